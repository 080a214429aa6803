"""Batched sampling on device: logits [N, V] -> one token per row.

One step, in order (the order of vLLM's v1 sampler):

    1. min_tokens   rows with fewer than min_tokens outputs: eos and stop ids -> -inf
    2. penalties    repetition (HF: over prompt + output), then frequency and
                    presence (OpenAI: over output only); counts by scatter_add
                    from padded [P, L] token tensors, no loop over tokens
    3. logprobs     log_softmax of the logits after 1 and 2, before temperature
                    and truncation: the model's own distribution as penalised,
                    so a greedy and a sampled row report comparable numbers
    4. greedy rows  argmax of the logits after 1 and 2
    5. random rows  / temperature, then min_p, then top_k and top_p (one sort),
                    then inverse-CDF sampling: one uniform u per row, the first
                    token whose running sum of p exceeds u * sum(p) (a cumsum and
                    a searchsorted, without torch.multinomial's host sync; the
                    exponential race argmax(p / q), q ~ Exp(1), spent 65 ms of a
                    CPU step on exponential_ over [64, 49152], this 4 ms)

Only the rows that need a stage pay for it: penalties, temperature and
truncation each run on the subset of rows that asked for them (an index
select, then an index copy back). When every row is greedy and none needs
penalties, min_tokens masking or logprobs, a step is one argmax.

Seeds: a row whose request has a seed draws its noise from its own generator,
seeded from (seed, tokens generated so far). Its noise therefore depends on
neither the batch around it nor on earlier steps having run in this process,
so the same request with the same seed yields the same tokens alone, batched,
after a preemption, or continued on a decode node after prefill elsewhere.
Other rows share the Sampler's generator.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from rtp.kernels import cpu_kernels
from rtp.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
_TOP_K_OFF = 1 << 62  # clamped to the vocabulary size at sampling time
# Parameters become float32 tensors here: a value float32 cannot hold is taken as its limit
# (a top_p of 1e-300 would round to 0 and cut every token; a temperature of 1e300 to inf,
# and -inf / inf is NaN), so every row samples a token in the vocabulary.
_F32 = torch.finfo(torch.float32)


def _f32(value: float) -> float:
    return min(max(value, _F32.tiny), _F32.max)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def step_seed(seed: int, step: int) -> int:
    """The generator seed of a seeded request's step-th token (0-based)."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ step)


def _padded(rows: Sequence[Sequence[int] | np.ndarray], device: torch.device
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of token ids -> ([R, L] int64 padded with 0, [R] int64 lengths) on device."""
    arrays = [np.asarray(r, dtype=np.int64).reshape(-1) for r in rows]
    lengths = np.fromiter((a.shape[0] for a in arrays), dtype=np.int64, count=len(arrays))
    out = np.zeros((len(arrays), max(1, int(lengths.max(initial=0)))), dtype=np.int64)
    for i, a in enumerate(arrays):
        out[i, :a.shape[0]] = a
    return (torch.from_numpy(out).to(device, non_blocking=True),
            torch.from_numpy(lengths).to(device, non_blocking=True))


def _counts(tokens: torch.Tensor, lengths: torch.Tensor, vocab: int) -> torch.Tensor:
    """[R, L] padded ids + [R] lengths -> [R, V] fp32 occurrence counts."""
    valid = torch.arange(tokens.shape[1], device=tokens.device) < lengths.unsqueeze(1)
    counts = torch.zeros(tokens.shape[0], vocab, dtype=torch.float32, device=tokens.device)
    return counts.scatter_add_(1, tokens, valid.to(torch.float32))


def _dev(values: Sequence, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    # built on the host, then copied without making the host wait for the device
    return torch.tensor(values, dtype=dtype).to(device, non_blocking=True)


def _argmax(x: torch.Tensor) -> torch.Tensor:
    """Index of each row's maximum (the first one on ties). Over a [64, 49152] fp32 batch on
    the CPU, NumPy's argmax took 0.64 ms, torch's max(dim) 1.1 ms (2.7 ms inside a decode
    step) and torch's argmax 2.6 ms, measured here; rtp's kernel runs the rows on every core."""
    if x.device.type == "cpu" and x.dtype == torch.float32:
        if cpu_kernels.argmax_supported(x):
            return cpu_kernels.argmax_rows(x.detach())
        return torch.from_numpy(x.detach().numpy().argmax(axis=-1))
    return x.max(dim=-1).indices


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """Each row's argmax, the first on ties: what a greedy row samples (and what a draft model
    drafts, rtp/engine/draft_model.py)."""
    return _argmax(logits)


def _rows(idx: np.ndarray, n: int, device: torch.device) -> torch.Tensor | None:
    """Row indices as a device tensor, or None when they are all n rows in order."""
    if len(idx) == n:
        return None
    return _tensor(idx.astype(np.int64), device)


def _tensor(values: np.ndarray, device: torch.device) -> torch.Tensor:
    # a copy of the gathered values (they are fresh arrays), sent without making the host wait
    return torch.from_numpy(values).to(device, non_blocking=True)


class SamplingBatch:
    """Everything one step's sampling needs, rows in the order of the logits.

    Built on the host once per step; every per-row value the device needs is
    a tensor, every decision that skips work is a Python bool or int, so the
    Sampler branches without reading anything back from the device.
    Row subsets (``*_rows``) are int64 index tensors, or None for "all rows".
    """

    def __init__(self, num_rows: int) -> None:
        self.num_rows = num_rows
        self.argmax_only = False
        # logit_bias: (row, token) pairs and the bias added to each
        self.bias_rows: torch.Tensor | None = None
        self.bias_cols: torch.Tensor | None = None
        self.bias_values: torch.Tensor | None = None
        # structured outputs: mask row i (int32 bit words) applies to logits row bitmask_rows[i]
        self.bitmask: torch.Tensor | None = None
        self.bitmask_rows: torch.Tensor | None = None
        # min_tokens: (row, token) pairs to mask
        self.mask_rows: torch.Tensor | None = None
        self.mask_cols: torch.Tensor | None = None
        # penalties, over pen_rows
        self.any_penalty = False
        self.pen_rows: torch.Tensor | None = None
        self.out_tokens: torch.Tensor | None = None
        self.out_lengths: torch.Tensor | None = None
        self.prompt_tokens: torch.Tensor | None = None  # None: no repetition penalty
        self.prompt_lengths: torch.Tensor | None = None
        self.repetition: torch.Tensor | None = None
        self.frequency: torch.Tensor | None = None
        self.presence: torch.Tensor | None = None
        # logprobs: K = max top logprobs requested; None = no row wants logprobs
        self.max_logprobs: int | None = None
        # greedy / random split
        self.any_greedy = False
        self.any_random = False
        self.random_rows: torch.Tensor | None = None
        self.temperature: torch.Tensor | None = None  # [M] over random rows
        self.min_p: torch.Tensor | None = None  # [M] or None when no row uses it
        # truncation, over trunc_rows (indices into the random rows)
        self.any_trunc = False
        self.trunc_rows: torch.Tensor | None = None
        self.top_k: torch.Tensor | None = None  # [T] int64, or None when no row uses it
        self.max_top_k = 0
        self.top_p: torch.Tensor | None = None  # [T] fp32 (inf = off), or None
        # seeded random rows: (index into the random rows, generator seed)
        self.seeded: list[tuple[int, int]] = []
        self.any_unseeded = False

    @classmethod
    def build(cls, params: Sequence[SamplingParams],
              output_ids: Sequence[Sequence[int] | np.ndarray],
              prompt_ids: Sequence[Sequence[int] | np.ndarray] | None = None, *,
              eos_token_ids: Sequence[int] = (),
              seeds: Sequence[int | None] | None = None,
              device: torch.device | str = "cpu") -> SamplingBatch:
        """One row per logits row, from the rows' settings and tokens as lists (tests, tools): the
        slots of a throwaway SlotSettings, gathered as the engine gathers its own.

        output_ids  tokens generated so far by each row's request (their count is
                    the step index of seeded rows and the min_tokens progress)
        prompt_ids  needed only by rows with a repetition penalty
        seeds       per-row override of params[i].seed (e.g. seed + i for the
                    i-th of n parallel samples); None entries mean unseeded
        """
        n = len(params)
        if len(output_ids) != n or (prompt_ids is not None and len(prompt_ids) != n):
            raise ValueError("params, output_ids and prompt_ids need one entry per row")
        settings = SlotSettings(max(n, 1))
        for i, p in enumerate(params):
            settings.set(i, p, p.seed if seeds is None else seeds[i])
        return cls.gather(settings, np.arange(n), _ListTokens(output_ids, prompt_ids),
                          eos_token_ids=eos_token_ids, device=device)

    @classmethod
    def gather(cls, settings: SlotSettings, slots: np.ndarray, tokens: TokenSource, *,
               eos_token_ids: Sequence[int] = (), device: torch.device | str = "cpu",
               masks=None, offsets: np.ndarray | None = None) -> SamplingBatch:
        """The batch of the rows sampling at `slots` (one per logits row): settings gathered by slot
        with numpy; tokens read (from `tokens`) only for rows whose settings need them; the token
        bitmask of the constrained rows filled by `masks` (a grammar's: rtp/engine/grammar/slots.py); offsets:
        each row's token's place past its request's generated tokens (Sampler.sample)."""
        n = len(slots)
        device = torch.device(device)
        b = cls(n)
        biased = np.flatnonzero(settings.biased[slots])
        if biased.size:
            rows, cols, values = [], [], []
            for i in biased.tolist():
                ids, bias = settings.bias[int(slots[i])]
                rows.append(np.full(ids.shape[0], i, dtype=np.int64))
                cols.append(ids)
                values.append(bias)
            b.bias_rows = _tensor(np.concatenate(rows), device)
            b.bias_cols = _tensor(np.concatenate(cols), device)
            b.bias_values = _tensor(np.concatenate(values), device)
        if masks is not None:
            constrained = masks.fill(slots)
            if constrained.size:
                b.bitmask = masks.bitmask[: constrained.size].to(device, non_blocking=True)
                b.bitmask_rows = _tensor(constrained.astype(np.int64), device)
        greedy = settings.greedy[slots]
        min_tokens = settings.min_tokens[slots]
        seeded = settings.seeded[slots] & ~greedy
        masking = np.flatnonzero(min_tokens > 0)
        out_len = None
        if masking.size or seeded.any():
            out_len = tokens.output_lengths(slots)
            if offsets is not None:
                out_len = out_len + offsets

        if masking.size:
            masking = masking[out_len[masking] < min_tokens[masking]]
        if masking.size:
            mask_rows: list[int] = []
            mask_cols: list[int] = []
            for i in masking.tolist():
                slot = int(slots[i])
                ids = list(settings.stop_ids(slot))
                if not settings.ignore_eos[slot]:
                    ids.extend(eos_token_ids)
                mask_rows.extend([i] * len(ids))
                mask_cols.extend(ids)
            b.mask_rows = _dev(mask_rows, torch.int64, device)
            b.mask_cols = _dev(mask_cols, torch.int64, device)

        pen = np.flatnonzero(settings.penalized[slots])
        if pen.size:
            b.any_penalty = True
            b.pen_rows = _rows(pen, n, device)
            pen_slots = slots[pen]
            rows = [tokens.slot_tokens(int(slot)) for slot in pen_slots]
            b.out_tokens, b.out_lengths = _padded([out for _, out in rows], device)
            rep = settings.repetition[pen_slots]
            if (rep != 1.0).any():
                if any(prompt is None for prompt, _ in rows):
                    raise ValueError("repetition_penalty needs prompt_ids")
                # rows without a repetition penalty send an empty prompt
                b.prompt_tokens, b.prompt_lengths = _padded(
                    [prompt if r != 1.0 else () for (prompt, _), r in zip(rows, rep)], device)
                b.repetition = _tensor(rep, device)
            freq, pres = settings.frequency[pen_slots], settings.presence[pen_slots]
            if freq.any():
                b.frequency = _tensor(freq, device)
            if pres.any():
                b.presence = _tensor(pres, device)

        want = settings.logprobs[slots]
        b.max_logprobs = int(want.max()) if want.size and want.max() >= 0 else None

        rand = np.flatnonzero(~greedy)
        b.any_random = bool(rand.size)
        b.any_greedy = rand.size < n
        b.argmax_only = (not b.any_random and not b.any_penalty and b.mask_rows is None
                         and b.max_logprobs is None and b.bias_rows is None and b.bitmask is None)
        if not rand.size:
            return b
        b.random_rows = _rows(rand, n, device)
        rand_slots = slots[rand]
        b.temperature = _tensor(settings.temperature[rand_slots], device)
        min_p = settings.min_p[rand_slots]
        if min_p.any():
            b.min_p = _tensor(min_p, device)
        top_k, top_p = settings.top_k[rand_slots], settings.top_p[rand_slots]
        trunc = np.flatnonzero((top_k > 0) | (top_p < 1.0))
        if trunc.size:
            b.any_trunc = True
            b.trunc_rows = _rows(trunc, rand.size, device)
            k = top_k[trunc]
            if (k > 0).any():
                b.top_k = _tensor(np.where(k > 0, k, _TOP_K_OFF), device)
                b.max_top_k = int(k.max())
            tp = top_p[trunc]
            if (tp < 1.0).any():
                # off rows get inf: a cumulative sum that rounds past 1.0 must not cut them
                b.top_p = _tensor(np.where(tp < 1.0, tp, np.float32(np.inf)), device)
        rand_seeded = np.flatnonzero(seeded[rand])
        b.any_unseeded = rand_seeded.size < rand.size
        for j in rand_seeded.tolist():
            i = int(rand[j])
            b.seeded.append((j, step_seed(int(settings.seed[slots[i]]), int(out_len[i]))))
        return b


class TokenSource(Protocol):
    """Where a batch reads the tokens its settings need (penalties, min_tokens, seeds)."""

    def output_lengths(self, slots: np.ndarray) -> np.ndarray:
        """Tokens generated so far by the request at each slot."""

    def slot_tokens(self, slot: int) -> tuple[np.ndarray, np.ndarray]:
        """(prompt ids, generated ids) of the request at a slot."""


class _ListTokens:
    """A TokenSource over lists, slot i being row i (SamplingBatch.build)."""

    def __init__(self, outputs, prompts):
        self.outputs, self.prompts = outputs, prompts

    def output_lengths(self, slots: np.ndarray) -> np.ndarray:
        return np.array([len(self.outputs[s]) for s in slots.tolist()], dtype=np.int64)

    def slot_tokens(self, slot: int) -> tuple[np.ndarray | None, np.ndarray]:
        return (None if self.prompts is None else np.asarray(self.prompts[slot]), np.asarray(self.outputs[slot]))


class SlotSettings:
    """Every live request's sampling settings, by runtime slot (a request keeps its slot of the
    Scheduler from admission to its end): written once when it is admitted (`set`), gathered
    for each step by the plan's sample slots, with numpy -- nothing per row is rebuilt from
    SamplingParams or Python lists per step. Floats are stored as float32 sees them: a value
    float32 cannot hold is taken as its limit (_f32). With a `runtime` (the engine's Scheduler), the
    stop settings -- min_tokens, ignore_eos, stop ids -- are read from it, where they live once;
    alone (tests, tools) they are kept here."""

    def __init__(self, num_slots: int, runtime=None):
        n = num_slots
        self.greedy = np.ones(n, dtype=bool)
        self.temperature = np.ones(n, dtype=np.float32)
        self.top_p = np.ones(n, dtype=np.float32)          # 1: off
        self.top_k = np.zeros(n, dtype=np.int64)           # 0: off
        self.min_p = np.zeros(n, dtype=np.float32)
        self.penalized = np.zeros(n, dtype=bool)
        self.repetition = np.ones(n, dtype=np.float32)
        self.frequency = np.zeros(n, dtype=np.float32)
        self.presence = np.zeros(n, dtype=np.float32)
        self.seeded = np.zeros(n, dtype=bool)
        self.seed = np.zeros(n, dtype=np.uint64)
        self.runtime = runtime
        if runtime is not None:
            self.min_tokens, self.ignore_eos = runtime.stop_settings()
        else:
            self.min_tokens = np.zeros(n, dtype=np.int32)
            self.ignore_eos = np.zeros(n, dtype=np.uint8)
            self._stop_ids: list[tuple[int, ...]] = [()] * n
        self.logprobs = np.full(n, -1, dtype=np.int64)    # -1: none
        self.biased = np.zeros(n, dtype=bool)
        self.bias: list[tuple[np.ndarray, np.ndarray] | None] = [None] * n  # (token ids, biases)

    def stop_ids(self, slot: int) -> tuple[int, ...]:
        """The stop token ids of the request at `slot` (read only for rows still under min_tokens)."""
        return self.runtime.stop_ids(slot) if self.runtime is not None else self._stop_ids[slot]

    def set(self, slot: int, p: SamplingParams, seed: int | None) -> None:
        """The settings of the request admitted at `slot`; `seed`: its own (p.seed + its choice index)."""
        self.greedy[slot] = p.greedy
        self.temperature[slot] = _f32(p.temperature)
        self.top_p[slot] = _f32(p.top_p) if p.top_p < 1.0 else 1.0
        self.top_k[slot] = min(p.top_k, _TOP_K_OFF) if p.top_k > 0 else 0
        self.min_p[slot] = p.min_p
        self.penalized[slot] = p.has_penalties
        self.repetition[slot] = _f32(p.repetition_penalty)
        self.frequency[slot] = p.frequency_penalty
        self.presence[slot] = p.presence_penalty
        self.seeded[slot] = seed is not None
        self.seed[slot] = 0 if seed is None else seed & _MASK64
        if self.runtime is None:
            self.min_tokens[slot] = p.min_tokens
            self.ignore_eos[slot] = p.ignore_eos
            self._stop_ids[slot] = tuple(p.stop_token_ids)
        self.logprobs[slot] = -1 if p.logprobs is None else p.logprobs
        self.biased[slot] = bool(p.logit_bias)
        # (the runtime, when there is one, took min_tokens, ignore_eos and the stop ids at admission)
        self.bias[slot] = None if not p.logit_bias else (
            np.fromiter(p.logit_bias.keys(), dtype=np.int64, count=len(p.logit_bias)),
            np.fromiter(p.logit_bias.values(), dtype=np.float32, count=len(p.logit_bias)))


@dataclass(slots=True)
class SamplerOutput:
    """Device tensors; the caller copies them to the host once per step.

    token_ids     [N] int64
    logprobs      [N] fp32 logprob of each sampled token, or None when no row
                  asked for logprobs (then rows that did not ask get one too)
    top_logprobs  ([N, K] fp32 values, [N, K] int64 ids), descending, K = the
                  largest ``logprobs`` in the batch; a row that asked for k < K
                  keeps the first k columns. None when K is 0 or no row asked.
    """

    token_ids: torch.Tensor
    logprobs: torch.Tensor | None = None
    top_logprobs: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass(slots=True)
class Sampled:
    """A step's sampling on the host: the tokens, the sampler's own output (logprobs), the failed rows."""

    token_ids: np.ndarray              # [N] int64, 0 at failed rows
    output: SamplerOutput | None       # None when every row failed
    failed: dict[int, Exception]       # row -> why its request failed


class Sampler:
    """Turns a step's logits into tokens; holds the generator unseeded rows share."""

    def __init__(self, seed: int | None = None) -> None:
        self.seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    def generator(self, device: torch.device) -> torch.Generator:
        g = self._generators.get(device)
        if g is None:
            g = torch.Generator(device=device)
            if self.seed is None:
                g.seed()
            else:
                g.manual_seed(self.seed)
            self._generators[device] = g
        return g

    def sample(self, logits: torch.Tensor, settings: SlotSettings, slots: np.ndarray, tokens: TokenSource, *,
               eos_token_ids: Sequence[int], vocab_size: int, masks=None,
               offsets: np.ndarray | None = None) -> Sampled:
        """A step's sampling, rows faulting alone: one token per logits row (the request at
        slots[k]), on the host, and the rows whose request faulted with why (a placeholder
        token 0 stands in for theirs). When sampling the batch raises, each row is sampled
        alone to find the requests that caused it; the others are then sampled together, as
        they would have been. A token outside the vocabulary is its row's fault too. offsets: each
        row's token's place past its request's last (speculative decoding: the k-th drafted token's
        row samples the request's (generated + k)-th token, seeds and min_tokens counting so)."""
        n = len(slots)
        if not n:
            return Sampled(np.zeros(0, dtype=np.int64), None, {})
        device = logits.device

        def run(rows: np.ndarray) -> SamplerOutput:
            batch = SamplingBatch.gather(settings, slots[rows], tokens, eos_token_ids=eos_token_ids, device=device,
                                         masks=masks, offsets=None if offsets is None else offsets[rows])
            return self(logits if len(rows) == n else logits[torch.from_numpy(rows).to(device)], batch)

        failed: dict[int, Exception] = {}
        try:
            out = run(np.arange(n))
        except Exception as batch_error:
            for k in range(n):
                try:
                    run(np.array([k]))
                except Exception as e:
                    failed[k] = e
            if not failed:  # only together: every row is a suspect
                failed = dict.fromkeys(range(n), batch_error)
            out = self._sample_rest(run, n, failed)
        ids = np.zeros(n, dtype=np.int64) if out is None else out.token_ids.cpu().numpy()
        for k in np.flatnonzero((ids < 0) | (ids >= vocab_size)).tolist():
            if k not in failed:  # NaN logits, or a sampler bug under this request's settings
                failed[k] = RuntimeError(f"sampling produced token id {int(ids[k])}, outside the "
                                         f"vocabulary of {vocab_size}")
        if failed:
            ids = ids.copy()
            ids[list(failed)] = 0
        return Sampled(ids, out, failed)

    @staticmethod
    def _sample_rest(run, n: int, failed: dict[int, Exception]) -> SamplerOutput | None:
        """The rows not in `failed`, sampled together and scattered back to full-batch rows."""
        good = np.array([k for k in range(n) if k not in failed], dtype=np.int64)
        if not good.size:
            return None
        try:
            out = run(good)
        except Exception as e:
            failed.update(dict.fromkeys(good.tolist(), e))
            return None
        index = torch.from_numpy(good).to(out.token_ids.device)

        def spread(t: torch.Tensor) -> torch.Tensor:
            return t.new_zeros((n, *t.shape[1:])).index_copy_(0, index, t)

        top = None if out.top_logprobs is None else (spread(out.top_logprobs[0]), spread(out.top_logprobs[1]))
        return SamplerOutput(spread(out.token_ids), None if out.logprobs is None else spread(out.logprobs), top)

    def __call__(self, logits: torch.Tensor, batch: SamplingBatch) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != batch.num_rows:
            raise ValueError(f"logits {tuple(logits.shape)} do not match a batch of "
                             f"{batch.num_rows} rows")
        if batch.argmax_only:
            return SamplerOutput(_argmax(logits))

        # One fp32 copy; everything below may work on it in place.
        x = logits.to(torch.float32, copy=True)
        if batch.bias_rows is not None:
            x.index_put_((batch.bias_rows, batch.bias_cols), batch.bias_values, accumulate=True)
        if batch.bitmask is not None:  # after the biases: a token the grammar forbids stays forbidden
            cpu_kernels.apply_token_bitmask(x, batch.bitmask, batch.bitmask_rows)
        if batch.mask_rows is not None:
            # the value made on the device: a Python scalar would be a blocking host-to-device copy
            x.index_put_((batch.mask_rows, batch.mask_cols), x.new_full((), float("-inf")))
        if batch.any_penalty:
            _apply_penalties(x, batch)

        logprobs = x.log_softmax(dim=-1) if batch.max_logprobs is not None else None
        tokens = _argmax(x) if batch.any_greedy else None
        if batch.any_random:
            # x is no longer needed unsubset once greedy tokens and logprobs are taken
            xr = x if batch.random_rows is None else x.index_select(0, batch.random_rows)
            sampled = self._sample(xr, batch)
            if tokens is None:
                tokens = sampled
            else:
                tokens.index_copy_(0, batch.random_rows, sampled)

        if logprobs is None:
            return SamplerOutput(tokens)
        chosen = logprobs.gather(1, tokens.unsqueeze(1)).squeeze(1)
        top = None
        if batch.max_logprobs > 0:
            values, ids = logprobs.topk(min(batch.max_logprobs, x.shape[1]), dim=-1)
            top = (values, ids)
        return SamplerOutput(tokens, chosen, top)

    def _sample(self, x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
        """Random rows only: temperature, min_p, top_k/top_p, inverse-CDF draw."""
        x.div_(batch.temperature.unsqueeze(1))
        if batch.any_penalty:  # a penalised logit near float32's limit over a small temperature
            x.clamp_(max=_F32.max)
        if batch.min_p is not None:
            probs = x.softmax(dim=-1)
            floor = probs.amax(dim=-1, keepdim=True) * batch.min_p.unsqueeze(1)
            x.masked_fill_(probs < floor, float("-inf"))
        if batch.any_trunc:
            if batch.trunc_rows is None:
                _apply_top_k_top_p(x, batch)
            else:
                xt = x.index_select(0, batch.trunc_rows)
                x.index_copy_(0, batch.trunc_rows, _apply_top_k_top_p(xt, batch))
        cdf = x.softmax(dim=-1).cumsum_(dim=-1)
        u = torch.empty(cdf.shape[0], 1, device=cdf.device)
        if batch.any_unseeded:
            u.uniform_(generator=self.generator(u.device))
        for row, seed in batch.seeded:
            g = torch.Generator(device=u.device)
            g.manual_seed(seed)
            u[row].uniform_(generator=g)
        total = cdf[:, -1:].contiguous()
        # masked tokens add nothing to the sum, so they are never the first to pass u * total
        tokens = torch.searchsorted(cdf, u * total, right=True)
        # u * total can round up to total itself: then the last token that adds to the sum
        return torch.minimum(tokens, torch.searchsorted(cdf, total)).squeeze(1)


def _apply_penalties(x: torch.Tensor, batch: SamplingBatch) -> None:
    rows = batch.pen_rows
    xp = x if rows is None else x.index_select(0, rows)
    vocab = x.shape[1]
    counts = _counts(batch.out_tokens, batch.out_lengths, vocab)
    if batch.repetition is not None:
        seen = counts > 0
        seen |= _counts(batch.prompt_tokens, batch.prompt_lengths, vocab) > 0
        r = batch.repetition.unsqueeze(1)
        xp = torch.where(seen, torch.where(xp > 0, xp / r, xp * r), xp)
    if batch.frequency is not None:
        xp -= batch.frequency.unsqueeze(1) * counts
    if batch.presence is not None:
        xp -= batch.presence.unsqueeze(1) * (counts > 0).to(torch.float32)
    # a penalty near float32's limits can push a logit to +inf, and softmax over +inf is NaN;
    # -inf (a masked token) stays
    xp.clamp_(max=_F32.max)
    if rows is None:
        if xp is not x:
            x.copy_(xp)
    else:
        x.index_copy_(0, rows, xp)


def _apply_top_k_top_p(x: torch.Tensor, batch: SamplingBatch) -> torch.Tensor:
    """Mask x [T, V] in place to each row's top_k, then to its top_p nucleus.

    top_k keeps every token tied with the k-th largest (a threshold, not a
    position), so a row's result does not depend on which path ran it.
    """
    vocab = x.shape[1]
    k = None if batch.top_k is None else batch.top_k.clamp(max=vocab)
    if batch.top_p is None:
        # top_k only: a partial top-k of width max k is cheaper than a full sort
        top = x.topk(min(batch.max_top_k, vocab), dim=-1).values
        x.masked_fill_(x < top.gather(1, k.unsqueeze(1) - 1), float("-inf"))
        return x
    sorted_x, order = x.sort(dim=-1, descending=True)
    if k is not None:
        sorted_x.masked_fill_(sorted_x < sorted_x.gather(1, k.unsqueeze(1) - 1), float("-inf"))
    probs = sorted_x.softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1).sub_(probs)
    # keep the smallest prefix whose mass reaches top_p; the first token always
    # stays (its mass_before is 0 < top_p)
    sorted_x.masked_fill_(mass_before >= batch.top_p.unsqueeze(1), float("-inf"))
    return x.scatter_(1, order, sorted_x)
