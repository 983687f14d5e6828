"""Where each invalid setting of a config came from, and the message naming them all.

A config's values come from a file and from `section.key=value` overrides; pydantic reports its problems by key.
This module turns them into one message for people: every problem at once, each blamed on the file's line or on the
command line, with the most likely intended key for an unknown one.
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from vidtune.config.schema import Config


def _section_model(location: tuple[Any, ...]) -> type[BaseModel] | None:
    model: type[BaseModel] = Config
    for part in location:
        field = model.model_fields.get(str(part))
        annotation = getattr(field, "annotation", None)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            model = annotation
        else:
            return model if part == location[-1] else None
    return model


def _suggest_key(key: str, section: tuple[Any, ...], allowed: list[str]) -> list[str]:
    """What an unknown `key` of `section` most likely meant: the same key in another section (`training.rank` ->
    `lora.rank`, a top-level `steps` -> `training.steps`), else a near spelling here, else (at the top level) a
    near spelling of a section's key (`learning_rat` -> `training.learning_rate`)."""
    elsewhere: dict[str, str] = {}  # section.key -> key, of every section but this one
    for name, field_info in Config.model_fields.items():
        annotation = field_info.annotation
        if (name,) != tuple(str(part) for part in section) and isinstance(annotation, type) \
                and issubclass(annotation, BaseModel):
            elsewhere.update({f"{name}.{sub}": sub for sub in annotation.model_fields})
    exact = [full for full, sub in elsewhere.items() if sub == key]
    if exact:
        return exact
    close = difflib.get_close_matches(key, allowed, n=1)
    if close or section:
        return close
    near = difflib.get_close_matches(key, sorted(set(elsewhere.values())), n=1)
    return [full for full, sub in elsewhere.items() if near and sub == near[0]]


def _describe(error: dict[str, Any]) -> str:
    location = tuple(error["loc"])
    key = ".".join(str(part) for part in location) or "(top level)"
    kind = error["type"]
    if kind == "extra_forbidden":
        section = _section_model(location)
        allowed = sorted(section.model_fields) if section else []
        close = _suggest_key(str(location[-1]), location[:-1], allowed)
        hint = f" Did you mean {' or '.join(repr(name) for name in close)}?" if close else ""
        return f"{key}: unknown key.{hint} Allowed keys here: {', '.join(allowed)}"
    if kind == "missing":
        return f"{key}: required, but not set"
    if kind == "value_error" and (not location or isinstance(error.get("input"), dict)):
        # A check across sections or keys of a section: its message names the keys; the whole input would bury it.
        message = str(error["msg"]).removeprefix("Value error, ")
        return message if not location or message.startswith(key) else f"{key}: {message}"
    if kind == "literal_error":
        expected = error.get("ctx", {}).get("expected", "")
        return f"{key}: {error['input']!r} is not allowed; choose one of {expected}"
    return f"{key}: {error['msg']} (got {error.get('input')!r})"


def yaml_key_lines(text: str) -> dict[tuple[str, ...], int]:
    """The line (1-based) of every key of a YAML mapping, by its path of keys: where to point at a bad one."""
    lines: dict[tuple[str, ...], int] = {}

    def walk(node: yaml.Node, path: tuple[str, ...]) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                here = (*path, str(key.value))
                lines[here] = key.start_mark.line + 1
                walk(value, here)

    try:
        root = yaml.compose(text)
    except yaml.YAMLError:
        return lines
    if root is not None:
        walk(root, ())
    return lines


@dataclass
class Origins:
    """Where the settings came from, to blame each invalid one on the right place: a file (and its line) or the
    command line."""

    file: Path | None = None
    file_lines: dict[tuple[str, ...], int] = field(default_factory=dict)
    overrides: dict[tuple[str, ...], str] = field(default_factory=dict)

    def command_line(self, location: tuple[str, ...]) -> str | None:
        """The override that set `location` (or a section holding it, or a key inside it), if any."""
        for path, override in reversed(list(self.overrides.items())):
            common = min(len(path), len(location))
            if common and path[:common] == location[:common]:
                return override
        return None

    def line(self, location: tuple[str, ...]) -> int | None:
        while location:
            if location in self.file_lines:
                return self.file_lines[location]
            location = location[:-1]
        return None


def describe_problems(error: ValidationError, origins: Origins) -> str:
    """Every invalid setting of `error`, grouped by where it was set (a file and its line, or the command line),
    as the message the user reads."""
    groups: dict[str, list[str]] = {}
    for item in error.errors():
        location = tuple(str(part) for part in item["loc"])
        text = _describe(item)
        if not location:
            where = "between settings"
        else:
            override = origins.command_line(location)
            key = override.partition("=")[0].strip() if override else ""
            if override and len(key.split(".")) > len(location) and key not in text:
                # A rule of the whole section (a key it lacks, two that clash) that does not name the key set
                # inside it: that key is not the cause.
                override = None
            where = "on the command line" if override is not None or origins.file is None else f"in {origins.file}"
            line = origins.line(location) if where.startswith("in ") else None
            if line is not None:
                text = f"line {line}: {text}"
            elif override is not None and not override.startswith(".".join(location) + "="):
                text = f"{text} (from {override})"
        groups.setdefault(where, []).append(text)
    count = sum(len(items) for items in groups.values())
    lines = [f"The config has {count} invalid setting{'s' if count != 1 else ''}; nothing was started."]
    for where, items in groups.items():
        lines.append(f"{where[0].upper()}{where[1:]}:")
        lines.extend(f"  - {text}" for text in items)
    lines.append("What to do: correct (or add) these keys (a key given on the command line replaces the file's); "
                 "`vidtune config show` lists every key with its default and meaning.")
    return "\n".join(lines)
