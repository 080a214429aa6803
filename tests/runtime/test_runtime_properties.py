"""Random interleavings of add / step / abort / evict against the runtime.

After every operation check_integrity() must hold (refcounts equal holders,
counters exact, eviction order safe); at the end every surviving request must
have generated exactly what the oracle generates — which fails if a prefix-cache
hit, a preemption or an eviction ever handed a request the wrong KV — and no
block may be left used.
"""

import numpy as np
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from runtime_sim import ToyRunner, make_scheduler, oracle, run_to_completion

VOCAB = 40
EOS = 0
PREFIXES = [list(range(1, 13)), list(range(1, 9)) + [30, 31, 32, 33], [17] * 10]


class RuntimeMachine(RuleBasedStateMachine):
    @initialize(
        cache=st.booleans(),
        policy=st.sampled_from(["fcfs", "lpm"]),
        num_blocks=st.integers(14, 40),
        block_size=st.sampled_from([1, 2, 4]),
        budget=st.sampled_from([4, 16, 64]),
        chunked=st.booleans(),
        lent=st.integers(0, 24),
    )
    def setup(self, cache, policy, num_blocks, block_size, budget, chunked, lent):
        if not cache:
            policy = "fcfs"
        if not chunked:
            budget = 64  # every prompt must fit one step's budget
        self.max_model_len = 48
        self.sched = make_scheduler(num_blocks=num_blocks * (4 // block_size), block_size=block_size,
                                    capacity=num_blocks * (4 // block_size) + lent, cache=cache, max_num_seqs=4, max_num_batched_tokens=budget,
                                    max_model_len=self.max_model_len, eos_token_ids=[EOS],
                                    policy=policy, chunked_prefill=chunked, vocab_size=VOCAB)
        self.runner = ToyRunner(self.sched, VOCAB)
        self.requests = {}  # id -> (prompt, max_tokens, ignore_eos, stop_ids)
        self.outputs = {}
        self.aborted = set()
        self.next_id = 0

    def _record(self, events):
        for rid, tok, _ in events:
            self.outputs.setdefault(rid, []).append(tok)

    @rule(prefix=st.integers(0, len(PREFIXES)), suffix=st.lists(st.integers(1, VOCAB - 1), max_size=14),
          max_tokens=st.integers(1, 14), ignore_eos=st.booleans(),
          stop=st.lists(st.integers(1, VOCAB - 1), max_size=2))
    def add(self, prefix, suffix, max_tokens, ignore_eos, stop):
        prompt = (PREFIXES[prefix] if prefix < len(PREFIXES) else []) + suffix
        if not prompt:
            prompt = [5]
        rid = self.next_id
        self.next_id += 1
        before = self.sched.stats()
        try:
            self.sched.add_request(rid, prompt, max_tokens=max_tokens, ignore_eos=ignore_eos,
                                   stop_token_ids=stop)
        except ValueError:
            assert self.sched.stats() == before  # refused and nothing changed
            return
        self.requests[rid] = (prompt, max_tokens, ignore_eos, stop)

    @rule()
    def step(self):
        self._record(self.runner.step())

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), in_flight=st.booleans())
    def abort(self, data, in_flight):
        rid = data.draw(st.sampled_from(sorted(self.requests)))
        if in_flight:
            self.sched.schedule()
            self.sched.abort(rid)
            self.sched.check_integrity()
            n = self.sched.update(self.runner.forward())
            s = self.sched
            self._record(zip(s.event_req_ids[:n].tolist(), s.event_tokens[:n].tolist(), s.event_finish[:n].tolist()))
            assert rid not in s.event_req_ids[:n].tolist()
        else:
            self.sched.abort(rid)
        assert not self.sched.has_request(rid)
        self.aborted.add(rid)

    @precondition(lambda self: self.sched.cache is not None)
    @rule(n=st.integers(1, 8))
    def evict(self, n):
        self.sched.cache.evict(n)

    @rule(data=st.data())
    def resize(self, data):
        """grow() or shrink() the pool between steps, never below the limit as built (what
        max_model_len was checked against); a refused shrink changes nothing."""
        alloc = self.sched.allocator
        target = data.draw(st.integers(alloc.base, alloc.capacity))
        if target >= alloc.num_blocks:
            alloc.grow(target)
            return
        busy = any(alloc.ref_count(b) for b in range(target, alloc.num_blocks))
        before = self.sched.stats()
        assert alloc.shrink(target) == (not busy)
        if busy:
            assert self.sched.stats() == before

    @invariant()
    def integrity(self):
        self.sched.check_integrity()

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        self._record_rest()
        for rid, (prompt, max_tokens, ignore_eos, stop) in self.requests.items():
            if rid in self.aborted:
                continue
            budget = min(max_tokens, max(self.max_model_len - len(prompt), 1))
            stops = set(stop) | (set() if ignore_eos else {EOS})
            want = oracle(prompt, budget, VOCAB, stops)
            assert self.outputs.get(rid) == want, f"request {rid}: {self.outputs.get(rid)} != {want}"
        alloc = self.sched.allocator
        assert alloc.num_used == 0, "blocks leaked"
        assert alloc.num_free == alloc.num_blocks - 1
        self.sched.check_integrity()

    def _record_rest(self):
        for rid, toks in run_to_completion(self.runner, check=False).items():
            self.outputs.setdefault(rid, []).extend(toks)


TestRuntime = RuntimeMachine.TestCase


def test_long_random_workload_with_shared_prefixes():
    """A bigger seeded run than hypothesis explores: many requests, heavy preemption."""
    rng = np.random.default_rng(3)
    s = make_scheduler(num_blocks=48, block_size=4, max_num_seqs=8, max_num_batched_tokens=24,
                       max_model_len=64, eos_token_ids=[EOS], vocab_size=VOCAB)
    r = ToyRunner(s, VOCAB)
    reqs, outs = {}, {}
    for rid in range(150):
        prompt = PREFIXES[rng.integers(len(PREFIXES))] + rng.integers(1, VOCAB, rng.integers(0, 20)).tolist()
        reqs[rid] = (prompt, int(rng.integers(1, 25)))
        s.add_request(rid, prompt, max_tokens=reqs[rid][1])
        for _ in range(int(rng.integers(0, 3))):
            for q, tok, _ in r.step():
                outs.setdefault(q, []).append(tok)
        s.check_integrity()
    for q, toks in run_to_completion(r).items():
        outs.setdefault(q, []).extend(toks)
    assert s.num_preemptions > 0 and s.cache.hit_tokens > 0
    for rid, (prompt, mt) in reqs.items():
        assert outs[rid] == oracle(prompt, min(mt, 64 - len(prompt)), VOCAB, {EOS})
    assert s.allocator.num_used == 0
