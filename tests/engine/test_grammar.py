"""Structured outputs in the offline API (SamplingParams(structured_outputs=...)) on the real
default model: every form matches what it asked for, and the grammar composes with n > 1,
seeds, stop strings, preemption by recompute and the prefix cache; the runtime's state holds
together afterwards."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest

from rtp import LLM, SamplingParams
from rtp.errors import InvalidRequest
from rtp.sampling_params import StructuredOutputs

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pets"],
          "properties": {"name": {"type": "string", "maxLength": 16},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120},
                         "pets": {"type": "array", "maxItems": 2,
                                  "items": {"enum": ["cat", "dog", "fish"]}}}}
QUESTIONS = ["Describe a person as JSON.", "Who is your best friend?", "Tell me about a sailor.",
             "Invent a character.", "Describe a teacher.", "Who lives next door?"]


@pytest.fixture(scope="module")
def llm(default_gguf):
    return LLM(model=str(default_gguf), dtype="float32", compile=False, max_model_len=256, max_num_seqs=8)


def chat(llm, text):
    return llm.tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                             tokenize=True)


def one(llm, prompt, params):
    return llm.generate([prompt], params)[0]


def idle(llm):
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    engine.scheduler.check_integrity()
    assert engine.allocator.num_used == 0


def test_json_schema_greedy_and_sampled(llm):
    greedy = llm.generate([chat(llm, q) for q in QUESTIONS], SamplingParams(
        temperature=0, max_tokens=120, structured_outputs=StructuredOutputs(json=PERSON)))
    sampled = one(llm, chat(llm, QUESTIONS[0]), SamplingParams(
        temperature=1.0, n=4, seed=11, max_tokens=120, structured_outputs=StructuredOutputs(json=PERSON)))
    again = one(llm, chat(llm, QUESTIONS[0]), SamplingParams(
        temperature=1.0, n=4, seed=11, max_tokens=120, structured_outputs=StructuredOutputs(json=PERSON)))
    for out in [*greedy, sampled, again]:
        for c in out.outputs:
            assert c.finish_reason == "stop", c.text
            jsonschema.validate(json.loads(c.text), PERSON)
    assert [c.text for c in sampled.outputs] == [c.text for c in again.outputs]  # the seed reproduces
    idle(llm)


def test_regex_choice_grammar_and_json_object(llm):
    prompt = chat(llm, "Give me a date.")
    date = one(llm, prompt, SamplingParams(temperature=0, max_tokens=30,
                                               structured_outputs=StructuredOutputs(regex=r"\d{4}-\d{2}-\d{2}")))
    assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", date.outputs[0].text)
    pick = one(llm, prompt, SamplingParams(temperature=0.7, n=3, seed=3, max_tokens=10,
                                               structured_outputs=StructuredOutputs(choice=["yes", "no"])))
    assert {c.text for c in pick.outputs} <= {"yes", "no"}
    gbnf = 'root ::= "The answer is " [0-9]+ "."'
    answer = one(llm, chat(llm, "What is 6 times 7?"), SamplingParams(
        temperature=0, max_tokens=20, structured_outputs=StructuredOutputs(grammar=gbnf)))
    assert re.fullmatch(r"The answer is \d+\.", answer.outputs[0].text)
    obj = one(llm, chat(llm, "Give a JSON object with a name and an age."), SamplingParams(
        temperature=0, max_tokens=100, structured_outputs=StructuredOutputs(json_object=True)))
    assert isinstance(json.loads(obj.outputs[0].text), dict)
    idle(llm)


def test_stop_string_inside_the_grammar(llm):
    out = one(llm, chat(llm, QUESTIONS[0]), SamplingParams(
        temperature=0, max_tokens=120, stop=['"age"'], structured_outputs=StructuredOutputs(json=PERSON)))
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].text.startswith('{"name"')
    assert '"age"' not in out.outputs[0].text
    idle(llm)


def test_constrained_rows_beside_free_ones_match_their_runs_alone(llm):
    free = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    bound = SamplingParams(temperature=0, max_tokens=120, structured_outputs=StructuredOutputs(json=PERSON))
    prompts = [chat(llm, q) for q in QUESTIONS]
    alone = {i: one(llm, prompts[i], bound).outputs[0].token_ids for i in (0, 2, 4)}
    mixed = llm.generate(prompts, [bound, free, bound, free, bound, free])
    assert {i: mixed[i].outputs[0].token_ids for i in (0, 2, 4)} == alone


def test_preemption_and_prefix_cache_keep_the_grammar(default_gguf):
    # a KV budget too small for the batch: requests are preempted and recomputed mid-output,
    # their matchers must carry on from the tokens they already have
    llm = LLM(model=str(default_gguf), dtype="float32", compile=False, max_model_len=160, max_num_seqs=6,
              block_size=16, kv_cache_memory=14 * 737_280)
    params = SamplingParams(temperature=0, max_tokens=100, structured_outputs=StructuredOutputs(json=PERSON))
    prompts = [chat(llm, q) for q in QUESTIONS]
    outs = llm.generate(prompts, params)
    assert llm.engine.stats()["num_preemptions"] > 0
    for out in outs:
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), PERSON)
    again = one(llm, prompts[0], params)  # its prompt now comes from the prefix cache
    assert again.num_cached_tokens > 0
    assert again.outputs[0].text == outs[0].outputs[0].text
    idle(llm)


def test_bad_grammars_are_refused_before_queueing(llm):
    for bad in (StructuredOutputs(regex="a(b"), StructuredOutputs(json={"type": "frob"}),
                StructuredOutputs(grammar="root ::= ???"), StructuredOutputs(choice=[])):
        with pytest.raises(InvalidRequest):
            one(llm, "hi", SamplingParams(max_tokens=5, structured_outputs=bad))
    idle(llm)


def test_offline_chat_takes_tools_and_a_required_call_is_a_json_array(default_gguf):
    """LLM.chat(tools=...) renders them through --chat-template's template; the grammar the server
    uses for tool_choice "required" works offline too."""
    from rtp.server.tools import plan_tools

    llm = LLM(model=str(default_gguf), dtype="float32", compile=False, max_model_len=512,
              chat_template="chatml-tools")
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
        "additionalProperties": False}}}]
    plan = plan_tools(tools, "required", False, parser=None, template=llm.tokenizer.chat_template, structured=False)
    question = [{"role": "user", "content": "Weather in Paris?"}]
    plain = llm.chat(question, SamplingParams(max_tokens=1))[0]
    out = llm.chat(question, SamplingParams(temperature=0, max_tokens=100, structured_outputs=plan.grammar),
                   tools=tools)[0]
    assert len(out.prompt_token_ids) > len(plain.prompt_token_ids)  # the tools are in the prompt
    calls = json.loads(out.outputs[0].text)
    assert out.outputs[0].finish_reason == "stop" and len(calls) == 1  # parallel_tool_calls false: one
    assert calls[0]["name"] == "get_weather" and len(calls[0]["parameters"]["city"]) <= 12
