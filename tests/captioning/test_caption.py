"""`vidtune caption`: frames in, text out, captions written where each layout keeps them; resumable, never
overwriting without --overwrite, a dry run writing nothing, a clip that does not decode skipped and reported."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from vidtune.captioning import run
from vidtune.captioning.command import resolve_data
from vidtune.captioning.qwen_inputs import VisionSettings
from vidtune.captioning.run import caption_all, load_captioner, open_sources
from vidtune.captioning.vlm import Captioner, Media
from vidtune.cli import main
from vidtune.config.schema import CaptionConfig, FolderSource, MetadataSource, PairsSource

FAST = ["--device", "cpu", "--max-new-tokens", "3", "--max-pixels", "3136"]


class FixedModel:
    """Answers every sample with its kind and frame count, and records what it was asked."""

    settings = VisionSettings()

    def __init__(self) -> None:
        self.asked: list[str] = []

    def caption(self, batch, instructions):
        self.asked.extend(instructions)
        return [f"{'still' if media.is_image else 'clip'} of {len(media.frames)} frames" for media in batch]


def test_a_fixed_model_s_captions_land_in_exactly_these_files(tmp_path: Path, clips):
    clips(tmp_path / "pairs", ["a.mp4", "b.png"])
    (tmp_path / "pairs/videos.txt").write_text("a.mp4\nb.png\n")
    clips(tmp_path / "folder", ["c.mp4", "sub/d.png"])
    clips(tmp_path / "sheet", ["e.mp4", "f.mp4"])
    (tmp_path / "sheet/list.csv").write_text("video,caption\ne.mp4,\nf.mp4,kept\n")
    (tmp_path / "sheet/list.jsonl").write_text('{"video": "e.mp4"}\n')
    sources = [PairsSource(type="pairs", root=str(tmp_path / "pairs")),
               FolderSource(type="folder", root=str(tmp_path / "folder")),
               MetadataSource(type="metadata", path=str(tmp_path / "sheet/list.csv")),
               MetadataSource(type="metadata", path=str(tmp_path / "sheet/list.jsonl"))]
    model = FixedModel()
    settings = CaptionConfig(prefix="vtstyle", fps=8, batch_size=2, instruction="Caption this {media}.")
    summary = caption_all(open_sources(sources), settings, lambda: model, progress=False)
    assert (summary.written, summary.kept, summary.skipped) == (6, 1, [])
    assert (tmp_path / "pairs/prompts.txt").read_text() == "vtstyle clip of 9 frames\nvtstyle still of 1 frames\n"
    assert (tmp_path / "folder/c.txt").read_text() == "vtstyle clip of 9 frames\n"
    assert (tmp_path / "folder/sub/d.txt").read_text() == "vtstyle still of 1 frames\n"
    assert (tmp_path / "sheet/list.csv").read_text() == "video,caption\ne.mp4,vtstyle clip of 9 frames\nf.mp4,kept\n"
    assert (tmp_path / "sheet/list.jsonl").read_text() == '{"video": "e.mp4", "caption": "vtstyle clip of 9 frames"}\n'
    assert model.asked.count("Caption this image.") == 2 and model.asked.count("Caption this video.") == 4


def test_the_model_is_never_loaded_when_every_sample_has_a_caption(tmp_path: Path, clips):
    clips(tmp_path, ["a.mp4"])
    (tmp_path / "videos.txt").write_text("a.mp4\n")
    (tmp_path / "prompts.txt").write_text("there\n")

    def no_model():
        raise AssertionError("loaded")

    summary = caption_all(open_sources([PairsSource(type="pairs", root=str(tmp_path))]), CaptionConfig(), no_model,
                          progress=False)
    assert (summary.written, summary.kept) == (0, 1)


@pytest.mark.parametrize("layout", ["pairs", "folder", "csv", "jsonl"])
def test_the_tiny_vlm_captions_each_layout_through_the_command(layout: str, tiny_vlm: Path, tmp_path: Path, clips,
                                                               capsys):
    data = clips(tmp_path / "data", ["a.mp4", "b.png", "c.mp4"])
    target = {"pairs": data, "folder": data, "csv": data / "clips.csv", "jsonl": data / "clips.jsonl"}[layout]
    if layout == "pairs":
        (data / "videos.txt").write_text("a.mp4\nb.png\nc.mp4\n")
    elif layout == "csv":
        target.write_text("video\na.mp4\nb.png\nc.mp4\n")
    elif layout == "jsonl":
        target.write_text("".join(json.dumps({"video": name}) + "\n" for name in ("a.mp4", "b.png", "c.mp4")))
    assert main(["caption", str(target), "--model", str(tiny_vlm), "--batch-size", "2", *FAST]) == 0
    assert "wrote 3, kept 0" in capsys.readouterr().out
    files = open_sources(resolve_data(str(target), []).sources)
    captions = [slot.caption for source in files for slot in source.slots]
    assert len(captions) == 3 and all(captions), captions


def test_a_rerun_after_a_kill_captions_only_what_is_missing(tiny_vlm: Path, tmp_path: Path, clips, capsys):
    data = clips(tmp_path, ["a.mp4", "b.mp4", "c.png"])
    (data / "videos.txt").write_text("a.mp4\nb.mp4\nc.png\n")
    settings = CaptionConfig(model=str(tiny_vlm), device="cpu", max_new_tokens=3, max_pixels=3136)
    real = load_captioner(settings)
    calls = []

    class KilledAfterOne:
        settings = real.settings

        def caption(self, batch, instructions):
            calls.append(len(batch))
            if len(calls) == 2:
                raise KeyboardInterrupt  # Ctrl-C while the second clip is being captioned
            return real.caption(batch, instructions)

    files = open_sources([PairsSource(type="pairs", root=str(data))])
    with pytest.raises(KeyboardInterrupt):
        caption_all(files, settings, KilledAfterOne, progress=False)
    first = (data / "prompts.txt").read_text()
    assert first.count("\n") == 1 and first.strip()
    assert main(["caption", str(data), "--model", str(tiny_vlm), *FAST]) == 0
    assert "wrote 2, kept 1" in capsys.readouterr().out
    lines = (data / "prompts.txt").read_text().splitlines()
    assert len(lines) == 3 and lines[0] == first.strip() and all(lines)
    assert main(["caption", str(data), "--model", str(tiny_vlm), *FAST]) == 0  # nothing left: no model, no change
    assert "wrote 0, kept 3" in capsys.readouterr().out
    assert (data / "prompts.txt").read_text().splitlines() == lines


def test_captions_are_kept_unless_overwrite_and_a_dry_run_writes_nothing(tiny_vlm: Path, tmp_path: Path, clips,
                                                                        capsys):
    data = clips(tmp_path, ["a.mp4", "b.mp4"])
    (data / "a.txt").write_text("mine\n")
    assert main(["caption", str(data), "--model", str(tiny_vlm), "--dry-run", *FAST]) == 0
    out = capsys.readouterr().out
    assert "would write 1, kept 1" in out and f"{data / 'b.txt'}: " in out
    assert sorted(path.name for path in data.iterdir()) == ["a.mp4", "a.txt", "b.mp4"]
    assert main(["caption", str(data), "--model", str(tiny_vlm), *FAST]) == 0
    assert (data / "a.txt").read_text() == "mine\n" and (data / "b.txt").read_text().strip()
    assert main(["caption", str(data), "--model", str(tiny_vlm), "--overwrite", "--prefix", "vtstyle", *FAST]) == 0
    assert (data / "a.txt").read_text().startswith("vtstyle ") and (data / "b.txt").read_text().startswith("vtstyle ")


def test_a_dry_run_lists_what_lacks_a_caption_without_loading_any_model(tmp_path: Path, clips, monkeypatch,
                                                                        capsys):
    data = clips(tmp_path, ["a.mp4", "b.mp4"])
    (data / "a.txt").write_text("mine\n")

    def never(*args, **kwargs):
        raise AssertionError("a dry run loaded the captioner")

    monkeypatch.setattr(run, "load_captioner", never)
    assert main(["caption", str(data), "--model", "Qwen/Qwen2.5-VL-7B-Instruct", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"{data / 'b.txt'}: would caption " in out and f"{data / 'a.txt'}: would caption" not in out
    assert "would write 1, kept 1" in out
    assert sorted(path.name for path in data.iterdir()) == ["a.mp4", "a.txt", "b.mp4"]


def test_offline_without_the_captioner_in_the_cache_says_so_before_loading(tmp_path: Path, clips, monkeypatch,
                                                                          capsys):
    from huggingface_hub import constants

    data = clips(tmp_path / "data", ["a.mp4"])
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))

    def never(*args, **kwargs):
        raise AssertionError("the captioner was loaded although it cannot be")

    monkeypatch.setattr("vidtune.captioning.vlm.Captioner", never)
    assert main(["caption", str(data), "--model", "Qwen/Qwen2.5-VL-7B-Instruct", "--device", "cpu"]) == 2
    error = capsys.readouterr().err
    assert "caption.model (--model): Qwen/Qwen2.5-VL-7B-Instruct is not in this machine's hub cache" in error
    assert "hf download Qwen/Qwen2.5-VL-7B-Instruct" in error and "set caption.model (--model) to that folder" in error


def test_a_clip_that_does_not_decode_is_reported_with_its_line_and_the_rest_captioned(tiny_vlm: Path,
                                                                                      tmp_path: Path, clips, capsys):
    data = clips(tmp_path, ["a.mp4", "c.mp4"])
    (data / "broken.mp4").write_bytes(b"this is not a video")
    (data / "videos.txt").write_text("a.mp4\nbroken.mp4\nc.mp4\n")
    assert main(["caption", str(data / "videos.txt"), "--model", str(tiny_vlm), *FAST]) == 1
    captured = capsys.readouterr()
    assert "wrote 2, kept 0 that already had one, skipped 1" in captured.out
    assert "videos.txt line 2" in captured.err and "broken.mp4" in captured.err
    lines = (data / "prompts.txt").read_text().split("\n")
    assert lines[0] and lines[1] == "" and lines[2]


def test_a_wrong_model_is_reported_before_any_clip_is_read(tmp_path: Path, clips, monkeypatch, capsys):
    data = clips(tmp_path / "data", ["a.mp4"])

    def no_clip(*args, **kwargs):
        raise AssertionError("a clip was read")

    monkeypatch.setattr(run, "read_media", no_clip)
    assert main(["caption", str(data), "--model", str(tmp_path / "nowhere"), "--device", "cpu"]) == 2
    assert "nowhere does not exist" in capsys.readouterr().err
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "t5"}))
    assert main(["caption", str(data), "--model", str(other), "--device", "cpu"]) == 2
    assert "is a t5 model" in capsys.readouterr().err
    assert main(["caption", str(data), "--model", "someone/not-downloaded", "--device", "cpu"]) == 2
    err = capsys.readouterr().err
    assert "someone/not-downloaded is not in this machine's hub cache" in err and "HF_HUB_OFFLINE=1" in err
    assert not (data / "a.txt").exists()


def test_captions_of_a_batch_equal_those_made_one_at_a_time(tiny_vlm: Path, clips, tmp_path: Path):
    from vidtune.captioning.frames import read_media

    captioner = Captioner(str(tiny_vlm), torch.device("cpu"), torch.float32, max_new_tokens=4)
    data = clips(tmp_path, ["a.mp4", "b.png", "c.mp4"])
    media: list[Media] = [read_media(data / name, captioner.settings, 8, 8, 3136 * 2)
                          for name in ("a.mp4", "b.png", "c.mp4")]
    asked = ["Describe this video.", "Describe this image.", "Describe this video."]
    together = captioner.caption(media, asked)
    assert together == [captioner.caption([one], [text])[0] for one, text in zip(media, asked, strict=True)]
    assert all(together)


def test_a_config_s_data_and_caption_sections_are_used_and_options_win(tiny_vlm: Path, tmp_path: Path, clips):
    data = clips(tmp_path / "data", ["a.mp4"])
    (data / "videos.txt").write_text("a.mp4\n")
    config = tmp_path / "caption.yaml"
    config.write_text(f"data: {{root: data}}\ncaption: {{model: {tiny_vlm}, prefix: fromconfig, max_pixels: 3136, "
                      "max_new_tokens: 3, device: cpu}\n")
    assert main(["caption", str(config), "--prefix", "fromflag"]) == 0
    assert (data / "prompts.txt").read_text().startswith("fromflag ")
    assert main(["caption", str(config), "caption.fps=0"]) == 2  # checked as the config is


def test_a_qwen3_vl_model_captions_clips_and_stills_with_their_frame_times(tiny_qwen3_vl: Path, tmp_path: Path,
                                                                          clips, capsys):
    from vidtune.captioning.frames import read_media

    data = clips(tmp_path, ["a.mp4", "b.png"])
    (data / "videos.txt").write_text("a.mp4\nb.png\n")
    assert main(["caption", str(data), "--model", str(tiny_qwen3_vl), "--batch-size", "2", "--fps", "8", *FAST]) == 0
    assert "wrote 2, kept 0" in capsys.readouterr().out
    assert all((data / "prompts.txt").read_text().splitlines())
    captioner = Captioner(str(tiny_qwen3_vl), torch.device("cpu"), torch.float32, max_new_tokens=2)
    clip = read_media(data / "a.mp4", captioner.settings, 8, 32, 4096)
    assert clip.times[:2] == [0.0, 0.125]
    assert "<0.1 seconds><|vision_start|><|video_pad|>" in captioner.prompt(clip, "Describe.", (5, 2, 2))


def test_ctrl_c_keeps_the_captions_made_and_says_to_run_again(tmp_path: Path, clips, monkeypatch, capsys):
    data = clips(tmp_path, ["a.mp4", "b.mp4"])
    (data / "videos.txt").write_text("a.mp4\nb.mp4\n")

    class StoppedOnTheSecond(FixedModel):
        def caption(self, batch, instructions):
            if self.asked:
                raise KeyboardInterrupt
            return super().caption(batch, instructions)

    monkeypatch.setattr(run, "load_captioner", lambda settings: StoppedOnTheSecond())
    assert main(["caption", str(data), "--device", "cpu"]) == 130
    assert "every caption made so far is written" in capsys.readouterr().err
    assert (data / "prompts.txt").read_text() == "clip of 2 frames\n"  # 1.1 s at the default 2 fps
