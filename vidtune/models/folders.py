"""What a local `model.pretrained` folder holds when it is not a complete base model: a vidtune run (or one of its
checkpoints, or an export), or a folder with the model folder inside it. For the messages that say which folder
to use instead."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import yaml

from vidtune.errors import ModelError
from vidtune.models.hub import looks_local
from vidtune.outputs import CHECKPOINTS, LORA_WEIGHTS, METRICS, RESOLVED_CONFIG, TRANSFORMER_FOLDER

# Folders looked into for a complete model folder below the one given (the quickstart's folder holds its tiny model
# one level down; a hub-style download two: models--x/snapshots/<hash>).
_SEARCH_DEPTH = 3
_SEARCH_LIMIT = 2000  # folders looked at, at most: a home folder given by mistake must not be walked whole


def check_folder_exists(pretrained: str) -> None:
    """A local model.pretrained that is no folder is a ModelError saying so. It needs none of the family's code: the
    commands check it before importing that (and torch)."""
    folder = Path(pretrained).expanduser()
    if looks_local(pretrained) and not folder.is_dir():
        raise ModelError(
            f"model.pretrained: the folder {folder.resolve()} does not exist.\n"
            "What to do: point it at a model folder in the diffusers layout (with model_index.json; relative "
            "paths in a config file are relative to the file's folder) or at a hub id such as "
            "Lightricks/LTX-Video."
        )


def run_folder(folder: Path) -> Path | None:
    """The run `folder` belongs to, when it is a vidtune run's output_dir, one of its checkpoints, or an export
    (an adapter file without a model): the folder itself, or for a checkpoint its run; None otherwise."""
    if folder.parent.name == CHECKPOINTS and (folder.parent.parent / RESOLVED_CONFIG).is_file():
        return folder.parent.parent
    markers = (RESOLVED_CONFIG, CHECKPOINTS, METRICS, LORA_WEIGHTS)
    if (folder / "model_index.json").is_file() or not any((folder / name).exists() for name in markers):
        return None
    return folder


def trained_from(run: Path) -> str | None:
    """The base model a run trained (its config.yaml's model.pretrained), or None when it does not say."""
    try:
        config = yaml.safe_load((run / RESOLVED_CONFIG).read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError):
        return None
    model = config.get("model") if isinstance(config, dict) else None
    pretrained = model.get("pretrained") if isinstance(model, dict) else None
    return pretrained if isinstance(pretrained, str) and pretrained else None


def describe_run(folder: Path, run: Path) -> str:
    """The message for a run given as model.pretrained: it is a run, what it trained from, and how to use it."""
    base = trained_from(run)
    use = [f"set model.pretrained to the base model{f' it trained from, {base}' if base else ''}"]
    adapter = folder / LORA_WEIGHTS if (folder / LORA_WEIGHTS).is_file() else run / LORA_WEIGHTS
    if adapter.is_file():
        use.append(f"to continue from its LoRA, add lora.init_from={adapter}")
    elif (run / TRANSFORMER_FOLDER).is_dir():
        trained = run / TRANSFORMER_FOLDER
        use.append(f"to start from its trained transformer, add model.subfolders.transformer={trained}")
    use.append(f"to generate videos with it, run vidtune sample {folder} --prompt \"...\"")
    what = "a checkpoint of a vidtune run" if run != folder else "a vidtune run (the weights it trained)"
    return f"{folder} is {what}, not a base model.\nWhat to do: {'; '.join(use)}."


def model_folders_inside(folder: Path, components: Sequence[str]) -> list[Path]:
    """Folders below `folder` (a few levels down, nearest first) holding every one of `components`."""
    found: list[Path] = []
    level = [folder]
    looked = 0
    for _ in range(_SEARCH_DEPTH):
        below: list[Path] = []
        for parent in level:
            try:
                children = sorted(child for child in parent.iterdir() if child.is_dir()
                                  and not child.name.startswith("."))
            except OSError:  # unreadable: nothing to point at there
                continue
            for child in children:
                looked += 1
                if all((child / name).is_dir() for name in components):
                    found.append(child)
                else:
                    below.append(child)
                if looked >= _SEARCH_LIMIT:
                    return found
        if found:
            return found
        level = below
    return found
