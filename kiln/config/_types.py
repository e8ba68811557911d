"""Checking a config value against a type annotation, with messages a user can act on."""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any, Literal, Union


from kiln.errors import ConfigError, did_you_mean  # ConfigError re-exported: kiln.config.ConfigError


def type_name(tp: Any) -> str:
    """Readable name of an annotation: ``int``, ``float or None``, ``one of 'a', 'b'``."""
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        args = typing.get_args(tp)
        names = [type_name(a) for a in args if a is not type(None)]
        if type(None) in args:
            names.append("None")
        return " or ".join(names)
    if origin in (tuple, list):
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        return f"list of {type_name(args[0])}" if args else "list"
    if tp is type(None):
        return "None"
    return getattr(tp, "__name__", str(tp))


def coerce(value: Any, tp: Any, key: str) -> Any:
    """Return ``value`` converted to ``tp`` where that is lossless (int -> float, list ->
    tuple), or raise ConfigError naming ``key`` and the expected type."""
    if tp is Any or tp is typing.Any:
        return value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return coerce_dataclass(value, tp, key)
    origin = typing.get_origin(tp)
    if origin is Literal:
        if value in typing.get_args(tp) and type(value) is type(_match(value, tp)):
            return value
        options = [str(a) for a in typing.get_args(tp)]
        raise ConfigError(f"{key}={value!r} is not allowed{did_you_mean(value, options)} (expected {type_name(tp)})")
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            try:
                return coerce(value, arg, key)
            except ConfigError:
                continue
        raise ConfigError(f"{key}={value!r} has the wrong type; expected {type_name(tp)}")
    if tp is type(None):
        if value is None:
            return None
        raise ConfigError(f"{key}={value!r}: expected None")
    if origin in (tuple, list) or tp in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{key}={value!r} has the wrong type; expected {type_name(tp)}")
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        if origin is tuple and args and Ellipsis not in typing.get_args(tp) and len(args) != len(value):
            raise ConfigError(f"{key}={list(value)!r}: expected a list of {len(args)} values")
        items = [coerce(v, args[min(i, len(args) - 1)], f"{key}[{i}]") if args else v for i, v in enumerate(value)]
        return tuple(items) if (origin is tuple or tp is tuple) else items
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is str:
        if isinstance(value, str):
            return value
    elif tp is dict:
        if isinstance(value, dict):
            return value
    elif isinstance(tp, type):
        if isinstance(value, tp):
            return value
    else:
        return value  # an annotation we do not check (a string forward reference, say)
    raise ConfigError(
        f"{key}={value!r} has the wrong type ({type(value).__name__}); expected {type_name(tp)}"
    )


def coerce_dataclass(value: Any, cls: type, key: str) -> dict[str, Any]:
    """A dict of ``cls``'s fields: defaults, updated with ``value``'s keys after checking each
    key exists and each value has the field's type."""
    if not isinstance(value, dict):
        raise ConfigError(f"{key}={value!r} must be a group of keys ({', '.join(f.name for f in dataclasses.fields(cls))})")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    out = dataclasses.asdict(cls())
    for name, item in value.items():
        if name not in hints:
            hint = did_you_mean(name, names, prefix=f"{key}.", quote=False)
            raise ConfigError(f"unknown key {key}.{name}{hint} (valid keys: {', '.join(names)})")
        out[name] = coerce(item, hints[name], f"{key}.{name}")
    return out


def _match(value: Any, literal: Any) -> Any:
    # Literal[1] must not accept True (True == 1 in Python); compare the exact member.
    for a in typing.get_args(literal):
        if a == value and type(a) is type(value):
            return a
    return object()
