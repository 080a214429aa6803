"""CPU graphs (rtp/kernels/cpu_graph.py): captured kernel calls replay what the eager run computes."""

import random

import pytest
import torch
from test_cpu_kernels import random_blocks

from rtp.kernels import cpu_kernels, quant
from rtp.kernels.cpu_graph import CaptureRefused, _place, capture

pytestmark = pytest.mark.skipif(not cpu_kernels.tiles_available(), reason="needs a CPU with AVX-512 BF16")


class TinyMLP:
    """Two quantized linears around the fused activation, on static input and output buffers."""

    def __init__(self, rows: int):
        self.up = random_blocks("q4_1", 128, 64, seed=1)
        self.down = random_blocks("q4_1", 64, 64, seed=2)
        self.x = torch.zeros(rows, 64, dtype=torch.bfloat16)

    def __call__(self) -> torch.Tensor:
        h = self.up.linear(self.x, None, torch.bfloat16)
        return self.down.linear(cpu_kernels.silu_mul(h), None, torch.float32)


@pytest.mark.parametrize("rows", [1, 6])
def test_replay_computes_what_eager_does_on_new_inputs(rows):
    mlp = TinyMLP(rows)
    graph = capture(mlp, rows)
    assert len(graph.calls) == 3
    for seed in range(3):
        mlp.x.copy_(torch.randn(rows, 64, generator=torch.Generator().manual_seed(seed)))
        want = mlp()
        assert torch.equal(graph.replay(rows), want)
        assert graph.replay(rows).data_ptr() == graph.output.data_ptr()  # one output, every time


def test_replay_over_fewer_rows():
    mlp = TinyMLP(6)
    graph = capture(mlp, 6)
    mlp.x.copy_(torch.randn(6, 64))
    want = mlp()
    for rows in (1, 3, 6):
        assert torch.equal(graph.replay(rows), want[:rows])
    with pytest.raises(ValueError):
        graph.replay(7)



def test_profile_times_each_call_of_a_replay():
    mlp = TinyMLP(6)
    graph = capture(mlp, 6)
    mlp.x.copy_(torch.randn(6, 64))
    want = mlp()
    times = graph.profile(4)
    assert times.shape == (len(graph.calls),) and times.dtype.name == "int64" and (times > 0).all()
    assert torch.equal(graph.output[:4], want[:4])  # a profiled replay computes what a replay does
    assert [cpu_kernels.op_name(int(c[0])) for c in graph.calls] == ["linear_q4_1", "silu_mul", "linear_q4_1"]
    with pytest.raises(ValueError):
        graph.profile(7)
    with pytest.raises(ValueError, match="one per call"):
        cpu_kernels.run_calls(graph.calls, 4, times[:1].copy())

def test_intermediates_share_an_arena():
    """Buffers whose lifetimes do not overlap share memory: the arena of a chain of layers is
    far smaller than the sum of their outputs."""
    layers = [random_blocks("q4_1", 64, 64, seed=s) for s in range(8)]
    x = torch.randn(4, 64).bfloat16()

    def chain():
        h = x
        for w in layers:
            h = w.linear(h, None, torch.bfloat16)
        return w.linear(h, None, torch.float32)

    graph = capture(chain, 4)
    assert graph.arena.numel() <= 3 * 4 * 64 * 2 + 64 * 2
    assert torch.equal(graph.replay(4), chain())


def test_capture_refuses_torch_ops_and_stops_recording():
    mlp = TinyMLP(2)
    with pytest.raises(CaptureRefused, match="add"):
        capture(lambda: mlp() + 1, 2)
    assert len(capture(mlp, 2).calls) == 3  # recording was stopped and starts again


def test_place_never_overlaps_live_blocks():
    rng = random.Random(0)
    for _ in range(50):
        blocks = []
        for _ in range(rng.randint(1, 30)):
            lo = rng.randint(0, 40)
            blocks.append((64 * rng.randint(1, 8), lo, lo + rng.randint(0, 10)))
        offsets = _place(blocks)
        for i, (si, li, hi) in enumerate(blocks):
            for j, (sj, lj, hj) in enumerate(blocks[:i]):
                if li <= hj and lj <= hi:  # live at once
                    assert offsets[i] + si <= offsets[j] or offsets[j] + sj <= offsets[i]


def test_a_step_graph_samples_one_row_on_the_one_row_kernels():
    """--no-deterministic: a step graph captured with one_sample replays a step of one sampling row on
    the one-row kernels (the exact weights), as an eager step of one sample runs, and several rows on the
    tile kernels; captured without it, one row would take the tile kernels and give other logits.
    Deterministic (the default), one row takes the tile kernels either way: the logits of a sample are
    the same bits whichever graph replays it."""
    with quant.determinism(False):
        _step_graph_samples(deterministic=False)
    _step_graph_samples(deterministic=True)


def _step_graph_samples(deterministic: bool) -> None:
    body = random_blocks("q4_1", 64, 64, seed=3)
    head = random_blocks("q8_0", 96, 64, seed=4).with_tile_layout()
    x = torch.zeros(8, 64, dtype=torch.bfloat16)
    index = torch.zeros(4, dtype=torch.int32)

    def logits(idx):
        return lambda hidden: head.linear(cpu_kernels.gather_rows(hidden, idx), None, torch.float32)

    both = capture(lambda: body.linear(x, None, torch.bfloat16), 8, samples=logits(index),
                   one_sample=logits(index[:1]))
    several = capture(lambda: body.linear(x, None, torch.bfloat16), 8, samples=logits(index))
    x.copy_(torch.randn(8, 64, generator=torch.Generator().manual_seed(5)))
    index.copy_(torch.tensor([5, 1, 7, 2], dtype=torch.int32))
    hidden = body.linear(x, None, torch.bfloat16)
    for samples in (1, 2, 4):
        want = head.linear(hidden[index[:samples].long()], None, torch.float32)
        assert torch.equal(both.replay_step(8, samples, 0, 1), want), samples
    assert torch.equal(several.replay_step(8, 4, 0, 1), head.linear(hidden[index.long()], None, torch.float32))
    one = head.linear(hidden[index[:1].long()], None, torch.float32)
    # without determinism the tile kernels' bf16 weights differ from the one-row kernel's exact ones
    assert torch.equal(several.replay_step(8, 1, 0, 1), one) == deterministic
    assert torch.allclose(several.replay_step(8, 1, 0, 1), one, atol=0.05, rtol=0.02)


def test_a_dry_capture_records_the_same_calls_and_replays_exactly():
    """A dry capture runs each kernel over 2 rows only, but records every call over all its rows: its
    replays compute what the eager forward computes, as a full capture's do."""
    mlp = TinyMLP(6)
    full = capture(mlp, 6)
    dry = capture(mlp, 6, dry=True)
    rows = [cpu_kernels.rows_word(int(c[0])) for c in full.calls]
    assert [int(c[w]) for c, w in zip(dry.calls, rows)] == [int(c[w]) for c, w in zip(full.calls, rows)] == [6] * 3
    assert dry.signature() == full.signature()
    for seed in range(2):
        mlp.x.copy_(torch.randn(6, 64, generator=torch.Generator().manual_seed(seed)))
        want = mlp()
        assert torch.equal(dry.replay(6), want) and torch.equal(full.replay(6), want)
