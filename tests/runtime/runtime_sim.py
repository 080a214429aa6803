"""A stand-in for the model runner, for exercising rtp.runtime without torch.

It does what the real runner does with a step plan — writes each new token's KV
into the slot the plan names, then reads every row's whole context back through
its block table — except that the "KV" is the token id and its position, and
the "logits" are a hash of the context it read. So a request's output is right
only if every block the scheduler and the prefix cache handed it held exactly
that request's tokens at the right positions; `oracle()` computes the right
output independently of the runtime.
"""

from __future__ import annotations

import numpy as np

from rtp.runtime import BlockAllocator, RadixCache, Scheduler, StepPlan

_WEIGHTS = np.random.default_rng(1234).integers(1, 1 << 20, size=1 << 16, dtype=np.int64)


def next_token(context: np.ndarray, vocab: int) -> int:
    """The toy model: a fixed function of the whole context."""
    n = len(context)
    return int(((context.astype(np.int64) + 1) * _WEIGHTS[:n]).sum() % 1_000_003 % vocab)


def repeating_token(context: np.ndarray, vocab: int, period: int = 7) -> int:
    """A toy model that mostly repeats its text with a period, so that n-gram drafts are often
    right, and breaks the pattern where a hash of the context says so, so that some are not."""
    n = len(context)
    if n >= period and next_token(context, 5) != 0:
        return int(context[n - period])
    return next_token(context, vocab)


def oracle(prompt, num_new: int, vocab: int, stop_ids=(), model=next_token) -> list[int]:
    """What a correct engine generates for prompt (greedy, stopping at stop_ids)."""
    seq = list(prompt)
    out = []
    for _ in range(num_new):
        tok = model(np.asarray(seq), vocab)
        out.append(tok)
        seq.append(tok)
        if tok in stop_ids:
            break
    return out


class ToyRunner:
    def __init__(self, sched: Scheduler, vocab: int, model=next_token):
        self.sched = sched
        self.vocab = vocab
        self.model = model
        nslots = sched.allocator.capacity * sched.block_size  # like the real KV cache: room for every grow()
        self.kv_token = np.full(nslots, -1, dtype=np.int64)
        self.kv_pos = np.full(nslots, -1, dtype=np.int64)

    def forward(self) -> np.ndarray:
        """Write the step's KV, read each row's context, return one token per sampling row."""
        plan = self.sched.plan
        bs = self.sched.block_size
        nt, nr, ns = plan.num_tokens, plan.num_rows, plan.num_samples
        # padding past the step's extent must be zero (captured graphs read it)
        assert not plan.input_ids[nt:].any() and not plan.slot_mapping[nt:].any()
        assert not plan.block_tables[nr:].any() and not plan.seq_lens[nr:].any()
        assert not plan.logits_indices[ns:].any()
        slots = plan.slot_mapping[:nt]
        assert (slots >= bs).all(), "a real token was written into the null block"
        assert len(np.unique(slots)) == nt, "two tokens written to one KV slot"
        self.kv_token[slots] = plan.input_ids[:nt]
        self.kv_pos[slots] = plan.positions[:nt]
        qsl = plan.query_start_loc
        assert qsl[0] == 0 and (np.diff(qsl[: nr + 1]) >= 1).all() and qsl[nr] == nt
        assert (np.diff(qsl[: plan.num_decode_rows + 1]) == 1).all()
        out = np.zeros(ns, dtype=np.int64)
        for k in range(ns):
            t = plan.logits_indices[k]
            row = int(np.searchsorted(qsl[: nr + 1], t, side="right") - 1)
            assert qsl[row + 1] - 1 == t, "a row samples from a token other than its last"
            length = plan.seq_lens[row]
            pos = np.arange(length)
            blocks = plan.block_tables[row, pos // bs]
            assert (blocks > 0).all(), "block table row shorter than its sequence"
            read = blocks.astype(np.int64) * bs + pos % bs
            assert (self.kv_pos[read] == pos).all(), "KV read at the wrong positions"
            out[k] = self.model(self.kv_token[read], self.vocab)
        return out

    def step(self) -> list[tuple[int, int, int]]:
        """One engine step; returns (req_id, token, finish_reason) events."""
        self.sched.schedule()
        n = self.sched.update(self.forward())
        s = self.sched
        return list(zip(s.event_req_ids[:n].tolist(), s.event_tokens[:n].tolist(), s.event_finish[:n].tolist()))


def make_scheduler(num_blocks=64, block_size=4, *, cache=True, max_num_seqs=8,
                   max_num_batched_tokens=32, max_model_len=64, capacity=0, **kwargs) -> Scheduler:
    alloc = BlockAllocator(num_blocks, block_size, capacity)
    radix = RadixCache(alloc) if cache else None
    width = -(-max_model_len // block_size)
    plan = StepPlan(max_num_batched_tokens, max_num_seqs, width)
    return Scheduler(alloc, plan, cache=radix, max_num_seqs=max_num_seqs,
                     max_num_batched_tokens=max_num_batched_tokens, max_model_len=max_model_len,
                     **kwargs)


def run_to_completion(runner: ToyRunner, max_steps=10_000, check=True) -> dict[int, list[int]]:
    """Step until nothing is left; returns every request's generated tokens."""
    outputs: dict[int, list[int]] = {}
    for _ in range(max_steps):
        if not runner.sched.has_unfinished:
            return outputs
        for rid, tok, _ in runner.step():
            outputs.setdefault(rid, []).append(tok)
        if check:
            runner.sched.check_integrity()
    raise AssertionError("requests did not finish")
