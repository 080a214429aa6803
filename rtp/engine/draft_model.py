"""Speculative decoding's draft model: a second model proposes each drafting request's next tokens
(its greedy continuation), which the target verifies in one step as it verifies n-gram drafts.

A greedy draft is a one-hot proposal, for which the rejection rule of speculative sampling is
exactly what the scheduler's verification does (rtp/runtime/scheduler.pyx `_verify`): sample the
target at every row, keep a draft while it is what the target chose, then the target's own token.
So greedy and seeded output stay token for token the plain engine's, unseeded sampling keeps its
distribution, and a draft model that guesses badly only costs time.

The draft runs on a ModelRunner of its own whose KV cache is indexed by the target's block ids
(as many blocks of the same size; its own per-layer tensors, shaped by its own layers): the
target's BlockAllocator, prefix cache, preemption and rollback govern both caches unchanged,
because the draft writes a position's KV in the step the target does, or the step after (a
prefix-cache hit finds both). Each step, between schedule() and the target's forward (`propose`):

  0. the first pass: the target's plan without its draft rows -- prompt chunks, plain decodes and
     each drafting request's last token -- after one row for each request whose previous step
     kept every draft (the last draft's KV, which step j below leaves to the step after, since it
     is needed only then); the argmax at a drafting request's last token is its first draft;
  j. for j = 1 .. d - 1: one row per request drafting more than j tokens, its j-th draft at its
     place (a row the target's plan holds: the same position, KV slot, block table and context
     length, gathered into buffers made once); the argmax there is its draft j + 1;

then the drafts go into the plan's input ids and the requests' token buffers (Scheduler.set_drafts).
d drafts cost d forwards of the draft model, one row per drafting request each. Where the step
after does not come as expected (the request finished, or was preempted and recomputes anyway), a
kept last draft never gets its draft KV: a cached block may then hold one stale draft position,
which can only cost acceptance, never a token of the output.
"""

from __future__ import annotations

import logging

import numpy as np
import torch

from rtp.checkpoint.tokenizer import Tokenizer
from rtp.engine.runner import ModelRunner
from rtp.engine.sampler import greedy_tokens
from rtp.runtime import StepPlan

log = logging.getLogger("rtp.draft")

# what a draft row takes from the target's row it drafts for: by token (a decode row's token index is its
# row index), and by sampling row
_TOKEN_ARRAYS = ("positions", "slot_mapping", "seq_lens", "block_tables")
_SAMPLE_ARRAYS = ("sample_slots", "sample_req_ids")
_PROBE_TEXT = "The quick brown fox, 42 times: def f(x): return x ** 2  # café naïve 東京\n"


class DraftModel:
    """The draft model's runner and the buffers of its per-step sub-plans (see the module's doc)."""

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
        n = tp.max_num_seqs
        # per sampling row of the target's step: the drafted token its row verifies (set_drafts reads it)
        self.tokens = np.zeros(n, dtype=np.int64)
        self._next_offset = np.zeros(n, dtype=np.int32)
        self._ramp = np.arange(max(n, tp.max_num_tokens) + 1, dtype=np.int32)
        self._keep = np.zeros(n, dtype=bool)     # the target's decode rows the first pass keeps
        self._where = np.zeros(n, dtype=np.int32)  # and where they go in it
        # request id -> (position, token) of its last draft, whose draft KV the next step writes if kept
        self._lag: dict[int, tuple[int, int]] = {}
        self.draft_steps = 0  # forwards of the draft model, every kind
        self.drafted_rows = 0  # rows of its steps 1 .. k

    def warmup(self, progress: bool = True) -> float:
        return self.runner.warmup(progress=progress)

    @torch.inference_mode()
    def propose(self) -> bool:
        """Run the draft over the target's planned step (keeping its KV cache in step with the
        target's) and draft every drafting request's tokens into `tokens`; whether any drafts."""
        tp, dp = self.target.plan, self.runner.plan
        ns = tp.num_samples
        off = tp.sample_offsets[:ns]
        lag, self._lag = self._lag_rows(tp), {}
        kept = self._first_pass(tp, dp, lag)
        logits = self.runner.forward()
        self.draft_steps += 1
        if ns == 0 or not off.any():
            return False
        # a drafting request's sampling rows are consecutive, offsets 0 .. d: its last row is one whose
        # successor starts another request (offset 0) or the step ends
        nxt = self._next_offset[:ns]
        nxt[:-1] = off[1:]
        nxt[-1] = 0
        lasts = np.flatnonzero((off > 0) & (nxt == 0))
        counts = off[lasts].astype(np.int64)
        firsts = lasts - counts  # the sampling row of each one's last token
        at = len(lag) + np.searchsorted(kept, firsts)  # their sampling rows in the first pass
        drafts = greedy_tokens(logits[torch.from_numpy(at).to(logits.device)]).cpu().numpy()
        self.tokens[firsts + 1] = drafts
        for j in range(1, int(counts.max())):
            active = np.flatnonzero(counts > j)
            rows = firsts[active] + j  # the target's sampling row verifying draft j: its position, slot, context
            self._write_rows(tp, dp, rows, drafts[active])
            logits = self.runner.forward()
            self.draft_steps += 1
            self.drafted_rows += len(rows)
            drafts[active] = greedy_tokens(logits).cpu().numpy()
            self.tokens[rows + 1] = drafts[active]
        # Each one's last draft has no draft KV yet: the step after writes it, in its first pass, if the
        # target kept it (then it is the token before that request's next one).
        at = tp.logits_indices[lasts]
        for rid, pos, tok in zip(tp.sample_req_ids[lasts].tolist(), tp.positions[at].tolist(),
                                 self.tokens[lasts].tolist()):
            self._lag[rid] = (pos, tok)
        return True

    def _lag_rows(self, tp: StepPlan) -> list[tuple[int, int, int, int]]:
        """(target row, position, token, slot) of each request whose previous step kept every draft:
        its last draft, just before the row's token, still lacks its draft KV."""
        if not self._lag:
            return []
        ns, nd = tp.num_samples, tp.num_decode_rows
        out = []
        for k in np.flatnonzero(tp.sample_offsets[:ns] == 0).tolist():
            row = int(tp.logits_indices[k])
            entry = self._lag.get(int(tp.sample_req_ids[k]))
            if entry is not None and row < nd and tp.positions[row] == entry[0] + 1:
                out.append((row, *entry, int(tp.sample_slots[k])))
        return out

    def _first_pass(self, tp: StepPlan, dp: StepPlan, lag: list[tuple[int, int, int, int]]) -> np.ndarray:
        """Write the first pass into the draft's plan: the target's step without its draft rows (their
        tokens are not known yet), after a row for each of `lag`. Returns the target's sampling rows
        the pass samples after the lag rows' own (which sample too: a step of decode rows that all
        sample replays a decode graph)."""
        ns, nd, nr, nt = tp.num_samples, tp.num_decode_rows, tp.num_rows, tp.num_tokens
        off = tp.sample_offsets[:ns]
        if not lag and not off.any():
            self._copy_plan(tp, dp)
            return self._ramp[:ns]
        e = len(lag)
        kept = np.flatnonzero(off == 0)
        keep = self._keep[:nd]
        keep[:] = True
        keep[tp.logits_indices[:ns][off > 0]] = False  # draft rows: decode rows of one token
        rows = np.flatnonzero(keep)
        nd2 = e + len(rows)
        delta = nd2 - nd
        nt2, nr2, ns2 = nt + delta, nr + delta, e + len(kept)
        old_t, old_r, old_s = dp.num_tokens, dp.num_rows, dp.num_samples
        for name in ("input_ids", "positions", "slot_mapping"):
            dst, src = getattr(dp, name), getattr(tp, name)
            dst[e:nd2] = src[rows]
            dst[nd2:nt2] = src[nd:nt]
            dst[nt2:old_t] = 0
        for name in ("seq_lens", "block_tables"):
            dst, src = getattr(dp, name), getattr(tp, name)
            dst[e:nd2] = src[rows]
            dst[nd2:nr2] = src[nd:nr]
            dst[nr2:old_r] = 0
        bs = self.target.block_size
        for i, (row, pos, tok, slot) in enumerate(lag):
            dp.sample_slots[i] = slot  # its request's: one request's rows still run its exact kernels
            dp.input_ids[i] = tok
            dp.positions[i] = pos
            dp.slot_mapping[i] = int(tp.block_tables[row, pos // bs]) * bs + pos % bs
            dp.seq_lens[i] = pos + 1
            dp.block_tables[i] = tp.block_tables[row]
        qsl = dp.query_start_loc
        qsl[: nd2 + 1] = self._ramp[: nd2 + 1]
        qsl[nd2 + 1: nr2 + 1] = tp.query_start_loc[nd + 1: nr + 1] + delta
        qsl[nr2 + 1: old_r + 1] = 0
        where = self._where[:nd]
        where[rows] = np.arange(e, nd2, dtype=np.int32)
        li = tp.logits_indices[kept]
        dp.logits_indices[:e] = self._ramp[:e]
        dp.logits_indices[e:ns2] = np.where(li < nd, where[np.minimum(li, nd - 1)], li + delta)
        dp.sample_slots[e:ns2] = tp.sample_slots[kept]
        dp.sample_req_ids[:e] = 0
        dp.sample_req_ids[e:ns2] = tp.sample_req_ids[kept]
        dp.sample_offsets[:ns2] = 0
        for name in ("logits_indices", "sample_slots", "sample_req_ids", "sample_offsets"):
            getattr(dp, name)[ns2:old_s] = 0
        dp.follow(nt2, nr2, nd2, ns2)
        return kept

    @staticmethod
    def _copy_plan(src: StepPlan, dst: StepPlan) -> None:
        """The target's plan into the draft's buffers, whole arrays (zero past the step's extent)."""
        for name in ("input_ids", "positions", "slot_mapping", "block_tables", "seq_lens", "query_start_loc",
                     "logits_indices", "sample_slots", "sample_req_ids", "sample_offsets"):
            np.copyto(getattr(dst, name), getattr(src, name))
        dst.follow(src.num_tokens, src.num_rows, src.num_decode_rows, src.num_samples)

    def _write_rows(self, src: StepPlan, dst: StepPlan, rows: np.ndarray, tokens: np.ndarray) -> None:
        """A decode-only step of one row per entry of `rows` (sampling rows of the target's decode rows,
        whose position, KV slot, block table and context length it keeps), fed `tokens`; what the
        previous draft step wrote past it zeroed."""
        m = len(rows)
        old_t, old_r, old_s = dst.num_tokens, dst.num_rows, dst.num_samples
        dst.input_ids[:m] = tokens
        at = src.logits_indices[rows]  # decode rows come first, one token each: token index == row index
        for name in _TOKEN_ARRAYS:
            getattr(dst, name)[:m] = getattr(src, name)[at]
        for name in _SAMPLE_ARRAYS:
            getattr(dst, name)[:m] = getattr(src, name)[rows]
        dst.query_start_loc[: m + 1] = self._ramp[: m + 1]
        dst.logits_indices[:m] = self._ramp[:m]
        dst.sample_offsets[:m] = 0
        for name in ("input_ids", "positions", "slot_mapping"):
            getattr(dst, name)[m:old_t] = 0
        for name in ("block_tables", "seq_lens"):
            getattr(dst, name)[m:old_r] = 0
        dst.query_start_loc[m + 1: old_r + 1] = 0
        for name in ("logits_indices", "sample_slots", "sample_req_ids"):
            getattr(dst, name)[m:old_s] = 0
        dst.follow(m, m, m, m)

    def stats(self) -> dict:
        return {"draft_steps": self.draft_steps, "drafted_rows": self.drafted_rows}


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
