"""The clips page: every clip and still of a data config or folder as a card (frames, length, rate, size, bucket,
sound, the problems `vidtune data check` reports), its caption read and written where its source keeps it
(`vidtune.data.caption_files`), and the window training reads, as a video."""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vidtune.captioning.command import CONFIG_SUFFIXES, resolve_data
from vidtune.config import Config, DataConfig
from vidtune.data.caption_files import (
    CaptionFiles,
    CaptionSlot,
    FolderCaptions,
    MetadataCaptions,
    PairsCaptions,
    open_caption_files,
)
from vidtune.data.report import DataCheck, check_data
from vidtune.data.sources import DatasetReport, inspect_dataset
from vidtune.errors import DataError, VidtuneError
from vidtune.studio.security import OutsideRoot


@dataclass
class Card:
    source: int  # which source of the data, in order
    slot: int  # the slot's index in its source (what a caption edit names)
    media: Path
    where: str
    caption: str
    target: str  # where its caption is written, in words
    is_image: bool
    frames: int | None = None
    fps: float | None = None
    size: tuple[int, int] | None = None  # height, width as displayed
    bucket: tuple[int, int, int] | None = None
    sound: bool | None = None
    problems: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)

    @property
    def seconds(self) -> float | None:
        return self.frames / self.fps if self.frames and self.fps else None

    def to_json(self, relative: Any) -> dict[str, Any]:
        return {"source": self.source, "slot": self.slot, "media": relative(self.media), "where": self.where,
                "caption": self.caption, "target": self.target, "image": self.is_image, "frames": self.frames,
                "fps": self.fps, "size": list(self.size) if self.size else None,
                "bucket": list(self.bucket) if self.bucket else None, "sound": self.sound,
                "problems": self.problems, "warnings": self.warnings}


@dataclass
class ClipsView:
    data: str  # what was opened, as given (relative to the root)
    cards: list[Card]
    problems: list[str]  # of the sources, not of one sample
    warnings: list[str]
    note: str  # how the buckets were chosen and what checked the clips
    data_config: DataConfig

    def to_json(self, relative: Any) -> dict[str, Any]:
        return {"data": self.data, "cards": [card.to_json(relative) for card in self.cards],
                "problems": self.problems, "warnings": self.warnings, "note": self.note}


def open_sources(path: Path) -> tuple[list, Config | None, DataConfig]:
    """The sources `vidtune caption` reads for `path`, the config when `path` is one (None otherwise) and the data
    section whose buckets and rates the cards show."""
    sources = resolve_data(str(path), []).sources
    if path.suffix.lower() in CONFIG_SUFFIXES:
        from vidtune.config import load_config
        from vidtune.config_docs import NOT_SET

        config = load_config(path, [], required_placeholder=NOT_SET)
        return sources, (None if NOT_SET in (config.model.name, config.model.pretrained) else config), config.data
    return sources, None, DataConfig(datasets=[source.model_dump() for source in sources])


def caption_files(path: Path) -> list[CaptionFiles]:
    sources, _, _ = open_sources(path)
    opened, problems = [], []
    for source in sources:
        try:
            opened.append(open_caption_files(source))
        except DataError as error:
            problems.extend(error.problems)
    if problems:
        raise DataError(problems)
    return opened


def data_places(root: Path, depth: int = 3) -> list[str]:
    """The folders under `root` that hold clips (a videos.txt, a .csv / .jsonl list, or video and image files),
    relative to it, for the clips page's first screen (hidden folders, runs and the studio's own left out)."""
    from vidtune.data.sources import MEDIA_SUFFIXES
    from vidtune.studio import runs

    found: list[str] = []

    def walk(folder: Path, level: int) -> None:
        try:
            entries = sorted(folder.iterdir())
        except OSError:  # unreadable: nothing to offer there
            return
        files = [entry for entry in entries if entry.is_file()]
        if any(entry.name == "videos.txt" or entry.suffix.lower() in (*MEDIA_SUFFIXES, ".csv", ".jsonl")
               for entry in files):
            found.append(folder.relative_to(root).as_posix() if folder != root else ".")
        if level < depth:
            for entry in entries:
                if (entry.is_dir() and not entry.name.startswith(".") and entry.name not in runs.SKIPPED
                        and not runs.is_run_folder(entry)):
                    walk(entry, level + 1)

    walk(root, 0)
    return found


def view_clips(path: Path, shown_as: str) -> ClipsView:
    """Every sample of the data at `path` (a config file, a folder, a clip list, a .csv / .jsonl) as a card."""
    _, config, data = open_sources(path)
    files = caption_files(path)
    check = _check(config, data)
    note = ("checked as `vidtune data check` checks it (the model's tokenizer counted the caption tokens)"
            if isinstance(check, DataCheck) else
            "buckets of the data section's shape" if path.suffix.lower() in CONFIG_SUFFIXES else
            "buckets of the default shape (open a config for your own)")
    report = check.report if isinstance(check, DataCheck) else check
    shapes = data.bucket_shapes()
    by_media: dict[Path, list[int]] = {}
    for number, clip in enumerate(report.clips):
        by_media.setdefault(Path(clip.video).resolve(), []).append(number)
    cards: list[Card] = []
    for source_number, opened in enumerate(files):
        for slot in opened.slots:
            card = Card(source_number, slot.index, slot.media, slot.where, slot.caption, opened.target(slot),
                        slot.is_image)
            numbers = by_media.get(slot.media.resolve(), [])
            if numbers:
                number = numbers.pop(0)
                clip = report.clips[number]
                if clip.info is not None:
                    card.frames, card.fps = clip.info.num_frames, clip.info.fps
                    card.size, card.sound = (clip.info.height, clip.info.width), clip.info.has_audio
                card.bucket = tuple(shapes[clip.bucket]) if clip.bucket is not None else None
                card.problems = list(report.sample_problems.get(number, []))
                if isinstance(check, DataCheck):
                    card.warnings = list(check.sample_warnings.get(number, []))
            cards.append(card)
    problems = [*(check.config_problems if isinstance(check, DataCheck) else []), *report.source_problems,
                *(problem for opened in files for problem in opened.problems)]
    return ClipsView(shown_as, cards, list(dict.fromkeys(problems)), list(report.warnings), note, data)


def _check(config: Config | None, data: DataConfig) -> DataCheck | DatasetReport:
    """`vidtune data check`'s check when the config names a model that is there, else the sources read and every
    sample probed and bucketed (what that check does before it counts tokens)."""
    if config is not None and Path(config.model.pretrained).is_dir():
        from vidtune.models.registry import get_spec_class

        spec = get_spec_class(config.model.name)(config.model, frame_rate=config.frame_rate)
        spec.check_source()
        return check_data(config, spec, progress=False)
    return inspect_dataset(data, progress=False)


def caption_file(opened: CaptionFiles, slot: CaptionSlot) -> Path:
    """The file a caption of `slot` is written to."""
    if isinstance(opened, PairsCaptions):
        return opened.prompts.path
    if isinstance(opened, FolderCaptions):
        return slot.media.with_suffix(".txt")
    if isinstance(opened, MetadataCaptions):
        return opened.path
    raise VidtuneError(f"Unknown kind of caption source: {type(opened).__name__}.")


def caption_files_outside(path: Path, inside: Callable[[Path], bool]) -> list[str]:
    """The files captions of the data at `path` would be written to that are not `inside` (the studio's root)."""
    return sorted({str(caption_file(opened, slot)) for opened in caption_files(path) for slot in opened.slots
                   if not inside(caption_file(opened, slot))})


def write_caption(path: Path, source: int, slot: int, caption: str, previous: str,
                  inside: Callable[[Path], bool]) -> CaptionSlot:
    """Store `caption` for slot `slot` of source `source`, read anew; refused when the caption there is no longer
    `previous` (changed on disk since the page showed it), so no edit made meanwhile is lost."""
    files = caption_files(path)
    if not 0 <= source < len(files):
        raise VidtuneError(f"{path.name} has no source {source}.")
    opened = files[source]
    found = next((item for item in opened.slots if item.index == slot), None)
    if found is None:
        raise VidtuneError(f"{path.name}: source {source} has no clip {slot}; reload the page.")
    if found.caption != previous:
        raise VidtuneError(f"The caption of {found.where} changed on disk since the page was shown (it is now "
                           f"{found.caption!r}); nothing was written.\nWhat to do: reload the page and edit again.")
    target = caption_file(opened, found)
    if not inside(target):
        raise OutsideRoot(f"The caption of {found.where} goes to {target}, outside the studio's folder; the studio "
                          "writes only under --root.\nWhat to do: edit it there, or start the studio with a --root "
                          "that holds the data.")
    opened.write(found, caption)
    return found


def window_of(path: Path, source: int, slot: int) -> tuple[Path, tuple[int, int, int], DataConfig]:
    """The clip of slot `slot` of source `source`, the bucket training gives it and the data section (one clip
    probed, not the whole data)."""
    from vidtune.data.buckets import assign_bucket
    from vidtune.data.video import is_image_path, probe_image, probe_video

    _, _, data = open_sources(path)
    files = caption_files(path)
    found = next((item for item in files[source].slots if item.index == slot), None) if 0 <= source < len(files) \
        else None
    if found is None:
        raise VidtuneError(f"{path.name}: there is no clip {slot} in source {source}; reload the page.")
    image = is_image_path(found.media)
    info = probe_image(found.media) if image else probe_video(found.media)
    shapes = data.bucket_shapes()
    bucket, reason = assign_bucket(info, image, shapes, data.fps)
    if bucket is None:
        raise VidtuneError(f"{found.where}: training reads no window of it: {reason}")
    return found.media, tuple(shapes[bucket]), data


# ----- pictures --------------------------------------------------------------------------------------------------
def frame_png(media: Path, at: str, size: tuple[int, int] | None = None, resize: str = "crop") -> bytes:
    """The first, middle or last frame of a clip (a still: itself) as PNG bytes, at most 320 pixels wide; with
    `size` (height, width: its bucket's), resized to it as training resizes it (`resize`: data.resize), so the card
    shows the crop that trains."""
    from PIL import Image

    from vidtune.data.video import is_image_path, probe_video, read_frames

    if is_image_path(media):
        index = 0
    else:
        count = probe_video(media).num_frames
        index = {"first": 0, "middle": count // 2, "last": count - 1}[at]
    if size is None and is_image_path(media):
        image = Image.open(media).convert("RGB")
    else:
        image = Image.fromarray(read_frames(media, [index], size, resize)[0])
    image.thumbnail((320, 320))
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def window_video(media: Path, bucket: tuple[int, int, int], data: DataConfig, folder: Path) -> Path:
    """The frames training reads from `media` for `bucket` (from the clip's start, resampled to data.fps and resized
    as data.resize says) as an mp4 in `folder`, made once per clip, shape and settings."""
    from vidtune.data.video import ClipWindow, decode_clip, is_image_path, probe_video, write_video

    frames, height, width = bucket
    stamp = media.stat()
    key = f"{media}|{stamp.st_mtime_ns}|{stamp.st_size}|{bucket}|{data.fps}|{data.resize}"
    target = folder / f"{hashlib.sha256(key.encode()).hexdigest()[:24]}.mp4"
    if not target.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        window = ClipWindow(frames, height, width, data.fps, 0, data.resize)
        array = decode_clip(media, window)
        rate = data.fps or (24.0 if is_image_path(media) else probe_video(media).fps)
        write_video(target, array, rate)  # written beside, then renamed
    return target
