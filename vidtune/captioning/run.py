"""`vidtune caption`: every clip and still of the data sources that has no caption yet gets one from the model,
written where its source keeps captions as soon as it is made (so a rerun after a kill goes on where it stopped).

A sample that does not decode is reported with its file and line and skipped, the others are captioned; the run
then ends listing every skipped sample (and the command exits 1). A wrong model is reported before any clip is read.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from tqdm import tqdm

from vidtune.captioning.frames import read_media
from vidtune.captioning.qwen_inputs import VisionSettings
from vidtune.captioning.vlm import Media
from vidtune.config.schema import CaptionConfig, FolderSource, MetadataSource, PairsSource
from vidtune.data.caption_files import CaptionFiles, CaptionSlot, open_caption_files
from vidtune.data.video import VideoDecodeError
from vidtune.errors import DataError, VidtuneError

Source = PairsSource | FolderSource | MetadataSource


class Model(Protocol):
    """What captioning needs of a model (`vlm.Captioner`, or a stand-in in tests)."""

    settings: VisionSettings

    def caption(self, batch: Sequence[Media], instructions: Sequence[str]) -> list[str]: ...


@dataclass
class CaptionSummary:
    """What a run did: captions written (or shown, in a dry run), samples that already had one, and every sample
    or line skipped, each with where it is and why."""

    written: int = 0
    kept: int = 0
    skipped: list[str] = field(default_factory=list)
    dry_run: bool = False

    def lines(self) -> list[str]:
        verb = "would write" if self.dry_run else "wrote"
        found = [f"Captions: {verb} {self.written}, kept {self.kept} that already had one, skipped "
                 f"{len(self.skipped)}."]
        if self.skipped:
            found.append("Skipped (no caption written):")
            found.extend(f"  - {line}" for line in self.skipped)
            found.append("What to do: fix or remove these clips (or lines) and run the command again; it captions only "
                         "what has no caption yet.")
        return found


def open_sources(sources: Sequence[Source]) -> list[CaptionFiles]:
    """Every source's captions, read before any model loads; a source that cannot be read at all stops here."""
    opened, problems = [], []
    for source in sources:
        try:
            opened.append(open_caption_files(source))
        except DataError as error:
            problems.extend(error.problems)
    if problems:
        listed = "\n".join(f"  - {problem}" for problem in problems)
        raise VidtuneError(f"The captions cannot be written; nothing was captioned:\n{listed}\n"
                           "What to do: fix the files above and run the command again.")
    return opened


def to_caption(files: Sequence[CaptionFiles], overwrite: bool) -> tuple[list[tuple[CaptionFiles, CaptionSlot]], int]:
    """The samples to caption (those without a caption, or all with `overwrite`) and how many keep theirs."""
    todo = [(source, slot) for source in files for slot in source.slots if overwrite or not slot.caption]
    kept = sum(len(source.slots) for source in files) - len(todo)
    return todo, kept


def instruction_for(settings: CaptionConfig, is_image: bool) -> str:
    return settings.instruction.replace("{media}", "image" if is_image else "video")


def with_prefix(settings: CaptionConfig, caption: str) -> str:
    prefix = settings.prefix.strip()
    return f"{prefix} {caption}" if prefix else caption


def caption_all(files: Sequence[CaptionFiles], settings: CaptionConfig, load_model: Callable[[], Model],
                overwrite: bool = False, dry_run: bool = False, progress: bool = True,
                show: Callable[[str], None] = tqdm.write) -> CaptionSummary:
    """Caption what `files` lack (everything with `overwrite`), `settings.batch_size` samples a model call, each
    caption written as soon as it is made. A dry run lists what would be captioned and where each caption would
    go, and loads no model. The model is loaded only when there is something to caption."""
    summary = CaptionSummary(dry_run=dry_run)
    for source in files:
        summary.skipped.extend(source.problems)
    todo, summary.kept = to_caption(files, overwrite)
    if not todo:
        return summary
    if dry_run:
        for source, slot in todo:
            show(f"{source.target(slot)}: would caption {slot.where}")
        summary.written = len(todo)
        return summary
    model = load_model()
    pending: list[tuple[CaptionFiles, CaptionSlot, Media]] = []

    def flush() -> None:
        captions = model.caption([media for _, _, media in pending],
                                 [instruction_for(settings, media.is_image) for _, _, media in pending])
        for (source, slot, _), caption in zip(pending, captions, strict=True):
            if not caption:
                summary.skipped.append(f"{slot.where} ({slot.media}): the model wrote no caption for it (try another "
                                       "--instruction, or a larger --max-new-tokens).")
                continue
            source.write(slot, with_prefix(settings, caption))
            summary.written += 1
        pending.clear()

    bar = tqdm(total=len(todo), desc="Captioning", unit="clip", disable=not progress)
    for source, slot, media in decoded(todo, settings, model.settings, ahead=2 * settings.batch_size):
        bar.update()
        if isinstance(media, VideoDecodeError):
            summary.skipped.append(f"{slot.where} ({slot.media}): {media.reason}")
            show(f"Skipped {slot.where}: {media.reason}")
            continue
        pending.append((source, slot, media))
        if len(pending) == settings.batch_size:
            flush()
    if pending:
        flush()
    bar.close()
    return summary


def decoded(todo: Sequence[tuple[CaptionFiles, CaptionSlot]], settings: CaptionConfig, vision: VisionSettings,
            ahead: int) -> Iterator[tuple[CaptionFiles, CaptionSlot, Media | VideoDecodeError]]:
    """Each sample with its frames (or why they cannot be read), in order, decoded by a thread up to `ahead`
    samples before the model needs them (decoding and generating overlap; PyAV and torch release the GIL)."""

    def decode(slot: CaptionSlot) -> Media | VideoDecodeError:
        try:
            return read_media(slot.media, vision, settings.fps, settings.max_frames, settings.max_pixels)
        except VideoDecodeError as error:
            return error

    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="caption-decode")
    waiting = iter(todo)
    queued: deque[tuple[CaptionFiles, CaptionSlot, Future[Media | VideoDecodeError]]] = deque()
    try:
        while True:
            while len(queued) < ahead and (item := next(waiting, None)) is not None:
                queued.append((item[0], item[1], pool.submit(decode, item[1])))
            if not queued:
                return
            source, slot, future = queued.popleft()
            yield source, slot, future.result()
    finally:  # stopped (Ctrl-C, an error): decode nothing more
        pool.shutdown(wait=True, cancel_futures=True)


def load_captioner(settings: CaptionConfig) -> Model:
    """The model of `settings` on its device (what `caption_all` calls when there is something to caption)."""
    import torch

    from vidtune.captioning.vlm import Captioner, resolve_dtype
    from vidtune.models.hub import check_hub_model, looks_local
    from vidtune.parallel import parse_device

    if not looks_local(settings.model):  # offline or the hub unreachable: said at once, before a long load
        check_hub_model(settings.model, None, "captioning", (), setting="caption.model (--model)")
    name = settings.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = parse_device(name, "caption.device (--device)")
    return Captioner(settings.model, device, resolve_dtype(settings.dtype, device), settings.max_new_tokens)


def describe_sources(files: Sequence[CaptionFiles]) -> str:
    return ", ".join(str(Path(source.location)) for source in files)
