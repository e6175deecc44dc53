"""The settings of ``pagedserve serve``: its flags, its ``--config`` file and the environment, merged.

Every ``EngineArgs`` and ``ServerArgs`` field is both a flag (``--max-model-len``)
and a key of the YAML file (``max_model_len:``); flags and help are generated
from the dataclass fields and their metadata (help, unit, choices). Precedence,
highest first: flags, the YAML file, ``PAGEDSERVE_API_KEY`` (for ``api_key``),
the dataclass defaults. ``ReplicaSettings`` fields are flags only.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any

import yaml

from pagedserve.engine import envs
from pagedserve.engine.config import EngineArgs
from pagedserve.server.app import ServerArgs
from pagedserve.server.config_table import SETTINGS_CLASSES, shown_default
from pagedserve.server.replicas.settings import ReplicaSettings


def _members(hint: Any) -> tuple[Any, ...]:
    """The types a field accepts: ``int | None`` -> ``(int, NoneType)``."""
    return typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)


def settings_fields() -> dict[str, tuple[dataclasses.Field, Any]]:
    """Every settable name -> (its dataclass field, its resolved type)."""
    fields = {}
    for cls in SETTINGS_CLASSES:
        hints = typing.get_type_hints(cls)
        fields |= {f.name: (f, hints[f.name]) for f in dataclasses.fields(cls)}
    return fields


def _flag_help(f: dataclasses.Field) -> str:
    unit = f.metadata.get("unit")
    text = f"{f.metadata['help']} " + (f"[{unit}] " if unit else "") + f"(default: {shown_default(f)})"
    return text.replace("%", "%%")  # argparse formats help with %


def _flag_options(hint: Any, f: dataclasses.Field) -> dict[str, Any]:
    """``argparse.add_argument`` options for a field of type ``hint``."""
    accepted = [t for t in _members(hint) if t is not types.NoneType]
    if bool in accepted:
        return {"action": argparse.BooleanOptionalAction}
    if typing.get_origin(accepted[0]) is list:
        return {"nargs": "*", "type": typing.get_args(accepted[0])[0]}
    # Sizes (int | str) stay text: the dataclass parses "2GiB" as well as "2147483648".
    kind = str if str in accepted else accepted[0]
    choices = f.metadata.get("choices")
    if choices:
        # argparse shows them as {a,b,c}; None (unset, the default) is no value a flag can spell.
        return {"type": kind, "choices": [c for c in choices if c is not None]}
    return {"type": kind, "metavar": (f.metadata.get("unit") or f.name).upper()}


def _add_flags(group: argparse._ArgumentGroup, cls: type) -> None:
    """A flag for each field of the dataclass ``cls``."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        # SUPPRESS leaves unset flags out of the namespace, so the YAML file can fill them.
        group.add_argument(f"--{f.name.replace('_', '-')}", dest=f.name, default=argparse.SUPPRESS,
                           help=_flag_help(f), **_flag_options(hints[f.name], f))


def add_settings_flags(parser: argparse.ArgumentParser) -> None:
    """A flag for every ``EngineArgs``, ``ServerArgs`` and ``ReplicaSettings`` field, in three groups."""
    for title, cls in zip(("engine", "server"), SETTINGS_CLASSES, strict=True):
        _add_flags(parser.add_argument_group(f"{title} settings (also YAML keys)"), cls)
    _add_flags(parser.add_argument_group("replica settings (Ray Serve, docs/replicas.md; flags only)"),
               ReplicaSettings)


def _accepts(kind: Any, value: Any) -> bool:
    """Whether a YAML value has type ``kind`` (bools are not numbers here, ints are floats)."""
    if kind is types.NoneType:
        return value is None
    if typing.get_origin(kind) is list:
        return isinstance(value, list) and all(_accepts(typing.get_args(kind)[0], v) for v in value)
    if kind in (int, float) and isinstance(value, bool):
        return False
    return isinstance(value, (int, float) if kind is float else kind)


def load_config_file(path: str) -> dict[str, Any]:
    """Read a YAML file of settings: a mapping of ``EngineArgs`` / ``ServerArgs`` field names.

    Raises:
        ValueError: the file is not a mapping, has unknown keys (all named) or
            a value of the wrong type.
        OSError: the file cannot be read.
    """
    with open(path, encoding="utf-8") as file:
        data = yaml.safe_load(file)
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a mapping of settings, got {type(data).__name__}")
    fields = settings_fields()
    unknown = sorted(str(key) for key in data if key not in fields)
    if unknown:
        raise ValueError(f"{path}: unknown keys {', '.join(unknown)}; known keys: {', '.join(fields)}")
    for key, value in data.items():
        hint = fields[key][1]
        if not any(_accepts(kind, value) for kind in _members(hint)):
            raise ValueError(f"{path}: {key} must be of type {hint}, got {value!r}")
    return data


def resolve_settings(args: argparse.Namespace) -> tuple[EngineArgs, ServerArgs]:
    """Merge defaults, the environment (``PAGEDSERVE_API_KEY``), the ``--config`` file and flags (highest wins).

    Raises:
        ValueError: a bad config file or an invalid setting (naming it).
        OSError: the config file cannot be read.
    """
    settings: dict[str, Any] = {}
    if envs.PAGEDSERVE_API_KEY is not None:
        settings["api_key"] = envs.PAGEDSERVE_API_KEY
    if args.config:
        settings |= load_config_file(args.config)
    fields = settings_fields()
    settings |= {name: value for name, value in vars(args).items() if name in fields}
    if args.model_tag is not None:
        if "model" in vars(args) and args.model != args.model_tag:
            raise ValueError(f"the model is given twice: {args.model_tag!r} and --model {args.model!r}")
        settings["model"] = args.model_tag
    engine_names = {f.name for f in dataclasses.fields(EngineArgs)}
    return (EngineArgs(**{k: v for k, v in settings.items() if k in engine_names}),
            ServerArgs(**{k: v for k, v in settings.items() if k not in engine_names}))
