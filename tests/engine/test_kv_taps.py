"""A prefill-only request's KV reaches its sink whatever path runs its last step.

The step that computes a prefill-only request's last prompt chunk hands every layer's KV to
the request's sink (kv_transfer.LayerTaps). A last chunk of one token -- a one-token prompt,
or a prompt found in the prefix cache but for its last token -- is a prompt chunk of one row
(prefill attention, as every prompt token takes: docs/determinism.md), so that step may be
replayed from the step graph, which runs no Python between layers: the runner then hands the
layers over after the replay. One engine in the default dtype (bf16 here, with CPU graphs
where rtp's kernels run), shared by the module.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rtp.config import EngineConfig
from rtp.engine.engine import LLMEngine
from rtp.engine.kv_transfer import gather
from rtp.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=4)
CACHED = list(range(300, 333))  # 33 tokens: two full blocks of 16 cached, one token left to compute


class Sink:
    def __init__(self):
        self.layers: dict[int, torch.Tensor] = {}
        self.first: tuple[int, int] | None = None

    def put_layer(self, layer: int, kv: torch.Tensor) -> None:
        assert layer not in self.layers, f"layer {layer} handed over twice"
        self.layers[layer] = kv.clone()

    def finish(self, token: int, logprobs, num_cached_tokens: int) -> None:
        self.first = (token, num_cached_tokens)


@pytest.fixture(scope="module")
def engine(default_gguf):
    return LLMEngine(EngineConfig.from_flat(model=str(default_gguf), compile=False, max_model_len=512,
                                            max_num_seqs=8))


def _prefill(engine: LLMEngine, request_id: str, prompt: list[int], others=()):
    """Run prompt as a prefill-only request (with `others`, plain requests, added in the same step);
    returns its sink, the KV the cache held at its slots right after its last step, and the
    (decode rows, rows) of that step."""
    sink = Sink()
    engine.add_request(request_id, prompt, GREEDY, kv_sink=sink)
    for i, other in enumerate(others):
        engine.add_request(f"{request_id}-other-{i}", other, GREEDY)
    caches = engine.runner.kv_caches
    seen = {}
    arm = engine.handoff._taps.arm

    def recording_arm(taps):
        seen["slots"] = [slots for slots, s in taps if s is sink]
        arm(taps)

    engine.handoff._taps.arm = recording_arm
    try:
        while sink.first is None:
            engine.step()
            assert engine.has_unfinished_requests() or sink.first is not None
        plan = engine.scheduler.plan
        shape = (plan.num_decode_rows, plan.num_rows)
        (slots,) = seen["slots"]
        held = [gather(cache, slots) for cache in caches]
    finally:
        del engine.handoff._taps.arm
    while engine.has_unfinished_requests():
        engine.step()
    return sink, held, shape


def _check_all_layers(engine: LLMEngine, sink: Sink, held, prompt_len: int) -> None:
    layout = engine.kv_layout()
    assert sorted(sink.layers) == list(range(len(layout.layers)))
    for layer, kv in sink.layers.items():
        assert kv.shape[1] == prompt_len
        assert torch.equal(kv, held[layer]), layer  # what the step wrote, not stale blocks


def test_a_one_token_prompt_replayed_from_a_cpu_graph_hands_over_every_layer(engine):
    runner = engine.runner
    _prefill(engine, "warm", [6004])  # installs the taps
    if not runner.cpu_graphs and runner.exact_graph is None:
        pytest.skip("no CPU graphs here: rtp's CPU kernels are not available")
    before = runner.graph_steps
    sink, held, shape = _prefill(engine, "one-token-graph", [6004])
    assert runner.graph_steps > before and shape == (0, 1)
    _check_all_layers(engine, sink, held, 1)
    # and a prompt cached but for its last token
    _prefill(engine, "cached-first", CACHED)
    before = runner.graph_steps
    sink, held, shape = _prefill(engine, "cached-graph", CACHED)
    assert sink.first[1] == 32 and shape == (0, 1) and runner.graph_steps > before
    _check_all_layers(engine, sink, held, len(CACHED))


def test_the_same_steps_run_eagerly_hand_over_the_same_kv(engine):
    runner = engine.runner
    graphs = runner.cpu_graphs or runner.exact_graph is not None
    with runner.eager():
        before = runner.graph_steps
        sink, held, shape = _prefill(engine, "one-token-eager", [6004])
        cached, cached_held, cached_shape = _prefill(engine, "cached-eager", CACHED)
        assert runner.graph_steps == before and shape == cached_shape == (0, 1)
    _check_all_layers(engine, sink, held, 1)
    _check_all_layers(engine, cached, cached_held, len(CACHED))
    if graphs:  # the replay runs the eager step's own kernels: the same bytes
        replayed, _, _ = _prefill(engine, "one-token-graph-again", [6004])
        for layer in sink.layers:
            assert torch.equal(replayed.layers[layer], sink.layers[layer]), layer


def test_a_one_token_last_chunk_in_a_mixed_step_hands_over_every_layer(engine):
    long = list(np.arange(1000, 1100).tolist())  # a prefill chunk in the same step
    sink, held, shape = _prefill(engine, "one-token-mixed", [6004], others=[long])
    assert shape == (0, 2)
    _check_all_layers(engine, sink, held, 1)
    # and the tapped request is the prefill chunk, beside a one-token prompt of another request
    sink, held, shape = _prefill(engine, "long-mixed", list(range(2000, 2040)), others=[[6005]])
    assert shape == (0, 2)
    _check_all_layers(engine, sink, held, 40)
    assert not engine.has_unfinished_requests() and engine.allocator.num_used == 0
