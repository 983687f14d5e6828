"""`vidtune data check`: everything `vidtune train` checks about the data, without loading a model.

Every source is read and every sample probed (headers and packets: no clip is decoded), given its bucket, its
caption counted in the family's tokens; then duplicates (same bytes, same caption) are looked for. For a family that
trains on a clip's sound (LTX-2), each sample's audio track is shown and counted: with one it trains sound and video,
without one video only. The result is a table per sample, counts per bucket, a paged contact sheet and a JSON
report. Problems would stop training; warnings would not (a caption cut at the token limit, a duplicate, a file a
folder holds but no sample uses).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vidtune.config import Config, DataConfig
from vidtune.data.audio import sound_line
from vidtune.data.buckets import Shape, check_bucket_shapes, describe_shape
from vidtune.data.overview import summary, write_dataset_overview
from vidtune.data.sources import Clip, DatasetReport, inspect_dataset
from vidtune.data.video import VideoInfo, describe_size, format_fps, frames_available
from vidtune.errors import ConfigError, VidtuneError
from vidtune.files import atomic_write_text

PAGE_ROWS = 32  # contact-sheet rows per page


@dataclass
class DataCheck:
    """The outcome of checking a config's data: per sample rows, problems that would stop training, warnings."""

    shapes: list[Shape]
    report: DatasetReport
    config_problems: list[str] = field(default_factory=list)
    tokens: dict[int, int] = field(default_factory=dict)  # sample index -> caption tokens
    token_limit: int | None = None
    sample_warnings: dict[int, list[str]] = field(default_factory=dict)
    # The family trains on a clip's sound beside its frames (`spec.audio_format()`): its audio track is shown.
    family: str = ""
    reads_sound: bool = False
    # The config's data section: how samples are read (buckets, fps, resize, frame window).
    data: DataConfig | None = None

    @property
    def clips(self) -> list[Clip]:
        return self.report.clips

    def problems(self) -> list[str]:
        return [*self.config_problems, *self.report.problems()]

    def warnings(self) -> list[str]:
        by_sample = [f"{self.clips[i].where}: {warning}" for i in sorted(self.sample_warnings)
                     for warning in self.sample_warnings[i]]
        return [*self.report.warnings, *by_sample]

    def bucket_counts(self) -> dict[str, int]:
        counts = {shape_key(shape): 0 for shape in self.shapes}
        for number, clip in enumerate(self.clips):
            if clip.bucket is not None and number not in self.report.sample_problems:
                counts[shape_key(self.shapes[clip.bucket])] += 1
        return counts

    def sound_summary(self) -> str | None:
        """How many samples train with their sound (the line a training run logs), for a family that reads it."""
        return sound_line(self.family, self.clips) if self.reads_sound else None

    def to_json(self) -> dict[str, Any]:
        rows = []
        for number, clip in enumerate(self.clips):
            info = clip.info
            rows.append({
                "path": str(clip.video), "caption": clip.caption, "source": clip.where,
                "image": clip.is_image, "repeats": clip.repeats,
                "bucket": list(self.shapes[clip.bucket]) if clip.bucket is not None else None,
                "duration": round(info.duration, 3) if info else None, "fps": info.fps if info else None,
                # [height, width] as displayed (what is resized to the bucket), as the config orders them.
                "size": [info.height, info.width] if info else None, "frames": info.num_frames if info else None,
                "pixel_aspect": _pixel_aspect(info), "stored_size": list(info.stored_size) if info and
                info.stored_size else None,
                "audio_track": info.has_audio if info else None,
                "tokens": self.tokens.get(number),
                "problems": list(self.report.sample_problems.get(number, [])),
                "warnings": list(self.sample_warnings.get(number, [])),
            })
        return {"clips": rows, "buckets": self.bucket_counts(), "token_limit": self.token_limit,
                "sound": self.sound_summary(),
                "problems": [*self.config_problems, *self.report.source_problems],
                "warnings": list(self.report.warnings), "ok": not self.problems()}


def shape_key(shape: Shape) -> str:
    """'49x480x832': frames x height x width."""
    return describe_shape(shape)


def _pixel_aspect(info: VideoInfo | None) -> str | None:
    """'128:117' for a file whose pixels are not square; None for square ones (and an unread file)."""
    if info is None or info.pixel_aspect == 1:
        return None
    return f"{info.pixel_aspect.numerator}:{info.pixel_aspect.denominator}"


def check_data(config: Config, spec: Any, progress: bool = True) -> DataCheck:
    """Check a config's data as `vidtune train` would (the model's files and shape rules, every source, every
    sample), collecting every problem instead of stopping at the first. The tokenizer is the only component
    loaded."""
    data = config.data
    shapes = data.bucket_shapes()
    config_problems: list[str] = []
    try:
        check_bucket_shapes(spec, shapes, single=not data.buckets)
    except ConfigError as error:
        # Listed as "  - <first line>": every line after it is indented under it (its items one level deeper).
        first, *rest = str(error).rsplit("\nWhat to do:", 1)[0].split("\n")
        config_problems.append("\n".join([first, *(f"  {line}" if line.startswith("  ") else f"    {line}"
                                                    for line in rest)]))
    report = inspect_dataset(data, progress=progress, required_inputs=spec.required_inputs(config))
    check = DataCheck(shapes, report, config_problems, family=spec.name,
                      reads_sound=spec.audio_format() is not None, data=data)
    _count_tokens(check, spec)
    _find_duplicates(check)
    return check


def _count_tokens(check: DataCheck, spec: Any) -> None:
    """Each caption's tokens in the family's (first) tokenizer, against the tokens a caption keeps."""
    try:
        from transformers import AutoTokenizer

        tokenizer = spec.load_component(AutoTokenizer, "tokenizer")
    except (VidtuneError, OSError, ValueError) as error:
        check.report.warnings.append(f"caption tokens not counted: the tokenizer could not be loaded ({error}).")
        return
    check.token_limit = spec.max_sequence_length
    for number, clip in enumerate(check.clips):
        count = len(tokenizer(clip.caption)["input_ids"])
        check.tokens[number] = count
        if count > check.token_limit:
            check.sample_warnings.setdefault(number, []).append(
                f"the caption has {count} tokens; the model reads {check.token_limit}, the rest is cut off "
                "(shorten it, or raise model.max_sequence_length)")


def _find_duplicates(check: DataCheck) -> None:
    """Samples with the same file content (under any name), and samples sharing one caption."""
    by_content: dict[str, list[int]] = {}
    by_caption: dict[str, list[int]] = {}
    hashes: dict[Path, str | None] = {}
    for number, clip in enumerate(check.clips):
        if clip.video not in hashes:
            hashes[clip.video] = _file_hash(clip.video)
        if hashes[clip.video] is not None:
            by_content.setdefault(hashes[clip.video], []).append(number)
        by_caption.setdefault(clip.caption, []).append(number)
    for group in by_content.values():
        for number in group[1:]:
            check.sample_warnings.setdefault(number, []).append(
                f"same file content as {check.clips[group[0]].where} ({check.clips[group[0]].video.name}): a "
                "duplicate is seen twice as often")
    for group in by_caption.values():
        for number in group[1:]:
            check.sample_warnings.setdefault(number, []).append(
                f"same caption as {check.clips[group[0]].where}")


def _file_hash(path: Path) -> str | None:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as file:
            for block in iter(lambda: file.read(1 << 20), b""):
                digest.update(block)
    except OSError:
        return None  # unreadable: the probe already reported it
    return digest.hexdigest()


# ----- presenting it ----------------------------------------------------------------------------------------------
def table(check: DataCheck, fps: float | None) -> str:
    """One row per sample: where it was named, its length, rate, size, the frames it yields, its bucket (or why it
    fits none), its caption tokens, for a family that reads sound whether it has an audio track; then the counts per
    bucket and of samples with sound."""
    header = ("#", "sample", "length", "fps", "size (HxW)", "frames", "bucket (FxHxW)", "tokens",
              *_sound_header(check), "file")
    rows = [header]
    notes: list[str] = []
    for number, clip in enumerate(check.clips):
        info = clip.info
        problems = check.report.sample_problems.get(number, [])
        if clip.bucket is not None and not problems:
            bucket = describe_shape(check.shapes[clip.bucket]) + (f", repeats {clip.repeats}" if clip.repeats > 1
                                                                  else "")
        else:
            bucket = f"NONE (see {len(notes) + 1})" if problems else "-"
            notes.extend(problems)
        limit = f"/{check.token_limit}" if check.token_limit else ""
        tokens = f"{check.tokens[number]}{limit}" if number in check.tokens else "-"
        if number in check.tokens and check.token_limit and check.tokens[number] > check.token_limit:
            tokens += " CUT"
        sound = (_sound(clip, info),) if check.reads_sound else ()
        rows.append((str(number + 1), clip.where, _length(clip, info), _rate(clip, info), _size(info),
                     _frames(clip, info, fps), bucket, tokens, *sound, clip.video.name))
    widths = [min(48, max(len(row[column]) for row in rows)) for column in range(len(header))]
    lines = ["  ".join(_cell(text, width) for text, width in zip(row, widths, strict=True)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * width for width in widths))
    if check.tokens:
        lines.append("tokens: the caption's length in the text encoder's tokens" + (
            " / the most it reads (model.max_sequence_length); CUT: the rest of the caption is not read"
            if check.token_limit else ""))
    lines.append("")
    lines.append("Samples per bucket (frames x height x width):")
    for key, count in check.bucket_counts().items():
        lines.append(f"  {key:>14}  {count}")
    if check.reads_sound:
        lines += ["", check.sound_summary() or ""]
    if notes:
        lines.append("")
        lines.extend(f"({number}) {note}" for number, note in enumerate(notes, start=1))
    return "\n".join(lines)


def _sound_header(check: DataCheck) -> tuple[str, ...]:
    return ("sound",) if check.reads_sound else ()


def _sound(clip: Clip, info: VideoInfo | None) -> str:
    """Whether the sample trains with its sound: `yes` (an audio track), `no` (none: video only), `-` (a still)."""
    if info is None:
        return "?"
    if clip.is_image:
        return "-"
    return "yes" if info.has_audio else "no"


def _cell(text: str, width: int) -> str:
    return text.ljust(width) if len(text) <= width else text[: width - 3] + "..."


def _length(clip: Clip, info: VideoInfo | None) -> str:
    if info is None:
        return "?"
    return "still" if clip.is_image else f"{info.duration:.2f} s"


def _rate(clip: Clip, info: VideoInfo | None) -> str:
    return "-" if info is None or clip.is_image else format_fps(info.fps)


def _size(info: VideoInfo | None) -> str:
    return "?" if info is None else describe_size(info)


def _frames(clip: Clip, info: VideoInfo | None, fps: float | None) -> str:
    if info is None:
        return "?"
    if clip.is_image:
        return "1"
    try:
        return str(frames_available(info.num_frames, fps, info.fps))
    except VidtuneError:
        return "?"


def write_json(check: DataCheck, path: str | os.PathLike[str]) -> Path:
    return atomic_write_text(Path(path), json.dumps(check.to_json(), indent=2, ensure_ascii=False) + "\n")


def write_sheets(check: DataCheck, path: Path, per_page: int = PAGE_ROWS) -> list[Path]:
    """The contact sheet of every sample as it trains, `per_page` rows a page: path, then path-2.png, path-3.png,
    ... Samples that will not train are on it, marked; the source lines that give no sample are listed on the last
    page. For a family that trains on sound, each row says whether the clip has an audio track."""
    clips = check.clips
    header = summary(clips, check.report.sample_problems, check.report.source_problems)
    starts = range(0, max(len(clips), 1), per_page)
    pages = []
    for page, first in enumerate(starts, start=1):
        target = path if page == 1 else path.with_name(f"{path.stem}-{page}{path.suffix}")
        last = page == len(starts)
        pages.append(write_dataset_overview(
            clips[first : first + per_page], check.data, target, problems=check.report.sample_problems,
            unused=check.report.source_problems if last else (), max_rows=per_page, sound=check.reads_sound,
            header=header + (f" (page {page} of {len(starts)})" if len(starts) > 1 else "")))
    return pages
