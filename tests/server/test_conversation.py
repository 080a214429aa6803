"""rtp/server/conversation.py: every refusal of a message or a template variable names its
index and field; a tool round trip comes out as templates read it and renders; and any list of
messages, any chat_template_kwargs, is either accepted (and then renders) or an InvalidRequest."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import tokenizers
from hypothesis import event, given
from hypothesis import strategies as st

import rtp.checkpoint
from rtp.checkpoint.tokenizer import Tokenizer, _compile_template
from rtp.errors import InvalidRequest
from rtp.server.conversation import RESERVED_TEMPLATE_VARIABLES, plain_messages, template_kwargs
from rtp.server.protocol import ChatMessage

TOOLS_TEMPLATE = (Path(rtp.checkpoint.__file__).parent / "chat_templates" / "chatml-tools.jinja").read_text()
PLAIN_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                  "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
HARMONY_LIKE = "{% for m in messages %}{% if m['role'] == 'developer' %}D:{% endif %}{{ m['content'] }}{% endfor %}"


def decode(messages: list[dict]) -> list[ChatMessage]:
    """As the server gets them: through msgspec, from JSON."""
    return msgspec.json.decode(msgspec.json.encode(messages), type=list[ChatMessage])


def tokenizer(template: str) -> Tokenizer:
    backend = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    return Tokenizer(backend, chat_template=template, bos_token="<s>", eos_token="</s>")


def nested(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


def call(id, name="get_weather", arguments='{"city": "Paris"}', **extra) -> dict:
    return {"id": id, "type": "function", "function": {"name": name, "arguments": arguments}, **extra}


ROUND_TRIP = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": [{"type": "text", "text": "Weather in Paris"}, {"type": "text", "text": "and Rome?"}]},
    {"role": "assistant", "content": None,
     "tool_calls": [call("call_1"), call("call_2", arguments={"city": "Rome", "days": [1, 2]})]},
    {"role": "tool", "tool_call_id": "call_2", "content": '{"sky": "rain"}'},  # answers may come in any order
    {"role": "tool", "tool_call_id": "call_1", "name": "get_weather", "content": '{"sky": "clear"}'},
    {"role": "assistant", "content": "Clear in Paris, rain in Rome."},
]


# -- accepted -------------------------------------------------------------------------------


def test_a_tool_round_trip_comes_out_as_templates_read_it():
    plain, size = plain_messages(decode(ROUND_TRIP), TOOLS_TEMPLATE)
    assert plain == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris\nand Rome?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
            {"id": "call_2", "type": "function",
             "function": {"name": "get_weather", "arguments": {"city": "Rome", "days": [1, 2]}}}]},
        {"role": "tool", "content": '{"sky": "rain"}', "tool_call_id": "call_2"},
        {"role": "tool", "content": '{"sky": "clear"}', "name": "get_weather", "tool_call_id": "call_1"},
        {"role": "assistant", "content": "Clear in Paris, rain in Rome."},
    ]
    contents = sum(len(m["content"]) for m in plain)
    arguments = len('{"city": "Paris"}') + len(msgspec.json.encode({"city": "Rome", "days": [1, 2]}))
    ids_and_names = 2 * len("call_1") + 2 * len("get_weather") + 2 * len("call_1") + len("get_weather")
    assert contents + arguments + ids_and_names <= size < 2 * (contents + arguments + ids_and_names)
    text = tokenizer(TOOLS_TEMPLATE).apply_chat_template(plain)
    assert text.count("<tool_call>") == 2 and text.count("<tool_response>") == 2
    assert '"arguments": {"city": "Rome", "days": [1, 2]}' in text


def test_an_assistants_thinking_reaches_the_template_that_reads_it():
    """A reply with --reasoning-parser sent back as it came: its reasoning_content reaches the template
    (Qwen3's renders it as <think>...</think> before the content), and counts in the size."""
    reply = {"role": "assistant", "content": "4", "reasoning_content": "2 and 2 make 4."}
    plain, size = plain_messages(decode([USER, reply]), PLAIN_TEMPLATE)
    assert plain[1] == {"role": "assistant", "content": "4", "reasoning_content": "2 and 2 make 4."}
    assert size == len("hi") + len("4") + len("2 and 2 make 4.")
    thinking = "{% for m in messages %}{% if m.reasoning_content %}<think>{{ m.reasoning_content }}</think>" \
               "{% endif %}{{ m.content }}|{% endfor %}"
    assert tokenizer(thinking).apply_chat_template(plain, add_generation_prompt=False) == \
        "hi|<think>2 and 2 make 4.</think>4|"


def test_developer_is_system_unless_the_template_knows_it():
    messages = decode([{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hi"}])
    assert plain_messages(messages, PLAIN_TEMPLATE)[0][0]["role"] == "system"
    assert plain_messages(messages, None)[0][0]["role"] == "system"
    assert plain_messages(messages, HARMONY_LIKE)[0][0]["role"] == "developer"


@pytest.mark.parametrize("arguments, expected", [
    ("", {}), ("  ", {}), ({"a": {"b": None}}, {"a": {"b": None}}), ('{"x": 1.5}', {"x": 1.5})])
def test_arguments_as_an_object_or_a_string_holding_one(arguments, expected):
    plain, _ = plain_messages(decode([{"role": "assistant", "tool_calls": [call("c", arguments=arguments)]}]),
                              TOOLS_TEMPLATE)
    assert plain[0]["tool_calls"][0]["function"]["arguments"] == expected


def test_lenient_shapes_clients_send():
    messages = decode([
        {"role": "user", "content": "hi", "tool_calls": []},                      # no calls, said as []
        {"role": "assistant", "tool_calls": [{"id": "0", "function": {"name": "f"}}]},  # no type, no arguments
        {"role": "tool", "tool_call_id": "0", "content": "one"},
        {"role": "assistant", "tool_calls": [call("0")]},                         # ids numbered per turn
        {"role": "tool", "tool_call_id": "0", "content": "two"},
        {"role": "assistant", "tool_calls": [call("1")]},                         # left unanswered
    ])
    plain, _ = plain_messages(messages, TOOLS_TEMPLATE)
    assert "tool_calls" not in plain[0]
    assert plain[1]["tool_calls"] == [{"id": "0", "type": "function", "function": {"name": "f", "arguments": {}}}]
    assert [m["role"] for m in plain] == ["user", "assistant", "tool", "assistant", "tool", "assistant"]


# -- refused --------------------------------------------------------------------------------

USER = {"role": "user", "content": "hi"}
ASKS = {"role": "assistant", "tool_calls": [call("a")]}

REFUSED = [
    # (messages, the start of the message)
    ([USER, {"role": "bot", "content": "x"}], "messages[1].role: 'bot' is not one of"),
    ([{"role": "", "content": "x"}], "messages[0].role:"),
    ([{"role": "x" * 10_000}], "messages[0].role: 'xxxxxxxx"),
    ([{"role": "user", "content": [{"type": "image_url", "text": "x"}]}],
     "messages[0].content[0].type: only text parts are supported, not 'image_url'"),
    ([{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text"}]}],
     "messages[0].content[1].text: a text part needs its text"),
    ([{"role": "user", "content": "x", "tool_calls": [call("a")]}], "messages[0].tool_calls: only an assistant's"),
    ([{"role": "tool", "tool_call_id": "a", "tool_calls": [call("a")]}], "messages[0].tool_calls: only an assistant's"),
    ([{"role": "assistant", "tool_calls": {"id": "a"}}], "messages[0].tool_calls: must be a list"),
    ([{"role": "assistant", "tool_calls": "call"}], "messages[0].tool_calls: must be a list"),
    ([{"role": "assistant", "tool_calls": [call("a"), 7]}], "messages[0].tool_calls[1]: must be an object"),
    ([{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f"}}]}],
     "messages[0].tool_calls[0].id: must be a non-empty string"),
    ([{"role": "assistant", "tool_calls": [call("")]}], "messages[0].tool_calls[0].id: must be a non-empty"),
    ([{"role": "assistant", "tool_calls": [call(5)]}], "messages[0].tool_calls[0].id: must be a non-empty"),
    ([{"role": "assistant", "tool_calls": [call("a"), call("b"), call("a")]}],
     "messages[0].tool_calls[2].id: 'a' is also the id of tool_calls[0]"),
    ([{"role": "assistant", "tool_calls": [call("a", type="retrieval")]}],
     "messages[0].tool_calls[0].type: must be \"function\", not 'retrieval'"),
    ([{"role": "assistant", "tool_calls": [{"id": "a", "type": "function"}]}],
     "messages[0].tool_calls[0].function: must be an object"),
    ([{"role": "assistant", "tool_calls": [{"id": "a", "function": "f"}]}],
     "messages[0].tool_calls[0].function: must be an object"),
    ([{"role": "assistant", "tool_calls": [{"id": "a", "function": {"arguments": "{}"}}]}],
     "messages[0].tool_calls[0].function.name: must be a non-empty string"),
    ([{"role": "assistant", "tool_calls": [call("a", name="")]}], "messages[0].tool_calls[0].function.name:"),
    ([{"role": "assistant", "tool_calls": [call("a", arguments=None)]}],
     "messages[0].tool_calls[0].function.arguments: must be a JSON object or a string holding one, not null"),
    ([{"role": "assistant", "tool_calls": [call("a", arguments=[1])]}],
     "messages[0].tool_calls[0].function.arguments: must be a JSON object or a string holding one, not a list"),
    ([{"role": "assistant", "tool_calls": [call("a", arguments=3)]}],
     "messages[0].tool_calls[0].function.arguments: must be a JSON object or a string holding one, not a number"),
    ([{"role": "assistant", "tool_calls": [call("a", arguments="[1, 2]")]}],
     "messages[0].tool_calls[0].function.arguments: must be a JSON object or a string holding one, not a list"),
    ([{"role": "assistant", "tool_calls": [call("a", arguments="null")]}],
     "messages[0].tool_calls[0].function.arguments: must be a JSON object or a string holding one, not null"),
    ([{"role": "assistant", "tool_calls": [call("a", arguments='"{}"')]}],
     "messages[0].tool_calls[0].function.arguments: must be a JSON object or a string holding one, not a string"),
    ([{"role": "assistant", "tool_calls": [call("a", arguments="{city: Paris}")]}],
     "messages[0].tool_calls[0].function.arguments: the string is not valid JSON"),
    ([{"role": "assistant", "tool_calls": [call("a", arguments='{"x": NaN}')]}],
     "messages[0].tool_calls[0].function.arguments: the string is not valid JSON"),
    ([{"role": "assistant", "tool_calls": [call("a", arguments='{"x":' * 5000)]}],
     "messages[0].tool_calls[0].function.arguments:"),
    ([{"role": "assistant", "tool_calls": [call("a", arguments="[" * 100_000)]}],
     "messages[0].tool_calls[0].function.arguments: nests deeper than 64 levels"),
    ([{"role": "assistant", "tool_calls": [call("a", arguments='{"x":' * 65 + "1" + "}" * 65)]}],
     "messages[0].tool_calls[0].function.arguments: nests deeper than 64 levels"),
    ([USER, {"role": "tool", "content": "r"}],
     "messages[1].tool_call_id: a tool message needs the id of the call it answers"),
    ([ASKS, {"role": "tool", "tool_call_id": "", "content": "r"}], "messages[1].tool_call_id: a tool message needs"),
    ([ASKS, {"role": "tool", "tool_call_id": "b", "content": "r"}],
     "messages[1].tool_call_id: 'b' matches no call an earlier assistant message made"),
    ([{"role": "tool", "tool_call_id": "a", "content": "r"}, ASKS], "messages[0].tool_call_id: 'a' matches no call"),
    ([ASKS, {"role": "tool", "tool_call_id": "a", "content": "r"}, {"role": "tool", "tool_call_id": "a"}],
     "messages[2].tool_call_id: 'a' was already answered by messages[1]"),
    ([ASKS, {"role": "user", "tool_call_id": "a", "content": "r"}],
     "messages[1].tool_call_id: only a tool message answers a call"),
    ([], "messages is empty"),
    ([{"role": "user", "content": "x", "reasoning_content": "hm"}],
     "messages[0].reasoning_content: only an assistant's message has thinking"),
]


@pytest.mark.parametrize("messages, expected", REFUSED, ids=[e[:60] for _, e in REFUSED])
def test_refused_naming_the_message_and_the_field(messages, expected):
    with pytest.raises(InvalidRequest) as e:
        plain_messages(decode(messages), TOOLS_TEMPLATE)
    assert str(e.value).startswith(expected), str(e.value)
    assert e.value.param == "messages"
    assert "\n" not in str(e.value) and len(str(e.value)) < 300  # one sentence, whatever the client sent


def test_tool_calls_need_a_template_that_renders_them():
    with pytest.raises(InvalidRequest, match=r"^messages\[1\]\.tool_calls: this model's chat template") as e:
        plain_messages(decode([USER, ASKS]), PLAIN_TEMPLATE)
    assert e.value.param == "messages"


@pytest.mark.parametrize("message, expected", [
    (ChatMessage("user", content=5), "messages[0].content: must be a string, a list of text parts or null"),
    (ChatMessage("user", content=[{"type": "text", "text": "x"}]), "messages[0].content[0]: must be a part"),
    (ChatMessage("user", name=3), "messages[0].name: must be a string"),
    (ChatMessage(None), "messages[0].role: null is not one of"),
    (ChatMessage("assistant", tool_calls=[call("a", arguments='{"a": "\udc00"}')]),
     "messages[0].tool_calls[0].function.arguments: the string is not valid JSON"),
    (ChatMessage("assistant", tool_calls=[call("a", arguments={"a": {1, 2}})]),
     "messages[0].tool_calls[0].function.arguments: holds a value of type set, which is not JSON"),
    (ChatMessage("assistant", reasoning_content=3), "messages[0].reasoning_content: must be a string"),
])
def test_refused_when_built_without_msgspec(message, expected):
    # msgspec refuses these types while decoding the body; a caller that builds messages itself
    # gets the same kind of answer
    with pytest.raises(InvalidRequest) as e:
        plain_messages([message], TOOLS_TEMPLATE)
    assert str(e.value).startswith(expected) and e.value.param == "messages"


# -- chat_template_kwargs -------------------------------------------------------------------


def test_template_kwargs_are_passed_on_as_a_copy():
    assert template_kwargs(None) == ({}, 0)
    given_kwargs = {"enable_thinking": False, "documents": [{"title": "a", "text": "b" * 1000}]}
    kwargs, size = template_kwargs(given_kwargs)
    assert kwargs == given_kwargs and kwargs is not given_kwargs
    assert 1000 < size < 1100
    text = tokenizer("{{ enable_thinking }} {{ documents[0].title }}").apply_chat_template([], **kwargs)
    assert text == "False a"


@pytest.mark.parametrize("name", sorted(RESERVED_TEMPLATE_VARIABLES))
def test_a_variable_the_server_sets_is_refused(name):
    with pytest.raises(InvalidRequest) as e:
        template_kwargs({"enable_thinking": True, name: 1})
    assert str(e.value).startswith(f"chat_template_kwargs.{name}: the server sets this template variable itself")
    assert e.value.param == "chat_template_kwargs"


@pytest.mark.parametrize("kwargs, expected", [
    ({"my-var": 1}, "chat_template_kwargs.'my-var': is not a name"),
    ({"1st": 1}, "chat_template_kwargs.'1st': is not a name"),
    ({"": 1}, "chat_template_kwargs.'': is not a name"),
    ({3: 1}, "chat_template_kwargs.a number: is not a name"),
    ({"x": float("nan")}, "chat_template_kwargs.x: holds a number JSON cannot write"),
    ({"x": {"a": object()}}, "chat_template_kwargs.x: holds a value of type object, which is not JSON"),
    ({"x": (1, 2)}, "chat_template_kwargs.x: holds a value of type tuple"),
    ({"x": {1: "a"}}, "chat_template_kwargs.x: has a key that is not a string"),
    ({"x": [[[]], nested(70)]}, "chat_template_kwargs.x: nests deeper than 64 levels"),
    ([("x", 1)], "chat_template_kwargs: must be an object"),
])
def test_template_kwargs_refused(kwargs, expected):
    with pytest.raises(InvalidRequest) as e:
        template_kwargs(kwargs)
    assert str(e.value).startswith(expected), str(e.value)
    assert e.value.param == "chat_template_kwargs"


def test_the_reserved_names_are_all_the_variables_the_tokenizer_sets():
    # a name tokenizer.py starts setting and RESERVED_TEMPLATE_VARIABLES misses would be a kwarg
    # that silently replaces it (or a TypeError under `messages`): this fails first
    class Recorder:
        def render(self, **variables):
            self.variables = variables
            return ""

    tok = tokenizer("unused")
    tok._template = recorder = Recorder()
    tok.apply_chat_template([], add_generation_prompt=True, tools=[])  # tools: as the server passes them
    assert set(recorder.variables) <= RESERVED_TEMPLATE_VARIABLES
    assert set(_compile_template("").globals) <= RESERVED_TEMPLATE_VARIABLES


# -- any input ------------------------------------------------------------------------------

def mostly(good, bad):
    """`good` seven times in eight: conversations close enough to valid to reach every check."""
    return st.integers(0, 7).flatmap(lambda k: bad if k == 0 else good)


IDS = st.sampled_from(["a", "b", "c", "d", "e", "f"])
TEXT = st.text(max_size=6)
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | TEXT,
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(TEXT, inner, max_size=3),
                    max_leaves=8)
OBJECTS = st.dictionaries(TEXT, JSON, max_size=3)
ARGUMENTS = mostly(st.one_of(st.sampled_from(['{"city": "Paris"}', "", "{}"]), OBJECTS,
                             OBJECTS.map(lambda o: msgspec.json.encode(o).decode())),
                   st.one_of(JSON, st.sampled_from(["[1]", "null", "3", "{", '{"x": NaN}', "[" * 2000,
                                                    '{"a":' * 70 + "1" + "}" * 70])))
JUNK_CALL = st.fixed_dictionaries({}, optional={
    "id": st.one_of(IDS, JSON), "type": st.sampled_from(["function", "code"]),
    "function": st.one_of(JSON, st.fixed_dictionaries({}, optional={"name": st.one_of(st.sampled_from(["f", ""]), JSON),
                                                                     "arguments": ARGUMENTS}))})
CALL = mostly(st.fixed_dictionaries({"id": IDS, "function": st.fixed_dictionaries({"name": st.just("f")},
                                                                                  optional={"arguments": ARGUMENTS})},
                                    optional={"type": st.just("function")}),
              JUNK_CALL)
PART = st.fixed_dictionaries({"type": st.just("text"), "text": TEXT})
CONTENT = mostly(st.one_of(st.none(), TEXT, st.lists(PART, max_size=2)),
                 st.one_of(st.lists(st.fixed_dictionaries({"type": st.sampled_from(["text", "image_url"])},
                                                          optional={"text": TEXT}), max_size=2), JSON))
ROLE = mostly(st.sampled_from(["system", "user", "assistant", "tool", "developer"]), TEXT)
SAYS = st.fixed_dictionaries({"role": mostly(st.sampled_from(["system", "user", "assistant", "developer"]), ROLE),
                              "content": CONTENT}, optional={"name": mostly(TEXT, JSON)})
ASKS_ANY = st.fixed_dictionaries({"role": mostly(st.just("assistant"), ROLE),
                                  "tool_calls": mostly(st.lists(CALL, max_size=3), JSON)},
                                 optional={"content": CONTENT})
ANSWERS = st.fixed_dictionaries({"role": mostly(st.just("tool"), ROLE), "content": CONTENT},
                                optional={"tool_call_id": mostly(IDS, st.one_of(st.just(""), JSON))})


@st.composite
def conversations(draw) -> list[dict]:
    """Turns that say something, and calls followed by answers to some of them in any order,
    each part possibly spoilt; and answers to nothing."""
    messages: list[dict] = []
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(["says", "asks"] * 3 + ["answers"]))
        if kind != "asks":
            messages.append(draw(SAYS if kind == "says" else ANSWERS))
            continue
        asks = draw(ASKS_ANY)
        messages.append(asks)
        calls = asks["tool_calls"] if isinstance(asks["tool_calls"], list) else []
        ids = draw(st.permutations([c.get("id") for c in calls if isinstance(c, dict)]))
        for call_id in ids[:draw(st.integers(0, len(ids)))]:
            answer = draw(ANSWERS)
            messages.append(answer | {"tool_call_id": draw(mostly(st.just(call_id), IDS))})
    return messages


@given(messages=conversations(), template=st.sampled_from([TOOLS_TEMPLATE] * 4 + [PLAIN_TEMPLATE, None]))
def test_any_messages_are_plain_messages_or_an_invalid_request(messages, template):
    try:
        decoded = decode(messages)
    except msgspec.ValidationError:
        event("refused while decoding")
        return  # a wrong type: the body's decoding answers that 400, before any handler runs
    try:
        plain, size = plain_messages(decoded, template)
    except InvalidRequest as e:
        assert e.param == "messages" and str(e).startswith("messages") and "\n" not in str(e)
        event(f"refused: {str(e).split(':')[0].split('.', 1)[-1]}")
        return
    calls, answers = sum("tool_calls" in m for m in plain), sum(m["role"] == "tool" for m in plain)
    event(f"accepted, {calls} with calls, {answers} answers")  # pytest --hypothesis-show-statistics
    assert len(plain) == len(messages) and size >= sum(len(m["content"]) for m in plain)
    made: set[str] = set()
    for m in plain:
        assert m["role"] in ("system", "user", "assistant", "tool") and isinstance(m["content"], str)
        for c in m.get("tool_calls", ()):
            assert c["id"] and c["type"] == "function" and c["function"]["name"]
            assert isinstance(c["function"]["arguments"], dict)
            made.add(c["id"])
        assert (m["role"] == "tool") == ("tool_call_id" in m)
        assert m["role"] != "tool" or m["tool_call_id"] in made
    if template is not None:
        tokenizer(template).apply_chat_template(plain)  # accepted messages render


@given(kwargs=st.dictionaries(st.one_of(st.text(max_size=6), st.sampled_from(sorted(RESERVED_TEMPLATE_VARIABLES))),
                              JSON, max_size=4))
def test_any_template_kwargs_are_accepted_and_render_or_an_invalid_request(kwargs):
    try:
        extra, size = template_kwargs(kwargs)
    except InvalidRequest as e:
        assert e.param == "chat_template_kwargs" and str(e).startswith("chat_template_kwargs.")
        return
    assert not set(extra) & RESERVED_TEMPLATE_VARIABLES and size >= 0
    extra["tools"] = None  # as the server adds them: no TypeError, nothing of the server's replaced
    text = tokenizer(TOOLS_TEMPLATE).apply_chat_template([{"role": "user", "content": "hi"}], **extra)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
