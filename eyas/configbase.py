"""Strict dataclass configs: unknown keys are errors that name the closest valid key.

Every stage owns a dataclass of its settings; this module only knows how to fill one from a dict.
"""

from __future__ import annotations

import dataclasses
import difflib
import typing
from typing import Any


class ConfigError(ValueError):
    """A recipe or override that does not fit the schema."""


def _closest(key: str, valid: list[str]) -> str:
    match = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    return f" (did you mean '{match[0]}'?)" if match else f" (valid keys: {', '.join(sorted(valid))})"


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """Light type checking: catch `lr: "abc"` and `epochs: 2.5` early, leave complex types alone."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Union or (origin is not None and str(origin) == "<class 'types.UnionType'>"):
        if value is None and type(None) in args:
            return None
        non_none = [a for a in args if a is not type(None)]
        return _coerce(value, non_none[0], where) if len(non_none) == 1 else value
    if annotation is float and isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if annotation is int and isinstance(value, bool):
        raise ConfigError(f"{where}: expected an integer, got {value!r}")
    if annotation in (int, float, str, bool) and not isinstance(value, annotation):
        if annotation is float and isinstance(value, str):
            try:
                return float(value)
            except ValueError:
                pass
        raise ConfigError(f"{where}: expected {annotation.__name__}, got {value!r}")
    if (origin in (list, tuple)) and not isinstance(value, (list, tuple)):
        raise ConfigError(f"{where}: expected a list, got {value!r}")
    if origin is list and args and dataclasses.is_dataclass(args[0]):
        return [from_dict(args[0], item, f"{where}[{i}]") if isinstance(item, dict) else item
                for i, item in enumerate(value)]
    if dataclasses.is_dataclass(annotation) and isinstance(value, dict):
        return from_dict(annotation, value, where)
    return value


def from_dict(cls: type, data: dict | None, where: str = "") -> Any:
    """Build dataclass `cls` from `data`, refusing unknown keys."""
    data = dict(data or {})
    if not isinstance(data, dict):
        raise ConfigError(f"{where or cls.__name__}: expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    kwargs = {}
    for key, value in data.items():
        if key not in fields:
            raise ConfigError(f"unknown key '{where + '.' if where else ''}{key}'{_closest(key, list(fields))}")
        kwargs[key] = _coerce(value, hints[key], f"{where + '.' if where else ''}{key}")
    return cls(**kwargs)


def to_dict(obj: Any) -> dict:
    return dataclasses.asdict(obj)
