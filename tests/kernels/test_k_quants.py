"""The K-quants and the other GGUF types served from their blocks: repacked exactly into rtp's
q4_1 (Q4_K, Q4_0), q8_1 (Q5_0, Q5_1, Q5_K) or q8_16 (Q6_K) layout (rtp/kernels/quant.py)
and multiplied by those kernels. Blocks are random bytes with sane scale fields, held against
gguf's own dequantizer; a GGUF holding them loads them packed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import dequantize
from tiny_models import random_gguf_blocks

from rtp.checkpoint.gguf import GGUFCheckpoint
from rtp.checkpoint.loader import load_model
from rtp.kernels import cpu_kernels, quant
from rtp.kernels.quant import BlockQuantized

REPACK = {Q.Q4_K: BlockQuantized.from_q4_k, Q.Q4_0: BlockQuantized.from_q4_0, Q.Q5_0: BlockQuantized.from_q5_0,
          Q.Q5_1: BlockQuantized.from_q5_1, Q.Q5_K: BlockQuantized.from_q5_k, Q.Q6_K: BlockQuantized.from_q6_k,
          Q.Q8_0: lambda raw, rows: BlockQuantized.from_gguf("q8_0", raw, rows),
          Q.IQ4_NL: BlockQuantized.from_iq4_nl, Q.IQ4_XS: BlockQuantized.from_iq4_xs}
KIND = {Q.Q4_K: "q4_1", Q.Q4_0: "q4_1", Q.Q5_0: "q8_1", Q.Q5_1: "q8_1", Q.Q5_K: "q8_1", Q.Q6_K: "q8_16",
        Q.Q8_0: "q8_0", Q.IQ4_NL: "q8_0", Q.IQ4_XS: "q8_0"}
TYPES = list(REPACK)
IDS = [t.name.lower() for t in TYPES]


def random_blocks(qtype, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """[rows, bytes] of random blocks whose fp16 scales are small positive numbers."""
    return random_gguf_blocks(qtype, rows, cols, (1e-3, 2e-2), np.random.default_rng(seed))


@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
def test_repack_is_exact(qtype):
    raw = random_blocks(qtype, 24, 768)
    packed = REPACK[qtype](raw, 24)
    assert packed.kind == KIND[qtype] and packed.shape == (24, 768)
    assert torch.equal(packed.dequantize(), torch.from_numpy(dequantize(raw, qtype)))


@pytest.mark.skipif(not cpu_kernels.tiles_available(), reason="needs a CPU with AVX-512 BF16")
@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 17, 64])
def test_kernels_multiply_the_repacked_blocks(qtype, rows):
    n, k = 40, 512
    raw = random_blocks(qtype, n, k, seed=rows)
    w = torch.from_numpy(dequantize(raw, qtype))
    packed = REPACK[qtype](raw, n)
    x = torch.randn(rows, k).bfloat16()  # as the model's layers hand them; the LM head's input is fp32
    ref = x.float() @ w.T
    for xin in (x, x.float()):  # q8_0: bf16 rows take q = 16 h + l as two bf16 halves, fp32 rows widen q
        out = packed.linear(xin, None, torch.float32)  # the AVX-512 kernels: the exact weights
        assert (out - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()


@pytest.mark.parametrize("qtype", TYPES, ids=IDS)
@pytest.mark.parametrize("rows", [2, 17, 64, 65, 300])
def test_tile_kernels_multiply_the_repacked_blocks_as_the_models_bf16_weights(qtype, rows):
    """Decode batches and the GEMM of prompt-sized ones, from the same tile records (AMX, or
    AVX-512 BF16 without it): the weights rounded to bf16 once, fp32 sums (fp32-rounding-level
    error); the bf16 output is that rounded."""
    if not cpu_kernels.tiles_available():
        pytest.skip("needs the tile-order kernels (AVX-512 BF16)")
    if rows < quant.TILE_MIN_ROWS:
        pytest.skip("the one-row kernels serve so few rows here")
    n, k = 48, 512
    raw = random_blocks(qtype, n, k, seed=rows)
    packed = REPACK[qtype](raw, n).with_tile_layout()
    w = torch.from_numpy(dequantize(raw, qtype)).bfloat16().float()
    x = torch.randn(rows, k).bfloat16()
    ref = x.float() @ w.T
    out = packed.linear(x, None, torch.float32)
    assert (out - ref).abs().max().item() <= 1e-5 * ref.abs().max().item()
    assert torch.equal(packed.linear(x, None, torch.bfloat16), out.bfloat16())


# a mixed file, as a Q4_K_M one is: most matrices Q4_K, some Q6_K (no kernel: dequantized), one Q5_0
MIXED = {"blk.0.attn_v": Q.Q6_K, "blk.0.ffn_down": Q.Q5_0}


def write_q4_k_llama(path, seed: int = 0, types: dict | None = None) -> dict[str, np.ndarray]:
    """A small Llama GGUF whose linear layers are block-quantized (columns a multiple of 256; MIXED
    says which are not Q4_K), the rest F32."""
    hidden, heads, kv_heads, head_dim, ffn, vocab = 256, 4, 2, 64, 512, 128
    g = np.random.default_rng(seed)
    writer = GGUFWriter(str(path), "llama")
    writer.add_architecture()
    writer.add_context_length(128)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_block_count(1)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_vocab_size(vocab)
    shapes = {"blk.0.attn_q": (heads * head_dim, hidden), "blk.0.attn_k": (kv_heads * head_dim, hidden),
              "blk.0.attn_v": (kv_heads * head_dim, hidden), "blk.0.attn_output": (hidden, heads * head_dim),
              "blk.0.ffn_gate": (ffn, hidden), "blk.0.ffn_up": (ffn, hidden), "blk.0.ffn_down": (hidden, ffn)}
    blocks = {}
    for i, (name, (rows, cols)) in enumerate(shapes.items()):
        qtype = (MIXED if types is None else types).get(name, Q.Q4_K)
        raw = random_blocks(qtype, rows, cols, seed=seed + i)
        writer.add_tensor(name + ".weight", raw, raw_dtype=qtype)  # the shape follows from the bytes
        blocks[name] = raw
    for name, shape in (("token_embd.weight", (vocab, hidden)), ("output.weight", (vocab, hidden)),
                        ("output_norm.weight", (hidden,)), ("blk.0.attn_norm.weight", (hidden,)),
                        ("blk.0.ffn_norm.weight", (hidden,))):
        writer.add_tensor(name, g.standard_normal(shape).astype(np.float32) * 0.1 + (1.0 if "norm" in name else 0))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return blocks


def test_a_mixed_k_quant_gguf_loads_its_blocks_packed(tmp_path):
    file = tmp_path / "q4k.gguf"
    write_q4_k_llama(file)
    ckpt = GGUFCheckpoint(file)
    packed = dict(ckpt.quantized())
    dense = dict(ckpt.tensors())
    assert {n: p.kind for n, p in packed.items() if p.kind != "q4_1"} == {
        "model.layers.0.self_attn.v_proj.weight": "q8_16", "model.layers.0.mlp.down_proj.weight": "q8_1"}
    assert len(packed) == 7
    for name, p in packed.items():  # q/k rows unpermuted like the dense tensors
        assert torch.equal(p.dequantize(), dense[name]), name
    model, _ = load_model(file, torch.bfloat16, torch.device("cpu"))
    if cpu_kernels.tiles_available():  # the linears multiply the blocks, not a bf16 copy
        kinds = {n: m.quant.kind for n, m in model.named_modules() if getattr(m, "quant", None) is not None}
        # qkv mixes Q4_K (q, k) with Q6_K (v): each part keeps its own layout and kernels
        assert kinds == {"model.layers.0.self_attn.qkv_proj": "q4_1+q4_1+q8_16",
                         "model.layers.0.self_attn.o_proj": "q4_1", "model.layers.0.mlp.gate_up_proj": "q4_1",
                         "model.layers.0.mlp.down_proj": "q8_1", "lm_head": "bf16"}, kinds  # F32 output: dense
        qkv = model.model.layers[0].self_attn.qkv_proj
        want = torch.cat([dense[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
        assert torch.equal(qkv.quant.dequantize(), want)
        for rows in (1, 2, 5, 70):
            x = torch.randn(rows, 256).bfloat16()
            got = qkv(x)
            ref = x.float() @ want.T
            assert (got.float() - ref).abs().max().item() <= 2e-2 * ref.abs().max().item(), rows


def test_a_k_quant_gguf_generates_its_dequantized_fp32_selfs_greedy_tokens(tmp_path, default_gguf):
    """Every layer in a K-quant (Q4_K, Q5_K, Q6_K, Q5_1 beside each other, as a Q4_K_M or Q5_K_M
    file mixes them) through its blocks in bf16, against the same file dequantized and run in
    fp32: the same greedy tokens, alone and batched."""
    from rtp import LLM, SamplingParams

    file = tmp_path / "mixed.gguf"
    write_q4_k_llama(file, seed=3, types={"blk.0.attn_q": Q.Q5_K, "blk.0.attn_v": Q.Q6_K, "blk.0.ffn_down": Q.Q6_K,
                                          "blk.0.ffn_up": Q.Q5_K, "blk.0.attn_output": Q.Q5_1})
    g = np.random.default_rng(4)
    prompts = [g.integers(1, 128, n).tolist() for n in (5, 9, 17)]
    sp = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    fp32 = LLM(model=str(file), tokenizer=str(default_gguf), dtype="float32", max_model_len=64)
    blocks = LLM(model=str(file), tokenizer=str(default_gguf), dtype="bfloat16", max_model_len=64)
    if cpu_kernels.tiles_available():
        kinds = {m.quant.kind for m in blocks.engine.model.modules() if getattr(m, "quant", None) is not None}
        assert {"q8_1", "q8_16"} <= {k for kind in kinds for k in kind.split("+")}
    want = [o.outputs[0].token_ids for o in fp32.generate(prompts, sp, use_tqdm=False)]
    alone = [blocks.generate([p], sp, use_tqdm=False)[0].outputs[0].token_ids for p in prompts]
    batched = [o.outputs[0].token_ids for o in blocks.generate(prompts, sp, use_tqdm=False)]
    assert alone == want and batched == want


@pytest.mark.skipif(not cpu_kernels.tiles_available(), reason="needs a CPU with AVX-512 BF16")
def test_q4_k_rows_multiply_the_files_own_super_blocks():
    """One request's rows (1 to 6) multiply Q4_K's own super-blocks (0.59 bytes a weight, not q4_1's
    0.75): the file's exact weights, each row as it would be alone, and nothing written past the
    output's columns."""
    n, k = 37, 768
    raw = random_blocks(Q.Q4_K, n, k, seed=9)
    packed = BlockQuantized.from_q4_k(raw, n)
    assert packed.native is not None and packed.native[0].numel() == n * k // 2
    w = torch.from_numpy(dequantize(raw, Q.Q4_K))
    x = torch.randn(6, k).bfloat16()
    bias = torch.randn(n)
    for rows in range(1, 7):
        out = packed.linear(x[:rows], bias, torch.float32)
        ref = x[:rows].float() @ w.T + bias
        assert (out - ref).abs().max().item() <= 1e-4 * ref.abs().max().item(), rows
        alone = torch.cat([packed.linear(x[i:i + 1], bias, torch.float32) for i in range(rows)])
        assert torch.equal(out, alone)
    wide = torch.full((6, n + 3), 7.0)
    packed.linear_into(x, bias, wide[:, :n])
    assert (wide[:, n:] == 7.0).all()
    assert torch.equal(wide[:, :n], packed.linear(x, bias, torch.float32))
