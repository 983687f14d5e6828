"""Reading and writing video files with PyAV.

Clips are decoded lazily: only the frames a sample needs are decoded, seeking to the nearest earlier
keyframe first, so reading a few frames from a long clip costs a few frames, not the whole file.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import av
import numpy as np
import torch
from av.video.reformatter import Interpolation
from PIL import Image, ImageOps

from vidtune.errors import VidtuneError
from vidtune.files import atomic_path

# Formats FFmpeg uses for still images: they open as a one-frame "video", which is never what a user meant.
_IMAGE_FORMATS = ("image2", "_pipe", "gif_pipe", "webp_pipe")
# Stills a dataset may hold beside its clips: read with Pillow, one-frame samples.
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".webp")
VIDEO_SUFFIXES = (".mp4", ".mov", ".m4v", ".mkv", ".webm", ".avi")
RESIZE_MODES = ("crop", "fit", "stretch")


def is_image_path(path: str | os.PathLike[str]) -> bool:
    return Path(path).suffix.lower() in IMAGE_SUFFIXES


class VideoDecodeError(VidtuneError):
    """A file could not be read as a video (missing, not a video, damaged or incomplete)."""

    def __init__(self, path: str | os.PathLike[str], reason: str, where: str = "") -> None:
        self.path = Path(path)
        self.reason = reason
        place = f" ({where})" if where else ""
        super().__init__(f"Could not use the video {self.path}{place}: {reason}")


class ClipTooShortError(VidtuneError):
    """A clip has fewer frames than a sample needs."""

    def __init__(self, path: str | os.PathLike[str], available: int, needed: int, source_fps: float) -> None:
        self.path = Path(path)
        self.available = available
        self.needed = needed
        self.source_fps = source_fps
        self.reason = (
            f"it is too short: it has {describe_length(available, source_fps)}; {needed} frames are needed. "
            "Use a longer clip or read fewer frames."
        )
        super().__init__(f"The video {self.path} {self.reason}")


@dataclass(frozen=True)
class VideoInfo:
    """What a probe learned about a clip. Width and height are as displayed (rotation and the pixels' aspect
    applied), which is what is resized to a bucket; `pixel_aspect` is the file's sample aspect ratio (a stored
    pixel's width over its height; 1: square) and, when it is not 1, `stored_size` the (height, width) its frames
    are stored at."""

    path: Path
    num_frames: int
    fps: float
    width: int
    height: int
    has_audio: bool = False  # the file holds an audio track
    pixel_aspect: Fraction = Fraction(1)
    stored_size: tuple[int, int] | None = None

    @property
    def duration(self) -> float:
        """Length in seconds (0 when the frame rate is unknown)."""
        return self.num_frames / self.fps if self.fps > 0 else 0.0


def describe_size(info: VideoInfo) -> str:
    """The size as the config orders it, height x width ('144x176'); a file whose pixels are not square also says
    how it is stored: '144x193 (stored 144x176, pixel aspect 128:117)'."""
    size = f"{info.height}x{info.width}"
    if info.pixel_aspect == 1:
        return size
    stored_height, stored_width = info.stored_size or (info.height, info.width)
    return (f"{size} (stored {stored_height}x{stored_width}, pixel aspect "
            f"{info.pixel_aspect.numerator}:{info.pixel_aspect.denominator})")


def format_fps(fps: float) -> str:
    """24.0 -> '24', 29.97002997 -> '29.97'."""
    return f"{fps:.2f}".rstrip("0").rstrip(".")


def describe_length(num_frames: int, fps: float) -> str:
    """'20 frames (0.83 s at 24 fps)', in words a user can check against their editor."""
    noun = "frame" if num_frames == 1 else "frames"
    if fps <= 0:
        return f"{num_frames} {noun}"
    return f"{num_frames} {noun} ({num_frames / fps:.2f} s at {format_fps(fps)} fps)"


# --------------------------------------------------------------------------------------------------
# Probing


def probe_video(path: str | os.PathLike[str]) -> VideoInfo:
    """Open a clip, decode its first frame and count its frames without decoding the rest.

    Frames are counted by demuxing every packet (cheap: no decoding). The header's frame count is
    only used to notice a file that was cut off: a header promising more frames than the file holds.
    """
    path = Path(path)
    _check_file(path)
    try:
        with av.open(str(path)) as container:
            stream = _video_stream(container, path)
            fps = _stream_fps(stream)
            first, stored, shown = _first_frame_and_packet_count(container, stream, path)
            promised = stream.frames
            width, height = _display_size(first, stream)
            pixel_aspect = _sample_aspect(stream)
            has_audio = bool(container.streams.audio)
    except av.FFmpegError as error:
        raise VideoDecodeError(path, _damaged_reason(error)) from error
    if promised > 0 and stored < promised:
        raise VideoDecodeError(
            path,
            f"the file is incomplete (probably cut off while copying or downloading): it should hold "
            f"{promised} frames but only {stored} are there. Copy or export the clip again.",
        )
    return VideoInfo(path=path, num_frames=shown, fps=fps, width=width, height=height, has_audio=has_audio,
                     pixel_aspect=pixel_aspect, stored_size=(first.height, first.width) if pixel_aspect != 1 else None)


def probe_image(path: str | os.PathLike[str]) -> VideoInfo:
    """A still's size as displayed (EXIF rotation applied), as a one-frame VideoInfo; reads the header only."""
    path = Path(path)
    _check_file(path, "image")
    try:
        with Image.open(path) as image:
            image.verify()  # checks the file's structure without decoding the pixels
        with Image.open(path) as image:
            width, height = ImageOps.exif_transpose(image).size if _rotated(image) else image.size
    except (OSError, SyntaxError, ValueError) as error:
        raise VideoDecodeError(path, _damaged_image_reason(error)) from error
    return VideoInfo(path=path, num_frames=1, fps=0.0, width=width, height=height)


def _rotated(image: Image.Image) -> bool:
    return image.getexif().get(0x0112, 1) in (5, 6, 7, 8)  # EXIF orientations that swap width and height


def _damaged_image_reason(error: Exception) -> str:
    return (
        "it is not an image Pillow can read, or the file is damaged. Open it in an image viewer to check, and "
        f"save it again (for example as .png). (Details: {error})"
    )


def _check_file(path: Path, what: str = "video") -> None:
    try:
        if not path.exists():
            raise VideoDecodeError(path, "the file does not exist.")
        if path.is_dir():
            raise VideoDecodeError(path, f"this is a folder, not a {what} file.")
        if path.stat().st_size == 0:
            raise VideoDecodeError(path, f"the file is empty (0 bytes). Copy or export the {what} again.")
        with path.open("rb"):  # a file that cannot be read is named as such, not as a damaged one
            pass
    except PermissionError:
        raise VideoDecodeError(path, "permission denied: you may not read this file (or a folder above it). Give "
                               f"yourself read permission (chmod u+r on the file) or copy the {what} somewhere you "
                               "can read it.") from None
    except OSError as error:
        raise VideoDecodeError(path, f"the disk would not give it back ({error.strerror or error}). Check the disk "
                               f"it is on, or copy the {what} to another one.") from None


def _damaged_reason(error: Exception) -> str:
    detail = getattr(error, "strerror", None) or str(error)
    return (
        "it is not a video file, or the file is damaged. Open it in a video player to check, and "
        f"export it again (for example as .mp4). (Details: {detail})"
    )


def _video_stream(container: av.container.InputContainer, path: Path) -> av.video.stream.VideoStream:
    """The first real video stream; cover art in audio files does not count."""
    format_name = container.format.name
    if format_name == "image2" or format_name.endswith("_pipe"):
        raise VideoDecodeError(
            path, "this is a still image, not a video. Use a video clip (for example .mp4)."
        )
    for stream in container.streams.video:
        if not stream.disposition & av.stream.Disposition.attached_pic:
            return stream
    if not container.streams.audio:  # nothing readable at all: a damaged header, not an audio file
        raise VideoDecodeError(path, _damaged_reason(ValueError("no streams found")))
    raise VideoDecodeError(
        path, "the file has no video in it (is it an audio file?). Use a video clip (for example .mp4)."
    )


def _stream_fps(stream: av.video.stream.VideoStream) -> float:
    """Frames per second, or 0.0 when the file does not say."""
    for rate in (stream.average_rate, stream.guessed_rate, stream.base_rate):
        if rate:
            return float(rate)
    return 0.0


def _first_frame_and_packet_count(
    container: av.container.InputContainer, stream: av.video.stream.VideoStream, path: Path
) -> tuple[av.VideoFrame, int, int]:
    """Decode until the first picture comes out, then only count the remaining packets.

    Returns (first frame, packets stored, packets shown): packets marked "discard" (cut by an edit list)
    are stored but never come out of the decoder, so they do not count as frames.
    """
    first: av.VideoFrame | None = None
    stored = shown = 0
    for packet in container.demux(stream):
        if packet.size:
            stored += 1
            shown += not packet.is_discard
        if first is None:
            frames = packet.decode()  # the final empty packet flushes the decoder
            if frames:
                first = frames[0]
    if first is None:
        raise VideoDecodeError(path, _damaged_reason(ValueError("no picture could be decoded")))
    return first, stored, shown


def _rotation_turns(frame: av.VideoFrame) -> int:
    """How many quarter turns counter-clockwise the frame must be rotated for display (phone clips)."""
    return round(getattr(frame, "rotation", 0) / 90) % 4  # older PyAV has no rotation: assume upright


def _sample_aspect(stream: av.video.stream.VideoStream) -> Fraction:
    sar = stream.sample_aspect_ratio
    return Fraction(sar) if sar and sar > 0 else Fraction(1)


def _display_size(frame: av.VideoFrame, stream: av.video.stream.VideoStream) -> tuple[int, int]:
    width = max(1, round(frame.width * _sample_aspect(stream)))
    height = frame.height
    if _rotation_turns(frame) % 2:
        width, height = height, width
    return width, height


# --------------------------------------------------------------------------------------------------
# Choosing frames


def _resampled_indices(num_frames: int, fps: float | None, source_fps: float, start: int) -> list[int]:
    """Source frame indices for a sample, without checking the clip's length."""
    if num_frames < 1:
        raise ValueError(f"num_frames must be at least 1, got {num_frames}")
    if start < 0:
        raise ValueError(f"start must be >= 0, got {start}")
    if fps is None:
        return list(range(start, start + num_frames))
    if fps <= 0:
        raise ValueError(f"fps must be positive, got {fps}")
    if source_fps <= 0:
        raise VidtuneError(
            f"Cannot read frames at {format_fps(fps)} fps: the clip does not say its own frame rate. "
            "Export it again, or leave the frame rate unset to take consecutive frames."
        )
    step = source_fps / fps
    # Nearest source frame to each target timestamp; the epsilon keeps exact halves from flipping.
    return [start + math.floor(k * step + 0.5 + 1e-9) for k in range(num_frames)]


def required_source_frames(num_frames: int, fps: float | None, source_fps: float) -> int:
    """How many source frames (from the start) a clip needs to yield `num_frames` at `fps`."""
    return _resampled_indices(num_frames, fps, source_fps, 0)[-1] + 1


def frames_available(source_frames: int, fps: float | None, source_fps: float) -> int:
    """How many frames a clip of `source_frames` yields when read at `fps` (None: its own rate)."""
    if fps is None or source_frames <= 0:
        return max(source_frames, 0)
    count = max(1, int((source_frames - 0.5) * fps / source_fps) + 1)  # a first guess, corrected exactly below
    while count > 1 and required_source_frames(count, fps, source_fps) > source_frames:
        count -= 1
    while required_source_frames(count + 1, fps, source_fps) <= source_frames:
        count += 1
    return count


def select_frame_indices(info: VideoInfo, num_frames: int, fps: float | None, start: int = 0) -> list[int]:
    """Source frame indices to read: consecutive frames, or resampled to `fps` by nearest timestamp.

    A 30 fps clip read at 15 fps takes every second frame; reading faster than the source repeats frames.
    """
    indices = _resampled_indices(num_frames, fps, info.fps, start)
    if indices[-1] >= info.num_frames:
        raise ClipTooShortError(info.path, info.num_frames, indices[-1] + 1, info.fps)
    return indices


# --------------------------------------------------------------------------------------------------
# Reading


@dataclass(frozen=True)
class ClipWindow:
    """Which frames of a clip a sample is, and the size they are read at: `frames` frames from source frame `start`,
    consecutive (`fps` None) or resampled to `fps` by nearest timestamp, resized to `height` x `width` by `resize`:
    `crop` covers H x W keeping the aspect ratio, then cuts the centre; `fit` fits inside and pads with black;
    `stretch` scales to H x W exactly."""

    frames: int
    height: int
    width: int
    fps: float | None = None
    start: int = 0
    resize: str = "crop"


def read_clip(path: str | os.PathLike[str], window: ClipWindow) -> torch.Tensor:
    """Decode the frames of `window` as a float32 tensor [F, 3, H, W] in [-1, 1]."""
    return frames_to_tensor(decode_clip(path, window))


def decode_clip(path: str | os.PathLike[str], window: ClipWindow) -> np.ndarray:
    """`read_clip`'s frames as decoded and resized, uint8 [F, H, W, 3] (a quarter of the float32 size, to keep)."""
    path = Path(path)
    if is_image_path(path):
        if window.frames != 1:
            raise ClipTooShortError(path, 1, window.frames, 0.0)
        return _image_array(path, window.height, window.width, window.resize)
    _check_file(path)
    try:
        with av.open(str(path)) as container:
            stream = _video_stream(container, path)
            stream.thread_type = "AUTO"
            source_fps = _stream_fps(stream)
            indices = _resampled_indices(window.frames, window.fps, source_fps, window.start)
            images = _decode_indices(container, stream, indices, path, (window.height, window.width), window.resize)
    except av.FFmpegError as error:
        raise VideoDecodeError(path, _damaged_reason(error)) from error
    return np.stack([images[index] for index in indices])


def frames_to_tensor(array: np.ndarray) -> torch.Tensor:
    """uint8 [F, H, W, 3] -> float32 [F, 3, H, W] in [-1, 1]."""
    return torch.from_numpy(array).permute(0, 3, 1, 2).contiguous().float().div_(127.5).sub_(1.0)


def read_image(path: str | os.PathLike[str], height: int, width: int, resize: str = "crop") -> torch.Tensor:
    """A still as a one-frame sample [1, 3, H, W] in [-1, 1], resized like a clip's frames."""
    return frames_to_tensor(_image_array(Path(path), height, width, resize))


def _image_array(path: Path, height: int, width: int, resize: str) -> np.ndarray:
    """A still as uint8 [1, H, W, 3], resized like a clip's frames."""
    _check_file(path, "image")
    try:
        with Image.open(path) as opened:
            image = ImageOps.exif_transpose(opened).convert("RGB")
    except (OSError, SyntaxError, ValueError) as error:
        raise VideoDecodeError(path, _damaged_image_reason(error)) from error
    return resize_image(image, height, width, resize)[None]


def resize_image(image: Image.Image, height: int, width: int, resize: str) -> np.ndarray:
    """An RGB image as uint8 [H, W, 3], resized to (height, width) as a still's frame is (see `ClipWindow`)."""
    if resize == "stretch":
        image = image.resize((width, height), Image.Resampling.LANCZOS)
    elif resize == "fit":
        image = ImageOps.pad(image, (width, height), Image.Resampling.LANCZOS, color=(0, 0, 0))
    else:
        image = ImageOps.fit(image, (width, height), Image.Resampling.LANCZOS)
    return np.array(image)  # a writable copy for torch


def read_frames(path: str | os.PathLike[str], indices: list[int], size: tuple[int, int] | None = None,
                resize: str = "crop") -> list[np.ndarray]:
    """Decode the given source frames (in the order given) as displayed, uint8 RGB arrays [H, W, 3]; with `size`
    (height, width), resized to it as training resizes them (see `ClipWindow` for `resize`)."""
    path = Path(path)
    if is_image_path(path) and size is not None:
        return [_image_array(path, size[0], size[1], resize)[0] for _ in indices]
    if is_image_path(path):  # a still: its one frame, whatever is asked
        _check_file(path, "image")
        try:
            with Image.open(path) as opened:
                image = np.asarray(ImageOps.exif_transpose(opened).convert("RGB"))
        except (OSError, SyntaxError, ValueError) as error:
            raise VideoDecodeError(path, _damaged_image_reason(error)) from error
        return [image for _ in indices]
    _check_file(path)
    try:
        with av.open(str(path)) as container:
            stream = _video_stream(container, path)
            images = _decode_indices(container, stream, indices, path, size, resize)
    except av.FFmpegError as error:
        raise VideoDecodeError(path, _damaged_reason(error)) from error
    return [images[index] for index in indices]


def _decode_indices(
    container: av.container.InputContainer,
    stream: av.video.stream.VideoStream,
    indices: list[int],
    path: Path,
    size: tuple[int, int] | None,
    resize: str = "crop",
) -> dict[int, np.ndarray]:
    """RGB images of the wanted frames by index, decoding no further than the last one."""
    wanted = set(indices)
    first, last = min(wanted), max(wanted)
    images: dict[int, np.ndarray] = {}
    seen = 0
    for index, frame in _frames_from(container, stream, first):
        seen = index + 1
        if index in wanted:
            images[index] = _to_rgb(frame, stream, size, resize)
        if index >= last:
            return images
    raise ClipTooShortError(path, seen, last + 1, _stream_fps(stream))


def _frames_from(
    container: av.container.InputContainer, stream: av.video.stream.VideoStream, first: int
) -> Iterator[tuple[int, av.VideoFrame]]:
    """Yield (index, frame) in display order, starting at or before `first`.

    Far from the start, seek to the keyframe before `first` and number frames from their timestamp.
    If the seek lands too late (odd files), start over from the beginning.
    """
    fps = _stream_fps(stream)
    if first > 0 and fps > 0:
        origin = _start_seconds(stream)
        # A few frames of margin: some formats seek by decode time, which runs ahead of display time.
        target = origin + max(0, first - 4) / fps
        container.seek(int(target / stream.time_base), stream=stream, backward=True)
        index: int | None = None
        for frame in _decoded_frames(container, stream):
            if index is None:
                if frame.time is None:
                    break
                index = max(0, round((frame.time - origin) * fps))
                if index > first:
                    break
            yield index, frame
            index += 1
        else:
            return  # end of file reached after a good seek
        container.seek(stream.start_time or 0, stream=stream, backward=True)
    for index, frame in enumerate(_decoded_frames(container, stream)):
        yield index, frame


def _start_seconds(stream: av.video.stream.VideoStream) -> float:
    if stream.start_time is None:
        return 0.0
    return float(stream.start_time * stream.time_base)


def _decoded_frames(
    container: av.container.InputContainer, stream: av.video.stream.VideoStream
) -> Iterator[av.VideoFrame]:
    """Every decoded frame from the current position on; the final empty packet flushes the decoder."""
    for packet in container.demux(stream):
        yield from packet.decode()


SCALE_THREADS = 1  # swscale's threads per conversion (see _to_rgb)


def _to_rgb(
    frame: av.VideoFrame, stream: av.video.stream.VideoStream, size: tuple[int, int] | None, resize: str = "crop"
) -> np.ndarray:
    """RGB uint8 [H, W, 3] as displayed; with `size`, resized to it (see `ClipWindow` for `resize`)."""
    turns = _rotation_turns(frame)
    display_w, display_h = _display_size(frame, stream)
    if size is None:
        out_h, out_w = display_h, display_w
    elif resize == "stretch":
        out_h, out_w = size
    elif resize == "fit":
        scale = min(size[0] / display_h, size[1] / display_w)
        out_h = min(size[0], max(1, round(display_h * scale)))
        out_w = min(size[1], max(1, round(display_w * scale)))
    else:
        scale = max(size[0] / display_h, size[1] / display_w)
        out_h = max(size[0], round(display_h * scale))
        out_w = max(size[1], round(display_w * scale))
    coded_w, coded_h = (out_h, out_w) if turns % 2 else (out_w, out_h)
    # AREA averages source pixels when shrinking (antialiased); BICUBIC is smoother when enlarging.
    # Without the accuracy flags swscale's scaling path darkens colours by a level or two.
    shrinking = coded_w * coded_h < frame.width * frame.height
    kernel = Interpolation.AREA if shrinking else Interpolation.BICUBIC
    flags = kernel | Interpolation.ACCURATE_RND | Interpolation.FULL_CHR_H_INT
    # One scaling thread: PyAV 18.1.1 defaults swscale to a thread pool, which a DataLoader worker forked after the
    # parent scaled a frame inherits without its threads, and waits on for ever.
    image = frame.reformat(width=coded_w, height=coded_h, format="rgb24", interpolation=flags,
                           threads=SCALE_THREADS).to_ndarray()
    if turns:
        image = np.rot90(image, k=turns)
    if size is not None and resize == "fit":
        padded = np.zeros((size[0], size[1], 3), dtype=np.uint8)  # black bars, centred
        top, left = (size[0] - out_h) // 2, (size[1] - out_w) // 2
        padded[top : top + out_h, left : left + out_w] = image
        image = padded
    elif size is not None:
        top = (out_h - size[0]) // 2
        left = (out_w - size[1]) // 2
        image = image[top : top + size[0], left : left + size[1]]
    return np.ascontiguousarray(image)


# --------------------------------------------------------------------------------------------------
# Writing


def write_video(
    path: str | os.PathLike[str],
    frames: np.ndarray | torch.Tensor,
    fps: float,
    *,
    crf: int = 18,
    keyframe_interval: int | None = None,
    audio: np.ndarray | torch.Tensor | None = None,
    sample_rate: int = 48000,
) -> Path:
    """Write frames as an H.264 (yuv420p) mp4 that plays everywhere, with `audio` (float [channels, samples] in
    [-1, 1], one or two channels, at `sample_rate`) as its AAC sound track when given.

    `frames` is uint8 [F, H, W, 3] or float [F, 3, H, W] in [-1, 1]. Odd sizes are padded by repeating
    the last row/column, because yuv420p needs even sizes. The video is encoded to a temporary file next
    to `path` and renamed at the end, so a crash never leaves a half-written file under the final name.
    """
    path = Path(path)
    if fps <= 0:
        raise ValueError(f"fps must be positive, got {fps}")
    array = _pad_to_even(frames_to_uint8(frames))
    sound = None if audio is None else _audio_array(audio)
    path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(path) as temporary:
        _encode_h264(temporary, array, fps, crf, keyframe_interval, sound, sample_rate)
    return path


def _audio_array(audio: np.ndarray | torch.Tensor) -> np.ndarray:
    array = audio.detach().cpu().float().numpy() if isinstance(audio, torch.Tensor) else np.asarray(audio)
    if array.ndim != 2 or array.shape[0] not in (1, 2) or array.shape[1] == 0:
        raise ValueError(f"audio must be float [channels, samples] with 1 or 2 channels, got shape {array.shape}")
    return np.ascontiguousarray(array, dtype=np.float32)


def frames_to_uint8(frames: np.ndarray | torch.Tensor) -> np.ndarray:
    """uint8 [F, H, W, 3] from uint8 [F, H, W, 3] or float [F, 3, H, W] in [-1, 1] (clamped)."""
    if isinstance(frames, torch.Tensor):
        tensor = frames.detach().cpu()
        if tensor.is_floating_point():
            if tensor.ndim != 4 or tensor.shape[1] != 3:
                raise ValueError(
                    f"float frames must be [F, 3, H, W] in [-1, 1], got shape {tuple(tensor.shape)}"
                )
            tensor = (
                ((tensor.float() + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1)
            )
        frames = tensor.numpy()
    array = np.asarray(frames)
    if np.issubdtype(array.dtype, np.floating):
        return frames_to_uint8(torch.from_numpy(np.ascontiguousarray(array)))
    if array.dtype != np.uint8 or array.ndim != 4 or array.shape[-1] != 3:
        raise ValueError(
            f"frames must be uint8 [F, H, W, 3] or float [F, 3, H, W]; got {array.dtype} {array.shape}"
        )
    if array.shape[0] == 0:
        raise ValueError("cannot write a video with no frames")
    return array


def _pad_to_even(array: np.ndarray) -> np.ndarray:
    pad_h = array.shape[1] % 2
    pad_w = array.shape[2] % 2
    if pad_h or pad_w:
        array = np.pad(array, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")
    return np.ascontiguousarray(array)


def _encode_h264(path: Path, array: np.ndarray, fps: float, crf: int, keyframe_interval: int | None,
                 audio: np.ndarray | None = None, sample_rate: int = 48000) -> None:
    rate = Fraction(fps).limit_denominator(1001)
    with av.open(str(path), "w", format="mp4", options={"movflags": "+faststart"}) as container:
        stream = container.add_stream("libx264", rate=rate, options={"crf": str(crf)})
        stream.width = array.shape[2]
        stream.height = array.shape[1]
        stream.pix_fmt = "yuv420p"
        if keyframe_interval is not None:
            stream.codec_context.gop_size = keyframe_interval
        sound = None if audio is None else container.add_stream("aac", rate=sample_rate,
                                                                layout="mono" if len(audio) == 1 else "stereo")
        for image in array:
            container.mux(stream.encode(_to_video_frame(image)))
        container.mux(stream.encode(None))
        if sound is not None and audio is not None:
            _encode_audio(container, sound, audio, sample_rate)


def _encode_audio(container: av.container.OutputContainer, stream: av.audio.stream.AudioStream, audio: np.ndarray,
                  sample_rate: int) -> None:
    """Whole encoder frames (AAC takes a fixed number of samples per frame), the last one padded with silence."""
    size = stream.codec_context.frame_size or 1024
    padded = np.pad(audio, ((0, 0), (0, -audio.shape[1] % size)))
    layout = "mono" if len(audio) == 1 else "stereo"
    for begin in range(0, padded.shape[1], size):
        frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(padded[:, begin : begin + size]), format="fltp",
                                           layout=layout)
        frame.sample_rate, frame.pts, frame.time_base = sample_rate, begin, Fraction(1, sample_rate)
        container.mux(stream.encode(frame))
    container.mux(stream.encode(None))


def _to_video_frame(image: np.ndarray) -> av.VideoFrame:
    return av.VideoFrame.from_ndarray(image, format="rgb24").reformat(format="yuv420p", threads=SCALE_THREADS)
