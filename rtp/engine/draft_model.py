"""Speculative decoding's draft model: a second model proposes each drafting request's next tokens
(its greedy continuation), which the target verifies in one step as it verifies n-gram drafts.

A greedy draft is a one-hot proposal, for which the rejection rule of speculative sampling is
exactly what the scheduler's verification does (rtp/runtime/scheduler.pyx `_verify`): sample the
target at every row, keep a draft while it is what the target chose, then the target's own token.
So greedy and seeded output stay token for token the plain engine's, unseeded sampling keeps its
distribution, and a draft model that guesses badly only costs time.

The draft runs on a ModelRunner of its own whose KV cache is indexed by the target's block ids
(as many blocks of the same size; its own per-layer tensors, shaped by its own layers): the
target's BlockAllocator, prefix cache, preemption and rollback govern both caches unchanged. The
draft computes only what a drafting request needs, when it drafts: a bit per KV slot (`valid`)
says whether the draft's KV there is for the token the target's KV there is (the target's writes
clear it, the draft's set it), so a request that did not draft for a while (more running than
--speculative-max-running, a prompt just prefilled, a prefix-cache hit on blocks the draft never
saw) catches up on the positions it missed the next time it drafts, and a step in which nobody
drafts runs no draft at all. Each step, between schedule() and the target's forward (`propose`):

  0. the first pass: for each drafting request, its tokens from the first position whose draft KV
     is not valid through its last token (usually one or two: its last token, and the last draft
     of the step before, which the target kept but the draft never computed); the argmax at its
     last token is its first draft;
  j. for j = 1 .. d - 1: one row per request drafting more than j tokens, its j-th draft at its
     place (a row the target's plan holds: the same position, KV slot, block table and context
     length, gathered into buffers made once); the argmax there is its draft j + 1;

then the drafts go into the plan's input ids and the requests' token buffers (Scheduler.set_drafts).
d drafts cost d forwards of the draft model, one row per drafting request each (and the first
pass's catch-up). A draft KV slot marked valid whose draft is then rejected is rolled back with
the target's, and the target writes it again before any request reads it: stale draft KV can
never be read as valid, and a draft that guesses badly only costs acceptance, never a token of
the output.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from rtp.checkpoint.tokenizer import Tokenizer
from rtp.engine.component import Component
from rtp.engine.runner import ModelRunner
from rtp.engine.sampler import greedy_tokens
from rtp.runtime import StepPlan

log = logging.getLogger("rtp.draft")

# what a draft row takes from the target's row it drafts for: by token (a decode row's token index is its
# row index), and by sampling row
_TOKEN_ARRAYS = ("positions", "slot_mapping", "seq_lens", "block_tables")
_SAMPLE_ARRAYS = ("sample_slots", "sample_req_ids")
_PROBE_TEXT = "The quick brown fox, 42 times: def f(x): return x ** 2  # café naïve 東京\n"


class DraftModel(Component):
    """The draft model's runner and the buffers of its per-step sub-plans (see the module's doc); an
    engine component: it drafts between the plan and the target's forward."""

    name = "draft_model"

    def __init__(self, model: torch.nn.Module, target: ModelRunner, *, num_blocks: int, committed_blocks: int,
                 max_model_len: int, max_draft_tokens: int, kv_dtype: torch.dtype, device: torch.device,
                 compile: bool = False):
        tp = target.plan
        self.target = target
        self.runner = ModelRunner(model, num_blocks=num_blocks, block_size=target.block_size,
                                  max_num_seqs=tp.max_num_seqs, max_num_batched_tokens=tp.max_num_tokens,
                                  max_model_len=max_model_len, kv_dtype=kv_dtype, device=device, compile=compile,
                                  committed_blocks=committed_blocks, max_draft_tokens=max_draft_tokens)
        if self.runner.plan.width != tp.width:
            raise ValueError(f"the draft's block tables are {self.runner.plan.width} wide, the target's {tp.width}")
        n, bs = tp.max_num_seqs, target.block_size
        # per sampling row of the target's step: the drafted token its row verifies (set_drafts reads it)
        self.tokens = np.zeros(n, dtype=np.int64)
        self._next_offset = np.zeros(n, dtype=np.int32)
        ramp = np.arange(max(n, tp.max_num_tokens, max_model_len) + 1)
        self._ramp = ramp.astype(np.int32)
        self._block_of = (ramp // bs).astype(np.int32)   # a position's block-table column
        self._offset_of = ramp % bs                      # and its place in that block (int64: slots are)
        # Per KV slot: whether the draft's KV there is for the token the target's KV there is. The
        # target's writes clear it, the draft's set it; a request about to draft first computes
        # (catches up on) its positions from the first one not valid.
        self.valid = np.zeros(num_blocks * bs, dtype=bool)
        # request id -> positions before it known valid (it drafted in the last step and was not
        # preempted since: only its own target rows, at or past that, write its blocks)
        self._known: dict[int, int] = {}
        self._preemptions = -1
        self.draft_steps = 0  # forwards of the draft model, every kind
        self.drafted_rows = 0  # rows of its steps 1 .. k
        self.catch_up_tokens = 0  # tokens of the first passes: each drafting request's missed ones and its last

    def warmup(self, progress: bool = True) -> float:
        return self.runner.warmup(progress=progress)

    @torch.inference_mode()
    def propose(self, scheduler) -> bool:
        """Draft every drafting request's tokens of the target's planned step into `tokens` (whether
        any request drafts): first catch the draft's KV cache up on each one's positions it lacks,
        then run the draft once per further token. Steps that draft nothing run no draft at all."""
        tp, dp = self.target.plan, self.runner.plan
        ns, nt = tp.num_samples, tp.num_tokens
        off = tp.sample_offsets[:ns]
        if scheduler.num_preemptions != self._preemptions:  # a recomputed request's blocks may be others now
            self._preemptions, self._known = scheduler.num_preemptions, {}
        if ns == 0 or not off.any():
            self.valid[tp.slot_mapping[:nt]] = False  # the target writes these slots, the draft does not
            self._known = {}
            return False
        # a drafting request's sampling rows are consecutive, offsets 0 .. d: its last row is one whose
        # successor starts another request (offset 0) or the step ends
        nxt = self._next_offset[:ns]
        nxt[:-1] = off[1:]
        nxt[-1] = 0
        lasts = np.flatnonzero((off > 0) & (nxt == 0))
        counts = off[lasts].astype(np.int64)
        firsts = lasts - counts  # the sampling row of each one's last token
        at = self._first_pass(tp, dp, scheduler, firsts)  # its sampling row in the pass; -1: not caught up
        self.valid[tp.slot_mapping[:nt]] = False
        self.valid[dp.slot_mapping[:dp.num_tokens]] = True
        logits = self.runner.forward()
        self.draft_steps += 1
        ready = at >= 0
        # a request the pass could not catch up (its missed tokens outnumber the step's room) drafts
        # its last token again: verification rejects it, and the step after goes on catching up
        drafts = tp.input_ids[tp.logits_indices[firsts]].astype(np.int64)
        if ready.any():
            drafts[ready] = greedy_tokens(logits[torch.from_numpy(at[ready]).to(logits.device)]).cpu().numpy()
        for j in range(counts.max()):
            self.tokens[firsts[counts > j] + j + 1] = drafts[counts > j]
        for j in range(1, int(counts.max())):
            active = np.flatnonzero(ready & (counts > j))
            if not active.size:
                break
            rows = firsts[active] + j  # the target's sampling row verifying draft j: its position, slot, context
            self._write_rows(tp, dp, rows, drafts[active])
            self.valid[dp.slot_mapping[:dp.num_tokens]] = True  # draft j's KV, the target's too if kept
            logits = self.runner.forward()
            self.draft_steps += 1
            self.drafted_rows += len(rows)
            drafts[active] = greedy_tokens(logits).cpu().numpy()
            self.tokens[rows + 1] = drafts[active]
        return True

    def before_forward(self, step) -> None:
        scheduler = step.core.scheduler
        if self.propose(scheduler):
            scheduler.set_drafts(self.tokens)  # the draft's tokens into the step's draft rows

    def reserved(self, request, blocks: np.ndarray) -> None:
        self.forget(blocks)  # KV computed elsewhere: the draft catches up on it when the request drafts

    def forget(self, blocks: np.ndarray) -> None:
        """Blocks whose KV the target got without computing it (a prompt prefilled on another node):
        the draft's KV there is not for their tokens."""
        bs = self.target.block_size
        self.valid[(np.asarray(blocks, dtype=np.int64)[:, None] * bs + self._offset_of[:bs]).ravel()] = False

    def _first_pass(self, tp: StepPlan, dp: StepPlan, scheduler, firsts: np.ndarray) -> np.ndarray:
        """Write the first pass into the draft's plan: for each drafting request (its last token at
        sampling row firsts[i] of the target's step), its tokens from the first position whose
        draft KV is not valid through its last token, which samples (its first draft). Generated
        tokens take a decode row each, as the target computed them (the same kernels, so a target
        drafting for itself drafts exactly its own choices), prompt tokens one prompt row. Returns
        each request's sampling row in the pass, -1 where the step's rows or tokens ran out first
        (it catches up on the rest next step)."""
        bs, valid = self.target.block_size, self.valid
        rows_t = tp.logits_indices[firsts]
        slots = tp.sample_slots[firsts]
        rids = tp.sample_req_ids[firsts]
        known, self._known = self._known, {}
        room_t, room_r = dp.max_num_tokens, dp.max_num_seqs
        decode, prompt = [], []  # (request, first position, tokens): a decode row a token / one prompt row
        for i, row in enumerate(rows_t.tolist()):
            last = int(tp.positions[row])
            start = min(known.get(int(rids[i]), 0), last)
            bt = tp.block_tables[row]
            kv = bt[self._block_of[start:last]] * bs + self._offset_of[start:last]
            stale = np.flatnonzero(~valid[kv])
            a = start + int(stale[0]) if stale.size else last
            plen = scheduler.prompt_length(int(slots[i]))
            n_prompt, n_out = max(0, plen - a), last - max(a, plen) + 1
            if n_prompt + n_out > room_t or n_out + (n_prompt > 0) > room_r:
                # past the step's room: as much as fits in one prompt row, the rest next step
                if room_r > 0 and room_t > 0:
                    prompt.append((i, a, min(last - a + 1, room_t)))
                    room_r, room_t = room_r - 1, room_t - min(last - a + 1, room_t)
                continue
            if n_prompt:
                prompt.append((i, a, n_prompt))
            decode.append((i, a + n_prompt, n_out))
            room_r, room_t = room_r - n_out - (n_prompt > 0), room_t - n_prompt - n_out
        at = np.full(len(firsts), -1, dtype=np.int32)
        t = r = k = 0
        for group in (decode, prompt):
            for i, a, n in group:
                row = int(rows_t[i])
                bt = tp.block_tables[row]
                scheduler.copy_tokens(int(slots[i]), a, dp.input_ids[t:t + n])
                dp.positions[t:t + n] = self._ramp[a:a + n]
                dp.slot_mapping[t:t + n] = bt[self._block_of[a:a + n]] * bs + self._offset_of[a:a + n]
                m = n if group is decode else 1  # rows: one a token, or one for the whole span
                dp.block_tables[r:r + m] = bt
                dp.seq_lens[r:r + m] = self._ramp[a + n - m + 1:a + n + 1]
                dp.query_start_loc[r:r + m] = self._ramp[t:t + m]
                ends = a + n - 1 == int(tp.positions[row])  # at the request's last token: it drafts
                samples = m if group is decode else int(ends)  # decode rows all sample (a decode step's must)
                dp.logits_indices[k:k + samples] = self._ramp[t + n - samples:t + n]
                dp.sample_slots[k:k + samples] = slots[i]  # one request's rows still run its exact kernels
                dp.sample_req_ids[k:k + samples] = rids[i]
                k += samples
                if ends:
                    at[i] = k - 1
                    self._known[int(rids[i])] = a + n
                t += n
                r += m
        nd = sum(n for *_, n in decode)
        self.catch_up_tokens += t
        dp.query_start_loc[r] = t
        dp.sample_offsets[:k] = 0
        dp.take(t, r, nd, k)
        return at

    def _write_rows(self, src: StepPlan, dst: StepPlan, rows: np.ndarray, tokens: np.ndarray) -> None:
        """A decode-only step of one row per entry of `rows` (sampling rows of the target's decode rows,
        whose position, KV slot, block table and context length it keeps), fed `tokens`; what the
        previous draft step wrote past it zeroed."""
        m = len(rows)
        dst.input_ids[:m] = tokens
        at = src.logits_indices[rows]  # decode rows come first, one token each: token index == row index
        for name in _TOKEN_ARRAYS:
            getattr(dst, name)[:m] = getattr(src, name)[at]
        for name in _SAMPLE_ARRAYS:
            getattr(dst, name)[:m] = getattr(src, name)[rows]
        dst.query_start_loc[: m + 1] = self._ramp[: m + 1]
        dst.logits_indices[:m] = self._ramp[:m]
        dst.sample_offsets[:m] = 0
        dst.take(m, m, m, m)

    def stats(self) -> dict:
        return {"draft_steps": self.draft_steps, "drafted_rows": self.drafted_rows,
                "catch_up_tokens": self.catch_up_tokens}


def check_same_vocabulary(target: Tokenizer, target_vocab: int, draft: Tokenizer | None, draft_vocab: int,
                          name: str) -> None:
    """Refuse a draft model that does not share the target's tokenizer: its token ids would mean
    other words (vLLM checks the vocabulary size; this also holds token strings and an encoding
    against each other). draft None: the draft checkpoint carries no tokenizer of its own, so only
    the sizes can be compared."""
    def refuse(what: str) -> None:
        raise ValueError(f"the draft model {name} does not share the target's tokenizer: {what}")

    if draft_vocab != target_vocab:
        refuse(f"its vocabulary has {draft_vocab} tokens, the target's {target_vocab}")
    if draft is None:
        log.warning("the draft model %s has no tokenizer to compare: only its vocabulary size (%d) was checked",
                    name, draft_vocab)
        return
    if draft.vocab_size != target.vocab_size:
        refuse(f"its tokenizer has {draft.vocab_size} tokens, the target's {target.vocab_size}")
    size = min(target.vocab_size, target_vocab)
    ids = set(np.linspace(0, size - 1, num=min(size, 257)).astype(int).tolist())
    ids |= {i for i in (*target.eos_token_ids, target.bos_token_id) if i is not None and i < size}
    for i in sorted(ids):
        a, b = target.id_to_token(i), draft.id_to_token(i)
        if a != b:
            refuse(f"token {i} is {a!r} for the target, {b!r} for the draft")
    a, b = target.encode(_PROBE_TEXT, add_special_tokens=False), draft.encode(_PROBE_TEXT, add_special_tokens=False)
    if a != b:
        refuse(f"they encode {_PROBE_TEXT!r} differently ({a[:12]} vs {b[:12]})")
