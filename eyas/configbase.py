"""Strict dataclass configs, checked when a recipe loads.

Every stage owns a dataclass of its settings; this module fills one from a dict and refuses, in one line that
names the key path, whatever does not fit the schema the dataclass declares:
- an unknown key (naming the closest valid key) or a value of the wrong type;
- a value outside a `typing.Literal[...]` of choices (naming the valid ones and the closest);
- a number outside the range, or a string outside the pattern, that the field's metadata declares:
  `field(default=1, metadata={"min": 1})`. min/max (inclusive) and gt/lt (exclusive) bound a number, or each
  item of a list, or each value of a mapping; "pattern": (regex, "what it allows") must match a whole string;
  min_len/len bound a list's length;
- a section or list item that is not a mapping;
- what a dataclass's own `cross_check()` refuses, as a ValueError("key: why") (rules between fields);
- a key listed in the dataclass's `removed_keys` {key: why} (one that recipes used to carry).
Constructing a dataclass directly, in code or tests, checks nothing: the schema applies where values come in.
The config dataclasses live in the stage folders, below eyas/, so they declare rules as plain data.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import re
import types
import typing
from typing import Any


class ConfigError(ValueError):
    """A recipe or override that does not fit the schema."""


RULES = ("min", "max", "gt", "lt", "pattern", "min_len", "len")  # the metadata keys check_rules reads
# YAML 1.1 reads unquoted off/no (on/yes) as false (true). A choice field offering one of these words takes the
# boolean as that word, so the documented `linear_kernels: off` means what it says.
BOOL_WORDS = {False: ("off", "no"), True: ("on", "yes")}


def _closest(key: str, valid: list[str]) -> str:
    match = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    return f" (did you mean '{match[0]}'?)" if match else f" (valid keys: {', '.join(sorted(valid))})"


def _show(value: Any) -> str:
    return repr(value) if isinstance(value, str) else str(value)


def _choice(value: Any, choices: tuple, where: str) -> Any:
    if isinstance(value, bool):
        word = next((w for w in BOOL_WORDS[value] if w in choices), None)
        if word is not None:
            return word
    elif value in choices:
        return value
    hint, shown = "", _show(value)
    if isinstance(value, bool):
        shown = str(value).lower()
        hint = " (YAML reads unquoted on/off/yes/no as true/false)"
    elif isinstance(value, str):
        # A higher bar than for keys: short choices look alike by chance (wrap/drop, fast/auto score 0.5).
        match = difflib.get_close_matches(value, [str(c) for c in choices], n=1, cutoff=0.6)
        hint = f" (did you mean '{match[0]}'?)" if match else ""
    raise ConfigError(f"{where}: {shown} is not one of {', '.join(map(str, choices))}{hint}")


def _mapping(value: Any, where: str) -> dict:
    if value is None:  # an empty section (`train:` with every key commented out) keeps the defaults
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"{where or 'recipe'}: expected a mapping of keys, got {_show(value)}")
    return value


def _coerce(value: Any, annotation: Any, where: str) -> Any:
    """`value` as `annotation` describes it, or a ConfigError naming `where`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        first_error = None
        for option in (a for a in args if a is not type(None)):
            try:
                return _coerce(value, option, where)
            except ConfigError as exc:
                first_error = first_error or exc
        raise first_error
    if origin is typing.Literal:
        return _choice(value, args, where)
    if dataclasses.is_dataclass(annotation):
        return from_dict(annotation, value, where)
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where}: expected a list, got {_show(value)}")
        item = args[0] if args else Any
        return [_coerce(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        key_type, value_type = args or (Any, Any)
        return {_coerce(k, key_type, f"{where} (key)"): _coerce(v, value_type, f"{where}.{k}")
                for k, v in _mapping(value, where).items()}
    if annotation is float:
        if isinstance(value, str):  # YAML 1.1 reads 3e-4 (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                pass
        if not isinstance(value, (int, float)) or isinstance(value, bool):
            raise ConfigError(f"{where}: expected a number, got {_show(value)}")
        if not math.isfinite(value):
            raise ConfigError(f"{where}: expected a finite number, got {value}")
        return float(value)
    if annotation is int and (isinstance(value, bool) or not isinstance(value, int)):
        raise ConfigError(f"{where}: expected an integer, got {_show(value)}")
    if annotation in (str, bool) and not isinstance(value, annotation):
        raise ConfigError(f"{where}: expected {'a string' if annotation is str else 'true or false'}, "
                          f"got {_show(value)}")
    return value


def _bounds(rules: dict) -> str:
    words = {"min": ">=", "gt": ">", "max": "<=", "lt": "<"}
    return " and ".join(f"{words[k]} {rules[k]}" for k in ("min", "gt", "max", "lt") if k in rules)


def _check_one(value: Any, rules: dict, where: str) -> None:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if (("min" in rules and value < rules["min"]) or ("gt" in rules and value <= rules["gt"])
                or ("max" in rules and value > rules["max"]) or ("lt" in rules and value >= rules["lt"])):
            raise ConfigError(f"{where}: must be {_bounds(rules)}, got {value}")
    if isinstance(value, str) and "pattern" in rules:
        pattern, allowed = rules["pattern"]
        if not re.fullmatch(pattern, value):
            raise ConfigError(f"{where}: {value!r} is not {allowed}")


def check_rules(value: Any, rules: typing.Mapping, where: str) -> None:
    """Apply a field's rules (its metadata, see the module docstring) to its value; None (unset) passes."""
    if value is None or not rules:
        return
    if isinstance(value, (list, tuple)):
        if "len" in rules and len(value) != rules["len"]:
            raise ConfigError(f"{where}: expected {rules['len']} items, got {len(value)}")
        if "min_len" in rules and len(value) < rules["min_len"]:
            raise ConfigError(f"{where}: expected at least {rules['min_len']} item(s), got {len(value)}")
        for i, item in enumerate(value):
            _check_one(item, rules, f"{where}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_one(item, rules, f"{where}.{key}")
    else:
        _check_one(value, rules, where)


def from_dict(cls: type, data: Any, where: str = "") -> Any:
    """Build dataclass `cls` from the mapping `data`, checking every key against its schema."""
    data = _mapping(data, where)
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}
    removed = getattr(cls, "removed_keys", {})
    prefix = f"{where}." if where else ""
    kwargs = {}
    for key, value in data.items():
        if key in removed:
            raise ConfigError(f"{prefix}{key}: no longer a setting ({removed[key]}); delete it")
        if key not in fields:
            raise ConfigError(f"unknown key '{prefix}{key}'{_closest(str(key), list(fields))}")
        kwargs[key] = _coerce(value, hints[key], prefix + key)
        check_rules(kwargs[key], fields[key].metadata, prefix + key)
    obj = cls(**kwargs)
    if hasattr(obj, "cross_check"):
        try:
            obj.cross_check()
        except ValueError as exc:
            raise ConfigError(f"{prefix}{exc}") from None
    return obj


def to_dict(obj: Any) -> dict:
    return dataclasses.asdict(obj)
