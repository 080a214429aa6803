"""Q4_K, Q4_0 and Q5_0 served from their blocks: repacked exactly into rtp's q4_1 (Q4_K, Q4_0)
or q8_0 (Q5_0) layout (rtp/kernels/quant.py) and multiplied by those kernels. Blocks are random bytes with sane
scale fields, held against gguf's own dequantizer; a GGUF holding them loads them packed."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf import GGUFWriter
from gguf.quants import dequantize

from rtp.checkpoint.gguf import GGUFCheckpoint
from rtp.checkpoint.loader import load_model
from rtp.kernels import cpu_kernels
from rtp.kernels.quant import BlockQuantized

# bytes per block, weights per block, offsets of the fp16 scale fields
LAYOUTS = {Q.Q4_K: (144, 256, (0, 2)), Q.Q4_0: (18, 32, (0,)), Q.Q5_0: (22, 32, (0,)), Q.Q6_K: (210, 256, (208,))}
REPACK = {Q.Q4_K: BlockQuantized.from_q4_k, Q.Q4_0: BlockQuantized.from_q4_0, Q.Q5_0: BlockQuantized.from_q5_0}
KIND = {Q.Q4_K: "q4_1", Q.Q4_0: "q4_1", Q.Q5_0: "q8_0"}


def random_blocks(qtype, rows: int, cols: int, seed: int = 0) -> np.ndarray:
    """[rows, bytes] of random blocks whose fp16 scales are small positive numbers."""
    size, per, scales = LAYOUTS[qtype]
    g = np.random.default_rng(seed)
    raw = g.integers(0, 256, size=(rows, cols // per, size), dtype=np.uint8)
    for off in scales:
        raw[:, :, off:off + 2] = g.uniform(1e-3, 2e-2, (rows, cols // per)).astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q4_0, Q.Q5_0], ids=["q4_k", "q4_0", "q5_0"])
def test_repack_is_exact(qtype):
    raw = random_blocks(qtype, 24, 768)
    packed = REPACK[qtype](raw, 24)
    assert packed.kind == KIND[qtype] and packed.shape == (24, 768)
    assert torch.equal(packed.dequantize(), torch.from_numpy(dequantize(raw, qtype)))


@pytest.mark.skipif(not cpu_kernels.available(), reason="needs a CPU with AVX-512 BF16")
@pytest.mark.parametrize("qtype", [Q.Q4_K, Q.Q4_0, Q.Q5_0], ids=["q4_k", "q4_0", "q5_0"])
@pytest.mark.parametrize("rows", [1, 2, 3, 17, 64])
def test_kernels_multiply_the_repacked_blocks(qtype, rows):
    n, k = 40, 512
    raw = random_blocks(qtype, n, k, seed=rows)
    w = torch.from_numpy(dequantize(raw, qtype))
    packed = REPACK[qtype](raw, n)
    x = torch.randn(rows, k).bfloat16()  # as the model hands them (q8_0 widens them to fp32)
    x = x if KIND[qtype] == "q4_1" else x.float()
    ref = x.float() @ w.T
    out = packed.linear(x, None, torch.float32)
    assert (out - ref).abs().max().item() <= 1e-4 * ref.abs().max().item()


# a mixed file, as a Q4_K_M one is: most matrices Q4_K, some Q6_K (no kernel: dequantized), one Q5_0
MIXED = {"blk.0.attn_v": Q.Q6_K, "blk.0.ffn_down": Q.Q5_0}


def write_q4_k_llama(path, seed: int = 0) -> dict[str, np.ndarray]:
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
        qtype = MIXED.get(name, Q.Q4_K)
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
    assert "model.layers.0.self_attn.v_proj.weight" not in packed  # Q6_K: dequantized only
    assert {n: p.kind for n, p in packed.items() if p.kind != "q4_1"} == {"model.layers.0.mlp.down_proj.weight": "q8_0"}
    assert len(packed) == 6
    for name, p in packed.items():  # q/k rows unpermuted like the dense tensors
        assert torch.equal(p.dequantize(), dense[name]), name
    model, _ = load_model(file, torch.bfloat16, torch.device("cpu"))
    if cpu_kernels.available():  # the decode linears multiply the blocks, not a bf16 copy
        kinds = {n: m.quant.kind for n, m in model.named_modules() if getattr(m, "quant", None) is not None}
        # qkv mixes Q4_K with Q6_K, so it keeps its bf16 weights; the others are packed
        assert kinds == {"model.layers.0.self_attn.o_proj": "q4_1", "model.layers.0.mlp.gate_up_proj": "q4_1",
                         "model.layers.0.mlp.down_proj": "q8_0"}, kinds
