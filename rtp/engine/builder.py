"""Building an engine from an EngineConfig: every part made once, in the order the ranks agree on.

    build_parts(config)   rank 0: the model and its runner (what every rank builds, in the same
                          order, since loading and warm-up run collectives), then what only rank 0
                          has: tokenizer, runtime, sampler, outputs, the registry, the components
                          and the core. LLMEngine (rtp/engine/engine.py) wraps the result.
    follow(config)        ranks 1..N-1 of a tensor- or expert-parallel engine, however started
                          (spawned by rank 0 or by torchrun): the model, its runner and the plan
                          channel only, then rank 0's steps until it stops.

The components are listed in the order their hooks run: the plan goes to the other ranks first,
then the knobs and drafts, the grammar's masks, the P/D taps, and expert balancing last.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from rtp.checkpoint import open_checkpoint
from rtp.checkpoint.hub import resolve_model
from rtp.checkpoint.loader import load_model
from rtp.checkpoint.tokenizer import Tokenizer, TokenizerError
from rtp.config import EngineConfig, ModelConfig
from rtp.distributed import world_size
from rtp.engine.component import Component
from rtp.engine.core import EngineCore
from rtp.engine.disaggregation import KVHandoff
from rtp.engine.draft_model import DraftModel, check_same_vocabulary
from rtp.engine.expert_balancer import ExpertBalancer, eplb_slots, lendable_kv_blocks
from rtp.engine.grammar import GrammarLimits
from rtp.engine.grammar.component import Grammars
from rtp.engine.kv_cache import bytes_per_block, num_kv_blocks, resolve_kv_dtype
from rtp.engine.kv_tiers import build_kv_tiers
from rtp.engine.output import OutputProcessor
from rtp.engine.prefill_budget import PrefillBudget
from rtp.engine.requests import Requests
from rtp.engine.runner import ModelRunner
from rtp.engine.sampler import Sampler, SlotSettings
from rtp.engine.speculation_governor import SpeculationGovernor
from rtp.engine.tensor_parallel import PlanChannel, follow as follow_steps, start_ranks
from rtp.kernels import cpu_kernels, quant
from rtp.kernels.quant import BlockQuantized
from rtp.models import model_class
from rtp.models.moe import FusedMoE
from rtp.runtime import BlockAllocator, RadixCache, Scheduler
from rtp.sampling_params import SamplingParams

log = logging.getLogger("rtp.engine")


@dataclass
class Model:
    """What every rank builds: the model, its KV cache and runner, the plan channel, EPLB."""

    config: EngineConfig
    path: Path
    device: torch.device
    dtype: torch.dtype
    compile: bool
    model: torch.nn.Module
    model_config: ModelConfig
    max_model_len: int
    kv_dtype: torch.dtype
    num_blocks: int
    lendable: int
    runner: ModelRunner
    channel: PlanChannel | None
    balancer: ExpertBalancer | None
    followers: list = field(default_factory=list)
    tokenizer: Tokenizer | None = None           # rank 0's
    draft_model: torch.nn.Module | None = None   # rank 0's, with --speculative-model
    warmup_seconds: float = 0.0


def build_model(config: EngineConfig, rank0: bool = False) -> Model:
    """The model and its runner, on any rank; rank 0 also loads the tokenizer and a draft model (no
    collectives: the other ranks do not)."""
    config.validate()
    load, cache, sched, eplb = config.load, config.cache, config.scheduler, config.eplb
    device = resolve_device(load.device)
    compile = load.compile if load.compile is not None else device.type == "cuda"
    # the expert exchange reads its counts on the host between collectives: nothing to capture
    compile = compile and config.parallel.expert_parallel_size == 1
    if compile:
        _use_rtp_compile_cache()
    dtype = resolve_dtype(load.dtype, device)
    path = resolve_model(load.model, load.revision) if load.model else _default_model()
    checkpoint = open_checkpoint(path)  # headers only, parsed once for everything below
    declared = ModelConfig.from_hf(checkpoint.config)
    model_class([declared.architecture])  # an architecture rtp has no model for fails here, first
    followers, device = start_ranks(config, declared, device, follow)
    eplb_ranks, spare = (eplb_slots(eplb, config.parallel, path, declared, dtype, device, compile)
                         if eplb.enable else (0, 0))
    model, mc = load_model(path, dtype, device, redundant_experts=spare, checkpoint=checkpoint)
    use_activation_dtype(model, load.activation_dtype)
    quant.set_deterministic(load.deterministic)
    max_model_len = min(sched.max_model_len or min(mc.max_position_embeddings, 8192), mc.max_position_embeddings)
    tokenizer = draft_model = None
    if rank0:
        tokenizer = _tokenizer(config, path, mc)
        if config.speculative.kind == "draft_model":
            draft_model = _load_draft_model(config, tokenizer, mc, dtype, device, max_model_len)
    specs = [layer.kv_cache_spec for layer in model.attention_layers()]
    # --kv-cache-dtype (rtp/engine/kv_cache.py): what it cannot do yet is refused here
    kv_dtype = resolve_kv_dtype(cache.kv_cache_dtype, dtype, device, model.attention_layers())
    if draft_model is not None:  # its cache takes the target's block ids (one block costs both) and dtype
        resolve_kv_dtype(cache.kv_cache_dtype, dtype, device, draft_model.attention_layers())
        specs += [layer.kv_cache_spec for layer in draft_model.attention_layers()]
    num_blocks = num_kv_blocks(specs, block_size=cache.block_size, dtype=kv_dtype, max_model_len=max_model_len,
                               max_num_seqs=sched.max_num_seqs, budget_bytes=cache.kv_cache_memory, device=device)
    moe_layers = [m for m in model.modules() if isinstance(m, FusedMoE)] if eplb_ranks else []
    block_bytes = bytes_per_block(specs, cache.block_size, kv_dtype)
    # blocks the pool is lent while EPLB's replicas are dropped: the cache is allocated for them too,
    # committed only as they are used (rtp/engine/kv_cache.py)
    lendable = lendable_kv_blocks(moe_layers, block_bytes)
    if world_size() > 1:  # block ids are rank 0's: every rank needs as many blocks
        blocks = torch.tensor([num_blocks, lendable])
        torch.distributed.all_reduce(blocks, op=torch.distributed.ReduceOp.MIN)
        num_blocks, lendable = blocks.tolist()
    runner = ModelRunner(model, num_blocks=num_blocks + lendable, block_size=cache.block_size,
                         max_num_seqs=sched.max_num_seqs, max_num_batched_tokens=sched.max_num_batched_tokens,
                         max_model_len=max_model_len, kv_dtype=kv_dtype, device=device, compile=compile,
                         committed_blocks=num_blocks, max_draft_tokens=config.speculative.draft_tokens)
    channel = PlanChannel(runner.plan) if world_size() > 1 else None
    warmup = runner.warmup(progress=sys.stderr.isatty())
    balancer = None
    if eplb_ranks:  # after warm-up: its dummy steps are no traffic
        balancer = ExpertBalancer(moe_layers, num_ranks=eplb_ranks, window=eplb.window_size,
                                  interval=eplb.step_interval, kv_pressure=eplb.kv_pressure,
                                  kv_block_bytes=block_bytes, kv_base=num_blocks, kv_capacity=num_blocks + lendable)
        balancer.channel = channel
    return Model(config, path, device, dtype, compile, model, mc, max_model_len, kv_dtype, num_blocks, lendable,
                 runner, channel, balancer, followers, tokenizer, draft_model, warmup)


def follow(config: EngineConfig) -> None:
    """A rank other than 0 (spawned by rank 0 or started by torchrun): rank 0's steps until it stops."""
    m = build_model(config)
    allocator = BlockAllocator(m.num_blocks, config.cache.block_size, m.num_blocks + m.lendable)
    on_rebalance = None
    if m.balancer is not None:
        def on_rebalance(slots, limit):
            m.balancer.follow(slots, limit, allocator, m.runner.kv_tensors)
    follow_steps(m.channel, m.runner.forward, on_rebalance)


@dataclass
class Parts:
    """Rank 0's engine, as LLMEngine holds it."""

    model: Model
    tokenizer: Tokenizer
    eos_token_ids: list[int]
    allocator: BlockAllocator
    cache: RadixCache | None
    scheduler: Scheduler
    core: EngineCore
    components: list[Component]


def build_parts(config: EngineConfig) -> Parts:
    cache, sched, spec = config.cache, config.scheduler, config.speculative
    m = build_model(config, rank0=True)
    tok = m.tokenizer
    mc = m.model_config
    eos = sorted(set(tok.eos_token_ids) | set(mc.eos_token_ids))
    drafter = None if m.draft_model is None else DraftModel(
        m.draft_model, m.runner, num_blocks=m.num_blocks + m.lendable, committed_blocks=m.num_blocks,
        max_model_len=m.max_model_len, max_draft_tokens=spec.draft_tokens, kv_dtype=m.kv_dtype, device=m.device,
        compile=m.compile)
    if drafter is not None:
        m.warmup_seconds += drafter.warmup(progress=sys.stderr.isatty())
    allocator = BlockAllocator(m.num_blocks, cache.block_size, m.num_blocks + m.lendable)
    radix = RadixCache(allocator) if cache.enable_prefix_caching else None
    scheduler = Scheduler(allocator, m.runner.plan, cache=radix, max_num_seqs=sched.max_num_seqs,
                          max_num_batched_tokens=sched.max_num_batched_tokens,
                          max_prefill_tokens_with_decodes=sched.max_prefill_tokens_with_decodes,
                          max_model_len=m.max_model_len, eos_token_ids=eos, vocab_size=mc.vocab_size,
                          policy=sched.scheduling_policy, num_speculative_tokens=spec.draft_tokens,
                          spec_ngram_min=spec.prompt_lookup_min, spec_ngram_max=spec.prompt_lookup_max,
                          spec_max_running=spec.max_running, external_drafts=drafter is not None)
    if (cache.kv_host_cache_gb or cache.kv_disk_cache) and (world_size() > 1 or m.device.type != "cpu"):
        raise ValueError("the KV cache tiers (--kv-host-cache-gb, --kv-disk-cache) run on one CPU process: "
                         "not with --tp or --ep above 1, nor on CUDA yet")
    tiers = build_kv_tiers(cache, model_path=m.path, model_config=mc, runner=m.runner, scheduler=scheduler,
                           cache=radix, dtype=m.dtype, kv_dtype=m.kv_dtype, isa=cpu_kernels.isa())
    s = config.structured
    grammars = Grammars(tok, mc.vocab_size, eos, num_slots=scheduler.max_requests, max_rows=sched.max_num_seqs,
                        limits=GrammarLimits(max_bytes=s.max_bytes, max_choices=s.max_choices,
                                             max_repetition=s.max_repetition, compile_timeout=s.compile_timeout))
    components: list[Component] = [c for c in (
        m.channel,
        PrefillBudget(sched.step_time_target, cap=sched.max_prefill_tokens_with_decodes or sched.max_num_batched_tokens,
                      floor=cache.block_size) if sched.step_time_target > 0 else None,
        # drafting only at batch sizes where it measured faster (rtp/engine/speculation_governor.py)
        SpeculationGovernor(spec.max_running) if spec.draft_tokens and spec.measured else None,
        drafter,
        grammars,
        KVHandoff(scheduler, m.runner),
        tiers,
        m.balancer,
    ) if c is not None]
    sampling = SlotSettings(scheduler.max_requests)  # each request's settings, by its runtime slot
    outputs = OutputProcessor(tok)

    def speculate(params: SamplingParams) -> bool:
        """Whether a request's decode steps may verify drafted tokens. Not under a grammar (its matcher
        would have to take and give back the drafts) nor with penalties (each position's counts would
        have to include the drafts before it): those decode a token a step."""
        return bool(spec.draft_tokens) and params.structured_outputs is None and not params.has_penalties

    requests = Requests(scheduler, sampling, components, max_model_len=m.max_model_len, vocab_size=mc.vocab_size,
                        speculate=speculate)
    core = EngineCore(scheduler=scheduler, runner=m.runner, sampler=Sampler(seed=config.load.seed), sampling=sampling,
                      outputs=outputs, requests=requests, components=components, eos_token_ids=eos,
                      vocab_size=mc.vocab_size, drafts=bool(spec.draft_tokens))
    log.info("engine ready: %s, %s on %s, %d KV blocks of %d tokens%s, max_model_len %d",
             mc.architecture, str(m.dtype).removeprefix("torch."), m.device, m.num_blocks - 1, cache.block_size,
             f" (+{m.lendable} lent while EPLB's replicas are dropped)" if m.lendable else "", m.max_model_len)
    return Parts(m, tok, eos, allocator, radix, scheduler, core, components)


def _tokenizer(config: EngineConfig, path: Path, mc: ModelConfig) -> Tokenizer:
    load = config.load
    tokenizer = Tokenizer.from_pretrained(resolve_model(load.tokenizer) if load.tokenizer else path)
    if load.chat_template:
        tokenizer.use_chat_template(load.chat_template)
    if tokenizer.backend.get_vocab_size() > mc.vocab_size:
        # prompts holding the extra ids are refused (Requests.check); say why once, up front
        log.warning("the tokenizer has %d tokens, more than the model's vocabulary of %d: is it this "
                    "model's tokenizer?", tokenizer.backend.get_vocab_size(), mc.vocab_size)
    return tokenizer


def _load_draft_model(config: EngineConfig, tokenizer: Tokenizer, mc: ModelConfig, dtype, device,
                      max_model_len: int) -> torch.nn.Module:
    """The draft model of --speculative-model (rtp/engine/draft_model.py), loaded as the target is,
    refused at startup when it does not share the target's tokenizer or cannot take its context."""
    if world_size() > 1:
        raise ValueError("--speculative-model runs on one process: not with --tp or --ep above 1")
    ref = config.speculative.model
    path = resolve_model(ref)
    model, draft_config = load_model(path, dtype, device)
    use_activation_dtype(model, config.load.activation_dtype, hint=False)
    try:
        draft_tokenizer = Tokenizer.from_pretrained(path)
    except TokenizerError:
        draft_tokenizer = None
    check_same_vocabulary(tokenizer, mc.vocab_size, draft_tokenizer, draft_config.vocab_size, ref)
    if draft_config.max_position_embeddings < max_model_len:
        raise ValueError(f"the draft model {ref} takes {draft_config.max_position_embeddings} positions, fewer than "
                         f"max_model_len {max_model_len}: lower --max-model-len")
    log.info("draft model: %s (%s, %d layers)", ref, draft_config.architecture, draft_config.num_hidden_layers)
    return model


def use_activation_dtype(model: torch.nn.Module, dtype: str, hint: bool = True) -> None:
    """--activation-dtype int8 / int8-prefill: every block-quantized linear layer's input rows (int8-prefill:
    its prompt rows, not the step's decode rows) go to the tile kernels as int8 (BlockQuantized.int8_rows;
    the CPU graphs captured after this record it), but the LM head's: its logits pick the tokens, and int8
    rows there cost more fidelity than they bought (SmolLM2 at 64 rows: 6.16 -> 5.99 ms; greedy prefixes
    identical to fp32 12/32 -> 9/32, docs/benchmarks.md). hint: say where int8-prefill would help (the
    target model, not a draft model)."""
    from rtp.kernels import cpu_kernels
    from rtp.kernels.quant import TILE_KIND_INT8_ROWS

    if dtype not in ("int8", "int8-prefill"):
        # not the default: on 288 chat prompts its greedy output matched fp32 171 times, transformers' bf16
        # 147, rtp's bf16 rows 233 (docs/benchmarks.md); rtp keeps its own fidelity unless asked
        weight = next(model.parameters(), None)
        if (hint and weight is not None and weight.dtype == torch.bfloat16 and cpu_kernels.int8_rows_available()
                and any(isinstance(q := getattr(m, "quant", None), BlockQuantized) and q.kind in TILE_KIND_INT8_ROWS
                        for m in model.modules())):
            log.info("this CPU multiplies int8 rows (AVX-512 VNNI, no AMX): --activation-dtype int8-prefill "
                     "makes prefill about 1.2x faster, its greedy output a little further from fp32 "
                     "(still closer than transformers' bf16)")
        return

    if not cpu_kernels.int8_rows_available():
        log.warning("--activation-dtype %s changes nothing on this CPU: it takes AVX-512 VNNI and no AMX "
                    "(AMX multiplies the rows in bf16)", dtype)
    rows = "all" if dtype == "int8" else "prefill"
    head = getattr(model, "lm_head", None)
    for module in model.modules():
        quant = getattr(module, "quant", None)
        if isinstance(quant, BlockQuantized) and module is not head:
            quant.int8_rows = rows


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bf16 where the device computes it natively or rtp's CPU kernels run (on any ISA path: they keep
    bf16 activations and compute in fp32 where the CPU has no bf16 products), else fp32 (never fp16 on a CPU)."""
    table = {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float16": torch.float16,
             "fp16": torch.float16, "half": torch.float16, "float32": torch.float32,
             "fp32": torch.float32, "float": torch.float32}
    if name != "auto":
        if table[name] == torch.float16 and device.type == "cpu":
            log.warning("float16 on a CPU runs at a small fraction of bfloat16's speed "
                        "(no native fp16 matmul); prefer --dtype bfloat16 or auto")
        return table[name]
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
    from rtp.kernels import cpu_kernels

    return torch.bfloat16 if _cpu_has_native_bf16() or cpu_kernels.available() else torch.float32


def _cpu_has_native_bf16() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def _use_rtp_compile_cache() -> None:
    """Keep Inductor's cache under rtp's home, so restarts compile from a warm cache."""
    if "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        from rtp.checkpoint.default_model import rtp_home

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(rtp_home() / "inductor")


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _default_model() -> Path:
    from rtp.checkpoint.default_model import default_model_path

    return default_model_path()
