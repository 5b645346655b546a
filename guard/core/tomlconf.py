"""Typed config from TOML: dataclasses built from tables, with errors that name the bad key.

Every config section is a `@dataclass(kw_only=True, slots=True)` whose `__post_init__`
validates values with `check()` / `check_choice()`; `from_dict()` rejects unknown keys and
wrong types and prefixes every message with the dotted key path (e.g. `model.n_experts`).

A table sets only the keys it names: the rest keep the enclosing section's default for that
field, not the bare class's (`[guard.loss_spike] budget = 1e-4` keeps GuardConfig's early_z and
ceilings for the loss; before 2026-11-24 it silently fell back to SpikeConfig's fixed-z rule).
TOML has no null: an optional key set to the string "none" is None (`budget = "none"` with a
`z` gives the fixed-z spike rule).
"""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

T = TypeVar("T")


class ConfigError(ValueError):
    """A config value is missing, unknown or out of range. The message names the key."""


def check(ok: bool, key: str, value: Any, why: str) -> None:
    if not ok:
        raise ConfigError(f"{key} = {value!r}: {why}")


def check_choice(key: str, value: Any, allowed: tuple[Any, ...] | list[Any]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key} = {value!r}: must be one of {', '.join(map(repr, allowed))}")


def load_toml(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {str(p)!r} does not exist")
    try:
        return tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{p}: not valid TOML: {e}") from None


def from_dict(cls: type[T], data: dict[str, Any] | None, prefix: str = "", base: T | None = None) -> T:
    """Build dataclass `cls` from a dict, recursing into nested dataclass fields. Keys the dict
    leaves out come from `base` when given, else from the class; a nested table starts from its
    field's default in the enclosing dataclass (so a partial table changes only what it names)."""
    data = dict(data or {})
    fields = {f.name: f for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    hints = typing.get_type_hints(cls)
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"[{prefix.rstrip('.')}]" if prefix else "the top level"
        raise ConfigError(
            f"unknown key '{prefix}{unknown[0]}' in {where}; allowed keys: {', '.join(sorted(fields))}"
        )
    kwargs: dict[str, Any] = {}
    for name, value in data.items():
        key = f"{prefix}{name}"
        nested = dataclasses.is_dataclass(hints[name]) and isinstance(value, dict)
        default = _field_default(fields[name], base) if nested else None  # built for tables only
        if default is not None:
            kwargs[name] = from_dict(hints[name], value, prefix=key + ".", base=default)
        else:
            kwargs[name] = _coerce(hints[name], value, key)
    try:
        return dataclasses.replace(base, **kwargs) if base is not None else cls(**kwargs)  # type: ignore[type-var]
    except ConfigError as e:
        if prefix and not str(e).startswith(prefix):
            raise ConfigError(f"{prefix}{e}") from None
        raise


def _field_default(f: dataclasses.Field[Any], base: Any) -> Any:
    """The value a field takes when the table leaves it out: `base`'s, else the field's default."""
    if base is not None:
        return getattr(base, f.name)
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


def _coerce(tp: Any, value: Any, key: str) -> Any:
    origin = typing.get_origin(tp)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a table, got {value!r}")
        return from_dict(tp, value, prefix=key + ".")
    if origin in (types.UnionType, typing.Union):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        optional = len(args) < len(typing.get_args(tp))
        if value is None or (
            optional and str not in args and isinstance(value, str) and value.lower() == "none"
        ):
            return None  # TOML has no null: "none" unsets an optional key
        errors = []
        for a in args:
            try:
                return _coerce(a, value, key)
            except ConfigError as e:
                errors.append(str(e))
        raise ConfigError(errors[0])
    if origin in (list, tuple):
        if not isinstance(value, list):
            raise ConfigError(f"{key} must be a list, got {value!r}")
        (inner,) = typing.get_args(tp)[:1] or (Any,)
        items = [_coerce(inner, v, f"{key}[{i}]") for i, v in enumerate(value)]
        return items if origin is list else tuple(items)
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{key} must be a table, got {value!r}")
        return dict(value)
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(f"{key} must be a number, got {value!r}")
        return float(value)
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{key} must be an integer, got {value!r}")
        return value
    if tp is bool:
        if not isinstance(value, bool):
            raise ConfigError(f"{key} must be true or false, got {value!r}")
        return value
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{key} must be a string, got {value!r}")
        return value
    return value


def to_dict(obj: Any) -> dict[str, Any]:
    """Dataclass -> plain dict (for meta.json and checkpoints)."""
    return dataclasses.asdict(obj)
