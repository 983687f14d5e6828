"""Write docs/configuration.md from the config classes, so the reference never disagrees with the code.

    python -m vidtune.config_docs > docs/configuration.md
"""

from __future__ import annotations

import json
import types
import typing

import yaml
from pydantic import BaseModel
from pydantic.fields import PydanticUndefined

from vidtune.config import PATH_KEYS, SOURCE_TYPES, Config

HEADER = """# Configuration reference

Generated from `vidtune/config/schema.py` by `python -m vidtune.config_docs > docs/configuration.md`;
a test fails when this file and the code disagree.

A config is a YAML or TOML file; any key can be overridden on the command line as `section.key=value`
(values are read as YAML: `training.steps=500`, `lora.target_modules=[to_q,to_v]`, `data.fps=null`).
Unknown keys and out-of-range values are errors that name the key (and the file's line, or the command line).
The resolved config, with every default filled in, is written to `output_dir/config.yaml`;
`vidtune config show [CONFIG] [section.key=value ...]` prints it with a line on each key.

**Paths.** A relative path written in a config file is relative to the folder of that file, wherever the command
runs; a path given on the command line (and the default `output_dir`) is relative to the current folder. The
keys that hold paths are {keys}. `model.pretrained` (and a `model.subfolders` value) is a local folder when it
starts with `.` or names an existing folder, and a hub id otherwise. The resolved config holds absolute paths.
`data.videos`, `data.prompts` and the clip paths listed in them are relative to `data.root`; the paths in a
`metadata` file are relative to that file's folder.
"""


def _type_name(annotation: object) -> str:
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(args[0])
    if origin is typing.Literal:
        return " / ".join(f"`{value}`" for value in args)
    if origin in (typing.Union, types.UnionType):
        return " or ".join("null" if arg is type(None) else _type_name(arg) for arg in args)
    if origin is not None:
        return f"{origin.__name__}[{', '.join(_type_name(arg) for arg in args)}]"
    return getattr(annotation, "__name__", str(annotation))


def _default(field) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "**required**"
    value = field.default_factory() if field.default_factory is not None else field.default
    if isinstance(value, BaseModel):
        return "(section)"
    return f"`{json.dumps(value)}`"


def _limits(field) -> str:
    parts = []
    for item in field.metadata:
        for name, symbol in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<=")):
            if getattr(item, name, None) is not None:
                parts.append(f"{symbol} {getattr(item, name)}")
    return ", ".join(parts)


def _source_tables() -> list[str]:
    """The keys of each kind of `data.datasets` entry (examples: docs/datasets.md)."""
    lines = ["\n### `data.datasets` entries\n",
             "Each entry is one source; its `type` decides the other keys."]
    for model in SOURCE_TYPES:
        kind = typing.get_args(model.model_fields["type"].annotation)[0]
        lines.append(f"\n**`type: {kind}`**: {model.__doc__.strip()}\n")
        lines.append("| key | type | default | limits | meaning |")
        lines.append("|---|---|---|---|---|")
        for key, sub in model.model_fields.items():
            if key == "type":
                continue
            cells = [f"`{key}`", _type_name(sub.annotation), _default(sub), _limits(sub), sub.description or ""]
            lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
    return lines


def _rows(section: type[BaseModel], prefix: str) -> list[tuple[str, object]]:
    """(dotted key, field) of a section, a nested section's own keys after its row (`parallel.context.ring`)."""
    rows: list[tuple[str, object]] = []
    for key, sub in section.model_fields.items():
        rows.append((f"{prefix}.{key}", sub))
        if isinstance(sub.annotation, type) and issubclass(sub.annotation, BaseModel):
            rows.extend(_rows(sub.annotation, f"{prefix}.{key}"))
    return rows


def render() -> str:
    lines = [HEADER.format(keys=", ".join(f"`{key}`" for key in PATH_KEYS))]
    top = [(name, field) for name, field in Config.model_fields.items()]
    for name, field in top:
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            lines.append(f"\n## `{name}`\n")
            if field.description:
                lines.append(f"{field.description}\n")
            lines.append("| key | type | default | limits | meaning |")
            lines.append("|---|---|---|---|---|")
            for key, sub in _rows(annotation, name):
                kind = _type_name(sub.annotation)
                cells = [f"`{key}`", kind, _default(sub), _limits(sub), sub.description or ""]
                lines.append("| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |")
            if name == "data":
                lines.extend(_source_tables())
    lines.append("\n## Top level\n")
    lines.append("| key | default | meaning |")
    lines.append("|---|---|---|")
    for name, field in top:
        annotation = field.annotation
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            lines.append(f"| `{name}` | {_default(field)} | {field.description or ''} |")
    return "\n".join(lines) + "\n"


NOT_SET = "\x00not set"  # what a required key holds in `vidtune config show` before the user sets it


def _yaml_value(value: object) -> str:
    """`value` as YAML on one line (flow style), as it would be written in a config file."""
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).removesuffix("\n...\n").strip()


def render_resolved(config: Config, source: str) -> str:
    """`vidtune config show`: every key with its resolved value and a one-line description, as YAML a user can
    save and edit. Required keys still unset show empty, marked as required."""
    values = config.to_dict()
    rows: list[tuple[str, str]] = []

    def add(indent: str, key: str, value: object, field_info) -> None:
        description = field_info.description or ""
        if value == NOT_SET:
            rows.append((f"{indent}{key}:", f"REQUIRED, not set. {description}"))
        elif isinstance(value, dict) and isinstance(field_info.annotation, type) \
                and issubclass(field_info.annotation, BaseModel):
            rows.append((f"{indent}{key}:", description))
            for sub_key, sub_field in field_info.annotation.model_fields.items():
                add(indent + "  ", sub_key, value[sub_key], sub_field)
        else:
            rows.append((f"{indent}{key}: {_yaml_value(value)}", description))

    for name, field_info in Config.model_fields.items():
        add("", name, values[name], field_info)
    width = min(48, max(len(text) for text, _ in rows))
    lines = [f"# The resolved config of {source}: every key, its value and what it means.",
             "# Save it as a .yaml file to start a config of your own; limits: docs/configuration.md."]
    lines += [f"{text.ljust(width)}  # {note}" if note else text for text, note in rows]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    print(render(), end="")
