"""Turn a user's dataset folder into clips (path, caption, line), checking every line before any long work starts.

A dataset is two text files in one folder: `videos.txt` (one clip path per line, relative to the folder
or absolute) and `prompts.txt` (the caption for the clip on the same line). Every problem is collected
and reported together, each naming the file and line to fix. Nothing is ever skipped: dropping a line
would pair every later clip with the wrong caption.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from vidtune.data.video import (
    VideoDecodeError,
    VideoInfo,
    describe_length,
    format_fps,
    probe_video,
    required_source_frames,
)
from vidtune.errors import DataError, VidtuneError

_LINE_BREAK = re.compile(r"\r\n|\r|\n")
# Whitespace plus stray byte-order marks (e.g. from pasting two files together).
_STRIP = " \t\f\v\u00a0\u200b\ufeff"
_PREVIEW = 60


@dataclass(frozen=True)
class Clip:
    """One clip and its caption. `line` is the 1-based line number in both files."""

    video: Path
    caption: str
    index: int
    line: int
    source: str = "videos.txt"  # how messages name the clip list, e.g. "videos.txt line 3"


def read_lines(path: str | os.PathLike[str]) -> list[str]:
    """Lines of a UTF-8 text file (BOM, LF/CRLF/CR all fine), stripped, trailing blank lines dropped."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise DataError([f"{path} does not exist."]) from None
    except IsADirectoryError:
        raise DataError([f"{path} is a folder, but it should be a text file."]) from None
    except OSError as error:
        raise DataError(
            [f"{path} could not be read ({error.strerror}). Check that the file is yours."]
        ) from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        line = _line_of_offset(data, error.start)
        raise DataError(
            [
                f"{path.name} line {line} is not UTF-8 text: save {path.name} with the encoding 'UTF-8' "
                "(in most text editors: Save As, then choose the encoding)."
            ],
            hint=f"File: {path}",
        ) from None
    lines = [line.strip(_STRIP) for line in _LINE_BREAK.split(text)]
    while lines and not lines[-1]:
        lines.pop()
    return lines


def _line_of_offset(data: bytes, offset: int) -> int:
    head = data[:offset]
    return len(_LINE_BREAK.findall(head.decode("latin-1"))) + 1


def load_text_pair_dataset(
    root: str | os.PathLike[str], videos_file: str = "videos.txt", prompts_file: str = "prompts.txt"
) -> list[Clip]:
    """Read the two lists in `root` into clips, or raise one DataError listing every problem."""
    root = Path(root).expanduser().absolute()
    if not root.is_dir():
        what = "is a file, not a folder" if root.exists() else "does not exist"
        raise DataError(
            [f"The dataset folder {root} {what}."],
            hint=f"create a folder holding your clips, {videos_file} and {prompts_file}, and point data.root at it "
            "(in a config file, relative to the file's folder).",
        )
    videos_path, prompts_path = root / videos_file, root / prompts_file
    problems: list[str] = []
    videos = _read_list(videos_path, "one clip path per line", problems)
    prompts = _read_list(prompts_path, "one caption per line, in the same order as the clips", problems)
    if videos is None or prompts is None:
        raise DataError(problems, hint=_hint(root))

    videos_name, prompts_name = _display_name(videos_file), _display_name(prompts_file)
    problems.extend(_count_problems(videos, prompts, videos_name, prompts_name))
    clips = _pair_lines(root, videos, prompts, videos_name, prompts_name, problems)
    if problems:
        raise DataError(problems, hint=_hint(root))
    return clips


def _pair_lines(
    root: Path,
    videos: list[str],
    prompts: list[str],
    videos_name: str,
    prompts_name: str,
    problems: list[str],
) -> list[Clip]:
    """Samples for the lines that are fine; a problem is recorded for every line that is not."""
    clips: list[Clip] = []
    for number, text in enumerate(videos, start=1):
        clip = _check_clip_line(root, text, number, videos_name, prompts_name, problems)
        caption = prompts[number - 1] if number <= len(prompts) else None
        if caption is None:
            continue
        if not caption:
            problems.append(
                f"{prompts_name} line {number} is empty: write the caption for the clip on "
                f"{videos_name} line {number} ({_preview(text) if text else 'also empty'})."
            )
        elif clip is not None:
            clips.append(Clip(clip, caption, number - 1, number, videos_name))
    for number in range(len(videos) + 1, len(prompts) + 1):
        if not prompts[number - 1]:
            problems.append(f"{prompts_name} line {number} is empty.")
    return clips


def _read_list(path: Path, content: str, problems: list[str]) -> list[str] | None:
    """Lines of a dataset list, or None (with a problem recorded) when it cannot be used at all."""
    if not path.exists():
        problems.append(f"{path} is missing: create it as a text file with {content}.")
        return None
    try:
        lines = read_lines(path)
    except DataError as error:
        problems.extend(error.problems)
        return None
    if not lines:
        problems.append(f"{path} is empty: write {content}.")
        return None
    return lines


def _display_name(name: str) -> str:
    return Path(name).name if Path(name).is_absolute() else name


def _count_problems(videos: list[str], prompts: list[str], videos_name: str, prompts_name: str) -> list[str]:
    if len(videos) == len(prompts):
        return []
    longer, shorter = (
        (videos_name, prompts_name) if len(videos) > len(prompts) else (prompts_name, videos_name)
    )
    extra_lines = videos if len(videos) > len(prompts) else prompts
    first_extra = min(len(videos), len(prompts)) + 1
    extra = len(extra_lines) - first_extra + 1
    return [
        f"{videos_name} has {_count(len(videos), 'line')} but {prompts_name} has {len(prompts)}: every clip "
        f"needs exactly one caption on the same line. {longer} has {_count(extra, 'extra line')}, "
        f"starting at line {first_extra}: {_preview(extra_lines[first_extra - 1])}. "
        f"Add the missing lines to {shorter} or remove the extra ones from {longer}."
    ]


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}{'' if number == 1 else 's'}"


def _check_clip_line(
    root: Path, text: str, number: int, videos_name: str, prompts_name: str, problems: list[str]
) -> Path | None:
    """The clip's absolute path, or None with a problem recorded."""
    if not text:
        problems.append(
            f"{videos_name} line {number} is empty: every line must name one clip. Remove the empty line "
            f"(and the caption on {prompts_name} line {number}) or write the clip's path there."
        )
        return None
    clip = _resolve_clip(root, text)
    if not clip.exists():
        problems.append(
            f"{videos_name} line {number}: the clip {_preview(text)} was not found (looked for {clip}). "
            f"Check the spelling, or write the path relative to {root}."
        )
        return None
    if clip.is_dir():
        problems.append(f"{videos_name} line {number}: {clip} is a folder, not a video file.")
        return None
    return clip


def _resolve_clip(root: Path, text: str) -> Path:
    """Absolute clip path. Also accepts quoted paths ("Copy as path" on Windows) and backslashes."""
    candidates = [text]
    unquoted = text[1:-1].strip() if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"" else text
    candidates += [unquoted, unquoted.replace("\\", "/")]
    resolved = [_absolute(root, candidate) for candidate in candidates if candidate]
    return next((path for path in resolved if path.exists()), resolved[0])


def _absolute(root: Path, text: str) -> Path:
    path = Path(text).expanduser()
    return path if path.is_absolute() else root / path


def _preview(text: str) -> str:
    short = text if len(text) <= _PREVIEW else text[: _PREVIEW - 3] + "..."
    return repr(short)


def _hint(root: Path) -> str:
    return f"fix the lines above (in the dataset folder {root}) and run again."


def validate_clips(
    clips: Sequence[Clip], num_frames: int, fps: float | None, progress: bool = True
) -> list[VideoInfo]:
    """Probe every clip; raise one DataError naming every unreadable or too-short clip.

    `num_frames` and `fps` are what training reads per clip (data.frames and data.fps).
    """
    problems: list[str] = []
    infos: list[VideoInfo] = []
    probed: dict[Path, VideoInfo | VideoDecodeError] = {}  # a clip may be listed twice with two captions
    for clip in tqdm(clips, desc="Checking clips", unit="clip", disable=not progress):
        where = f"{clip.source} line {clip.line} ({clip.video})"
        if clip.video not in probed:
            try:
                probed[clip.video] = probe_video(clip.video)
            except VideoDecodeError as error:
                probed[clip.video] = error
        info = probed[clip.video]
        if isinstance(info, VideoDecodeError):
            problems.append(f"{where}: {info.reason}")
            continue
        reason = _length_problem(info, num_frames, fps)
        if reason:
            problems.append(f"{where}: {reason}")
        infos.append(info)
    if problems:
        raise DataError(
            problems, hint="fix or replace these clips (keep the captions in prompts.txt in step)."
        )
    return infos


def _length_problem(info: VideoInfo, num_frames: int, fps: float | None) -> str | None:
    """Why a clip is too short for a sample, in words, or None."""
    try:
        needed = required_source_frames(num_frames, fps, info.fps)
    except VidtuneError as error:
        return str(error)
    if info.num_frames >= needed:
        return None
    have = describe_length(info.num_frames, info.fps)
    if fps is None:
        return f"it has {have}; {num_frames} are needed: use a longer clip or lower data.frames."
    return (
        f"it has {have}; reading {num_frames} frames at {format_fps(fps)} fps needs "
        f"{needed / info.fps:.2f} s ({needed} source frames): use a longer clip, lower data.frames "
        "or raise data.fps."
    )
