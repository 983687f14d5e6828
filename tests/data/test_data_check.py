"""`vidtune data check` on a mixed dataset: the table, the buckets, the JSON report, the paged contact sheet, and
exit 1 on every bad input (checked in-process, as the CLI runs it, to stay fast)."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import yaml
from PIL import Image

from vidtune.cli import main
from vidtune.config import build_config
from vidtune.data.synthetic import render_mixed_dataset
from vidtune.data.video import write_video

BUCKETS = [[9, 32, 64], [9, 64, 32], [9, 32, 32], [1, 32, 64], [1, 64, 32], [1, 32, 32]]


def write_config(tmp_path: Path, model: Path, datasets: list[dict], **data) -> Path:
    path = tmp_path / "check.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"name": "ltx-video", "pretrained": str(model), "max_sequence_length": data.pop("tokens", 128)},
        "data": {"datasets": datasets, "buckets": data.pop("buckets", BUCKETS), **data},
        "output_dir": str(tmp_path / "run"), "logging": {"progress": False}}))
    return path


def test_a_mixed_dataset_passes_with_its_table_buckets_report_and_sheet(tmp_path, tiny_model_dir, capsys):
    datasets = render_mixed_dataset(tmp_path / "data")
    config = write_config(tmp_path, tiny_model_dir("ltx-video"), datasets)
    code = main(["data", "check", str(config), "--report", str(tmp_path / "report.json"),
                 "--overview", str(tmp_path / "sheet.png")])
    out = capsys.readouterr().out
    assert code == 0, out
    lines = out.splitlines()
    row = next(line for line in lines if "portrait.mp4" in line)
    assert "folder/portrait.mp4" in row and "0.67 s" in row and "30" in row and "64x36" in row  # height x width
    assert "9x64x32, repeats 2" in row  # its bucket (frames x height x width), seen twice per epoch
    still = next(line for line in lines if "wide.png" in line)
    assert "pairs/videos.txt line 2" in still and "still" in still and "1x32x64" in still
    header = next(line for line in lines if line.startswith("#"))
    assert "size (HxW)" in header and "bucket (FxHxW)" in header
    assert "media.csv row 1 (line 2)" in out and "long.jsonl line 1" in out
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["ok"] is True and report["buckets"] == {"9x32x64": 2, "9x64x32": 1, "9x32x32": 1, "1x32x64": 1,
                                                          "1x64x32": 1, "1x32x32": 1}
    assert [clip["bucket"] for clip in report["clips"]][:2] == [[9, 32, 64], [1, 32, 64]]
    assert all(clip["problems"] == [] and clip["tokens"] > 0 for clip in report["clips"])
    assert (tmp_path / "sheet.png").stat().st_size > 1000


def test_every_bad_input_fails_the_check_and_is_named(tmp_path, tiny_model_dir, capsys):
    datasets = render_mixed_dataset(tmp_path / "data")
    bad = tmp_path / "bad"
    bad.mkdir()
    write_video(bad / "short.mp4", np.zeros((78, 32, 32, 3), np.uint8), 25)
    (bad / "short.txt").write_text("a short clip " + "and many words " * 40)  # also over the token limit
    write_video(bad / "no_caption.mp4", np.zeros((12, 32, 32, 3), np.uint8), 25)
    (bad / "broken.mp4").write_bytes(b"\x00" * 64)
    (bad / "broken.txt").write_text("a broken clip")
    (bad / "copy.mp4").write_bytes((tmp_path / "data/media/long.mp4").read_bytes())
    (bad / "copy.txt").write_text("the long clip again")
    (bad / "meta.jsonl").write_text('{"clip": "short.mp4", "caption": "x"}\n')
    datasets += [{"type": "folder", "root": str(bad)}, {"type": "metadata", "path": str(bad / "meta.jsonl")}]
    config = write_config(tmp_path, tiny_model_dir("ltx-video"), datasets, tokens=32, fps=25.0,
                          buckets=[[97, 32, 64], [97, 64, 32], [97, 32, 32], [1, 32, 32]])
    code = main(["data", "check", str(config), "--report", str(tmp_path / "report.json")])
    captured = capsys.readouterr()
    assert code == 1
    errors = captured.err
    assert "3.12 s at 25 fps gives 78 frames; the smallest bucket needs 97" in errors
    assert f"bad/no_caption.mp4 has no caption: looked for {bad / 'no_caption.txt'}" in errors
    assert "bad/broken.mp4" in errors and "it is not a video file" in errors
    assert "meta.jsonl line 1: no key 'video'; its keys are: 'clip', 'caption'" in errors
    assert "What to do:" in errors
    assert "NONE (see" in captured.out  # the table marks samples that fit no bucket
    warnings = captured.out.split("warning")[-1]
    assert "the caption has" in warnings and "the model reads 32" in warnings
    assert "same file content as long.jsonl line 1 (long.mp4)" in captured.out
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["ok"] is False
    short = next(clip for clip in report["clips"] if clip["path"].endswith("short.mp4"))
    assert short["bucket"] is None and "gives 78 frames" in short["problems"][0]
    assert any("tokens" in warning for warning in short["warnings"])


def test_a_bucket_the_family_refuses_fails_the_check_with_the_nearest_values(tmp_path, tiny_model_dir, capsys):
    datasets = render_mixed_dataset(tmp_path / "data")
    config = write_config(tmp_path, tiny_model_dir("ltx-video"), datasets, buckets=[[9, 32, 64], [10, 40, 32],
                                                                                     [1, 32, 32]])
    assert main(["data", "check", str(config)]) == 1
    errors = capsys.readouterr().err
    assert "data.buckets[1] = [10, 40, 32]: frames=10 must be 4k+1 for this model; nearest valid values: 9 or 13" \
        in errors


@pytest.mark.parametrize("pages", [1, 3])
def test_the_contact_sheet_is_paged(tmp_path, pages):
    from vidtune.config import DataConfig
    from vidtune.data.report import DataCheck, write_sheets
    from vidtune.data.sources import inspect_dataset

    data = DataConfig(datasets=render_mixed_dataset(tmp_path / "data"), buckets=BUCKETS)
    check = DataCheck(data.bucket_shapes(), inspect_dataset(data, progress=False), data=data)
    written = write_sheets(check, tmp_path / "sheet.png", per_page=-(-len(check.clips) // pages))
    assert [path.name for path in written] == ["sheet.png", *[f"sheet-{n}.png" for n in range(2, pages + 1)]]


def test_for_a_family_that_trains_on_sound_each_sample_says_whether_it_has_a_track(tmp_path, tiny_model_dir, capsys):
    from vidtune.data.overview import clip_details
    from vidtune.data.report import check_data
    from vidtune.models.registry import get_spec_class

    data = tmp_path / "data"
    data.mkdir()
    frames = np.zeros((12, 32, 32, 3), np.uint8)
    tone = 0.5 * np.sin(2 * np.pi * 440 * np.arange(8000) / 16000).astype(np.float32)
    write_video(data / "heard.mp4", frames, 24, audio=np.stack([tone, tone]), sample_rate=16000)
    write_video(data / "quiet.mp4", frames, 24)
    Image.new("RGB", (32, 32)).save(data / "still.png")
    for name in ("heard", "quiet", "still"):
        (data / f"{name}.txt").write_text(f"a {name} sample")

    def check(family: str) -> tuple[int, list[str], dict]:
        path = tmp_path / f"{family}.yaml"
        path.write_text(yaml.safe_dump({
            "model": {"name": family, "pretrained": str(tiny_model_dir(family))},
            "data": {"datasets": [{"type": "folder", "root": str(data)}], "buckets": [[9, 32, 32], [1, 32, 32]]},
            "output_dir": str(tmp_path / family), "logging": {"progress": False}}))
        code = main(["data", "check", str(path), "--report", str(tmp_path / f"{family}.json")])
        return code, capsys.readouterr().out.splitlines(), json.loads((tmp_path / f"{family}.json").read_text())

    code, lines, report = check("ltx-2")
    assert code == 0, "\n".join(lines)
    header = next(line for line in lines if line.startswith("#"))
    assert header.split()[-2:] == ["sound", "file"]
    sound_column = {line.split()[-1]: line.split()[-2] for line in lines if line.split()[-1:] and
                    line.split()[-1] in ("heard.mp4", "quiet.mp4", "still.png")}
    assert sound_column == {"heard.mp4": "yes", "quiet.mp4": "no", "still.png": "-"}
    summary = ("ltx-2: 1 of 3 samples have an audio track and train sound and video together; 2 without one train "
               "video only (the video does not attend to the audio stream).")
    assert summary in lines and report["sound"] == summary
    tracks = {Path(clip["path"]).name: clip["audio_track"] for clip in report["clips"]}
    assert tracks == {"heard.mp4": True, "quiet.mp4": False, "still.png": False}

    # The contact sheet's rows say it too (for such a family only).
    config = build_config(yaml.safe_load((tmp_path / "ltx-2.yaml").read_text()))
    spec = get_spec_class("ltx-2")(config.model, frame_rate=config.frame_rate)
    clips = {clip.video.name: clip for clip in check_data(config, spec, progress=False).clips}
    assert clip_details(clips["heard.mp4"], clips["heard.mp4"].info, sound=True).endswith(", sound track")
    assert clip_details(clips["quiet.mp4"], clips["quiet.mp4"].info, sound=True).endswith(", no sound track")
    assert "sound" not in clip_details(clips["heard.mp4"], clips["heard.mp4"].info)
    assert "sound" not in clip_details(clips["still.png"], clips["still.png"].info, sound=True)

    # A family that does not read sound shows no such column or line.
    code, lines, report = check("ltx-video")
    assert code == 0 and not any("sound" in line for line in lines) and report["sound"] is None


def test_a_shape_problem_keeps_every_line_under_its_item(tmp_path, tiny_model_dir, capsys):
    datasets = render_mixed_dataset(tmp_path / "data")
    config = write_config(tmp_path, tiny_model_dir("ltx-video"), datasets, buckets=None, frames=10, height=32,
                          width=32)
    assert main(["data", "check", str(config)]) == 1
    errors = capsys.readouterr().err
    item = next(number for number, line in enumerate(errors.splitlines()) if "The clip shape does not fit" in line)
    lines = errors.splitlines()[item:item + 3]
    assert lines[0].startswith("  - The clip shape does not fit the ltx-video model at")
    assert lines[1].startswith("    - data.frames=10")
    assert lines[2].startswith("    For comparison, the published LTX-Video checkpoints need"), lines


def test_a_clip_with_non_square_pixels_gives_its_size_as_shown_and_as_stored(tmp_path, tiny_model_dir, capsys):
    import av

    root = tmp_path / "clips"
    root.mkdir()
    with av.open(str(root / "pal.mp4"), "w") as container:  # 176x144 stored, pixels 128:117 wide (PAL 4:3 CIF)
        stream = container.add_stream("libx264", rate=25)
        stream.width, stream.height, stream.pix_fmt = 176, 144, "yuv420p"
        stream.codec_context.sample_aspect_ratio = Fraction(128, 117)
        for _ in range(12):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.zeros((144, 176, 3), np.uint8), "rgb24")))
        container.mux(stream.encode())
    (root / "videos.txt").write_text("pal.mp4\n")
    (root / "prompts.txt").write_text("a grey screen\n")
    config = write_config(tmp_path, tiny_model_dir("ltx-video"), [{"type": "pairs", "root": str(root)}],
                          buckets=[[9, 32, 32]])
    assert main(["data", "check", str(config), "--report", str(tmp_path / "report.json")]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "pal.mp4" in line)
    assert "144x193 (stored 144x176, pixel aspect 128:117)" in row and "9x32x32" in row
    assert ("tokens: the caption's length in the text encoder's tokens / the most it reads "
            "(model.max_sequence_length)") in out
    clip = json.loads((tmp_path / "report.json").read_text())["clips"][0]
    assert (clip["size"], clip["stored_size"], clip["pixel_aspect"]) == ([144, 193], [144, 176], "128:117")


def test_following_the_still_advice_keeps_the_clips_moving(tmp_path, tiny_model_dir, capsys):
    """A still beside clips trained at data.frames: the advice names the whole bucket list; a list of one-frame
    buckets alone would train every clip as a still, which the check reports (and training refuses)."""
    render_mixed_dataset(tmp_path / "data")
    pairs = [{"type": "pairs", "root": str(tmp_path / "data/pairs")}]  # landscape.mp4 (20 frames) and wide.png

    def check(**data) -> tuple[int, str, str]:
        path = tmp_path / "check.yaml"
        path.write_text(yaml.safe_dump({
            "model": {"name": "ltx-video", "pretrained": str(tiny_model_dir("ltx-video"))},
            "data": {"datasets": pairs, "frames": 9, **data}, "output_dir": str(tmp_path / "run"),
            "logging": {"progress": False}}))
        code = main(["data", "check", str(path), "--overview", str(tmp_path / "sheet.png"), "--report",
                     str(tmp_path / "report.json")])
        captured = capsys.readouterr()
        return code, captured.out, captured.err

    code, _, err = check(height=32, width=64)
    assert code == 1 and "set data.buckets to [[9, 32, 64], [1, 32, 64]] (the bucket list in full" in err, err
    code, out, err = check(buckets=[[1, 32, 64]])  # only the bucket the old advice named
    assert code == 1, out
    assert "1 clip would train as a still: every bucket of data.buckets has 1 frame ([[1, 32, 64]])" in err, err
    assert "e.g. data.buckets: [[9, 32, 64], [1, 32, 64]]" in err
    assert "The dataset is ready" not in out
    code, out, err = check(buckets=[[9, 32, 64], [1, 32, 64]])  # the advice followed
    assert code == 0, err
    report = json.loads((tmp_path / "report.json").read_text())
    assert [clip["bucket"] for clip in report["clips"]] == [[9, 32, 64], [1, 32, 64]]


def test_training_refuses_clips_that_would_train_as_stills(make_config):
    from vidtune.data.sources import DataError
    from vidtune.trainers import build_trainer

    trainer = build_trainer(make_config(data={"buckets": [[1, 32, 32]]}))
    with pytest.raises(DataError, match="4 clips would train as stills"):
        trainer.check_inputs()


def test_a_check_in_a_run_folder_leaves_the_runs_overview_as_it_trained(tmp_path, tiny_model_dir, capsys):
    """`vidtune data check my.yaml data.frames=...` after a run: the run's dataset_overview.png stays what the run
    trained; the check draws its own beside it and says so."""
    from vidtune import outputs

    datasets = render_mixed_dataset(tmp_path / "data")
    config = write_config(tmp_path, tiny_model_dir("ltx-video"), datasets)
    run = tmp_path / "run"
    run.mkdir()
    (run / outputs.RESOLVED_CONFIG).write_text("training:\n  steps: 10\n")  # a run trained here
    (run / outputs.DATASET_OVERVIEW).write_bytes(b"the run's own overview")
    code = main(["data", "check", str(config), "data.frames=201"])
    out = capsys.readouterr().out
    assert code in (0, 1)
    assert (run / outputs.DATASET_OVERVIEW).read_bytes() == b"the run's own overview"
    with Image.open(run / outputs.DATA_CHECK_OVERVIEW) as sheet:
        assert sheet.size[0] > 0
    assert f"keeps its own {outputs.DATASET_OVERVIEW}" in out and outputs.DATA_CHECK_OVERVIEW in out
