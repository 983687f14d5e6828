"""The torch dataset, batching, the synthetic shapes dataset and the overview contact sheet."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from vidtune.data import overview
from vidtune.data.dataset import VideoCaptionDataset, collate_samples
from vidtune.data.sources import Clip, load_text_pair_dataset, read_lines, validate_clips
from vidtune.data.synthetic import BACKGROUNDS, COLORS, render_shapes_dataset
from vidtune.data.video import VideoDecodeError, read_frames, write_video


@pytest.fixture(scope="module")
def shapes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return render_shapes_dataset(
        tmp_path_factory.mktemp("shapes"), num_clips=3, num_frames=12, height=40, width=48
    )


def test_dataset_items(shapes: Path) -> None:
    samples = load_text_pair_dataset(shapes)
    dataset = VideoCaptionDataset(samples, [(8, 32, 32)])
    assert len(dataset) == 3
    item = dataset[(5, 1, 0)]
    assert item["position"] == 5
    assert item["video"].shape == (8, 3, 32, 32)
    assert item["video"].dtype == torch.float32
    assert item["video"].min() >= -1.0 and item["video"].max() <= 1.0
    assert item["caption"] == read_lines(shapes / "prompts.txt")[1]
    assert item["index"] == 1


def test_dataset_with_fps_takes_every_other_frame(shapes: Path) -> None:
    samples = load_text_pair_dataset(shapes)
    full = VideoCaptionDataset(samples, [(12, 32, 32)])[(0, 0, 0)]["video"]
    half = VideoCaptionDataset(samples, [(6, 32, 32)], fps=12)[(0, 0, 0)]["video"]
    torch.testing.assert_close(half, full[::2])


def test_collate_through_a_dataloader(shapes: Path) -> None:
    samples = load_text_pair_dataset(shapes)
    loader = DataLoader(
        VideoCaptionDataset(samples, [(4, 16, 24)]),
        batch_sampler=[[(0, 0, 0), (1, 1, 0)]],
        collate_fn=collate_samples,
    )
    batch = next(iter(loader))
    assert batch["video"].shape == (2, 4, 3, 16, 24)
    assert batch["caption"] == [sample.caption for sample in samples[:2]]
    assert batch["index"].dtype == torch.long
    assert batch["index"].tolist() == [0, 1]


def test_collate_rejects_an_empty_batch() -> None:
    with pytest.raises(ValueError):
        collate_samples([])


def test_dataset_error_names_the_line(tmp_path: Path) -> None:
    clip = write_video(tmp_path / "short.mp4", np.zeros((3, 16, 16, 3), np.uint8), 24)
    dataset = VideoCaptionDataset([Clip(clip, "a cat", 0, 7)], [(5, 16, 16)])
    with pytest.raises(VideoDecodeError) as caught:
        dataset[(0, 0, 0)]
    assert "(videos.txt line 7)" in str(caught.value)
    assert "it has 3 frames" in str(caught.value)


# ------------------------------------------------------------------------------------------- synthetic


def test_shapes_dataset_files_and_captions(shapes: Path) -> None:
    assert read_lines(shapes / "videos.txt") == [f"clips/clip_{i:03d}.mp4" for i in range(3)]
    captions = read_lines(shapes / "prompts.txt")
    assert [caption.split()[2] for caption in captions] == ["circle", "square", "triangle"]
    assert all(caption.startswith("a ") and caption.endswith(" background") for caption in captions)
    infos = validate_clips(load_text_pair_dataset(shapes), 12, None, progress=False)
    assert [(info.num_frames, info.width, info.height, info.fps) for info in infos] == [
        (12, 48, 40, 24.0)
    ] * 3


def foreground_center(image: np.ndarray, background: tuple[int, int, int]) -> np.ndarray:
    """(x, y) center of the pixels that differ clearly from the background."""
    mask = np.abs(image.astype(int) - background).sum(axis=-1) > 90
    ys, xs = np.nonzero(mask)
    return np.array([xs.mean(), ys.mean()])


def test_shapes_move_as_their_captions_say(shapes: Path) -> None:
    directions = {
        "from left to right": (1, 0),
        "from right to left": (-1, 0),
        "from top to bottom": (0, 1),
        "from bottom to top": (0, -1),
    }
    for sample in load_text_pair_dataset(shapes):
        background = next(name for name in BACKGROUNDS if sample.caption.endswith(f"on a {name} background"))
        color = sample.caption.split()[1]
        assert color in COLORS
        direction = next(words for words in directions if words in sample.caption)
        first, last = read_frames(sample.video, [0, 11])
        assert np.abs(first[0, 0].astype(int) - BACKGROUNDS[background]).max() < 12  # corner: background
        rgb = BACKGROUNDS[background]
        moved = foreground_center(last, rgb) - foreground_center(first, rgb)
        assert np.sign(np.round(moved / 10)).tolist() == list(directions[direction]), sample.caption


def test_shapes_dataset_is_deterministic(tmp_path: Path) -> None:
    a = render_shapes_dataset(tmp_path / "a", num_clips=2, num_frames=3, height=16, width=16, seed=5)
    b = render_shapes_dataset(tmp_path / "b", num_clips=2, num_frames=3, height=16, width=16, seed=5)
    c = render_shapes_dataset(tmp_path / "c", num_clips=6, num_frames=3, height=16, width=16, seed=6)
    assert read_lines(a / "prompts.txt") == read_lines(b / "prompts.txt")
    assert (a / "clips/clip_001.mp4").read_bytes() == (b / "clips/clip_001.mp4").read_bytes()
    assert read_lines(c / "prompts.txt")[:2] != read_lines(a / "prompts.txt")


# -------------------------------------------------------------------------------------------- overview


def test_overview_png(shapes: Path, tmp_path: Path) -> None:
    samples = load_text_pair_dataset(shapes)
    infos = validate_clips(samples, 12, None, progress=False)
    path = overview.write_dataset_overview(samples, infos, tmp_path / "overview.png")
    with Image.open(path) as image:
        assert image.format == "PNG"
        size = image.size
        pixels = np.asarray(image.convert("RGB"))
    assert size == (overview.WIDTH, overview.HEADER_H + 3 * overview.ROW_H)
    assert size == (3 * 168 + 8 + 460, 30 + 3 * 106)  # the layout itself, not just its own formula
    # The first thumbnail is the 48x40 frame scaled to 108x90 and centered: black bars left and right,
    # clip 1's background just inside its top-left corner.
    background = next(
        rgb for name, rgb in BACKGROUNDS.items() if samples[0].caption.endswith(f"{name} background")
    )
    top = overview.HEADER_H + overview.PAD
    left = overview.PAD + (overview.THUMB_W - 108) // 2
    assert np.abs(pixels[top + 3, left + 3].astype(int) - background).max() < 20
    assert pixels[top + 3, left - 3].max() == 0  # letterbox bar
    assert sorted(p.name for p in tmp_path.iterdir()) == ["overview.png"]  # no temp file left behind


def test_overview_caps_rows_and_notes_the_rest(shapes: Path, tmp_path: Path) -> None:
    samples = load_text_pair_dataset(shapes)
    infos = validate_clips(samples, 12, None, progress=False)
    path = overview.write_dataset_overview(samples, infos, tmp_path / "sheet.png", max_rows=2)
    with Image.open(path) as image:
        assert image.size == (overview.WIDTH, overview.HEADER_H + 2 * overview.ROW_H + overview.NOTE_H)
        note = np.asarray(image.convert("L"))[-overview.NOTE_H :]
    assert note.max() > 100  # the "... and 1 more clip" note is drawn


def test_overview_rejects_mismatched_infos(shapes: Path, tmp_path: Path) -> None:
    samples = load_text_pair_dataset(shapes)
    with pytest.raises(ValueError):
        overview.write_dataset_overview(samples, [], tmp_path / "x.png")
    assert not (tmp_path / "x.png").exists()
