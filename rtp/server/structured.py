"""The OpenAI API's (and vLLM's) structured-output fields -> one StructuredOutputs.

    response_format  {"type": "text"} | {"type": "json_object"}
                     | {"type": "json_schema", "json_schema": {"name", "schema", "strict"}}
    vLLM's extras    structured_outputs {json | json_object | regex | choice | grammar, and
                     grammar_syntax (lark | gbnf), whitespace_pattern}, and the older guided_json,
                     guided_regex, guided_choice, guided_grammar, guided_whitespace_pattern
    logit_bias       {"token id": bias}: ids arrive as JSON object keys, so as strings, each a
                     token id in canonical decimal

At most one form per request: two that disagree are a 400 naming the second, never a silent
pick. What the grammar backend cannot compile is a 400 too, raised where the server waits for
the compile (rtp/server/openai_api.py), before the request is queued.
"""

from __future__ import annotations

import re

import msgspec

from rtp.errors import InvalidRequest
from rtp.sampling_params import StructuredOutputs


def structured_outputs(body) -> tuple[StructuredOutputs | None, str | None]:
    """The request's structured output and the field that asked for it (to name in errors)."""
    found: list[tuple[str, StructuredOutputs]] = []
    fmt = getattr(body, "response_format", None)
    if fmt is not None:
        spec = _response_format(fmt)
        if spec is not None:
            found.append(("response_format", spec))
    extra = getattr(body, "structured_outputs", None)
    if extra is not None:
        if not isinstance(extra, dict):
            raise InvalidRequest("structured_outputs must be an object", "structured_outputs")
        known = {"json", "json_object", "regex", "choice", "grammar", "grammar_syntax", "whitespace_pattern"}
        unknown = set(extra) - known
        if unknown:
            raise InvalidRequest(f"structured_outputs has fields rtp does not take: {sorted(unknown)}",
                                 "structured_outputs")
        found.append(("structured_outputs", _spec(**{k: v for k, v in extra.items() if k in known})))
    for name, form in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                       ("guided_grammar", "grammar")):
        value = getattr(body, name, None)
        if value is not None:
            found.append((name, _spec(**{form: value})))
    if len(found) > 1:
        raise InvalidRequest(f"{found[1][0]} asks for a structured output as {found[0][0]} already does: give one",
                             found[1][0])
    whitespace = getattr(body, "guided_whitespace_pattern", None)
    if whitespace is not None:  # vLLM's: the whitespace a JSON output may hold between its tokens
        if not found or (found[0][1].json is None and not found[0][1].json_object):
            raise InvalidRequest("guided_whitespace_pattern applies to a JSON output (guided_json, response_format "
                                 "json_object or json_schema)", "guided_whitespace_pattern")
        if not isinstance(whitespace, str):
            raise InvalidRequest("guided_whitespace_pattern must be a string (a regex)", "guided_whitespace_pattern")
        found[0] = (found[0][0], msgspec.structs.replace(found[0][1], whitespace_pattern=whitespace))
    if not found:
        return None, None
    field, spec = found[0]
    try:
        spec.validate()
    except InvalidRequest as e:
        raise InvalidRequest(str(e), field) from None
    return spec, field


def _response_format(fmt) -> StructuredOutputs | None:
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise InvalidRequest("response_format must be an object with a type", "response_format")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputs(json_object=True)
    if kind == "json_schema":
        inner = fmt.get("json_schema")
        if not isinstance(inner, dict) or not isinstance(inner.get("schema", {}), dict):
            raise InvalidRequest("response_format.json_schema must be an object whose schema is a JSON Schema",
                                 "response_format")
        # OpenAI allows a json_schema without a schema: any JSON object then
        schema = inner.get("schema")
        return StructuredOutputs(json=schema) if schema else StructuredOutputs(json_object=True)
    raise InvalidRequest(f"response_format type {kind!r} is not one of text, json_object, json_schema",
                         "response_format")


def _spec(**form) -> StructuredOutputs:
    try:
        return StructuredOutputs(**form)
    except TypeError as e:
        raise InvalidRequest(f"structured output: {e}", "structured_outputs") from None


_TOKEN_ID = re.compile(r"0|[1-9][0-9]*", re.ASCII)


def logit_bias(value) -> dict[int, float] | None:
    """OpenAI's logit_bias (string token ids -> bias) as SamplingParams takes it."""
    if value is None or value == {}:
        return None
    if not isinstance(value, dict):
        raise InvalidRequest("logit_bias must map token ids to biases", "logit_bias")
    out = {}
    for key, bias in value.items():
        # a canonical decimal token id only: int() would also take "1_000", " 12 ", "٣" and merge "05" with "5"
        if not isinstance(key, str) or _TOKEN_ID.fullmatch(key) is None:
            raise InvalidRequest(f"logit_bias keys must be token ids written in decimal digits, got {key!r}",
                                 "logit_bias")
        if isinstance(bias, bool) or not isinstance(bias, (int, float)):
            raise InvalidRequest(f"logit_bias values must be numbers, got {bias!r}", "logit_bias")
        out[int(key)] = float(bias)
    return out
