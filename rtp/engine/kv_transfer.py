"""A request's KV cache, out of one node's blocks and into another's.

On the wire a layer's KV is token-major: [lead, num_tokens, *trail] in the cache's
dtype (lead 2 for K and V, 1 for MLA's latent; trail the per-token heads and dims),
so it does not depend on either node's block size. Gathering on the prefill node
and scattering on the decode node through each node's own block ids is the layout
conversion: nodes with different block sizes exchange KV without either knowing
the other's.

The prefill node gathers a layer as soon as that layer's attention has written it
(`LayerTaps`, a forward hook per attention layer), so the transfer of layer l
proceeds while layers l+1.. still compute, instead of after the whole forward; a
step that replays a graph (no Python between layers) hands every layer over once
the replay is done.
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import partial
from typing import Protocol

import msgspec
import numpy as np
import torch

class KVLayout(msgspec.Struct, frozen=True):
    """What this engine's KV cache looks like, block size aside. The server turns it into the
    wire's KVLayout (rtp/wire/kv_layout.py), which both ends of a transfer compare."""

    dtype: str
    layers: list[list[int]]  # per layer: [lead, *trail] (the cache's shape without blocks and block size)


def layout_of(kv_caches: list[torch.Tensor]) -> KVLayout:
    """Each cache is [lead, num_blocks, block_size, *trail] (rtp/engine/kv_cache.py)."""
    return KVLayout(str(kv_caches[0].dtype).removeprefix("torch."),
                    [[c.shape[0], *c.shape[3:]] for c in kv_caches])


def token_slots(blocks: np.ndarray, block_size: int, num_tokens: int) -> torch.Tensor:
    """The cache slot (block * block_size + offset) of each of the first num_tokens tokens."""
    pos = np.arange(num_tokens, dtype=np.int64)
    return torch.from_numpy(np.asarray(blocks, dtype=np.int64)[pos // block_size] * block_size + pos % block_size)


def gather(cache: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """The KV of the tokens at `slots`, token-major and contiguous: [lead, len(slots), *trail]."""
    return cache.flatten(1, 2).index_select(1, slots.to(cache.device))


_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def raw_view(t: torch.Tensor) -> np.ndarray:
    """A CPU tensor's memory as a numpy array of an integer type of the same item size (numpy has
    no bfloat16): the bytes as they are, without a copy."""
    return t.view(_SAME_SIZE_INT[t.element_size()]).numpy()


def scatter(cache: torch.Tensor, slots: torch.Tensor, kv: torch.Tensor | bytes | bytearray | memoryview) -> None:
    """Write token-major KV [lead, len(slots), *trail] (a tensor, or its raw bytes as they came
    off the wire) into the cache at `slots`.

    On a CPU it copies with numpy: a torch op could open an OpenMP region, and an OpenMP pool
    of a thread other than the engine's slows every engine step (rtp/server/async_engine.py,
    AsyncEngine.load)."""
    shape = (cache.shape[0], len(slots), *cache.shape[3:])
    raw = isinstance(kv, (bytes, bytearray, memoryview))
    if cache.device.type == "cpu":
        flat = raw_view(cache.flatten(1, 2))
        data = np.frombuffer(kv, dtype=flat.dtype) if raw else raw_view(kv.contiguous())
        data = data.reshape(shape)
        n, bs = len(slots), cache.shape[2]
        full = n // bs
        s = slots.numpy()
        if full and (s[: full * bs].reshape(full, bs) - s[: full * bs: bs, None] == np.arange(bs)).all():
            # whole blocks (the usual case): one row of block_size tokens per index, 1.5x faster
            by_block = raw_view(cache)
            by_block[:, s[: full * bs: bs] // bs] = data[:, : full * bs].reshape(shape[0], full, bs, *shape[2:])
            flat[:, s[full * bs:]] = data[:, full * bs:]
        else:
            flat[:, s] = data
        return
    if raw:
        kv = torch.frombuffer(kv, dtype=cache.dtype)
    cache.flatten(1, 2).index_copy_(1, slots.to(cache.device), kv.to(cache.device).view(shape))


class LayerTaps:
    """Hands each layer's KV of chosen requests to their sinks: layer by layer while an eager
    forward runs (a forward hook per attention layer), or all at once after a forward that runs
    no Python between layers (a CPU graph replay, a compiled graph).

    `arm(taps)` before a forward, `disarm()` after: a tap is (slots, sink) and the sink's
    `put_layer(layer, kv)` gets a copy (the blocks may be reused once the step ends; the copy
    is what crosses to the sending thread). The model runner owns the delivery: the hooks hand
    a layer over only inside `per_layer()` (its eager forward), and `complete()` after every
    forward hands over each layer not yet handed over -- so every sink gets every layer once,
    whichever path ran the step (decode-only graph replay, eager, mixed), and a compiled graph
    never runs a hook that would hand over a layer. The hooks cost one attribute test per layer
    otherwise."""

    def __init__(self, layers: list[torch.nn.Module], kv_caches: list[torch.Tensor]):
        self.kv_caches = kv_caches
        self.taps: list[tuple[torch.Tensor, KVSink]] = []
        self.live = False  # True only inside per_layer(): the hooks hand layers over
        self.sent = [False] * len(kv_caches)  # per layer, this step: handed over already
        self.handles = [layer.register_forward_hook(partial(self._done, i)) for i, layer in enumerate(layers)]

    @property
    def armed(self) -> bool:
        return bool(self.taps)

    def arm(self, taps: list[tuple[torch.Tensor, KVSink]]) -> None:
        self.taps = taps
        self.sent = [False] * len(self.kv_caches)

    def disarm(self) -> None:
        self.taps = []
        self.live = False

    @contextmanager
    def per_layer(self):
        """Hand each layer over as the forward run inside finishes it (the transfer of layer l
        overlaps the compute of l+1..). Only for a forward whose earlier parts of the step, if
        any, already wrote every layer of the rows they computed."""
        self.live = True
        try:
            yield
        finally:
            self.live = False

    def complete(self) -> None:
        """After the step's forward: hand over every layer no hook handed over (all of them
        after a graph replay); every layer's KV is in the cache by now."""
        for layer, sent in enumerate(self.sent):
            if not sent:
                self._put(layer)

    def _done(self, layer: int, module, args, output) -> None:
        if self.live and self.taps:
            self._put(layer)

    def _put(self, layer: int) -> None:
        self.sent[layer] = True
        cache = self.kv_caches[layer]
        for slots, sink in self.taps:
            kv = gather(cache, slots)
            # the sender reads host memory; on CUDA this copy waits for the layer (a side stream
            # and an event per layer would let it overlap, not done yet)
            sink.put_layer(layer, kv if kv.device.type == "cpu" else kv.cpu())


class KVSink(Protocol):
    """Where a prefill-only request's KV and first token go (the serving side implements it);
    both methods are called on the engine thread and must not block."""

    def put_layer(self, layer: int, kv: torch.Tensor) -> None: ...

    def finish(self, token: int, logprobs: dict[int, float] | None, num_cached_tokens: int) -> None: ...
