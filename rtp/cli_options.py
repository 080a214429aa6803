"""Command-line options generated from the config structs (rtp/config.py).

Each config field becomes one flag: its flat name in kebab case (or the `flag` its Meta
names), its type, default and help text from the field itself. `rtp generate` and
`rtp serve` add the same engine options this way, differing only in the defaults a
command overrides, so the commands and the offline API `LLM(**flat)` cannot drift;
`rtp serve`'s own options (ServeConfig) and `rtp route`'s (RouteConfig) come the same way.
"""

from __future__ import annotations

import argparse
import functools
import types
import typing
from collections.abc import Iterable
from typing import Any

import msgspec

from rtp.config import SUB_CONFIGS, EngineConfig, RouteConfig, ServeConfig, field_meta, flat_names, struct_fields


def byte_size(text: str) -> int:
    """A byte count: a plain integer or one with a unit (512MiB, 2GiB, 4GB, 100k)."""
    units = {"": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2, "mib": 1024**2,
             "g": 1000**3, "gb": 1000**3, "gib": 1024**3}
    number = text.rstrip("kKmMgGiIbB")
    unit = text[len(number):].lower()
    try:
        value = int(float(number) * units[unit])
    except (KeyError, ValueError):
        raise argparse.ArgumentTypeError(f"not a byte size: {text!r} (examples: 1048576, 512MiB, 2GiB)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be positive: {text!r}")
    return value


def add_engine_options(parser: argparse.ArgumentParser, defaults: dict[str, Any] | None = None,
                       parts: Iterable[str] = tuple(SUB_CONFIGS)) -> None:
    """One flag per field of the engine's sub-configs (`parts` of them), grouped by sub-config."""
    names = {(part, field): flat for flat, (part, field) in flat_names().items()}
    for part in parts:
        cls = SUB_CONFIGS[part]
        group = parser.add_argument_group(f"{part} options", _first_line(cls.__doc__))
        for field in cls.__struct_fields__:
            _add(group, cls, field, names[part, field], defaults or {})


def number_or_word(text: str) -> float | str:
    """A number, or a word the option knows (beta: auto); the config's validate() says which words."""
    try:
        return float(text)
    except ValueError:
        return text


def add_serve_options(parser: argparse.ArgumentParser) -> None:
    _add_struct(parser, "server options", ServeConfig)


def add_route_options(parser: argparse.ArgumentParser) -> None:
    _add_struct(parser, "router options", RouteConfig)


def engine_config(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig.from_flat(**{name: getattr(args, name) for name in flat_names()})


def serve_config(args: argparse.Namespace) -> ServeConfig:
    return _struct(ServeConfig, args)


def route_config(args: argparse.Namespace) -> RouteConfig:
    return _struct(RouteConfig, args)


def _add_struct(parser: argparse.ArgumentParser, title: str, cls: type) -> None:
    """One flag per field of a command's own options struct, named as the field."""
    group = parser.add_argument_group(title, _first_line(cls.__doc__))
    for field in cls.__struct_fields__:
        _add(group, cls, field, field, {})


def _struct(cls: type, args: argparse.Namespace):
    config = cls(**{name: getattr(args, name) for name in cls.__struct_fields__})
    config.validate()
    return config


_PARSERS = {"bytes": byte_size, "number_or_word": number_or_word}


def _add(group, cls: type, field: str, flat: str, defaults: dict[str, Any]) -> None:
    meta = field_meta(cls, field)
    extra = dict((meta.extra or {}) if meta is not None else {})
    default = defaults.get(flat, _default(cls, field))
    kind = _base_type(_type_hints(cls)[field])
    flags = [extra.get("flag") or "--" + flat.replace("_", "-"), *extra.get("aliases", ())]
    text = (meta.description if meta is not None and meta.description else "").replace("%", "%%")
    kw: dict[str, Any] = {"dest": flat, "default": default}
    if kind is bool:
        kw["action"] = argparse.BooleanOptionalAction if extra.get("negatable") else "store_true"
        if extra.get("negatable") and default is not None:
            text += f" (default {'on' if default else 'off'})"
    else:
        kw["type"] = _PARSERS[extra["parse"]] if "parse" in extra else kind
        for key in ("choices", "nargs", "metavar"):
            if key in extra:
                kw[key] = extra[key]
        if default is not None and default != []:
            text += f" (default {default})"
    group.add_argument(*flags, help=text, **kw)


def _default(cls: type, field: str):
    info = struct_fields(cls)[field]
    return info.default_factory() if info.default is msgspec.NODEFAULT else info.default


@functools.cache
def _type_hints(cls: type) -> dict:
    return typing.get_type_hints(cls)


def _base_type(hint) -> type:
    """int from `int`, `int | None`, `Optional[int]`; list fields take their item type (nargs)."""
    args = typing.get_args(hint)
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        hint = next(a for a in args if a is not type(None))
    origin = typing.get_origin(hint)
    if origin is list:
        return typing.get_args(hint)[0]
    return hint


def _first_line(doc: str | None) -> str:
    return (doc or "").strip().split("\n\n")[0].replace("\n", " ").replace("%", "%%")
