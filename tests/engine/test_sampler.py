"""Sampler and SamplingParams: CPU, small vocabularies, fixed seeds."""

import math

import msgspec
import pytest
import torch

from rtp.engine.sampler import Sampler, SamplerOutput, SamplingBatch, step_seed
from rtp.sampling_params import SamplingParams

SP = SamplingParams


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA"))]


@pytest.fixture(params=DEVICES)
def device(request):
    return request.param


def sample(logits, params, outputs=None, prompts=None, sampler=None, device="cpu", **kw):
    """Sample on `device`; the output comes back on the CPU."""
    outputs = outputs if outputs is not None else [[] for _ in params]
    batch = SamplingBatch.build(params, outputs, prompts, device=device, **kw)
    out = (sampler or Sampler(seed=0))(logits.to(device), batch)
    top = None if out.top_logprobs is None else tuple(t.cpu() for t in out.top_logprobs)
    return SamplerOutput(out.token_ids.cpu(),
                         None if out.logprobs is None else out.logprobs.cpu(), top)


def draws(logits_row, p, num=4000, seed=0, device="cpu"):
    """num independent unseeded draws from one row's distribution, in one call."""
    out = sample(logits_row.expand(num, -1).contiguous(), [p] * num, sampler=Sampler(seed=seed),
                 device=device)
    return out.token_ids


def reference_penalties(logits, p, prompt, output):
    """The textbook loops: HF repetition penalty, then OpenAI frequency/presence."""
    x = logits.clone().tolist()
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return torch.tensor(x)


# --- greedy ---------------------------------------------------------------

def test_greedy_is_argmax(device):
    logits = torch.randn(7, 100, generator=torch.Generator().manual_seed(1))
    params = [SP(temperature=0.0)] * 4 + [SP(temperature=0.8, top_k=1)] * 3
    assert SamplingBatch.build(params, [[]] * 7).argmax_only
    out = sample(logits, params, device=device)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.token_ids.dtype == torch.int64 and out.logprobs is None
    tied = torch.zeros(3, 50)
    tied[:, [7, 20, 41]] = 1.0  # the first of equal maxima, as torch and vLLM pick it
    assert sample(tied, [SP(temperature=0.0)] * 3, device=device).token_ids.tolist() == [7, 7, 7]


def test_caller_logits_are_not_modified():
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(2))
    before = logits.clone()
    params = [SP(temperature=0.7, top_p=0.5, min_p=0.1, top_k=5, repetition_penalty=1.3,
                 logprobs=2, min_tokens=2)] * 3
    sample(logits, params, [[1, 2]] * 3, [[3]] * 3, eos_token_ids=[0])
    assert torch.equal(logits, before)


# --- temperature and truncation --------------------------------------------

def test_temperature_matches_softmax(device):
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0, -1.0, 0.3, 1.2])
    t, num = 0.7, 20000
    tokens = draws(logits, SP(temperature=t), num, device=device)
    counts = torch.bincount(tokens, minlength=8).double()
    expected = torch.softmax(logits.double() / t, -1) * num
    chi2 = ((counts - expected) ** 2 / expected).sum().item()
    assert chi2 < 40, chi2  # 7 degrees of freedom: p < 1e-5 beyond ~33


def test_high_temperature_flattens():
    logits = torch.tensor([3.0, 0.0, 0.0, 0.0])
    low = (draws(logits, SP(temperature=0.5)) == 0).float().mean()
    high = (draws(logits, SP(temperature=5.0)) == 0).float().mean()
    assert low > 0.95 and 0.3 < high < 0.6


LOGITS10 = torch.linspace(2.0, -2.0, 10)[torch.tensor([3, 0, 7, 1, 9, 4, 2, 8, 5, 6])]


def allowed_top_k(logits, k):
    return set(logits.topk(k).indices.tolist())


def allowed_top_p(logits, p):
    probs = torch.softmax(logits.double(), -1)
    order = probs.argsort(descending=True).tolist()
    kept, mass = [], 0.0
    for t in order:
        kept.append(t)
        mass += probs[t].item()
        if mass >= p:
            break
    return set(kept)


def allowed_min_p(logits, m):
    probs = torch.softmax(logits, -1)
    return set(torch.nonzero(probs >= m * probs.max()).flatten().tolist())


@pytest.mark.parametrize("p, allowed", [
    (SP(top_k=3), allowed_top_k(LOGITS10, 3)),
    (SP(top_k=-1), set(range(10))),
    (SP(top_k=50), set(range(10))),
    (SP(top_p=0.6), allowed_top_p(LOGITS10, 0.6)),
    (SP(min_p=0.2), allowed_min_p(LOGITS10, 0.2)),
    (SP(top_k=4, top_p=0.5), allowed_top_p(LOGITS10.masked_fill(
        ~torch.isin(torch.arange(10), torch.tensor(sorted(allowed_top_k(LOGITS10, 4)))),
        float("-inf")), 0.5)),
])
def test_filters_pick_exactly_the_allowed_tokens(p, allowed):
    assert 1 <= len(allowed)
    assert set(draws(LOGITS10, p).tolist()) == allowed


def test_filters_per_row_in_one_batch(device):
    """Different filters in one batch: each row keeps to its own set, unfiltered rows see all."""
    kinds = [(SP(), set(range(10))), (SP(top_k=2), allowed_top_k(LOGITS10, 2)),
             (SP(top_p=0.4), allowed_top_p(LOGITS10, 0.4)),
             (SP(min_p=0.3), allowed_min_p(LOGITS10, 0.3)), (SP(temperature=0.0), None)]
    reps = 2000
    params = [p for p, _ in kinds for _ in range(reps)]
    out = sample(LOGITS10.expand(len(params), -1).contiguous(), params, device=device).token_ids
    for j, (_, allowed) in enumerate(kinds):
        got = set(out[j * reps:(j + 1) * reps].tolist())
        assert got == (allowed or {LOGITS10.argmax().item()}), j


def test_top_k_only_and_top_p_paths_agree():
    """A top_k row gives the same token whether a top_p row shares its batch or not."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 300, generator=g)
    p = SP(top_k=20, seed=5)
    alone = sample(logits, [p]).token_ids
    mixed = sample(torch.cat([logits, logits]), [p, SP(top_p=0.3)]).token_ids
    assert alone.item() == mixed[0].item()


# --- penalties --------------------------------------------------------------

@pytest.mark.parametrize("kw", [
    dict(repetition_penalty=1.5),
    dict(repetition_penalty=0.7),
    dict(frequency_penalty=0.8),
    dict(presence_penalty=-1.2),
    dict(repetition_penalty=1.3, frequency_penalty=0.5, presence_penalty=0.9),
])
def test_penalties_match_reference(kw, device):
    g = torch.Generator().manual_seed(4)
    vocab, rows = 20, 5
    logits = torch.randn(rows, vocab, generator=g) * 3
    prompts = [torch.randint(0, vocab, (int(n),), generator=g).tolist() for n in (0, 3, 8, 1, 12)]
    outputs = [torch.randint(0, vocab, (int(n),), generator=g).tolist() for n in (6, 0, 9, 2, 4)]
    # logprobs=20 on a 20-token vocabulary returns the whole penalised distribution;
    # an unpenalised row in the middle must stay untouched
    params = [SP(temperature=0.0, logprobs=20, **kw)] * rows
    params[2] = SP(temperature=0.0, logprobs=20)
    out = sample(logits, params, outputs, prompts, device=device)
    for i in range(rows):
        ref = reference_penalties(logits[i], params[i], prompts[i], outputs[i])
        values, ids = out.top_logprobs
        got = torch.empty(vocab).scatter_(0, ids[i], values[i])
        torch.testing.assert_close(got, torch.log_softmax(ref, -1), atol=1e-5, rtol=1e-5)
        assert out.token_ids[i].item() == ref.argmax().item()


def test_penalties_accept_numpy_and_tensor_ids():
    import numpy as np
    logits = torch.randn(2, 30, generator=torch.Generator().manual_seed(5))
    p = SP(temperature=0.0, repetition_penalty=2.0, frequency_penalty=1.0, logprobs=0)
    a = sample(logits, [p, p], [[1, 1, 2], [4]], [[7], [8, 9]])
    b = sample(logits, [p, p], [np.array([1, 1, 2]), torch.tensor([4])],
               [np.array([7]), torch.tensor([8, 9])])
    assert torch.equal(a.token_ids, b.token_ids) and torch.equal(a.logprobs, b.logprobs)


def test_repetition_penalty_needs_prompts():
    with pytest.raises(ValueError, match="prompt_ids"):
        SamplingBatch.build([SP(repetition_penalty=1.2)], [[1]])


# --- seeds ------------------------------------------------------------------

def run_steps(logits_fn, params_rows, steps, sampler, device="cpu"):
    """Decode `steps` tokens for every row; row r at step s sees logits_fn(r, s)."""
    outs = [[] for _ in params_rows]
    for s in range(steps):
        logits = torch.stack([logits_fn(r, s) for r in range(len(params_rows))])
        toks = sample(logits, params_rows, outs, sampler=sampler, device=device).token_ids.tolist()
        for r, t in enumerate(toks):
            outs[r].append(t)
    return outs


def test_seed_reproducible_alone_and_batched(device):
    base = torch.randn(4, 64, generator=torch.Generator().manual_seed(6))
    seeded = SP(temperature=1.0, top_p=0.95, seed=1234)

    def alone_fn(r, s):
        return base[0] + 0.1 * s

    alone = run_steps(alone_fn, [seeded], 12, Sampler(seed=1), device)[0]

    def mixed_fn(r, s):  # the seeded row's logits are the same, the others differ
        return base[0] + 0.1 * s if r == 2 else base[r] * (s + 1)

    batch_params = [SP(temperature=0.9), SP(top_k=5), seeded, SP(temperature=0.0, seed=7)]
    batched = run_steps(mixed_fn, batch_params, 12, Sampler(seed=99), device)[2]
    assert alone == batched
    other_seed = SP(temperature=1.0, top_p=0.95, seed=1235)
    other = run_steps(alone_fn, [other_seed], 12, Sampler(seed=1), device)[0]
    assert other != alone


def test_seed_depends_on_step_not_on_history_in_process():
    """A resumed request (e.g. after preemption) continues with the same draws."""
    logits = torch.randn(1, 200, generator=torch.Generator().manual_seed(7))
    p = SP(seed=42)
    a = sample(logits, [p], [[5, 6, 7]], sampler=Sampler(seed=1)).token_ids
    b = sample(logits, [p], [[9, 9, 9]], sampler=Sampler(seed=2)).token_ids
    assert torch.equal(a, b)
    assert step_seed(42, 3) != step_seed(42, 4) != step_seed(43, 3)


def test_seed_override_per_row():
    logits = torch.zeros(2, 1000)
    p = SP(seed=10)
    out = sample(logits, [p, p], seeds=[10, 11]).token_ids
    again = sample(logits[:1], [p]).token_ids
    assert out[0] == again[0] and out[0] != out[1]


def test_seeded_draws_follow_the_distribution():
    """Noise from per-row generators still samples softmax(logits)."""
    logits = torch.tensor([0.0, 1.0, 2.0, 0.5])
    num = 4000
    params = [SP(seed=s) for s in range(num)]
    out = sample(logits.expand(num, -1).contiguous(), params).token_ids
    freq = torch.bincount(out, minlength=4).double() / num
    torch.testing.assert_close(freq, torch.softmax(logits.double(), -1), atol=0.03, rtol=0)


# --- logprobs ---------------------------------------------------------------

def test_logprobs_are_log_softmax_before_temperature(device):
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(4, 40, generator=g)
    params = [SP(temperature=0.0, logprobs=0), SP(temperature=0.5, logprobs=3),
              SP(temperature=1.5, top_k=4, logprobs=5), SP()]
    out = sample(logits, params, device=device)
    ref = torch.log_softmax(logits, -1)
    torch.testing.assert_close(out.logprobs, ref.gather(1, out.token_ids[:, None])[:, 0])
    values, ids = out.top_logprobs
    assert values.shape == ids.shape == (4, 5)
    ref_v, ref_i = ref.topk(5, -1)
    torch.testing.assert_close(values, ref_v)
    assert torch.equal(ids, ref_i)
    assert out.token_ids[0] == logits[0].argmax()


def test_logprobs_zero_gives_no_top():
    out = sample(torch.randn(2, 10), [SP(logprobs=0), SP(logprobs=0, temperature=0.0)])
    assert out.logprobs.shape == (2,) and out.top_logprobs is None


# --- min_tokens -------------------------------------------------------------

def test_min_tokens_masks_eos_and_stop_ids(device):
    logits = torch.zeros(4, 10)
    logits[:, 0] = 10.0  # eos
    logits[:, 3] = 9.0   # a stop token
    p = SP(temperature=0.0, min_tokens=3, stop_token_ids=[3])
    params = [p, p, SP(temperature=0.0), SP(temperature=0.0, min_tokens=3, ignore_eos=True)]
    out = sample(logits, params, [[1, 2], [1, 2, 4], [], []], eos_token_ids=[0], device=device)
    assert out.token_ids.tolist() == [1, 0, 0, 0]
    random = sample(logits[:1].expand(500, -1).contiguous(),
                    [SP(min_tokens=3, stop_token_ids=[3])] * 500, [[]] * 500,
                    eos_token_ids=[0], device=device).token_ids
    assert not torch.isin(random, torch.tensor([0, 3])).any()


# --- mixed batch, dtypes ----------------------------------------------------

def test_mixed_batch(device):
    g = torch.Generator().manual_seed(9)
    vocab = 20
    logits = torch.randn(6, vocab, generator=g) * 2
    prompts = [[1, 2, 3]] * 6
    outputs = [[4, 4, 5], [], [6], [7, 7], [8], [1]]
    params = [
        SP(temperature=0.0),
        SP(temperature=0.8, top_k=3, seed=3),
        SP(temperature=0.0, repetition_penalty=1.4, frequency_penalty=0.3, logprobs=20),
        SP(temperature=1.2, top_p=0.8, presence_penalty=0.5, logprobs=2),
        SP(temperature=0.7, min_p=0.2, min_tokens=4),
        SP(temperature=1.0),
    ]
    out = sample(logits, params, outputs, prompts, eos_token_ids=[0], device=device)
    assert out.token_ids.shape == (6,) and out.logprobs.shape == (6,)
    assert out.token_ids[0] == logits[0].argmax()
    ref2 = reference_penalties(logits[2], params[2], prompts[2], outputs[2])
    assert out.token_ids[2] == ref2.argmax()
    assert out.token_ids[1].item() in allowed_top_k(logits[1], 3)
    assert out.token_ids[4].item() != 0
    values, ids = out.top_logprobs
    torch.testing.assert_close(torch.empty(vocab).scatter_(0, ids[2], values[2]),
                               torch.log_softmax(ref2, -1), atol=1e-5, rtol=1e-5)
    # the same seeded row alone gives the same token
    alone = sample(logits[1:2], [params[1]], [outputs[1]], [prompts[1]], device=device)
    assert alone.token_ids[0] == out.token_ids[1]


def test_bf16_logits(device):
    logits = torch.randn(5, 64, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16)
    greedy = sample(logits, [SP(temperature=0.0)] * 5, device=device)
    assert torch.equal(greedy.token_ids, logits.float().argmax(-1))
    params = [SP(temperature=0.0, logprobs=2), SP(top_p=0.9), SP(top_k=3, seed=1),
              SP(repetition_penalty=1.2), SP(min_p=0.1)]
    out = sample(logits, params, [[1]] * 5, [[2]] * 5, device=device)
    assert out.logprobs.dtype == torch.float32 and out.token_ids.dtype == torch.int64
    assert out.token_ids[0] == logits[0].float().argmax()


def test_logits_shape_mismatch():
    with pytest.raises(ValueError):
        sample(torch.zeros(3, 5), [SP()] * 2)


# --- SamplingParams ---------------------------------------------------------

def test_params_defaults_and_normalisation():
    p = SP()
    assert (p.n, p.temperature, p.top_p, p.top_k) == (1, 1.0, 1.0, 0)
    assert (p.max_tokens, p.min_tokens, p.logprobs, p.seed) == (16, 0, None, None)
    assert p.stop == [] and p.stop_token_ids == [] and not p.greedy
    assert SP(stop="###").stop == ["###"]
    assert SP(stop=("a", "b")).stop == ["a", "b"]
    assert SP(temperature=0.0).greedy and SP(top_k=1).greedy
    assert SP(max_tokens=None, min_tokens=100).max_tokens is None
    d = msgspec.json.decode(b'{"temperature": 0, "stop": "x", "seed": 3}', type=SP)
    assert d.greedy and d.stop == ["x"] and d.seed == 3


@pytest.mark.parametrize("kw, field", [
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=math.nan), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.01), "top_p"),
    (dict(top_k=-2), "top_k"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.5), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(presence_penalty=-2.1), "presence_penalty"),
    (dict(frequency_penalty=-3.0), "frequency_penalty"),
    (dict(frequency_penalty=2.01), "frequency_penalty"),
    (dict(n=0), "n"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=20, max_tokens=10), "min_tokens"),
    (dict(logprobs=-1), "logprobs"),
    (dict(logprobs=21), "logprobs"),
    (dict(stop_token_ids=[3, -1]), "stop_token_ids"),
    (dict(stop=["ok", ""]), "stop"),
])
def test_params_validation(kw, field):
    with pytest.raises(ValueError, match=field):
        SP(**kw)
    with pytest.raises(msgspec.ValidationError, match=field):
        msgspec.convert(kw, SP)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_step_does_not_wait_for_the_device():
    """Building the batch and sampling never block the host on the GPU."""
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(8, 32000, generator=g).to("cuda", torch.bfloat16)
    params = [SP(temperature=0.0), SP(top_k=40, seed=1), SP(top_p=0.9, min_p=0.05),
              SP(repetition_penalty=1.2, frequency_penalty=0.3, logprobs=5),
              SP(temperature=0.0, logprobs=0, min_tokens=4), SP(), SP(top_k=5, top_p=0.8),
              SP(presence_penalty=1.0, seed=2)]
    outputs = [[1, 2, 3]] * 8
    sampler = Sampler(seed=0)
    sampler.generator(logits.device)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        batch = SamplingBatch.build(params, outputs, [[4, 5]] * 8, eos_token_ids=[2],
                                    device="cuda")
        out = sampler(logits, batch)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.token_ids.is_cuda and out.token_ids.shape == (8,)
