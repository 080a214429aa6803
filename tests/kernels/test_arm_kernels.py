"""The Arm64 NEON path's kernels (rtp/kernels/csrc/arm/), cross-built for AArch64 with a small C harness
(tests/kernels/arm/harness.c) and run under qemu-aarch64, against the references and tolerances the avx2 path's
tests hold the same kernels' twins to (test_avx2_small_kernels.py, test_avx2_linear.py, test_avx2_attention.py,
whose helpers are imported here), computed on the host. The harness links every C file of csrc/ as setup.py
builds them for AArch64 and runs each op as a CPU graph's replay does: a call's words through the op table's
trampoline (kernel_ops.c), dispatched on the selected ISA path to the op's _neon variant.

One build for baseline ARMv8-A (as setup.py builds it) carries both AArch64 paths: dotprod (the integer linears on
SDOT, compiled for ARMv8.2-A + dot product in arm/linear_int8_dotprod.c) and neon (their widening-multiply form),
run on an emulated Cortex-A53 (no dot product: an SDOT there would be SIGILL); the integer linears run on both
and must give the same bits. Every buffer the harness hands a kernel
has guard bytes on both sides, checked after the call, so a write past an operand fails as well; row strides
past the width are checked to stay untouched where a kernel takes them. Shapes are small (qemu emulates each
NEON instruction) but hit the remainders: widths off the vector width, partial weight tiles, a block size of 7,
odd token counts, rows that take the OpenMP paths (16 or more).

Skipped where aarch64-linux-gnu-gcc or qemu-aarch64 is not on PATH (Debian: apt-get install
crossbuild-essential-arm64 qemu-user).
"""

from __future__ import annotations

import math
import os
import shutil
import struct
import subprocess
from pathlib import Path

import pytest

CC, QEMU = "aarch64-linux-gnu-gcc", "qemu-aarch64"
_MISSING = [tool for tool in (CC, QEMU) if shutil.which(tool) is None]
if _MISSING:
    pytest.skip(f"needs {' and '.join(_MISSING)} on PATH to build and run the AArch64 kernels (Debian: apt-get "
                "install crossbuild-essential-arm64 qemu-user)", allow_module_level=True)

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from test_avx2_attention import CAP, _assert_close_to_fp32, _cache, _plan, _prefill_case  # noqa: E402
from test_avx2_linear import int_blocks, random_blocks  # noqa: E402
from test_avx2_small_kernels import BF16_REL, assert_rounded_once, reference_rms_norm  # noqa: E402

from rtp.kernels import ops_codegen  # noqa: E402
from rtp.kernels.quant import U8_SPLIT  # noqa: E402
from rtp.models.attention import causal_attention, decode_attention, hadamard, quantize_kv, rotates_kv  # noqa: E402
from rtp.models.rotary import get_rope  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
CSRC = ROOT / "rtp" / "kernels" / "csrc"
HARNESS = Path(__file__).resolve().parent / "arm" / "harness.c"
# setup.py's -ffp-contract=off as well: RoPE's x1 cos - x2 sin must round each product, as torch does
FLAGS = ["-O2", "-fopenmp", "-ffp-contract=off", "-Wall", "-Wextra"]
# one build for baseline ARMv8-A (as setup.py builds it), which carries both paths: the harness selects each
PATHS = {"dotprod": 2, "plain": 1}  # RTP_ISA_DOTPROD, RTP_ISA_NEON (csrc/cpu_kernels.h)
THREADS = 2  # OpenMP threads a run takes (the kernels' parallel paths run; one core-heavy process at a time)
TIMEOUT = 120


class Harness:
    """One build of the harness: run(op, *args) runs op through the op table (its rtp_<op>_neon variant) with args
    in its prototype's order
    (tensors, contiguous, for pointers; None for NULL; int and bool for integers; float for floats) and returns
    (its int result, args with every tensor replaced by its contents after the call)."""

    def __init__(self, command: list[str], workdir: Path, isa: int):
        self.command, self.workdir, self.calls, self.isa = command, workdir, 0, isa

    def run(self, op: str, *args, threads: int = THREADS):
        self.calls += 1
        src, dst = self.workdir / f"in{self.calls}.bin", self.workdir / f"out{self.calls}.bin"
        parts = [struct.pack("<q", len(args))]
        for a in args:
            if a is None:
                parts.append(struct.pack("<q", 3))
            elif isinstance(a, torch.Tensor):
                assert a.is_contiguous(), "the harness takes contiguous buffers (a stride is an argument)"
                data = (a.view(torch.int16) if a.dtype == torch.bfloat16 else a).numpy().tobytes()
                parts += [struct.pack("<qq", 2, len(data)), data]
            elif isinstance(a, float):
                parts.append(struct.pack("<qd", 1, a))
            else:
                assert isinstance(a, (int, bool)), type(a)
                parts.append(struct.pack("<qq", 0, int(a)))
        src.write_bytes(b"".join(parts))
        env = dict(os.environ, OMP_NUM_THREADS=str(threads), RTP_HARNESS_ISA=str(self.isa))
        done = subprocess.run([*self.command, op, str(src), str(dst)], capture_output=True, text=True,
                              timeout=TIMEOUT, env=env)
        assert done.returncode == 0, f"{op}: exit {done.returncode}: {done.stderr}"
        raw = dst.read_bytes()
        src.unlink()
        dst.unlink()
        result, intact = struct.unpack_from("<qq", raw)
        assert intact == 1, f"{op} wrote outside one of its buffers"
        after, at = [], 16
        for a in args:
            if isinstance(a, torch.Tensor):
                n = a.numel() * a.element_size()
                t = a.clone()
                if n:
                    t.view(-1).view(torch.uint8).copy_(torch.frombuffer(bytearray(raw[at:at + n]), dtype=torch.uint8))
                after.append(t)
                at += n
            else:
                after.append(a)
        assert at == len(raw)
        return result, after


def _build(workdir: Path, march: str) -> list[str]:
    """The harness linked with every C file of csrc/ as setup.py compiles them (the x86-64 ones compile to
    nothing here), kernel_ops.c's trampolines and the op table regenerated from ops.py first."""
    ops_codegen.write()
    sources = [str(HARNESS)] + sorted(str(p) for p in CSRC.rglob("*.c"))
    exe = workdir / "harness"
    compile_ = [CC, march, *FLAGS, f"-I{CSRC}", "-o", str(exe), *sources, "-lm"]
    done = subprocess.run([*compile_, "-static"], capture_output=True, text=True, timeout=600)
    if done.returncode == 0:
        return [QEMU, str(exe)]
    # no static libgomp or libc for the target: link dynamically, qemu finding the target's libraries
    dynamic = subprocess.run(compile_, capture_output=True, text=True, timeout=600)
    assert dynamic.returncode == 0, f"the AArch64 build failed:\n{done.stderr}\n{dynamic.stderr}"
    return [QEMU, "-L", "/usr/aarch64-linux-gnu", str(exe)]


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, Harness]:
    """One build for baseline ARMv8-A, as setup.py builds it, carrying both paths: "dotprod" on qemu's default
    CPU (which has the dot product), "plain" on an emulated Cortex-A53 (ARMv8.0: no dot product), where an SDOT
    the neon path ran would stop the harness with SIGILL."""
    root = tmp_path_factory.mktemp("arm_kernels")
    command = _build(root, "-march=armv8-a")
    a53 = [command[0], "-cpu", "cortex-a53", *command[1:]]
    for name in PATHS:
        (root / name).mkdir()
    return {"dotprod": Harness(command, root / "dotprod", PATHS["dotprod"]),
            "plain": Harness(a53, root / "plain", PATHS["plain"])}


@pytest.fixture(scope="module")
def neon(builds) -> Harness:
    """The dot-product build, which runs every op."""
    return builds["dotprod"]


def bf16(x: torch.Tensor) -> bool:
    return x.dtype == torch.bfloat16


def test_one_baseline_build_carries_both_integer_paths_and_selects_each(builds):
    # each harness runs the path it selects, the table's trampolines dispatching on it
    assert builds["dotprod"].run("features")[0] == PATHS["dotprod"]
    assert builds["plain"].run("features")[0] == PATHS["plain"]
    dump = subprocess.run(["aarch64-linux-gnu-objdump", "-d", builds["plain"].command[-1]], capture_output=True,
                          text=True, timeout=120).stdout
    assert "\tsdot\t" in dump  # the dotprod path's int8 linears, compiled for it in the baseline build


# -- norms -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("delta_dtype,out_dtype,weight_dtype,tokens", [
    (None, torch.float32, torch.float32, 1), (torch.float32, torch.bfloat16, torch.bfloat16, 3),
    (torch.bfloat16, torch.float32, torch.bfloat16, 17), (torch.bfloat16, torch.bfloat16, torch.float32, 17),
    (None, torch.bfloat16, torch.bfloat16, 5), (torch.float32, torch.float32, torch.float32, 16)])
def test_add_rms_norm(neon, delta_dtype, out_dtype, weight_dtype, tokens):
    g = torch.Generator().manual_seed(3)
    h = 96
    weight = (torch.randn(h, generator=g) + 1).to(weight_dtype)
    wide = torch.randn(tokens, h + 16, generator=g) * 4  # the residual's rows strided past the width
    delta = None if delta_dtype is None else torch.randn(tokens, h, generator=g).to(delta_dtype)
    out = torch.zeros(tokens, h, dtype=out_dtype)
    _, after = neon.run("add_rms_norm", wide, h + 16, delta, delta is not None and bf16(delta), h, weight,
                        bf16(weight), 1e-5, out, bf16(out), h, tokens, h)
    want_res = wide[:, :h] + (0 if delta is None else delta.float())
    assert torch.equal(after[0][:, :h], want_res)  # the residual add is exact fp32
    assert torch.equal(after[0][:, h:], wide[:, h:])
    assert_rounded_once(after[8], reference_rms_norm(want_res, weight, 1e-5), atol=1e-6)


@pytest.mark.parametrize("x_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens,h,weight_dtype", [(1, 64, torch.float32), (3, 50, torch.bfloat16),
                                                   (17, 1152, torch.float32), (5, 7, torch.bfloat16)])
def test_rms_norm(neon, x_dtype, tokens, h, weight_dtype):
    g = torch.Generator().manual_seed(1)
    wide = (torch.randn(tokens, h + 24, generator=g) * 3).to(x_dtype)  # ldx != h
    weight = (torch.randn(h, generator=g) + 1).to(weight_dtype)
    out = torch.zeros(tokens, h + 3, dtype=x_dtype)  # ldo != h: the 3 past each row stay 0
    _, after = neon.run("rms_norm", wide, h + 24, bf16(wide), weight, bf16(weight), 1e-6, out, h + 3, bf16(out),
                        tokens, h)
    assert_rounded_once(after[6][:, :h], reference_rms_norm(wide[:, :h], weight, 1e-6), atol=1e-6)
    assert torch.all(after[6][:, h:] == 0)


@pytest.mark.parametrize("heads,kv_heads,dim,weight_dtype", [(4, 2, 32, torch.float32), (3, 1, 50, torch.bfloat16),
                                                             (2, 2, 256, torch.bfloat16)])
@pytest.mark.parametrize("tokens", [1, 19])
def test_qk_rms_norm_in_place(neon, heads, kv_heads, dim, weight_dtype, tokens):
    g = torch.Generator().manual_seed(2)
    width = (heads + 2 * kv_heads) * dim
    wide = (torch.randn(tokens, width + 40, generator=g) * 2).bfloat16()
    qw = (torch.randn(dim, generator=g) + 1).to(weight_dtype)
    kw = (torch.randn(dim, generator=g) + 1).to(weight_dtype)
    _, after = neon.run("qk_rms_norm", wide, width + 40, qw, kw, bf16(qw), 1e-6, tokens, heads, kv_heads, dim)
    got = after[0]
    q, k, v = wide[:, :width].split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    assert_rounded_once(got[:, :heads * dim].reshape(tokens, heads, dim),
                        reference_rms_norm(q.reshape(tokens, heads, dim), qw, 1e-6), atol=1e-6)
    assert_rounded_once(got[:, heads * dim:(heads + kv_heads) * dim].reshape(tokens, kv_heads, dim),
                        reference_rms_norm(k.reshape(tokens, kv_heads, dim), kw, 1e-6), atol=1e-6)
    assert torch.equal(got[:, (heads + kv_heads) * dim:], wide[:, (heads + kv_heads) * dim:])


def test_bf16_outputs_keep_nan_and_infinities(neon):
    """A bf16 output rounds to nearest even, a NaN stays NaN and the infinities stay: rms_norm's output times a
    weight holding them, and a row holding a NaN whose payload (all ones, which the arithmetic carries to every
    output of the row) the rounding's carry would wrap to zero."""
    g = torch.Generator().manual_seed(8)
    h = 21
    x = torch.randn(2, h, generator=g)
    x.view(torch.int32)[1, 3] = -1  # fp32 bits 0xffffffff: a NaN
    weight = torch.randn(h, generator=g)
    weight[:5] = torch.tensor([math.nan, math.inf, -math.inf, 0.0, 3e38])
    out = torch.zeros(2, h, dtype=torch.bfloat16)
    _, after = neon.run("rms_norm", x, h, False, weight, False, 1e-6, out, h, True, 2, h)
    want = reference_rms_norm(x, weight, 1e-6)
    got = after[6].float()
    assert torch.all(torch.isnan(got[:, 0])) and torch.all(torch.isnan(got[1]))
    assert torch.equal(torch.isnan(got), torch.isnan(want))
    assert torch.equal(torch.isinf(got), torch.isinf(want.bfloat16().float()))
    finite = torch.isfinite(want.bfloat16().float())
    assert_rounded_once(after[6][finite], want[finite], atol=1e-6)


def test_row_kernels_give_a_row_the_same_bits_alone_and_on_any_thread_count(neon):
    g = torch.Generator().manual_seed(7)
    x = (torch.randn(33, 200, generator=g) * 3).bfloat16()
    weight = torch.randn(200, generator=g) + 1
    gate_up = (torch.randn(33, 2 * 72, generator=g) * 3).bfloat16()
    logits = torch.randn(33, 5000, generator=g) * 40

    def rows(a, b, threads):
        t = b - a
        norm = neon.run("rms_norm", x[a:b].contiguous(), 200, True, weight, False, 1e-6,
                        torch.zeros(t, 200, dtype=torch.bfloat16), 200, True, t, 200, threads=threads)[1][6]
        gelu = neon.run("gelu_tanh_mul", gate_up[a:b].contiguous(), 144, torch.zeros(t, 72, dtype=torch.bfloat16),
                        72, t, 72, threads=threads)[1][2]
        capped = neon.run("softcap", logits[a:b].contiguous(), 5000, 30.0, t, 5000, threads=threads)[1][0]
        return norm, gelu, capped

    want = rows(0, 33, 1)
    for a, b in zip(rows(0, 33, 3), want):
        assert torch.equal(a, b)
    for r in (0, 16, 32):
        for a, b in zip(rows(r, r + 1, THREADS), want):
            assert torch.equal(a, b[r:r + 1])


# -- activations -------------------------------------------------------------------------------------------

@pytest.mark.parametrize("tokens,inter", [(1, 64), (19, 48)])
def test_silu_mul(neon, tokens, inter):
    """silu(gate) * up in fp32, rounded once to bf16; extreme gates stay finite."""
    g = torch.Generator().manual_seed(5)
    wide = (torch.randn(tokens, 2 * inter + 32, generator=g) * 4).bfloat16()
    wide[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0]).bfloat16()
    out = torch.zeros(tokens, inter, dtype=torch.bfloat16)
    _, after = neon.run("silu_mul", wide, 2 * inter + 32, out, inter, tokens, inter)
    out = after[2]
    gate, up = wide[:, :2 * inter].float().chunk(2, dim=-1)
    want = F.silu(gate) * up
    assert torch.all(torch.isfinite(out.float()))
    assert torch.all((out.float() - want).abs() <= want.abs() * 2**-8 + 1e-30)


@pytest.mark.parametrize("tokens,inter", [(1, 64), (5, 50), (19, 7), (3, 1030)])
def test_gelu_tanh_mul(neon, tokens, inter):
    """Rounded once to bf16 from fp32 that keeps its digits (against fp64, via the sigmoid form)."""
    g = torch.Generator().manual_seed(4)
    wide = (torch.randn(tokens, 2 * inter + 16, generator=g) * 3).bfloat16()
    wide[0, :4] = torch.tensor([-200.0, 200.0, 0.0, -0.0]).bfloat16()
    wide[-1, 4:7] = torch.tensor([-6.0, -3.0, 1e4]).bfloat16()
    out = torch.zeros(tokens, inter + 5, dtype=torch.bfloat16)  # ldo != inter
    _, after = neon.run("gelu_tanh_mul", wide, 2 * inter + 16, out, inter + 5, tokens, inter)
    assert torch.all(after[2][:, inter:] == 0)
    out = after[2][:, :inter]
    x = wide[:, :2 * inter]
    assert torch.all(torch.isfinite(out.float()))
    gate, up = x.double().chunk(2, dim=-1)
    y = math.sqrt(2 / math.pi) * (gate + 0.044715 * gate**3)
    assert_rounded_once(out, (gate * torch.sigmoid(2 * y) * up).float(), atol=1e-30)
    gate, up = x.float().chunk(2, dim=-1)
    torch_fp32 = F.gelu(gate, approximate="tanh") * up
    lost = 2**-23 * (gate * up).abs()  # an ulp of 1 + tanh, times 0.5 g u: what torch's fp32 may lose
    assert torch.all((out.float() - torch_fp32).abs() <= torch_fp32.abs() * BF16_REL * (1 + 1e-3) + lost + 1e-30)


@pytest.mark.parametrize("tokens,n", [(1, 15), (3, 4096 + 17), (17, 5000)])
@pytest.mark.parametrize("cap", [30.0, 3.0])
def test_softcap(neon, tokens, n, cap):
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(tokens, n + 5, generator=g) * 20
    wide[0, :8] = torch.tensor([0.0, -0.0, 1e-30, -1e-6, 1e30, -math.inf, math.inf, math.nan])
    want = torch.tanh(wide[:, :n] / cap) * cap
    _, after = neon.run("softcap", wide, n + 5, cap, tokens, n)
    x = after[0]
    torch.testing.assert_close(x[:, :n], want, rtol=1e-6, atol=1e-6 * cap, equal_nan=True)
    assert torch.equal(x[:, n:], wide[:, n:])
    torch.testing.assert_close(x[0, 1:4], want[0, 1:4], rtol=1e-6, atol=0)  # tiny values keep their digits


@pytest.mark.parametrize("gate_dtype", [torch.bfloat16, torch.float32])
def test_add_sigmoid_gated(neon, gate_dtype):
    g = torch.Generator().manual_seed(6)
    out = torch.randn(5, 72 + 8, generator=g)  # rows strided past the width
    gate = (torch.randn(5, 2, generator=g) * 8).to(gate_dtype)
    y = torch.randn(5, 72, generator=g).bfloat16()
    _, after = neon.run("add_sigmoid_gated", out, 72 + 8, gate, bf16(gate), 2, y, 72, 5, 72)
    want = out[:, :72] + torch.sigmoid(gate[:, :1].float()) * y.float()
    torch.testing.assert_close(after[0][:, :72], want, rtol=2e-6, atol=1e-6)
    assert torch.equal(after[0][:, 72:], out[:, 72:])


# -- the embedding ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("h", [96, 50])
@pytest.mark.parametrize("scaled", [False, True])
def test_embed_rows(neon, dtype, h, scaled):
    """table[ids] in fp32; scaled: the product in the table's dtype first, as torch's, bit for bit."""
    g = torch.Generator().manual_seed(6)
    wide = (torch.randn(60, h + 8, generator=g) * 0.7).to(dtype)
    table = wide[:, :h]  # ldt != h
    ids = torch.tensor([3, 0, 59, 3, 17], dtype=torch.int32)
    factor = torch.tensor(h**0.5, dtype=torch.float32).to(dtype)
    scale = factor.item() if scaled else 1.0
    out = torch.zeros(5, h + 2)  # ldo != h
    _, after = neon.run("embed_rows", wide, bf16(wide), h + 8, ids, out, h + 2, 5, h, scale)
    want = F.embedding(ids, table) * factor if scaled else F.embedding(ids, table)
    assert torch.equal(after[4][:, :h], want.float())
    assert torch.all(after[4][:, h:] == 0)


# -- RoPE + KV write ---------------------------------------------------------------------------------------

def _rope_case(heads, kv_heads, dim, tokens, rotary_dim=None, seed=4):
    g = torch.Generator().manual_seed(seed)
    rope = get_rope(dim, rotary_dim, 256, 10000.0, None)
    width = (heads + 2 * kv_heads) * dim
    wide = (torch.randn(tokens, width + 24, generator=g) * 3).bfloat16()  # ldq != width
    positions = torch.randint(0, 256, (tokens,), dtype=torch.int32, generator=g)
    return rope, wide, width, positions, g


def _rope_run(neon, rope, wide, width, positions, slots, heads, kv_heads, dim, blocks, block_size, int8):
    tokens = wide.shape[0]
    cos_sin = rope.cos_sin_cache.contiguous()
    cache = torch.zeros(2, blocks, block_size, kv_heads, dim, dtype=torch.int8 if int8 else torch.bfloat16)
    scales = torch.zeros(2, blocks, block_size, kv_heads) if int8 else None
    q = torch.zeros(tokens, heads, dim, dtype=torch.bfloat16)
    ok, after = neon.run("rope_store_kv", wide, width + 24, positions, cos_sin, cos_sin.shape[1], q,
                         cache[0].contiguous(), cache[1].contiguous(), kv_heads * dim, slots, tokens, heads, kv_heads,
                         dim, blocks * block_size, None if scales is None else scales[0].contiguous(),
                         None if scales is None else scales[1].contiguous())
    assert torch.equal(after[0], wide)
    cache = torch.stack([after[6], after[7]]).view(2, -1, kv_heads, dim)
    scales = None if scales is None else torch.stack([after[15], after[16]]).view(2, -1, kv_heads)
    return ok, after[5], cache, scales


def _rope_reference(rope, wide, width, positions, heads, kv_heads, dim):
    tokens = wide.shape[0]
    q_ref, k_ref, v_ref = wide[:, :width].split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1)
    q_ref, k_ref = rope(positions, q_ref.reshape(tokens, heads, dim), k_ref.reshape(tokens, kv_heads, dim))
    return q_ref, k_ref, v_ref.reshape(tokens, kv_heads, dim)


@pytest.mark.parametrize("heads,kv_heads,dim,rotary_dim", [(9, 3, 64, None), (3, 1, 96, None), (2, 1, 64, 32)])
@pytest.mark.parametrize("tokens", [1, 17])
def test_rope_store_kv(neon, heads, kv_heads, dim, rotary_dim, tokens):
    """rotary + index_copy, bit for bit (rot < D: the dims past rot copied as they are)."""
    rope, wide, width, positions, g = _rope_case(heads, kv_heads, dim, tokens, rotary_dim)
    blocks, block_size = 8, 4
    slots = torch.randperm(blocks * block_size, generator=g)[:tokens].to(torch.int64)
    ok, q, flat, _ = _rope_run(neon, rope, wide, width, positions, slots, heads, kv_heads, dim, blocks, block_size,
                               False)
    assert ok == 1
    q_ref, k_ref, v_ref = _rope_reference(rope, wide, width, positions, heads, kv_heads, dim)
    assert torch.equal(q, q_ref)
    assert torch.equal(flat[0, slots], k_ref)
    assert torch.equal(flat[1, slots], v_ref)
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[slots] = False
    assert torch.all(flat[:, untouched] == 0)


@pytest.mark.parametrize("heads,kv_heads,dim", [(9, 3, 64), (8, 1, 32), (6, 2, 96), (2, 2, 256)])
@pytest.mark.parametrize("tokens", [1, 17])
def test_rope_store_kv_int8(neon, heads, kv_heads, dim, tokens):
    """quantize_kv(rotary k, times the Hadamard matrix where the head dim is a power of two) and quantize_kv(v)
    at the slots, scales included, bit for bit; q rotated alike; other slots untouched."""
    rope, wide, width, positions, g = _rope_case(heads, kv_heads, dim, tokens)
    wide[0, (heads + kv_heads) * dim:(heads + kv_heads + 1) * dim] = 0  # a V row of zeros: scale 0
    blocks, block_size = 12, 4
    slots = torch.randperm(blocks * block_size, generator=g)[:tokens].to(torch.int64)
    ok, q, flat, flat_scales = _rope_run(neon, rope, wide, width, positions, slots, heads, kv_heads, dim, blocks,
                                         block_size, True)
    assert ok == 1
    q_ref, k_ref, v_ref = _rope_reference(rope, wide, width, positions, heads, kv_heads, dim)
    if rotates_kv(dim):
        q_ref, k_ref = hadamard(q_ref).bfloat16(), hadamard(k_ref)
    assert torch.equal(q, q_ref)
    for part, x in ((0, k_ref), (1, v_ref)):
        want, want_scales = quantize_kv(x)
        assert torch.equal(flat[part, slots], want)
        assert torch.equal(flat_scales[part, slots], want_scales)
    assert flat_scales[1, slots[0], 0] == 0 and torch.all(flat[1, slots[0], 0] == 0)
    untouched = torch.ones(flat.shape[1], dtype=torch.bool)
    untouched[slots] = False
    assert torch.all(flat[:, untouched] == 0) and torch.all(flat_scales[:, untouched] == 0)


@pytest.mark.parametrize("int8", [False, True])
def test_rope_store_kv_refuses_a_slot_outside_the_cache(neon, int8):
    rope, wide, width, positions, _ = _rope_case(9, 3, 64, 3)
    slots = torch.tensor([3, 16, -1], dtype=torch.int64)
    ok, _, flat, scales = _rope_run(neon, rope, wide, width, positions, slots, 9, 3, 64, 4, 4, int8)
    assert ok == 0
    written = torch.zeros(16, dtype=torch.bool)
    written[3] = True  # the slot inside the cache, written; nothing else
    assert torch.all(flat[:, 3].float().abs().amax(-1) > 0) and torch.all(flat[:, ~written] == 0)
    if int8:
        assert torch.all(scales[:, 3] > 0) and torch.all(scales[:, ~written] == 0)


# -- linears -------------------------------------------------------------------------------------------------

def _linear_call(harness, op, w, x, ldx, bias, out, threads=THREADS):
    """Runs linear op over x's first K columns of rows ldx apart (x the whole buffer): returns out after."""
    rows, n = out.shape
    k = w.shape[1]
    b = None if bias is None else bias.float().contiguous()
    xf = x.dtype == torch.float32
    if op == "linear_bf16":
        args = (x, ldx, xf, w.qs.contiguous(), k, b, out, n, bf16(out), rows, n, k)
    elif op == "linear_q4_1":
        assert not xf
        args = (x, ldx, w.qs, w.d, w.m, b, out, n, bf16(out), rows, n, k)
    elif op == "linear_q8":
        assert xf
        args = (x, ldx, w.qs, w.d, w.m, 16 if w.kind == "q8_16" else 32, b, out, n, bf16(out), rows, n, k)
    else:  # linear_u8, as BlockQuantized.linear takes it for each kind
        group, offset = {"q8_0": (32, U8_SPLIT), "q8_1": (32, 0), "q8_16": (16, 32)}[w.kind]
        args = (x, ldx, xf, w.qs, w.d, w.m, group, offset, b, out, n, bf16(out), rows, n, k)
    result, after = harness.run(op, *args, threads=threads)
    if op in ("linear_q4_1", "linear_u8"):
        assert result == 1
    assert torch.equal(after[0], x)
    return after[next(i for i, a in enumerate(args) if a is out)]


# (op, kind): every kernel with each kind BlockQuantized.linear gives it on the avx2 path, and linear_q8 with the
# kinds it takes (q8_1's offsets, q8_16's scales per 16) for fp32 x
LINEARS = [("linear_q4_1", "q4_1"), ("linear_u8", "q8_0"), ("linear_u8", "q8_1"), ("linear_u8", "q8_16"),
           ("linear_q8", "q8_0"), ("linear_q8", "q8_1"), ("linear_q8", "q8_16"), ("linear_bf16", "bf16")]
INT_LINEARS = [c for c in LINEARS if c[0] != "linear_bf16"]


def _x_dtypes(op):
    return {"linear_q4_1": [torch.bfloat16], "linear_q8": [torch.float32]}.get(op, [torch.bfloat16, torch.float32])


@pytest.mark.parametrize("op,kind", LINEARS)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 9, 70, 131])  # 6: tiles of 4 and 2 rows; 70, 131: past 64 rows
def test_linear_matches_dequantized_weights(neon, op, kind, rows):
    n, k = 37, 160  # partial tiles of weight rows; five blocks a row
    w = random_blocks(kind, n, k, seed=rows)
    bias = torch.randn(n)
    for x_dtype in _x_dtypes(op):
        x = torch.randn(rows, k).to(x_dtype)
        # dense bf16 weights multiply x rounded to bf16; the block kinds x's 15-bit blocks
        xr = x.bfloat16().float() if kind in ("bf16", "q4_1") else x.float()
        ref = (xr.double() if kind == "bf16" else int_blocks(xr).double()) @ w.dequantize().double().T + bias.double()
        scale = ref.abs().max().item()
        out_dtype = torch.bfloat16 if (rows + (x_dtype == torch.float32)) % 2 else torch.float32
        out = _linear_call(neon, op, w, x, k, bias, torch.zeros(rows, n, dtype=out_dtype))
        tol = 1e-5 * scale if out_dtype == torch.float32 else 2.0**-8 * scale
        assert (out.float() - ref).abs().max().item() <= tol, (x_dtype, out_dtype)


@pytest.mark.parametrize("op,kind", INT_LINEARS)
def test_the_plain_neon_integer_path_gives_the_dot_product_paths_bits(builds, op, kind):
    """The SDOT build and the plain-NEON fallback: the same int32 lanes, so the same outputs, bit for bit."""
    n, k = 21, 96
    w = random_blocks(kind, n, k, seed=7)
    bias = torch.randn(n)
    for rows, x_dtype in zip((1, 7), _x_dtypes(op) * 2):
        x = torch.randn(rows, k).to(x_dtype)
        got = [_linear_call(builds[b], op, w, x, k, bias, torch.zeros(rows, n)) for b in ("dotprod", "plain")]
        assert torch.equal(got[0], got[1])
        ref = int_blocks(x.float()).double() @ w.dequantize().double().T + bias.double()
        assert (got[1].double() - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()


@pytest.mark.parametrize("op,kind", [("linear_q4_1", "q4_1"), ("linear_u8", "q8_16"), ("linear_bf16", "bf16")])
def test_linear_gives_a_row_the_same_bits_whatever_the_batch_and_threads(neon, op, kind):
    n, k = 45, 128
    w = random_blocks(kind, n, k)
    x = torch.randn(70, k).bfloat16()
    batch = _linear_call(neon, op, w, x, k, None, torch.zeros(70, n))
    for start, size in ((0, 1), (5, 2), (9, 3), (66, 4), (1, 7)):
        part = x[start:start + size].contiguous()
        assert torch.equal(_linear_call(neon, op, w, part, k, None, torch.zeros(size, n)), batch[start:start + size])
    assert torch.equal(_linear_call(neon, op, w, x, k, None, torch.zeros(70, n), threads=1), batch)
    assert torch.equal(_linear_call(neon, op, w, x, k, None, torch.zeros(70, n), threads=3), batch)


@pytest.mark.parametrize("op,kind", [("linear_u8", "q8_1"), ("linear_bf16", "bf16"), ("linear_q8", "q8_0")])
def test_linear_reads_a_strided_row_slice(neon, op, kind):
    w = random_blocks(kind, 32, 96)
    wide = torch.randn(5, 160).to(torch.float32 if op == "linear_q8" else torch.bfloat16)
    x = wide[:, 32:128]  # rows strided past the width: the buffer from row 0's column 32 on, rows 160 apart
    from_slice = _linear_call(neon, op, w, wide.view(-1)[32:].clone(), 160, None, torch.zeros(5, 32))
    assert torch.equal(from_slice, _linear_call(neon, op, w, x.contiguous(), 96, None, torch.zeros(5, 32)))


# -- the sampler's kernels --------------------------------------------------------------------------------

@pytest.mark.parametrize("n", [1, 3, 7, 8, 9, 1000, 49152])
def test_argmax_rows_is_numpys(neon, n):
    """NumPy's answer on random rows, ties (the first wins, across lanes and vectors), -inf rows, NaN (the first
    NaN wins) and a row stride past N."""
    g = torch.Generator().manual_seed(n)
    wide = torch.randn(37, n + 3, generator=g)
    x = wide[:, :n]
    x[1] = 0.0
    x[2, n // 2] = x[2, n - 1] = 100.0
    x[3] = float("-inf")
    x[4, n // 3] = float("nan")
    x[5, -1] = float("nan")
    x[5, 0] = float("inf")
    x[6] = torch.randint(0, 3, (n,), generator=g).float()
    x[7, n // 2:] = float("nan")
    out = torch.full((37,), -1, dtype=torch.int64)
    _, after = neon.run("argmax_rows", wide, n + 3, 37, n, out)
    assert torch.equal(after[4], torch.from_numpy(x.numpy().argmax(axis=-1)))


@pytest.mark.parametrize("n", [5, 32, 77, 1000])
def test_apply_token_bitmask(neon, n):
    """-inf exactly where the row's bit is 0, only on the listed rows, never past the vocabulary."""
    g = torch.Generator().manual_seed(n)
    words = (n + 31) // 32
    wide = torch.randn(6, n + 40, generator=g)
    mask = torch.randint(-2**31, 2**31, (4, words + 1), dtype=torch.int64, generator=g).to(torch.int32)
    mask[0, 0] = -1  # every token of the word allowed: skipped
    mask[1, -2] = 0  # the last word, all forbidden (its bits past n too)
    mask[2, 0] = 0  # a whole word forbidden (the vector stores where it lies below n)
    rows = torch.tensor([4, 0, 2], dtype=torch.int64)
    _, after = neon.run("apply_token_bitmask", wide, n + 40, mask, words + 1, rows, 3, n)
    shifts = torch.arange(32, dtype=torch.int32)
    allowed = ((mask[:3, :words].unsqueeze(-1) >> shifts) & 1).reshape(3, -1)[:, :n].bool()
    want = wide[:, :n].clone()
    want[rows] = want[rows].masked_fill(~allowed, float("-inf"))
    assert torch.equal(after[0][:, :n], want)
    assert torch.equal(after[0][:, n:], wide[:, n:])


# -- paged attention --------------------------------------------------------------------------------------

def _decode(neon, q, kv, scales, tables, lens, scale, window, softcap, threads=THREADS):
    b, h, d = q.shape
    _, block_size, hkv, _ = kv[0].shape
    k, v = kv[0].contiguous(), kv[1].contiguous()
    out = torch.full_like(q, 7.0)
    _, after = neon.run("decode_attention", q.contiguous(), k, v, hkv * d, tables.contiguous(), tables.shape[1],
                        lens.contiguous(), out, b, h, hkv, d, block_size, float(scale), window,
                        None if scales is None else scales[0].contiguous(),
                        None if scales is None else scales[1].contiguous(), float(softcap), threads=threads)
    return after[7]


def _prefill(neon, q, kv, scales, rows, width, scale, window, softcap, out=None, threads=THREADS):
    qsl, lens, tables = _plan(rows, width)
    t, h, d = q.shape
    _, block_size, hkv, _ = kv[0].shape
    out = torch.full_like(q, float("nan")) if out is None else out
    ok, after = neon.run("prefill_attention", q.contiguous(), kv[0].contiguous(), kv[1].contiguous(), hkv * d, qsl,
                         lens, tables, width, 0, len(rows), out, h, hkv, d, block_size, float(scale), window, False,
                         None if scales is None else scales[0].contiguous(),
                         None if scales is None else scales[1].contiguous(), float(softcap), threads=threads)
    assert ok == 1
    return after[10]


# GQA ratios 3, 1, 4 and 2; head dims 64, 128, 32 and 256; a block size off the 32-key steps
@pytest.mark.parametrize("kind", ["bf16", "int8"])
@pytest.mark.parametrize("heads,kv_heads,dim,block_size", [(9, 3, 64, 16), (4, 4, 128, 7), (16, 4, 32, 16),
                                                           (4, 2, 256, 7)])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (20, 0.0), (300, 0.0), (0, CAP), (20, CAP)])
def test_decode_attention_matches_fp32_reference(neon, kind, heads, kv_heads, dim, block_size, window, softcap):
    g = torch.Generator().manual_seed(1)
    blocks, batch, width = 50, 8, 40
    kv, fp32, scales = _cache(kind, blocks, block_size, kv_heads, dim, g)
    tables = torch.randint(1, blocks, (batch, width), dtype=torch.int32, generator=g)
    # one key, block edges, the 32-key steps' edges, many blocks; 0: a padding row
    lens = torch.tensor([1, 16, 33, 100, 7, 257, width * block_size, 0], dtype=torch.int32)
    q = (torch.randn(batch, heads, dim, generator=g) * 2).bfloat16()
    scale = dim**-0.5
    ref = decode_attention(q.float(), fp32[0], fp32[1], tables, lens, scale, window or None, softcap or None)
    out = _decode(neon, q, kv, scales, tables, lens, scale, window, softcap)
    live = lens > 0
    _assert_close_to_fp32(out[live], ref[live])
    assert torch.all(out[~live] == 0)


@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_decode_rows_are_the_same_bits_alone_in_any_batch_and_on_any_thread_count(neon, kind):
    g = torch.Generator().manual_seed(2)
    heads, kv_heads, dim, blocks, block_size, width = 9, 3, 64, 40, 16, 20
    kv, _, scales = _cache(kind, blocks, block_size, kv_heads, dim, g)
    tables = torch.randint(1, blocks, (6, width), dtype=torch.int32, generator=g)
    lens = torch.tensor([1, 31, 32, 33, 200, 300], dtype=torch.int32)
    q = (torch.randn(6, heads, dim, generator=g) * 2).bfloat16()
    scale = dim**-0.5
    out = _decode(neon, q, kv, scales, tables, lens, scale, 50, CAP)
    for r in (0, 4):
        alone = _decode(neon, q[r:r + 1], kv, scales, tables[r:r + 1], lens[r:r + 1], scale, 50, CAP)
        assert torch.equal(alone[0], out[r]), r
    order = torch.tensor([5, 2, 0, 4, 1, 3])
    assert torch.equal(_decode(neon, q[order], kv, scales, tables[order], lens[order], scale, 50, CAP), out[order])
    for threads in (1, 3):
        assert torch.equal(_decode(neon, q, kv, scales, tables, lens, scale, 50, CAP, threads=threads), out)


# GQA ratios 3, 1, 4 and 16 (the most a kv head takes: one token a tile); a block size off the 32-key steps
@pytest.mark.parametrize("kind", ["bf16", "int8"])
@pytest.mark.parametrize("heads,kv_heads,dim,block_size", [(9, 3, 64, 16), (4, 4, 128, 7), (8, 2, 64, 7),
                                                           (16, 1, 32, 16)])
@pytest.mark.parametrize("window,softcap", [(0, 0.0), (50, 0.0), (0, CAP), (50, CAP)])
def test_prefill_attention_matches_fp32_reference(neon, kind, heads, kv_heads, dim, block_size, window, softcap):
    g = torch.Generator().manual_seed(3)
    contexts = [37, 50, 300, 1, 129, 200]
    q, kv, fp32, scales, ids, starts, width = _prefill_case(kind, heads, kv_heads, dim, block_size, contexts, g)
    # whole prompts, one-token chunks, and chunks after a cached prefix (the rest of q stays out of the call)
    chunks = [(0, 37), (49, 1), (100, 200), (0, 1), (64, 65), (150, 50)]  # (cached tokens, chunk tokens)
    rows, start = [], 0
    for (cached, n), ctx, blk in zip(chunks, contexts, ids):
        assert cached + n == ctx
        rows.append((start, n, ctx, blk))
        start += n
    qs = torch.cat([q[s + cached:s + ctx] for s, (cached, _), ctx in zip(starts, chunks, contexts)])
    scale = dim**-0.5
    out = _prefill(neon, qs, kv, scales, rows, width, scale, window, softcap)
    ref = []
    for (s, n, ctx, blk) in rows:
        k, v = (x[blk.long()].flatten(0, 1)[:ctx] for x in (fp32[0], fp32[1]))
        ref.append(causal_attention(qs[s:s + n].float(), k, v, scale, window or None, softcap or None))
    _assert_close_to_fp32(out, torch.cat(ref))


@pytest.mark.parametrize("kind", ["bf16", "int8"])
def test_a_query_is_the_same_bits_however_its_prompt_is_chunked_or_decoded(neon, kind):
    """Prefill of a whole prompt, of the same prompt in chunks that start off the 32-key steps and off the tiles
    (in one call, and call by call), on 1 and 3 threads, and decode of each position: the same bits."""
    g = torch.Generator().manual_seed(4)
    heads, kv_heads, dim, window = 8, 2, 64, 45
    contexts = [103, 20]
    q, kv, _, scales, ids, starts, width = _prefill_case(kind, heads, kv_heads, dim, 16, contexts, g)
    scale = dim**-0.5
    q0 = q[starts[0]:starts[0] + contexts[0]].contiguous()
    whole = _prefill(neon, q0, kv, scales, [(0, contexts[0], contexts[0], ids[0])], width, scale, window, CAP)
    for threads in (1, 3):
        again = _prefill(neon, q0, kv, scales, [(0, contexts[0], contexts[0], ids[0])], width, scale, window, CAP,
                         threads=threads)
        assert torch.equal(again, whole), threads
    cuts = [0, 5, 37, 38, 64, 103]
    rows = [(a, b - a, b, ids[0]) for a, b in zip(cuts, cuts[1:])]
    assert torch.equal(_prefill(neon, q0, kv, scales, rows, width, scale, window, CAP), whole)
    out = torch.full_like(q0, float("nan"))
    for row in rows[1:3]:  # a call per chunk leaves the other tokens of out alone
        out = _prefill(neon, q0, kv, scales, [row], width, scale, window, CAP, out=out)
    assert torch.equal(out[5:38], whole[5:38]) and torch.all(torch.isnan(out[:5].float()))
    assert torch.all(torch.isnan(out[38:].float()))
    # decode of position p over its p + 1 keys: the prefill's query at p
    lens = torch.arange(1, contexts[0] + 1, dtype=torch.int32)
    tables = ids[0].expand(contexts[0], -1).contiguous()
    assert torch.equal(_decode(neon, q0, kv, scales, tables, lens, scale, window, CAP), whole)
