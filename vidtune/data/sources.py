"""Turn a user's datasets into samples (path, caption, where it came from), checking everything before any long work.

Three kinds of source (`data.datasets`, or `data.root` for one `pairs` dataset):

- `pairs`: `videos.txt` (one clip path per line, relative to the folder or absolute) and `prompts.txt` (the
  caption for the clip on the same line);
- `folder`: every clip and image in a folder and its subfolders, each with a same-name `.txt` caption beside it;
- `metadata`: a `.csv` (header row) or `.jsonl` file naming each clip and its caption; paths relative to the file.

Stills (png, jpg, webp) are one-frame samples in every source. Each sample holds its own caption from the moment
it is read, so no problem elsewhere can pair a clip with another's caption. Every problem of every source is
collected and reported together, each naming the file and line (or row) to fix. Nothing is ever skipped.
"""

from __future__ import annotations

import csv
import io
import json
import os
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

from tqdm import tqdm

from vidtune.data.buckets import assign_bucket, clips_as_stills
from vidtune.data.captions import CaptionStyle
from vidtune.data.input_files import (
    missing_input_problems,
    parse_input_value,
    probe_control,
    probe_inputs,
    read_list_inputs,
    split_folder_inputs,
)
from vidtune.data.inputs import IMAGES_SEPARATOR, ClipInputs, Rectangle
from vidtune.data.video import (
    IMAGE_SUFFIXES,
    VIDEO_SUFFIXES,
    VideoDecodeError,
    VideoInfo,
    is_image_path,
    probe_image,
    probe_video,
)
from vidtune.errors import DataError
from vidtune.files import did_you_mean

if TYPE_CHECKING:  # the config's data section, named for annotations only (vidtune.config sits above data/)
    from vidtune.config import DataConfig

_LINE_BREAK = re.compile(r"\r\n|\r|\n")
# Whitespace plus stray byte-order marks (e.g. from pasting two files together).
_STRIP = " \t\f\v\u00a0\u200b\ufeff"
_PREVIEW = 60


@dataclass(frozen=True)
class Clip:
    """One sample (a clip or a still) and its caption, and where it was named: `source` line `line` (a CSV: row
    `row`, which starts on line `line`; a folder: `line` 0 and `source` the media file).

    `load_dataset` also fills in what the checks learned: `info` (the probe) and `bucket` (its index in the
    config's bucket shapes)."""

    video: Path
    caption: str
    index: int
    line: int
    source: str = "videos.txt"  # how messages name the list, e.g. "videos.txt line 3"
    is_image: bool = False
    repeats: int = 1
    row: int = 0
    info: VideoInfo | None = field(default=None, compare=False)
    bucket: int | None = None
    control: Path | None = None  # control training: the clip the denoiser is conditioned on (same frames, shape)
    held_out: bool = False  # from a source marked `eval: true`: scored for the held-out score, never trained on
    # The source's options: its caption options, number in data.datasets, draw weight, role and loss weight.
    style: CaptionStyle = field(default_factory=CaptionStyle)
    untriggered_caption: str | None = None  # the caption without the source's trigger (None: `caption`)
    source_number: int = 0
    weight: float | None = None
    regularization: bool = False
    loss_weight: float = 1.0
    # Per-clip inputs (vidtune/data/inputs.py): kind -> its files, read with the clip's window; after
    # `load_dataset` their probes; the source's `mask_rect`, a mask for every clip without a mask file.
    inputs: ClipInputs = field(default_factory=ClipInputs)
    input_info: Mapping[str, tuple[VideoInfo, ...]] = field(default_factory=dict, compare=False)
    mask_rect: Rectangle | None = None

    @property
    def untriggered(self) -> str:
        """The caption without its source's trigger word (what `training.preserve_base` starts from)."""
        return self.caption if self.untriggered_caption is None else self.untriggered_caption

    @property
    def where(self) -> str:
        """Where the user named this sample: 'videos.txt line 3', 'clips.csv row 2 (line 3)', 'shots/a.mp4'."""
        if self.row:
            return f"{self.source} row {self.row} (line {self.line})"
        return f"{self.source} line {self.line}" if self.line else self.source


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


def _read_pairs(root: str | os.PathLike[str], videos_file: str, prompts_file: str) -> tuple[list[Clip], list[str]]:
    """The clips of every good line of the two lists, and a problem for every line that is not."""
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
        return [], problems

    videos_name, prompts_name = _display_name(videos_file), _display_name(prompts_file)
    problems.extend(_count_problems(videos, prompts, videos_name, prompts_name))
    clips = _pair_lines(root, videos, prompts, videos_name, prompts_name, problems)
    return clips, problems


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
            clips.append(Clip(clip, caption, number - 1, number, videos_name, is_image=is_image_path(clip)))
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
            f"{videos_name} line {number}: the clip {_preview(text)} was not found (looked for {clip})."
            f"{did_you_mean(clip)} Check the spelling, or write the path relative to {root}."
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


def probe(clip: Clip) -> VideoInfo | VideoDecodeError:
    """The probe of a sample (a still or a clip), or the error saying why it cannot be read."""
    try:
        return probe_image(clip.video) if clip.is_image else probe_video(clip.video)
    except VideoDecodeError as error:
        return error


# ----- every source of a config ---------------------------------------------------------------------------------
MEDIA_SUFFIXES = IMAGE_SUFFIXES + VIDEO_SUFFIXES
_LISTED = 5  # files named in a warning about ignored files before "and N more"


@dataclass
class DatasetReport:
    """What reading and checking a config's datasets found: every sample (checked ones hold `info` and `bucket`),
    the problems of the source files, each sample's problems (by index) and warnings."""

    clips: list[Clip]
    source_problems: list[str] = field(default_factory=list)
    sample_problems: dict[int, list[str]] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)

    def problems(self) -> list[str]:
        by_sample = [f"{self.clips[i].where} ({self.clips[i].video}): {problem}"
                     for i in sorted(self.sample_problems) for problem in self.sample_problems[i]]
        return [*self.source_problems, *by_sample]

    def raise_problems(self) -> None:
        problems = self.problems()
        if problems:
            raise DataError(problems, hint="fix the files and lines above (every problem of every source is listed) "
                            "and run again; `vidtune data check CONFIG` shows each sample with its bucket.")


def read_sources(data: DataConfig) -> DatasetReport:
    """Every sample of `data.datasets` (or `data.root`), in order, each with its own caption; nothing probed yet.

    A line that names no usable sample is a problem, never skipped silently."""
    report = DatasetReport([])
    sources = data.sources()
    for number, source in enumerate(sources):
        found: list[Clip] = []
        problems: list[str] = []
        try:  # each reader returns the samples it could read and a problem for everything else
            if source.type == "pairs":
                found, problems = _read_pairs(Path(source.root), source.videos, source.prompts)
                found = _read_controls(Path(source.root), source.controls, found, problems)
                if source.inputs:
                    found = read_list_inputs(Path(source.root), source.inputs, found, problems, read_lines)
            elif source.type == "folder":
                found, problems = _read_folder(Path(source.root), report)
            else:
                found, problems = _read_metadata(Path(source.path), source.video_column, source.caption_column,
                                                 source.control_column, source.inputs)
        except DataError as error:  # the source as a whole cannot be read
            problems = error.problems
        where = f"(in {source.root}) " if source.type == "pairs" and len(sources) > 1 else ""
        report.source_problems.extend(f"{where}{problem}" for problem in problems)
        prefix = source.caption_prefix.strip(_STRIP)
        style = CaptionStyle((source.trigger or "").strip(_STRIP), source.trigger_position, source.shuffle_tags,
                             source.keep_tokens, source.caption_dropout)
        for clip in found:
            untriggered = f"{prefix} {clip.caption}" if prefix else clip.caption
            caption = style.with_trigger(untriggered)
            # With several sources, a list is named with its folder: "pairs/videos.txt line 3".
            label = f"{Path(source.root).name}/{clip.source}" if source.type == "pairs" and len(sources) > 1 \
                else clip.source
            report.clips.append(replace(clip, caption=caption, index=len(report.clips), repeats=source.repeats,
                                        source=label, held_out=source.eval, style=style,
                                        untriggered_caption=untriggered if caption != untriggered else None,
                                        source_number=number, weight=source.weight,
                                        regularization=source.role == "regularization",
                                        loss_weight=source.loss_weight,
                                        mask_rect=None if source.mask_rect is None else tuple(source.mask_rect)))
    if not report.clips and not report.source_problems:
        report.source_problems.append("The datasets hold no samples at all.")
    return report


def draw_weights(clips: Sequence[Clip]) -> list[float] | None:
    """Each sample's probability of being drawn when the sources have a `weight`: its source's share of the draws
    (weight over the sum of the weights of the sources among `clips`), split equally among that source's samples;
    None without weights (epochs of `repeats`)."""
    if not clips or any(clip.weight is None for clip in clips):
        return None
    counts = Counter(clip.source_number for clip in clips)
    weights = {clip.source_number: float(clip.weight or 0.0) for clip in clips}
    total = sum(weights.values())
    return [weights[clip.source_number] / total / counts[clip.source_number] for clip in clips]


def inspect_dataset(data: DataConfig, progress: bool = True, required_inputs: Sequence[str] = ()) -> DatasetReport:
    """`read_sources`, then every sample and its inputs probed (headers and packets, no decoding) and the sample
    given its bucket; `required_inputs`: the input kinds the run reads, which every sample must have."""
    report = read_sources(data)
    shapes = data.bucket_shapes()
    probed: dict[Path, VideoInfo | VideoDecodeError] = {}  # a file may be listed twice, with two captions
    for number, problems in missing_input_problems(report.clips, required_inputs).items():
        report.sample_problems.setdefault(number, []).extend(problems)
    for number, clip in enumerate(tqdm(report.clips, desc="Checking samples", unit="sample", disable=not progress)):
        if clip.video not in probed:
            probed[clip.video] = probe(clip)
        info = probed[clip.video]
        if isinstance(info, VideoDecodeError):
            report.sample_problems.setdefault(number, []).append(info.reason)
            continue
        bucket, reason = assign_bucket(info, clip.is_image, shapes, data.fps)
        input_info, input_problems = probe_inputs(clip, info, probed) if clip.inputs else ({}, [])
        control_info, control_problems = probe_control(clip, info, probed)
        if control_info is not None:  # kept beside the inputs' probes: a control of another rate is read by time
            input_info = {**input_info, "control": (control_info,)}
        input_problems = [*input_problems, *control_problems]
        report.clips[number] = replace(clip, info=info, bucket=bucket, input_info=input_info)
        if reason:
            report.sample_problems.setdefault(number, []).append(reason)
        report.sample_problems.setdefault(number, []).extend(input_problems)
        if not report.sample_problems[number]:
            del report.sample_problems[number]
    stills = clips_as_stills(shapes, data.frames, [(clip.is_image, clip.bucket) for clip in report.clips])
    if stills:
        report.source_problems.append(stills)
    return report


def load_dataset(data: DataConfig, progress: bool = True, required_inputs: Sequence[str] = ()) -> list[Clip]:
    """The checked samples of a config's data section (each with `info` and `bucket`), or one DataError listing
    every problem of every source (`required_inputs`: the input kinds every sample must have). Warnings (files a
    folder holds but no sample uses) are printed."""
    report = inspect_dataset(data, progress=progress, required_inputs=required_inputs)
    report.raise_problems()
    for warning in report.warnings:
        print(f"Note: {warning}", flush=True)
    return report.clips


def _read_controls(root: Path, controls_file: str, clips: list[Clip], problems: list[str]) -> list[Clip]:
    """Control training: each clip's control clip from `controls_file` beside the clip list (line n is the
    control of the clip on line n), when that file exists; a problem for every line that names no file."""
    root = root.expanduser().absolute()
    path = root / controls_file
    if not path.is_file():
        return clips
    try:
        lines = read_lines(path)
    except DataError as error:
        problems.extend(error.problems)
        return clips
    name = _display_name(controls_file)
    with_controls = []
    for clip in clips:
        text = lines[clip.line - 1] if clip.line <= len(lines) else ""
        control = _resolve_clip(root, text) if text else None
        if control is None:
            problems.append(f"{name} line {clip.line} is missing or empty: write the control clip of {clip.where} "
                            f"({clip.video.name}) there; {name} has one control clip a line, in the clips' order.")
        elif not control.is_file():
            problems.append(f"{name} line {clip.line}: the control clip {_preview(text)} was not found (looked for "
                            f"{control}). Check the spelling, or write the path relative to {root}.")
        with_controls.append(replace(clip, control=control))
    return with_controls


def folder_files(root: Path) -> list[Path]:
    """Every file a `folder` source sees under `root`, sorted: subfolders too, hidden files and folders left out."""
    return sorted(path for path in root.rglob("*") if path.is_file()
                  and not any(part.startswith(".") for part in path.relative_to(root).parts))


def _read_folder(root: Path, report: DatasetReport) -> tuple[list[Clip], list[str]]:
    """Every clip and image under `root` (hidden files and folders left out), each with its .txt caption."""
    root = root.expanduser().absolute()
    if not root.is_dir():
        what = "is a file, not a folder" if root.exists() else "does not exist"
        raise DataError([f"The dataset folder {root} {what}: point the `folder` dataset's root at a folder of clips "
                         "and images, each with a .txt caption of the same name beside it."])
    files = folder_files(root)
    media = [path for path in files if path.suffix.lower() in MEDIA_SUFFIXES]
    if not media:
        raise DataError([f"The dataset folder {root} holds no clips or images (looked for "
                         f"{', '.join(MEDIA_SUFFIXES)}, in subfolders too)."])
    media, inputs, problems = split_folder_inputs(media)  # `<stem>.<kind>.<ext>`: an input beside its clip
    clips: list[Clip] = []
    used: set[Path] = set()
    for path in media:
        name = f"{root.name}/{path.relative_to(root).as_posix()}"
        caption_file = path.with_suffix(".txt")
        used.add(caption_file)
        if not caption_file.is_file():
            problems.append(f"{name} has no caption: looked for {caption_file}. Write its caption in that file "
                            "(a .txt file with the same name, beside it).")
            continue
        try:
            caption = " ".join(line for line in read_lines(caption_file) if line)
        except DataError as error:
            problems.extend(error.problems)
            continue
        if not caption:
            problems.append(f"{caption_file} is empty: write the caption of {name} in it.")
            continue
        clips.append(Clip(path, caption, len(clips), 0, name, is_image=is_image_path(path),
                          inputs=ClipInputs(inputs.get(path, {}))))
    orphans = [path for path in files if path.suffix.lower() == ".txt" and path not in used]
    others = [path for path in files if path.suffix.lower() not in (*MEDIA_SUFFIXES, ".txt")]
    if orphans:
        noun = "is a caption" if len(orphans) == 1 else "are captions"
        report.warnings.append(f"{root}: {_listing(orphans, root)} {noun} with no clip or image of the same name "
                               "beside it, not used.")
    if others:
        report.warnings.append(f"{root}: {_listing(others, root)} {'is' if len(others) == 1 else 'are'} not a clip or "
                               f"image vidtune reads ({', '.join(MEDIA_SUFFIXES)}), not used.")
    return clips, problems


def _listing(paths: list[Path], root: Path) -> str:
    names = [path.relative_to(root).as_posix() for path in paths[:_LISTED]]
    more = f" and {len(paths) - _LISTED} more" if len(paths) > _LISTED else ""
    return ", ".join(names) + more


def _read_metadata(path: Path, video_column: str, caption_column: str, control_column: str | None = None,
                   input_columns: Mapping[str, str] | None = None) -> tuple[list[Clip], list[str]]:
    """The samples of a .csv (with a header row) or .jsonl file; clip paths relative to the file's folder."""
    path = path.expanduser().absolute()
    suffix = path.suffix.lower()
    if suffix not in (".csv", ".jsonl"):
        kind = suffix or "a file without an extension"
        raise DataError([f"{path}: a `metadata` dataset must be a .csv or a .jsonl file, not {kind}. Save the "
                         "spreadsheet as CSV (with a header row), or write one JSON object a line in a .jsonl file."])
    if not path.is_file():
        raise DataError([f"The metadata file {path} {'is a folder' if path.exists() else 'does not exist'}: point "
                         "the `metadata` dataset's path at a .csv or .jsonl file."])
    text = "\n".join(read_lines(path))  # UTF-8 (with a clear message if not), any line ends
    input_columns = dict(input_columns or {})
    rows = _csv_rows(path, text, video_column, caption_column, control_column, input_columns) if suffix == ".csv" \
        else _jsonl_rows(path, text, video_column, caption_column, control_column, input_columns)
    problems: list[str] = []
    clips: list[Clip] = []
    for line, row, video, caption, problem, control_text, input_texts in rows:
        where = f"{path.name} row {row} (line {line})" if row else f"{path.name} line {line}"
        if problem:
            problems.append(f"{where}: {problem}")
            continue
        if not video:
            problems.append(f"{where}: the {video_column!r} value is empty: write the path of the clip or image.")
            continue
        if not caption:
            problems.append(f"{where}: the {caption_column!r} value is empty: write the caption of {video!r}.")
            continue
        resolved = _resolve_clip(path.parent, video)
        if not resolved.is_file():
            state = "is a folder, not a file" if resolved.is_dir() else "was not found"
            problems.append(f"{where}: {_preview(video)} {state} (looked for {resolved}). Check the spelling, or "
                            f"write the path relative to {path.parent}.")
            continue
        control = None
        if control_column is not None:
            if not control_text:
                problems.append(f"{where}: the {control_column!r} value is empty: write the path of the control clip "
                                f"of {video!r}.")
                continue
            control = _resolve_clip(path.parent, control_text)
            if not control.is_file():
                problems.append(f"{where}: the control clip {_preview(control_text)} was not found (looked for "
                                f"{control}). Check the spelling, or write the path relative to {path.parent}.")
                continue
        inputs: dict[str, tuple[Path, ...]] = {}
        for kind, value in input_texts:
            paths, input_problems = parse_input_value(kind, value, path.parent,
                                                      f"{where}, {input_columns[kind]!r}")
            problems.extend(input_problems)
            if paths:
                inputs[kind] = paths
        clips.append(Clip(resolved, caption, len(clips), line, path.name, is_image=is_image_path(resolved), row=row,
                          control=control, inputs=ClipInputs(inputs)))
    if not clips and not problems:
        problems.append(f"{path} names no samples: write one clip or image and its caption per "
                        f"{'row' if suffix == '.csv' else 'line'}.")
    return clips, problems


class Row(NamedTuple):
    """One CSV row or JSONL line as read, before its paths are checked: its values, or the problem that it has."""

    line: int  # where it starts in the file
    row: int  # the CSV row (the header not counted); 0 in a JSONL file
    video: str = ""
    caption: str = ""
    problem: str | None = None
    control: str = ""  # the control clip, when a control column is read
    inputs: tuple[tuple[str, str], ...] = ()  # (kind, value) of each input column read


def _csv_rows(path: Path, text: str, video_column: str, caption_column: str,
              control_column: str | None = None, input_columns: Mapping[str, str] | None = None) -> list[Row]:
    reader = csv.reader(io.StringIO(text, newline=""))
    try:
        header = [cell.strip(_STRIP) for cell in next(reader)]
    except StopIteration:
        raise DataError([f"{path} is empty: write a header row (e.g. {video_column},{caption_column}) and one row "
                         "per clip."]) from None
    kinds = list(input_columns or {})
    columns = (video_column, caption_column, *([control_column] if control_column else []),
               *(input_columns or {}).values())
    missing = [column for column in columns if column not in header]
    if missing:
        raise DataError([f"{path.name} has no column {' and no column '.join(repr(c) for c in missing)} (line 1, "
                         f"the header row); its columns are: {', '.join(repr(c) for c in header if c) or 'none'}. "
                         "Rename the column in the file, or set video_column / caption_column / control_column / "
                         "inputs in the dataset entry to the column that holds it."], hint=f"File: {path}")
    at = [header.index(column) for column in columns]
    rows: list[Row] = []
    line = reader.line_num + 1
    for number, cells in enumerate(reader, start=1):
        start, line = line, reader.line_num + 1
        if not any(cell.strip(_STRIP) for cell in cells):
            continue  # a blank line between rows
        if len(cells) <= max(at):
            rows.append(Row(start, number, problem=f"it has {len(cells)} cells but the header has {len(header)}: "
                            "check for a missing comma or a caption with a comma that is not in double quotes."))
            continue
        video, caption, *rest = (cells[i].strip(_STRIP) for i in at)
        control, values = rest[: len(rest) - len(kinds)], rest[len(rest) - len(kinds):]
        rows.append(Row(start, number, video, caption, control=control[0] if control else "",
                        inputs=tuple(zip(kinds, values, strict=True))))
    return rows


def _jsonl_rows(path: Path, text: str, video_column: str, caption_column: str,
                control_column: str | None = None, input_columns: Mapping[str, str] | None = None) -> list[Row]:
    columns = (video_column, caption_column, *([control_column] if control_column else []))
    rows: list[Row] = []
    for line, content in enumerate(text.split("\n"), start=1):
        if not content:
            continue
        try:
            item = json.loads(content)
        except json.JSONDecodeError as error:
            rows.append(Row(line, 0, problem=f"this is not valid JSON ({error.msg} at character {error.colno}): "
                            f'write one object per line, e.g. {{"{video_column}": "clip.mp4", "{caption_column}": '
                            '"a cat"}.'))
            continue
        if not isinstance(item, dict):
            rows.append(Row(line, 0, problem="this is not a JSON object ({...}): write one object per line."))
            continue
        missing = [key for key in columns if key not in item]
        if missing:
            rows.append(Row(line, 0, problem=f"no key {' and no key '.join(repr(k) for k in missing)}; its keys are: "
                            f"{', '.join(repr(k) for k in item) or 'none'}. Rename the key, or set video_column / "
                            "caption_column / control_column in the dataset entry."))
            continue
        values = [item[column] for column in columns]
        if not all(isinstance(value, str) for value in values):
            rows.append(Row(line, 0, problem=f"{' and '.join(repr(c) for c in columns)} must be text (in double "
                            "quotes)."))
            continue
        video, caption, *control = (value.strip(_STRIP) for value in values)
        # An input key may be left out of a line (that clip has none); several images may be a list of paths.
        inputs, problem = _jsonl_inputs(item, input_columns or {})
        rows.append(Row(line, 0, video, caption, problem, control=control[0] if control else "", inputs=inputs))
    return rows


def _jsonl_inputs(item: dict, input_columns: Mapping[str, str]) -> tuple[tuple[tuple[str, str], ...], str | None]:
    """(kind, value) of each input key of a JSONL object (a list of paths joined by '|'), or a problem."""
    found = []
    for kind, key in input_columns.items():
        value = item.get(key, "")
        if isinstance(value, list) and all(isinstance(part, str) for part in value):
            value = IMAGES_SEPARATOR.join(value)
        if not isinstance(value, str):
            return (), f"{key!r} must be a path in double quotes (or a list of them), not {json.dumps(value)}."
        found.append((kind, value))
    return tuple(found), None
