"""The model runner: static step buffers, the KV cache, and one forward per step.

Every tensor a step reads is allocated once here. The runtime's StepPlan writes
straight into their numpy views (on CPU the same memory; on CUDA a pinned
staging copy that is sent with non-blocking copies), so building a step costs
no allocation and no host sync.

With compile on, the decode rows of a step (one query token each, batch <= 64)
run through `torch.compile`d graphs, one per batch bucket {1, 2, 4, ..., 64}:
the rows are copied into the bucket's static buffers and padded (padding points
at the null block). On CPU the graphs are Inductor C++ kernels with weights
frozen as constants; the block-table width is a dynamic dimension, so one graph
per bucket serves every context length. On CUDA, mode="reduce-overhead" captures
CUDA graphs and the width is the full (static) max_model_len. Prefill chunks run
eagerly (their shapes vary too much to capture).

With compile off on a CPU with rtp's kernels (the default there), decode-only steps
replay CPU graphs instead (rtp/kernels/cpu_graph.py): the step's kernel calls,
captured at warm-up over the plan's own input buffers, run from C with no Python
between them; one graph serves every batch size whose calls agree (with AMX: one
row, and 2-64 rows). Steps that mix decode rows with a prefill chunk run eagerly
as one forward, so the weights are read once.

On a node that prefills for others, `taps` (kv_transfer.LayerTaps, armed by the engine
for the step that computes a prefill-only request's last chunk) must see the step
whatever path runs it: a one-token last chunk is a prompt row of one token, and its step
may be replayed from the step graph. forward() hands the taps every layer: layer by layer during its eager forward,
the rest (all of them after a replay) once the forward is done.
"""

from __future__ import annotations

import logging
import os
import time
from contextlib import contextmanager, nullcontext

import numpy as np
import torch

from rtp.distributed import world_size
from rtp.engine.kv_cache import allocate_kv_cache, allocate_kv_scales
from rtp.engine.kv_transfer import LayerTaps
from rtp.kernels import cpu_kernels, quant
from rtp.kernels.cpu_graph import CaptureRefused, CPUGraph, capture
from rtp.models.attention import AttentionMetadata, PlanRows, PrefillRow, forward_context
from rtp.runtime import StepPlan, plan_array_shapes

log = logging.getLogger("rtp.runner")

BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    """The torch dtype of a numpy one (the plan's arrays are declared in numpy terms)."""
    return torch.from_numpy(np.empty(0, dtype=dtype)).dtype


class ModelRunner:
    def __init__(self, model: torch.nn.Module, *, num_blocks: int, block_size: int, max_num_seqs: int,
                 max_num_batched_tokens: int, max_model_len: int, kv_dtype: torch.dtype,
                 device: torch.device, compile: bool = False, committed_blocks: int | None = None,
                 max_draft_tokens: int = 0):
        self.model = model
        self.device = device
        self.block_size = block_size
        width = -(-max_model_len // block_size)
        self.width = width
        pin = device.type == "cuda"
        # the StepPlan's arrays (PLAN_ARRAYS, rtp/runtime/step_plan.pyx) as tensors it writes through
        shapes = plan_array_shapes(max_num_batched_tokens, max_num_seqs, width)
        self.host = {name: torch.zeros(shape, dtype=_torch_dtype(dtype), pin_memory=pin)
                     for name, (shape, dtype) in shapes.items()}
        self.plan = StepPlan(max_num_batched_tokens, max_num_seqs, width,
                             **{name: t.numpy() for name, t in self.host.items()})
        # on CPU the device tensors are the host tensors; on CUDA they are copies made each step
        self.dev = self.host if device.type == "cpu" else {
            name: torch.zeros_like(t, device=device) for name, t in self.host.items()}
        layers = model.attention_layers()
        # num_blocks: the pool's capacity; committed_blocks: its blocks as built (see allocate_kv_cache)
        specs = [layer.kv_cache_spec for layer in layers]
        self.kv_caches = allocate_kv_cache(specs, num_blocks, block_size, kv_dtype, device, committed=committed_blocks)
        # int8 caches: their per-token scales, by the same block ids (rtp/engine/kv_cache.py); else none
        self.kv_scales = (allocate_kv_scales(specs, num_blocks, block_size, device, committed=committed_blocks)
                          if kv_dtype == torch.int8 else [])
        self.kv_tensors = self.kv_caches + self.kv_scales  # every tensor indexed by block id (EPLB lends blocks)
        for i, (layer, cache) in enumerate(zip(layers, self.kv_caches)):
            layer.kv_cache = cache
            if hasattr(layer, "kv_scales"):  # layers that take int8 caches (PagedAttention)
                layer.kv_scales = self.kv_scales[i] if self.kv_scales else None
        self.graphs: dict[int, _DecodeBucket] = {}
        self._compiled = None
        self.compiled_steps = 0  # steps whose decode rows ran through a captured graph
        if compile:
            self._setup_compile(max_num_seqs)
        # CPU graphs (rtp/kernels/cpu_graph.py), captured in warmup(): decode steps of several requests,
        # (lowest rows, most rows, graph); and the decode step of one request, its last token and up
        # to max_draft_tokens drafted ones, on the exact one-row kernels
        self.cpu_graphs: list[tuple[int, int, CPUGraph]] = []
        self.exact_graph: CPUGraph | None = None
        self.max_draft_tokens = max_draft_tokens
        self._max_num_seqs = max_num_seqs
        # (not with tensor or expert parallelism: a collective is not a kernel call a graph can replay)
        self._want_cpu_graphs = (device.type == "cpu" and not compile and cpu_kernels.available()
                                 and world_size() == 1 and os.environ.get("RTP_CPU_GRAPHS", "1") != "0")
        self.graph_steps = 0  # steps replayed from a CPU graph
        # the step graph: any step, prompt chunks and decode rows alike (captured in warmup())
        self.step_graph: CPUGraph | None = None
        self.taps: LayerTaps | None = None  # set by the engine on a node that prefills for others

    # -- compiled decode -------------------------------------------------------------------

    def _setup_compile(self, max_num_seqs: int) -> None:
        import torch._dynamo
        import torch._inductor.config as inductor_config

        # one cache entry per bucket: well past dynamo's default limit
        for knob in ("recompile_limit", "cache_size_limit"):
            if hasattr(torch._dynamo.config, knob):
                setattr(torch._dynamo.config, knob, max(64, getattr(torch._dynamo.config, knob)))
        # The batch size of each bucket stays static: left on, "automatic dynamic" would turn
        # it symbolic as soon as a second bucket runs and serve every bucket from one slower
        # generic graph. Only the block-table width is dynamic, marked where it is passed.
        torch._dynamo.config.automatic_dynamic_shapes = False
        top = next((b for b in BUCKETS if b >= max_num_seqs), BUCKETS[-1])
        sizes = [b for b in BUCKETS if b <= top]
        for b in sizes:
            self.graphs[b] = _DecodeBucket(b, self.width, self.device)
        if self.device.type == "cpu":
            # Weights are graph inputs, not frozen constants: with freezing (weights prepacked for
            # oneDNN) Inductor's cache refuses the graphs and every start recompiles for minutes.
            inductor_config.freezing = os.environ.get("RTP_FREEZE") == "1"
            self._compiled = torch.compile(self._decode_logits, fullgraph=True)
        else:
            self._compiled = torch.compile(self._decode_logits, fullgraph=True, mode="reduce-overhead")

    def _decode_logits(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.model.compute_logits(self.model(input_ids, positions))

    def warmup(self, progress: bool = True) -> float:
        """Compile every decode bucket now (before serving), or capture the CPU graphs; returns
        the seconds it took."""
        if self._want_cpu_graphs:
            return self._capture_cpu_graphs()
        if not self._compiled:
            return 0.0
        start = time.perf_counter()
        bar = None
        if progress:
            from tqdm import tqdm

            bar = tqdm(total=len(self.graphs), desc="compiling decode graphs", unit="bucket")
        for b, g in self.graphs.items():
            g.zero()
            self._run_bucket(g, 2)
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        seconds = time.perf_counter() - start
        log.info("compiled %d decode buckets (%s) in %.1f s", len(self.graphs), ",".join(map(str, self.graphs)), seconds)
        return seconds

    # -- CPU graphs ------------------------------------------------------------------------

    @torch.inference_mode()
    def _capture_cpu_graphs(self) -> float:
        """Capture the decode step of one request (1 + max_draft_tokens rows, the exact one-row
        kernels) and at each bucket size from 2 rows (several requests), over the plan's own input
        buffers (a decode-only step's rows are its first tokens); bucket sizes whose calls agree
        share the largest one's graph; then the step graph (every other step)."""
        start = time.perf_counter()
        top = min(self._max_num_seqs, BUCKETS[-1])
        sizes = sorted({b for b in BUCKETS if 1 < b < top} | ({top} if top > 1 else set()))
        names = ("input_ids", "positions", "slot_mapping", "seq_lens", "block_tables")
        saved = {name: self.host[name].clone() for name in names}
        for name in names:  # rows of nothing: the null block's slot, no context to attend to
            self.host[name].zero_()
        graphs: list[tuple[int, int, CPUGraph | None]] = []
        refused: dict[int, str] = {}  # rows -> why no graph
        try:
            one = min(1 + self.max_draft_tokens, self._max_num_seqs)
            try:
                with quant.exact_rows(one):
                    self.exact_graph = self._capture_decode(one)
            except CaptureRefused as e:
                refused[1] = str(e)
            for size in sizes:
                lo = graphs[-1][1] + 1 if graphs else 2
                try:
                    graph = self._capture_decode(size)
                except CaptureRefused as e:
                    refused[size] = str(e)
                    graphs.append((lo, size, None))
                    continue
                last = graphs[-1][2] if graphs else None
                if last is not None and last.signature() == graph.signature():
                    lo = graphs.pop()[0]
                graphs.append((lo, size, graph))
        finally:
            for name in names:
                self.host[name].copy_(saved[name])
        self.cpu_graphs = [g for g in graphs if g[2] is not None]
        self.step_graph = self._capture_step_graph()
        seconds = time.perf_counter() - start
        if self.exact_graph is None and not self.cpu_graphs and len(set(refused.values())) == 1:
            log.info("no CPU graphs (%s): decode steps run eagerly", next(iter(refused.values())))  # e.g. fp32
            return seconds
        for size, why in refused.items():
            log.info("no CPU graph for %s decode steps (%s): they run eagerly",
                     "one request's" if size == 1 else f"{size}-row", why)
        ranges = ([f"one request ({self.exact_graph.rows} rows)"] if self.exact_graph is not None else [])
        ranges += [f"{lo}-{hi} rows" if lo < hi else f"{hi} rows" for lo, hi, _ in self.cpu_graphs]
        log.info("captured CPU graphs for decode steps of %s%s in %.2f s", ", ".join(ranges),
                 ", and one for every other step" if self.step_graph is not None else "", seconds)
        return seconds

    def _capture_decode(self, size: int) -> CPUGraph:
        meta = AttentionMetadata(slot_mapping=self.host["slot_mapping"][:size], block_size=self.block_size,
                                 num_decode=size, decode_block_tables=self.host["block_tables"][:size],
                                 decode_seq_lens=self.host["seq_lens"][:size])
        ids, pos = self.host["input_ids"][:size], self.host["positions"][:size]
        with forward_context(meta):
            return capture(lambda: self._decode_logits(ids, pos), size)

    @torch.inference_mode()
    def _capture_step_graph(self) -> CPUGraph | None:
        """Capture one step of every kind at once: the plan's whole token budget, one decode row and one
        prompt chunk (of no length: the buffers hold zeros, nothing is attended to), the sampling rows
        gathered by the plan's logits_indices. A replay patches each call's rows -- tokens, samples,
        decode and prefill rows -- to the step at hand, so mixed steps, prefill chunks and decode
        batches without a graph of their own all run from C (None, with the reason logged, when the
        forward leaves rtp's kernels: the steps then run eagerly)."""
        names = ("input_ids", "positions", "slot_mapping", "seq_lens", "block_tables", "query_start_loc",
                 "logits_indices")
        tokens = self.host["input_ids"].shape[0]
        samples = min(self._max_num_seqs, tokens)
        if tokens < 2 or self.host["seq_lens"].shape[0] < 2:
            return None
        saved = {name: self.host[name].clone() for name in names}
        for name in names:
            self.host[name].zero_()
        try:
            tables = self.host["block_tables"]
            meta = AttentionMetadata(slot_mapping=self.host["slot_mapping"][:tokens], block_size=self.block_size,
                                     num_decode=1, decode_block_tables=tables[:1],
                                     decode_seq_lens=self.host["seq_lens"][:1],
                                     prefill=[PrefillRow(1, tokens, 0, tables[1, :0])],
                                     plan=PlanRows(self.host["query_start_loc"], self.host["seq_lens"], tables))
            ids, pos = self.host["input_ids"][:tokens], self.host["positions"][:tokens]
            rows = self.host["logits_indices"][:samples]

            def logits(index: torch.Tensor):
                return lambda hidden: self.model.compute_logits(cpu_kernels.gather_rows(hidden, index))

            with forward_context(meta):
                # one sampling row takes the one-row kernels in an eager step: captured apart; dry: the
                # forward over the whole token budget would take 1.5-2 s of every start for nothing
                return capture(lambda: self.model(ids, pos), tokens, samples=logits(rows), one_sample=logits(rows[:1]),
                               dry=True)
        except (CaptureRefused, ValueError) as e:
            log.info("no CPU graph for prefill and mixed steps (%s): they run eagerly", e)
            return None
        finally:
            for name in names:
                self.host[name].copy_(saved[name])

    def cpu_graph(self, rows: int, single: bool = False) -> CPUGraph | None:
        """The captured CPU graph that replays decode steps of `rows` rows (single: all of one
        request's; one row always is), if there is one."""
        if single or rows == 1:
            g = self.exact_graph
            return g if g is not None and rows <= g.rows else None
        for lo, hi, graph in self.cpu_graphs:
            if lo <= rows <= hi:
                return graph
        return None

    @contextmanager
    def eager(self):
        """Within: every step runs eagerly, no CPU graph replayed (to compare the two)."""
        saved = self.cpu_graphs, self.exact_graph, self.step_graph
        self.cpu_graphs, self.exact_graph, self.step_graph = [], None, None
        try:
            yield
        finally:
            self.cpu_graphs, self.exact_graph, self.step_graph = saved

    def _single_request(self) -> bool:
        """Whether every sampling row of the planned step is one request's (its drafts verified)."""
        p = self.plan
        ns = p.num_samples
        return ns > 0 and p.sample_slots[0] == p.sample_slots[ns - 1]

    @torch.inference_mode()
    def _run_bucket(self, g: "_DecodeBucket", width: int) -> torch.Tensor:
        if self.device.type != "cpu":
            width = self.width  # static shapes for CUDA graphs
        tables = g.block_tables[:, :width]
        if self.device.type == "cpu":
            torch._dynamo.mark_dynamic(tables, 1)
        meta = AttentionMetadata(slot_mapping=g.slot_mapping, block_size=self.block_size, num_decode=g.size,
                                 decode_block_tables=tables, decode_seq_lens=g.seq_lens)
        with forward_context(meta):
            return self._compiled(g.input_ids, g.positions)

    def _forward_compiled(self, taps: LayerTaps | None = None) -> torch.Tensor:
        p = self.plan
        nd, nr, ns = p.num_decode_rows, p.num_rows, p.num_samples
        g = self.graphs[next(b for b in self.graphs if b >= nd)]
        width = max(2, self._decode_width())  # 2: a size-1 dim would specialise
        g.fill(p, nd, width)
        logits = self._run_bucket(g, width)
        self.compiled_steps += 1
        indices = p.logits_indices[:ns]
        n_dec = int(np.searchsorted(indices, nd))  # decode rows sample first; token index == row index
        parts = [logits[torch.from_numpy(indices[:n_dec].astype(np.int64)).to(self.device)]]
        if nr > nd:
            parts.append(self._forward_eager(first_token=nd, first_sample=n_dec, taps=taps))
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _to_device(self, name: str, n: int | tuple[int, int]) -> torch.Tensor:
        host = self.host[name]
        part = host[:n] if isinstance(n, int) else host[: n[0], : n[1]]
        if self.dev is self.host:
            return part
        dev = self.dev[name]
        dpart = dev[:n] if isinstance(n, int) else dev[: n[0], : n[1]]
        dpart.copy_(part, non_blocking=True)
        return dpart

    def _decode_width(self) -> int:
        """Block-table columns the step's longest decode row uses."""
        p = self.plan
        return -(-int(p.seq_lens[: p.num_decode_rows].max()) // self.block_size)

    def metadata(self, first_token: int = 0) -> AttentionMetadata:
        """Attention metadata of the plan's rows whose tokens start at first_token (0: all;
        the decode rows' count: only the prefill rows). Host-side numpy reads only."""
        p = self.plan
        bs = self.block_size
        nd, nr = p.num_decode_rows, p.num_rows
        seq_lens = p.seq_lens
        qsl = p.query_start_loc
        slots = self._to_device("slot_mapping", p.num_tokens)[first_token:]
        meta = AttentionMetadata(slot_mapping=slots, block_size=bs, num_decode=0 if first_token else nd)
        if not first_token and self.device.type == "cpu":  # the prefill kernel reads the plan's own arrays
            meta.plan = PlanRows(self.host["query_start_loc"], self.host["seq_lens"], self.host["block_tables"])
        if meta.num_decode:
            meta.decode_block_tables = self._to_device("block_tables", (nd, self._decode_width()))
            meta.decode_seq_lens = self._to_device("seq_lens", nd)
        if nr > nd:
            tables = self._to_device("block_tables", (nr, p.width))
            for r in range(nd, nr):
                length = int(seq_lens[r])
                meta.prefill.append(PrefillRow(int(qsl[r]) - first_token, int(qsl[r + 1]) - first_token,
                                               length, tables[r, : -(-length // bs)]))
        return meta

    @torch.inference_mode()
    def forward(self) -> torch.Tensor:
        """Run the planned step; logits [num_samples, vocab] in fp32 for the sampling rows."""
        taps = self.taps if self.taps is not None and self.taps.armed else None
        logits = self._forward(taps)
        if taps is not None:
            taps.complete()
        return logits

    def _forward(self, taps: LayerTaps | None) -> torch.Tensor:
        p = self.plan
        nd = p.num_decode_rows
        decode_only = 0 < nd == p.num_rows == p.num_samples
        single = decode_only and self._single_request()
        if decode_only:
            graph = self.cpu_graph(nd, single)
            if graph is not None:  # a decode-only step: row r is token r and sample r
                self.graph_steps += 1
                return graph.replay(nd)
            if single and self.device.type == "cpu" and self._compiled is None:
                # one request's rows: the one-row kernels' exact weights (compiled graphs keep their own choice)
                with quant.exact_rows(nd):
                    return self._forward_eager(taps=taps)
        if self.step_graph is not None and 0 < p.num_tokens <= self.step_graph.rows:
            self.graph_steps += 1
            return self.step_graph.replay_step(p.num_tokens, p.num_samples, nd, p.num_rows - nd)
        if self._compiled is not None and 0 < nd <= max(self.graphs):
            return self._forward_compiled(taps)
        return self._forward_eager(taps=taps)

    def _forward_eager(self, first_token: int = 0, first_sample: int = 0,
                       taps: LayerTaps | None = None) -> torch.Tensor:
        """Eager forward over the plan's tokens from first_token on; logits of its samples
        from first_sample on. With taps, each layer goes to them as it is done (rows before
        first_token were computed by a graph that already wrote every layer)."""
        p = self.plan
        n = p.num_tokens
        meta = self.metadata(first_token)
        input_ids = self._to_device("input_ids", n)[first_token:]
        positions = self._to_device("positions", n)[first_token:]
        with forward_context(meta), taps.per_layer() if taps is not None else nullcontext():
            hidden = self.model(input_ids, positions)
        rows = self._to_device("logits_indices", p.num_samples)[first_sample:]
        if first_token:
            rows = rows - first_token
        if cpu_kernels.available() and hidden.device.type == "cpu" and hidden.dim() == 2 and hidden.stride(1) == 1:
            return self.model.compute_logits(cpu_kernels.gather_rows(hidden, rows.contiguous()))
        return self.model.compute_logits(hidden[rows])

    def sample_req_ids(self) -> np.ndarray:
        return self.plan.sample_req_ids[: self.plan.num_samples]


class _DecodeBucket:
    """Static inputs of one decode graph: `size` rows, padded rows pointing at the null block."""

    def __init__(self, size: int, width: int, device: torch.device):
        self.size = size
        pin = device.type == "cuda"
        self.host = {
            "input_ids": torch.zeros(size, dtype=torch.int32, pin_memory=pin),
            "positions": torch.zeros(size, dtype=torch.int32, pin_memory=pin),
            "slot_mapping": torch.zeros(size, dtype=torch.int64, pin_memory=pin),
            "seq_lens": torch.zeros(size, dtype=torch.int32, pin_memory=pin),
            "block_tables": torch.zeros(size, width, dtype=torch.int32, pin_memory=pin),
        }
        self.np = {k: v.numpy() for k, v in self.host.items()}
        self.dev = self.host if device.type == "cpu" else {
            k: torch.zeros_like(v, device=device) for k, v in self.host.items()}
        self.input_ids = self.dev["input_ids"]
        self.positions = self.dev["positions"]
        self.slot_mapping = self.dev["slot_mapping"]
        self.seq_lens = self.dev["seq_lens"]
        self.block_tables = self.dev["block_tables"]

    def zero(self) -> None:
        for a in self.np.values():
            a[...] = 0

    def fill(self, plan: StepPlan, rows: int, width: int) -> None:
        """Copy the plan's first `rows` decode rows in; zero the padding rows."""
        for name in ("input_ids", "positions", "slot_mapping", "seq_lens"):
            dst = self.np[name]
            dst[:rows] = getattr(plan, name)[:rows]
            dst[rows:] = 0
        bt = self.np["block_tables"]
        bt[:rows, :width] = plan.block_tables[:rows, :width]
        bt[rows:, :width] = 0
        if self.dev is not self.host:
            for k, v in self.host.items():
                self.dev[k].copy_(v, non_blocking=True)
