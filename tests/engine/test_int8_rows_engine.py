"""--activation-dtype int8 through the whole engine on the default model (Q4_1 layers): prefill chunks and
decode steps replayed from CPU graphs multiply int8 rows (rtp/kernels/csrc/vnni_gemm.c); int8-prefill: the
prompt rows only, every decode row in bf16, in mixed steps too; and what it asks for is validated like
every other option."""

from __future__ import annotations

import argparse

import pytest

from rtp import LLM, SamplingParams
from rtp.config import EngineConfig
from rtp.kernels import cpu_kernels
from rtp.kernels.quant import BlockQuantized

QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "Name three primary colors.",
             "What is 12 times 7?"]


@pytest.mark.skipif(not cpu_kernels.tiles_available() or not cpu_kernels.int8_rows_available(),
                    reason="needs AVX-512 VNNI and no AMX")
def test_int8_rows_serve_a_batch_and_keep_a_rows_answer(default_gguf):
    """Every quantized layer but the LM head takes int8 rows; a batch of four greedy requests gives each the tokens it gets
    beside one other request (each row is quantized on its own: a row's answer does not depend on the
    rows of its step, from 2 rows on, as in bf16), and the answers are the model's, not noise."""
    llm = LLM(model=str(default_gguf), activation_dtype="int8", max_num_seqs=8)
    model = llm.engine.model
    quantized = [m for m in model.modules() if isinstance(getattr(m, "quant", None), BlockQuantized)]
    assert model.lm_head in quantized and not model.lm_head.quant.int8_rows  # the logits stay bf16
    assert len(quantized) > 30 and all(m.quant.int8_rows for m in quantized if m is not model.lm_head)
    params = SamplingParams(max_tokens=12, temperature=0)
    prompts = [[{"role": "user", "content": q}] for q in QUESTIONS]
    batch = [o.outputs[0].token_ids for o in llm.chat(prompts, params)]
    other = [{"role": "user", "content": "Tell me a long story about a dragon."}]
    beside = [llm.chat([p, other], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
              .outputs[0].token_ids for p in prompts]
    assert batch == beside
    # the model's answers, a little further from fp32 than bf16's: each question's first-token log-probs
    # near the bf16 engine's (the capital of France: "The" over "L" by 0.06 in bf16; int8 moves each ~0.3)
    first = SamplingParams(max_tokens=1, temperature=0, logprobs=4)
    int8 = [o.outputs[0].logprobs[0] for o in llm.chat(prompts, first)]
    del llm
    bf16 = [o.outputs[0].logprobs[0] for o in LLM(model=str(default_gguf), max_num_seqs=8).chat(prompts, first)]
    for a, b in zip(int8, bf16):
        shared = set(a) & set(b)
        assert len(shared) >= 3 and all(abs(a[t] - b[t]) < 0.5 for t in shared), (a, b)


@pytest.mark.skipif(not cpu_kernels.tiles_available() or not cpu_kernels.int8_rows_available(),
                    reason="needs AVX-512 VNNI and no AMX")
def test_int8_prefill_keeps_decode_rows_bf16_beside_prompt_chunks(default_gguf):
    """Two requests decoding together give the same tokens beside a third request's prompt chunks (mixed
    steps, the step graph splitting each linear at the step's decode rows) as alone (decode-only steps,
    bf16 throughout); and the prompts did run as int8 rows: their first-token log-probs moved off the
    bf16 engine's, a little. (Both runs sample the same rows in the same steps: a step that samples one
    row takes the LM head's one-row kernel, one of several its tile kernel.)"""
    llm = LLM(model=str(default_gguf), activation_dtype="int8-prefill", max_num_seqs=8, max_num_batched_tokens=64,
              enable_prefix_caching=False)
    model = llm.engine.model
    quantized = [m for m in model.modules() if isinstance(getattr(m, "quant", None), BlockQuantized)]
    assert not model.lm_head.quant.int8_rows
    assert len(quantized) > 30 and all(m.quant.int8_rows == "prefill" for m in quantized if m is not model.lm_head)
    runner = llm.engine.runner
    assert runner.step_graph is not None
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    short = [{"role": "user", "content": "Hi."}]
    long = [{"role": "user", "content": "Summarize this: " + "The river ran past the old mill. " * 40}]

    for q in QUESTIONS[:2]:
        mine = [{"role": "user", "content": q}]
        alone = [o.outputs[0].token_ids for o in llm.chat([mine, short], params)]
        steps = runner.graph_steps
        beside_prompt = llm.chat([mine, short, long], params)  # long: ~400 tokens, 64 a step
        assert runner.graph_steps - steps >= 16
        assert alone == [o.outputs[0].token_ids for o in beside_prompt[:2]], q
    first = SamplingParams(max_tokens=1, temperature=0, logprobs=4)
    prompts = [[{"role": "user", "content": q}] for q in QUESTIONS]
    int8 = [o.outputs[0].logprobs[0] for o in llm.chat(prompts, first)]
    del llm
    bf16 = [o.outputs[0].logprobs[0] for o in LLM(model=str(default_gguf), max_num_seqs=8).chat(prompts, first)]
    assert int8 != bf16
    for a, b in zip(int8, bf16):
        shared = set(a) & set(b)
        assert len(shared) >= 3 and all(abs(a[t] - b[t]) < 0.5 for t in shared), (a, b)


def test_a_bad_activation_dtype_is_a_clear_error():
    with pytest.raises(ValueError, match="--activation-dtype must be auto, int8 or int8-prefill, got 'fp8'"):
        EngineConfig.from_flat(activation_dtype="fp8")
    from rtp.cli_options import add_engine_options, engine_config

    parser = argparse.ArgumentParser()
    add_engine_options(parser)
    assert engine_config(parser.parse_args(["--activation-dtype", "int8"])).load.activation_dtype == "int8"
    assert (engine_config(parser.parse_args(["--activation-dtype", "int8-prefill"])).load.activation_dtype
            == "int8-prefill")
    with pytest.raises(SystemExit):
        parser.parse_args(["--activation-dtype", "fp8"])


@pytest.mark.skipif(not cpu_kernels.tiles_available() or not cpu_kernels.int8_rows_available(),
                    reason="needs AVX-512 VNNI and no AMX")
def test_the_engine_says_where_int8_prefill_would_help(default_gguf, caplog):
    """int8-prefill is opt-in; on a CPU where it runs, a bf16 engine over Q4_1 layers says so once at
    start-up, and an fp32 engine (asked for fidelity) or one already taking int8 rows does not."""
    hint = "--activation-dtype int8-prefill makes prefill"
    for kwargs, said in [({}, True), ({"dtype": "float32"}, False), ({"activation_dtype": "int8-prefill"}, False)]:
        caplog.clear()
        with caplog.at_level("INFO", logger="rtp.engine"):
            llm = LLM(model=str(default_gguf), max_num_seqs=2, **kwargs)
        del llm
        assert sum(hint in r.getMessage() for r in caplog.records) == int(said), kwargs
