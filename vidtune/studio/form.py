"""The settings form, generated from the config schema (`vidtune.config.schema`): one field per key with its
description, default, allowed values and the chosen family's default; validated with the messages `vidtune train`
prints for the same file; saved as a YAML config the command line runs unchanged."""

from __future__ import annotations

import re
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel

from vidtune.config import Config, Origins, build_config, resolve_paths, yaml_key_lines
from vidtune.errors import ConfigError
from vidtune.files import atomic_write_text

GENERAL = "general"  # the top-level keys that are no section (output_dir, ...)


@dataclass(frozen=True)
class FormField:
    key: str  # section.key
    kind: str  # choice, integer, number, text, yaml
    description: str
    default: str  # as YAML text; "" when it has none
    required: bool
    choices: tuple[str, ...] = ()
    optional: bool = False  # may be left empty (None)


@dataclass(frozen=True)
class FormSection:
    name: str
    description: str
    fields: tuple[FormField, ...]


def yaml_text(value: Any) -> str:
    """A value as one would write it after `key: ` in YAML."""
    if value is None:
        return ""
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    elif isinstance(value, tuple):
        value = list(value)
    text = yaml.safe_dump(value, default_flow_style=True, sort_keys=False, width=10_000).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()


def _field(key: str, info: Any) -> FormField:
    annotation = info.annotation
    optional = False
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        args = [arg for arg in typing.get_args(annotation) if arg is not type(None)]
        optional = len(args) < len(typing.get_args(annotation))
        annotation = args[0] if len(args) == 1 else annotation
    choices: tuple[str, ...] = ()
    if typing.get_origin(annotation) is Literal:
        kind, choices = "choice", tuple(yaml_text(value) for value in typing.get_args(annotation))
    elif annotation is bool:
        kind, choices = "choice", ("true", "false")
    elif annotation is int:
        kind = "integer"
    elif annotation is float:
        kind = "number"
    elif annotation is str:
        kind = "text"
    else:
        kind = "yaml"
    required = info.is_required()
    if info.default_factory is not None:
        default = yaml_text(info.default_factory())
    else:
        default = "" if required else yaml_text(info.default)
    return FormField(key, kind, info.description or "", default, required, choices, optional)


def form_sections() -> list[FormSection]:
    """Every section of the config and its keys, in the schema's order; the top-level keys last, as `general`."""
    sections, general = [], []
    for name, info in Config.model_fields.items():
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            fields = tuple(_field(f"{name}.{key}", sub) for key, sub in annotation.model_fields.items())
            if name == "model":  # the families the registry knows, as the allowed values of model.name
                from vidtune.models.registry import SPECS

                fields = tuple(FormField(f.key, "choice", f.description, f.default, f.required, tuple(sorted(SPECS)))
                               if f.key == "model.name" else f for f in fields)
            sections.append(FormSection(name, info.description or "", fields))
        else:
            general.append(_field(name, info))
    sections.append(FormSection(GENERAL, "Keys outside the sections.", tuple(general)))
    return sections


def family_defaults(family: str) -> dict[str, str]:
    """The keys a model family sets when the config leaves them unset (`vidtune.models.defaults`), as YAML text."""
    from vidtune.models.defaults import CONFIG_KEYS, FAMILY_DEFAULTS

    defaults = FAMILY_DEFAULTS.get(family)
    if defaults is None:
        return {}
    values = {f"{section}.{key}": yaml_text(getattr(defaults, name)) for (section, key), name in CONFIG_KEYS.items()}
    values["model.frame_rate"] = f"{yaml_text(defaults.fps)} (when data.fps is unset)"
    return values


def flatten(data: dict[str, Any]) -> dict[str, str]:
    """A config's mapping as form values: `section.key` -> YAML text."""
    values = {}
    for name, value in data.items():
        if isinstance(value, dict) and name in Config.model_fields and name != GENERAL:
            values.update({f"{name}.{key}": yaml_text(sub) for key, sub in value.items()})
        else:
            values[name] = yaml_text(value)
    return values


def nest(values: dict[str, str]) -> dict[str, Any]:
    """Form values as a config's mapping; an empty value leaves its key unset (its default), and text is read as
    YAML as a `section.key=value` override is."""
    data: dict[str, Any] = {}
    for key, text in values.items():
        if not isinstance(text, str) or not text.strip():
            continue
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            value = text
        section, _, sub = key.partition(".")
        if sub:
            data.setdefault(section, {})[sub] = value
        else:
            data[section] = value
    return data


def config_text(values: dict[str, str], file: Path) -> str:
    """The YAML file the form saves as `file`: a first line saying how to run it, then the keys set."""
    return (f"# Written by vidtune studio; run it with: vidtune train {file.name}\n"
            + yaml.safe_dump(nest(values), sort_keys=False, allow_unicode=True))


_PROBLEM_KEY = re.compile(r"^\s+- (?:line \d+: )?([A-Za-z0-9_.]+):")


def validate(values: dict[str, str], file: Path) -> tuple[Config | None, str, dict[str, list[str]]]:
    """The config the form makes when saved as `file`: (the config or None, the message `vidtune train file` would
    print for it, that message's problems by key)."""
    text = config_text(values, file)  # its line numbers are those of the file saved
    origins = Origins(file=file, file_lines=yaml_key_lines(text))
    try:
        config = build_config(resolve_paths(nest(values), file.parent), origins=origins)
    except ConfigError as error:
        message = str(error)
        by_key: dict[str, list[str]] = {}
        for line in message.splitlines():
            match = _PROBLEM_KEY.match(line)
            if match:
                by_key.setdefault(match.group(1), []).append(line.strip().removeprefix("- "))
        return None, message, by_key
    return config, "", {}


def save(values: dict[str, str], file: Path) -> Path:
    """Write the form as the YAML config `file` (atomically), only when it is valid."""
    config, message, _ = validate(values, file)
    if config is None:
        raise ConfigError(message)
    return atomic_write_text(file, config_text(values, file))


def read_values(file: Path) -> dict[str, str]:
    """A config file's keys as form values (empty for a new file)."""
    if not file.is_file():
        return {}
    data = yaml.safe_load(file.read_text(encoding="utf-8-sig"))
    if not isinstance(data, dict):
        raise ConfigError(f"{file}: the top level must be a mapping of sections (model:, data:, ...).")
    return flatten(data)
