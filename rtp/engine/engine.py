"""LLMEngine: add_request / step / abort, where a step is schedule -> forward -> sample -> update.

The runtime (rtp._runtime) owns every request's tokens, blocks and stop
conditions in C; this file keeps, per request, only what the runtime cannot:
its sampling parameters, detokenizer, text and stop strings. Outputs are shaped
like vLLM's (`RequestOutput.outputs[i].text / .token_ids / .finish_reason`).
"""

from __future__ import annotations

import itertools
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from rtp._runtime import FINISH_REASONS, BlockAllocator, RadixCache, Scheduler
from rtp.config import EngineConfig, ModelConfig
from rtp.distributed import (
    destroy_parallel,
    ep_size,
    init_parallel,
    local_rank,
    tp_size,
    world_rank,
    world_size,
)
from rtp.checkpoint import open_checkpoint
from rtp.engine.expert_balancer import ExpertBalancer, lendable_kv_blocks, spare_slots_for
from rtp.engine.kv_cache import bytes_per_block, num_kv_blocks, release_blocks
from rtp.engine.kv_transfer import KVLayout, KVSink, LayerTaps, layout_of, scatter, token_slots
from rtp.checkpoint.loader import load_model
from rtp.engine.runner import ModelRunner
from rtp.engine.sampler import Sampler, SamplerOutput, SamplingBatch
from rtp.engine.tensor_parallel import PlanChannel, spawn_followers, threads_per_rank
from rtp.engine.tokenizer import IncrementalDetokenizer, Tokenizer
from rtp.errors import EngineFatal, EngineFull, InvalidRequest
from rtp.models.moe import FusedMoE
from rtp.sampling_params import SamplingParams

log = logging.getLogger("rtp.engine")


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None          # "stop" | "length" | "abort" | "error" | "remote"
    stop_reason: int | str | None = None      # the stop token id or stop string that ended it
    logprobs: list[dict[int, float]] | None = None  # per token: {token id: logprob}, sampled first
    cumulative_logprob: float | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    finished: bool = False
    error: Exception | None = None  # set when processing this request failed; the others go on


@dataclass
class _Sequence:
    """One runtime request: a (request, choice index) pair."""

    rid: int
    request: RequestOutput
    output: CompletionOutput
    params: SamplingParams
    detok: IncrementalDetokenizer
    prompt_ids: np.ndarray
    out_ids: list[int] = field(default_factory=list)
    held_text: str = ""  # text withheld because it may be the start of a stop string
    kv_sink: KVSink | None = None  # prefill-only: where its KV and first token go


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


class LLMEngine:
    def __init__(self, config: EngineConfig):
        config.validate()
        self.config = config
        self.device = resolve_device(config.device)
        self.compile = config.compile if config.compile is not None else self.device.type == "cuda"
        # the expert exchange reads its counts on the host between collectives: nothing to capture
        self.compile = self.compile and config.expert_parallel_size == 1
        if self.compile:
            _use_rtp_compile_cache()
        self.dtype = resolve_dtype(config.dtype, self.device)
        path = Path(config.model).expanduser() if config.model else _default_model()
        if not path.exists():
            raise FileNotFoundError(f"model path {path} does not exist")
        self._followers: list = []
        self._channel: PlanChannel | None = None
        tp, ep = config.tensor_parallel_size, config.expert_parallel_size
        ranks = max(tp, ep)  # config.validate() checked each is 1 or this
        if ranks > 1 and world_size() == 1:  # checked before any rank starts, so only one reports it
            checkpoint = ModelConfig.from_hf(open_checkpoint(path).config)
            if ep > 1 and not checkpoint.num_experts:  # each rank would only repeat the same dense model
                raise ValueError(f"expert_parallel_size {ep}: {checkpoint.architecture} has no experts to split")
            if tp > 1:
                checkpoint.check_tensor_parallel(tp)
        threads = threads_per_rank(ranks)  # a bad RTP_NUM_THREADS fails before any rank starts
        if ranks > 1 and world_size() == 1:  # rank 0 starts the others (under torchrun they exist)
            init, self._followers = spawn_followers(config, ranks)
            init_parallel(tp, ep, 0, init_method=init)
        if ranks > 1 or os.environ.get("RTP_NUM_THREADS"):  # one rank keeps torch's default unless told
            torch.set_num_threads(threads)
        if ranks > 1 and self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", local_rank())  # each rank of a host its own GPU
        if (tp_size(), ep_size()) != (tp, ep):
            raise ValueError(f"tensor_parallel_size {tp} and expert_parallel_size {ep}, but the process group "
                             f"has tp {tp_size()} and ep {ep_size()}")
        self.model_path = path
        eplb_ranks, spare = self._eplb_slots(path) if config.enable_eplb else (0, 0)
        self.model, self.model_config = load_model(path, self.dtype, self.device, redundant_experts=spare)
        self.tokenizer = Tokenizer.from_pretrained(path)
        mc: ModelConfig = self.model_config
        self.max_model_len = min(config.max_model_len or min(mc.max_position_embeddings, 8192),
                                 mc.max_position_embeddings)
        self.eos_token_ids = sorted(set(self.tokenizer.eos_token_ids) | set(mc.eos_token_ids))
        specs = [layer.kv_cache_spec for layer in self.model.attention_layers()]
        num_blocks = num_kv_blocks(specs, block_size=config.block_size, dtype=self.dtype,
                                   max_model_len=self.max_model_len, max_num_seqs=config.max_num_seqs,
                                   budget_bytes=config.kv_cache_memory, device=self.device)
        moe_layers = [m for m in self.model.modules() if isinstance(m, FusedMoE)] if eplb_ranks else []
        block_bytes = bytes_per_block(specs, config.block_size, self.dtype)
        # blocks the pool is lent while EPLB's replicas are dropped: the cache is allocated for
        # them too, committed only as they are used (rtp/engine/kv_cache.py)
        lendable = lendable_kv_blocks(moe_layers, block_bytes)
        if world_size() > 1:  # block ids are rank 0's: every rank needs as many blocks
            blocks = torch.tensor([num_blocks, lendable])
            torch.distributed.all_reduce(blocks, op=torch.distributed.ReduceOp.MIN)
            num_blocks, lendable = blocks.tolist()
        self.runner = ModelRunner(self.model, num_blocks=num_blocks + lendable, block_size=config.block_size,
                                  max_num_seqs=config.max_num_seqs,
                                  max_num_batched_tokens=config.max_num_batched_tokens,
                                  max_model_len=self.max_model_len, kv_dtype=self.dtype, device=self.device,
                                  compile=self.compile, committed_blocks=num_blocks)
        self.allocator = BlockAllocator(num_blocks, config.block_size, num_blocks + lendable)
        self.cache = RadixCache(self.allocator) if config.enable_prefix_caching else None
        self.scheduler = Scheduler(self.allocator, self.runner.plan, cache=self.cache,
                                   max_num_seqs=config.max_num_seqs,
                                   max_num_batched_tokens=config.max_num_batched_tokens,
                                   max_prefill_tokens_with_decodes=config.max_prefill_tokens_with_decodes,
                                   max_model_len=self.max_model_len, eos_token_ids=self.eos_token_ids,
                                   vocab_size=mc.vocab_size, policy=config.scheduling_policy)
        self.sampler = Sampler(seed=config.seed)
        if world_size() > 1:
            self._channel = PlanChannel(self.runner.plan)
        self.warmup_seconds = self.runner.warmup(progress=sys.stderr.isatty())
        self.balancer: ExpertBalancer | None = None
        if eplb_ranks:  # after warm-up: its dummy steps are no traffic
            self.balancer = ExpertBalancer(moe_layers, num_ranks=eplb_ranks, window=config.eplb_window_size,
                                           interval=config.eplb_step_interval, kv_pressure=config.eplb_kv_pressure,
                                           kv_block_bytes=block_bytes, kv_base=num_blocks,
                                           kv_capacity=num_blocks + lendable)
        self._seqs: dict[int, _Sequence] = {}
        self._requests: dict[str, list[int]] = {}  # request id -> runtime ids of its choices
        self._next_rid = itertools.count()
        self._reserved: dict[str, int] = {}  # request id -> runtime id, KV on its way from a prefill node
        self._taps: LayerTaps | None = None  # installed by the first prefill-only request
        log.info("engine ready: %s, %s on %s, %d KV blocks of %d tokens%s, max_model_len %d",
                 mc.architecture, str(self.dtype).removeprefix("torch."), self.device, num_blocks - 1,
                 config.block_size, f" (+{lendable} lent while EPLB's replicas are dropped)" if lendable else "",
                 self.max_model_len)

    # -- requests ---------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams | None = None,
                    kv_sink: KVSink | None = None) -> RequestOutput:
        """Queue a request. With a kv_sink it is prefill-only (prefill/decode disaggregation): its
        KV goes to the sink layer by layer during its last prefill step, then its first token; its
        output then finishes with reason "remote" and its blocks are free again (the prompt's
        stays in the prefix cache). A first token that already ends it finishes it as usual."""
        params = params or SamplingParams()
        if kv_sink is not None and params.n != 1:
            raise InvalidRequest("n must be 1 for a request prefilled for another node", "n")
        if request_id in self._requests:
            raise InvalidRequest(f"request {request_id!r} already exists")
        if isinstance(prompt, str):
            text, ids = prompt, self.tokenizer.encode(prompt)
        else:
            text, ids = None, list(prompt)
        self.check_request(ids, params)
        if kv_sink is not None and self._taps is None:
            self._taps = LayerTaps(self.model.attention_layers(), self.runner.kv_caches)
        max_tokens = params.max_tokens or max(1, self.max_model_len - len(ids))
        prompt_ids = np.asarray(ids, dtype=np.int32)
        request = RequestOutput(request_id, text, list(ids), [])
        rids = []
        try:
            for index in range(params.n):
                rid = next(self._next_rid)
                self.scheduler.add_request(rid, prompt_ids, max_tokens=max_tokens, min_tokens=params.min_tokens,
                                           stop_token_ids=params.stop_token_ids or (),
                                           ignore_eos=params.ignore_eos, prefill_only=kv_sink is not None)
                rids.append(rid)
                output = CompletionOutput(index, logprobs=[] if params.logprobs is not None else None,
                                          cumulative_logprob=0.0 if params.logprobs is not None else None)
                request.outputs.append(output)
                self._seqs[rid] = _Sequence(rid, request, output, params,
                                            IncrementalDetokenizer(self.tokenizer, ids,
                                                                   skip_special_tokens=params.skip_special_tokens),
                                            prompt_ids, kv_sink=kv_sink)
        except BaseException as e:
            for rid in rids:  # all choices or none
                self.scheduler.abort(rid)
                self._seqs.pop(rid, None)
            if isinstance(e, OverflowError):  # every request slot of the runtime is taken
                raise EngineFull(str(e)) from None
            if isinstance(e, ValueError) and not isinstance(e, InvalidRequest):  # e.g. needs more KV than exists
                raise InvalidRequest(str(e)) from None
            raise
        self._requests[request_id] = rids
        return request

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
        reserved = self._reserved.pop(request_id, None)
        if reserved is not None:  # its blocks return to the pool; their partial KV is never cached
            self.scheduler.abort(reserved)
            self._seqs.pop(reserved, None)
            return True
        rids = self._requests.pop(request_id, None)
        if rids is None:
            return False
        for rid in rids:
            self.scheduler.abort(rid)
            seq = self._seqs.pop(rid, None)
            if seq is not None and seq.output.finish_reason is None:
                seq.output.finish_reason = "abort"
        return True

    def has_unfinished_requests(self) -> bool:
        return bool(self._requests)

    # -- the step ---------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """One engine step; returns the requests that received tokens or finished (marked so).

        Faults are kept where they arise (rtp/errors.py). A failure caused by one request --
        building its sampling row, sampling it, a token outside the vocabulary, detokenizing,
        stop strings, its KV hand-off -- finishes that request with an error (`RequestOutput.error`)
        and the step goes on for the others with the tokens they would have had. A failure of a
        stage every request shares (schedule, forward, the runtime's update, a collective), or
        an integrity check that fails after a request was failed, raises EngineFatal."""
        if not self.scheduler.has_unfinished:
            return []
        try:
            return self._step()
        except EngineFatal:
            raise
        except Exception as e:
            raise EngineFatal(f"engine step failed: {e!r}") from e

    def _step(self) -> list[RequestOutput]:
        self.scheduler.schedule()
        plan = self.scheduler.plan
        if plan.num_rows == 0:
            self.scheduler.update(np.zeros(0, dtype=np.int64))
            return []
        if self._channel is not None:
            self._channel.send_step()
        seqs = [self._seqs[rid] for rid in self.runner.sample_req_ids().tolist()]
        if self._taps is not None:
            self._arm_taps(seqs)
        try:
            logits = self.runner.forward()
        finally:
            if self._taps is not None:
                self._taps.disarm()
        tokens, sampled, failed = self._sample(logits, seqs)
        for k in failed:  # dropped by update(), which never appends their placeholder token
            self.scheduler.abort(seqs[k].rid)
        for seq in seqs:
            # read before update(): a request that finishes on its first token leaves the scheduler there
            if not seq.out_ids and seq.output.index == 0:
                seq.request.num_cached_tokens = self.scheduler.cached_prompt_tokens(seq.rid)
        n = self.scheduler.update(tokens)
        touched: dict[str, RequestOutput] = {}
        faults = 0

        def fail(seq: _Sequence, error: Exception) -> None:
            nonlocal faults
            faults += 1
            self._fail(seq.request, error)
            touched[seq.request.request_id] = seq.request

        for k, seq in enumerate(seqs):
            if k in failed:
                fail(seq, failed[k])
            elif seq.rid in self._seqs:  # else aborted while the step ran, or failed with a sibling choice
                try:
                    self._append(seq, k, int(tokens[k]), sampled)
                except Exception as e:  # a detokenizer or stop-string failure ends this request alone
                    fail(seq, e)
                touched[seq.request.request_id] = seq.request
        finish = self.scheduler.event_finish
        for i in range(n):
            rid = int(self.scheduler.event_req_ids[i])
            reason = FINISH_REASONS[int(finish[i])]
            seq = self._seqs.get(rid)
            if seq is None or reason is None:
                continue
            try:
                if reason == "remote":
                    self._hand_off(seq, int(self.scheduler.event_tokens[i]))
                if seq.output.finish_reason is None:
                    self._finish(seq, reason, stop_reason=int(self.scheduler.event_tokens[i])
                                 if reason == "stop" else None)
            except Exception as e:
                fail(seq, e)
        if faults:
            self._check_integrity()
        if self.balancer is not None:
            self._rebalance_experts()
        return list(touched.values())

    def _sample(self, logits: torch.Tensor, seqs: list[_Sequence]
                ) -> tuple[np.ndarray, SamplerOutput | None, dict[int, Exception]]:
        """One token per sampling row, and the rows whose request faulted (a placeholder token 0
        stands in for theirs). When sampling the batch raises, each row is sampled alone to find
        the requests that caused it; the others are then sampled together, as they would have been."""
        if not seqs:
            return np.zeros(0, dtype=np.int64), None, {}
        failed: dict[int, Exception] = {}
        try:
            sampled = self.sampler(logits, self._batch(seqs))
        except Exception as batch_error:
            for k, seq in enumerate(seqs):
                try:
                    self.sampler(logits[k:k + 1], self._batch([seq]))
                except Exception as e:
                    failed[k] = e
            if not failed:  # only together: every row is a suspect
                failed = dict.fromkeys(range(len(seqs)), batch_error)
            sampled = self._sample_rows(logits, seqs, failed)
        if sampled is None:
            tokens = np.zeros(len(seqs), dtype=np.int64)
        else:
            tokens = sampled.token_ids.cpu().numpy()
        vocab = self.model_config.vocab_size
        for k in np.flatnonzero((tokens < 0) | (tokens >= vocab)).tolist():
            if k not in failed:  # NaN logits or a sampler bug under this request's settings
                failed[k] = RuntimeError(f"sampling produced token id {int(tokens[k])}, outside the "
                                         f"vocabulary of {vocab}")
        if failed:
            tokens = tokens.copy()
            tokens[list(failed)] = 0
            log.warning("step: %d of %d sampling rows failed", len(failed), len(seqs))
        return tokens, sampled, failed

    def _sample_rows(self, logits: torch.Tensor, seqs: list[_Sequence], failed: dict[int, Exception]
                     ) -> SamplerOutput | None:
        """The rows not in `failed`, sampled together and scattered back to full-batch rows."""
        good = [k for k in range(len(seqs)) if k not in failed]
        if not good:
            return None
        try:
            out = self.sampler(logits[good], self._batch([seqs[k] for k in good]))
        except Exception as e:
            failed.update(dict.fromkeys(good, e))
            return None
        index = torch.tensor(good, device=out.token_ids.device)

        def spread(t: torch.Tensor) -> torch.Tensor:
            full = t.new_zeros((len(seqs), *t.shape[1:]))
            return full.index_copy_(0, index, t)

        top = None if out.top_logprobs is None else (spread(out.top_logprobs[0]), spread(out.top_logprobs[1]))
        return SamplerOutput(spread(out.token_ids), None if out.logprobs is None else spread(out.logprobs), top)

    def _check_integrity(self) -> None:
        """After a request failed mid-step: the runtime's shared state must still hold together."""
        try:
            self.scheduler.check_integrity()
        except Exception as e:
            raise EngineFatal(f"the runtime's integrity check failed after a request fault: {e!r}") from e

    # -- EPLB ---------------------------------------------------------------------------------

    def _eplb_slots(self, path: Path) -> tuple[int, int]:
        """(planner ranks, spare expert slots per layer) for --enable-eplb; (0, 0) for a dense model."""
        if self.compile and os.environ.get("RTP_FREEZE") == "1":  # frozen weights would not see the moves
            raise ValueError("--enable-eplb moves expert weights in place: not with RTP_FREEZE=1 graphs")
        mc = ModelConfig.from_hf(open_checkpoint(path).config)
        if not mc.num_experts:
            log.warning("--enable-eplb: %s has no experts; EPLB stays off", mc.architecture)
            return 0, 0
        files = [path] if path.is_file() else list(path.glob("*.safetensors")) + list(path.glob("*.bin"))
        ranks, spare = spare_slots_for(self.config, mc, sum(f.stat().st_size for f in files), self.dtype,
                                       self.device, self.config.expert_parallel_size)
        if world_size() > 1:  # each rank measured its own free memory: every layer needs the same slots
            agreed = torch.tensor([spare])
            torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN)
            spare = int(agreed)
        return ranks, spare

    def _rebalance_experts(self) -> None:
        """Between steps: a due EPLB plan, made here and applied on every rank before the next step.

        The KV pool is resized around the move: lent blocks go back (shrink) before replicas
        take their memory again, and are lent (grow) only after the replicas have left it. A plan
        whose shrink is refused (lent blocks still hold KV) is not applied. Pressure is judged
        against the pool as built, the one the replicas leave: a pool grown into their memory
        would otherwise look relieved and call them back at once."""
        a = self.allocator
        decision = self.balancer.after_step(a.num_used / max(1, a.base - 1))
        if decision is None:
            return
        old, limit = a.num_blocks, self.balancer.kv_limit_after(decision.slots)
        if limit < old and not a.shrink(limit):
            self.balancer.wait_for_kv(decision, old - limit)
            return
        if self._channel is not None:
            self._channel.send_rebalance(decision.slots, limit)
        self._move_experts(decision.slots, old, limit, decision)

    def _follow_rebalance(self, slots: np.ndarray, limit: int) -> None:
        """A follower: rank 0's rebalance, with the KV limit rank 0 moves to (this rank's
        allocator holds no blocks, so it mirrors the limit without refusal)."""
        old = self.allocator.num_blocks
        if limit < old:
            self.allocator.shrink(limit)
        self._move_experts(slots, old, limit)

    def _move_experts(self, slots: np.ndarray, old: int, limit: int, decision=None) -> None:
        if limit < old:  # blocks handed back: their KV pages go before the replicas' come
            release_blocks(self.runner.kv_caches, limit, old)
        self.balancer.apply(slots, decision, kv_limit=limit)
        if limit > old:
            self.allocator.grow(limit)

    # -- prefill/decode disaggregation ------------------------------------------------------------

    def kv_layout(self) -> KVLayout:
        return layout_of(self.runner.kv_caches)

    def _arm_taps(self, seqs: list[_Sequence]) -> None:
        """A prefill-only request samples only in the step that computes its last prompt chunk:
        by then its earlier chunks' KV is in place, so each layer's hook can take all of it."""
        taps = []
        for seq in seqs:
            if seq.kv_sink is not None:
                state = self.scheduler.request_state(seq.rid)
                taps.append((token_slots(state["block_ids"], self.scheduler.block_size, state["num_tokens"]),
                             seq.kv_sink))
        self.runner.taps = self._taps  # the runner hands them every layer, whichever path runs the step
        self._taps.arm(taps)

    def _hand_off(self, seq: _Sequence, token: int) -> None:
        """A prefill-only request sampled its first token: every layer's KV went to its sink during
        the step, so its blocks are free at once (its prompt stays in the prefix cache)."""
        self.scheduler.release(seq.rid)
        logprobs = seq.output.logprobs[-1] if seq.output.logprobs else None
        seq.kv_sink.finish(token, logprobs, seq.request.num_cached_tokens)

    def reserve_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> np.ndarray:
        """Decode node: hold blocks for a prompt another node prefills; returns their ids, in which
        the prompt's KV is to be written (write_kv). MemoryError when too few are free now, ValueError
        when the request could never run here. Nothing runs until resume_request()."""
        params.validate()
        if params.n != 1:
            raise ValueError("n must be 1 for a request prefilled on another node")
        if request_id in self._requests or request_id in self._reserved:
            raise ValueError(f"request {request_id!r} already exists")
        if not prompt_ids or len(prompt_ids) >= self.max_model_len:
            raise ValueError(f"a prompt of {len(prompt_ids)} tokens leaves no room to decode "
                             f"(max_model_len {self.max_model_len})")
        max_tokens = params.max_tokens or max(1, self.max_model_len - len(prompt_ids))
        if max_tokens < 2:
            raise ValueError("a request of one token finishes on the prefill node; there is nothing to decode")
        prompt = np.asarray(prompt_ids, dtype=np.int32)
        rid = next(self._next_rid)
        blocks = self.scheduler.reserve(rid, prompt, max_tokens=max_tokens, min_tokens=params.min_tokens,
                                        stop_token_ids=params.stop_token_ids or (), ignore_eos=params.ignore_eos)
        request = RequestOutput(request_id, None, list(prompt_ids), [])
        output = CompletionOutput(0, logprobs=[] if params.logprobs is not None else None,
                                  cumulative_logprob=0.0 if params.logprobs is not None else None)
        request.outputs.append(output)
        self._seqs[rid] = _Sequence(rid, request, output, params,
                                    IncrementalDetokenizer(self.tokenizer, prompt_ids,
                                                           skip_special_tokens=params.skip_special_tokens),
                                    prompt)
        self._reserved[request_id] = rid
        return blocks

    def write_kv(self, layer: int, blocks: np.ndarray, num_tokens: int, kv) -> None:
        """Write token-major KV (a tensor or its raw bytes) of a reserved request's first num_tokens
        prompt tokens into its blocks. Safe from another thread while steps run: no step reads
        or writes the blocks of a reserved request."""
        scatter(self.runner.kv_caches[layer], token_slots(blocks, self.scheduler.block_size, num_tokens), kv)

    def resume_request(self, request_id: str, first_token: int, logprobs: dict[int, float] | None = None,
                       num_cached_tokens: int = 0) -> RequestOutput:
        """Decode node: the reserved request's KV is in its blocks; continue it from the first token
        the prefill node sampled (counted as generated, with its logprobs and text, as if sampled
        here). It joins the batch at the next step. KeyError for a request not reserved here."""
        rid = self._reserved.get(request_id)
        if rid is None:
            raise KeyError(f"request {request_id!r} is not reserved here")
        self.scheduler.resume(rid, first_token)  # ValueError (and nothing changed) if it would finish
        del self._reserved[request_id]
        seq = self._seqs[rid]
        seq.request.num_cached_tokens = num_cached_tokens
        out = seq.output
        seq.out_ids.append(first_token)
        out.token_ids.append(first_token)
        if out.logprobs is not None:
            entry = dict(logprobs) if logprobs else {first_token: 0.0}
            out.logprobs.append(entry)
            out.cumulative_logprob += entry.get(first_token, 0.0)
        self._requests[request_id] = [rid]
        try:
            self._add_text(seq, seq.detok.add(first_token))
        except Exception as e:
            self._fail(seq.request, e)
        return seq.request

    def follow(self) -> None:
        """Tensor-parallel ranks other than 0: run rank 0's steps until it stops."""
        if self._channel is None or world_rank() == 0:
            raise RuntimeError("follow() is for tensor-parallel ranks other than 0")
        try:
            on_rebalance = self._follow_rebalance if self.balancer is not None else None
            while self._channel.receive(on_rebalance):
                self.runner.forward()
        finally:
            destroy_parallel()

    def followers_alive(self) -> bool:
        """Whether every tensor-parallel follower this engine started still runs."""
        return all(proc.is_alive() for proc in self._followers)

    def shutdown(self) -> None:
        """Stop the tensor-parallel followers this engine started (idempotent)."""
        if self._channel is None or world_rank() != 0:
            return
        channel, self._channel = self._channel, None
        try:
            channel.send_stop()
        finally:
            for proc in self._followers:
                proc.join(timeout=30)
            destroy_parallel()

    def _batch(self, seqs: list[_Sequence]) -> SamplingBatch:
        # choice i of a seeded request draws from seed + i, so n > 1 choices differ
        seeds = [None if s.params.seed is None else s.params.seed + s.output.index for s in seqs]
        return SamplingBatch.build(
            [s.params for s in seqs], [s.out_ids for s in seqs], [s.prompt_ids for s in seqs],
            eos_token_ids=self.eos_token_ids, seeds=seeds, device=self.device)

    def _append(self, seq: _Sequence, k: int, token: int, sampled) -> None:
        out = seq.output
        seq.out_ids.append(token)
        out.token_ids.append(token)
        if out.logprobs is not None and sampled.logprobs is not None:
            entry = {token: float(sampled.logprobs[k])}
            if sampled.top_logprobs is not None and seq.params.logprobs:
                values, ids = sampled.top_logprobs
                for j in range(seq.params.logprobs):
                    entry.setdefault(int(ids[k, j]), float(values[k, j]))
            out.logprobs.append(entry)
            out.cumulative_logprob += entry[token]
        self._add_text(seq, seq.detok.add(token))

    def _add_text(self, seq: _Sequence, piece: str) -> None:
        """Append text, honouring stop strings (never emitted unless asked)."""
        stops = seq.params.stop
        if not stops:
            seq.output.text += piece
            return
        pending = seq.held_text + piece
        for stop in stops:
            at = pending.find(stop)
            if at >= 0:
                keep = pending[: at + len(stop)] if seq.params.include_stop_str_in_output else pending[:at]
                seq.output.text += keep
                seq.held_text = ""
                self.scheduler.abort(seq.rid)
                self._finish(seq, "stop", stop_reason=stop)
                return
        # hold back the longest tail that could still grow into a stop string
        hold = 0
        for stop in stops:
            for n in range(min(len(stop) - 1, len(pending)), 0, -1):
                if stop.startswith(pending[-n:]):
                    hold = max(hold, n)
                    break
        seq.output.text += pending[: len(pending) - hold]
        seq.held_text = pending[len(pending) - hold:]

    def _finish(self, seq: _Sequence, reason: str, stop_reason=None) -> None:
        out = seq.output
        if not isinstance(stop_reason, str):  # a stop string already cut the text
            out.text += seq.held_text + seq.detok.flush()
        seq.held_text = ""
        out.finish_reason = reason
        out.stop_reason = stop_reason
        self._seqs.pop(seq.rid, None)
        request = seq.request
        if all(o.finish_reason is not None for o in request.outputs):
            request.finished = True
            self._requests.pop(request.request_id, None)

    def _fail(self, request: RequestOutput, error: Exception) -> None:
        """End a request whose processing raised: its unfinished choices finish with "error",
        its blocks go back, and `request.error` carries the cause to whoever waits for it."""
        if request.error is not None:
            return  # another of its choices failed first
        log.error("request %s failed: %r", request.request_id, error, exc_info=error)
        for out in request.outputs:
            if out.finish_reason is None:
                out.finish_reason = "error"
        self.abort_request(request.request_id)
        request.error = error
        request.finished = True

    def stats(self) -> dict:
        stats = self.scheduler.stats()
        if self.balancer is not None:
            stats["eplb"] = self.balancer.stats()
        return stats


def _default_model() -> Path:
    from rtp.checkpoint.default_model import default_model_path

    return default_model_path()
