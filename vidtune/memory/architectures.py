"""The architectures `vidtune plan` knows without a download: the config.json contents (layer counts, widths) of
each released model's transformer, VAE and text / image encoders, in `architectures.json`, by hub id.

Only what differs from the diffusers / transformers class defaults is written there (with `_class_name`), so a
component is built exactly as `from_config` builds it from the released file; `model_index` holds the pipeline
settings a spec reads. Each entry's `sources` says where its values come from (diffusers' conversion scripts, the
class defaults, the published model configs) and `inferred` lists any value that had to be inferred. A local model
folder is read as it is.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import json
import tempfile
from pathlib import Path

from vidtune.errors import ConfigError
from vidtune.models.hub import looks_local

ARCHITECTURES_FILE = Path(__file__).with_name("architectures.json")
# Components whose settings file is not config.json.
CONFIG_FILES = {"scheduler": "scheduler_config.json", "audio_scheduler": "scheduler_config.json",
                "tokenizer": "tokenizer_config.json"}


@functools.cache
def shipped_architectures() -> dict[str, dict]:
    return json.loads(ARCHITECTURES_FILE.read_text())


@functools.cache
def _written(hub_id: str) -> Path:
    """The shipped architecture of `hub_id` as a model folder (one `<component>/config.json` each), written once
    per process into a temporary folder."""
    folder = Path(tempfile.mkdtemp(prefix="vidtune-architecture-"))
    entry = shipped_architectures()[hub_id]
    for component, config in entry["components"].items():
        (folder / component).mkdir()
        name = CONFIG_FILES.get(component, "config.json")
        (folder / component / name).write_text(json.dumps(_with_defaults(config)))
    if "model_index" in entry:  # pipeline settings some specs read (Wan 2.2's experts and timestep layout)
        (folder / "model_index.json").write_text(json.dumps(entry["model_index"]))
    return folder


def families(hub_id: str) -> list[str]:
    """The `model.name`s a shipped hub id serves (an image-to-video family often shares its text-to-video id)."""
    family = shipped_architectures()[hub_id]["family"]
    return [family] if isinstance(family, str) else list(family)


def _with_defaults(config: dict) -> dict:
    """A diffusers component's config with every argument its class takes (the specs read some of them from the
    file, as a released config.json holds them all); transformers configs fill their own defaults."""
    import diffusers

    cls = getattr(diffusers, config["_class_name"], None)
    if cls is None or "model_type" in config:
        return config
    parameters = inspect.signature(cls.__init__).parameters.values()
    defaults = {p.name: p.default for p in parameters if p.default is not inspect.Parameter.empty}
    return json.loads(json.dumps({**defaults, **config}, default=list))


def architecture_folder(pretrained: str, family: str) -> tuple[Path, str]:
    """(folder holding the components' config.json files, how to name it): a local folder as it is, a hub id from
    the shipped architectures."""
    if looks_local(pretrained):
        folder = Path(pretrained).expanduser()
        if not (folder / "transformer" / "config.json").is_file():
            raise ConfigError(
                f"model.pretrained: {folder.resolve()} has no transformer/config.json.\n"
                "What to do: point it at a model folder in the diffusers layout (each component in its own subfolder "
                "with its config.json), or at one of the hub ids `vidtune plan` knows: "
                f"{', '.join(shipped_architectures())}."
            )
        return folder, str(folder.resolve())
    known = shipped_architectures()
    if pretrained not in known:
        by_case = {hub_id.lower(): hub_id for hub_id in known}
        close = difflib.get_close_matches(pretrained.lower(), list(by_case), n=1, cutoff=0.75)
        meant = f"Did you mean {by_case[close[0]]}? " if close else ""
        folder = pretrained.rstrip("/").split("/")[-1]
        raise ConfigError(
            f"model.pretrained: `vidtune plan` has no architecture for the hub id {pretrained}.\n"
            f"What to do: {meant}Use one it knows ({', '.join(known)}), or download the model's config files where "
            f"there is network (`hf download {pretrained} --include '*.json' --local-dir {folder}`) and set "
            "model.pretrained to that folder."
        )
    if family not in families(pretrained):
        names = " or ".join(families(pretrained))
        raise ConfigError(
            f"model.pretrained: {pretrained} is a {names} model, but model.name is {family}.\n"
            f"What to do: set model.name={families(pretrained)[0]}."
        )
    return _written(pretrained), pretrained
