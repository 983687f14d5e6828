"""Per-clip inputs (vidtune/data/inputs.py): where each layout names them, every bad one reported at once with its
file and line, and each read with its clip's own window (times, crop, resize)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers.datasets import pair_samples, write_mask
from vidtune.config import DataConfig
from vidtune.data.dataset import VideoCaptionDataset, collate_samples
from vidtune.data.input_files import input_reads, read_input
from vidtune.data.inputs import INPUT_KINDS, ClipInputs
from vidtune.data.sources import load_dataset
from vidtune.data.video import ClipWindow, write_video
from vidtune.errors import DataError


def _data(*datasets: dict, frames: int = 9, **options) -> DataConfig:
    return DataConfig(datasets=list(datasets), frames=frames, height=32, width=32, num_workers=0, **options)


def _pairs(shapes_dataset: Path, root: Path, count: int = 2) -> list[Path]:
    clips = [clip.video for clip in pair_samples(shapes_dataset)][:count]
    root.mkdir(parents=True, exist_ok=True)
    (root / "videos.txt").write_text("".join(f"{path}\n" for path in clips))
    (root / "prompts.txt").write_text("".join(f"caption {number}\n" for number in range(len(clips))))
    return clips


def test_the_kinds_table_names_each_kind_once_with_its_media():
    assert set(INPUT_KINDS) >= {"mask", "reference", "reference_images", "pose", "face", "background"}
    assert INPUT_KINDS["reference_images"].media == "images" and INPUT_KINDS["mask"].media == "video"
    assert all(kind.name == name for name, kind in INPUT_KINDS.items())


def test_pairs_lists_name_each_clips_inputs_line_by_line(shapes_dataset, tmp_path):
    root = tmp_path / "pairs"
    _pairs(shapes_dataset, root, 3)
    mask = write_mask(root / "masks" / "a.png", 48, 48)
    refs = [write_mask(root / f"ref{n}.png", 20, 30) for n in range(2)]
    (root / "masks.txt").write_text("masks/a.png\n\nmasks/a.png\n")  # clip 2 has none
    (root / "references.txt").write_text("ref0.png | ref1.png\nref1.png\n\n")
    clips = load_dataset(_data({"type": "pairs", "root": str(root),
                                "inputs": {"mask": "masks.txt", "reference_images": "references.txt"}}),
                         progress=False)
    assert clips[0].inputs == {"mask": (mask,), "reference_images": tuple(refs)}
    assert clips[1].inputs == {"reference_images": (refs[1],)}
    assert clips[2].inputs == {"mask": (mask,)}
    assert isinstance(clips[0].inputs, ClipInputs) and hash(clips[0])  # a Clip stays a frozen, hashable value


def test_a_folder_takes_files_named_after_a_clip_as_its_inputs_not_as_samples(shapes_dataset, tmp_path):
    root = tmp_path / "folder"
    root.mkdir()
    source = pair_samples(shapes_dataset)[0].video
    shutil.copy(source, root / "walk.mp4")
    (root / "walk.txt").write_text("a walk\n")
    mask = write_mask(root / "walk.mask.mp4", 24, 24, frames=33)
    refs = [write_mask(root / f"walk.reference_images.{n}.png", 16, 16) for n in (2, 1)]
    clips = load_dataset(_data({"type": "folder", "root": str(root)}), progress=False)
    assert [clip.video.name for clip in clips] == ["walk.mp4"]  # no caption asked for the inputs
    assert clips[0].inputs == {"mask": (mask,), "reference_images": (refs[1], refs[0])}  # in their numbers' order


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_metadata_columns_name_each_rows_inputs(shapes_dataset, tmp_path, suffix):
    clips = [clip.video for clip in pair_samples(shapes_dataset)][:2]
    mask = write_mask(tmp_path / "m.png", 48, 48)
    refs = [write_mask(tmp_path / f"r{n}.png", 8, 8) for n in range(2)]
    path = tmp_path / f"clips{suffix}"
    if suffix == ".csv":
        path.write_text(f"video,caption,mask_path,refs\n{clips[0]},one,m.png,r0.png|r1.png\n{clips[1]},two,,\n")
    else:
        path.write_text(json.dumps({"video": str(clips[0]), "caption": "one", "mask_path": "m.png",
                                    "refs": ["r0.png", "r1.png"]}) + "\n"
                        + json.dumps({"video": str(clips[1]), "caption": "two"}) + "\n")
    found = load_dataset(_data({"type": "metadata", "path": str(path),
                                "inputs": {"mask": "mask_path", "reference_images": "refs"}}), progress=False)
    assert found[0].inputs == {"mask": (mask,), "reference_images": tuple(refs)}
    assert found[1].inputs == {}


def test_every_bad_input_is_reported_at_once_with_its_file_and_line(shapes_dataset, tmp_path):
    root = tmp_path / "pairs"
    clips = [clip.video for clip in pair_samples(shapes_dataset)]
    root.mkdir()
    (root / "videos.txt").write_text("".join(f"{path}\n" for path in [*clips, clips[0]]))
    (root / "prompts.txt").write_text("".join(f"c{n}\n" for n in range(5)))
    (root / "broken.png").write_bytes(b"not an image at all")
    write_mask(root / "wide.png", 48, 96)  # another aspect than the 48x48 clips
    write_mask(root / "short.mp4", 48, 48, frames=10)  # the clips have 33 frames
    (root / "masks.txt").write_text("gone.png\nbroken.png\nwide.png\nshort.mp4\n")  # no line 5
    table = tmp_path / "more.csv"
    table.write_text(f"video,caption\n{clips[0]},x\n")
    with pytest.raises(DataError) as raised:
        load_dataset(_data({"type": "pairs", "root": str(root), "inputs": {"mask": "masks.txt"}},
                           {"type": "metadata", "path": str(table), "inputs": {"mask": "mask_path"}}),
                     progress=False, required_inputs=("mask",))
    message = str(raised.value)
    assert "masks.txt line 1: the mask 'gone.png' was not found" in message
    assert "videos.txt line 5" in message and "it has no mask, which this run needs" in message
    assert "more.csv has no column 'mask_path' (line 1" in message
    assert "videos.txt line 2" in message and "broken.png cannot be read" in message
    assert "videos.txt line 3" in message and "wide.png is 48x96, another shape than the clip's 48x48" in message
    assert "videos.txt line 4" in message and "short.mp4 is shorter than the clip" in message


def test_a_run_that_needs_a_mask_names_every_clip_without_one(shapes_dataset, tmp_path):
    root = tmp_path / "pairs"
    _pairs(shapes_dataset, root, 2)
    write_mask(root / "m.png", 48, 48)
    (root / "masks.txt").write_text("m.png\n\n")
    data = _data({"type": "pairs", "root": str(root), "inputs": {"mask": "masks.txt"}})
    with pytest.raises(DataError, match=r"videos.txt line 2 .*it has no mask, which this run needs"):
        load_dataset(data, progress=False, required_inputs=("mask",))
    with_rect = _data({"type": "pairs", "root": str(root), "mask_rect": [0, 0, 0.5, 1]})
    assert len(load_dataset(with_rect, progress=False, required_inputs=("mask",))) == 2


def _timed_frames(frames: int, height: int, width: int, step: int) -> np.ndarray:
    """Frame k: grey level 8 * step * k (its time, at any rate), a white bar over the second quarter of the width."""
    array = np.zeros((frames, height, width, 3), dtype=np.uint8)
    for k in range(frames):
        array[k] = 8 * step * k
    array[:, :, width // 4 : width // 2] = 255
    return array


def test_an_input_of_another_size_and_frame_rate_is_read_at_the_clips_times_and_crop(tmp_path):
    """The clip: 64x48 at 24 fps; its mask: 32x24 at 12 fps, the same picture at the same times. Read through the
    dataset with the clip's window, the mask equals the clip's frames (crop and resize included)."""
    root = tmp_path / "pairs"
    root.mkdir()
    write_video(root / "clip.mp4", _timed_frames(24, 48, 64, 1), 24.0)
    write_video(root / "mask.mp4", _timed_frames(12, 24, 32, 2), 12.0)
    (root / "videos.txt").write_text("clip.mp4\n")
    (root / "prompts.txt").write_text("a bar\n")
    (root / "masks.txt").write_text("mask.mp4\n")
    entry = {"type": "pairs", "root": str(root), "inputs": {"mask": "masks.txt"}}
    data = DataConfig(datasets=[entry], frames=5, height=24, width=24, num_workers=0, fps=12.0)
    (clip,) = load_dataset(data, progress=False, required_inputs=("mask",))
    dataset = VideoCaptionDataset([clip], data.bucket_shapes(), data.fps, data.resize, "start", inputs=("mask",))
    item = dataset[(0, 0, 0)]
    video, mask = item["video"].permute(1, 0, 2, 3), item["inputs"]["mask"]  # both [3, F, H, W]
    assert mask.shape == video.shape == (3, 5, 24, 24)
    assert (mask - video).abs().mean() < 0.03
    # At the clip's own rate the mask's frames are those nearest each time: frames 4..8 of the clip are 2, 2.5 -> 3, ...
    window = ClipWindow(5, 24, 24, None, 4, "crop")
    assert input_reads(clip, "mask", window)[0].indices == (2, 3, 3, 4, 4)
    assert (read_input(clip, "mask", window)[:, 0] - read_input(clip, "mask", window)[:, 2]).abs().mean() > 0.05
    batch = collate_samples([item, item])
    assert [tuple(value.shape) for value in batch["inputs"]["mask"]] == [(3, 5, 24, 24)] * 2


def test_a_rectangle_mask_is_drawn_on_the_clip_and_cropped_like_it(shapes_dataset, tmp_path):
    root = tmp_path / "pairs"
    _pairs(shapes_dataset, root, 1)
    data = _data({"type": "pairs", "root": str(root), "mask_rect": [0.0, 0.0, 0.5, 1.0]})
    (clip,) = load_dataset(data, progress=False, required_inputs=("mask",))
    mask = read_input(clip, "mask", ClipWindow(9, 32, 32))
    assert mask.shape == (3, 9, 32, 32)
    assert torch.all(mask[:, :, :, :15] == 1.0) and torch.all(mask[:, :, :, 17:] == -1.0)


def test_a_still_mask_of_another_size_covers_the_same_region(shapes_dataset, tmp_path):
    root = tmp_path / "pairs"
    _pairs(shapes_dataset, root, 1)
    write_mask(root / "m.png", 96, 96, white=(0.5, 0.0, 1.0, 1.0))  # twice the clip's size: the right half
    (root / "masks.txt").write_text("m.png\n")
    (clip,) = load_dataset(_data({"type": "pairs", "root": str(root), "inputs": {"mask": "masks.txt"}}),
                           progress=False)
    mask = read_input(clip, "mask", ClipWindow(9, 32, 32))
    assert mask.shape == (3, 1, 32, 32)  # one still for every frame
    assert torch.all(mask[:, :, :, :15] < -0.9) and torch.all(mask[:, :, :, 17:] > 0.9)


def test_a_control_clip_of_another_size_and_frame_rate_is_read_at_the_clips_times(tmp_path):
    root = tmp_path / "pairs"
    root.mkdir()
    write_video(root / "clip.mp4", _timed_frames(24, 48, 64, 1), 24.0)
    write_video(root / "control.mp4", _timed_frames(12, 24, 32, 2), 12.0)
    write_video(root / "short.mp4", _timed_frames(6, 24, 32, 2), 12.0)
    (root / "videos.txt").write_text("clip.mp4\n")
    (root / "prompts.txt").write_text("a bar\n")
    (root / "controls.txt").write_text("control.mp4\n")
    data = DataConfig(root=str(root), frames=5, height=24, width=24, num_workers=0, fps=12.0)
    (clip,) = load_dataset(data, progress=False)
    dataset = VideoCaptionDataset([clip], data.bucket_shapes(), data.fps, data.resize, "start")
    video = dataset.read(clip, clip.video, 5, 24, 24, 4)  # from the clip's frame 4: the control's frame 2
    control = dataset.read(clip, clip.control, 5, 24, 24, 4)
    assert (control - video).abs().mean() < 0.03
    (root / "controls.txt").write_text("short.mp4\n")
    with pytest.raises(DataError, match=r"videos.txt line 1 .*control clip short.mp4 is shorter than the clip"):
        load_dataset(data, progress=False)
