"""Each option is declared once: a dataclass field whose `option(...)` metadata gives its help.

From that one declaration come the command-line flag (`--max-batch-tokens`), the environment
variable (`PERGOLA_MAX_BATCH_TOKENS`, which sets the flag's default, as TEI does), the type
conversion of config.pbtxt parameters and of environment values, and the options table of
docs/options.md (`pergola options --markdown`; tests/test_options.py checks that the page holds it).
Booleans accept true/false, 1/0, yes/no, on/off wherever they are read; a field that may be
unset is `X | None` and None means "not set".
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable
from dataclasses import MISSING, Field, field, fields
from typing import Any

ENV_PREFIX = "PERGOLA_"
BOOL_WORDS = {"true": True, "1": True, "yes": True, "on": True,
              "false": False, "0": False, "no": False, "off": False}
_SCALARS = {"int": int, "float": float, "str": str, "bool": bool}


def option(default: Any, help: str, *, choices: Iterable[str] | None = None, metavar: str | None = None,
           cli: bool = True, env: bool | None = None) -> Any:
    """A dataclass field declared as an option (default MISSING: required). cli=False: a field
    the program sets itself (the model folder, the instance's device), kept out of the flags and
    the table; unless env=True: a setting read only from its PERGOLA_* variable (in the table)."""
    metadata = {"help": help, "choices": tuple(choices) if choices else None, "metavar": metavar, "cli": cli,
                "env": cli if env is None else env}
    return field(metadata=metadata) if default is MISSING else field(default=default, metadata=metadata)


def declared(cls: type) -> list[Field]:
    """The fields of `cls` that are command-line options."""
    return [f for f in fields(cls) if f.metadata.get("cli", False)]


def environment_only(cls: type) -> list[Field]:
    """The fields of `cls` read only from the environment (no flag)."""
    return [f for f in fields(cls) if f.metadata.get("env") and not f.metadata.get("cli")]


def flag_name(f: Field) -> str:
    return "--" + f.name.replace("_", "-")


def env_name(f: Field) -> str:
    return ENV_PREFIX + f.name.upper()


def value_type(f: Field) -> tuple[type, bool]:
    """(scalar type, may be None) from the annotation, which is a string here ("int | None")."""
    text = f.type if isinstance(f.type, str) else getattr(f.type, "__name__", str(f.type))
    parts = [p.strip() for p in text.split("|")]
    optional = "None" in parts
    names = [p for p in parts if p != "None"]
    if len(names) != 1 or names[0] not in _SCALARS:
        raise TypeError(f"option {f.name}: unsupported type {text!r}")
    return _SCALARS[names[0]], optional


def parse_bool(raw: str, what: str) -> bool:
    try:
        return BOOL_WORDS[raw.strip().lower()]
    except KeyError:
        raise ValueError(f"{what} must be true or false (or 1/0, yes/no, on/off), got {raw!r}") from None


def convert(f: Field, raw: str, what: str | None = None) -> Any:
    """A string (config.pbtxt parameter, environment variable) as the field's type."""
    what = what or f.name
    kind, optional = value_type(f)
    if optional and raw == "":
        return None
    if kind is bool:
        return parse_bool(raw, what)
    try:
        return kind(raw)
    except ValueError:
        raise ValueError(f"{what} must be {kind.__name__}, got {raw!r}") from None


def default_of(f: Field) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:  # type: ignore[misc]
        return f.default_factory()  # type: ignore[misc]
    return None


def add_arguments(parser: argparse.ArgumentParser | Any, cls: type, title: str | None = None,
                  exclude: Iterable[str] = ()) -> None:
    """One flag per declared field of `cls` (but `exclude`: fields another group of the same
    command already declares); its environment variable, when set, is the default."""
    group = parser.add_argument_group(title) if title else parser
    for f in declared(cls):
        if f.name in exclude:
            continue
        kind, _ = value_type(f)
        default = default_of(f)
        env = os.environ.get(env_name(f))
        if env is not None:
            default = convert(f, env, env_name(f))
        help_text = f"{f.metadata['help']} [env {env_name(f)}; default: {default_text(f)}]"
        kwargs: dict[str, Any] = dict(dest=f.name, default=default, help=help_text.replace("%", "%%"))
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        else:
            kwargs["type"] = lambda raw, f=f: convert(f, raw, flag_name(f))
            kwargs["metavar"] = None if f.metadata["choices"] else metavar_of(f)
            if f.metadata["choices"]:
                kwargs["choices"] = f.metadata["choices"]
        group.add_argument(flag_name(f), **kwargs)


def metavar_of(f: Field) -> str:
    kind, _ = value_type(f)
    return f.metadata.get("metavar") or {"str": "TEXT"}.get(kind.__name__, kind.__name__.upper())


def values_from(args: argparse.Namespace, cls: type) -> dict[str, Any]:
    """The parsed values of `cls`'s declared fields (those the command has)."""
    return {f.name: getattr(args, f.name) for f in declared(cls) if hasattr(args, f.name)}


def default_text(f: Field) -> str:
    default = default_of(f)
    if default is None:
        return "not set"
    if isinstance(default, bool):
        return "true" if default else "false"
    return str(default)


def markdown_table(classes: Iterable[type], listed: Iterable[str] = ()) -> str:
    """The options table of docs/options.md: flag, environment variable, default, meaning; no row
    for the variables in `listed` (a flag declared by hand lists them)."""
    rows = ["| option | environment | default | |", "| --- | --- | --- | --- |"]
    listed = set(listed)  # a variable is listed once: where its flag declares it (PERGOLA_REPO, PERGOLA_API_KEY, ...)
    for cls in classes:
        for f in declared(cls) + environment_only(cls):
            if env_name(f) in listed or (not f.metadata["cli"] and f"`{env_name(f)}`" in "".join(rows)):
                continue
            listed.add(env_name(f))
            kind, _ = value_type(f)
            choices = f.metadata["choices"]
            flag = flag_name(f) if kind is not bool else f"{flag_name(f)}, --no-{flag_name(f)[2:]}"
            value = "|".join(choices) if choices else ("" if kind is bool else metavar_of(f))
            name = f"`{flag}{' ' + value if value else ''}`".replace("|", "\\|") if f.metadata["cli"] else "(no flag)"
            help_text = f.metadata["help"].replace("|", "\\|")
            rows.append(f"| {name} | `{env_name(f)}` | {default_text(f)} | {help_text} |")
    return "\n".join(rows)


def from_environment(cls: type) -> Any:
    """An instance of `cls` from its PERGOLA_* environment variables (defaults where unset)."""
    values = {}
    for f in declared(cls) + environment_only(cls):
        raw = os.environ.get(env_name(f))
        if raw is not None:
            values[f.name] = convert(f, raw, env_name(f))
    return cls(**values)


def to_environment(obj: Any) -> dict[str, str]:
    """The PERGOLA_* variables that give `obj`'s declared values (None left out), for a child
    process that reads them with from_environment."""
    out = {}
    for f in declared(type(obj)):
        value = getattr(obj, f.name)
        if value is not None:
            out[env_name(f)] = str(value).lower() if isinstance(value, bool) else str(value)
    return out
