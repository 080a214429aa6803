"""Mixture-of-experts GGUFs against transformers: qwen2moe, qwen3moe, olmoe, and Mixtral as llama.cpp
writes it (architecture llama with experts).

Each tiny random transformers model of tests/tiny_models.py (MOE_CONFIGS: a shared expert and
a dense layer in Qwen2-MoE, renormalised top-k, a dense layer and q/k norm in Qwen3-MoE) is
written as a GGUF the way llama.cpp's converter writes it: the experts of a layer stacked per
projection (ffn_gate_exps, ffn_up_exps, ffn_down_exps), the router as ffn_gate_inp, the shared
expert and its gate as *_shexp, q/k rows permuted for llama, the counts in the metadata
(expert_count, expert_used_count, expert_feed_forward_length, ...); in F32, or with every matrix
whose rows split into blocks quantized by gguf.quants (transformers then runs on the same
dequantized weights). rtp's loader reads it and its real runtime (paged KV cache, prefix cache,
chunked prefill, batched) gives transformers' logits. A broken file is one error naming the file
and the tensor.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from tiny_models import MOE_CONFIGS, hf_reference, make_moe, prompts_of, random_gguf_blocks, run_rtp

from rtp.checkpoint.gguf import GGUFCheckpoint, GGUFError

gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType

ARCH = {"mixtral": "llama", "qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe", "olmoe": "olmoe"}
_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output",
          "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
          "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
          "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
          "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
          "mlp.gate": "ffn_gate_inp", "mlp.shared_expert_gate": "ffn_gate_inp_shexp",
          "mlp.shared_expert.gate_proj": "ffn_gate_shexp", "mlp.shared_expert.up_proj": "ffn_up_shexp",
          "mlp.shared_expert.down_proj": "ffn_down_shexp"}


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row permutation for llama (rotate-half halves interleaved)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _gguf_tensors(hf, arch: str, stacked: bool = True, arrays: dict | None = None) -> list[tuple[str, np.ndarray]]:
    """(GGUF name, array in torch order) of every tensor, as llama.cpp's converter names them. `arrays`
    replaces some parameters' weights by arrays of the same rows (a K-quant's raw blocks, a row's bytes
    in place of its weights): every change made here moves whole rows, so it applies to those alike."""
    cfg = hf.config
    out = []
    for name, p in hf.state_dict().items():
        w = p.detach().float().numpy() if arrays is None or name not in arrays else arrays[name]
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        stem, _, suffix = name.rpartition(".")
        if stem.endswith("mlp.experts"):  # transformers' fused experts: [E, 2 * width, hidden], gate rows first
            layer = stem.split(".")[2]
            if suffix == "gate_up_proj":
                width = w.shape[1] // 2
                parts = {"gate": w[:, :width], "up": w[:, width:]}
            else:
                parts = {"down": w}
            for part, stack in parts.items():
                if stacked:
                    out.append((f"blk.{layer}.ffn_{part}_exps.weight", np.ascontiguousarray(stack)))
                else:
                    out += [(f"blk.{layer}.ffn_{part}.{e}.weight", np.ascontiguousarray(stack[e]))
                            for e in range(stack.shape[0])]
            continue
        if stem in _NAMES:
            gname = f"{_NAMES[stem]}.{suffix}"
        else:
            _, _, layer, rest = stem.split(".", 3)
            gname = f"blk.{layer}.{_NAMES[rest]}.{suffix}"
            if arch == "llama" and rest == "self_attn.q_proj":
                w = _permute(w, cfg.num_attention_heads)
            elif arch == "llama" and rest == "self_attn.k_proj":
                w = _permute(w, cfg.num_key_value_heads)
            elif rest == "mlp.shared_expert_gate":
                w = w.reshape(-1)  # llama.cpp's {n_embd}
        out.append((gname, w))
    return out


def _quantizable(w: np.ndarray, qtype) -> bool:
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    return w.ndim >= 2 and w.shape[-1] % block == 0


def write_moe_gguf(path, hf, kind: str, qtype=None, *, stacked: bool = True, edit=None, split_max_tensors: int = 0):
    """hf as a GGUF of its llama.cpp architecture; matrices in qtype where their rows split into its
    blocks (hf's own weights then replaced by what the file holds). `edit(writer, tensors)` may
    change the metadata and the tensor list first."""
    arch, cfg = ARCH[kind], hf.config
    raw = _random_k_blocks(hf, qtype) if qtype in UNWRITABLE else {}  # gguf.quants cannot make these
    tensors = _gguf_tensors(hf, arch, stacked)
    raw_tensors = dict(_gguf_tensors(hf, arch, stacked, raw)) if raw else {}
    writer = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)  # writes general.architecture
    writer.add_name(f"tiny {kind}")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    experts = getattr(cfg, "num_experts", None) or cfg.num_local_experts
    writer.add_expert_count(experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    if arch not in ("llama", "olmoe"):  # llama.cpp writes the width of Mixtral's and OLMoE's experts as ffn length
        writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    if getattr(cfg, "clip_qkv", None):
        writer.add_clamp_kqv(cfg.clip_qkv)
    if getattr(cfg, "shared_expert_intermediate_size", 0):
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    if edit is not None:
        tensors = edit(writer, tensors)
    for name, w in tensors:
        if raw and raw_tensors[name].dtype == np.uint8:
            writer.add_tensor(name, raw_tensors[name], raw_dtype=qtype)
        elif raw:
            writer.add_tensor(name, w)
        elif qtype is not None and _quantizable(w, qtype) and "norm" not in name:
            writer.add_tensor(name, gguf.quants.quantize(w, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(name, w)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if qtype is not None and not raw:
        _round_like_the_file(hf, qtype)
    return path


# types gguf.quants cannot write: their blocks are random bytes with sane scale fields (random_gguf_blocks)
UNWRITABLE = {Q.Q4_K, Q.Q5_K, Q.Q6_K, Q.IQ4_NL, Q.IQ4_XS, Q.IQ2_XXS}


def _random_k_blocks(hf, qtype) -> dict[str, np.ndarray]:
    """Random K-quant blocks (small fp16 scales) for each of hf's matrices whose rows split into
    them, hf's weights replaced by their dequantization; {name: raw [..., bytes per row]}."""
    per = gguf.GGML_QUANT_SIZES[qtype][0]
    g = np.random.default_rng(0)
    raw = {}
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or "shared_expert_gate" in name or p.dim() < 2 or p.shape[-1] % per:
                continue
            rows = int(np.prod(p.shape[:-1]))
            blocks = random_gguf_blocks(qtype, rows, p.shape[-1], (2e-5, 2e-4), g).reshape(*p.shape[:-1], -1)
            p.copy_(torch.from_numpy(gguf.quants.dequantize(blocks, qtype)).reshape(p.shape))
            raw[name] = blocks
    return raw


def _round_like_the_file(hf, qtype) -> None:
    """hf's weights replaced by what a file of qtype holds (each row's blocks quantized and back)."""
    with torch.no_grad():
        for name, p in hf.named_parameters():
            w = p.numpy()
            if "norm" in name or "shared_expert_gate" in name or not _quantizable(w, qtype):  # the gate: 1-D in files
                continue
            p.copy_(torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(w, qtype), qtype)))


# -- logits --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("qtype", [None, Q.Q8_0], ids=["f32", "q8_0"])
@pytest.mark.parametrize("kind", list(MOE_CONFIGS))
def test_logits_match_transformers(kind, qtype, tmp_path):
    _, hf = make_moe(kind, tmp_path / "hf")
    path = write_moe_gguf(tmp_path / f"{kind}.gguf", hf, kind, qtype)
    prompts = prompts_of((5, 23, 40), seed=1)
    worst, _ = run_rtp(path, prompts, hf_reference(hf, prompts))
    assert worst < 1e-4, f"{kind}: max abs logit difference {worst}"


def test_an_iq_type_without_a_packed_layout_is_dequantized_and_said(tmp_path, caplog):
    """IQ2_XXS (a lattice codebook no rtp kernel multiplies): its matrices are dequantized at load (in
    fp32 here, so the logits are transformers' on the same weights), and the loader says so once."""
    import logging

    from tiny_models import MOE, random_hf_model

    cfg_cls, extra = MOE_CONFIGS["qwen3_moe"]
    hf = random_hf_model(cfg_cls(**{**MOE, **extra, **K_QUANT_MOE}))
    path = write_moe_gguf(tmp_path / "iq2.gguf", hf, "qwen3_moe", Q.IQ2_XXS)
    prompts = prompts_of((5, 23), seed=1)
    with caplog.at_level(logging.INFO, logger="rtp"):
        worst, _ = run_rtp(path, prompts, hf_reference(hf, prompts))
    assert worst < 1e-4, worst
    said = [r.getMessage() for r in caplog.records if "IQ2_XXS tensors are dequantized" in r.getMessage()]
    assert len(said) == 1, caplog.text


def test_config_reads_as_transformers_reads_the_twin(tmp_path):
    for kind in MOE_CONFIGS:
        _, hf = make_moe(kind, tmp_path / kind)
        cfg = GGUFCheckpoint(write_moe_gguf(tmp_path / f"{kind}.gguf", hf, kind)).config
        want = hf.config
        assert cfg["architectures"] == want.architectures, kind
        assert cfg["num_experts_per_tok"] == want.num_experts_per_tok
        if kind == "mixtral":
            assert cfg["num_local_experts"] == want.num_local_experts
            assert cfg["intermediate_size"] == want.intermediate_size
            continue
        assert cfg["num_experts"] == want.num_experts
        if kind == "olmoe":
            assert cfg["intermediate_size"] == want.intermediate_size and not cfg["norm_topk_prob"]
            assert cfg["clip_qkv"] == want.clip_qkv
            continue
        assert cfg["moe_intermediate_size"] == want.moe_intermediate_size
        assert cfg["norm_topk_prob"] == (kind == "qwen3_moe")
        dense = [i for i in range(want.num_hidden_layers)
                 if i in want.mlp_only_layers or (i + 1) % want.decoder_sparse_step]
        assert cfg["mlp_only_layers"] == dense, kind
        assert cfg.get("shared_expert_intermediate_size", 0) == getattr(want, "shared_expert_intermediate_size", 0)


def test_one_tensor_per_expert_as_early_mixtral_files_hold_them(tmp_path):
    _, hf = make_moe("mixtral", tmp_path / "hf")
    path = write_moe_gguf(tmp_path / "mixtral.gguf", hf, "mixtral", Q.Q8_0, stacked=False)
    prompts = prompts_of((7, 30), seed=2)
    worst, _ = run_rtp(path, prompts, hf_reference(hf, prompts))
    assert worst < 1e-4, worst


def test_a_split_moe_gguf_loads_as_one_and_serves_its_experts_from_blocks(tmp_path):
    """llama.cpp's gguf-split layout (NAME-0000k-of-0000N.gguf), a few tensors a part, so that a
    layer's stacked experts lie in other files than its router: transformers' logits in fp32, and in
    bf16 the experts from their blocks."""
    from rtp.checkpoint.loader import load_model

    _, hf = make_moe("qwen2_moe", tmp_path / "hf")
    write_moe_gguf(tmp_path / "moe.gguf", hf, "qwen2_moe", Q.Q8_0, split_max_tensors=5)
    parts = sorted(tmp_path.glob("moe-*-of-*.gguf"))
    assert len(parts) > 3
    ckpt = GGUFCheckpoint(parts[0])
    assert len({r.path for r in ckpt.records() if ".experts." in r.name}) > 1  # a layer's experts across files
    prompts = prompts_of((5, 23, 40), seed=4)
    worst, _ = run_rtp(parts[0], prompts, hf_reference(hf, prompts))
    assert worst < 1e-4, worst
    model, _ = load_model(parts[0], torch.bfloat16, torch.device("cpu"))
    from rtp.kernels import cpu_kernels

    if cpu_kernels.available():
        assert all(m.blocks is not None for m in _sparse(model))


# -- a broken file: one error naming the file and the tensor ----------------------------------------------


def _drop(name):
    def edit(writer, tensors):
        return [(n, w) for n, w in tensors if n != name]
    return edit


def _metadata(key, value, kind="qwen2moe"):
    def edit(writer, tensors):
        writer.add_uint32(f"{kind}.{key}", value)  # written again: the later value stands
        return tensors
    return edit


def _experts_cut(name, keep):
    def edit(writer, tensors):
        return [(n, w[:keep] if n == name else w) for n, w in tensors]
    return edit


@pytest.mark.parametrize("edit, says", [
    (_drop("blk.2.ffn_up_exps.weight"), r"layer 2 has a router but no expert tensor blk\.2\.ffn_up_exps\.weight"),
    (_experts_cut("blk.0.ffn_down_exps.weight", 6), r"blk\.0\.ffn_down_exps\.weight has shape \(6, 64, 32\): not 8"),
    (_experts_cut("blk.2.ffn_gate_inp.weight", 6), r"router blk\.2\.ffn_gate_inp\.weight has shape \(6, 64\)"),
    (_metadata("expert_count", 10), r"router blk\.0\.ffn_gate_inp\.weight has shape \(8, 64\), not \[10"),
    (_metadata("expert_used_count", 9), r"qwen2moe\.expert_used_count = 9 is not between 1 and"),
    (_metadata("expert_feed_forward_length", 48), r"expert_feed_forward_length = 48, but the expert tensors are 32"),
    (_drop("blk.0.ffn_down_shexp.weight"), r"layer 0 has a shared expert but no blk\.0\.ffn_down_shexp\.weight"),
    (_drop("blk.0.ffn_gate_inp.weight"), r"layer 0 holds expert tensors but no router blk\.0\.ffn_gate_inp"),
], ids=["missing-expert-tensor", "fewer-experts-than-said", "router-of-fewer-experts", "router-of-more-experts-said",
        "top-k-past-the-experts", "width-not-as-said", "shared-expert-part-missing", "experts-without-a-router"])
def test_a_broken_moe_file_is_one_error_naming_the_tensor(edit, says, tmp_path):
    _, hf = make_moe("qwen2_moe", tmp_path / "hf")
    path = write_moe_gguf(tmp_path / "broken.gguf", hf, "qwen2_moe", edit=edit)
    with pytest.raises(GGUFError, match=says) as e:
        GGUFCheckpoint(path)
    assert str(path) in str(e.value)


# -- experts served from their blocks (bf16 on a CPU with rtp's kernels) -----------------------------------

K_QUANT_MOE = dict(hidden_size=256, moe_intermediate_size=256, intermediate_size=256, head_dim=64)


def _blocks_model(kind, qtype, tmp_path, **override):
    from tiny_models import MOE, random_hf_model

    from rtp.checkpoint.loader import load_model
    from rtp.kernels import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("rtp's CPU kernels are not built for this machine")
    cfg_cls, extra = MOE_CONFIGS[kind]
    hf = random_hf_model(cfg_cls(**{**MOE, **extra, **override}))
    path = write_moe_gguf(tmp_path / f"{kind}.gguf", hf, kind, qtype)
    model, _ = load_model(path, torch.bfloat16, torch.device("cpu"))
    return hf, model, path


def _sparse(model):
    from rtp.models.moe import FusedMoE

    return [m for m in model.modules() if isinstance(m, FusedMoE)]


@pytest.mark.parametrize("kind, qtype, override", [
    ("qwen3_moe", Q.Q8_0, {}), ("qwen2_moe", Q.Q8_0, {}), ("qwen3_moe", Q.Q4_0, {}), ("qwen3_moe", Q.Q4_1, {}),
    ("qwen3_moe", Q.Q5_0, {}), ("qwen3_moe", Q.Q5_1, {}),
    ("qwen3_moe", Q.Q4_K, K_QUANT_MOE), ("qwen3_moe", Q.Q6_K, K_QUANT_MOE), ("qwen3_moe", Q.Q5_K, K_QUANT_MOE),
    ("olmoe", Q.Q8_0, {"intermediate_size": 128}),  # experts whose rows split into Q8_0 blocks
    ("qwen3_moe", Q.IQ4_NL, {}), ("qwen3_moe", Q.IQ4_XS, K_QUANT_MOE),
], ids=["qwen3-q8_0", "qwen2-q8_0", "qwen3-q4_0", "qwen3-q4_1", "qwen3-q5_0", "qwen3-q5_1", "qwen3-q4_k",
        "qwen3-q6_k", "qwen3-q5_k", "olmoe-q8_0", "qwen3-iq4_nl", "qwen3-iq4_xs"])
def test_quantized_experts_are_served_from_their_blocks(kind, qtype, override, tmp_path):
    """No dense copy of the experts (w13 and w2 on the meta device: nothing allocated, nothing read);
    each layer's experts through the block kernels give what fp32 experts on the file's weights
    give, to bf16's precision, at 1, 3, 17 and 64 tokens (one-row kernels and tile loops); and the
    model's logits are transformers' on those weights."""
    from rtp.checkpoint.loader import load_model

    hf, model, path = _blocks_model(kind, qtype, tmp_path, **override)
    sparse = _sparse(model)
    assert sparse and all(m.blocks is not None and m.w13.device.type == m.w2.device.type == "meta" for m in sparse)
    from rtp.kernels import cpu_kernels

    if cpu_kernels.tiles_available() or cpu_kernels.lanes_available():
        # each expert holds one layout, which takes every batch: its tiles, or lane order on the avx512 path
        lanes = cpu_kernels.lanes_available()
        assert all((w.lanes if lanes else w.tiles) is not None and w.qs is None and w.native is None
                   for m in sparse for w in m.blocks.w13 + m.blocks.w2)
    reference, _ = load_model(path, torch.float32, torch.device("cpu"))  # dense fp32 experts, same weights
    g = torch.Generator().manual_seed(0)
    for served, dense in zip(sparse, _sparse(reference)):
        for tokens in (1, 3, 17, 64):
            x = torch.randn(tokens, served.w13.shape[2], generator=g).bfloat16()
            weights = torch.rand(tokens, 2, generator=g)
            ids = torch.randint(0, served.num_experts, (tokens, 2), generator=g)
            got, want = served(x, weights, ids).float(), dense(x.float(), weights, ids)
            assert (got - want).abs().max() <= 0.02 * want.abs().max(), (tokens, (got - want).abs().max())
    prompts = prompts_of((5, 23, 40), seed=1)
    from tiny_models import teacher_force

    refs = hf_reference(hf, prompts)
    rows, *_ = teacher_force(model, prompts, refs, kv_dtype=torch.bfloat16, num_blocks=256, max_num_seqs=4,
                             max_batched=128, prefix_cache=False, warmup=False)
    # as faithful as transformers in bf16 on the same tokens, or within 3 % of the logits' range; gate and up
    # swapped: tens of % in every row. A bf16 router's near tie can flip an expert in either, which in a tiny
    # random model moves that row's logits by several %: one row of the 48 may (the second worst may not)
    hf16 = copy.deepcopy(hf).to(torch.bfloat16)
    with torch.no_grad():
        theirs = max((hf16(torch.tensor([tokens])).logits[0].float() - logits).abs().max().item()
                     for tokens, logits in refs)
    scale = max(logits.abs().max().item() for _, logits in refs)
    second_worst = sorted(diff for diff, _ in rows)[-2]
    assert second_worst <= max(2 * theirs, 0.03 * scale), (second_worst, theirs, scale)


def test_eplb_moves_and_replicates_block_experts_bit_for_bit(tmp_path):
    """Two spare slots: experts moved and replicated by place() (references to the same blocks) leave
    every output bit unchanged, the padded groups included."""
    from rtp.checkpoint.loader import load_model
    from rtp.kernels import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("rtp's CPU kernels are not built for this machine")
    _, hf = make_moe("qwen3_moe", tmp_path / "hf")
    path = write_moe_gguf(tmp_path / "q.gguf", hf, "qwen3_moe", Q.Q8_0)
    model, _ = load_model(path, torch.bfloat16, torch.device("cpu"), redundant_experts=2)
    (experts,) = _sparse(model)
    assert experts.blocks is not None and experts.num_slots == 10
    g = torch.Generator().manual_seed(1)
    x = torch.randn(40, 64, generator=g).bfloat16()
    weights, ids = torch.rand(40, 2, generator=g), torch.randint(0, 8, (40, 2), generator=g)
    ids[:20, 0] = 3  # a hot expert, worth replicating
    before = experts(x, weights, ids)
    experts.place([7, 3, 0, 1, 2, 3, 4, 5, 6, 3])  # expert 3 in three slots, every expert moved
    assert experts.replica_count[3] == 3 and experts.blocks.w13[1] is experts.blocks.w13[9]
    assert torch.equal(experts(x, weights, ids), before)
    assert experts.releasable(0) == 0


def test_a_requests_tokens_do_not_depend_on_its_neighbours_with_block_experts(tmp_path, default_gguf):
    """A Q8_0 Qwen3-MoE GGUF with the default model's tokenizer through rtp.LLM in its default dtype
    (experts from their blocks): each of 8 prompts gets the same greedy tokens and logprobs batched
    with the others (its experts then multiply rows of other requests beside its own) as alone."""
    from tiny_models import MOE, random_hf_model

    from rtp import LLM, SamplingParams
    from rtp.checkpoint.gguf import GGUFFile
    from rtp.kernels import cpu_kernels

    if not cpu_kernels.available():
        pytest.skip("rtp's CPU kernels are not built for this machine")
    tok = GGUFFile(default_gguf).tokenizer_metadata
    cfg_cls, extra = MOE_CONFIGS["qwen3_moe"]
    hf = random_hf_model(cfg_cls(**{**MOE, **extra, "vocab_size": len(tok["tokens"])}))

    def with_tokenizer(writer, tensors):
        writer.add_tokenizer_model(tok["model"])
        writer.add_tokenizer_pre(tok.get("pre") or "default")
        writer.add_token_list(tok["tokens"])
        writer.add_token_types(tok["token_type"])
        writer.add_token_merges(tok["merges"])
        writer.add_bos_token_id(tok["bos_token_id"])
        writer.add_eos_token_id(tok["eos_token_id"])
        return tensors

    path = write_moe_gguf(tmp_path / "moe.gguf", hf, "qwen3_moe", Q.Q8_0, edit=with_tokenizer)
    llm = LLM(model=str(path), max_model_len=256, max_num_seqs=8)
    assert all(m.blocks is not None for m in _sparse(llm.engine.model))
    g = np.random.default_rng(3)
    prompts = [g.integers(100, 40000, size=int(n)).tolist() for n in g.integers(3, 60, size=8)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=1)
    together = llm.generate(prompts, params)
    for prompt, out in zip(prompts, together):
        (alone,) = llm.generate([prompt], params)
        assert alone.outputs[0].token_ids == out.outputs[0].token_ids
        assert alone.outputs[0].logprobs == out.outputs[0].logprobs


# -- one kernel call per MoE layer (csrc/moe.c) and MoE steps from CPU graphs ------------------------------

def _routing_logits(tokens_per_expert, experts, top_k, g):
    """Logits [T, experts] whose top-1 expert is e for tokens_per_expert[e] tokens (in a shuffled order),
    the other k - 1 choices random, every gap wide enough that no rounding reorders them."""
    first = torch.tensor([e for e, n in enumerate(tokens_per_expert) for _ in range(n)], dtype=torch.int64)
    first = first[torch.randperm(len(first), generator=g)]
    logits = torch.rand(len(first), experts, generator=g)  # the rest: below 1
    for t, e in enumerate(first.tolist()):
        others = [o for o in torch.randperm(experts, generator=g).tolist() if o != e][:top_k - 1]
        for rank, o in enumerate([e] + others):
            logits[t, o] = 6.0 - 0.5 * rank
    return logits


@pytest.mark.parametrize("qtype, override", [(Q.Q8_0, {}), (Q.Q4_1, {}), (Q.Q4_K, K_QUANT_MOE),
                                             (Q.Q6_K, K_QUANT_MOE), (Q.IQ4_XS, K_QUANT_MOE)],
                         ids=["q8_0", "q4_1", "q4_k", "q6_k", "iq4_xs"])
@pytest.mark.parametrize("top_k", [1, 2, 8])
def test_one_kernel_call_routes_and_multiplies_a_moe_layer(qtype, override, top_k, tmp_path):
    """FusedMoE.routed on a GGUF's block experts is one call of the MoE op (softmax top-k, dispatch, both
    tile products, the weighted combine): against fp32 experts on the file's weights routed by torch, to
    bf16's precision, with 0, 1, 2, 5, 17 and 300 tokens per expert and with one expert taking every
    token; it counts EPLB's load as torch's top-k does; and each row's bits are the row's alone."""
    from rtp.checkpoint.loader import load_model
    from rtp.kernels import cpu_kernels
    from rtp.models.moe import TopKRouter

    _, model, path = _blocks_model("qwen3_moe", qtype, tmp_path, **override)
    (served,) = _sparse(model)
    if not served.blocks.one_call:
        pytest.skip(f"no one-call MoE op on the {cpu_kernels.isa()} path")
    (dense,) = _sparse(load_model(path, torch.float32, torch.device("cpu"))[0])
    router = TopKRouter(top_k, renormalize=top_k > 1)
    g = torch.Generator().manual_seed(top_k)
    hidden = served.blocks.w13[0].shape[1]
    for per_expert in ([0, 1, 2, 5, 17, 300, 0, 3], [40, 0, 0, 0, 0, 0, 0, 0]):
        logits = _routing_logits(per_expert, served.num_experts, top_k, g).bfloat16()
        x = torch.randn(logits.shape[0], hidden, generator=g).bfloat16()
        served.expert_load.zero_()
        got = served.routed(x, logits, router)
        want = dense(x.float(), *router(logits))
        assert got.dtype == torch.float32
        assert (got - want).abs().max() <= 0.02 * want.abs().max(), (per_expert, (got - want).abs().max())
        _, ids = router(logits)
        assert served.expert_load.tolist() == torch.bincount(ids.flatten(), minlength=8).tolist()
        for row in (0, len(x) // 2, len(x) - 1):  # alone: the same bits as within the batch
            assert torch.equal(served.routed(x[row:row + 1], logits[row:row + 1], router), got[row:row + 1])
    assert torch.equal(served.routed(x[:0], logits[:0], router), got[:0])


def test_a_row_of_nan_logits_stays_in_its_own_row(tmp_path):
    """A token whose router logits are NaN (a broken model, an overflow) still picks k experts inside the table
    (no index past it), gets NaN output itself, and leaves every other row's bits as they are."""
    from rtp.kernels import cpu_kernels
    from rtp.models.moe import TopKRouter

    _, model, _ = _blocks_model("qwen3_moe", Q.Q8_0, tmp_path)
    (served,) = _sparse(model)
    if not served.blocks.one_call:
        pytest.skip(f"no one-call MoE op on the {cpu_kernels.isa()} path")
    router = TopKRouter(2, renormalize=True)
    g = torch.Generator().manual_seed(9)
    x = torch.randn(6, served.blocks.w13[0].shape[1], generator=g).bfloat16()
    logits = torch.randn(6, served.num_experts, generator=g).bfloat16()
    clean = served.routed(x, logits, router)
    logits[2] = float("nan")
    logits[4, :3] = float("nan")
    served.expert_load.zero_()
    dirty = served.routed(x, logits, router)
    assert served.expert_load.sum().item() == 6 * 2  # every pair counted, each against an expert that exists
    assert torch.isnan(dirty[2]).all()
    rest = [0, 1, 3, 5]
    assert torch.equal(dirty[rest], clean[rest])


@pytest.mark.parametrize("kind, override", [
    ("qwen3_moe", {}),
    ("qwen2_moe", {"shared_expert_intermediate_size": 64, "hidden_size": 128}),  # head_dim 32: the RoPE kernel's
])
def test_moe_steps_replay_cpu_graphs_and_follow_an_eplb_placement(kind, override, tmp_path):
    """A Qwen3-MoE GGUF, and a Qwen2-MoE one with its shared experts, through rtp.LLM: their decode,
    prefill and mixed steps replay CPU graphs (the routed experts one kernel call a layer, the shared
    expert's gated sum another) and give the eager steps' tokens and logprobs; experts moved and
    replicated in place afterwards are what the same graphs replay, with the same bits."""
    from rtp import LLM, SamplingParams
    from rtp.kernels import cpu_kernels

    if not cpu_kernels.has_op("moe_experts"):
        pytest.skip("no one-call MoE op on this ISA path")
    from tiny_models import MOE, random_hf_model, write_word_tokenizer

    cfg_cls, extra = MOE_CONFIGS[kind]
    # the dense MLPs as wide as their rows split into Q8_0 blocks: every linear a kernel's
    hf = random_hf_model(cfg_cls(**{**MOE, **extra, "intermediate_size": 128, **override}))
    write_word_tokenizer(tmp_path, MOE["vocab_size"])
    path = write_moe_gguf(tmp_path / "q.gguf", hf, kind, Q.Q8_0)
    llm = LLM(model=str(path), tokenizer=str(tmp_path / "tokenizer.json"), max_model_len=256, max_num_seqs=4,
              enable_eplb=True, num_redundant_experts=2, eplb_step_interval=10 ** 6)
    runner = llm.engine.runner
    assert runner.exact_graph is not None and runner.cpu_graphs and runner.step_graph is not None
    experts = _sparse(llm.engine.model)[0]
    assert experts.blocks.one_call and experts.num_slots >= 10
    prompts = prompts_of((3, 12, 30), seed=4)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=2)

    def run():
        outs = llm.generate(prompts, params) + llm.generate(prompts[1:2], params)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]

    steps = runner.graph_steps
    replayed = run()
    assert runner.graph_steps - steps >= 2 * 15
    with runner.eager():
        assert run() == replayed
    # expert 3 in three slots, every expert moved, the other spare slots empty
    experts.place([7, 3, 0, 1, 2, 3, 4, 5, 6, 3] + [-1] * (experts.num_slots - 10))
    steps = runner.graph_steps
    assert run() == replayed
    assert runner.graph_steps - steps >= 2 * 15


# -- expert parallelism ----------------------------------------------------------------------------------


def _ep2_rank(rank: int, init: str, path, prompts, refs) -> float:
    import rtp.distributed as dist

    dist.init_parallel(tp=1, ep=2, rank=rank, backend="gloo", init_method=init, timeout_s=60)
    worst, _ = run_rtp(path, prompts, refs)
    return worst


def test_a_moe_gguf_at_ep2_gives_transformers_logits(tmp_path):
    """--ep 2 on Qwen2-MoE (shared expert, a dense layer): each of two gloo ranks reads its half of every
    layer's expert records from the Q8_0 file (the pairs routed to the other half over all-to-all):
    transformers' logits on the file's weights."""
    from ranks import run_ranks

    _, hf = make_moe("qwen2_moe", tmp_path / "hf")
    path = write_moe_gguf(tmp_path / "moe.gguf", hf, "qwen2_moe", Q.Q8_0)
    prompts = prompts_of((5, 23, 40), seed=6)
    worst = run_ranks(_ep2_rank, path, prompts, hf_reference(hf, prompts), tmp_path=tmp_path)
    assert max(worst) < 1e-4, worst


def _ep2_blocks_rank(rank: int, init: str, path, prompts, refs) -> tuple:
    import rtp.distributed as dist
    from rtp.checkpoint.loader import load_model
    from tiny_models import teacher_force

    dist.init_parallel(tp=1, ep=2, rank=rank, backend="gloo", init_method=init, timeout_s=60)
    model, _ = load_model(path, torch.bfloat16, torch.device("cpu"), redundant_experts=2)
    (served,) = _sparse(model)
    assert served.blocks is not None and served.blocks.movable and served.local_slots == 5
    assert served.w13.device.type == "meta"

    def logits():
        rows, *_ = teacher_force(model, prompts, refs, kv_dtype=torch.bfloat16, num_blocks=256, max_num_seqs=4,
                                 max_batched=128, prefix_cache=False, warmup=False)
        return [diff for diff, _ in rows]

    before = logits()
    # every expert to another slot, most to the other rank; expert 2 in three slots (one a replica on each rank)
    served.place([7, 6, 2, 5, 4, 3, 2, 1, 0, 2])
    assert [b is None for b in served.blocks.w13] == [False] * 5
    after = logits()
    return before, after


def test_block_experts_at_ep2_move_between_ranks_with_a_placement(tmp_path):
    """--ep 2 in bf16: each rank serves its half of the experts from their records (no dense copy), and a
    placement that moves experts between ranks (and replicates one on both) sends the records over the
    all-to-all: every row's logits are the same bits after it as before, and as near transformers' as
    transformers' own bf16 is."""
    import copy

    from ranks import run_ranks

    from rtp.kernels import cpu_kernels

    if not (cpu_kernels.tiles_available() or cpu_kernels.lanes_available()):
        pytest.skip("the experts' records are one tensor each only on the tile and lane paths")
    _, hf = make_moe("qwen3_moe", tmp_path / "hf")
    path = write_moe_gguf(tmp_path / "moe.gguf", hf, "qwen3_moe", Q.Q8_0)
    prompts = prompts_of((5, 23, 40), seed=7)
    refs = hf_reference(hf, prompts)
    results = run_ranks(_ep2_blocks_rank, path, prompts, refs, tmp_path=tmp_path)
    for before, after in results:
        assert before == after
    hf16 = copy.deepcopy(hf).to(torch.bfloat16)
    with torch.no_grad():
        theirs = max((hf16(torch.tensor([tokens])).logits[0].float() - logits).abs().max().item()
                     for tokens, logits in refs)
    scale = max(logits.abs().max().item() for _, logits in refs)
    second_worst = sorted(results[0][0])[-2]
    assert second_worst <= max(2 * theirs, 0.03 * scale), (second_worst, theirs, scale)
