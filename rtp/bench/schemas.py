"""JSON Schemas for `rtp bench serve --dataset json-schema`: one per request, of varied shapes.

Each schema is an object of 3-6 fields drawn from: strings with a length window (long enough
that a document takes about as many tokens as an unconstrained reply), bounded integers and
numbers, enums, booleans, arrays of short strings or of enum values, nullable fields and a
nested object. Every one is strict (additionalProperties false, all fields required), as
OpenAI's structured outputs and pydantic models through `parse` send them. Field names are
drawn from a word list with the schema's index, so no two schemas are the same text and the
server's grammar cache does not hide a compile.
"""

from __future__ import annotations

import random

_WORDS = ("title", "summary", "author", "city", "country", "rating", "price", "count", "status", "tags",
          "notes", "owner", "color", "size", "weight", "score", "level", "kind", "source", "target",
          "reason", "answer", "comment", "category", "language", "version", "region", "priority")


def make_schema(index: int, seed: int = 0) -> dict:
    rng = random.Random(seed * 1_000_003 + index)
    names = rng.sample(_WORDS, rng.randint(3, 6))
    properties = {f"{name}_{index}" if k == 0 else name: _field(rng, depth=0)
                  for k, name in enumerate(names)}
    return _object(properties)


def _object(properties: dict) -> dict:
    return {"type": "object", "properties": properties, "required": list(properties),
            "additionalProperties": False}


def _field(rng: random.Random, depth: int) -> dict:
    kind = rng.choice(["text", "text", "integer", "number", "enum", "boolean", "array", "enum_array",
                       "nullable", "object" if depth == 0 else "text"])
    if kind == "text":
        low = rng.choice([10, 20, 40])
        return {"type": "string", "minLength": low, "maxLength": low + rng.choice([40, 80, 160])}
    if kind == "integer":
        low = rng.randint(-100, 100)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(1, 10_000)}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": rng.choice([1, 100, 1e6])}
    if kind == "enum":
        return {"type": "string", "enum": rng.sample(["low", "medium", "high", "red", "green", "blue", "yes",
                                                      "no", "open", "closed"], rng.randint(2, 5))}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "array":
        return {"type": "array", "minItems": 1, "maxItems": rng.randint(2, 5),
                "items": {"type": "string", "minLength": 3, "maxLength": 30}}
    if kind == "enum_array":
        return {"type": "array", "maxItems": 4, "items": {"enum": ["a", "b", "c", "d"]}}
    if kind == "nullable":
        return {"anyOf": [{"type": "string", "maxLength": 40}, {"type": "null"}]}
    inner = rng.sample(_WORDS, rng.randint(2, 3))
    return _object({name: _field(rng, depth + 1) for name in inner})
