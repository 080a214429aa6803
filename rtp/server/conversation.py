"""A chat request's `messages` and `chat_template_kwargs` -> what the chat template renders.

Every refusal is an InvalidRequest that names the message and the field, in one sentence:
`messages[3].tool_call_id: 'call_9' matches no call an earlier assistant message made`.

    role          system, user, assistant, tool or developer (developer: see `_ROLES`)
    content       a string, null, or a list of text parts (joined with newlines)
    name          a string
    tool_calls    an assistant's only; each with a unique non-empty string id, type "function"
                  (or none), a function with a non-empty name, and arguments that are a JSON
                  object (an object, or a string holding one; "" or none mean {}) nested at
                  most _MAX_DEPTH levels
    tool_call_id  a tool message's, and only its: the id of a call an earlier assistant
                  message made and no tool message has answered yet
    reasoning_content  an assistant's only, a string: its thinking, as a reply with
                  --reasoning-parser gave it (clients send replies back as they got them);
                  templates that keep thinking in the history read it (Qwen3's keeps the
                  thinking of the turns after the last user message), others leave it out

An id is answered once: a second answer to the same call could not be told apart from the
first. An assistant message that reuses an id (clients that number calls 0, 1, ... per turn)
opens it again. A call left unanswered is accepted: templates render it, and histories cut
to fit a context window often end that way. Turn order (alternation, a system turn first) is
the template's to enforce: it raises, and the caller answers a 400 for it.

`chat_template_kwargs` reach the template as variables. Names the server already gives the
template (`RESERVED_TEMPLATE_VARIABLES`) are refused: passed on, they were a TypeError
(`messages`, `tokenize`: arguments of Tokenizer.apply_chat_template) or silently replaced
what the server set (`bos_token`, `tools`, `raise_exception`, ...).
"""

from __future__ import annotations

import inspect
import math
import re
from functools import lru_cache
from typing import Any

import msgspec
from jinja2.defaults import DEFAULT_NAMESPACE

from rtp.checkpoint.tokenizer import Tokenizer
from rtp.errors import InvalidRequest
from rtp.server.protocol import ChatMessage, TextPart

# OpenAI's `developer` role is its newer name for `system` ("developer messages replace system
# messages" for its reasoning models). Open-weights templates mostly know system, user,
# assistant and tool only: given `developer` as is, Llama 3 and Mistral templates raise, and
# ChatML ones write `<|im_start|>developer`, a turn the model never saw in training. So it
# reaches the template as `system`, the role that means the same, unless the template names
# the developer role itself (gpt-oss's harmony template does): then it is left as it is.
_ROLES = ("system", "user", "assistant", "tool", "developer")

# arguments and template values nest at most this deep: decoding raises RecursionError (not a
# DecodeError) past ~1000 levels, and the template's tojson, deep inside a render, runs out sooner
_MAX_DEPTH = 64

# Template variables the server sets itself, by where they are set:
#   Tokenizer.apply_chat_template's parameters   self, messages, add_generation_prompt, tokenize
#   the variables it passes to render             bos_token, eos_token, pad_token, unk_token
#   tokenizer._compile_template's globals         raise_exception, strftime_now
#   jinja2's default globals                      range, dict, lipsum, cycler, joiner, namespace
#   OpenAIServing._chat_prompt                    tools (the checked `tools` of the request)
# tokenizer.py keeps the second and third groups inside functions, so they are written out
# here; tests/server/test_conversation.py checks them against a render.
RESERVED_TEMPLATE_VARIABLES = frozenset(
    [name for name, p in inspect.signature(Tokenizer.apply_chat_template).parameters.items()
     if p.kind is not inspect.Parameter.VAR_KEYWORD]
    + ["bos_token", "eos_token", "pad_token", "unk_token", "raise_exception", "strftime_now", "tools"]
    + list(DEFAULT_NAMESPACE))


def plain_messages(messages: list[ChatMessage], template: str | None) -> tuple[list[dict], int]:
    """The messages as the chat template reads them, checked, and their size in characters.

    `template` is the chat template's source (to know whether it renders tool calls and the
    developer role). The size counts content, names, ids and arguments: what rendering costs.
    """
    if not messages:
        raise InvalidRequest("messages is empty", "messages")
    plain: list[dict] = []
    size = 0
    open_calls: dict[str, int] = {}  # id -> index of the assistant message that made the call
    answered: dict[str, int] = {}    # id -> index of the tool message that answered it
    for i, m in enumerate(messages):
        role = _role(i, m.role, template)
        content = _content(i, m.content)
        message: dict[str, Any] = {"role": role, "content": content}
        size += len(content)
        if m.name is not None:
            if not isinstance(m.name, str):
                _refuse(i, "name", "must be a string")
            message["name"] = m.name
            size += len(m.name)
        if m.tool_calls is not None and m.tool_calls != []:  # [] is what some clients send for none
            calls, calls_size = _tool_calls(i, m.role, m.tool_calls, template)
            message["tool_calls"] = calls
            size += calls_size
            for call in calls:
                open_calls[call["id"]] = i
                answered.pop(call["id"], None)
        if m.role == "tool":
            call_id = m.tool_call_id
            if not isinstance(call_id, str) or not call_id:
                _refuse(i, "tool_call_id", "a tool message needs the id of the call it answers")
            if call_id in answered:
                _refuse(i, "tool_call_id", f"{_show(call_id)} was already answered by messages[{answered[call_id]}]")
            if open_calls.pop(call_id, None) is None:
                _refuse(i, "tool_call_id", f"{_show(call_id)} matches no call an earlier assistant message made")
            answered[call_id] = i
            message["tool_call_id"] = call_id
            size += len(call_id)
        elif m.tool_call_id is not None:
            _refuse(i, "tool_call_id", "only a tool message answers a call")
        if m.reasoning_content is not None:
            if m.role != "assistant":
                _refuse(i, "reasoning_content", "only an assistant's message has thinking")
            if not isinstance(m.reasoning_content, str):
                _refuse(i, "reasoning_content", "must be a string")
            message["reasoning_content"] = m.reasoning_content
            size += len(m.reasoning_content)
        plain.append(message)
    return plain, size


def template_kwargs(kwargs: dict | None) -> tuple[dict[str, Any], int]:
    """`chat_template_kwargs` checked (new names only, values plain JSON), and their size.

    Returns a copy, for the caller to add `tools` to, and about how many characters the values
    write (documents can be long): to add to the messages' size.
    """
    if kwargs is None:
        return {}, 0
    size = 0
    if not isinstance(kwargs, dict):
        raise InvalidRequest("chat_template_kwargs: must be an object of template variables", "chat_template_kwargs")
    for name, value in kwargs.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise InvalidRequest(f"chat_template_kwargs.{_show(name)}: is not a name a template can read "
                                 "(letters, digits and _, not starting with a digit)", "chat_template_kwargs")
        if name in RESERVED_TEMPLATE_VARIABLES:
            raise InvalidRequest(f"chat_template_kwargs.{name}: the server sets this template variable itself "
                                 f"(it sets {', '.join(sorted(RESERVED_TEMPLATE_VARIABLES))})",
                                 "chat_template_kwargs")
        problem, walked = _json_walk(value)
        if problem is not None:
            raise InvalidRequest(f"chat_template_kwargs.{name}: {problem}", "chat_template_kwargs")
        size += walked
    return dict(kwargs), size


# -- one field each ---------------------------------------------------------------------------


def _role(i: int, role, template: str | None) -> str:
    if not isinstance(role, str) or role not in _ROLES:
        _refuse(i, "role", f"{_show(role)} is not one of {', '.join(_ROLES)}")
    if role == "developer" and not _renders_developer(template):
        return "system"
    return role


@lru_cache(maxsize=8)
def _renders_developer(template: str | None) -> bool:
    return template is not None and re.search(r"""["']developer["']""", template) is not None


def _content(i: int, content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        _refuse(i, "content", "must be a string, a list of text parts or null")
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, TextPart):
            _refuse(i, f"content[{j}]", 'must be a part like {"type": "text", "text": ...}')
        if part.type != "text":
            _refuse(i, f"content[{j}].type", f"only text parts are supported, not {_show(part.type)}")
        if not isinstance(part.text, str):
            _refuse(i, f"content[{j}].text", "a text part needs its text")
        texts.append(part.text)
    return "\n".join(texts)


def _tool_calls(i: int, role: str, calls, template: str | None) -> tuple[list[dict], int]:
    """An assistant's calls as templates read them: arguments as an object (the API sends a JSON
    string; HF templates write `arguments | tojson`), and their size."""
    if role != "assistant":
        _refuse(i, "tool_calls", "only an assistant's message makes calls")
    if "tool_calls" not in (template or ""):
        # the template would drop them without a word: the model would never see its calls
        _refuse(i, "tool_calls", "this model's chat template does not render tool calls; start the server "
                "with --chat-template (e.g. chatml-tools)")
    if not isinstance(calls, list):
        _refuse(i, "tool_calls", "must be a list of calls")
    out, size, ids = [], 0, {}
    for j, call in enumerate(calls):
        field = f"tool_calls[{j}]"
        if not isinstance(call, dict):
            _refuse(i, field, "must be an object with an id, a type and a function")
        call_id = call.get("id")
        if not isinstance(call_id, str) or not call_id:
            _refuse(i, f"{field}.id", "must be a non-empty string")
        if call_id in ids:
            _refuse(i, f"{field}.id", f"{_show(call_id)} is also the id of tool_calls[{ids[call_id]}]")
        ids[call_id] = j
        kind = call.get("type", "function")  # absent: OpenAI's only type
        if kind != "function":
            _refuse(i, f"{field}.type", f'must be "function", not {_show(kind)}')
        function = call.get("function")
        if not isinstance(function, dict):
            _refuse(i, f"{field}.function", "must be an object with a name and arguments")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            _refuse(i, f"{field}.function.name", "must be a non-empty string")
        arguments, arguments_size = _arguments(i, f"{field}.function.arguments", function.get("arguments", "{}"))
        out.append({"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}})
        size += len(call_id) + len(name) + arguments_size
    return out, size


def _arguments(i: int, field: str, arguments) -> tuple[dict, int]:
    if isinstance(arguments, str):
        size = len(arguments)
        if not arguments.strip():
            return {}, size  # some clients send "" for a call without arguments
        try:
            arguments = msgspec.json.decode(arguments)  # strict JSON: no NaN, unlike json.loads
        except (msgspec.DecodeError, UnicodeEncodeError):  # lone surrogates: not from a JSON body
            _refuse(i, field, "the string is not valid JSON")
        except RecursionError:
            _refuse(i, field, f"nests deeper than {_MAX_DEPTH} levels")
    else:
        size = None
    if not isinstance(arguments, dict):
        _refuse(i, field, f"must be a JSON object or a string holding one, not {_json_kind(arguments)}")
    problem, walked = _json_walk(arguments)
    if problem is not None:
        _refuse(i, field, problem)
    return arguments, walked if size is None else size


# -- helpers ------------------------------------------------------------------------------------


def _refuse(i: int, field: str, why: str):
    raise InvalidRequest(f"messages[{i}].{field}: {why}", "messages")


def _show(value, limit: int = 40) -> str:
    """A client's value for an error message, cut short: the message must not cost more than it."""
    if not isinstance(value, str):
        return _json_kind(value)  # repr of a client's list or int could be as long as the body
    return repr(value) if len(value) <= limit else repr(value[:limit]) + "..."


def _json_kind(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return {str: "a string", list: "a list", dict: "an object"}.get(type(value), type(value).__name__)


def _json_walk(value) -> tuple[str | None, int]:
    """Why `value` is not a plain JSON value nested at most _MAX_DEPTH deep (None when it is),
    and about how many characters it writes as JSON. Walked with a stack, not recursion: a
    value of any depth is answered, not a RecursionError."""
    stack, size = [(value, 1)], 0
    while stack:
        v, depth = stack.pop()
        if isinstance(v, str):
            size += len(v) + 2
        elif isinstance(v, (dict, list)):
            if depth > _MAX_DEPTH:
                return f"nests deeper than {_MAX_DEPTH} levels", size
            if isinstance(v, dict):
                if not all(isinstance(k, str) for k in v):
                    return "has a key that is not a string", size
                size += sum(len(k) + 4 for k in v)
                v = v.values()
            size += 2 + len(v)
            stack.extend((item, depth + 1) for item in v)
        elif isinstance(v, float) and not math.isfinite(v):
            return "holds a number JSON cannot write", size
        elif v is None or isinstance(v, (bool, int, float)):
            size += 5  # a short number, true, false or null: a count, not an exact size
        else:
            return f"holds a value of type {type(v).__name__}, which is not JSON", size
    return None, size
