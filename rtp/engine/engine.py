"""LLMEngine: add_request / step / abort_request.

A step is five calls (`_step`): the scheduler plans it, the runner runs the model, the
sampler turns logits into tokens, the scheduler applies them, and the output processor
turns what happened into per-request deltas:

    plan = scheduler.schedule()       rtp/runtime/scheduler.pyx  (admission, chunked prefill, preemption)
    logits = runner.forward()         rtp/engine/runner.py
    tokens = sampler.sample(...)      rtp/engine/sampler.py  (a request's fault fails it alone)
    events = scheduler.update(tokens) rtp/runtime/scheduler.pyx  (append, stop ids, length, free, cache)
    deltas = outputs.emit(events)     rtp/engine/output.py   (text, stop strings, logprobs)

The runtime owns every request's tokens, blocks and stop conditions in C; the output
processor its text. The rest are components called at named points: speculative decoding's
draft model between schedule and forward (rtp/engine/draft_model.py), prefill/decode
disaggregation (rtp/engine/disaggregation.py), EPLB (rtp/engine/expert_balancer.py) and
the tensor-parallel ranks (rtp/engine/tensor_parallel.py). Faults: rtp/errors.py.
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

from rtp.checkpoint import open_checkpoint
from rtp.checkpoint.loader import load_model
from rtp.checkpoint.hub import resolve_model
from rtp.checkpoint.tokenizer import Tokenizer, TokenizerError
from rtp.config import EngineConfig, ModelConfig
from rtp.distributed import world_rank, world_size
from rtp.engine.disaggregation import KVHandoff
from rtp.engine.draft_model import DraftModel, check_same_vocabulary
from rtp.engine.speculation_governor import SpeculationGovernor
from rtp.engine.expert_balancer import ExpertBalancer, eplb_slots, lendable_kv_blocks
from rtp.engine.grammar import GrammarCompiler, GrammarLimits, GrammarSlots
from rtp.engine.kv_cache import bytes_per_block, num_kv_blocks, resolve_kv_dtype
from rtp.engine.kv_transfer import KVLayout, KVSink
from rtp.engine.output import Logprobs, OutputProcessor, RequestDelta
from rtp.engine.prefill_budget import PrefillBudget
from rtp.engine.runner import ModelRunner
from rtp.engine.sampler import Sampler, SamplerOutput, SlotSettings
from rtp.engine.tensor_parallel import PlanChannel, follow, start_ranks, stop_followers
from rtp.errors import EngineFatal, EngineFull, InvalidRequest
from rtp.kernels.quant import BlockQuantized
from rtp.models import model_class
from rtp.models.moe import FusedMoE
from rtp.runtime import BlockAllocator, RadixCache, Scheduler
from rtp.sampling_params import SamplingParams

log = logging.getLogger("rtp.engine")


class LLMEngine:
    def __init__(self, config: EngineConfig):
        config.validate()
        self.config = config
        load, cache, sched, eplb = config.load, config.cache, config.scheduler, config.eplb
        self.speculative = config.speculative
        device = resolve_device(load.device)
        self.compile = load.compile if load.compile is not None else device.type == "cuda"
        # the expert exchange reads its counts on the host between collectives: nothing to capture
        self.compile = self.compile and config.parallel.expert_parallel_size == 1
        if self.compile:
            _use_rtp_compile_cache()
        self.dtype = resolve_dtype(load.dtype, device)
        path = resolve_model(load.model, load.revision) if load.model else _default_model()
        self.model_path = path
        checkpoint = open_checkpoint(path)  # headers only, parsed once for everything below
        declared = ModelConfig.from_hf(checkpoint.config)
        model_class([declared.architecture])  # an architecture rtp has no model for fails here, first
        self._followers, self.device = start_ranks(config, declared, device, run_follower)
        eplb_ranks, spare = (eplb_slots(eplb, config.parallel, path, declared, self.dtype, self.device,
                                        self.compile) if eplb.enable else (0, 0))
        self.model, self.model_config = load_model(path, self.dtype, self.device, redundant_experts=spare,
                                                   checkpoint=checkpoint)
        _use_activation_dtype(self.model, load.activation_dtype)
        self.tokenizer = Tokenizer.from_pretrained(resolve_model(load.tokenizer) if load.tokenizer else path)
        if load.chat_template:
            self.tokenizer.use_chat_template(load.chat_template)
        if self.tokenizer.backend.get_vocab_size() > self.model_config.vocab_size:
            # prompts holding the extra ids are refused (check_request); say why once, up front
            log.warning("the tokenizer has %d tokens, more than the model's vocabulary of %d: is it this "
                        "model's tokenizer?", self.tokenizer.backend.get_vocab_size(), self.model_config.vocab_size)
        mc: ModelConfig = self.model_config
        self.max_model_len = min(sched.max_model_len or min(mc.max_position_embeddings, 8192),
                                 mc.max_position_embeddings)
        self.eos_token_ids = sorted(set(self.tokenizer.eos_token_ids) | set(mc.eos_token_ids))
        draft_model = self._load_draft_model() if self.speculative.kind == "draft_model" else None
        specs = [layer.kv_cache_spec for layer in self.model.attention_layers()]
        # --kv-cache-dtype (rtp/engine/kv_cache.py): what it cannot do yet is refused here
        self.kv_dtype = kv_dtype = resolve_kv_dtype(cache.kv_cache_dtype, self.dtype, self.device,
                                                    self.model.attention_layers())
        if draft_model is not None:  # its cache takes the target's block ids (one block costs both) and dtype
            resolve_kv_dtype(cache.kv_cache_dtype, self.dtype, self.device, draft_model.attention_layers())
            specs += [layer.kv_cache_spec for layer in draft_model.attention_layers()]
        num_blocks = num_kv_blocks(specs, block_size=cache.block_size, dtype=kv_dtype,
                                   max_model_len=self.max_model_len, max_num_seqs=sched.max_num_seqs,
                                   budget_bytes=cache.kv_cache_memory, device=self.device)
        moe_layers = [m for m in self.model.modules() if isinstance(m, FusedMoE)] if eplb_ranks else []
        block_bytes = bytes_per_block(specs, cache.block_size, kv_dtype)
        # blocks the pool is lent while EPLB's replicas are dropped: the cache is allocated for
        # them too, committed only as they are used (rtp/engine/kv_cache.py)
        lendable = lendable_kv_blocks(moe_layers, block_bytes)
        if world_size() > 1:  # block ids are rank 0's: every rank needs as many blocks
            blocks = torch.tensor([num_blocks, lendable])
            torch.distributed.all_reduce(blocks, op=torch.distributed.ReduceOp.MIN)
            num_blocks, lendable = blocks.tolist()
        self.runner = ModelRunner(self.model, num_blocks=num_blocks + lendable, block_size=cache.block_size,
                                  max_num_seqs=sched.max_num_seqs,
                                  max_num_batched_tokens=sched.max_num_batched_tokens,
                                  max_model_len=self.max_model_len, kv_dtype=kv_dtype, device=self.device,
                                  compile=self.compile, committed_blocks=num_blocks,
                                  max_draft_tokens=self.speculative.draft_tokens)
        self.drafter = None if draft_model is None else DraftModel(
            draft_model, self.runner, num_blocks=num_blocks + lendable, committed_blocks=num_blocks,
            max_model_len=self.max_model_len, max_draft_tokens=self.speculative.draft_tokens, kv_dtype=kv_dtype,
            device=self.device, compile=self.compile)
        self.allocator = BlockAllocator(num_blocks, cache.block_size, num_blocks + lendable)
        self.cache = RadixCache(self.allocator) if cache.enable_prefix_caching else None
        self.scheduler = Scheduler(self.allocator, self.runner.plan, cache=self.cache,
                                   max_num_seqs=sched.max_num_seqs,
                                   max_num_batched_tokens=sched.max_num_batched_tokens,
                                   max_prefill_tokens_with_decodes=sched.max_prefill_tokens_with_decodes,
                                   max_model_len=self.max_model_len, eos_token_ids=self.eos_token_ids,
                                   vocab_size=mc.vocab_size, policy=sched.scheduling_policy,
                                   num_speculative_tokens=self.speculative.draft_tokens,
                                   spec_ngram_min=self.speculative.prompt_lookup_min,
                                   spec_ngram_max=self.speculative.prompt_lookup_max,
                                   spec_max_running=self.speculative.max_running,
                                   external_drafts=self.drafter is not None)
        self.prefill_budget = (PrefillBudget(sched.step_time_target,
                                             cap=sched.max_prefill_tokens_with_decodes or sched.max_num_batched_tokens,
                                             floor=cache.block_size)
                               if sched.step_time_target > 0 else None)
        # drafting only at batch sizes where it measured faster (rtp/engine/speculation_governor.py)
        self.governor = (SpeculationGovernor(self.speculative.max_running)
                         if self.speculative.draft_tokens and self.speculative.measured else None)
        self.sampler = Sampler(seed=load.seed)
        self.sampling = SlotSettings(self.scheduler.max_requests)  # each request's, by its runtime slot
        self.grammars = GrammarSlots(self.scheduler.max_requests, sched.max_num_seqs, mc.vocab_size)
        self._grammar_compiler: GrammarCompiler | None = None  # built with the first structured request
        self._compiler_lock = threading.Lock()
        self.outputs = OutputProcessor(self.tokenizer)
        self.handoff = KVHandoff(self.scheduler, self.runner)
        self._channel = PlanChannel(self.runner.plan) if world_size() > 1 else None
        self.warmup_seconds = self.runner.warmup(progress=sys.stderr.isatty())
        if self.drafter is not None:
            self.warmup_seconds += self.drafter.warmup(progress=sys.stderr.isatty())
        self.balancer: ExpertBalancer | None = None
        if eplb_ranks:  # after warm-up: its dummy steps are no traffic
            self.balancer = ExpertBalancer(moe_layers, num_ranks=eplb_ranks, window=eplb.window_size,
                                           interval=eplb.step_interval, kv_pressure=eplb.kv_pressure,
                                           kv_block_bytes=block_bytes, kv_base=num_blocks,
                                           kv_capacity=num_blocks + lendable)
        self._next_rid = itertools.count()
        log.info("engine ready: %s, %s on %s, %d KV blocks of %d tokens%s, max_model_len %d",
                 mc.architecture, str(self.dtype).removeprefix("torch."), self.device, num_blocks - 1,
                 cache.block_size, f" (+{lendable} lent while EPLB's replicas are dropped)" if lendable else "",
                 self.max_model_len)

    def _load_draft_model(self) -> torch.nn.Module:
        """The draft model of --speculative-model (rtp/engine/draft_model.py), loaded as the target is,
        refused at startup when it does not share the target's tokenizer or cannot take its context."""
        if world_size() > 1:
            raise ValueError("--speculative-model runs on one process: not with --tp or --ep above 1")
        ref = self.speculative.model
        path = resolve_model(ref)
        model, config = load_model(path, self.dtype, self.device)
        _use_activation_dtype(model, self.config.load.activation_dtype, hint=False)
        try:
            tokenizer = Tokenizer.from_pretrained(path)
        except TokenizerError:
            tokenizer = None
        check_same_vocabulary(self.tokenizer, self.model_config.vocab_size, tokenizer, config.vocab_size, ref)
        if config.max_position_embeddings < self.max_model_len:
            raise ValueError(f"the draft model {ref} takes {config.max_position_embeddings} positions, fewer than "
                             f"max_model_len {self.max_model_len}: lower --max-model-len")
        log.info("draft model: %s (%s, %d layers)", ref, config.architecture, config.num_hidden_layers)
        return model

    # -- requests ---------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    kv_sink: KVSink | None = None) -> None:
        """Queue a request (InvalidRequest naming the field when it cannot run; EngineFull when
        the runtime holds as many requests as it can). With a kv_sink it is prefill-only
        (rtp/engine/disaggregation.py): it finishes with reason "remote" once its KV and first
        token went to the sink, unless that first token already ends it."""
        params = params or SamplingParams()
        if kv_sink is not None and params.n != 1:
            raise InvalidRequest("n must be 1 for a request prefilled for another node", "n")
        if request_id in self.outputs:
            raise InvalidRequest(f"request {request_id!r} already exists")
        ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.check_request(ids, params)
        spec = params.structured_outputs
        # compiled now, unless the server already waited for it off this thread; each choice runs a copy
        grammar = None if spec is None else self.compile_grammar(spec).result()
        max_tokens = params.max_tokens or max(1, self.max_model_len - len(ids))
        prompt_ids = np.asarray(ids, dtype=np.int32)
        rids = []
        try:
            for index in range(params.n):
                rid = next(self._next_rid)
                self.scheduler.add_request(rid, prompt_ids, max_tokens=max_tokens, min_tokens=params.min_tokens,
                                           stop_token_ids=params.stop_token_ids, ignore_eos=params.ignore_eos,
                                           prefill_only=kv_sink is not None, speculate=self._drafts_for(params))
                rids.append(rid)
                self._admit_slot(rid, params, index, grammar)
        except BaseException as e:
            for rid in rids:  # all choices or none
                self.scheduler.abort(rid)
            if isinstance(e, OverflowError):  # every request slot of the runtime is taken
                raise EngineFull(str(e)) from None
            if isinstance(e, ValueError) and not isinstance(e, InvalidRequest):  # e.g. needs more KV than exists
                raise InvalidRequest(str(e)) from None
            raise
        self.outputs.add(request_id, ids, params, rids)
        if kv_sink is not None:
            self.handoff.add_sink(rids[0], kv_sink)

    def _drafts_for(self, params: SamplingParams) -> bool:
        """Whether a request's decode steps may verify drafted tokens. Not under a grammar (its
        matcher would have to take and give back the drafts) nor with penalties (each position's
        counts would have to include the drafts before it): those decode a token a step."""
        return bool(self.speculative.draft_tokens) and params.structured_outputs is None and not params.has_penalties

    def _admit_slot(self, rid: int, params: SamplingParams, index: int, grammar) -> None:
        """What a request keeps by its runtime slot: its sampling settings and a matcher of its own,
        copied from the compiled `grammar` (None: unconstrained)."""
        slot = self.scheduler.slot_of_request(rid)
        # choice i of a seeded request draws from seed + i, so n > 1 choices differ
        self.sampling.set(slot, params, None if params.seed is None else params.seed + index)
        self.grammars.set(slot, None if grammar is None else grammar.deep_copy())

    def compile_grammar(self, spec, client: str = "local"):
        """A future of the compiled grammar of a StructuredOutputs (rtp/engine/grammar/): bounded,
        cached, fair between clients (`client`: who asks), cancelled when cancelled. The server
        awaits it before queueing, so the engine thread never builds one."""
        with self._compiler_lock:
            if self._grammar_compiler is None:
                s = self.config.structured
                limits = GrammarLimits(max_bytes=s.max_bytes, max_choices=s.max_choices,
                                       max_repetition=s.max_repetition, compile_timeout=s.compile_timeout)
                self._grammar_compiler = GrammarCompiler(self.tokenizer, self.model_config.vocab_size,
                                                         self.eos_token_ids, limits)
        return self._grammar_compiler.compile(spec, client)

    def check_request(self, prompt_ids: list[int], params: SamplingParams, prompt_param: str = "prompt") -> None:
        """Everything about a request that can be refused before it runs, against this model:
        InvalidRequest naming the field. The HTTP layer calls this too, before it queues."""
        params.validate()
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty", prompt_param)
        vocab = self.model_config.vocab_size
        if not all(type(t) is int and 0 <= t < vocab for t in prompt_ids):
            raise InvalidRequest(f"prompt token ids must be integers in [0, {vocab})", prompt_param)
        params.validate_for(len(prompt_ids), vocab_size=vocab, max_model_len=self.max_model_len,
                            prompt_param=prompt_param)

    def abort_request(self, request_id: str) -> bool:
        """Drop a request wherever it is (queued, running, reserved); its blocks are free before the
        next step. False for an unknown or finished one."""
        rids = self.outputs.remove(request_id)
        reserved = self.handoff.reserved.pop(request_id, None)
        if reserved is not None:  # its partial KV is never cached
            rids.append(reserved)
        for rid in rids:
            self.scheduler.abort(rid)
            self.handoff.forget(rid)
        return bool(rids)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestDelta]:
        """One engine step; what it added to each request that moved (RequestDelta, `finished`
        set on its last).

        Faults are kept where they arise (rtp/errors.py). A failure caused by one request --
        building its sampling row, sampling it, a token outside the vocabulary, detokenizing,
        stop strings, its KV hand-off -- finishes that request with an error and the step goes
        on for the others with the tokens they would have had. A failure of a stage every
        request shares (schedule, forward, the runtime's update, a collective), or an integrity
        check that fails after a request was failed, raises EngineFatal."""
        if not self.scheduler.has_unfinished:
            return []
        try:
            return self._step()
        except EngineFatal:
            raise
        except Exception as e:
            raise EngineFatal(f"engine step failed: {e!r}") from e

    def _step(self) -> list[RequestDelta]:
        start = time.monotonic()
        s = self.scheduler
        if self.prefill_budget is not None:
            s.max_prefill_tokens_with_decodes = self.prefill_budget.budget(s.step_count, s.oldest_waiting_step, start)
        if self.governor is not None:
            s.spec_max_running = self.governor.cap(s.num_running)
        before = (s.step_count, s.spec_verifications, s.spec_emitted_tokens)
        deltas = self._run_step()
        if s.step_count == before[0]:
            return deltas  # nothing was scheduled
        seconds, plan = time.monotonic() - start, s.plan
        if self.prefill_budget is not None:
            self.prefill_budget.observe(seconds, plan.num_tokens - plan.num_decode_rows, plan.num_decode_rows)
        if self.governor is not None:
            drafts = int(np.count_nonzero(plan.sample_offsets[:plan.num_samples]))
            requests = plan.num_samples - drafts
            # a request that verified emitted its kept drafts and one more; the others one token each
            emitted = requests - (s.spec_verifications - before[1]) + (s.spec_emitted_tokens - before[2])
            self.governor.observe(seconds, requests, emitted, drafts > 0, plan.num_tokens - plan.num_decode_rows)
        return deltas

    def _run_step(self) -> list[RequestDelta]:
        if not self.scheduler.schedule():
            self.scheduler.update(np.zeros(0, dtype=np.int64))
            return []
        if self._channel is not None:
            self._channel.send_step()
        plan = self.scheduler.plan
        # the draft model's tokens into the draft rows
        if self.drafter is not None and self.drafter.propose(self.scheduler):
            self.scheduler.set_drafts(self.drafter.tokens)
        rids = self.runner.sample_req_ids().tolist()
        slots = plan.sample_slots[:plan.num_samples]
        self.grammars.prefetch(slots)  # the masks are filled beside the forward, not after it
        self.handoff.arm(rids)
        try:
            logits = self.runner.forward()
        finally:
            self.handoff.disarm()
        offsets = plan.sample_offsets[:plan.num_samples] if self.speculative.draft_tokens else None
        sampled = self.sampler.sample(logits, self.sampling, slots, self.scheduler, grammars=self.grammars,
                                      eos_token_ids=self.eos_token_ids, vocab_size=self.model_config.vocab_size,
                                      offsets=offsets)
        refused, complete = self.grammars.advance(slots, sampled.token_ids, set(sampled.failed))
        if complete:
            refused.update(self._complete_too_soon(slots, complete))
            complete -= set(refused)
        if refused:
            sampled.failed.update(refused)
            sampled.token_ids[list(refused)] = 0
        for k in sampled.failed:  # dropped by update(), which never appends their placeholder token
            self.scheduler.abort(rids[k])
        for rid in rids:
            if self.scheduler.is_first_token(rid) and self.outputs.has(rid):
                # read before update(): a request that finishes on its first token leaves the scheduler there
                self.outputs.set_cached(rid, self.scheduler.cached_prompt_tokens(rid))
        s = self.scheduler
        n = s.update(sampled.token_ids)
        deltas = self.outputs.emit(n, s.event_req_ids, s.event_tokens, s.event_finish, s.event_rows,
                                   _host_logprobs(sampled.output), ended={rids[k] for k in complete})
        for rid in self.outputs.stopped:  # a stop string or a complete grammar ended it: the runtime still runs it
            s.abort(rid)
        for k, error in sampled.failed.items():
            request_id = self.outputs.request_of(rids[k])
            if request_id is not None:
                deltas[request_id] = self.outputs.fail(request_id, error)
        if sampled.failed:
            log.warning("step: %d of %d sampling rows failed", len(sampled.failed), len(rids))
        for delta in deltas.values():
            self._after(delta)
        if sampled.failed or any(d.error is not None for d in deltas.values()):
            self._check_integrity()
        if self.balancer is not None:
            self.balancer.between_steps(self.allocator, self.runner.kv_tensors, self._channel)
        return list(deltas.values())

    def _complete_too_soon(self, slots: np.ndarray, rows: set[int]) -> dict[int, Exception]:
        """Rows whose grammar completed before the request's min_tokens: min_tokens cannot be honoured
        (the grammar takes nothing more), and is never dropped silently, so such a request fails as
        the client's mistake."""
        rows_list = sorted(rows)
        kept = slots[rows_list]
        generated = self.scheduler.output_lengths(kept) + 1  # this step's token included
        wanted = self.sampling.min_tokens[kept]
        return {r: InvalidRequest(f"the structured output was complete after {int(n)} tokens, fewer than "
                                  f"min_tokens {int(m)}: lower min_tokens or widen the grammar", "min_tokens")
                for r, n, m in zip(rows_list, generated, wanted) if n < m}

    def _after(self, delta: RequestDelta) -> None:
        """A request's delta is out: hand off a prefill-only one, forget a finished one."""
        for choice in delta.choices:
            if choice.finish_reason == "remote" and delta.error is None:
                rid = self.outputs.rids_of(delta.request_id)[choice.index]
                try:
                    self.handoff.hand_off(rid, choice.token_ids[0], choice.logprobs[0] if choice.logprobs else None,
                                          delta.num_cached_tokens)
                except Exception as e:
                    failed = self.outputs.fail(delta.request_id, e)
                    delta.choices, delta.error, delta.finished = failed.choices, e, True
        if delta.error is not None:
            log.error("request %s failed: %r", delta.request_id, delta.error, exc_info=delta.error)
        if delta.finished:
            for rid in self.outputs.remove(delta.request_id):
                if delta.error is not None:
                    self.scheduler.abort(rid)
                self.handoff.forget(rid)

    def _check_integrity(self) -> None:
        """After a request failed mid-step: the runtime's shared state must still hold together."""
        try:
            self.scheduler.check_integrity()
        except Exception as e:
            raise EngineFatal(f"the runtime's integrity check failed after a request fault: {e!r}") from e

    # -- prefill/decode disaggregation: the decode node (rtp/engine/disaggregation.py) ---------------

    def kv_layout(self) -> KVLayout:
        return self.handoff.layout()

    def reserve_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> np.ndarray:
        """Hold blocks for a prompt another node prefills; returns their ids, in which the prompt's
        KV is to be written (write_kv). MemoryError when too few are free now, InvalidRequest
        when the request could never run here. Nothing runs until resume_request()."""
        if params.n != 1:
            raise InvalidRequest("n must be 1 for a request prefilled on another node", "n")
        if request_id in self.outputs or request_id in self.handoff.reserved:
            raise InvalidRequest(f"request {request_id!r} already exists")
        self.check_request(prompt_ids, params)
        max_tokens = params.max_tokens or max(1, self.max_model_len - len(prompt_ids))
        if max_tokens < 2:
            raise InvalidRequest("a request of one token finishes on the prefill node; there is nothing to decode",
                                 "max_tokens")
        prompt = np.asarray(prompt_ids, dtype=np.int32)
        rid = next(self._next_rid)
        spec = params.structured_outputs
        grammar = None if spec is None else self.compile_grammar(spec).result()
        blocks = self.handoff.reserve(request_id, rid, prompt, max_tokens=max_tokens, min_tokens=params.min_tokens,
                                      stop_token_ids=params.stop_token_ids, ignore_eos=params.ignore_eos,
                                      speculate=self._drafts_for(params))
        if self.drafter is not None:  # KV computed elsewhere: the draft catches up on it when the request drafts
            self.drafter.forget(blocks)
        self._admit_slot(rid, params, 0, grammar)
        self.outputs.add(request_id, prompt_ids, params, [rid])
        return blocks

    def write_kv(self, layer: int, blocks: np.ndarray, num_tokens: int, kv) -> None:
        """Write token-major KV (a tensor or its raw bytes) of a reserved request's first num_tokens
        prompt tokens into its blocks. Safe from another thread while steps run."""
        self.handoff.write(layer, blocks, num_tokens, kv)

    def resume_request(self, request_id: str, first_token: int, logprobs: dict[int, float] | None = None,
                       num_cached_tokens: int = 0) -> RequestDelta:
        """The reserved request's KV is in its blocks; continue it from the first token the prefill
        node sampled (counted as generated, with its logprobs and text, as if sampled here). It
        joins the batch at the next step; the delta of that first token. KeyError for a request
        not reserved here; ValueError (nothing changed) for a token that would end it."""
        rid = self.handoff.reserved.get(request_id)
        if rid is not None:  # the first token was sampled under the grammar there: it advances it here
            slot = np.array([self.scheduler.slot_of_request(rid)])
            refused, complete = self.grammars.advance(slot, np.array([first_token]), set())
            if refused or complete:
                raise ValueError(f"the first token {first_token} " + ("breaks the request's grammar" if refused
                                 else "completes the request's grammar: the prefill node answers it"))
        rid = self.handoff.resume(request_id, first_token)
        try:
            return self.outputs.resume(rid, first_token, logprobs, num_cached_tokens)
        except Exception as e:
            delta = self.outputs.fail(request_id, e)
            self._after(delta)
            return delta

    # -- tensor parallelism (rtp/engine/tensor_parallel.py) ---------------------------------------

    def follow(self) -> None:
        """Ranks other than 0: run rank 0's steps until it stops."""
        if self._channel is None or world_rank() == 0:
            raise RuntimeError("follow() is for tensor-parallel ranks other than 0")
        on_rebalance = None
        if self.balancer is not None:
            def on_rebalance(slots, limit):
                self.balancer.follow(slots, limit, self.allocator, self.runner.kv_tensors)
        follow(self._channel, self.runner.forward, on_rebalance)

    def followers_alive(self) -> bool:
        """Whether every tensor-parallel follower this engine started still runs."""
        return all(proc.is_alive() for proc in self._followers)

    def shutdown(self) -> None:
        """Stop the grammar compiler's sandboxes and the tensor-parallel followers this engine started
        (idempotent)."""
        if self._grammar_compiler is not None:
            self._grammar_compiler.close()
        if self._channel is None or world_rank() != 0:
            return
        channel, self._channel = self._channel, None
        stop_followers(channel, self._followers)

    def stats(self) -> dict:
        stats = self.scheduler.stats()
        if self.prefill_budget is not None:
            stats["prefill_budget"] = self.prefill_budget.last
        if self.balancer is not None:
            stats["eplb"] = self.balancer.stats()
        if self.drafter is not None:
            stats["draft_model"] = self.drafter.stats()
        if self.governor is not None:
            stats["speculation"] = self.governor.stats()
        if self._grammar_compiler is not None:  # once a request brought a structured output
            stats["grammar"] = {**self._grammar_compiler.stats(), **self.grammars.stats()}
        return stats


def _use_activation_dtype(model: torch.nn.Module, dtype: str, hint: bool = True) -> None:
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


def run_follower(config: EngineConfig) -> None:
    """What a spawned tensor-parallel rank runs (rtp/engine/tensor_parallel.py)."""
    LLMEngine(config).follow()


def _host_logprobs(sampled: SamplerOutput | None) -> Logprobs | None:
    """The step's logprobs copied to the host once, when any row asked for them."""
    if sampled is None or sampled.logprobs is None:
        return None
    top = sampled.top_logprobs
    return Logprobs(sampled.logprobs.cpu().numpy(), None if top is None else top[0].cpu().numpy(),
                    None if top is None else top[1].cpu().numpy())


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bf16 where the device computes it natively, else fp32 (never fp16 on a CPU)."""
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
    return torch.bfloat16 if _cpu_has_native_bf16() else torch.float32


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
