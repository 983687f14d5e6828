"""Decoding, frame selection and writing of real mp4 files (tiny clips, CPU only)."""

from __future__ import annotations

from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import pytest
import torch

from vidtune.data import video
from vidtune.data.video import (
    ClipTooShortError,
    ClipWindow,
    VideoDecodeError,
    VideoInfo,
    probe_video,
    read_clip,
    read_frames,
    required_source_frames,
    select_frame_indices,
    write_video,
)

STEP = 4  # brightness step per frame: frame i is a flat gray of value STEP * (i % 64)


def gray_clip(
    path: Path, num_frames: int, fps: float = 30, size: int = 32, keyframe_interval: int = 10
) -> Path:
    """A clip whose frame index can be read back from its brightness."""
    frames = np.empty((num_frames, size, size, 3), dtype=np.uint8)
    for index in range(num_frames):
        frames[index] = STEP * (index % 64)
    # Lossless, so every level survives; lossy x264 merges neighbouring flat grays.
    return write_video(path, frames, fps, crf=0, keyframe_interval=keyframe_interval)


def frame_numbers(clip: torch.Tensor) -> list[int]:
    """Read gray_clip's frame indices (mod 64) back from decoded brightness."""
    values = (clip.mean(dim=(1, 2, 3)) + 1.0) * 127.5
    return [round(value / STEP) for value in values.tolist()]


def noise_clip(path: Path, num_frames: int) -> Path:
    """Random frames: large, incompressible packets, so a cut-off file is really missing frames."""
    frames = np.random.default_rng(0).integers(0, 256, (num_frames, 32, 32, 3), dtype=np.uint8)
    return write_video(path, frames, 24)


def info(num_frames: int, fps: float) -> VideoInfo:
    return VideoInfo(path=Path("/clips/a.mp4"), num_frames=num_frames, fps=fps, width=64, height=64)


# ------------------------------------------------------------------------------------------------ probe


def test_probe_reports_frames_fps_and_size(tmp_path: Path) -> None:
    frames = np.zeros((30, 48, 64, 3), dtype=np.uint8)
    result = probe_video(write_video(tmp_path / "a.mp4", frames, 24))
    assert (result.num_frames, result.fps, result.width, result.height) == (30, 24.0, 64, 48)
    assert result.duration == pytest.approx(1.25)
    assert result.path == tmp_path / "a.mp4"


def test_probe_counts_packets_when_header_has_no_frame_count(tmp_path: Path) -> None:
    path = tmp_path / "a.mkv"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=Fraction(25))
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        for _ in range(12):
            frame = av.VideoFrame.from_ndarray(np.zeros((32, 32, 3), np.uint8), format="rgb24")
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    with av.open(str(path)) as container:
        assert container.streams.video[0].frames == 0  # the case the fallback exists for
    assert probe_video(path).num_frames == 12


def test_probe_rejects_random_bytes(tmp_path: Path) -> None:
    path = tmp_path / "fake.mp4"
    path.write_bytes(np.random.default_rng(1).integers(0, 256, 4000, dtype=np.uint8).tobytes())
    with pytest.raises(VideoDecodeError) as caught:
        probe_video(path)
    assert "not a video file, or the file is damaged" in caught.value.reason
    assert str(path) in str(caught.value)


def test_probe_rejects_cut_off_mp4(tmp_path: Path) -> None:
    path = noise_clip(tmp_path / "a.mp4", 40)
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(VideoDecodeError) as caught:
        probe_video(path)
    assert "incomplete" in caught.value.reason
    assert "should hold 40 frames" in caught.value.reason


def test_probe_rejects_mp4_cut_inside_header(tmp_path: Path) -> None:
    path = noise_clip(tmp_path / "a.mp4", 40)
    path.write_bytes(path.read_bytes()[:200])
    with pytest.raises(VideoDecodeError, match="damaged"):
        probe_video(path)


def test_probe_rejects_audio_only_file(tmp_path: Path) -> None:
    path = tmp_path / "song.m4a"
    with av.open(str(path), "w") as container:
        stream = container.add_stream("aac", rate=44100)
        for _ in range(5):
            frame = av.AudioFrame.from_ndarray(np.zeros((1, 1024), np.float32), format="fltp", layout="mono")
            frame.sample_rate = 44100
            container.mux(stream.encode(frame))
        container.mux(stream.encode(None))
    with pytest.raises(VideoDecodeError, match="no video"):
        probe_video(path)


def test_probe_rejects_missing_and_empty_files(tmp_path: Path) -> None:
    with pytest.raises(VideoDecodeError, match="does not exist"):
        probe_video(tmp_path / "nope.mp4")
    (tmp_path / "empty.mp4").touch()
    with pytest.raises(VideoDecodeError, match="empty"):
        probe_video(tmp_path / "empty.mp4")


# ------------------------------------------------------------------------------------------ frame choice


def test_consecutive_frames_without_fps() -> None:
    assert select_frame_indices(info(100, 24), 5, None) == [0, 1, 2, 3, 4]
    assert select_frame_indices(info(100, 24), 3, None, start=10) == [10, 11, 12]


def test_fps_resampling_picks_nearest_source_frames() -> None:
    assert select_frame_indices(info(100, 30), 5, 15) == [0, 2, 4, 6, 8]
    assert select_frame_indices(info(100, 24), 4, 8, start=5) == [5, 8, 11, 14]
    assert select_frame_indices(info(100, 25), 4, 10) == [0, 3, 5, 8]  # 2.5 rounds up: nearest, not even
    assert select_frame_indices(info(100, 12), 4, 24) == [0, 1, 1, 2]  # faster than source repeats frames


def test_required_source_frames() -> None:
    assert required_source_frames(49, None, 24) == 49
    assert required_source_frames(25, 15, 30) == 49
    assert required_source_frames(10, 8, 24) == 28


def test_too_short_clip_says_what_it_has_and_needs() -> None:
    with pytest.raises(ClipTooShortError) as caught:
        select_frame_indices(info(20, 24), 49, None)
    message = str(caught.value)
    assert "20 frames (0.83 s at 24 fps)" in message
    assert "49 frames are needed" in message
    assert (caught.value.available, caught.value.needed) == (20, 49)
    with pytest.raises(ClipTooShortError) as caught:
        select_frame_indices(info(40, 30), 25, 15)
    assert caught.value.needed == 49


# ------------------------------------------------------------------------------------------------ read


def test_read_clip_shape_dtype_and_range(tmp_path: Path) -> None:
    frames = np.random.default_rng(2).integers(0, 256, (6, 40, 56, 3), dtype=np.uint8)
    clip = read_clip(write_video(tmp_path / "a.mp4", frames, 24), ClipWindow(4, 24, 32))
    assert clip.shape == (4, 3, 24, 32)
    assert clip.dtype == torch.float32
    assert clip.min() >= -1.0 and clip.max() <= 1.0
    assert clip.max() - clip.min() > 1.0  # real content, not a constant


def banded_frame(bands: list[tuple[int, int, int]], height: int, width: int, vertical: bool) -> np.ndarray:
    """Four equal colour bands, left to right (or top to bottom when vertical)."""
    image = np.zeros((height, width, 3), dtype=np.uint8)
    size = (height if vertical else width) // len(bands)
    for number, color in enumerate(bands):
        if vertical:
            image[number * size : (number + 1) * size] = color
        else:
            image[:, number * size : (number + 1) * size] = color
    return image


RED, BLACK, WHITE, GREEN = (255, 0, 0), (0, 0, 0), (255, 255, 255), (0, 255, 0)


@pytest.mark.parametrize("vertical", [False, True])
def test_read_clip_covers_then_center_crops(tmp_path: Path, vertical: bool) -> None:
    # A 2:1 frame (red | black | white | green) read as a square: scaling to cover then cropping the
    # center keeps only black | white. Squashing instead of cropping would show red and green at the edges.
    height, width = (256, 128) if vertical else (128, 256)
    image = banded_frame([RED, BLACK, WHITE, GREEN], height, width, vertical)
    path = write_video(tmp_path / "a.mp4", np.stack([image] * 3), 24)
    clip = read_clip(path, ClipWindow(1, 32, 32))[0]  # [3, 32, 32]
    if vertical:
        clip = clip.transpose(1, 2)  # compare columns as if it were the horizontal case
    assert clip.shape == (3, 32, 32)
    assert clip[:, :, :12].max() < -0.85  # left of the crop: black
    assert clip[:, :, 20:].min() > 0.85  # right of the crop: white
    assert (clip[0] - clip[1]).abs().max() < 0.15  # no red or green anywhere


def test_read_clip_resamples_fps_by_timestamp(tmp_path: Path) -> None:
    path = gray_clip(tmp_path / "a.mp4", 60, fps=30)
    assert frame_numbers(read_clip(path, ClipWindow(10, 16, 16, fps=15))) == list(range(0, 20, 2))
    assert frame_numbers(read_clip(path, ClipWindow(4, 16, 16, fps=10, start=20))) == [20, 23, 26, 29]


def test_read_clip_with_start_seeks_to_the_right_frames(tmp_path: Path) -> None:
    path = gray_clip(tmp_path / "a.mp4", 60, fps=30, keyframe_interval=10)
    assert frame_numbers(read_clip(path, ClipWindow(5, 16, 16, start=37))) == [37, 38, 39, 40, 41]
    assert frame_numbers(read_clip(path, ClipWindow(3, 16, 16, start=57))) == [57, 58, 59]


def test_read_clip_past_the_end_is_too_short(tmp_path: Path) -> None:
    path = gray_clip(tmp_path / "a.mp4", 20)
    with pytest.raises(ClipTooShortError) as caught:
        read_clip(path, ClipWindow(5, 16, 16, start=18))
    assert (caught.value.available, caught.value.needed) == (20, 23)


class CountingContainer:
    """Wraps a PyAV container and counts the packets read from the file."""

    def __init__(self, container: av.container.InputContainer, counts: list[int]) -> None:
        self._container = container
        self._counts = counts

    def demux(self, *args, **kwargs):
        for packet in self._container.demux(*args, **kwargs):
            if packet.size:
                self._counts[-1] += 1
            yield packet

    def __getattr__(self, name: str):
        return getattr(self._container, name)

    def __enter__(self) -> CountingContainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self._container.close()


def test_read_clip_decodes_only_what_it_needs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = gray_clip(tmp_path / "long.mp4", 300, keyframe_interval=30)
    counts: list[int] = []
    real_open = av.open

    def counting_open(*args, **kwargs):
        counts.append(0)
        return CountingContainer(real_open(*args, **kwargs), counts)

    monkeypatch.setattr(video.av, "open", counting_open)
    assert probe_video(path).num_frames == 300
    assert counts[-1] == 300  # the wrapper sees every packet when the whole file is read

    assert frame_numbers(read_clip(path, ClipWindow(9, 16, 16))) == list(range(9))
    assert 9 <= counts[-1] <= 20

    # Keyframes at least every 30 frames: decoding starts at the one before frame 200, not at frame 0.
    clip = read_clip(path, ClipWindow(9, 16, 16, start=200))
    assert frame_numbers(clip) == [index % 64 for index in range(200, 209)]
    assert 9 <= counts[-1] <= 45


class LateSeekContainer(CountingContainer):
    """Its first seek lands one second later than asked, as in a badly indexed file."""

    def __init__(self, container: av.container.InputContainer, seeks: list[int]) -> None:
        super().__init__(container, [0])
        self._seeks = seeks

    def seek(self, offset: int, **kwargs) -> None:
        self._seeks.append(offset)
        late = int(1 / kwargs["stream"].time_base) if len(self._seeks) == 1 else 0
        self._container.seek(offset + late, **kwargs)


def test_read_clip_starts_over_when_a_seek_overshoots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = gray_clip(tmp_path / "a.mp4", 60, fps=30, keyframe_interval=10)
    seeks: list[int] = []
    real_open = av.open
    monkeypatch.setattr(video.av, "open", lambda *a, **k: LateSeekContainer(real_open(*a, **k), seeks))
    assert frame_numbers(read_clip(path, ClipWindow(3, 16, 16, start=20))) == [20, 21, 22]
    assert len(seeks) == 2 and seeks[1] == 0  # the late seek, then back to the start


def test_rotated_phone_clip_is_turned_upright(tmp_path: Path) -> None:
    path = tmp_path / "phone.mp4"
    image = banded_frame([WHITE, BLACK, BLACK, BLACK], 32, 64, vertical=False)  # white on the left
    with av.open(str(path), "w") as container:
        stream = container.add_stream("libx264", rate=Fraction(24))
        stream.width, stream.height, stream.pix_fmt = 64, 32, "yuv420p"
        stream.set_display_rotation(90)  # displayed turned a quarter counter-clockwise
        for _ in range(3):
            container.mux(stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")))
        container.mux(stream.encode(None))
    result = probe_video(path)
    assert (result.width, result.height) == (32, 64)
    upright = read_frames(path, [0])[0]
    assert upright.shape == (64, 32, 3)
    assert upright[-10:].min() > 200 and upright[:40].max() < 50  # the left edge is now the bottom


# ------------------------------------------------------------------------------------------------ write


def test_write_video_float_frames_round_trip(tmp_path: Path) -> None:
    frames = torch.full((5, 3, 16, 24), 0.5)
    frames[:, :, :, :12] = -0.5
    path = write_video(tmp_path / "a.mp4", frames, 12)
    assert probe_video(path).num_frames == 5
    clip = read_clip(path, ClipWindow(5, 16, 24))
    assert clip[:, :, :, :10].mean().item() == pytest.approx(-0.5, abs=0.05)
    assert clip[:, :, :, 14:].mean().item() == pytest.approx(0.5, abs=0.05)


def test_write_video_pads_odd_sizes(tmp_path: Path) -> None:
    result = probe_video(write_video(tmp_path / "odd.mp4", np.zeros((3, 33, 35, 3), np.uint8), 24))
    assert (result.width, result.height) == (36, 34)


def test_write_video_rejects_bad_layout(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="uint8"):
        write_video(tmp_path / "a.mp4", np.zeros((3, 3, 16, 16), np.int32), 24)
    assert not (tmp_path / "a.mp4").exists()


def test_write_video_never_leaves_a_half_written_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    old = gray_clip(tmp_path / "old.mp4", 5)
    calls = {"n": 0}
    real = video._to_video_frame

    def failing(image: np.ndarray) -> av.VideoFrame:
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("disk full")
        return real(image)

    monkeypatch.setattr(video, "_to_video_frame", failing)
    frames = np.zeros((8, 16, 16, 3), np.uint8)
    with pytest.raises(RuntimeError, match="disk full"):
        write_video(tmp_path / "new.mp4", frames, 24)
    calls["n"] = 0
    with pytest.raises(RuntimeError, match="disk full"):
        write_video(old, frames, 24)

    assert sorted(p.name for p in tmp_path.iterdir()) == ["old.mp4"]  # no new file, no temp files
    assert probe_video(old).num_frames == 5  # the previous video is untouched
