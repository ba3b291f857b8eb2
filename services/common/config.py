"""One config dataclass per service: field docs feed ``--help``; values come from flags,
then ``KVMESH_*`` environment variables, then a TOML file, then defaults.

A field is declared with :func:`option`, whose ``help`` becomes the flag's help text.
``load(cls, argv)`` builds the parser, merges the sources and calls ``validate()``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import re
import tomllib
import typing
from collections.abc import Mapping, Sequence
from typing import Any

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B?)?\s*$", re.IGNORECASE)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1e3,
    "kb": 1e3,
    "kib": 1 << 10,
    "m": 1e6,
    "mb": 1e6,
    "mib": 1 << 20,
    "g": 1e9,
    "gb": 1e9,
    "gib": 1 << 30,
    "t": 1e12,
    "tb": 1e12,
    "tib": 1 << 40,
}


class ConfigError(ValueError):
    """A configuration value is missing or invalid; the message says which and why."""


def option(default: Any, help: str, **kw: Any) -> Any:
    """A config field with its ``--help`` text."""
    if isinstance(default, (list, dict)):
        return dataclasses.field(
            default_factory=lambda: type(default)(default), metadata={"help": help, **kw}
        )
    return dataclasses.field(default=default, metadata={"help": help, **kw})


def parse_size(value: str | int) -> int:
    """``"64MiB"`` -> 67108864; plain integers are bytes."""
    if isinstance(value, int):
        return value
    m = _SIZE.match(str(value))
    if not m or (m.group(2) or "").lower() not in _UNITS:
        raise ConfigError(f"cannot read {value!r} as a size; write e.g. 512MiB, 2GiB or 1048576")
    return int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])


def available_memory() -> int:
    """Bytes of memory available to new allocations now (Linux MemAvailable)."""
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def parse_memory(value: str | int) -> int:
    """A size (``"2GiB"``) or a share of the memory available at start (``"40%"``)."""
    text = str(value).strip()
    if text.endswith("%"):
        try:
            pct = float(text[:-1])
        except ValueError:
            raise ConfigError(f"cannot read {value!r} as a percentage; write e.g. 40%") from None
        if not 0 < pct <= 90:
            raise ConfigError(f"{value!r}: a memory share must be in (0%, 90%]")
        return int(available_memory() * pct / 100)
    return parse_size(value)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _base_type(tp: Any) -> Any:
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return (
        args[0]
        if typing.get_origin(tp) in (typing.Union, getattr(__import__("types"), "UnionType", None))
        and args
        else tp
    )


def _coerce(name: str, tp: Any, raw: Any) -> Any:
    tp = _base_type(tp)
    try:
        if tp is bool:
            if isinstance(raw, bool):
                return raw
            s = str(raw).strip().lower()
            if s in ("1", "true", "yes", "on"):
                return True
            if s in ("0", "false", "no", "off"):
                return False
            raise ValueError(raw)
        if tp is int:
            return int(raw)
        if tp is float:
            value = float(raw)
            if not math.isfinite(value):  # NaN passes every range check
                raise ConfigError(f"{name}: {raw!r} is not a finite number")
            return value
        if typing.get_origin(tp) is list or tp is list:
            if isinstance(raw, list):
                return [str(x) for x in raw]
            return [s for s in str(raw).split(",") if s]
        return str(raw)
    except ConfigError:
        raise
    except (TypeError, ValueError):
        raise ConfigError(f"{name}: cannot read {raw!r} as {getattr(tp, '__name__', tp)}") from None


def env_name(f: dataclasses.Field) -> str:
    """The environment variable of config field ``f``: ``KVMESH_<NAME>``, unless the field
    names its own (``option(..., env=...)``, where ``KVMESH_<NAME>`` means something else)."""
    return f.metadata.get("env") or f"KVMESH_{f.name.upper()}"


def add_arguments(cls: type, parser: argparse.ArgumentParser) -> None:
    """Adds one flag per field of ``cls``; defaults stay unset so other sources can win."""
    parser.add_argument(
        "--config",
        dest="_config_file",
        default=None,
        help="TOML file with values for these options (flags and KVMESH_* win)",
    )
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            default = f.default_factory()
        else:
            default = None
        help_text = f"{f.metadata.get('help', '')} (default: {default!r}; env {env_name(f)})"
        help_text = help_text.replace("%", "%%")  # argparse formats help with %
        tp = _base_type(hints[f.name])
        if tp is bool:
            parser.add_argument(
                _flag(f.name),
                dest=f.name,
                default=None,
                action=argparse.BooleanOptionalAction,
                help=help_text,
            )
        else:
            parser.add_argument(
                _flag(f.name), dest=f.name, default=None, help=help_text, metavar=f.name.upper()
            )


def from_sources(
    cls: type,
    args: argparse.Namespace | None = None,
    env: Mapping[str, str] | None = None,
    section: str | None = None,
) -> Any:
    """Merges flags > env > TOML > defaults into ``cls`` and validates it."""
    env = os.environ if env is None else env
    args = args or argparse.Namespace()
    toml_values: dict[str, Any] = {}
    path = getattr(args, "_config_file", None) or env.get("KVMESH_CONFIG")
    if path:
        try:
            with open(path, "rb") as fh:
                data = tomllib.load(fh)
        except OSError as e:
            raise ConfigError(f"cannot read config file {path}: {e.strerror}") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError(f"config file {path} is not valid TOML: {e}") from None
        toml_values = {k: v for k, v in data.items() if not isinstance(v, dict)}
        if section and isinstance(data.get(section), dict):
            toml_values.update(data[section])
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = set(toml_values) - names
    if unknown:
        raise ConfigError(
            f"config file {path}: unknown option(s) {sorted(unknown)}; known: {sorted(names)}"
        )
    values: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        raw = getattr(args, f.name, None)
        if raw is None:
            raw = env.get(env_name(f))
        if raw is None:
            raw = toml_values.get(f.name)
        if raw is not None:
            values[f.name] = _coerce(f.name, hints[f.name], raw)
    cfg = cls(**values)
    validate = getattr(cfg, "validate", None)
    if validate:
        validate()
    return cfg


def load(
    cls: type,
    argv: Sequence[str] | None = None,
    prog: str | None = None,
    section: str | None = None,
    env: Mapping[str, str] | None = None,
) -> Any:
    """Parses ``argv`` for ``cls`` (``--help`` lists every field with its doc)."""
    parser = argparse.ArgumentParser(prog=prog, description=(cls.__doc__ or "").strip())
    add_arguments(cls, parser)
    return from_sources(cls, parser.parse_args(argv), env=env, section=section)
