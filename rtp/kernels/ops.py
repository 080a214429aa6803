"""Every kernel op of rtp's CPU kernels, defined once.

A kernel call is CALL_WORDS int64 words (what a CPU graph records and replays): word 0 is the
op's number (its place in OPS, from 1), word i its i-th field: an address or an integer as int64,
a float as the bits of a double, 0 past the op's last field. Each entry below gives the op's
name, its C function's prototype (its fields are the function's parameters, in order, with
Python defaults where the binding has them; `bool` is a C int that is 0 or 1), which field holds
the row count a replay over fewer rows patches, which fields a step graph's replay takes from the
step's plan, and the docstring of its Python entry point. Fields that are pointers are the
addresses a capture relocates into its arena.

From this table rtp/kernels/ops_codegen.py writes, at build time (setup.py runs it; the files are
not in git):
    csrc/kernel_ops.h   the RTP_OP_* enum, each op's prototype (so the compiler holds every kernel's
                        definition to its entry) and its call as a struct of named fields
    csrc/kernel_ops.c   each op's replay trampoline and rtp_ops[], the table kernel_calls.c runs
                        calls through (name, rows word, address words, the step's plan fields)
    _kernel_ops.pxi     each op's Python entry point in _cpu_kernels.pyx (it builds the call's
                        words) and OP_NAMES
A new op is its C function and one entry here (and a torch-facing wrapper in cpu_kernels.py,
which owns shapes, dtypes and allocation); tests/kernels/test_op_table.py holds the built module
to this table.

Why a Python table that generates code rather than an X-macro header: the Cython entry points
(typed, named parameters, defaults, docstrings) cannot be written by the C preprocessor, so an
X-macro would still need a generator for them; one plain-data table read by one generator keeps
a single source for both languages. It imports nothing, so setup.py, the tests and cpu_graph.py
read it without the compiled module.
"""

from __future__ import annotations

import platform
import re
from dataclasses import dataclass

CALL_WORDS = 24  # prefill attention over an int8 cache, with its softcap, takes 22

# Each architecture's ISA paths, lowest first (RTP_ISA_* from 1: csrc/cpu_features.c on x86-64,
# csrc/arm/platform.c on AArch64): an op runs the variant of the highest path of the machine's architecture
# at or below the one selected. An entry's `c` function is its variant for `isa` (avx512bf16 unless the
# entry says), `variants` maps another path (a lower x86 one, or an Arm one) to a function of the same
# parameters. An op without a variant on an architecture leaves its layers on torch there.
ISA_FAMILIES = {"x86_64": ("avx2", "avx512", "avx512bf16", "amx"), "aarch64": ("neon", "dotprod")}
FAMILY_OF = {isa: arch for arch, isas in ISA_FAMILIES.items() for isa in isas}
ARCH = {"AMD64": "x86_64", "arm64": "aarch64"}.get(platform.machine(), platform.machine())
ISAS = ISA_FAMILIES.get(ARCH, ())  # this machine's paths (none: rtp's kernels are not built here)

# What a step graph's replay puts into a field from the step's plan (rtp_run_step_calls).
DECODE_ROWS = "decode_rows"
PREFILL_ROWS = "prefill_rows"

# The word a field's value takes: its C type in the call struct, the Cython type of the parameter.
_KINDS = {  # kind: (struct type, Cython parameter type)
    "address": ("void *", "intptr_t"),
    "int64": ("int64_t", "int64_t"),
    "int": ("int64_t", "int"),
    "bool": ("int64_t", "bint"),
    "float": ("double", "float"),
}


@dataclass(frozen=True)
class Field:
    name: str
    ctype: str            # as the kernel's prototype spells it ("const uint16_t *", "int64_t", "int", "float")
    kind: str             # a key of _KINDS
    word: int             # its word in the call (1, 2, ...)
    default: str | None   # the Python entry point's default, or None
    passed: bool = True   # False: data for the replay only, not a parameter of the C function


@dataclass(frozen=True)
class Op:
    name: str
    code: int                    # word 0 of its calls (RTP_OP_<NAME>)
    function: str                # the C function a call runs
    status: bool                 # the function returns int, 0 when the call failed (else void)
    fields: tuple[Field, ...]
    rows: str | None             # the field holding the row count (replays over fewer rows patch it)
    plan: dict                   # field -> DECODE_ROWS / PREFILL_ROWS: set from the step's plan
    plan_when: str | None        # the plan fields apply only where this flag field is set
    doc: str
    isa: str = "avx512bf16"      # the lowest ISA path `function` runs on
    variants: tuple = ()         # (isa, function) for other paths: each architecture's, highest first

    @property
    def functions(self) -> tuple[tuple[str, str], ...]:
        """(isa, function) of every variant of every architecture."""
        return ((self.isa, self.function),) + self.variants

    def functions_on(self, arch: str) -> tuple[tuple[str, str], ...]:
        """(isa, function) of the variants for architecture `arch`, highest path first."""
        return tuple(v for v in self.functions if FAMILY_OF[v[0]] == arch)

    def lowest_isa_on(self, arch: str) -> str | None:
        """The lowest path of `arch` any variant runs on (None: the op has none there)."""
        here = self.functions_on(arch)
        return here[-1][0] if here else None

    @property
    def lowest_isa(self) -> str | None:
        """The lowest path of this machine's architecture any variant runs on (None: none here)."""
        return self.lowest_isa_on(ARCH)

    @property
    def words(self) -> int:
        """Words a call of this op uses (word 0 included)."""
        return 1 + len(self.fields)

    @property
    def rows_word(self) -> int:
        """The word holding the row count, 0 for none."""
        return self.field(self.rows).word if self.rows else 0

    @property
    def address_mask(self) -> int:
        """Bit i set: word i is an address."""
        return sum(1 << f.word for f in self.fields if f.kind == "address")

    def plan_word(self, count: str) -> int:
        """The word a step graph sets to `count` (DECODE_ROWS, PREFILL_ROWS), 0 for none."""
        return next((self.field(f).word for f, c in self.plan.items() if c == count), 0)

    @property
    def plan_when_word(self) -> int:
        return self.field(self.plan_when).word if self.plan_when else 0

    def field(self, name: str) -> Field:
        return next(f for f in self.fields if f.name == name)


_PROTOTYPE = re.compile(r"^(int|void) (rtp_\w+)\((.*)\)$", re.S)
_PARAM = re.compile(r"^(.*?)\s*(\w+)(?:\s*=\s*(\S+))?$")


def _fields(params: str, first_word: int, passed: bool) -> list[Field]:
    fields = []
    for i, p in enumerate(x.strip() for x in params.split(",") if x.strip()):
        ctype, name, default = _PARAM.match(p).groups()
        ctype = ctype.strip()
        if ctype.endswith("*"):
            kind = "address"
        else:
            kind = {"int64_t": "int64", "int": "int", "bool": "bool", "float": "float"}[ctype]
            ctype = "int" if ctype == "bool" else ctype
        fields.append(Field(name, ctype, kind, first_word + i, default, passed))
    return fields


def _ops(*entries) -> tuple[Op, ...]:
    ops = []
    for code, e in enumerate(entries, 1):
        status, function, params = _PROTOTYPE.match(" ".join(e["c"].split())).groups()
        fields = _fields(params, 1, True)
        fields += _fields(e.get("replay", ""), 1 + len(fields), False)
        isa = e.get("isa", "avx512bf16")

        def rank(v):  # each architecture's variants together, highest first
            family = ISA_FAMILIES[FAMILY_OF[v[0]]]
            return FAMILY_OF[v[0]], -family.index(v[0])

        variants = tuple(sorted(e.get("variants", {}).items(), key=rank))
        x86 = ISA_FAMILIES["x86_64"]
        assert all(x86.index(v) < x86.index(isa) for v, _ in variants if FAMILY_OF[v] == "x86_64"), \
            f"{e['name']}: a variant above its isa"
        op = Op(e["name"], code, function, status == "int", tuple(fields), e.get("rows"), e.get("plan", {}),
                e.get("plan_when"), e["doc"], isa, variants)
        names = [f.name for f in fields]
        assert op.words <= CALL_WORDS, f"{op.name}: {op.words} words, a call holds {CALL_WORDS}"
        assert len(set(names)) == len(names), f"{op.name}: a field name twice"
        assert all(n in names for n in [op.rows or names[0], op.plan_when or names[0], *op.plan]), op.name
        assert all(c in (DECODE_ROWS, PREFILL_ROWS) for c in op.plan.values()), op.name
        ops.append(op)
    return tuple(ops)


# The order is the ops' numbers, which recorded calls hold: append, never reorder.
OPS = _ops(
    dict(name="linear_q4_1", rows="rows", variants={"avx2": "rtp_linear_q4_1_avx2", "neon": "rtp_linear_q4_1_neon",
                   "dotprod": "rtp_linear_q4_1_dotprod"},
         c="""int rtp_linear_q4_1(const uint16_t *x, int64_t ldx, const uint8_t *qs, const float *d, const float *m,
              const float *bias, void *out, int64_t ldo, bool out_bf16, int64_t rows, int64_t n, int64_t k)""",
         doc="out = x @ dequant(Q4_1 weight).T (+ bias); x bf16."),
    dict(name="linear_q8", rows="rows", variants={"avx2": "rtp_linear_q8_avx2", "neon": "rtp_linear_q8_neon",
                   "dotprod": "rtp_linear_q8_dotprod"},
         c="""void rtp_linear_q8(const float *x, int64_t ldx, const int8_t *qs, const float *d, const float *mn,
              int group, const float *bias, void *out, int64_t ldo, bool out_bf16, int64_t rows, int64_t n,
              int64_t k)""",
         doc="out = x @ dequant(int8 blocks).T (+ bias): d per `group` (32 or 16) weights, mn per 32 or 0; x fp32."),
    dict(name="linear_tiles", rows="rows", plan={"bf16_rows": DECODE_ROWS}, plan_when="bf16_rows_decode",
         c="""int rtp_linear_tiles(const void *x, int64_t ldx, bool x_fp32, int kind, const uint8_t *weights,
              const float *bias, void *out, int64_t ldo, bool out_bf16, int64_t rows, int64_t n, int64_t k,
              bool glu, bool amx, int64_t bf16_rows=0)""",
         replay="bool bf16_rows_decode=False",
         doc="""out = x @ dequant(weight).T (+ bias) from weight records in tile order (kind 0 Q4_1, 1 Q8_0,
    2 Q8_1, 3 Q8 with scales per 16, 4 bf16; 5 and 6: the records of 0 and 1 with x's rows quantized to
    int8, vnni_gemm.c, where the CPU has VNNI and the call is not on AMX; the first bf16_rows rows in
    bf16 all the same); x bf16 or fp32. glu: weight is gate and up interleaved by tiles, out bf16
    [rows, n / 2] = silu(gate) * up. amx: on AMX tiles (amx_linear.c, amx_gemm.c), else with AVX-512
    BF16 (avx_gemm.c). bf16_rows_decode: a step graph's replay sets bf16_rows to the step's decode rows."""),
    dict(name="add_rms_norm", variants={"avx2": "rtp_add_rms_norm_avx2", "neon": "rtp_add_rms_norm_neon"}, rows="t",
         c="""void rtp_add_rms_norm(float *residual, int64_t ldr, const void *delta, bool delta_bf16, int64_t ldd,
              const void *weight, bool weight_bf16, float eps, void *out, bool out_bf16, int64_t ldo, int64_t t,
              int64_t h)""",
         doc="residual += delta (0: none); out = rmsnorm(residual) * weight."),
    dict(name="rope_store_kv", variants={"avx2": "rtp_rope_store_kv_avx2", "neon": "rtp_rope_store_kv_neon"}, rows="t",
         c="""int rtp_rope_store_kv(const uint16_t *qkv, int64_t ldq, const int32_t *positions, const float *cos_sin,
              int64_t rot, uint16_t *q_out, void *k_cache, void *v_cache, int64_t tok_stride, const int64_t *slots,
              int64_t t, int64_t h, int64_t hkv, int64_t d, int64_t num_slots, float *k_scales=0,
              float *v_scales=0)""",
         doc="""Rotate q, k of a fused qkv output; q to q_out, k and v into the cache (num_slots slots) at
    slots: bf16, or int8 with their fp32 scales (k_scales, v_scales [num_slots, hkv]; 0: bf16).
    IndexError, after the call, when a slot lies outside the cache (nothing written there)."""),
    dict(name="decode_attention", rows="b", plan={"b": DECODE_ROWS},
         c="""void rtp_paged_decode_attention_bf16(const uint16_t *q, const void *k_cache, const void *v_cache,
              int64_t tok_stride, const int32_t *block_tables, int64_t ldt, const int32_t *seq_lens, uint16_t *out,
              int64_t b, int64_t h, int64_t hkv, int64_t d, int64_t block_size, float scale, int64_t window,
              const float *k_scales=0, const float *v_scales=0, float softcap=0)""",
         doc="""One bf16 query token per row over paged bf16 K/V, or int8 K/V with fp32 scales (k_scales,
    v_scales: [slots, hkv]; 0: bf16); softcap > 0: scores -> softcap * tanh(scores / softcap) (0:
    none); see attention/decode_attention.c for the layout.""",
         variants={"avx2": "rtp_paged_decode_attention_bf16_avx2",
                   "neon": "rtp_paged_decode_attention_bf16_neon"}),
    dict(name="embed_rows", variants={"avx2": "rtp_embed_rows_avx2", "neon": "rtp_embed_rows_neon"}, rows="t",
         c="""void rtp_embed_rows(const void *table, bool table_bf16, int64_t ldt, const int32_t *ids, float *out,
              int64_t ldo, int64_t t, int64_t h, float scale=1.0)""",
         doc="out fp32 [t, h] = table rows at ids (int32), times scale rounded to the table's dtype (1: as they are)."),
    dict(name="silu_mul", variants={"avx2": "rtp_silu_mul_avx2", "neon": "rtp_silu_mul_neon"}, rows="t",
         c="void rtp_silu_mul(const uint16_t *x, int64_t ldx, uint16_t *out, int64_t ldo, int64_t t, int64_t i)",
         doc="out bf16 [t, i] = silu(x[:, :i]) * x[:, i:] for x bf16 [t, 2i]."),
    # no rows field: its rows are the plan's (first_row, nseq), which a step graph's replay sets
    dict(name="prefill_attention", plan={"first_row": DECODE_ROWS, "nseq": PREFILL_ROWS},
         c="""int rtp_prefill_attention_bf16(const uint16_t *q, const void *k_cache, const void *v_cache,
              int64_t tok_stride, const int32_t *qsl, const int32_t *seq_lens, const int32_t *tables, int64_t ldt,
              int64_t first_row, int64_t nseq, uint16_t *out, int64_t h, int64_t hkv, int64_t d,
              int64_t block_size, float scale, int64_t window, bool amx, const float *k_scales=0,
              const float *v_scales=0, float softcap=0)""",
         doc="""Causal varlen attention of a step plan's rows [first_row, first_row + nseq) over paged bf16 K/V, or
    int8 K/V with fp32 scales (k_scales, v_scales [slots, hkv]; 0: bf16); softcap as
    decode_attention's; see attention/prefill_attention.c.""",
         variants={"avx2": "rtp_prefill_attention_bf16_avx2",
                   "neon": "rtp_prefill_attention_bf16_neon"}),
    dict(name="gather_rows", rows="n", isa="avx2", variants={"neon": "rtp_gather_rows"},  # plain C: both
         c="""void rtp_gather_rows(const void *src, int64_t src_stride, const int32_t *idx, int64_t n, void *out,
              int64_t out_stride, int64_t row_bytes)""",
         doc="out row i = src row idx[i] (int32), row_bytes each, strides in bytes."),
    dict(name="linear_q4_k", rows="rows",
         c="""int rtp_linear_q4_k(const uint16_t *x, int64_t ldx, const uint8_t *qs, const uint8_t *scm,
              const float *dd, const float *bias, void *out, int64_t ldo, bool out_bf16, int64_t rows, int64_t n,
              int64_t k)""",
         doc="out = x @ (Q4_K super-blocks, rtp's q4_k layout).T (+ bias); x bf16."),
    dict(name="linear_bf16", rows="rows", variants={"avx2": "rtp_linear_bf16_avx2", "neon": "rtp_linear_bf16_neon"},
         c="""void rtp_linear_bf16(const void *x, int64_t ldx, bool x_fp32, const uint16_t *w, int64_t ldw,
              const float *bias, void *out, int64_t ldo, bool out_bf16, int64_t rows, int64_t n, int64_t k)""",
         doc="out = x @ W.T (+ bias) for dense bf16 W [n, k] (row stride ldw); x bf16 or fp32."),
    dict(name="linear_u8", rows="rows", variants={"avx2": "rtp_linear_u8_avx2", "neon": "rtp_linear_u8_neon",
                   "dotprod": "rtp_linear_u8_dotprod"},
         c="""int rtp_linear_u8(const void *x, int64_t ldx, bool x_fp32, const int8_t *qs, const float *d,
              const float *mn, int group, int offset, const float *bias, void *out, int64_t ldo, bool out_bf16,
              int64_t rows, int64_t n, int64_t k)""",
         doc="out = x @ W.T (+ bias) for small int8 blocks (q8_1: offset 0, group 32, mn; q8_16: offset 32, "
             "group 16)."),
    dict(name="rms_norm", variants={"avx2": "rtp_rms_norm_avx2", "neon": "rtp_rms_norm_neon"}, rows="t",
         c="""void rtp_rms_norm(const void *x, int64_t ldx, bool x_bf16, const void *weight, bool weight_bf16,
              float eps, void *out, int64_t ldo, bool out_bf16, int64_t t, int64_t h)""",
         doc="out [t, h] = rmsnorm(x [t, h]) * weight; x, weight and out each bf16 or fp32 (strides in their "
             "elements)."),
    dict(name="qk_rms_norm", variants={"avx2": "rtp_qk_rms_norm_avx2", "neon": "rtp_qk_rms_norm_neon"}, rows="t",
         c="""void rtp_qk_rms_norm(uint16_t *qkv, int64_t ldq, const void *q_weight, const void *k_weight,
              bool weight_bf16, float eps, int64_t t, int64_t h, int64_t hkv, int64_t d)""",
         doc="In place: each q head (h of them) and k head (hkv) of qkv bf16 [t, (h + 2 hkv) d] normed with its "
             "weight."),
    dict(name="gelu_tanh_mul", variants={"avx2": "rtp_gelu_tanh_mul_avx2", "neon": "rtp_gelu_tanh_mul_neon"}, rows="t",
         c="void rtp_gelu_tanh_mul(const uint16_t *x, int64_t ldx, uint16_t *out, int64_t ldo, int64_t t, int64_t i)",
         doc="out bf16 [t, i] = gelu_tanh(x[:, :i]) * x[:, i:] for x bf16 [t, 2i]."),
    dict(name="softcap", variants={"avx2": "rtp_softcap_avx2", "neon": "rtp_softcap_neon"}, rows="t",
         c="void rtp_softcap(float *x, int64_t ldx, float cap, int64_t t, int64_t n)",
         doc="In place: x fp32 [t, n] = cap * tanh(x / cap)."),
    dict(name="moe_experts", rows="t", isa="avx512",  # its tile orders only where the tile linears run
         c="""int rtp_moe_experts(const uint16_t *x, int64_t ldx, const void *logits, int64_t ldl, bool logits_bf16,
              int64_t t, int64_t hidden, int64_t inter, int64_t experts, int64_t top_k, bool renormalize,
              const int64_t *expert_slots, int64_t max_replicas, const int64_t *replica_count, int64_t *expert_load,
              int64_t slots, const int64_t *w13, const int64_t *w2, int kind13, int kind2, int order,
              float *out, int64_t ldo)""",
         doc="""A MoE layer's routed experts for x bf16 [t, hidden] from its router logits [t, experts]: softmax,
    top_k (renormalised where asked), each pair dealt to a replica slot (expert_slots [experts, max_replicas],
    replica_count; expert_load += pairs per expert unless 0), each slot's rows through its [gate | up] and
    down records (w13, w2: [slots] record addresses; order 0: glu tiles and tiles, 1: the same on AMX, 2: both
    in lane order),
    out fp32 [t, hidden] = the weighted sum over k in k order (csrc/moe.c)."""),
    dict(name="linear_lanes", rows="rows", isa="avx512",
         c="""int rtp_linear_lanes(const void *x, int64_t ldx, bool x_fp32, int kind, const uint8_t *weights,
              const float *bias, void *out, int64_t ldo, bool out_bf16, int64_t rows, int64_t n, int64_t k)""",
         doc="""out = x @ dequant(weight).T (+ bias) from weight records in lane order (BlockQuantized.lane_layout; kind 0
    Q4_1, 1 Q8_0, 2 Q8_1, 3 Q8 with scales per 16) with x's rows as 15-bit integer blocks, on AVX-512 VNNI
    (avx512/linear_lanes.c: the avx512 path's linears, every batch); x bf16 or fp32."""),
    dict(name="add_sigmoid_gated", rows="t", isa="avx2", variants={"neon": "rtp_add_sigmoid_gated"},  # plain C: both
         c="""void rtp_add_sigmoid_gated(float *out, int64_t ldo, const void *gate, bool gate_bf16, int64_t ldg,
              const uint16_t *y, int64_t ldy, int64_t t, int64_t h)""",
         doc="In place: out fp32 [t, h] += sigmoid(gate [t, 1], bf16 or fp32) * y bf16 [t, h] (Qwen2-MoE's shared "
             "expert)."),
)

BY_CODE = {op.code: op for op in OPS}
BY_NAME = {op.name: op for op in OPS}


def op_name(code: int) -> str:
    """The name of the op whose calls have word 0 `code`."""
    op = BY_CODE.get(code)
    return op.name if op else f"op {code}"


def rows_word(code: int) -> int:
    """The word of a call that holds its row count (0: none, or no such op)."""
    op = BY_CODE.get(code)
    return op.rows_word if op else 0


def address_words(code: int) -> int:
    """Bitmask of the words of a call that hold addresses (0 for no such op)."""
    op = BY_CODE.get(code)
    return op.address_mask if op else 0
