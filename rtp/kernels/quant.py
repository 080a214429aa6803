"""Block-quantized weights kept in the checkpoint's own format, multiplied from their blocks.

A GGUF checkpoint stores most matrices as blocks of 32 weights (Q4_1, Q8_0) or super-blocks
of 256 (the K-quants). Each is repacked exactly, at load, into one of four layouts rtp's kernels
multiply: Q4_K and Q4_0 into q4_1, Q5_0, Q5_1 and Q5_K into q8_1, Q6_K into q8_16, IQ4_NL and
IQ4_XS into q8_0 (from_q4_k and the others below). A decode step is bound by reading the
weights, so the linear layers keep the packed blocks (a third to a half of bf16's bytes) and
multiply them directly with rtp's CPU kernels:
  - one row: the AVX-512 kernel over the blocks, exact fp32 weights (csrc/linear/q4_1.c and its siblings);
  - every larger batch: the blocks in tile order (tile_layout), dequantized to the model's bf16
    weights in L1 and multiplied, from 2 rows on (TILE_MIN_ROWS) -- on CPUs with AMX on the tile
    unit: decode batches (amx_linear.c) and prompt-sized ones, prefill chunks and mixed steps, as a
    GEMM that dequantizes each tile once for all the rows (amx_gemm.c); without AMX with AVX-512
    BF16 dot products (avx_gemm.c). Such a layer then needs no dense bf16 copy of its weights
    (serves_every_batch): the loader drops it.

Packed layout (per matrix of N rows by K columns, K a multiple of 32):
  q4_1:  qs uint8 [N, K/2], d fp32 [N, K/32], m fp32 [N, K/32]   (w = d * q + m)
  q8_0:  qs int8  [N, K],   d fp32 [N, K/32]                      (w = d * q)
  q8_1:  qs int8  [N, K],   d fp32 [N, K/32], m fp32 [N, K/32]   (w = d * q + m, q in 0..31)
  q8_16: qs int8  [N, K],   d fp32 [N, K/16]                      (w = d * q, a scale per 16 weights)
The int8 layouts hold 5- and 6-bit weights in a byte each: more bytes than the file (1.25 a
weight against Q5_K's 0.69 and Q6_K's 0.82), fewer than bf16's 2, and the kernels that take
int8 blocks multiply them.
(d and m are the file's fp16 values widened: more bytes, but the kernels are bound by
shuffle work per block, which fp16 scales would add to.)
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch

from rtp.kernels import cpu_kernels, hugepages

BLOCK = 32
_BLOCK_BYTES = {"q4_1": 20, "q8_0": 34}  # GGUF bytes per block of 32 weights
# the AMX kernels' kind codes (rtp/kernels/csrc/tile_blocks.h), and each kind's weights per scale
TILE_KIND = {"q4_1": 0, "q8_0": 1, "q8_1": 2, "q8_16": 3, "bf16": 4}
# Q4_1's and Q8_0's records with x's rows quantized to int8 (--activation-dtype int8 and int8-prefill; vnni_gemm.c)
TILE_KIND_INT8_ROWS = {"q4_1": 5, "q8_0": 6}
GROUP = {"q4_1": 32, "q8_0": 32, "q8_1": 32, "q8_16": 16}
# the kinds the avx512 path's lane-order kernel takes (its kind code: TILE_KIND's)
LANE_KINDS = ("q4_1", "q8_0", "q8_1", "q8_16")
# the small-int8 kinds the one-row u8 kernel takes, and the offset that makes q + 128 + offset a bf16
_U8_OFFSET = {"q8_1": 0, "q8_16": 32}
# q8_0 with bf16 x takes rtp_linear_u8 too, q split into two nibble halves (U8_SPLIT in csrc/linear/u8.c);
# fp32 x (the LM head's input) keeps rtp_linear_q8, which multiplies it unrounded
U8_SPLIT = 2176


# The kernel ops (rtp/kernels/ops.py) each kind's linear takes (BlockQuantized.linear), whatever x's dtype.
_KIND_OPS = {"q4_1": ("linear_q4_1",), "q8_0": ("linear_u8", "linear_q8"), "q8_1": ("linear_u8",),
             "q8_16": ("linear_u8",), "bf16": ("linear_bf16",)}

# Row ranges where each kernel measured fastest (docs/benchmarks.md, "Decode step").
QUANT_MAX_ROWS = 4   # the one-row AVX-512 kernel, for a layer without tiles (N not a multiple of 16)
AMX_MIN_ROWS = 2     # one row: the AVX-512 kernel reads fewer bytes (no bf16 tile round trip)
# The fewest rows the tile-order kernels take, with AMX or without: every batch of several rows then
# multiplies the same bf16 weights in the same order per row, so a request's tokens do not depend on
# how many rows share its step (a drafting engine's greedy output is the plain one's, token for token:
# tests/engine/test_draft_model.py). Without AMX the one-row kernel is still faster at 2 rows (AMD
# Zen 5, SmolLM2's qkv: 0.017 ms for one row, 0.022 for two on avx_gemm.c's few-row loop, 0.042 before
# it), but it multiplies the exact fp32 weights, and mixing the two by row count broke that test.
TILE_MIN_ROWS = AMX_MIN_ROWS

# Deterministic (the default): one row takes the tile-order kernels too, so every batch, one row
# included, multiplies the same bf16 weights in the same order per row, and a request's bits never
# depend on how many rows share its step (docs/determinism.md). Off (--no-deterministic): one row
# multiplies the exact fp32 weights on the AVX-512 kernels, and so do the rows of a step that are all
# one request's (_exact_rows) -- a lone request's numbers then differ from the same request's beside
# others.
_deterministic = True

# Batches of up to this many rows multiply the exact weights (the AVX-512 kernels) even where AMX
# tiles exist, when not deterministic: the runner sets it for a step whose rows are all one request's
# -- its last token and the tokens it drafted (speculative decoding) -- so that they meet the numbers
# the request meets when it decodes a token a step alone. Every kernel treats rows independently.
_exact_rows = 1


def set_deterministic(on: bool) -> None:
    """Whether one row takes the tile kernels (True, the default) or the exact one-row kernels."""
    global _deterministic
    _deterministic = bool(on)


def deterministic() -> bool:
    return _deterministic


@contextlib.contextmanager
def determinism(on: bool):
    """Within: set_deterministic(on), the setting before restored after (tests, tools)."""
    previous = _deterministic
    set_deterministic(on)
    try:
        yield
    finally:
        set_deterministic(previous)


def _tiles_take(rows: int) -> bool:
    """Whether a batch of `rows` rows takes the tile-order kernels (where a layer has tiles)."""
    if _deterministic:
        return rows >= 1
    return rows >= TILE_MIN_ROWS and rows > _exact_rows


@contextlib.contextmanager
def exact_rows(rows: int):
    """Within: batches of up to `rows` rows take the one-row kernels' exact fp32 weights."""
    global _exact_rows
    previous, _exact_rows = _exact_rows, max(1, rows)
    try:
        yield
    finally:
        _exact_rows = previous


# A step's first rows decode (the scheduler puts them before the prompt chunks): with
# --activation-dtype int8-prefill they stay bf16, and only the prompt rows are multiplied as int8.
_decode_rows = 0


@contextlib.contextmanager
def decode_rows(rows: int):
    """Within: the first `rows` rows of every batch are decode rows (forward_context sets it per step)."""
    global _decode_rows
    previous, _decode_rows = _decode_rows, max(0, rows)
    try:
        yield
    finally:
        _decode_rows = previous


def _q4_k_scales(scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The eight 6-bit scales and mins packed in a K-quant's 12 scale bytes, as float32:
    blocks 0-3 take the low 6 bits of bytes 0-3 (scales) and 4-7 (mins); blocks 4-7 take
    a nibble of bytes 8-11 and their top 2 bits from the top of bytes 0-3 / 4-7."""
    s = scales.astype(np.uint8)
    sc = np.empty(s.shape[:-1] + (8,), dtype=np.float32)
    mn = np.empty_like(sc)
    sc[..., :4] = s[..., 0:4] & 63
    mn[..., :4] = s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0x0F) | ((s[..., 0:4] >> 6) << 4)
    mn[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    return sc, mn


# IQ4_NL's and IQ4_XS's codebook (ggml's kvalues_iq4nl): a nibble's weight, before the block's scale
IQ4_VALUES = np.array([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=np.int8)


def _iq4_values(qs: np.ndarray) -> np.ndarray:
    """IQ4 blocks' 16 nibble bytes each ([..., 16]; byte j: weight j low, weight j + 16 high) as their
    codebook values, int8 [..., 32]."""
    return np.ascontiguousarray(np.concatenate([IQ4_VALUES[qs & 0x0F], IQ4_VALUES[qs >> 4]], axis=-1))


@dataclass
class BlockQuantized:
    kind: str                   # "q4_1", "q8_0", "q8_1", "q8_16", or "bf16" (a dense layer's own weights)
    qs: torch.Tensor
    d: torch.Tensor | None      # None for bf16
    m: torch.Tensor | None      # q4_1 and q8_1
    tiles: torch.Tensor | None = None  # the same blocks in AMX tile order (tile_layout), when made
    glu: bool = False           # tiles interleave gate and up (an MLP's gate_up): only silu_mul reads them
    # a Q4_K file's own super-blocks (qs uint8 [N, K/2], scm uint8 [N, K/256, 16], dd fp32 [N, K/256, 2]),
    # which the one-row kernel multiplies: 0.59 bytes a weight where q4_1 reads 0.75
    native: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # which of x's rows the tile kernels quantize to int8 for these weights: "all" (--activation-dtype int8)
    # or "prefill", a step's prompt rows but not its decode rows (int8-prefill); Q4_1 and Q8_0 on a CPU with
    # AVX-512 VNNI and no AMX (rtp/kernels/csrc/vnni_gemm.c); elsewhere it changes nothing
    int8_rows: str | None = None
    # keep_only_tiles() ran: qs, d, m and native are gone, the tiles take every batch, and `shape` is this
    only_tiles: tuple[int, int] | None = None
    # the same blocks in lane order (lane_layout), on the avx512 path (AVX-512 with VNNI, no BF16): they take every
    # batch, and the blocks are dropped (only_tiles set)
    lanes: torch.Tensor | None = None

    def __post_init__(self):
        # the kernels read d and m as fp32 by address: another dtype (numpy's float64 from float32 times an
        # integer array) would be read as garbage, so it is refused here, where a repack makes it
        for name, t in (("d", self.d), ("m", self.m)):
            if t is not None and t.dtype != torch.float32:
                raise TypeError(f"BlockQuantized {self.kind}: {name} is {t.dtype}, not torch.float32")

    @property
    def tile_kind(self) -> int:
        """The kind code the tile kernels take for these weights."""
        if self.int8_rows and self.kind in TILE_KIND_INT8_ROWS:
            return TILE_KIND_INT8_ROWS[self.kind]
        return TILE_KIND[self.kind]

    def _tile_rows(self, rows: int) -> tuple[int, int, bool]:
        """For a batch of `rows` rows: the tile kernels' kind, how many first rows stay bf16 all the
        same, and whether a step graph's replay sets those to its step's decode rows."""
        if self.int8_rows != "prefill" or self.kind not in TILE_KIND_INT8_ROWS:
            return self.tile_kind, 0, False
        if rows <= _decode_rows:  # decode rows only: the plain kind, so a decode graph records no split
            return TILE_KIND[self.kind], 0, False
        return TILE_KIND_INT8_ROWS[self.kind], _decode_rows, True

    @property
    def shape(self) -> tuple[int, int]:
        if self.only_tiles is not None:
            return self.only_tiles
        per_byte = 2 if self.kind == "q4_1" else 1
        return self.qs.shape[0], self.qs.shape[1] * per_byte

    @classmethod
    def from_dense(cls, weight: torch.Tensor) -> "BlockQuantized":
        """A dense bf16 layer's weight [N, K] (the tensor itself, not a copy), for rtp's kernels: the
        one-row kernel reads it as it lies, the AMX kernels a copy in tile order (with_tile_layout).
        Without them such a layer ran on oneDNN, which a CPU graph cannot replay."""
        return cls("bf16", weight.detach(), None, None)

    @classmethod
    def from_gguf(cls, kind: str, raw: np.ndarray, rows: int) -> "BlockQuantized":
        """Repack a GGUF tensor's raw blocks (any shape, row-major, `rows` rows)."""
        b = np.asarray(raw, dtype=np.uint8).reshape(rows, -1, _BLOCK_BYTES[kind])
        d = torch.from_numpy(np.ascontiguousarray(b[:, :, 0:2]).view(np.float16)[..., 0].astype(np.float32))
        if kind == "q4_1":
            m = torch.from_numpy(np.ascontiguousarray(b[:, :, 2:4]).view(np.float16)[..., 0].astype(np.float32))
            qs = torch.from_numpy(np.ascontiguousarray(b[:, :, 4:]).reshape(rows, -1))
            return cls(kind, qs, d, m)
        qs = torch.from_numpy(np.ascontiguousarray(b[:, :, 2:]).reshape(rows, -1).view(np.int8))
        return cls(kind, qs, d, None)

    @classmethod
    def from_q4_0(cls, raw: np.ndarray, rows: int) -> "BlockQuantized":
        """GGUF Q4_0 (w = d * (q - 8)) as q4_1, exactly: the same nibbles, m = -8 d."""
        b = np.asarray(raw, dtype=np.uint8).reshape(rows, -1, 18)
        d = np.ascontiguousarray(b[:, :, 0:2]).view(np.float16)[..., 0].astype(np.float32)
        qs = np.ascontiguousarray(b[:, :, 2:]).reshape(rows, -1)
        return cls("q4_1", torch.from_numpy(qs), torch.from_numpy(d), torch.from_numpy(-8.0 * d))

    @classmethod
    def from_q5_0(cls, raw: np.ndarray, rows: int) -> "BlockQuantized":
        """GGUF Q5_0 (w = d * (q - 16), q of 5 bits: a nibble in qs, the fifth bit in qh) as q8_1, exactly:
        q with the same d and m = -16 d (d q and d (q - 16) have at most 16 significant bits: exact in
        fp32, so d q + m is the file's weight). As q8_1 the one-row kernel builds bf16 weights in two
        instructions (rtp_linear_u8), where q8_0's signed bytes need a widening to fp32 each."""
        b = np.asarray(raw, dtype=np.uint8).reshape(rows, -1, 22)
        d = np.ascontiguousarray(b[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)
        high = np.ascontiguousarray(b[..., 2:6]).view("<u4")[..., 0]           # bit j: weight j's fifth bit
        qs = b[..., 6:22]
        nibbles = np.concatenate([qs & 0x0F, qs >> 4], axis=-1).astype(np.int16)  # weights 0-15, 16-31
        fifth = (high[..., None] >> np.arange(32, dtype=np.uint32)) & 1
        q = nibbles | (fifth.astype(np.int16) << 4)
        return cls("q8_1", torch.from_numpy(np.ascontiguousarray(q.astype(np.int8).reshape(rows, -1))),
                   torch.from_numpy(np.ascontiguousarray(d)), torch.from_numpy(np.ascontiguousarray(-16.0 * d)))

    @classmethod
    def from_q4_k(cls, raw: np.ndarray, rows: int) -> "BlockQuantized":
        """GGUF Q4_K as q4_1, exactly. A Q4_K super-block of 256 weights is eight blocks of 32,
        each w = (d * sc) q - (dmin * mn) with 6-bit sc and mn: that is q4_1's w = d' q + m' per
        block of 32, with d' and m' exact in fp32 (11-bit fp16 mantissas times 6-bit integers).
        Only the nibbles move: Q4_K keeps two blocks in the low and high halves of 32 bytes,
        q4_1 one block in 16 bytes (byte j: weight j low, weight j + 16 high)."""
        b = np.asarray(raw, dtype=np.uint8).reshape(rows, -1, 144)   # [N, K/256, 144]
        d = np.ascontiguousarray(b[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)
        dmin = np.ascontiguousarray(b[..., 2:4]).view(np.float16)[..., 0].astype(np.float32)
        sc, mn = _q4_k_scales(b[..., 4:16])                            # [N, K/256, 8] each
        qs = b[..., 16:].reshape(rows, -1, 4, 32)                      # 4 pairs of blocks
        low, high = qs & 0x0F, qs >> 4                                 # block 2p, block 2p + 1
        blocks = np.stack([low, high], axis=3).reshape(rows, -1, 8, 32)  # [N, K/256, 8, 32] values
        packed = blocks[..., :16] | (blocks[..., 16:] << 4)
        d_block = (d[..., None] * sc).reshape(rows, -1)
        m_block = (-(dmin[..., None] * mn)).reshape(rows, -1)
        native = (torch.from_numpy(np.ascontiguousarray(b[..., 16:].reshape(rows, -1))),
                  torch.from_numpy(np.ascontiguousarray(np.concatenate([sc, mn], axis=-1).astype(np.uint8))),
                  torch.from_numpy(np.ascontiguousarray(np.stack([d, dmin], axis=-1))))
        return cls("q4_1", torch.from_numpy(np.ascontiguousarray(packed.reshape(rows, -1))),
                   torch.from_numpy(np.ascontiguousarray(d_block)), torch.from_numpy(np.ascontiguousarray(m_block)),
                   native=native)

    @classmethod
    def from_q5_1(cls, raw: np.ndarray, rows: int) -> "BlockQuantized":
        """GGUF Q5_1 (w = d * q + m, q of 5 bits: a nibble in qs, the fifth bit in qh) as q8_1, exactly."""
        b = np.asarray(raw, dtype=np.uint8).reshape(rows, -1, 24)
        d = np.ascontiguousarray(b[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)
        m = np.ascontiguousarray(b[..., 2:4]).view(np.float16)[..., 0].astype(np.float32)
        high = np.ascontiguousarray(b[..., 4:8]).view("<u4")[..., 0]
        qs = b[..., 8:24]
        nibbles = np.concatenate([qs & 0x0F, qs >> 4], axis=-1)                 # weights 0-15, 16-31
        fifth = ((high[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
        q = (nibbles | (fifth << 4)).astype(np.int8)
        return cls("q8_1", torch.from_numpy(np.ascontiguousarray(q.reshape(rows, -1))),
                   torch.from_numpy(np.ascontiguousarray(d)), torch.from_numpy(np.ascontiguousarray(m)))

    @classmethod
    def from_q5_k(cls, raw: np.ndarray, rows: int) -> "BlockQuantized":
        """GGUF Q5_K as q8_1, exactly: a super-block of 256 is eight blocks of 32, each w = (d sc) q -
        (dmin mn) with q of 5 bits (low nibbles in qs, two blocks a 32-byte run; the fifth bits in
        qh, bit j of byte i for block j)."""
        b = np.asarray(raw, dtype=np.uint8).reshape(rows, -1, 176)   # [N, K/256, 176]
        d = np.ascontiguousarray(b[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)
        dmin = np.ascontiguousarray(b[..., 2:4]).view(np.float16)[..., 0].astype(np.float32)
        sc, mn = _q4_k_scales(b[..., 4:16])
        qh, qs = b[..., 16:48], b[..., 48:176]
        low = np.stack([qs.reshape(rows, -1, 4, 32) & 0x0F, qs.reshape(rows, -1, 4, 32) >> 4], axis=3)
        low = low.reshape(rows, -1, 8, 32)                             # [N, K/256, block, weight]
        fifth = (qh[..., None, :] >> np.arange(8, dtype=np.uint8)[:, None]) & 1
        q = (low | (fifth << 4)).astype(np.int8).reshape(rows, -1)
        return cls("q8_1", torch.from_numpy(np.ascontiguousarray(q)),
                   torch.from_numpy(np.ascontiguousarray((d[..., None] * sc).reshape(rows, -1))),
                   torch.from_numpy(np.ascontiguousarray((-(dmin[..., None] * mn)).reshape(rows, -1))))

    @classmethod
    def from_q6_k(cls, raw: np.ndarray, rows: int) -> "BlockQuantized":
        """GGUF Q6_K as q8_16, exactly: a super-block of 256 holds sixteen groups of 16, each w =
        (d sc) (q - 32) with an int8 sc per group and q of 6 bits (4 in ql, 2 in qh)."""
        b = np.asarray(raw, dtype=np.uint8).reshape(rows, -1, 210)   # [N, K/256, 210]
        ql, qh = b[..., 0:128], b[..., 128:192]
        sc = np.ascontiguousarray(b[..., 192:208]).view(np.int8).astype(np.float32)
        d = np.ascontiguousarray(b[..., 208:210]).view(np.float16)[..., 0].astype(np.float32)
        low = np.stack([ql.reshape(rows, -1, 2, 64) & 0x0F, ql.reshape(rows, -1, 2, 64) >> 4], axis=3)
        low = low.reshape(rows, -1, 8, 32)      # half h, nibble: blocks 4h + 2 nibble + (byte >= 32)
        high = (qh.reshape(rows, -1, 2, 1, 32) >> np.array([0, 2, 4, 6], dtype=np.uint8)[:, None]) & 3
        high = high.reshape(rows, -1, 8, 32)    # half h, shift s: block 4h + s
        q = ((low | (high << 4)).astype(np.int16) - 32).astype(np.int8).reshape(rows, -1)
        return cls("q8_16", torch.from_numpy(np.ascontiguousarray(q)),
                   torch.from_numpy(np.ascontiguousarray((d[..., None] * sc).reshape(rows, -1))), None)

    @classmethod
    def from_iq4_nl(cls, raw: np.ndarray, rows: int) -> "BlockQuantized":
        """GGUF IQ4_NL (w = d * IQ4_VALUES[q], a nibble indexing a fixed non-linear codebook of int8 values;
        Q4_0's nibble order) as q8_0, exactly: the codebook's values with the block's d. Twice the file's
        bytes, against bf16's four times, and the int8 kernels."""
        b = np.asarray(raw, dtype=np.uint8).reshape(rows, -1, 18)
        d = np.ascontiguousarray(b[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)
        return cls("q8_0", torch.from_numpy(_iq4_values(b[..., 2:18]).reshape(rows, -1)),
                   torch.from_numpy(np.ascontiguousarray(d)), None)

    @classmethod
    def from_iq4_xs(cls, raw: np.ndarray, rows: int) -> "BlockQuantized":
        """GGUF IQ4_XS as q8_0, exactly: a super-block of 256 is eight blocks of 32, each w = d (ls - 32)
        IQ4_VALUES[q] with a 6-bit ls (4 bits in scales_l, 2 in scales_h) and IQ4_NL's nibbles; d (ls -
        32) is exact in fp32 (an 11-bit mantissa times a 6-bit integer)."""
        b = np.asarray(raw, dtype=np.uint8).reshape(rows, -1, 136)   # [N, K/256, 136]
        d = np.ascontiguousarray(b[..., 0:2]).view(np.float16)[..., 0].astype(np.float32)
        high = np.ascontiguousarray(b[..., 2:4]).view("<u2")[..., 0].astype(np.int32)
        low = b[..., 4:8]
        block = np.arange(8)
        ls = ((low[..., block // 2] >> (4 * (block % 2))) & 0x0F).astype(np.int32) | (
            ((high[..., None] >> (2 * block)) & 3) << 4)
        q = _iq4_values(b[..., 8:136].reshape(rows, -1, 8, 16))
        return cls("q8_0", torch.from_numpy(q.reshape(rows, -1)),
                   torch.from_numpy(np.ascontiguousarray((d[..., None] * (ls - 32)).astype(np.float32).reshape(rows, -1))),
                   None)

    def as_kind(self, kind: str) -> "BlockQuantized | None":
        """These weights in another layout, exactly (None where it cannot hold them): q4_1 and q8_0 as
        q8_1, q8_0 as q8_16. A fused layer whose parts came in different types takes one of them."""
        if kind == self.kind:
            return self
        n, k = self.shape
        if kind == "q8_1" and self.kind == "q4_1":
            q = torch.stack([self.qs & 15, self.qs >> 4], dim=-1)  # byte j: weights j and j + 16
            q = q.view(n, k // BLOCK, BLOCK // 2, 2).transpose(2, 3).reshape(n, k).to(torch.int8)
            return BlockQuantized("q8_1", q.contiguous(), self.d, self.m)
        if kind == "q8_1" and self.kind == "q8_0":
            return BlockQuantized("q8_1", self.qs, self.d, torch.zeros_like(self.d))
        if kind == "q8_16" and self.kind == "q8_0":
            return BlockQuantized("q8_16", self.qs, self.d.repeat_interleave(2, dim=1).contiguous(), None)
        return None

    def rows(self, index: torch.Tensor | slice) -> "BlockQuantized":
        """A row subset or permutation (rows are independent: blocks never span two)."""
        def pick(t: torch.Tensor) -> torch.Tensor:
            return t[index].contiguous()

        native = None if self.native is None else tuple(pick(t) for t in self.native)
        return BlockQuantized(self.kind, pick(self.qs), pick(self.d), None if self.m is None else pick(self.m),
                              native=native)

    @staticmethod
    def cat(parts: list["BlockQuantized"]) -> "BlockQuantized | None":
        """Stack parts row-wise (fused qkv / gate_up), in one layout that holds them all exactly
        (as_kind); None when none does (a Q4_K part beside a Q6_K one)."""
        kinds = {p.kind for p in parts}
        if len(kinds) > 1:
            target = next((k for k in ("q8_1", "q8_16") if all(p.as_kind(k) is not None for p in parts)), None)
            if target is None:
                return None
            parts = [p.as_kind(target) for p in parts]
        m = None if parts[0].m is None else torch.cat([p.m for p in parts])
        native = (tuple(torch.cat(ts) for ts in zip(*(p.native for p in parts)))
                  if all(p.native is not None for p in parts) else None)
        return BlockQuantized(parts[0].kind, torch.cat([p.qs for p in parts]),
                              torch.cat([p.d for p in parts]), m, native=native)

    def tile_layout(self, glu: bool = False) -> torch.Tensor:
        """The blocks regrouped for rtp's tile-order kernels (amx_linear.c, amx_gemm.c, avx_gemm.c):
        uint8 [N/16, K/32, record], one record per 16 rows x 1 block: their quant bytes, then d
        (then m), fp32.
        glu (rows [gate | up]): the 16-row tiles interleaved, gate tile j then up tile j, so that
        the kernel's SiLU-and-mul epilogue finds both halves of an output tile in one pass."""
        n, k = self.shape
        nk = k // BLOCK

        def by_tile(t: torch.Tensor) -> torch.Tensor:  # [N, nk, e] -> [N/16, nk, 16 * e] bytes
            t = t.reshape(n, nk, -1)
            t = t.contiguous().view(torch.uint8)
            return t.view(n // 16, 16, nk, -1).transpose(1, 2).reshape(n // 16, nk, -1)

        parts = [by_tile(t) for t in (self.qs, self.d, self.m) if t is not None]
        tiles = torch.cat(parts, dim=-1)
        if glu:
            half = n // 32
            tiles = tiles[torch.stack([torch.arange(half), torch.arange(half, 2 * half)], dim=1).flatten()]
        return hugepages.copy(tiles)  # streamed every step

    def lane_layout(self) -> torch.Tensor:
        """The blocks regrouped for the avx512 path's lane-order kernel (csrc/avx512/linear_lanes.c): uint8 [N/16,
        K/32, record], one record per 16 rows x 1 block, 16 rows in the lanes of each 64-byte vector: q4_1, vector v
        lane n = bytes 4v..4v+3 of row n's 16 nibble bytes, then d and m; the int8 kinds, vector g lane n = row n's
        values 4g..4g+3 plus 128 (unsigned), then d (q8_16: both halves' 16 each) and m (q8_1)."""
        n, k = self.shape
        nb = k // BLOCK
        if self.kind == "q4_1":
            quant = self.qs.view(n // 16, 16, nb, 4, 4).permute(0, 2, 3, 1, 4)      # [tile, block, v, lane, byte]
        else:
            q = (self.qs.view(torch.uint8) ^ 0x80)                                   # q + 128, as unsigned
            quant = q.view(n // 16, 16, nb, 8, 4).permute(0, 2, 3, 1, 4)
        parts = [quant.reshape(n // 16, nb, -1)]
        d = self.d.view(n // 16, 16, nb, -1).permute(0, 2, 3, 1)                      # [tile, block, half, lane]
        parts.append(d.contiguous().view(torch.uint8).reshape(n // 16, nb, -1))
        if self.m is not None:
            m = self.m.view(n // 16, 16, nb).permute(0, 2, 1)
            parts.append(m.contiguous().view(torch.uint8).reshape(n // 16, nb, -1))
        return hugepages.copy(torch.cat(parts, dim=-1).contiguous())

    def on_huge_pages(self) -> "BlockQuantized":
        """This, its arrays moved onto transparent huge pages (rtp/kernels/hugepages.py) like the AMX
        records: a one-row step streams every block, and with 4 KiB pages every 4 KiB of the
        stream is a TLB miss (the LM head's one-row product: 3.1-3.2 -> 2.2-2.7 ms)."""
        if self.only_tiles is not None:  # tile_layout put the tiles there already
            return self
        self.qs, self.d = hugepages.copy(self.qs), hugepages.copy(self.d)
        self.m = None if self.m is None else hugepages.copy(self.m)
        if self.native is not None:
            self.native = tuple(hugepages.copy(t) for t in self.native)
        return self

    def keep_only_tiles(self) -> "BlockQuantized":
        """This, holding its tiles alone (where it has them): they then take every batch, one row
        included, whatever --no-deterministic says, and the other layouts' memory goes (for weights
        nothing else reads: a MoE expert's, rtp/models/expert_blocks.py, where the blocks, a Q4_K
        file's own super-blocks and the tiles together were 2.1 bytes a weight, the tiles 0.75)."""
        if self.tiles is not None:
            self.only_tiles = self.shape
            self.qs = self.d = self.m = self.native = None
        return self

    def with_tile_layout(self, glu: bool = False) -> "BlockQuantized":
        """This, also holding tile_layout(glu) (when rtp's CPU kernels run here and N is a multiple of
        16, of 32 for glu)."""
        if cpu_kernels.tiles_available() and self.shape[0] % (32 if glu else 16) == 0:
            self.tiles = self.tile_layout(glu)
            self.glu = glu
        elif cpu_kernels.lanes_available() and self.kind in LANE_KINDS and self.shape[0] % 16 == 0:
            # the avx512 path: lane order takes every batch, so the blocks it was made from go
            self.lanes = self.lane_layout()
            self.only_tiles = self.shape
            self.qs = self.d = self.m = self.native = None
        return self

    def dequantize(self) -> torch.Tensor:
        """The fp32 weights [N, K] (for tests and checks)."""
        n, k = self.shape
        if self.kind == "bf16":
            return self.qs.float()
        if self.kind == "q4_1":
            q = torch.stack([self.qs & 15, self.qs >> 4], dim=-1)  # byte j: weights j and j + 16
            q = q.view(n, k // BLOCK, BLOCK // 2, 2).transpose(2, 3).reshape(n, k // BLOCK, BLOCK)
            w = q.float() * self.d[..., None] + self.m[..., None]
        else:
            g = GROUP[self.kind]
            w = self.qs.view(n, k // g, g).float() * self.d[..., None]
            if self.m is not None:
                w = w.view(n, k // BLOCK, BLOCK) + self.m[..., None]
        return w.reshape(n, k)

    @property
    def runs_here(self) -> bool:
        """Whether the kernels for these blocks run on this CPU's ISA path (else the layer stays dense)."""
        return all(cpu_kernels.has_op(op) for op in _KIND_OPS[self.kind])

    @property
    def serves_every_batch(self) -> bool:
        """Whether these blocks multiply any number of rows (tile order; or on a path without tiles, where
        the block kernels take every batch): the layer needs no dense copy."""
        return self.tiles is not None or not cpu_kernels.tiles_available() and self.runs_here

    def _tiles_take(self, rows: int) -> bool:
        return self.only_tiles is not None or _tiles_take(rows)

    def takes(self, rows: int) -> bool:
        """Whether a batch of `rows` rows is multiplied from the blocks (else from dense bf16 weights)."""
        if not cpu_kernels.tiles_available():  # the avx2 path: the block kernels are its only linears
            return True
        if self.tiles is not None:
            # interleaved tiles serve silu_mul only: a plain product is the one-row kernel's
            return not self._tiles_take(rows) if self.glu else True
        # no tiles (N not a multiple of 16): the block kernels treat rows independently, so
        # deterministic they take every batch; else the dense weights' GEMM past a few rows
        return _deterministic or rows <= max(QUANT_MAX_ROWS, _exact_rows)

    def takes_silu_mul(self, rows: int) -> bool:
        """Whether silu_mul serves a batch of `rows` rows (tiles made with glu: every batch when deterministic,
        else TILE_MIN_ROWS rows or more)."""
        return self.glu and self._tiles_take(rows)

    def silu_mul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """silu(gate) * up of these [gate | up] blocks (glu tiles) for x, bf16 [M, N/2], one kernel."""
        kind, bf16_rows, decode = self._tile_rows(x.shape[0])
        return cpu_kernels.linear_tiles_glu(x.to(torch.bfloat16), kind, self.tiles,
                                          None if bias is None else bias.float(), bf16_rows, decode)

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
        """x @ W.T (+ bias) in out_dtype, through the kernel this batch takes (each a torch custom op,
        so compiled graphs call it as one node)."""
        b = None if bias is None else bias.float()
        if self.lanes is not None:
            return cpu_kernels.linear_lanes(x if x.dtype == torch.float32 else x.to(torch.bfloat16),
                                            TILE_KIND[self.kind], self.lanes, b, out_dtype)
        if self.tiles is not None and self._tiles_take(x.shape[0]):
            if x.dtype != torch.float32:  # fp32 (the LM head's input) is rounded inside the kernel
                x = x.to(torch.bfloat16)
            kind, bf16_rows, decode = self._tile_rows(x.shape[0])
            return cpu_kernels.linear_tiles(x, kind, self.tiles, b, out_dtype, bf16_rows, decode)
        if self.kind == "bf16":  # x bf16, or fp32 (the LM head's input) rounded in the kernel
            return cpu_kernels.linear_bf16(x if x.dtype == torch.float32 else x.to(torch.bfloat16), self.qs, b,
                                           out_dtype)
        if self.native is not None and cpu_kernels.has_op("linear_q4_k"):  # else as the q4_1 it also is
            return cpu_kernels.linear_q4_k(x.to(torch.bfloat16), *self.native, b, out_dtype)
        if self.kind in _U8_OFFSET:
            return cpu_kernels.linear_u8(x if x.dtype == torch.float32 else x.to(torch.bfloat16), self.qs, self.d,
                                         self.m, GROUP[self.kind], _U8_OFFSET[self.kind], b, out_dtype)
        if self.kind == "q4_1":
            return cpu_kernels.linear_q4_1(x.to(torch.bfloat16), self.qs, self.d, self.m, b, out_dtype)
        if self.kind == "q8_0" and x.dtype == torch.bfloat16:
            return cpu_kernels.linear_u8(x, self.qs, self.d, None, 32, U8_SPLIT, b, out_dtype)
        return cpu_kernels.linear_q8(x.float(), self.qs, self.d, self.m, GROUP[self.kind], b, out_dtype)

    def linear_into(self, x: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor) -> torch.Tensor:
        """linear() written into out ([M, N] with contiguous rows: a fused layer's columns), eagerly."""
        b = None if bias is None else bias.float()
        if self.lanes is not None:
            return cpu_kernels.linear_lanes_into(x if x.dtype == torch.float32 else x.to(torch.bfloat16), TILE_KIND[self.kind],
                                                 self.lanes, b, out)
        if self.tiles is not None and self._tiles_take(x.shape[0]):
            kind, bf16_rows, decode = self._tile_rows(x.shape[0])
            return cpu_kernels.linear_tiles_into(x if x.dtype == torch.float32 else x.to(torch.bfloat16),
                                               kind, self.tiles, b, out, bf16_rows=bf16_rows, bf16_rows_decode=decode)
        if self.kind == "bf16":
            return cpu_kernels.linear_bf16_into(x if x.dtype == torch.float32 else x.to(torch.bfloat16), self.qs, b,
                                                out)
        if self.native is not None and cpu_kernels.has_op("linear_q4_k"):  # else as the q4_1 it also is
            return cpu_kernels.linear_q4_k_into(x.to(torch.bfloat16), *self.native, b, out)
        if self.kind in _U8_OFFSET:
            return cpu_kernels.linear_u8_into(x if x.dtype == torch.float32 else x.to(torch.bfloat16), self.qs,
                                              self.d, self.m, GROUP[self.kind], _U8_OFFSET[self.kind], b, out)
        if self.kind == "q4_1":
            return cpu_kernels.linear_q4_1_into(x.to(torch.bfloat16), self.qs, self.d, self.m, b, out)
        if self.kind == "q8_0" and x.dtype == torch.bfloat16:
            return cpu_kernels.linear_u8_into(x, self.qs, self.d, None, 32, U8_SPLIT, b, out)
        return cpu_kernels.linear_q8_into(x.float(), self.qs, self.d, self.m, GROUP[self.kind], b, out)


@dataclass
class BlockParts:
    """A fused layer (qkv) whose parts came in layouts no one layout holds exactly -- a Q4_K_M
    file's q and k in Q4_K beside v in Q6_K: each part keeps its own blocks and kernels, and
    writes its columns of the one output."""

    parts: list[BlockQuantized]
    glu = False

    @property
    def shape(self) -> tuple[int, int]:
        return sum(p.shape[0] for p in self.parts), self.parts[0].shape[1]

    @property
    def kind(self) -> str:
        return "+".join(p.kind for p in self.parts)

    @property
    def tiles(self) -> list[torch.Tensor] | None:
        tiles = [p.tiles for p in self.parts]
        return None if any(t is None for t in tiles) else tiles

    @property
    def serves_every_batch(self) -> bool:
        return all(p.serves_every_batch for p in self.parts)

    @property
    def runs_here(self) -> bool:
        return all(p.runs_here for p in self.parts)

    def takes(self, rows: int) -> bool:
        return all(p.takes(rows) for p in self.parts)

    def takes_silu_mul(self, rows: int) -> bool:
        return False

    def on_huge_pages(self) -> "BlockParts":
        for p in self.parts:
            p.on_huge_pages()
        return self

    def with_tile_layout(self, glu: bool = False) -> "BlockParts":
        for p in self.parts:
            p.with_tile_layout()
        return self

    def dequantize(self) -> torch.Tensor:
        return torch.cat([p.dequantize() for p in self.parts])

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None, out_dtype: torch.dtype) -> torch.Tensor:
        out = torch.empty(x.shape[0], self.shape[0], dtype=out_dtype)
        at = 0
        for p in self.parts:
            n = p.shape[0]
            p.linear_into(x, None if bias is None else bias[at:at + n], out[:, at:at + n])
            at += n
        return out
