"""Tiny random checkpoints and transformers' answers for them, shared by the model, engine and
parallelism tests.

Three families, each a dict of the fields its kinds share and a table of kinds (config class
and the fields that differ): dense Llama-style models (DENSE), mixture-of-experts models (MOE)
and DeepSeek-V3 (DEEPSEEK). make_dense / make_moe / make_deepseek save a seeded random
transformers model as a real checkpoint; hf_reference is transformers' greedy continuation and
logits, run_rtp drives a checkpoint through rtp's loader and real runtime against them.
"""

from __future__ import annotations

import numpy as np
import torch
import transformers

from rtp.checkpoint.loader import load_model
from rtp.engine.runner import ModelRunner
from rtp.models.moe import FusedMoE, TopKRouter
from rtp.runtime import BlockAllocator, RadixCache, Scheduler

NEW_TOKENS = 16

# -- dense (Llama family) --------------------------------------------------------------------------

DENSE = dict(vocab_size=160, hidden_size=64, intermediate_size=112, num_hidden_layers=2,
             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
             rms_norm_eps=1e-5)

DENSE_CONFIGS = {
    "llama": (transformers.LlamaConfig, dict(tie_word_embeddings=False)),
    "llama-tied-mha": (transformers.LlamaConfig, dict(tie_word_embeddings=True, num_key_value_heads=4)),
    "llama3-rope": (transformers.LlamaConfig, dict(rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})),
    "mistral-sliding": (transformers.MistralConfig, dict(sliding_window=12, head_dim=16)),
    "qwen2-bias": (transformers.Qwen2Config, dict(tie_word_embeddings=True)),
    "qwen3-qknorm": (transformers.Qwen3Config, dict(head_dim=32)),
}

# -- mixture of experts ----------------------------------------------------------------------------

MOE = {"vocab_size": 160, "hidden_size": 64, "intermediate_size": 112, "num_hidden_layers": 2,
       "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-5,
       "num_experts_per_tok": 2}

MOE_CONFIGS = {
    "mixtral": (transformers.MixtralConfig, {"num_local_experts": 8}),
    # layer 1 dense (mlp_only_layers), layers 0 and 2 sparse with a shared expert
    "qwen2_moe": (transformers.Qwen2MoeConfig, {"num_experts": 8, "moe_intermediate_size": 32, "num_hidden_layers": 3,
                                                "shared_expert_intermediate_size": 48, "mlp_only_layers": [1]}),
    # layer 0 dense (decoder_sparse_step 2), renormalised top-k, q/k norm
    "qwen3_moe": (transformers.Qwen3MoeConfig, {"num_experts": 8, "moe_intermediate_size": 32, "decoder_sparse_step": 2,
                                                "norm_topk_prob": True, "head_dim": 32}),
    # q/k norm over all heads, q, k and v clamped
    "olmoe": (transformers.OlmoeConfig, {"num_experts": 8, "clip_qkv": 2.0, "eos_token_id": 2}),
}

# -- DeepSeek-V3 -----------------------------------------------------------------------------------

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 1.0, "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1}

# 3 layers: layer 0 dense (first_k_dense_replace 1), layers 1-2 sparse; 8 experts in 4 groups,
# routed within the best 2 groups; head dims chosen all different so a mixed-up split fails
DEEPSEEK = {"vocab_size": 160, "hidden_size": 64, "intermediate_size": 112, "moe_intermediate_size": 32,
            "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1,
            "n_routed_experts": 8, "num_experts_per_tok": 2, "n_group": 4, "topk_group": 2,
            "routed_scaling_factor": 2.5, "norm_topk_prob": True, "first_k_dense_replace": 1, "kv_lora_rank": 32,
            "qk_nope_head_dim": 24, "qk_rope_head_dim": 16, "v_head_dim": 20, "max_position_embeddings": 256,
            "rms_norm_eps": 1e-5, "rope_parameters": YARN}

DEEPSEEK_CONFIGS = {
    "q-lora-yarn": {"q_lora_rank": 48},
    "no-q-lora-yarn": {"q_lora_rank": None},
    # the plain RoPE, a softmax scale without mscale, pairs not interleaved, two dense layers
    "q-lora-rope-halves": {"q_lora_rank": 48, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
                           "rope_interleave": False, "first_k_dense_replace": 2, "n_shared_experts": 2},
}


def random_hf_model(config) -> torch.nn.Module:
    """transformers' fp32 model for config, seeded, its matrices drawn wider than the default
    init so that logits (and a MoE's routing) differ visibly between implementations."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").float().eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.normal_(0, 0.08)
    return model


def make_dense(kind: str, path) -> tuple[str, torch.nn.Module]:
    cfg_cls, extra = DENSE_CONFIGS[kind]
    model = random_hf_model(cfg_cls(**{**DENSE, **extra}))
    model.save_pretrained(path)
    return path, model


def make_moe(kind: str, path):
    cfg_cls, extra = MOE_CONFIGS[kind]
    model = random_hf_model(cfg_cls(**{**MOE, **extra}))
    model.save_pretrained(path)
    return path, model


def make_deepseek(kind: str, path):
    config = transformers.DeepseekV3Config(**{**DEEPSEEK, **DEEPSEEK_CONFIGS[kind]})
    model = random_hf_model(config)
    with torch.no_grad():
        for layer in model.model.layers[config.first_k_dense_replace:]:
            # a correction bias big enough to change which experts (and groups) win
            layer.mlp.gate.e_score_correction_bias.normal_(0, 0.3)
    model.save_pretrained(path)
    return path, model


def write_word_tokenizer(path, vocab_size: int) -> None:
    """A tokenizer.json whose token i is the word t{i}: enough for rtp.LLM to detokenize."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(path / "tokenizer.json"))


# where each GGUF block type keeps its fp16 scale fields (d, and dmin where it has one); block sizes are gguf's
GGUF_SCALE_OFFSETS = {"Q4_0": (0,), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,), "Q4_K": (0, 2), "Q5_K": (0, 2),
                      "Q6_K": (208,), "IQ4_NL": (0,), "IQ4_XS": (0,), "IQ2_XXS": (0,)}


def random_gguf_blocks(qtype, rows: int, cols: int, scales: tuple[float, float], rng) -> np.ndarray:
    """[rows, bytes] of random blocks of GGUF type qtype, cols weights a row: random bytes, but for the fp16
    scale fields, drawn uniformly from `scales` (small positive numbers, so the weights stay sane)."""
    import gguf

    per, size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(rows, cols // per, size), dtype=np.uint8)
    for off in GGUF_SCALE_OFFSETS[qtype.name]:
        raw[:, :, off:off + 2] = rng.uniform(*scales, (rows, cols // per)).astype(np.float16)[..., None].view(np.uint8)
    return raw.reshape(rows, -1)


def prompts_of(lengths, seed):
    rng = np.random.default_rng(seed)
    return [rng.integers(1, 160, n).tolist() for n in lengths]


def hf_reference(model, prompts):
    """transformers' greedy continuation of each prompt and its logits at every position."""
    refs = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, min_new_tokens=NEW_TOKENS,
                                 pad_token_id=0)
            logits = model(out).logits[0].float()
        refs.append((out[0].tolist(), logits))
    return refs


def run_rtp(path, prompts, refs, *, block_size=4, max_batched=64, prefix_cache=True, compile=False,
            max_num_seqs=8):
    """The checkpoint through rtp's loader and the real runtime (scheduler, paged KV cache, prefix
    cache, chunked prefill), fed transformers' greedy tokens: the worst logit difference from
    refs over every sampled row, and the scheduler."""
    model, config = load_model(path, torch.float32, torch.device("cpu"))
    return run_model(model, prompts, refs, block_size=block_size, max_batched=max_batched,
                     prefix_cache=prefix_cache, compile=compile, max_num_seqs=max_num_seqs)


def run_model(model, prompts, refs, *, decode_only=False, compile=False, **runtime):
    """run_rtp for a model already loaded (in any dtype). decode_only: the worst difference over
    the rows that decode, not those that end a prompt."""
    rows, runner, sched, _ = teacher_force(model, prompts, refs, compile=compile, **runtime)
    worst = max(diff for diff, decodes in rows if decodes or not decode_only)
    if compile:
        assert runner.compiled_steps >= NEW_TOKENS
    return worst, sched


def teacher_force(model, prompts, refs, *, kv_dtype=torch.float32, num_blocks=256, block_size=4, max_batched=64,
                  prefix_cache=True, compile=False, max_num_seqs=8, warmup=True, max_model_len=128,
                  new_tokens=NEW_TOKENS):
    """Every prompt through the real runtime (scheduler, paged KV cache, prefix cache, chunked
    prefill), fed the reference's tokens (refs[i]: (tokens, logits at each position)) so every run
    sees the same contexts. Returns, per sampled row, (its largest |logit - reference|, whether it
    decodes rather than ends a prompt); the runner; the scheduler; and the prompt tokens the prefix
    cache supplied."""
    alloc = BlockAllocator(num_blocks, block_size)
    runner = ModelRunner(model, num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
                         max_num_batched_tokens=max_batched, max_model_len=max_model_len,
                         kv_dtype=kv_dtype, device=torch.device("cpu"), compile=compile)
    if warmup:  # CPU graphs (and compiled graphs): captured where the forward allows
        runner.warmup(progress=False)
    sched = Scheduler(alloc, runner.plan, cache=RadixCache(alloc) if prefix_cache else None,
                      max_num_seqs=max_num_seqs, max_num_batched_tokens=max_batched, max_model_len=max_model_len)
    for i, p in enumerate(prompts):
        sched.add_request(i, p, max_tokens=new_tokens, ignore_eos=True)
    length = {i: len(p) for i, p in enumerate(prompts)}
    rows, hits = [], 0
    while sched.has_unfinished:
        sched.schedule()
        logits = runner.forward()
        feed = np.zeros(len(logits), dtype=np.int64)
        for k, rid in enumerate(runner.sample_req_ids().tolist()):
            seq, ref = refs[rid]
            pos = length[rid] - 1
            if length[rid] == len(prompts[rid]):
                hits += sched.cached_prompt_tokens(rid)
            rows.append(((logits[k].float() - ref[pos]).abs().max().item(), length[rid] > len(prompts[rid])))
            feed[k] = seq[pos + 1]
            length[rid] += 1
        sched.update(feed)
        sched.check_integrity()
    assert len(rows) == len(prompts) * new_tokens
    return rows, runner, sched, hits


# -- one expert layer, without a model -------------------------------------------------------------

def random_experts(num_experts=8, hidden=64, inter=32, num_slots=None, seed=0):
    torch.manual_seed(seed)
    layer = FusedMoE(num_experts, hidden, inter, num_slots=num_slots)
    with torch.no_grad():
        layer.w13.normal_(0, 0.1)
        layer.w2.normal_(0, 0.1)
    return layer


def routed(tokens, num_experts=8, top_k=2, hidden=64, seed=1):
    """tokens random hidden states and their top-k routing over num_experts (seeded)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g)
    weights, ids = TopKRouter(top_k, renormalize=False)(torch.randn(tokens, num_experts, generator=g))
    return x, weights, ids
