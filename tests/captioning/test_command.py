"""What `vidtune caption DATA` reads DATA as, and the messages for DATA it cannot caption."""

from __future__ import annotations

from pathlib import Path

import pytest

from vidtune.captioning.command import resolve_data, with_options
from vidtune.config.schema import CaptionConfig
from vidtune.errors import ConfigError


def test_data_is_read_as_the_layout_it_names(tmp_path: Path):
    (tmp_path / "pairs").mkdir()
    (tmp_path / "pairs/videos.txt").write_text("a.mp4\n")
    (tmp_path / "folder").mkdir()
    (tmp_path / "takes.txt").write_text("a.mp4\n")
    (tmp_path / "sheet.csv").write_text("file\n")
    [pairs] = resolve_data(str(tmp_path / "pairs"), []).sources
    assert (pairs.type, pairs.root, pairs.prompts) == ("pairs", str(tmp_path / "pairs"), "prompts.txt")
    [folder] = resolve_data(str(tmp_path / "folder"), []).sources
    assert folder.type == "folder"
    [listed] = resolve_data(str(tmp_path / "takes.txt"), [], prompts="takes-captions.txt").sources
    assert (listed.type, listed.videos, listed.prompts) == ("pairs", "takes.txt", "takes-captions.txt")
    [sheet], settings, _ = resolve_data(str(tmp_path / "sheet.csv"), [], video_column="file", caption_column="text")
    assert (sheet.type, sheet.video_column, sheet.caption_column) == ("metadata", "file", "text")
    assert settings == CaptionConfig()


def test_a_config_gives_its_sources_and_caption_section(tmp_path: Path):
    config = tmp_path / "my.yaml"
    config.write_text("data:\n  datasets:\n    - {type: folder, root: clips}\n    - {type: metadata, path: s.jsonl}\n"
                      "caption: {model: ./vlm, prefix: vtstyle}\n")
    sources, settings, progress = resolve_data(str(config), ["caption.fps=1"])
    assert progress
    assert not resolve_data(str(config), ["logging.progress=false"]).progress
    assert [source.type for source in sources] == ["folder", "metadata"]
    assert sources[0].root == str(tmp_path / "clips")  # relative to the file, as for training
    assert (settings.model, settings.prefix, settings.fps) == (str(tmp_path / "vlm"), "vtstyle", 1.0)
    assert with_options(settings, {"prefix": "other", "fps": None}).prefix == "other"
    with pytest.raises(ConfigError, match="--max-frames: Input should be greater than 0"):
        with_options(settings, {"max_frames": 0})


def test_data_that_cannot_be_captioned_says_what_to_give(tmp_path: Path):
    with pytest.raises(ConfigError, match="does not exist"):
        resolve_data(str(tmp_path / "nowhere"), [])
    (tmp_path / "clip.mp4").write_bytes(b"")
    with pytest.raises(ConfigError, match="not a kind of file"):
        resolve_data(str(tmp_path / "clip.mp4"), [])
    with pytest.raises(ConfigError, match="go with a config file only"):
        resolve_data(str(tmp_path), ["caption.fps=1"])
    (tmp_path / "empty.yaml").write_text("caption: {prefix: x}\n")
    with pytest.raises(ConfigError, match="no data section"):
        resolve_data(str(tmp_path / "empty.yaml"), [])
