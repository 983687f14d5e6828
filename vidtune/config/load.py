"""Loading a config: a YAML or TOML file plus `section.key=value` overrides from the command line, relative paths
made absolute, validated against the schema (`vidtune.config.schema`), the family's defaults filled into the
frozen `Config` made from it; and writing the resolved config into a run's output folder.
"""

from __future__ import annotations

import fnmatch
import json
import os
import tomllib
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from vidtune.config.problems import Origins, describe_problems, yaml_key_lines
from vidtune.config.schema import Config, required_keys
from vidtune.errors import ConfigError
from vidtune.files import atomic_write_text
from vidtune.models.defaults import apply_family_defaults
from vidtune.outputs import RESOLVED_CONFIG


def _read_file(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ConfigError(f"Config file not found: {path.absolute()}\n"
                          "What to do: check the path (relative to the current folder), or write a config: "
                          "`vidtune quickstart` leaves a complete example, `vidtune config show` lists every key.")
    text = path.read_text(encoding="utf-8-sig")
    try:
        if path.suffix.lower() == ".toml":
            data = tomllib.loads(text)
        elif path.suffix.lower() in (".yaml", ".yml", ".json"):
            data = yaml.safe_load(text)
        else:
            raise ConfigError(f"{path}: config files must end in .yaml, .yml, .toml or .json.\n"
                              "What to do: rename the file (its content decides nothing about its format).")
    except (yaml.YAMLError, tomllib.TOMLDecodeError) as error:
        raise ConfigError(f"{path} is not valid {path.suffix.lstrip('.').upper()}:\n{error}\n"
                          "What to do: fix the line shown above (indentation, a missing ':' or quote).") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: the top level must be a mapping of sections (model:, data:, ...).\n"
                          "What to do: start from the config `vidtune quickstart` writes.")
    return data


# Keys that hold paths. A relative path is resolved against the folder of the config file it is written in, or
# against the current folder when it comes from the command line (or is a default). `hub`: a local folder or a
# hub id, which is left as it is unless it starts with `.` or names an existing folder. `latest`: that word or a path.
PATH_KEYS: dict[str, str] = {
    "model.pretrained": "hub",
    "model.subfolders.*": "hub",
    "model.transformer_file": "path",
    "model.transformer_2_file": "path",
    "data.root": "path",
    "data.datasets.root": "path",
    "data.datasets.path": "path",
    "lora.init_from": "path",
    "precompute.cache_dir": "path",
    "parallel.deepspeed_config": "path",
    "checkpoint.resume": "latest",
    "output_dir": "path",
    "caption.model": "hub",
}


# Lists whose items hold paths: an item's keys are named as if the list were a section (data.datasets.root).
LIST_SECTIONS = ("data.datasets",)


def _path_kind(key: str) -> str | None:
    return next((kind for pattern, kind in PATH_KEYS.items() if fnmatch.fnmatchcase(key, pattern)), None)


# A hub-kind value kept as a hub id because no folder of that name exists -> the folder it was looked for as, for
# the message when the hub has no such model either.
_FOLDERS_LOOKED_FOR: dict[str, str] = {}


def folder_looked_for(value: str) -> str | None:
    """The absolute folder a model.pretrained (or model.subfolders) value read as a hub id was first looked for as
    (relative to the config file's folder, or on the command line to the current one); None if never."""
    return _FOLDERS_LOOKED_FOR.get(value)


def resolve_path(value: Any, kind: str, base: Path) -> Any:
    """`value` as an absolute path from `base` (see PATH_KEYS); anything else is returned as it is."""
    if not isinstance(value, str) or not value or (kind == "latest" and value == "latest"):
        return value
    path = Path(value).expanduser()
    if path.is_absolute():
        return str(path)
    candidate = base / path
    if kind == "hub" and not value.startswith(".") and not candidate.exists():
        _FOLDERS_LOOKED_FOR[value] = os.path.normpath(candidate.absolute())
        return value  # a hub id such as Lightricks/LTX-Video
    return os.path.normpath(candidate.absolute())


def resolve_paths(data: Any, base: Path, prefix: str = "") -> Any:
    """Every path of `data` (nested sections, keys as in PATH_KEYS under `prefix`) made absolute from `base`."""
    if isinstance(data, dict):
        return {key: resolve_paths(value, base, f"{prefix}{key}.") for key, value in data.items()}
    if isinstance(data, list) and prefix.rstrip(".") in LIST_SECTIONS:
        return [resolve_paths(item, base, prefix) for item in data]
    kind = _path_kind(prefix.rstrip("."))
    return resolve_path(data, kind, base) if kind else data


def parse_override(override: str) -> tuple[list[str], Any]:
    """`training.steps=500` -> (["training", "steps"], 500). Values are read as YAML scalars/lists."""
    key, sep, raw = override.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"Override '{override}' (command line) must look like section.key=value, e.g. "
                          "training.steps=500.\nWhat to do: write it as section.key=value; `vidtune config show` "
                          "lists every key.")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def apply_overrides(data: dict[str, Any], overrides: list[str], base: Path | None = None) -> dict[str, Any]:
    """Set each `section.key=value` in `data`; with `base`, relative paths among them are resolved from it."""
    for override in overrides:
        path, value = parse_override(override)
        if base is not None:
            value = resolve_paths(value, base, ".".join(path) + ".")
        node = data
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"Override '{override}' (command line): '{part}' is a value, not a section.\n"
                                  "What to do: set a key inside a section, e.g. training.steps=500.")
            node = child
        node[path[-1]] = value
    return data


def build_config(data: dict[str, Any], source: str = "config", origins: Origins | None = None) -> Config:
    """The frozen config of `data` (sections of keys), the family's defaults filled into the keys it leaves unset;
    every invalid setting named in one ConfigError, blamed on `origins` (or on the file `source`)."""
    try:
        return apply_family_defaults(Config.model_validate(data))
    except ValidationError as error:
        if origins is None:
            origins = Origins(file=Path(source)) if source not in ("config", "the command line") else Origins()
        raise ConfigError(describe_problems(error, origins)) from None


def load_config(path: str | os.PathLike[str] | None, overrides: list[str] | None = None,
                required_placeholder: str | None = None) -> Config:
    """Read a config file (or start empty), apply `section.key=value` overrides and validate.

    Relative paths (PATH_KEYS) written in the file are relative to the file's folder; those given as overrides,
    and the default output_dir, are relative to the current folder. The config holds them as absolute paths.
    With `required_placeholder`, required keys left unset hold that text instead of being errors (to show a
    config that is not complete yet)."""
    overrides = list(overrides or [])
    origins = Origins()
    data: dict[str, Any] = {}
    if path is not None:
        file = Path(path)
        data = resolve_paths(_read_file(file), file.absolute().parent)
        origins.file = file
        if file.suffix.lower() in (".yaml", ".yml", ".json"):
            origins.file_lines = yaml_key_lines(file.read_text(encoding="utf-8-sig"))
    for override in overrides:
        origins.overrides[tuple(parse_override(override)[0])] = override
    data = apply_overrides(data, overrides, base=Path.cwd())
    if required_placeholder is not None:
        for section, keys in required_keys().items():
            if isinstance(data.setdefault(section, {}), dict):
                for key in keys:
                    data[section].setdefault(key, required_placeholder)
        # The data needs one of two keys: show the one-dataset shorthand as the one to set.
        if isinstance(data.setdefault("data", {}), dict) and not data["data"].get("datasets"):
            data["data"].setdefault("root", required_placeholder)
    config = build_config(data, origins=origins)
    if not Path(config.output_dir).is_absolute():  # the default: where the command runs
        config = config.model_copy(update={"output_dir": os.path.normpath(Path(config.output_dir).absolute())})
    return config


def write_resolved_config(config: Config, folder: str | os.PathLike[str]) -> Path:
    """Write the resolved config next to the run's outputs (atomically), in YAML."""
    return atomic_write_text(Path(folder) / RESOLVED_CONFIG, yaml.safe_dump(config.to_dict(), sort_keys=False))


def config_fingerprint(config: Config) -> str:
    """The config as one canonical JSON text, to compare two configs by."""
    return json.dumps(config.to_dict(), sort_keys=True)
