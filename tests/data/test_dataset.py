"""The torch dataset, batching, the synthetic shapes dataset and the overview contact sheet."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torch.utils.data import DataLoader

from tests.helpers.datasets import pair_samples
from vidtune.data import overview
from vidtune.data.dataset import VideoCaptionDataset, collate_samples
from vidtune.data.sources import Clip, read_lines
from vidtune.data.synthetic import BACKGROUNDS, COLORS, render_shapes_dataset
from vidtune.data.video import VideoDecodeError, read_frames, write_video


@pytest.fixture(scope="module")
def shapes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return render_shapes_dataset(
        tmp_path_factory.mktemp("shapes"), num_clips=3, num_frames=12, height=40, width=48
    )


def test_dataset_items(shapes: Path) -> None:
    samples = pair_samples(shapes)
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
    samples = pair_samples(shapes)
    full = VideoCaptionDataset(samples, [(12, 32, 32)])[(0, 0, 0)]["video"]
    half = VideoCaptionDataset(samples, [(6, 32, 32)], fps=12)[(0, 0, 0)]["video"]
    torch.testing.assert_close(half, full[::2])


def test_collate_through_a_dataloader(shapes: Path) -> None:
    samples = pair_samples(shapes)
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
    infos = [sample.info for sample in pair_samples(shapes, frames=12)]
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
    for sample in pair_samples(shapes):
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


def _bucketed(shapes: Path, **data):
    from vidtune.config import DataConfig
    from vidtune.data.sources import inspect_dataset

    config = DataConfig(root=str(shapes), **data)
    return config, inspect_dataset(config, progress=False)


def test_overview_png_shows_each_clip_cropped_to_its_bucket(shapes: Path, tmp_path: Path) -> None:
    data, report = _bucketed(shapes, frames=8, height=32, width=32)
    path = overview.write_dataset_overview(report.clips, data, tmp_path / "overview.png")
    with Image.open(path) as image:
        assert image.format == "PNG"
        size = image.size
        pixels = np.asarray(image.convert("RGB"))
    assert size == (overview.WIDTH, overview.HEADER_H + 3 * overview.ROW_H)
    assert size == (3 * 168 + 8 + 460, 50 + 3 * 106)  # the layout itself, not just its own formula
    # The first thumbnail is the 40x48 clip cropped to its 32x32 bucket, scaled to 88x88 and centred: the clip's
    # background just inside its corner, the sheet's (not a letterbox of the wider frame) just outside it.
    background = next(
        rgb for name, rgb in BACKGROUNDS.items() if report.clips[0].caption.endswith(f"{name} background")
    )
    top = overview.HEADER_H + overview.PAD + 1
    left = overview.PAD + (overview.THUMB_W - 88) // 2
    assert np.abs(pixels[top + 3, left + 3].astype(int) - background).max() < 20
    assert pixels[top + 3, left - 4].tolist() == list(overview._BACKGROUND)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["overview.png"]  # no temp file left behind


def test_no_text_of_the_overview_runs_past_its_right_edge(shapes: Path, tmp_path: Path, monkeypatch) -> None:
    """Long names, captions and reasons are wrapped or cut to the sheet, measured in its font."""
    import dataclasses

    data, report = _bucketed(shapes, frames=8, height=32, width=32)
    long = "a very long caption with many wide words such as MMMMMMMM and WWWWWWWW, " * 6
    clips = [dataclasses.replace(clip, caption=long, source=f"a/long/folder/name/{'w' * 60}/videos.txt")
             for clip in report.clips]
    drawn: list[tuple[int, str]] = []
    text = overview.ImageDraw.ImageDraw.text

    def record(self, xy, content, *args, **kwargs):
        drawn.append((xy[0], content))
        return text(self, xy, content, *args, **kwargs)

    monkeypatch.setattr(overview.ImageDraw.ImageDraw, "text", record)
    problems = {0: ["it is too short: " + "x" * 300]}
    overview.write_dataset_overview(clips, data, tmp_path / "sheet.png", problems, ["videos.txt line 9: " + long],
                                    header="H" * 200)
    font = overview.sheet_font()
    assert drawn and all(left + font.getlength(content) <= overview.WIDTH - overview.PAD for left, content in drawn)
    assert any(content.endswith("...") for _, content in drawn)  # what did not fit is cut visibly


def test_overview_caps_rows_and_notes_the_rest(shapes: Path, tmp_path: Path) -> None:
    data, report = _bucketed(shapes, frames=8, height=32, width=32)
    path = overview.write_dataset_overview(report.clips, data, tmp_path / "sheet.png", max_rows=2)
    with Image.open(path) as image:
        assert image.size == (overview.WIDTH, overview.HEADER_H + 2 * overview.ROW_H + overview.NOTE_H)
        note = np.asarray(image.convert("L"))[-overview.NOTE_H :]
    assert note.max() > 100  # the "... and 1 more sample" note is drawn


def test_overview_shows_what_trains_and_marks_what_will_not(shapes: Path, tmp_path: Path) -> None:
    from vidtune.data.video import ClipWindow, decode_clip

    folder = tmp_path / "data"
    folder.mkdir()
    clip = sorted((shapes / "clips").glob("*.mp4"))[0]
    Image.fromarray(read_frames(clip, [0])[0]).save(folder / "still.png")
    (folder / "broken.mp4").write_bytes(b"\x00" * 64)
    (folder / "videos.txt").write_text(f"{clip}\nbroken.mp4\nmissing.mp4\nstill.png\n")
    (folder / "prompts.txt").write_text("a clip\na broken file\na missing file\na still\n")
    data, report = _bucketed(folder, frames=8, height=32, width=32, fps=16.0)  # no one-frame bucket
    rows = overview.sheet_rows(report.clips, data, report.sample_problems)
    assert [(row.clip.video.name, row.trains) for row in rows] == [(clip.name, True), ("broken.mp4", False),
                                                                   ("still.png", False)]
    trained, broken, still = rows
    # What trains: the window read at 16 fps from a 24 fps clip (source frames 0, 2, 3, 5, ..., 11), first,
    # middle and last, resized to the bucket as training resizes them.
    assert trained.window == (0, 11) and trained.shape == (8, 32, 32)
    expected = decode_clip(clip, ClipWindow(8, 32, 32, fps=16.0))
    assert len(trained.frames) == 3 and all(frame.shape == (32, 32, 3) for frame in trained.frames)
    assert np.array_equal(np.stack(trained.frames), expected[[0, 4, 7]])
    # What does not: shown, each with its reason; the still once, at its own size; the broken file without frames.
    assert len(still.frames) == 1 and still.frames[0].shape == (40, 48, 3)
    assert any("no bucket has 1 frame" in problem for problem in still.problems)
    assert broken.frames == () and "not a video file" in broken.problems[0]
    assert overview.summary(report.clips, report.sample_problems, report.source_problems) == (
        "3 samples: 1 clip and 0 stills train, 2 will not (in red); 1 line of the sources gives no sample (listed "
        "at the end)")
    path = overview.write_dataset_overview(report.clips, data, tmp_path / "sheet.png", report.sample_problems,
                                           report.source_problems)
    with Image.open(path) as image:
        pixels = np.asarray(image.convert("RGB"))
    assert pixels.shape[0] > overview.HEADER_H + 3 * overview.ROW_H  # and the line that gives no sample below
    red = np.all(pixels == overview._MARK, axis=-1)
    edge = overview.PAD // 2 + 1  # the left edge of a row's red frame
    marked = [red[overview.HEADER_H + number * overview.ROW_H + overview.ROW_H // 2, edge] for number in range(3)]
    assert marked == [False, True, True]
    assert red[overview.HEADER_H + 3 * overview.ROW_H:].any()  # the missing file's line, in red
