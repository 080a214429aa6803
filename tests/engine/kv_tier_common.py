"""What tests/engine/test_kv_tiers.py and its second process (kv_tier_worker.py) share: the engine's
settings (a pool of 80 blocks of 16 tokens, so a few prompts of a few hundred tokens evict each other) and
the sampling parameters."""

from rtp import SamplingParams

ENGINE = dict(kv_cache_memory=80 * 368640, max_model_len=1024, max_num_seqs=8, max_num_batched_tokens=256)
PARAMS = SamplingParams(max_tokens=8, temperature=0, logprobs=0)
