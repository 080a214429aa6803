"""The engine end to end on the real default model (SmolLM2-135M-Instruct, Q4_1 GGUF).

transformers loads the same GGUF (dequantized to fp32) and is the reference: rtp's
greedy continuations must equal its own, token for token.
"""

from __future__ import annotations

import pytest
import torch

from rtp import LLM, SamplingParams
from rtp.kernels import cpu_kernels

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Name three primary colors.",
    "What is 12 times 7?",
    "Translate 'good morning' into Spanish.",
    "Give me one tip for learning to code.",
    "Who wrote Romeo and Juliet?",
    "Describe a cat in one sentence.",
]
NEW = 24


@pytest.fixture(scope="module")
def llm_fp32(default_gguf):
    return LLM(model=str(default_gguf), dtype="float32", compile=False, max_model_len=512,
               max_num_seqs=8)


def chat_ids(llm, question):
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                             add_generation_prompt=True, tokenize=True)


def hf_greedy(model, prompt_ids, eos_ids):
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=NEW, do_sample=False,
                             eos_token_id=eos_ids, pad_token_id=eos_ids[0])
    return out[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="module")
def reference(hf_model, llm_fp32):
    eos = llm_fp32.engine.eos_token_ids
    return {q: hf_greedy(hf_model, chat_ids(llm_fp32, q), eos) for q in QUESTIONS}


@pytest.fixture(scope="module")
def hf_bf16_matches(hf_model, llm_fp32, reference):
    """How many QUESTIONS transformers' bf16 answers as the fp32 reference does: the bar for rtp's default dtype."""
    import copy

    hf_bf16 = copy.deepcopy(hf_model).to(torch.bfloat16)
    eos = llm_fp32.engine.eos_token_ids
    return sum(hf_greedy(hf_bf16, chat_ids(llm_fp32, q), eos) == reference[q] for q in QUESTIONS)


def test_capital_of_france(llm_fp32):
    out = llm_fp32.chat([{"role": "user", "content": "What is the capital of France?"}],
                        SamplingParams(temperature=0, max_tokens=32))
    assert out[0].outputs[0].text == "The capital of France is Paris."
    assert out[0].outputs[0].finish_reason == "stop"


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_batched_greedy_equals_transformers(default_gguf, reference, prefix_caching):
    llm = LLM(model=str(default_gguf), dtype="float32", compile=False, max_model_len=512,
              max_num_seqs=8, enable_prefix_caching=prefix_caching)
    outs = llm.generate([chat_ids(llm, q) for q in QUESTIONS], SamplingParams(temperature=0, max_tokens=NEW))
    for q, out in zip(QUESTIONS, outs):
        got = out.outputs[0].token_ids
        want = reference[q]
        assert got == want[: len(got)] and (len(got) == len(want) or out.outputs[0].finish_reason == "stop"), q
    # every prompt starts with the same chat-template system preamble: a second round hits it
    again = llm.generate([chat_ids(llm, q) for q in QUESTIONS[:2]], SamplingParams(temperature=0, max_tokens=NEW))
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs[:2]]
    assert (llm.engine.stats()["prefix_cache_hit_tokens"] > 0) == prefix_caching


def test_shared_system_prompt_recomputes_only_new_tokens(llm_fp32):
    system = "You are a helpful assistant who answers briefly. " * 8
    msgs = lambda q: [{"role": "system", "content": system}, {"role": "user", "content": q}]  # noqa: E731
    params = SamplingParams(temperature=0, max_tokens=8)
    first = llm_fp32.chat(msgs("What is 2 + 2?"), params)[0]
    second = llm_fp32.chat(msgs("What is 3 + 3?"), params)[0]
    prompt_len = len(second.prompt_token_ids)
    assert second.num_cached_tokens >= len(chat_ids(llm_fp32, "x")) // 2
    assert prompt_len - second.num_cached_tokens < 32  # only the question and the template tail
    alone = LLM(model=llm_fp32.engine.model_path, dtype="float32", compile=False, max_model_len=512,
                enable_prefix_caching=False).chat(msgs("What is 3 + 3?"), params)[0]
    assert second.outputs[0].token_ids == alone.outputs[0].token_ids
    assert first.outputs[0].text


def test_one_token_requests_finish_with_their_cached_count(llm_fp32):
    # a request that ends on its first token leaves the scheduler inside that step
    system = "You are a helpful assistant who answers briefly. " * 8
    prompts = [llm_fp32.tokenizer.encode(system + q) for q in ("One?", "Two?")]
    outs = llm_fp32.generate(prompts, SamplingParams(temperature=0, max_tokens=1, logprobs=1))
    again = llm_fp32.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=1))[0]
    for out in outs + [again]:
        assert out.error is None and out.finished
        assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"
    assert again.num_cached_tokens >= 64  # the shared system text came from the prefix cache


def test_tiny_kv_budget_preempts_and_still_matches(default_gguf, reference):
    # 12 blocks of 16 tokens (fp32: 737,280 bytes each) for 8 requests of ~70 tokens:
    # even with the shared preamble deduplicated they must preempt and recompute
    llm = LLM(model=str(default_gguf), dtype="float32", compile=False, max_model_len=128,
              max_num_seqs=8, block_size=16, kv_cache_memory=12 * 737_280)
    outs = llm.generate([chat_ids(llm, q) for q in QUESTIONS], SamplingParams(temperature=0, max_tokens=NEW))
    assert llm.engine.stats()["num_preemptions"] > 0
    for q, out in zip(QUESTIONS, outs):
        got = out.outputs[0].token_ids
        assert got == reference[q][: len(got)], q


def test_bad_input_gets_clear_errors(llm_fp32, tmp_path):
    for bad in (dict(temperature=-1), dict(top_p=0), dict(top_p=1.5), dict(max_tokens=0)):
        with pytest.raises(ValueError):
            llm_fp32.generate("hi", SamplingParams(**bad))
    with pytest.raises(ValueError, match="maximum context length is 512"):
        llm_fp32.generate([1] * 600)
    with pytest.raises(FileNotFoundError):
        LLM(model=str(tmp_path / "nope"))
    assert not llm_fp32.engine.has_unfinished_requests()  # nothing half-queued


def test_sampling_options_and_stop_strings(llm_fp32):
    params = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=16, n=2, logprobs=2)
    out = llm_fp32.generate("Once upon a time", params)[0]
    assert len(out.outputs) == 2 and out.outputs[0].token_ids != out.outputs[1].token_ids
    again = llm_fp32.generate("Once upon a time", params)[0]
    assert [o.token_ids for o in again.outputs] == [o.token_ids for o in out.outputs]  # seeded
    assert all(len(o.logprobs) == len(o.token_ids) for o in out.outputs)
    greedy = llm_fp32.chat([{"role": "user", "content": "What is the capital of France?"}],
                           SamplingParams(temperature=0, max_tokens=32, stop=["France"]))[0].outputs[0]
    assert greedy.text == "The capital of " and greedy.finish_reason == "stop" and greedy.stop_reason == "France"


def run_cli(*args):
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-m", "rtp", "generate", *args], capture_output=True, text=True,
                          timeout=600)


def test_rtp_generate_cli(default_gguf, capsys):
    done = run_cli("--chat", "What is the capital of France?", "--no-compile", "--dtype", "float32")
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "The capital of France is Paris."
    # the refusals, through the same main() in this process (each fails before loading a model, so
    # a subprocess apiece would mostly time torch's import); an exception escaping main fails here
    from rtp.cli import main

    for bad, message in [(["--chat", "hi", "--temperature", "-1"], "temperature"),
                         (["--chat", "hi", "--model", "/nonexistent/model"], "does not exist"),
                         (["--chat", "hi", "--prompt", "hi"], "exactly one"),
                         (["--chat", "hi", "--max-tokens", "0"], "max_tokens")]:
        code = main(["generate", *bad, "--no-compile"])
        err = capsys.readouterr().err
        assert code != 0 and message in err and "Traceback" not in err, err


@pytest.fixture(scope="module")
def llm_bf16(default_gguf):
    """The default dtype on this CPU (bf16), eager: rtp's CPU kernels where the CPU has them."""
    llm = LLM(model=str(default_gguf), compile=False, max_model_len=512, max_num_seqs=16)
    assert llm.engine.dtype == torch.bfloat16 or not _cpu_has_bf16()
    return llm


def _cpu_has_bf16():
    from rtp.engine.engine import _cpu_has_native_bf16

    return _cpu_has_native_bf16()


def test_bf16_greedy_is_as_faithful_as_transformers_bf16(llm_bf16, reference, hf_bf16_matches):
    """Greedy output in the default dtype matches the fp32 reference at least as often as
    transformers' own bf16 does (small models have top-2 margins of a few bf16 steps)."""
    from rtp.kernels import cpu_kernels

    if cpu_kernels.tiles_available():  # the GGUF's own blocks serve small-batch decode
        assert llm_bf16.engine.model.model.layers[0].mlp.gate_up_proj.quant is not None
    prompts = [chat_ids(llm_bf16, q) for q in QUESTIONS]
    outs = llm_bf16.generate(prompts, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    ours = sum(o.outputs[0].token_ids[: len(reference[q])] == reference[q] for q, o in zip(QUESTIONS, outs))
    assert ours >= hf_bf16_matches, (ours, hf_bf16_matches)
    # 16 rows: past the quantized kernels' batch limit, oneDNN's bf16 GEMM on dequantized weights
    outs = llm_bf16.generate(prompts * 2, SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True))
    assert [o.outputs[0].token_ids for o in outs[:8]] == [o.outputs[0].token_ids for o in outs[8:]]
    ours = sum(o.outputs[0].token_ids[: len(reference[q])] == reference[q] for q, o in zip(QUESTIONS, outs))
    assert ours >= hf_bf16_matches, (ours, hf_bf16_matches)
    france = llm_bf16.chat([{"role": "user", "content": "What is the capital of France?"}],
                           SamplingParams(temperature=0, max_tokens=32))
    assert france[0].outputs[0].text == "The capital of France is Paris."


_ON_A_LOWER_PATH = """
import json, sys
from rtp import LLM, SamplingParams
from rtp.kernels import cpu_kernels
llm = LLM(model=sys.argv[1], compile=False, max_model_len=512, max_num_seqs=8)
prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True,
                                             tokenize=True) for q in json.loads(sys.argv[2])]
greedy = SamplingParams(temperature=0, max_tokens=int(sys.argv[3]), ignore_eos=True)
alone = [llm.generate([p], greedy)[0].outputs[0].token_ids for p in prompts]
batched = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
print(json.dumps({"isa": cpu_kernels.isa(), "graphs": llm.engine.runner.graph_steps,
                  "blocks": llm.engine.model.model.layers[0].mlp.gate_up_proj.quant is not None,
                  "lanes": getattr(llm.engine.model.model.layers[0].mlp.gate_up_proj.quant, "lanes", None) is not None,
                  "alone": alone, "batched": batched}))
"""


@pytest.mark.parametrize("path", ["avx2", "avx512"])
def test_a_lower_isa_path_is_as_faithful_as_transformers_bf16(path, default_gguf, reference, hf_bf16_matches):
    """The engine on a lower ISA path's kernels (RTP_CPU_ISA, as on a CPU without AVX-512 BF16; avx512 runs its
    lane-order linears where the CPU has VNNI, the avx2 variants for the other ops): in its default dtype, the
    GGUF's blocks multiplied in place and the steps
    replayed from CPU graphs, greedy output matches the fp32 reference at least as often as transformers'
    bf16 does, and a request gets the same tokens alone as in a batch of eight."""
    import json
    import os
    import subprocess
    import sys

    if path not in cpu_kernels.paths_here():
        pytest.skip(f"this CPU cannot run the {path} path")
    out = subprocess.run([sys.executable, "-c", _ON_A_LOWER_PATH, str(default_gguf), json.dumps(QUESTIONS),
                          str(NEW)], capture_output=True, text=True, timeout=600,
                         env={**os.environ, "RTP_CPU_ISA": path})
    assert out.returncode == 0, out.stderr[-3000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["isa"] == path and got["blocks"] and got["graphs"] > 0, got
    assert got["lanes"] == (path == "avx512" and cpu_kernels._k.vnni_supported()), got
    assert got["alone"] == got["batched"]
    ours = sum(ids[: len(reference[q])] == reference[q] for q, ids in zip(QUESTIONS, got["alone"]))
    assert ours >= hf_bf16_matches, (ours, hf_bf16_matches)


def test_cpu_graphs_give_the_eager_tokens(llm_bf16):
    """Decode steps replayed from CPU graphs (one row, and 8 rows through the tile kernels' graph) and
    the prefill steps replayed from the step graph give token for token what the same engine gives
    with every step eager; sampled steps too."""
    runner = llm_bf16.engine.runner
    if not runner.cpu_graphs:
        pytest.skip("no CPU graphs: rtp's CPU kernels are not available here")
    # every linear of a prefill step on rtp's kernels, with AMX or without: the step graph
    assert runner.step_graph is not None
    prompts = [chat_ids(llm_bf16, q) for q in QUESTIONS]
    greedy = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=NEW, ignore_eos=True)

    def run():
        batch = llm_bf16.generate(prompts, greedy) + llm_bf16.generate(prompts[:2], sampled)
        single = llm_bf16.generate(prompts[:1], greedy)
        return [o.outputs[0].token_ids for o in batch + single]

    run()  # the prompts' blocks now sit in the prefix cache for both runs compared below
    before = runner.graph_steps
    replayed = run()
    assert runner.graph_steps - before >= 2 * (NEW - 1)
    with runner.eager():
        eager = run()
    assert replayed == eager


def test_a_step_graph_samples_one_row_as_an_eager_step_does(llm_bf16):
    """A prompt's step samples one row: the step graph replays it on the LM head's one-row kernel, as
    the eager step runs it, so the first token's logprobs are the eager ones exactly (on the tile
    kernels that the graph's several-sample head takes they were ~0.1 apart, enough to flip a near tie)."""
    runner = llm_bf16.engine.runner
    if runner.step_graph is None:
        pytest.skip("no step graph: rtp's CPU kernels are not available here")
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    prompts = [chat_ids(llm_bf16, q) for q in QUESTIONS[:3]]

    def first_logprobs():
        return [llm_bf16.generate([p], params)[0].outputs[0].logprobs[0] for p in prompts]

    first_logprobs()  # the prompts' full blocks now sit in the prefix cache for both runs below
    before = runner.graph_steps
    replayed = first_logprobs()
    assert runner.graph_steps - before == len(prompts)
    with runner.eager():
        eager = first_logprobs()
    assert replayed == eager


def test_compiled_bf16_decode_equals_eager(default_gguf):
    """The bucket-1 decode graph (Inductor on CPU, rtp's kernels as custom ops inside) gives the
    eager engine's tokens. The eager engine is a fresh one like it: the shared llm_bf16 holds
    these prompts in its prefix cache, computed in other batches, and a bf16 prefill over
    cached KV may round a near-tie the other way."""
    llm = LLM(model=str(default_gguf), compile=True, max_model_len=512, max_num_seqs=1)
    eager = LLM(model=str(default_gguf), compile=False, max_model_len=512, max_num_seqs=1)
    params = SamplingParams(temperature=0, max_tokens=NEW, ignore_eos=True)
    for q in QUESTIONS[:3]:
        got = llm.generate([chat_ids(llm, q)], params)[0].outputs[0].token_ids
        want = eager.generate([chat_ids(eager, q)], params)[0].outputs[0].token_ids
        assert got == want, q
    assert llm.engine.runner.compiled_steps > 0
