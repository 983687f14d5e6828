"""Several sources (pairs, folder, CSV, JSONL), stills beside clips, buckets and resizing, on real files; every bad
input reported at once with its file and line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from vidtune.config import DataConfig
from vidtune.data.dataset import VideoCaptionDataset
from vidtune.data.sources import inspect_dataset, load_dataset
from vidtune.data.synthetic import render_mixed_dataset
from vidtune.data.video import ClipWindow, read_clip, write_video
from vidtune.errors import DataError

BUCKETS = [[9, 32, 64], [9, 64, 32], [9, 32, 32], [1, 32, 64], [1, 64, 32], [1, 32, 32]]


@pytest.fixture(scope="module")
def mixed(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    folder = tmp_path_factory.mktemp("mixed")
    return folder, render_mixed_dataset(folder)


def data(datasets: list[dict], **extra) -> DataConfig:
    return DataConfig(datasets=datasets, buckets=extra.pop("buckets", BUCKETS), num_workers=0, **extra)


def test_every_source_kind_mixed_keeps_each_caption_with_its_sample(mixed) -> None:
    folder, datasets = mixed
    clips = load_dataset(data(datasets), progress=False)
    names = [clip.video.name for clip in clips]
    assert names == ["landscape.mp4", "wide.png", "portrait.mp4", "tall.jpg", "odd.mp4", "square.webp", "long.mp4"]
    assert [clip.index for clip in clips] == list(range(7))
    assert [clip.is_image for clip in clips] == [False, True, False, True, False, True, False]
    assert [clip.where for clip in clips] == [
        "pairs/videos.txt line 1", "pairs/videos.txt line 2", "folder/portrait.mp4", "folder/stills/tall.jpg",
        "media.csv row 1 (line 2)", "media.csv row 2 (line 3)", "long.jsonl line 1"]
    assert [clip.repeats for clip in clips] == [1, 1, 2, 2, 1, 1, 1]
    assert clips[2].caption == (folder / "folder/portrait.txt").read_text().strip()
    assert clips[4].caption in (folder / "media.csv").read_text()
    assert clips[6].caption.startswith("vtstyle a ")  # caption_prefix
    shapes = [tuple(BUCKETS[clip.bucket]) for clip in clips]
    assert shapes == [(9, 32, 64), (1, 32, 64), (9, 64, 32), (1, 64, 32), (9, 32, 32), (1, 32, 32), (9, 32, 64)]


def test_samples_decode_to_their_bucket_and_stills_to_one_frame(mixed) -> None:
    clips = load_dataset(data(mixed[1]), progress=False)
    dataset = VideoCaptionDataset(clips, [tuple(b) for b in BUCKETS], frame_sampling="random", seed=1)
    for clip in clips:
        item = dataset[(3, clip.index, clip.bucket)]
        assert item["video"].shape == (BUCKETS[clip.bucket][0], 3, *BUCKETS[clip.bucket][1:])
        assert item["caption"] == clip.caption


def test_random_frames_of_a_long_clip_differ_per_visit_and_repeat_per_position(mixed) -> None:
    clips = load_dataset(data(mixed[1]), progress=False)
    long = clips[6]
    dataset = VideoCaptionDataset(clips, [tuple(b) for b in BUCKETS], frame_sampling="random", seed=1)
    first, again, other = (dataset[(p, 6, long.bucket)]["video"] for p in (10, 10, 11))
    assert torch.equal(first, again)
    assert not torch.equal(first, other)
    start = VideoCaptionDataset(clips, [tuple(b) for b in BUCKETS], frame_sampling="start")[(10, 6, long.bucket)]
    torch.testing.assert_close(start["video"], read_clip(long.video, ClipWindow(9, 32, 64)))


def test_resize_modes(tmp_path: Path) -> None:
    image = np.zeros((20, 40, 3), np.uint8)
    image[:, :, 0] = 255  # a red 2:1 frame
    Image.fromarray(image).save(tmp_path / "red.png")
    write_video(tmp_path / "red.mp4", np.repeat(image[None], 3, axis=0), 24)
    for path in (tmp_path / "red.png", tmp_path / "red.mp4"):
        crop = read_clip(path, ClipWindow(1, 16, 16, resize="crop"))
        fit = read_clip(path, ClipWindow(1, 16, 16, resize="fit"))
        stretch = read_clip(path, ClipWindow(1, 16, 16, resize="stretch"))
        assert crop.shape == fit.shape == stretch.shape == (1, 3, 16, 16)
        assert crop[0, 0].min() > 0.8 and stretch[0, 0].min() > 0.8  # red everywhere
        assert fit[0, 0, 0].max() < -0.9 and fit[0, 0, 8].min() > 0.8  # black bars above, red in the middle


# ----- bad input --------------------------------------------------------------------------------------------------
def test_every_problem_of_every_source_is_reported_at_once_with_file_and_line(tmp_path: Path, mixed) -> None:
    _, datasets = mixed
    bad = tmp_path / "bad"
    (bad / "shots").mkdir(parents=True)
    write_video(bad / "shots/short.mp4", np.zeros((5, 32, 32, 3), np.uint8), 25)
    write_video(bad / "shots/fine.mp4", np.zeros((12, 32, 32, 3), np.uint8), 25)
    (bad / "shots/fine.txt").write_text("a fine clip")
    (bad / "shots/short.txt").write_text("a short clip")
    write_video(bad / "shots/no_caption.mp4", np.zeros((12, 32, 32, 3), np.uint8), 25)
    (bad / "shots/broken.png").write_bytes(b"not a png at all")
    (bad / "shots/broken.txt").write_text("a broken still")
    (bad / "wrong_columns.csv").write_text("clip,caption\nshots/fine.mp4,a cat\n")
    (bad / "rows.jsonl").write_text('{"video": "shots/fine.mp4", "caption": "ok"}\n{"video": "shots/fine.mp4"\n'
                                    '{"file": "x.mp4", "caption": "a"}\n{"video": "shots/gone.mp4", "caption": "b"}\n')
    sources = [*datasets,
               {"type": "folder", "root": str(bad / "shots")},
               {"type": "metadata", "path": str(bad / "wrong_columns.csv")},
               {"type": "metadata", "path": str(bad / "rows.jsonl")}]
    with pytest.raises(DataError) as caught:
        load_dataset(data(sources, buckets=[[9, 32, 32], [9, 32, 64], [9, 64, 32], [1, 32, 32]]), progress=False)
    problems = caught.value.problems
    text = "\n".join(problems)
    assert f"shots/no_caption.mp4 has no caption: looked for {bad / 'shots/no_caption.txt'}" in text
    assert ("wrong_columns.csv has no column 'video' (line 1, the header row); its columns are: 'clip', 'caption'"
            in text)
    assert "rows.jsonl line 2: this is not valid JSON" in text
    assert "rows.jsonl line 3: no key 'video'; its keys are: 'file', 'caption'" in text
    assert f"rows.jsonl line 4: 'shots/gone.mp4' was not found (looked for {bad / 'shots/gone.mp4'})" in text
    assert f"shots/broken.png ({bad / 'shots/broken.png'}): it is not an image Pillow can read" in text
    assert "shots/short.mp4" in text and "0.20 s at its own 25 fps gives 5 frames; the smallest bucket needs 9" in text
    assert len(problems) == 7, text  # the good sources add none
    assert str(caught.value).rstrip().splitlines()[-1].startswith("What to do:")


def test_a_missing_column_in_a_csv_and_an_unreadable_clip_in_pairs(tmp_path: Path) -> None:
    (tmp_path / "clips").mkdir()
    (tmp_path / "clips/bad.mp4").write_bytes(b"\x00" * 100)
    (tmp_path / "videos.txt").write_text("clips/bad.mp4\n")
    (tmp_path / "prompts.txt").write_text("a cat\n")
    report = inspect_dataset(DataConfig(root=str(tmp_path), frames=9, height=32, width=32), progress=False)
    [problem] = report.problems()
    assert problem.startswith(f"videos.txt line 1 ({tmp_path / 'clips/bad.mp4'}): it is not a video file")


def test_a_still_without_a_one_frame_bucket_says_which_bucket_to_add(mixed) -> None:
    with pytest.raises(DataError) as caught:
        load_dataset(data(mixed[1], buckets=[[9, 32, 64], [9, 64, 32]]), progress=False)
    assert len(caught.value.problems) == 3
    assert "no bucket has 1 frame" in caught.value.problems[0] and "[1, 32, 64]" in caught.value.problems[0]


def test_folder_warns_about_files_it_does_not_use(tmp_path: Path) -> None:
    write_video(tmp_path / "a.mp4", np.zeros((12, 32, 32, 3), np.uint8), 25)
    (tmp_path / "a.txt").write_text("a clip\n\nover two lines\n")
    (tmp_path / "orphan.txt").write_text("no clip")
    (tmp_path / "notes.docx").write_bytes(b"x")
    (tmp_path / ".vidtune-cache").mkdir()
    (tmp_path / ".vidtune-cache/x.mp4").write_bytes(b"x")  # hidden folders are not datasets
    report = inspect_dataset(DataConfig(datasets=[{"type": "folder", "root": str(tmp_path)}], frames=9,
                                        height=32, width=32), progress=False)
    assert not report.problems() and [c.caption for c in report.clips] == ["a clip over two lines"]
    assert any("orphan.txt is a caption with no clip" in w for w in report.warnings)
    assert any("notes.docx is not a clip or image" in w for w in report.warnings)


def test_config_paths_in_datasets_are_relative_to_the_config_file(tmp_path: Path, mixed) -> None:
    from vidtune.config import load_config

    (tmp_path / "sub").mkdir()
    path = tmp_path / "sub" / "my.yaml"
    path.write_text(json.dumps({"model": {"name": "ltx-video", "pretrained": "x/y"},
                                "data": {"datasets": [{"type": "folder", "root": "clips"},
                                                      {"type": "metadata", "path": "../meta.csv"}]}}))
    config = load_config(path)
    assert config.data.datasets[0].root == str(tmp_path / "sub" / "clips")
    assert config.data.datasets[1].path == str(tmp_path / "meta.csv")
