"""What `vidtune caption DATA` captions: DATA named as a config file, a folder, a clip list or a metadata file, and
the caption settings (the config's `caption:` section, then the command's options)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

from pydantic import ValidationError

from vidtune.config.schema import CaptionConfig, FolderSource, MetadataSource, PairsSource
from vidtune.errors import ConfigError

CONFIG_SUFFIXES = (".yaml", ".yml", ".toml", ".json")


class CaptionData(NamedTuple):
    """What DATA names: its sources, the caption settings, and whether to draw progress bars (a config's
    `logging.progress`)."""

    sources: list[PairsSource | FolderSource | MetadataSource]
    settings: CaptionConfig
    progress: bool = True
METADATA_SUFFIXES = (".csv", ".jsonl")
DATA_FORMS = ("a config file with a data section (.yaml, .yml, .toml, .json), a folder (with videos.txt: its "
              "prompts.txt; else a .txt beside each clip), a clip list such as videos.txt, or a .csv / .jsonl file")


def resolve_data(data: str, overrides: list[str], prompts: str | None = None, video_column: str | None = None,
                 caption_column: str | None = None) -> CaptionData:
    """The sources DATA names and the caption settings it holds (defaults unless DATA is a config file)."""
    path = Path(data).expanduser()
    suffix = path.suffix.lower()
    if suffix in CONFIG_SUFFIXES:
        return _from_config(path, overrides)
    if overrides:
        raise ConfigError(f"vidtune caption {data}: section.key=value settings ({' '.join(overrides)}) go with a "
                          "config file only.\nWhat to do: use the options instead (vidtune caption --help), or "
                          "give a config.")
    if not path.exists():
        raise ConfigError(f"vidtune caption: {path.absolute()} does not exist.\nWhat to do: give {DATA_FORMS}.")
    if path.is_dir():
        if (path / "videos.txt").is_file() or prompts is not None:
            return CaptionData([PairsSource(type="pairs", root=str(path.absolute()), prompts=prompts or "prompts.txt")],
                               CaptionConfig())
        return CaptionData([FolderSource(type="folder", root=str(path.absolute()))], CaptionConfig())
    if suffix == ".txt":
        return CaptionData([PairsSource(type="pairs", root=str(path.absolute().parent), videos=path.name,
                                        prompts=prompts or "prompts.txt")], CaptionConfig())
    if suffix in METADATA_SUFFIXES:
        return CaptionData([MetadataSource(type="metadata", path=str(path.absolute()),
                                           video_column=video_column or "video",
                                           caption_column=caption_column or "caption")], CaptionConfig())
    raise ConfigError(f"vidtune caption: {path} is not a kind of file captions are written for.\nWhat to do: give "
                      f"{DATA_FORMS}.")


def _from_config(path: Path, overrides: list[str]) -> CaptionData:
    from vidtune.config import load_config
    from vidtune.config_docs import NOT_SET

    config = load_config(path, overrides, required_placeholder=NOT_SET)  # the model section may be left out
    if config.data.root == NOT_SET and not config.data.datasets:
        raise ConfigError(f"{path}: no data section (data.root or data.datasets), so there is nothing to caption.\n"
                          "What to do: add the data section training uses, or give the data folder or file itself.")
    return CaptionData(config.data.sources(), config.caption, config.logging.progress)


def with_options(settings: CaptionConfig, options: dict[str, Any]) -> CaptionConfig:
    """`settings` with the options given on the command line (None: not given), checked as the config is."""
    given = {key: value for key, value in options.items() if value is not None}
    try:
        return CaptionConfig.model_validate({**settings.model_dump(), **given})
    except ValidationError as error:
        problems = "\n".join(f"  --{'-'.join(str(part) for part in problem['loc']).replace('_', '-')}: "
                             f"{problem['msg']}" for problem in error.errors())
        raise ConfigError(f"vidtune caption: an option is not valid:\n{problems}\nWhat to do: fix it (vidtune "
                          "caption --help lists them).") from None
