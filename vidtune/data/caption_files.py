"""Reading and writing the captions of a data source where that source keeps them, one caption at a time.

- `pairs`: the caption of the clip on `videos.txt` line n is `prompts.txt` line n (the file is made when missing);
- `folder`: `clip.txt` beside `clip.mp4`;
- `metadata`: the caption column of a `.csv` (added to the header when missing) or the caption key of a `.jsonl` line.

`open_caption_files(source)` lists a source's samples as `CaptionSlot`s (the clip or still, the caption it holds now,
where it is named) and `write(slot, caption)` stores one caption. Each write replaces its file atomically (written
beside it, then renamed), so a kill never leaves a half-written file; a list or sheet is rewritten as a whole with
every other line, row, column, quoting, line ending and byte-order mark kept byte for byte. A file that changed on
disk since it was read is never overwritten (the writer stops with a message instead), so an edit made meanwhile is
not lost.
"""

from __future__ import annotations

import csv
import io
import json
import re
from abc import ABC, abstractmethod
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from vidtune.data.sources import MEDIA_SUFFIXES, folder_files, read_lines
from vidtune.data.video import is_image_path
from vidtune.errors import DataError, VidtuneError
from vidtune.files import atomic_write_bytes, did_you_mean

if TYPE_CHECKING:  # the config's source sections, named for annotations only (vidtune.config sits above data/)
    from vidtune.config import FolderSource, MetadataSource, PairsSource

_LINE_END = re.compile(r"(\r\n|\r|\n)")
_STRIP = " \t\f\v\u00a0\u200b\ufeff"  # as the sources strip what they read
_BOM = "\ufeff"


@dataclass(frozen=True)
class CaptionSlot:
    """One clip or still of a source and the caption it holds now ("" when it has none). `where` names it as the
    user wrote it ('videos.txt line 3', 'clips.csv row 2 (line 3)', 'shoot/beach.mp4'); `index` is its place in
    the source's list, which `write` uses to find it again."""

    media: Path
    caption: str
    where: str
    index: int

    @property
    def is_image(self) -> bool:
        return is_image_path(self.media)


def one_line(text: str) -> str:
    """A caption as every layout stores it: one line, single spaces."""
    return " ".join(text.split())


class CaptionFiles(ABC):
    """The captions of one source. `slots` are its samples in order; `problems` name the lines that give no
    sample to caption (an empty line, a clip that is not there), each with its file and line."""

    def __init__(self, location: Path) -> None:
        self.location = location  # the file (or folder) the captions go to, for messages
        self.slots: list[CaptionSlot] = []
        self.problems: list[str] = []

    @abstractmethod
    def target(self, slot: CaptionSlot) -> str:
        """Where `write` puts the caption of `slot`, in words ('prompts.txt line 3')."""

    @abstractmethod
    def write(self, slot: CaptionSlot, caption: str) -> None:
        """Store `caption` (made one line) as the caption of `slot`, atomically."""


def open_caption_files(source: PairsSource | FolderSource | MetadataSource) -> CaptionFiles:
    """The captions of a `data.datasets` entry (or the `data.root` shorthand as a pairs entry)."""
    if source.type == "pairs":
        return PairsCaptions(Path(source.root), source.videos, source.prompts)
    if source.type == "folder":
        return FolderCaptions(Path(source.root))
    return MetadataCaptions(Path(source.path), source.video_column, source.caption_column)


# ----- text files kept byte for byte ----------------------------------------------------------------------------
@dataclass
class _Line:
    text: str
    end: str  # "\n", "\r\n", "\r", or "" for a last line without one


class _TextFile:
    """A UTF-8 text file as lines with their own line ends (and its byte-order mark), written back atomically; a
    line not changed is written back exactly as it was read."""

    def __init__(self, path: Path, missing_ok: bool = False) -> None:
        self.path = path
        self.bom = False
        self.lines: list[_Line] = []
        self._stamp: tuple[int, int] | None = None
        if not path.is_file():
            if missing_ok and not path.exists():
                return
            read_lines(path)  # raises the sources' message (missing, a folder)
        data = path.read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            read_lines(path)  # raises the sources' message naming the line that is not UTF-8
            raise
        self.bom = text.startswith(_BOM)
        self.lines = _split_lines(text[1:] if self.bom else text)
        self._stamp = _stamp(path)

    @property
    def newline(self) -> str:
        """The line end the file uses (its first), "\\n" for a new file."""
        return next((line.end for line in self.lines if line.end), "\n")

    def text(self) -> str:
        return (_BOM if self.bom else "") + "".join(line.text + line.end for line in self.lines)

    def save(self) -> None:
        """Replace the file with the lines, unless it changed on disk since it was read or last saved."""
        if _stamp(self.path) != self._stamp:
            raise VidtuneError(f"{self.path} changed on disk while captions were being written (edited or written by "
                               "another program), so it was not overwritten.\nWhat to do: run the command again: it "
                               "reads the file anew and captions what is still missing.")
        atomic_write_bytes(self.path, self.text().encode("utf-8"), durable=True)
        self._stamp = _stamp(self.path)


def _split_lines(text: str) -> list[_Line]:
    parts = _LINE_END.split(text)  # [text, end, text, end, ..., last text]
    lines = [_Line(parts[i], parts[i + 1]) for i in range(0, len(parts) - 1, 2)]
    if parts[-1]:
        lines.append(_Line(parts[-1], ""))
    return lines


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        status = path.stat()
    except FileNotFoundError:
        return None
    return status.st_mtime_ns, status.st_size


def _set_line(file: _TextFile, number: int, text: str) -> None:
    """Line `number` (0-based) of `file` set to `text`, empty lines added before it when the file is shorter."""
    while len(file.lines) <= number:
        if file.lines and not file.lines[-1].end:
            file.lines[-1].end = file.newline
        file.lines.append(_Line("", file.newline))
    file.lines[number].text = text


def _resolve(base: Path, text: str) -> Path:
    """A clip path as the sources read it: absolute, or relative to `base`; quotes and backslashes accepted."""
    unquoted = text[1:-1].strip() if len(text) >= 2 and text[0] == text[-1] and text[0] in "'\"" else text
    candidates = [Path(candidate).expanduser() for candidate in (text, unquoted, unquoted.replace("\\", "/"))
                  if candidate]
    resolved = [path if path.is_absolute() else base / path for path in candidates]
    return next((path for path in resolved if path.exists()), resolved[0])


def _media_problem(where: str, text: str, path: Path, base: Path) -> str | None:
    if not path.exists():
        return (f"{where}: the clip {text!r} was not found (looked for {path}).{did_you_mean(path)} Check the "
                f"spelling, or write the path relative to {base}.")
    if path.is_dir():
        return f"{where}: {path} is a folder, not a clip or image."
    return None


# ----- pairs ----------------------------------------------------------------------------------------------------
class PairsCaptions(CaptionFiles):
    """`videos.txt` names the clips; `prompts.txt` line n holds the caption of the clip on line n."""

    def __init__(self, root: Path, videos: str = "videos.txt", prompts: str = "prompts.txt") -> None:
        self.root = root.expanduser().absolute()
        super().__init__(self.root / prompts)
        if not self.root.is_dir():
            raise DataError([f"The dataset folder {self.root} {'is a file' if self.root.exists() else 'does not exist'}"
                             f": a pairs source is a folder holding {videos} (one clip a line)."])
        self.videos_name, self.prompts_name = Path(videos).name, Path(prompts).name
        clips = read_lines(self.root / videos)
        self.prompts = _TextFile(self.root / prompts, missing_ok=True)
        captions = [line.text.strip(_STRIP) for line in self.prompts.lines]
        for number, text in enumerate(clips, start=1):
            where = f"{self.videos_name} line {number}"
            if not text:
                continue  # an empty line names nothing to caption (training reports it)
            media = _resolve(self.root, text)
            problem = _media_problem(where, text, media, self.root)
            if problem:
                self.problems.append(problem)
                continue
            caption = captions[number - 1] if number <= len(captions) else ""
            self.slots.append(CaptionSlot(media, caption, where, number - 1))

    def target(self, slot: CaptionSlot) -> str:
        return f"{self.prompts_name} line {slot.index + 1}"

    def write(self, slot: CaptionSlot, caption: str) -> None:
        _set_line(self.prompts, slot.index, one_line(caption))
        self.prompts.save()


# ----- folder ---------------------------------------------------------------------------------------------------
class FolderCaptions(CaptionFiles):
    """Every clip and image under a folder (hidden ones left out), each with `NAME.txt` beside it."""

    def __init__(self, root: Path) -> None:
        self.root = root.expanduser().absolute()
        super().__init__(self.root)
        if not self.root.is_dir():
            raise DataError([f"The dataset folder {self.root} {'is a file' if self.root.exists() else 'does not exist'}"
                             ": a folder source is a folder of clips and images."])
        media = [path for path in folder_files(self.root) if path.suffix.lower() in MEDIA_SUFFIXES]
        owners: dict[Path, str] = {}  # caption file -> the first sample that reads it
        for path in media:
            where = f"{self.root.name}/{path.relative_to(self.root).as_posix()}"
            caption_file = path.with_suffix(".txt")
            if caption_file in owners:  # clip.mp4 and clip.png read one clip.txt: only the first is captioned
                if not caption_file.is_file():
                    self.problems.append(f"{where} shares its caption file {caption_file.name} with "
                                         f"{owners[caption_file]}, which gets the caption; rename one of them to give "
                                         "each its own.")
                continue
            owners[caption_file] = where
            caption = ""
            if caption_file.is_file():
                try:
                    caption = " ".join(line for line in read_lines(caption_file) if line)
                except DataError as error:
                    self.problems.extend(error.problems)
                    continue
            self.slots.append(CaptionSlot(path, caption, where, len(self.slots)))
        if not media:
            self.problems.append(f"The dataset folder {self.root} holds no clips or images (looked for "
                                 f"{', '.join(MEDIA_SUFFIXES)}, in subfolders too).")

    def target(self, slot: CaptionSlot) -> str:
        return str(slot.media.with_suffix(".txt"))

    def write(self, slot: CaptionSlot, caption: str) -> None:
        atomic_write_bytes(slot.media.with_suffix(".txt"), (one_line(caption) + "\n").encode("utf-8"), durable=True)


# ----- metadata -------------------------------------------------------------------------------------------------
@dataclass
class _Record:
    """A CSV record (its physical lines `first`..`last`, 0-based) or a JSONL line, and where it is named."""

    first: int
    last: int
    where: str


class MetadataCaptions(CaptionFiles):
    """A `.csv` with a header row (the caption column is added when missing) or a `.jsonl` file."""

    def __init__(self, path: Path, video_column: str = "video", caption_column: str = "caption") -> None:
        self.path = path.expanduser().absolute()
        super().__init__(self.path)
        self.video_column, self.caption_column = video_column, caption_column
        suffix = self.path.suffix.lower()
        if suffix not in (".csv", ".jsonl"):
            raise DataError([f"{self.path}: a metadata source must be a .csv or a .jsonl file."])
        self.file = _TextFile(self.path)
        self.is_csv = suffix == ".csv"
        self.records: list[_Record] = []
        self.header: list[str] = []
        if self.is_csv:
            self._read_csv()
        else:
            self._read_jsonl()

    # CSV --------------------------------------------------------------------------------------------------------
    def _csv_records(self) -> Iterator[tuple[int, int, list[str]]]:
        """(first line, last line, cells) of each record, blank lines included (as empty records)."""
        consumed = 0

        def lines() -> Iterator[str]:
            nonlocal consumed
            for line in self.file.lines:
                consumed += 1
                yield line.text + line.end

        reader = csv.reader(lines())
        while True:
            first = consumed
            try:
                cells = next(reader)
            except StopIteration:
                return
            except csv.Error as error:
                raise DataError([f"{self.path.name} line {consumed}: {error}. Check the quotes there."]) from None
            yield first, consumed - 1, cells

    def _read_csv(self) -> None:
        records = self._csv_records()
        try:
            _, header_last, header = next(records)
        except StopIteration:
            raise DataError([f"{self.path} is empty: write a header row (e.g. {self.video_column}) and one row per "
                             "clip."]) from None
        self.header_lines = (0, header_last)
        self.header = [cell.strip(_STRIP) for cell in header]
        if self.video_column not in self.header:
            raise DataError([f"{self.path.name} has no column {self.video_column!r} (line 1, the header row); its "
                             f"columns are: {', '.join(repr(c) for c in self.header if c) or 'none'}. Give the column "
                             "that holds the clip paths (--video-column, or video_column in the dataset entry)."])
        at_video = self.header.index(self.video_column)
        at_caption = self.header.index(self.caption_column) if self.caption_column in self.header else None
        for row, (first, last, cells) in enumerate(records, start=1):
            if not any(cell.strip(_STRIP) for cell in cells):
                continue
            where = f"{self.path.name} row {row} (line {first + 1})"
            video = cells[at_video].strip(_STRIP) if at_video < len(cells) else ""
            if not video:
                self.problems.append(f"{where}: the {self.video_column!r} value is empty: no clip to caption.")
                continue
            media = _resolve(self.path.parent, video)
            problem = _media_problem(where, video, media, self.path.parent)
            if problem:
                self.problems.append(problem)
                continue
            caption = cells[at_caption].strip(_STRIP) if at_caption is not None and at_caption < len(cells) else ""
            self.slots.append(CaptionSlot(media, caption, where, len(self.records)))
            self.records.append(_Record(first, last, where))

    def _write_csv(self, record: _Record, caption: str) -> None:
        if self.caption_column not in self.header:  # a new column, at the end of the header
            first, last = self.header_lines
            cells = next(csv.reader([line.text + line.end for line in self.file.lines[first:last + 1]]))
            self._replace(first, last, [*cells, self.caption_column])
            self.header.append(self.caption_column)
        at = self.header.index(self.caption_column)
        cells = next(csv.reader([line.text + line.end for line in self.file.lines[record.first:record.last + 1]]))
        cells += [""] * (at + 1 - len(cells))
        cells[at] = caption
        self._replace(record.first, record.last, cells)

    def _replace(self, first: int, last: int, cells: list[str]) -> None:
        """Lines `first`..`last` become the one CSV record `cells`; records after it move by the lines it gained
        or lost (a cell with line breaks written with the quotes it needs)."""
        end = self.file.lines[last].end
        buffer = io.StringIO()
        csv.writer(buffer, lineterminator="\r\n").writerow(cells)  # its terminator makes cells with breaks quoted
        written = _split_lines(buffer.getvalue()[:-2])  # quoted cells may hold line breaks of their own
        replacement = [*written[:-1], _Line(written[-1].text if written else "", end)]
        self.file.lines[first:last + 1] = replacement
        shift = len(replacement) - (last - first + 1)
        if shift:
            for other in self.records:
                if other.first > last:
                    other.first += shift
                    other.last += shift

    # JSONL ------------------------------------------------------------------------------------------------------
    def _read_jsonl(self) -> None:
        for number, line in enumerate(self.file.lines):
            where = f"{self.path.name} line {number + 1}"
            if not line.text.strip(_STRIP):
                continue
            try:
                item = json.loads(line.text)
            except json.JSONDecodeError as error:
                self.problems.append(f"{where}: this is not valid JSON ({error.msg} at character {error.colno}).")
                continue
            video = item.get(self.video_column) if isinstance(item, dict) else None
            if not isinstance(video, str) or not video.strip(_STRIP):
                self.problems.append(f"{where}: no clip path under the key {self.video_column!r} (write one object a "
                                     f'line, e.g. {{"{self.video_column}": "clip.mp4"}}).')
                continue
            media = _resolve(self.path.parent, video.strip(_STRIP))
            problem = _media_problem(where, video, media, self.path.parent)
            if problem:
                self.problems.append(problem)
                continue
            caption = item.get(self.caption_column)
            caption = caption.strip(_STRIP) if isinstance(caption, str) else ""
            self.slots.append(CaptionSlot(media, caption, where, len(self.records)))
            self.records.append(_Record(number, number, where))

    def _write_jsonl(self, record: _Record, caption: str) -> None:
        line = self.file.lines[record.first]
        item = json.loads(line.text)
        item[self.caption_column] = caption
        line.text = json.dumps(item, ensure_ascii=False)

    # both -------------------------------------------------------------------------------------------------------
    def target(self, slot: CaptionSlot) -> str:
        record = self.records[slot.index]
        return f"{record.where}, {'column' if self.is_csv else 'key'} {self.caption_column!r}"

    def write(self, slot: CaptionSlot, caption: str) -> None:
        record = self.records[slot.index]
        if self.is_csv:
            self._write_csv(record, one_line(caption))
        else:
            self._write_jsonl(record, one_line(caption))
        self.file.save()

