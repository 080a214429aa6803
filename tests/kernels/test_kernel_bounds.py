"""rtp's C kernels write inside their outputs and nowhere else.

Every operand of a kernel call sits in memory of its own between random canary bytes, and
outputs are views of larger canary-filled buffers (a row stride past the width, rows a call
must leave alone): after the call, every byte it had no business writing must be as it was,
inputs included. A stray store lands in weights, KV blocks or another request's state in
production, and showed up in the tests only as a wrong answer many tests later (the RoPE
table, see tests/conftest.py). AddressSanitizer (tools/sanitize.sh) sees the kernels' plain
AVX-512 stores too, but not AMX tile stores; this check runs in every build, -O3 included,
and on the AMX paths where the CPU has them. Each case also replays its recorded call over
fewer rows (rtp/kernels/cpu_graph.py does), which must write only those rows.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
import torch

from rtp.kernels import cpu_kernels

pytestmark = pytest.mark.skipif(not cpu_kernels.tiles_available(), reason="needs a CPU with AVX-512 BF16")

PAD = 4096  # canary bytes before and after each operand
Mark = Callable[[torch.Tensor, int], torch.Tensor]  # (element mask, rows) -> the part a call may write


class Canaries:
    """Operands placed between canary bytes; check() fails on any byte written outside the
    parts marked writable (for a given row count)."""

    def __init__(self, seed: int = 0):
        self.gen = torch.Generator().manual_seed(seed)
        self.regions: list[dict] = []

    def place(self, name: str, value: torch.Tensor, view: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
              writes: Mark | None = None) -> torch.Tensor:
        """A copy of `value` (contiguous), 64-byte aligned, its last byte followed directly by
        canaries; returns view(copy). writes(mask, rows): the elements a call over `rows` rows
        may write, as a view of a bool mask shaped like value (None: an input, never written)."""
        value = value.contiguous()
        nbytes = value.numel() * value.element_size()
        raw = torch.randint(0, 256, (nbytes + 2 * PAD + 64,), dtype=torch.uint8, generator=self.gen)
        start = PAD + (-(raw.data_ptr() + PAD)) % 64
        body = raw[start:start + nbytes]
        body.copy_(value.reshape(-1).view(torch.uint8))
        self.regions.append(dict(name=name, raw=raw, before=raw.clone(), start=start, shape=value.shape,
                                 size=value.element_size(), writes=writes, mask=None))
        return view(body.view(value.dtype).view(value.shape))

    def allow(self, rows: int) -> None:
        """Mark what a call over `rows` rows may write."""
        for r in self.regions:
            mask = torch.zeros(r["raw"].numel(), dtype=torch.bool)
            if r["writes"] is not None:
                elements = torch.zeros(r["shape"], dtype=torch.bool)
                r["writes"](elements, rows).fill_(True)
                n = elements.numel() * r["size"]
                mask[r["start"]:r["start"] + n] = elements.reshape(-1).repeat_interleave(r["size"])
            r["mask"] = mask

    def check(self, what: str) -> None:
        for r in self.regions:
            bad = torch.nonzero((r["raw"] != r["before"]) & ~r["mask"]).flatten()
            if len(bad):
                offsets = (bad - r["start"]).tolist()
                body = r["size"] * int(np.prod(r["shape"]))
                where = ", ".join(f"{o}" + (" (before it)" if o < 0 else " (past its end)" if o >= body else "")
                                  for o in offsets[:6])
                pytest.fail(f"{what}: {len(bad)} bytes of {r['name']} {tuple(r['shape'])} written that it may "
                            f"not write, at byte offsets {where}{' ...' if len(bad) > 6 else ''}")

    def reset(self) -> None:
        """Every region back to how it was placed (outputs to canaries)."""
        for r in self.regions:
            r["raw"].copy_(r["before"])


def run_and_replay(arena: Canaries, call: Callable[[], None], rows: int, fewer: tuple[int, ...]) -> None:
    """call() (over `rows` rows) must write only what the arena allows; so must each replay of
    its recorded calls over fewer rows."""
    arena.allow(rows)
    cpu_kernels.record_start()
    try:
        call()
    finally:
        calls = np.frombuffer(cpu_kernels.record_stop(), dtype=np.int64).reshape(-1, cpu_kernels.CALL_WORDS).copy()
    arena.check(f"a call over {rows} rows")
    for r in fewer:
        arena.reset()
        arena.allow(r)
        cpu_kernels.run_calls(calls, r)
        arena.check(f"its replay over {r} of {rows} rows")


def first_rows(t: torch.Tensor, r: int) -> torch.Tensor:
    return t[:r]


def blocks(kind: str, n: int, k: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    d = torch.rand(n, k // 32, generator=g) * 0.02 + 0.001
    if kind == "q4_1":
        return torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g), d, torch.randn(n, k // 32,
                                                                                                     generator=g)
    return torch.randint(-128, 128, (n, k), dtype=torch.int8, generator=g), d, None


# ---- the linears over GGUF blocks -------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
# 5 and 6 rows: one pass, two weight rows a tile; an odd N leaves a tile of one
@pytest.mark.parametrize("m,n,k", [(1, 1, 32), (3, 5, 64), (5, 37, 160), (6, 9, 96), (9, 16, 544), (17, 7, 32)])
@pytest.mark.parametrize("out_bf16", [False, True])
def test_quantized_linears_write_only_their_outputs(kind, m, n, k, out_bf16):
    from rtp.kernels.quant import BlockQuantized

    qs, d, mn = blocks(kind, n, k)
    x_dtype = torch.bfloat16 if kind == "q4_1" else torch.float32
    x = torch.randn(m, k + 32).to(x_dtype)  # row stride past K
    bias = torch.randn(n)
    out_dtype = torch.bfloat16 if out_bf16 else torch.float32
    want = BlockQuantized(kind, qs, d, mn).linear(x[:, :k], bias, out_dtype)

    a = Canaries(1)
    xs = a.place("x", x, lambda t: t[:, :k])
    qs_, d_ = a.place("qs", qs), a.place("d", d)
    mn_ = a.place("m", mn) if mn is not None else None
    b_ = a.place("bias", bias)
    wide = n + 5  # out row stride past N: the columns between must stay
    out = a.place("out", torch.zeros(m, wide, dtype=out_dtype), lambda t: t[:, :n], lambda e, r: e[:r, :n])

    def call():
        if kind == "q4_1":
            cpu_kernels._k.linear_q4_1(xs.data_ptr(), xs.stride(0), qs_.data_ptr(), d_.data_ptr(), mn_.data_ptr(),
                                       b_.data_ptr(), out.data_ptr(), wide, out_bf16, m, n, k)
        else:
            cpu_kernels._k.linear_q8(xs.data_ptr(), xs.stride(0), qs_.data_ptr(), d_.data_ptr(), 0, 32, b_.data_ptr(),
                                       out.data_ptr(), wide, out_bf16, m, n, k)

    a.allow(m)
    call()
    a.check("the call")
    assert torch.equal(out, want)  # the call was made right: the bounds checked are the real ones
    a.reset()
    run_and_replay(a, call, m, tuple(sorted({1, max(1, m - 1)})))


@pytest.mark.parametrize("m,n,k", [(1, 1, 32), (3, 5, 64), (5, 37, 160), (6, 9, 96), (9, 16, 544)])
@pytest.mark.parametrize("x_fp32", [False, True])
@pytest.mark.parametrize("kind", ["q8_1", "q8_16"])
def test_small_int8_linear_writes_only_its_output(m, n, k, x_fp32, kind):
    g = torch.Generator().manual_seed(m * n + k)
    group, offset = (32, 0) if kind == "q8_1" else (16, 32)
    low, high = (0, 32) if kind == "q8_1" else (-32, 32)
    a = Canaries(9)
    xs = a.place("x", torch.randn(m, k + 32, generator=g).to(torch.float32 if x_fp32 else torch.bfloat16),
                 lambda t: t[:, :k])
    qs = a.place("qs", torch.randint(low, high, (n, k), dtype=torch.int8, generator=g))
    d = a.place("d", torch.rand(n, k // group, generator=g) * 0.02)
    mn = a.place("m", torch.randn(n, k // 32, generator=g) * 0.05) if kind == "q8_1" else None
    b_ = a.place("bias", torch.randn(n, generator=g))
    wide = n + 5
    out = a.place("out", torch.zeros(m, wide), lambda t: t[:, :n], lambda e, r: e[:r, :n])

    def call():
        cpu_kernels._k.linear_u8(xs.data_ptr(), xs.stride(0), x_fp32, qs.data_ptr(), d.data_ptr(),
                                 0 if mn is None else mn.data_ptr(), group, offset, b_.data_ptr(), out.data_ptr(),
                                 wide, False, m, n, k)

    run_and_replay(a, call, m, tuple(sorted({1, max(1, m - 1)})))


@pytest.mark.parametrize("m,n,k", [(1, 1, 32), (3, 5, 64), (5, 37, 160), (6, 9, 96), (9, 16, 544)])
@pytest.mark.parametrize("x_fp32", [False, True])
def test_dense_bf16_linear_writes_only_its_output(m, n, k, x_fp32):
    g = torch.Generator().manual_seed(m * n)
    a = Canaries(8)
    x = torch.randn(m, k + 32, generator=g).to(torch.float32 if x_fp32 else torch.bfloat16)
    xs = a.place("x", x, lambda t: t[:, :k])
    w = a.place("w", torch.randn(n, k + 16, generator=g).bfloat16(), lambda t: t[:, :k])  # row stride past K
    b_ = a.place("bias", torch.randn(n, generator=g))
    wide = n + 5
    out = a.place("out", torch.zeros(m, wide), lambda t: t[:, :n], lambda e, r: e[:r, :n])

    def call():
        cpu_kernels._k.linear_bf16(xs.data_ptr(), xs.stride(0), x_fp32, w.data_ptr(), w.stride(0), b_.data_ptr(),
                                   out.data_ptr(), wide, False, m, n, k)

    run_and_replay(a, call, m, tuple(sorted({1, max(1, m - 1)})))


@pytest.mark.parametrize("amx", [pytest.param(True, id="amx", marks=pytest.mark.skipif(
    not cpu_kernels.amx_available(), reason="needs a CPU with AMX-BF16")), pytest.param(False, id="avx512")])
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
@pytest.mark.parametrize("m", [1, 15, 17, 64, 65, 100, 300, 529])  # past 64 rows: the GEMM (amx_gemm.c)
@pytest.mark.parametrize("glu", [False, True])
@pytest.mark.parametrize("x_fp32", [False, True])
def test_tile_linear_writes_only_its_output(kind, m, glu, x_fp32, amx):
    """The AMX kernels store tiles with _tile_stored, which AddressSanitizer does not see; the AVX-512
    kernel writes only the rows and features it owns too."""
    from rtp.kernels.quant import BlockQuantized

    if glu and x_fp32:
        pytest.skip("glu takes bf16 rows")
    n, k = 64, 96
    w = BlockQuantized(kind, *blocks(kind, n, k)).with_tile_layout(glu)
    x = torch.randn(m, k + 32).to(torch.float32 if x_fp32 else torch.bfloat16)
    bias = torch.randn(n)
    cols = n // 2 if glu else n
    a = Canaries(2)
    xs = a.place("x", x, lambda t: t[:, :k])
    tiles = a.place("tiles", w.tiles)
    b_ = a.place("bias", bias)
    out = a.place("out", torch.zeros(m, cols + 8, dtype=torch.bfloat16), lambda t: t[:, :cols],
                  lambda e, r: e[:r, :cols])

    def call():
        cpu_kernels._k.linear_tiles(xs.data_ptr(), xs.stride(0), x_fp32, 0 if kind == "q4_1" else 1,
                                    tiles.data_ptr(), b_.data_ptr(), out.data_ptr(), cols + 8, True, m, n, k, glu,
                                    amx)

    run_and_replay(a, call, m, tuple(sorted({1, max(1, m - 1), max(1, m - 16)})))


# ---- norms, activations, embeddings, argmax ---------------------------------------------------------

@pytest.mark.parametrize("t", [1, 3, 17])
@pytest.mark.parametrize("h", [16, 96])
@pytest.mark.parametrize("bf16", [False, True])
def test_add_rms_norm_writes_only_its_residual_and_output(t, h, bf16):
    dt = torch.bfloat16 if bf16 else torch.float32
    a = Canaries(3)
    res = a.place("residual", torch.randn(t, h + 16), lambda x: x[:, :h], lambda e, r: e[:r, :h])
    delta = a.place("delta", torch.randn(t, h + 32).to(dt), lambda x: x[:, :h])
    weight = a.place("weight", torch.randn(h).to(dt))
    out = a.place("out", torch.zeros(t, h + 16, dtype=dt), lambda x: x[:, :h], lambda e, r: e[:r, :h])

    def call():
        cpu_kernels._k.add_rms_norm(res.data_ptr(), res.stride(0), delta.data_ptr(), bf16, delta.stride(0),
                                    weight.data_ptr(), bf16, 1e-5, out.data_ptr(), bf16, out.stride(0), t, h)

    run_and_replay(a, call, t, (1,))


@pytest.mark.parametrize("t", [1, 5, 17])
def test_silu_mul_writes_only_its_output(t):
    i = 48
    a = Canaries(4)
    x = a.place("x", torch.randn(t, 2 * i + 16).bfloat16(), lambda v: v[:, :2 * i])
    out = a.place("out", torch.zeros(t, i + 16, dtype=torch.bfloat16), lambda v: v[:, :i], lambda e, r: e[:r, :i])
    run_and_replay(a, lambda: cpu_kernels._k.silu_mul(x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), t, i),
                   t, (1, t - 1) if t > 2 else (1,))


@pytest.mark.parametrize("h", [16, 50, 96])  # 50: the scalar tail of the bf16 loop
@pytest.mark.parametrize("bf16", [False, True])
def test_embed_rows_writes_only_its_output(h, bf16):
    vocab, t = 40, 6
    a = Canaries(5)
    table = a.place("table", torch.randn(vocab, h + 8).to(torch.bfloat16 if bf16 else torch.float32),
                    lambda v: v[:, :h])
    ids = a.place("ids", torch.tensor([vocab - 1, 0, 7, vocab - 1, 3, 1], dtype=torch.int32))
    out = a.place("out", torch.zeros(t, h + 4), lambda v: v[:, :h], lambda e, r: e[:r, :h])
    run_and_replay(a, lambda: cpu_kernels._k.embed_rows(table.data_ptr(), bf16, table.stride(0), ids.data_ptr(),
                                                        out.data_ptr(), out.stride(0), t, h), t, (1, 5))


@pytest.mark.parametrize("n", [1, 15, 17, 1000])
def test_argmax_rows_writes_only_its_output(n):
    t = 5
    a = Canaries(6)
    x = a.place("x", torch.randn(t, n + 3), lambda v: v[:, :n])
    out = a.place("out", torch.zeros(t, dtype=torch.int64), writes=first_rows)
    a.allow(t)
    cpu_kernels._k.argmax_rows(x.data_ptr(), x.stride(0), t, n, out.data_ptr())
    a.check("argmax_rows")
    assert torch.equal(out, x.argmax(dim=1))


# ---- RoPE + KV write, decode attention, prefill attention ---------------------------------------------

@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (4, 2, 128), (2, 1, 32)])
def test_rope_store_kv_writes_only_q_and_its_slots(heads, kv_heads, dim):
    """The cos/sin table it reads is the one all layers share: it must come out as it went in."""
    from rtp.models.rotary import _build_rope

    t, nblocks, block_size, max_pos = 6, 5, 4, 64
    table = _build_rope(dim, dim, max_pos, 10000.0, None).cos_sin_cache
    slots_list = [0, nblocks * block_size - 1, 5, 9, 10, 17]  # the first and the last slot of the cache
    a = Canaries(7)
    width = (heads + 2 * kv_heads) * dim
    qkv = a.place("qkv", torch.randn(t, width + 64).bfloat16(), lambda v: v[:, :width])
    pos = a.place("positions", torch.tensor([max_pos - 1, 0, 1, 31, 62, 7], dtype=torch.int32))
    cs = a.place("cos_sin", table)
    q = a.place("q_out", torch.zeros(t, heads, dim, dtype=torch.bfloat16), writes=first_rows)

    def slot_rows(e, r):  # the slots of the first r tokens, in both halves of the cache
        flat = e.view(2, nblocks * block_size, kv_heads * dim)
        for s in slots_list[:r]:
            flat[:, s] = True
        return e[:0]

    kv = a.place("kv_cache", torch.zeros(2, nblocks, block_size, kv_heads, dim, dtype=torch.bfloat16), writes=slot_rows)
    slots = a.place("slots", torch.tensor(slots_list, dtype=torch.int64))
    run_and_replay(a, lambda: cpu_kernels._k.rope_store_kv(
        qkv.data_ptr(), qkv.stride(0), pos.data_ptr(), cs.data_ptr(), dim, q.data_ptr(), kv[0].data_ptr(),
        kv[1].data_ptr(), kv_heads * dim, slots.data_ptr(), t, heads, kv_heads, dim, nblocks * block_size),
        t, (1, 4))


@pytest.mark.parametrize("bad", [-1, 20, 1 << 40])
def test_rope_store_kv_refuses_a_slot_outside_the_cache(bad):
    """The one kernel that stores at addresses from data: a slot past either end of the cache is
    not written (the memory around a cache is weights and other layers' blocks) and the call raises."""
    heads, kv_heads, dim, t, nblocks, block_size = 2, 1, 32, 3, 5, 4
    a = Canaries(10)
    qkv = a.place("qkv", torch.randn(t, (heads + 2 * kv_heads) * dim).bfloat16())
    pos = a.place("positions", torch.tensor([0, 1, 2], dtype=torch.int32))
    cs = a.place("cos_sin", torch.randn(8, dim))
    q = a.place("q_out", torch.zeros(t, heads, dim, dtype=torch.bfloat16), writes=first_rows)

    def good_slots(e, r):
        flat = e.view(2, nblocks * block_size, kv_heads * dim)
        flat[:, 3] = flat[:, 19] = True
        return e[:0]

    kv = a.place("kv_cache", torch.zeros(2, nblocks, block_size, kv_heads, dim, dtype=torch.bfloat16),
                 writes=good_slots)
    slots = a.place("slots", torch.tensor([3, bad, 19], dtype=torch.int64))
    a.allow(t)
    with pytest.raises(IndexError, match="outside the KV cache"):
        cpu_kernels._k.rope_store_kv(qkv.data_ptr(), qkv.stride(0), pos.data_ptr(), cs.data_ptr(), dim, q.data_ptr(),
                                     kv[0].data_ptr(), kv[1].data_ptr(), kv_heads * dim, slots.data_ptr(), t, heads,
                                     kv_heads, dim, nblocks * block_size)
    a.check("rope_store_kv with a bad slot")
    assert (kv.view(2, -1, dim)[:, [3, 19]] != 0).any(dim=-1).all()  # the good slots were written


def test_a_replay_over_more_rows_than_recorded_fails_before_it_writes():
    """A graph's buffers hold the rows it was captured over: run_calls refuses more."""
    t, i = 3, 32
    a = Canaries(11)
    x = a.place("x", torch.randn(t + 1, 2 * i).bfloat16())
    out = a.place("out", torch.zeros(t, i, dtype=torch.bfloat16), writes=first_rows)
    run_and_replay(a, lambda: cpu_kernels._k.silu_mul(x.data_ptr(), x.stride(0), out.data_ptr(), i, t, i), t, ())
    calls = np.frombuffer(_recorded(lambda: cpu_kernels._k.silu_mul(x.data_ptr(), x.stride(0), out.data_ptr(), i, t,
                                                                    i)), dtype=np.int64).reshape(1, -1).copy()
    a.reset()
    a.allow(0)
    with pytest.raises(ValueError, match="recorded over 3 rows, cannot run over 4"):
        cpu_kernels.run_calls(calls, t + 1)
    a.check("a refused replay")


def _recorded(call) -> bytes:
    cpu_kernels.record_start()
    try:
        call()
    finally:
        calls = cpu_kernels.record_stop()
    return calls.tobytes()


# G = 16 and D = 256: the largest group and head the kernel's stack arrays hold
@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (16, 1, 256), (4, 4, 128), (14, 2, 96), (1, 1, 32)])
@pytest.mark.parametrize("batch", [1, 5])  # 1: a task per (row, kv head); 5: per row
def test_decode_attention_writes_only_its_output(heads, kv_heads, dim, batch):
    nblocks, block_size, width = 48, 16, 40
    g = torch.Generator().manual_seed(8)
    a = Canaries(8)
    q = a.place("q", torch.randn(batch, heads, dim, generator=g).bfloat16())
    kv = a.place("kv_cache", torch.randn(2, nblocks, block_size, kv_heads, dim, generator=g).bfloat16())
    tables = a.place("block_tables", torch.randint(0, nblocks, (batch, width + 3), dtype=torch.int32, generator=g),
                     lambda v: v[:, :width])
    lens_list = [width * block_size, 0, 17, 256, 513][:batch]  # all keys (in parts), a padding row, span edges
    lens = a.place("seq_lens", torch.tensor(lens_list, dtype=torch.int32))
    out = a.place("out", torch.zeros(batch, heads, dim, dtype=torch.bfloat16), writes=first_rows)
    run_and_replay(a, lambda: cpu_kernels._k.decode_attention(
        q.data_ptr(), kv[0].data_ptr(), kv[1].data_ptr(), kv.stride(2), tables.data_ptr(), tables.stride(0),
        lens.data_ptr(), out.data_ptr(), batch, heads, kv_heads, dim, block_size, dim**-0.5, 0),
        batch, (1,) if batch == 1 else (1, 3))


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (16, 1, 256), (4, 4, 32), (12, 3, 96)])
@pytest.mark.parametrize("block_size", [16, 7])
@pytest.mark.parametrize("amx", [False, True])
@pytest.mark.parametrize("window", [0, 50])
def test_prefill_attention_writes_only_its_chunks_rows(heads, kv_heads, dim, block_size, amx, window):
    """Rows of tokens outside every chunk (decode rows before them, padding after) stay as they were."""
    if amx and not cpu_kernels.amx_available():
        pytest.skip("no AMX here")
    chunks = [(3, 37, 37), (40, 1, 129), (41, 100, 300), (141, 16, 16)]  # (first token, tokens, context)
    total = 160
    g = torch.Generator().manual_seed(9)
    nblocks = sum(-(-ctx // block_size) for _, _, ctx in chunks) + 2
    a = Canaries(9)
    q = a.place("q", torch.randn(total, heads, dim, generator=g).bfloat16())
    kv = a.place("kv_cache", torch.randn(2, nblocks, block_size, kv_heads, dim, generator=g).bfloat16())
    from rtp.models.attention import AttentionMetadata, PrefillRow

    rows, used = [], 0
    for start, n, ctx in chunks:
        w = -(-ctx // block_size)
        rows.append(PrefillRow(start, start + n, ctx, torch.arange(used + 1, used + 1 + w, dtype=torch.int32)))
        used += w
    meta = AttentionMetadata(slot_mapping=torch.zeros(0, dtype=torch.int64), block_size=block_size,
                             num_decode=chunks[0][0], prefill=rows)
    qsl, lens, tables, first, nseq = meta.prefill_kernel_args()  # the plan's arrays: decode rows first
    qsl, lens, tables = a.place("qsl", qsl), a.place("seq_lens", lens), a.place("tables", tables)

    def chunk_rows(e, r):
        for start, n, _ in chunks:
            e[start:start + n] = True
        return e[:0]

    out = a.place("out", torch.zeros(total, heads, dim, dtype=torch.bfloat16), writes=chunk_rows)
    a.allow(total)
    cpu_kernels._k.prefill_attention(q.data_ptr(), kv[0].data_ptr(), kv[1].data_ptr(), kv.stride(2),
                                     qsl.data_ptr(), lens.data_ptr(), tables.data_ptr(), tables.stride(0), first,
                                     nseq, out.data_ptr(), heads, kv_heads, dim, block_size, dim**-0.5, window,
                                     amx)
    a.check("prefill attention")


def test_rope_store_kv_wrapper_refuses_slot_mappings_the_kernel_would_misread():
    """The kernel reads T int64 slots: int32 ones would pair up into wild slots, a short
    mapping would send the last tokens wherever the memory after it points."""
    heads, kv_heads, dim, t = 2, 1, 32, 3
    qkv = torch.randn(t, (heads + 2 * kv_heads) * dim).bfloat16()
    kv = torch.zeros(2, 4, 4, kv_heads, dim, dtype=torch.bfloat16)
    pos = torch.arange(t, dtype=torch.int32)
    table = torch.randn(8, dim)
    for slots in (torch.arange(t, dtype=torch.int32), torch.arange(t - 1, dtype=torch.int64)):
        with pytest.raises(ValueError, match="int64 slot_mapping"):
            cpu_kernels.rope_store_kv(qkv, pos, table, kv, slots, heads, kv_heads)
    assert torch.all(kv == 0)
    cpu_kernels.rope_store_kv(qkv, pos, table, kv, torch.arange(t, dtype=torch.int64), heads, kv_heads)
    assert (kv.view(2, -1, dim)[:, :t] != 0).any(dim=-1).all()
