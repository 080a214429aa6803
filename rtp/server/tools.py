"""A chat request's `tools` and `tool_choice` -> what the prompt, the grammar and the parser do.

    tool_choice   the prompt            the grammar                      the reply
    none          tools in the template  the request's own, if any        content only
    auto          tools in the template  the request's own, if any        parsed by --tool-call-parser
    required      tools in the template  a JSON array of {"name": one of  the array's calls
                                         the tools, "parameters": its
                                         schema}, at least one
    {"type": "function", "function": {"name": F}}
                  tools in the template  F's parameters schema            one call of F

`required` and a named function are enforced by the grammar, so their calls always parse and
their arguments always match the schema, whatever the model's own call format (vLLM does the
same). `auto` leaves the model free and reads its calls out of its text, which needs a parser
for the model's format; without `--tool-call-parser`, `auto` is a 400 that says so, as vLLM's
`--enable-auto-tool-choice` is. The template must know about tools (it reads `tools`): a
template that does not would drop them silently, so that too is a 400, naming --chat-template.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from rtp.errors import InvalidRequest
from rtp.sampling_params import StructuredOutputs
from rtp.server.tool_parsers import PARSERS, NamedCallParser, RequiredCallsParser


@dataclass
class ToolPlan:
    tools: list[dict]                       # for the template, as HF templates take them
    choice: str                             # none | auto | required | named
    function: str | None = None             # the named function
    grammar: StructuredOutputs | None = None
    parser: str | None = None               # --tool-call-parser, for auto

    def new_parser(self):
        """A parser for one choice's text, or None when the text is only content. It knows the
        functions offered: a call of any other is content."""
        if self.choice == "named":
            return NamedCallParser(self.function)
        functions = [tool["function"]["name"] for tool in self.tools]
        if self.choice == "required":
            return RequiredCallsParser(functions)
        if self.choice == "auto":
            return PARSERS[self.parser](functions)
        return None


def template_takes_tools(template: str | None) -> bool:
    return template is not None and re.search(r"\btools\b", template) is not None


def plan_tools(tools, tool_choice, parallel_tool_calls, *, parser: str | None, template: str | None,
               structured: bool) -> ToolPlan | None:
    """Check the request's tool fields; None when it has no tools. `structured`: the request asks
    for a structured output of its own (which `required` and a named choice would override)."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none"):
            raise InvalidRequest("tool_choice needs tools", "tool_choice")
        return None
    functions = _functions(tools)
    if not template_takes_tools(template):
        raise InvalidRequest("this model's chat template does not render tools; start the server with "
                             "--chat-template (e.g. --chat-template chatml-tools) to give it one", "tools")
    choice = "auto" if tool_choice is None else tool_choice
    named = None
    if isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        named = function.get("name") if isinstance(function, dict) else None
        if not isinstance(named, str):
            raise InvalidRequest('tool_choice must be none, auto, required or {"type": "function", '
                                 '"function": {"name": ...}}', "tool_choice")
        if named not in functions:
            raise InvalidRequest(f"tool_choice names {named!r}, which is not among the tools "
                                 f"({', '.join(functions)})", "tool_choice")
        choice = "named"
    elif choice not in ("none", "auto", "required"):
        raise InvalidRequest(f"tool_choice must be none, auto, required or a function, got {choice!r}",
                             "tool_choice")
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise InvalidRequest("parallel_tool_calls must be true or false", "parallel_tool_calls")
    if choice in ("required", "named") and structured:
        raise InvalidRequest(f"tool_choice {tool_choice!r} decides the reply's format, and so does the "
                             "request's structured output: give one", "tool_choice")
    if choice == "auto" and parser is None:
        raise InvalidRequest('tool_choice "auto" needs the server started with --tool-call-parser '
                             f"({', '.join(PARSERS)}); \"required\" or a named function work without one",
                             "tool_choice")
    plan = ToolPlan([{"type": "function", "function": f} for f in functions.values()], choice, named,
                    parser=parser)
    if choice == "named":
        plan.grammar = StructuredOutputs(json=_parameters(functions[named]))
    elif choice == "required":
        calls = [{"type": "object",
                  "properties": {"name": {"type": "string", "enum": [name]},
                                 "parameters": _parameters(f)},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, f in functions.items()]
        schema = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        if parallel_tool_calls is False:
            schema["maxItems"] = 1
        plan.grammar = StructuredOutputs(json=schema)
    return plan


def _functions(tools) -> dict[str, dict]:
    if not isinstance(tools, list):
        raise InvalidRequest("tools must be a list of functions", "tools")
    out: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function" or not isinstance(function, dict):
            raise InvalidRequest(f'tools[{i}] must be {{"type": "function", "function": {{...}}}}', "tools")
        name = function.get("name")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9_.\-]{1,64}", name):
            raise InvalidRequest(f"tools[{i}].function.name must be 1-64 letters, digits, _ . or -", "tools")
        if name in out:
            raise InvalidRequest(f"tools[{i}]: two functions are named {name!r}", "tools")
        parameters = function.get("parameters")
        if parameters is not None and not isinstance(parameters, dict):
            raise InvalidRequest(f"tools[{i}].function.parameters must be a JSON Schema object", "tools")
        out[name] = {k: v for k, v in function.items() if k in ("name", "description", "parameters", "strict")}
    return out


def _parameters(function: dict) -> dict:
    # no parameters: any object (OpenAI's default)
    return function.get("parameters") or {"type": "object"}
