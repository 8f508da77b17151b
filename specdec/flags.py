"""Command-line flags built from config dataclasses: one source for names, defaults and help.

Every service config declares its fields with `option(...)`, which keeps the help text (and
choices, aliases, a flag name) in the field's metadata. `add_flags` turns the fields into
argparse flags, `from_args` turns parsed flags back into the config, and `to_argv` writes a
config as the flags a child process parses back into the same config. `specdec serve`, the
standalone gateway and both model services all build their command lines this way, so a
default or a flag cannot exist in one place and be missing or different in another.

A field declared `advanced=True` (a tuning knob, a diagnostic switch) is listed in `--help`
after the everyday flags, in an "advanced" group, so the flags a user reaches for come first.
"""

from __future__ import annotations

import argparse
import dataclasses
import inspect
import typing
from collections.abc import Iterable, Mapping
from typing import Any, TypeVar

T = TypeVar("T")
C = TypeVar("C")


def option(
    default: T,
    help: str,
    *,
    choices: Iterable[Any] | None = None,
    aliases: Iterable[str] = (),
    flag: str = "",
    advanced: bool = False,
) -> T:
    """A config field with its command-line help. `flag` renames the flag (default: the field
    name with dashes); `aliases` are extra spellings, offered only on unprefixed flags;
    `advanced` lists it in the "advanced" group of `--help`."""
    metadata = {
        "help": help, "choices": list(choices) if choices is not None else None, "aliases": tuple(aliases),
        "flag": flag, "advanced": advanced,
    }
    return typing.cast(T, dataclasses.field(default=default, metadata=metadata))


def inherit(
    base: type, name: str, default: Any = dataclasses.MISSING, *, advanced: bool | None = None, help: str = "",
) -> Any:
    """Redeclare a base config field in a subclass, keeping its choices (and its help, unless
    `help` replaces it): with a new default, or (`advanced`) listed in another group of `--help`."""
    original = next(f for f in dataclasses.fields(base) if f.name == name)
    metadata = dict(original.metadata)
    if advanced is not None:
        metadata["advanced"] = advanced
    if help:
        metadata["help"] = help
    return dataclasses.field(default=original.default if default is dataclasses.MISSING else default, metadata=metadata)


def is_advanced(field: dataclasses.Field[Any]) -> bool:
    """Whether the field's flag belongs in the "advanced" group of `--help`."""
    return bool(field.metadata.get("advanced", False))


_METAVARS = {int: "N", float: "X", str: "TEXT"}


def _dest(prefix: str, name: str) -> str:
    return (prefix + name).replace("-", "_")


def _shown(value: object) -> str:
    return repr(value) if value == "" else str(value)


def add_flags(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup,
    cls: type,
    *,
    advanced: argparse._ArgumentGroup | None = None,
    prefix: str = "",
    skip: Iterable[str] = (),
    demote: Iterable[str] = (),
    defaults: Mapping[str, Any] | None = None,
    helps: Mapping[str, str] | None = None,
) -> None:
    """One `--<prefix><field>` flag per field of `cls` except `skip`.

    Everyday flags go to `parser`; advanced ones (the field's marker, or named in `demote` for
    this command line) to `advanced`, by default a group "advanced options" of `parser` (the
    advanced flags of a group `parser` stay in it). `defaults` and `helps` override a field's
    default and help for this command line only (e.g. `specdec serve` defaults the draft model
    to the target's).
    """
    hints = typing.get_type_hints(cls)
    defaults, helps, skipped, demoted = dict(defaults or {}), dict(helps or {}), set(skip), set(demote)
    for field in _own_fields_first(cls):
        if field.name in skipped:
            continue
        meta = field.metadata
        if "help" not in meta:
            raise TypeError(f"{cls.__name__}.{field.name} has no help: declare it with specdec.flags.option")
        container = parser
        if is_advanced(field) or field.name in demoted:
            if advanced is None and isinstance(parser, argparse.ArgumentParser):
                advanced = parser.add_argument_group("advanced options")
            container = advanced or parser
        _add_flag(container, field, hints[field.name], prefix, defaults.get(field.name, field.default), helps)


def _own_fields_first(cls: type) -> list[dataclasses.Field[Any]]:
    """The fields of `cls`, those its mixins declare (TLS settings, thread placement) after its
    own, so `--help` opens with what the service is about."""
    bases = [base for base in cls.__mro__ if dataclasses.is_dataclass(base)]

    def declared_by(field: dataclasses.Field[Any]) -> int:
        return max(i for i, base in enumerate(bases) if field.name in inspect.get_annotations(base))

    return sorted(dataclasses.fields(cls), key=declared_by)


def _add_flag(
    container: argparse.ArgumentParser | argparse._ArgumentGroup,
    field: dataclasses.Field[Any],
    kind: Any,
    prefix: str,
    default: Any,
    helps: Mapping[str, str],
) -> None:
    meta = field.metadata
    names = [f"--{prefix}{meta['flag'] or field.name.replace('_', '-')}"]
    if not prefix:
        names += list(meta["aliases"])
    text = f"{helps.get(field.name, meta['help'])} (default: {_shown(default)})"
    dest = _dest(prefix, field.name)
    if kind is bool:
        container.add_argument(*names, dest=dest, action=argparse.BooleanOptionalAction, default=default, help=text)
    else:
        metavar = None if meta["choices"] else _METAVARS.get(kind, "VALUE")
        container.add_argument(
            *names, dest=dest, type=kind, default=default, choices=meta["choices"], metavar=metavar, help=text,
        )


def from_args(cls: type[C], args: argparse.Namespace, *, prefix: str = "", **values: Any) -> C:
    """The config the parsed flags describe; `values` set fields that have no flag here."""
    for field in dataclasses.fields(cls):  # type: ignore[arg-type]
        if field.name not in values:
            values[field.name] = getattr(args, _dest(prefix, field.name))
    return cls(**values)


def to_argv(config: object, *, skip: Iterable[str] = ()) -> list[str]:
    """The flags that make a child process's `from_args` rebuild `config` (fields that differ
    from the class default only, so the child's log shows what was chosen)."""
    hints = typing.get_type_hints(type(config))
    argv: list[str] = []
    skipped = set(skip)
    for field in dataclasses.fields(config):  # type: ignore[arg-type]
        value = getattr(config, field.name)
        if field.name in skipped or value == field.default:
            continue
        flag = f"--{field.metadata['flag'] or field.name.replace('_', '-')}"
        if hints[field.name] is bool:
            argv.append(flag if value else f"--no-{flag[2:]}")
        else:
            argv += [flag, str(value)]
    return argv


def parse_config(cls: type[C], argv: Iterable[str]) -> C:
    """The config a service builds from `argv` (its own flags, plus the `--log-level` every
    service takes): how a launcher knows what a child will run before starting it."""
    parser = argparse.ArgumentParser(prog=cls.__name__, add_help=False)
    add_flags(parser, cls)
    parser.add_argument("--log-level")
    return from_args(cls, parser.parse_args(list(argv)))
