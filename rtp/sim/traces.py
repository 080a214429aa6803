"""Synthetic request traces with the shapes production traffic has.

- `conversational`: chat with heavy shared system prompts -- a thousand tenants'
  system prompts of 1-4k tokens, popularity Zipf-distributed, and multi-turn
  conversations whose every turn re-sends the whole history (so turns share
  their conversation's prefix too).
- `code`: long-context code generation -- prompts of 4-16k tokens (repository
  context), a minority sharing a repository prefix, longer outputs.
- `bursty`: the conversational mix arriving in bursts (on/off modulated
  Poisson: bursts at 4x the mean rate a fifth of the time).

A trace stores how to build each prompt, not its tokens (100,000 prompts of
a few thousand tokens would be gigabytes): `Trace.tokens(i)` materialises one
prompt when the simulator routes it, deterministically from its seeds.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

KINDS = ("conversational", "code", "bursty")


@dataclass
class Trace:
    name: str
    arrival: np.ndarray        # [N] float64 seconds, sorted
    prefix_id: np.ndarray      # [N] int32: shared prefix (system prompt / repository), -1 for none
    stream_id: np.ndarray      # [N] int64: the conversation / file whose tokens follow the prefix
    stream_len: np.ndarray     # [N] int32: tokens taken from the stream
    output_len: np.ndarray     # [N] int32
    prefixes: list[np.ndarray]
    vocab: int = 32000

    def __len__(self) -> int:
        return len(self.arrival)

    def tokens(self, i: int) -> np.ndarray:
        p = int(self.prefix_id[i])
        body = np.random.default_rng(int(self.stream_id[i])).integers(
            0, self.vocab, size=int(self.stream_len[i]), dtype=np.int32)
        return np.concatenate([self.prefixes[p], body]) if p >= 0 else body


def _zipf(rng, n_items: int, size: int, s: float = 1.1) -> np.ndarray:
    w = 1.0 / np.arange(1, n_items + 1) ** s
    return rng.choice(n_items, size=size, p=w / w.sum())


def _poisson_arrivals(rng, n: int, rate: float) -> np.ndarray:
    return np.cumsum(rng.exponential(1.0 / rate, size=n))


def _bursty_arrivals(rng, n: int, rate: float, burst_factor: float = 4.0, burst_share: float = 0.2,
                     period_s: float = 10.0) -> np.ndarray:
    """On/off modulated Poisson with mean `rate`: bursts at burst_factor x the quiet rate."""
    quiet = rate / (burst_share * burst_factor + (1 - burst_share))
    out, t = np.empty(n), 0.0
    for i in range(n):
        phase = (t % period_s) / period_s
        r = quiet * (burst_factor if phase < burst_share else 1.0)
        t += rng.exponential(1.0 / r)
        out[i] = t
    return out


def conversational(n: int, rate: float, seed: int = 0, *, bursty: bool = False, vocab: int = 32000,
                   think_s: float = 30.0, n_system: int = 1000) -> Trace:
    """Requests arrive as a (bursty) Poisson process at `rate`; each is the next turn of one
    of the conversations in progress (about rate * think_s of them, so a conversation's
    turns are think_s apart on average). System prompts are many tenants' (n_system of
    1-4k tokens, Zipf popularity: the head is everywhere, the tail fits no single
    worker's cache). A conversation has 1-6 turns; each turn's prompt is its system
    prompt plus the whole history, its user message 20-300 tokens, its answer about 250
    tokens (lognormal)."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, vocab, size=int(rng.integers(1000, 4000)), dtype=np.int32)
                for _ in range(n_system)]
    arrival = (_bursty_arrivals if bursty else _poisson_arrivals)(rng, n, rate)
    active = max(1, min(n, int(rate * think_s)))
    popular = _zipf(rng, n_system, n + active, s=1.0)
    pick = rng.integers(0, active, size=n)
    # each live conversation: [id, system prompt, history tokens, turns left]
    convs = [[c, popular[c], 0, int(rng.integers(1, 7))] for c in range(active)]
    next_id = active
    prefix_id = np.empty(n, np.int32)
    stream_id = np.empty(n, np.int64)
    stream_len = np.empty(n, np.int32)
    output_len = np.clip(rng.lognormal(np.log(250), 0.6, size=n), 16, 1024).astype(np.int32)
    user = rng.integers(20, 300, size=n)
    for i in range(n):
        c = convs[pick[i]]
        c[2] += int(user[i])
        prefix_id[i], stream_id[i], stream_len[i] = c[1], 1_000_003 * c[0] + seed, c[2]
        c[2] += int(output_len[i])      # the answer joins the next turn's prompt
        c[3] -= 1
        if c[3] == 0:                   # over: a new conversation takes its place
            convs[pick[i]] = [next_id, popular[next_id % len(popular)], 0, int(rng.integers(1, 7))]
            next_id += 1
    return Trace("bursty" if bursty else "conversational", arrival, prefix_id, stream_id, stream_len,
                 output_len, prefixes, vocab)


def code(n: int, rate: float, seed: int = 0, *, vocab: int = 32000) -> Trace:
    rng = np.random.default_rng(seed + 1)
    n_repos = 64
    prefixes = [rng.integers(0, vocab, size=int(rng.integers(2000, 6000)), dtype=np.int32)
                for _ in range(n_repos)]
    shared = rng.random(n) < 0.3
    pid = np.where(shared, _zipf(rng, n_repos, n, s=0.8), -1).astype(np.int32)
    total = rng.integers(4000, 16000, size=n)
    plen = np.array([len(p) for p in prefixes])
    slen = np.maximum(64, total - np.where(pid >= 0, plen[pid], 0)).astype(np.int32)
    out = np.clip(rng.lognormal(np.log(400), 0.5, size=n), 32, 2048).astype(np.int32)
    sid = rng.integers(1, 2**62, size=n)
    return Trace("code", _poisson_arrivals(rng, n, rate), pid, sid, slen, out, prefixes, vocab)


def make(kind: str, n: int, rate: float, seed: int = 0) -> Trace:
    if kind == "conversational":
        return conversational(n, rate, seed)
    if kind == "bursty":
        return conversational(n, rate, seed, bursty=True)
    if kind == "code":
        return code(n, rate, seed)
    raise ValueError(f"unknown trace kind {kind!r}; choose one of {', '.join(KINDS)}")
