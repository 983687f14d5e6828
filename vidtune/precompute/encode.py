"""Encoding captions and clips: a functional API, and the precompute stage built on it.

The functional API needs no trainer:

    from vidtune.precompute import encode_captions, encode_videos, Preprocess
    conditions = encode_captions(spec, spec.load_text_components(device), ["a cat"], batch_size=8)
    latents = encode_videos(spec, spec.load_vae(device), ["clip.mp4"], preprocess=Preprocess(49, 512, 768))

Each returns one dict of tensors per item (no batch dimension; `stack_items` batches them again). The
trainer's on-the-fly path calls the same two functions, so a batch read from the cache is the batch it would
have computed.

`precompute(config)` fills the cache for a whole dataset: the text encoders on `precompute.text_device` and
one VAE per entry of `precompute.vae_devices` work concurrently (threads; PyTorch releases the GIL), clips are
decoded by a pool of threads ahead of the VAEs, and each entry is written as soon as it is computed, so an
interrupted run resumes where it stopped. Components are loaded only if something is missing, and released
before it returns. Under torchrun, rank r computes items r, r + world, ... of the work; all ranks then wait
for each other, so every rank can read every entry.
"""

from __future__ import annotations

import gc
import logging
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeVar

import torch
from tqdm.auto import tqdm

from vidtune import parallel
from vidtune.config import Config
from vidtune.data.audio import AudioBatch, ClipAudio, sound_line
from vidtune.data.buckets import check_bucket_shapes
from vidtune.data.sources import Clip, load_dataset
from vidtune.models.registry import get_spec_class
from vidtune.models.spec import CONTROL_INPUT, FRAME_RATE, POSTERIOR_KEYS, ModelSpec, TextComponents, draw_latent
from vidtune.precompute.cache import CacheStore, CorruptEntryError
from vidtune.precompute.plan import CachePlan, InputEntry, Preprocess, build_plan, cache_root
from vidtune.processors import with_reference_controls

logger = logging.getLogger(__name__)

# Loading is not thread-safe: diffusers / transformers patch torch globally while they build a model (meta
# device, skipped initialisation), which would leak into a model another thread builds at the same time.
# Workers load one at a time, then encode concurrently.
_LOAD_LOCK = threading.Lock()

Tensors = dict[str, torch.Tensor]
ClipSource = torch.Tensor | str | os.PathLike | Clip
Decoded = tuple[torch.Tensor, ClipAudio | None]  # a window's frames [F, 3, H, W], and its sound when it is read
T = TypeVar("T")


# ----- functional API --------------------------------------------------------------------------------------
def place(tensors: Tensors, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> Tensors:
    """Move every tensor to `device` and cast floating ones to `dtype` (None: leave as is)."""
    def one(value: torch.Tensor) -> torch.Tensor:
        target = dtype if dtype is not None and value.is_floating_point() else value.dtype
        return value.to(device=device or value.device, dtype=target)

    return {key: one(value) for key, value in tensors.items()}


def split_items(batch: Tensors, count: int, device: torch.device | str | None = None,
                dtype: torch.dtype | None = None) -> list[Tensors]:
    """A batched dict -> one dict per item (see `place` for device and dtype)."""
    return [place({key: value[i] for key, value in batch.items()}, device, dtype) for i in range(count)]


def stack_items(items: Sequence[Tensors]) -> Tensors:
    """One dict per item -> a batched dict (the inverse of `split_items`)."""
    if not items:
        raise ValueError("nothing to stack")
    return {key: torch.stack([item[key] for item in items]) for key in items[0]}


def _chunks(items: Sequence[T], size: int) -> Iterator[Sequence[T]]:
    for start in range(0, len(items), size):
        yield items[start : start + size]


@torch.no_grad()
def encode_captions(spec: ModelSpec, text: TextComponents, captions: Sequence[str], batch_size: int = 8,
                    device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> list[Tensors]:
    """Conditions of each caption (the spec's `prepare_conditions`, `batch_size` captions per call)."""
    items: list[Tensors] = []
    for chunk in _chunks(list(captions), batch_size):
        items.extend(split_items(spec.prepare_conditions(text, list(chunk)), len(chunk), device, dtype))
    return items


@torch.no_grad()
def encode_clip_captions(spec: ModelSpec, text: TextComponents, captions: Sequence[str],
                         windows: torch.Tensor | Sequence[torch.Tensor], batch_size: int = 8,
                         device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> list[Tensors]:
    """Captions encoded with pictures of their clip windows ([F, 3, H, W] in [-1, 1] each, of one shape; the spec's
    `prepare_clip_conditions`), one dict per caption: the one way both the cache and on-the-fly training encode
    them."""
    if len(captions) != len(windows):
        raise ValueError(f"{len(captions)} captions for {len(windows)} clip windows")
    items: list[Tensors] = []
    for start in range(0, len(captions), batch_size):
        frames = torch.stack([windows[i] for i in range(start, min(start + batch_size, len(captions)))])
        chunk = list(captions[start:start + batch_size])
        items.extend(split_items(spec.prepare_clip_conditions(text, chunk, frames), len(chunk), device, dtype))
    return items


def read_clips(clips: Sequence[ClipSource], preprocess: Preprocess | None, workers: int = 2,
               lookahead: int = 8) -> Iterator[Decoded]:
    """Clips as ([F, 3, H, W] tensor, its sound or None) in order, decoded by `workers` threads up to `lookahead`
    clips ahead. The sound is read where `preprocess` says so (`Preprocess.audio`); tensors come without."""
    def decode(clip: ClipSource) -> Decoded:
        if isinstance(clip, torch.Tensor):
            return clip, None
        if preprocess is None:
            raise ValueError("encode_videos: pass preprocess=Preprocess(frames, height, width) to read clip files")
        path = clip.video if isinstance(clip, Clip) else clip
        return preprocess.read(path), preprocess.read_audio(path)

    if workers <= 0:
        yield from (decode(clip) for clip in clips)
        return
    with ThreadPoolExecutor(workers, thread_name_prefix="vidtune-decode") as pool:
        pending: list[Future] = []
        for clip in clips:
            pending.append(pool.submit(decode, clip))
            if len(pending) > lookahead:
                yield pending.pop(0).result()
        for future in pending:
            yield future.result()


def _latent_items(spec: ModelSpec, vae: torch.nn.Module, videos: torch.Tensor, audio: AudioBatch | None, store: str,
                  generators: Sequence[torch.Generator | None] | None, device: torch.device | str | None,
                  dtype: torch.dtype | None, frame_rate: float | None = None) -> list[Tensors]:
    if frame_rate is not None and audio is not None:
        audio = replace(audio, frame_rate=frame_rate)
    # Only a family with an audio format takes the sound (and always gets the argument, even when it is None).
    sound = {"audio": audio} if spec.audio_format() is not None else {}
    items = split_items(spec.prepare_latents(vae, videos, **sound), len(videos))
    if store == "sample":
        generators = generators or [None] * len(items)
        items = [
            {"latents": draw_latent(item, generator),
             **{k: v for k, v in item.items() if k not in POSTERIOR_KEYS}}
            for item, generator in zip(items, generators, strict=True)
        ]
    items = [place(item, device, dtype) for item in items]
    if frame_rate is not None:  # the clip's frame rate beside its latents, float64 whatever `dtype` (29.97 stays)
        items = [{**item, FRAME_RATE: torch.tensor([frame_rate], dtype=torch.float64, device=device)}
                 for item in items]
    return items


@torch.no_grad()
def encode_videos(spec: ModelSpec, vae: torch.nn.Module, clips: torch.Tensor | Sequence[ClipSource],
                  batch_size: int = 4, device: torch.device | str | None = None, dtype: torch.dtype | None = None, *,
                  preprocess: Preprocess | None = None, store: str = "posterior",
                  generators: Sequence[torch.Generator] | None = None, decode_workers: int = 2,
                  audio: AudioBatch | None = None) -> list[Tensors]:
    """The normalised VAE posterior of each clip ({"latents_mean", "latents_std"} + video-derived conditions).

    `clips`: a [B, F, 3, H, W] tensor in [-1, 1] (with `audio`, their sound, for a family that trains on it), or
    a list of such [F, 3, H, W] tensors, video paths or `Clip`s (files are decoded with `preprocess`, ahead of the
    VAE, their sound too where it says so). `store="sample"` returns one drawn latent per clip instead
    ({"latents"}, drawn with `generators`).
    """
    if store not in ("posterior", "sample"):
        raise ValueError(f"store must be 'posterior' or 'sample', not {store!r}")
    if isinstance(clips, torch.Tensor):
        batches: Iterator[tuple[torch.Tensor, AudioBatch | None]] = (
            (clips[i : i + batch_size], None if audio is None else audio.select(slice(i, i + batch_size)))
            for i in range(0, len(clips), batch_size))
    else:
        decoded = read_clips(list(clips), preprocess, workers=decode_workers, lookahead=2 * batch_size)
        batches = _batched_stack(decoded, batch_size)
    items: list[Tensors] = []
    frame_rate = None if preprocess is None or isinstance(clips, torch.Tensor) else preprocess.frame_rate
    for videos, sound in batches:
        chunk_generators = generators[len(items) : len(items) + len(videos)] if generators else None
        items.extend(_latent_items(spec, vae, videos, sound, store, chunk_generators, device, dtype, frame_rate))
    return items


def encode_clip_inputs(spec: ModelSpec, vae: torch.nn.Module | None, inputs: dict[str, Any], latents: Tensors
                       ) -> Tensors:
    """One clip's inputs (`item["inputs"]`: a tensor per kind, a list for an `images` kind) encoded beside its
    latents (no batch dimension), as a batch of one: the one way both the cache and on-the-fly training encode
    them (`spec.encode_inputs`)."""
    batch = {kind: [value] if isinstance(value, list) else value[None] for kind, value in inputs.items()}
    encoded = spec.encode_inputs(vae, batch, {key: value[None] for key, value in latents.items()})
    return {key: value[0].detach().float().cpu().contiguous() for key, value in encoded.items()}


def stack_decoded(decoded: Sequence[Decoded]) -> tuple[torch.Tensor, AudioBatch | None]:
    """Decoded windows of one shape as a batch: frames [B, F, 3, H, W] and their sound (None when not read)."""
    sounds = [sound for _, sound in decoded if sound is not None]
    if 0 < len(sounds) < len(decoded):
        raise ValueError("a batch mixes windows read with and without their sound")
    return torch.stack([video for video, _ in decoded]), AudioBatch.stack(sounds) if sounds else None


def _batched_stack(decoded: Iterator[Decoded], size: int) -> Iterator[tuple[torch.Tensor, AudioBatch | None]]:
    batch: list[Decoded] = []
    for item in decoded:
        batch.append(item)
        if len(batch) == size:
            yield stack_decoded(batch)
            batch = []
    if batch:
        yield stack_decoded(batch)


def as_posterior(entry: Tensors) -> Tensors:
    """A latents entry in the layout training expects: a stored sample becomes a posterior with std 0."""
    if "latents" not in entry:
        return entry
    sample = entry["latents"]
    rest = {k: v for k, v in entry.items() if k != "latents"}
    return {"latents_mean": sample, "latents_std": torch.zeros_like(sample), **rest}


def latent_draw_generator(key: str) -> torch.Generator:
    """The generator of a stored latent sample (store: sample): fixed by the entry's key."""
    return torch.Generator().manual_seed(int(key[:15], 16))


# ----- the precompute stage --------------------------------------------------------------------------------
def shard(items: Sequence[T], rank: int, world: int) -> list[T]:
    """Rank `rank`'s share of `items`: every item in exactly one share, shares differ in size by at most 1."""
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in a world of {world}")
    return list(items[rank::world])


@dataclass
class WorkerReport:
    """What one worker did, and when (for the summary and to show that workers ran concurrently)."""

    name: str
    device: str
    items: int = 0
    started: float | None = None
    finished: float | None = None


@dataclass
class PrecomputeSummary:
    conditions_computed: int = 0
    conditions_reused: int = 0
    latents_computed: int = 0
    latents_reused: int = 0
    corrupt: int = 0
    seconds: float = 0.0
    rank: int = 0
    world: int = 1
    cache_dir: Path | None = None
    workers: list[WorkerReport] = field(default_factory=list)
    computed_keys: dict[str, list[str]] = field(default_factory=dict)  # this rank's, by kind
    plan: CachePlan | None = None
    sound: str | None = None  # which clips train with their sound (a family that trains on it; `sound_line`)
    inputs_computed: int = 0  # per-clip inputs (masks, references, ...; vidtune/data/inputs.py)
    inputs_reused: int = 0
    clip_conditions_computed: int = 0  # captions encoded with their clip's pictures (MiniMax H3's keyframes)
    clip_conditions_reused: int = 0

    def line(self) -> str:
        inputs = (f"; inputs: {self.inputs_computed} computed, {self.inputs_reused} reused"
                  if self.inputs_computed or self.inputs_reused else "")
        with_clips = (f"; captions with their clip: {self.clip_conditions_computed} computed, "
                      f"{self.clip_conditions_reused} reused"
                      if self.clip_conditions_computed or self.clip_conditions_reused else "")
        return (f"conditions: {self.conditions_computed} computed, {self.conditions_reused} reused; "
                f"latents: {self.latents_computed} computed, {self.latents_reused} reused{inputs}{with_clips}")


def build_spec(config: Config) -> ModelSpec:
    return get_spec_class(config.model.name)(
        config.model, frame_rate=config.frame_rate, text_encoder_weights=config.memory.text_encoder_weights,
        vae_tiling=config.memory.vae_tiling,
        base_weights=config.memory.base_weights)


def load_clips(config: Config, spec: ModelSpec, progress: bool = True) -> list[Clip]:
    """The dataset, checked like `vidtune train` checks it (each sample with its probe and bucket, and the inputs
    the run reads)."""
    data = config.data
    spec.check_source()
    check_bucket_shapes(spec, data.bucket_shapes(), single=not data.buckets)
    return with_reference_controls(config, load_dataset(data, progress=progress,
                                                        required_inputs=spec.required_inputs(config)))


def _check_existing(cache: CacheStore, kind: str, keys: list[str]) -> tuple[list[str], int, int]:
    """(keys to compute, entries reused, damaged entries found) - every existing entry is read and verified."""
    todo: list[str] = []
    reused = corrupt = 0
    for key in keys:
        try:
            cache.read(kind, key)
            reused += 1
        except FileNotFoundError:
            todo.append(key)
        except CorruptEntryError as error:
            logger.warning("%s; computing it again.", error)
            cache.remove(kind, key)
            corrupt += 1
            todo.append(key)
    return todo, reused, corrupt


class _Stage:
    """Threads of one precompute: shared stop flag, first error, reports."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.errors: list[BaseException] = []
        self.reports: list[WorkerReport] = []
        self.threads: list[threading.Thread] = []
        self.loaded: list[weakref.ref] = []  # every module a worker loaded, to check it is gone afterwards

    def track(self, *objects: Any) -> None:
        self.loaded.extend(weakref.ref(o) for o in objects if isinstance(o, torch.nn.Module))

    def start(self, name: str, device: str, target: Callable[[WorkerReport], None]) -> None:
        report = WorkerReport(name, device)
        self.reports.append(report)

        def run() -> None:
            report.started = time.perf_counter()
            try:
                target(report)
            except BaseException as error:
                self.errors.append(error)
                self.stop.set()
            finally:
                report.finished = time.perf_counter()

        thread = threading.Thread(target=run, name=f"vidtune-{name}", daemon=True)
        self.threads.append(thread)
        thread.start()

    def join(self) -> None:
        try:
            for thread in self.threads:
                thread.join()
        except BaseException:  # Ctrl-C: let the workers stop after their current batch
            self.stop.set()
            raise
        if self.errors:
            raise self.errors[0]


def _put(items: queue.Queue, value: Any, stop: threading.Event) -> bool:
    while not stop.is_set():
        try:
            items.put(value, timeout=0.1)
            return True
        except queue.Full:
            continue
    return False


def run_encoders(spec: ModelSpec, plan: CachePlan, condition_keys: list[str], latent_keys: list[str], *,
                 batch_size: int, decode_workers: int, progress: bool = True,
                 clip_condition_keys: Sequence[str] = ()) -> list[WorkerReport]:
    """Compute and write the given entries: text and VAE workers concurrently, decoding ahead of the VAEs. The text
    worker also encodes the captions read with their clip window's pictures (`clip_condition_keys`), decoding it."""
    cache, stage = plan.cache, _Stage()
    clip_condition_keys = list(clip_condition_keys)
    bars = {
        "conditions": tqdm(total=len(condition_keys) + len(clip_condition_keys), desc="conditions", unit="caption",
                           position=0, disable=not progress or not (condition_keys or clip_condition_keys),
                           dynamic_ncols=True),
        "latents": tqdm(total=len(latent_keys), desc="latents", unit="clip", position=1,
                        disable=not progress or not latent_keys, dynamic_ncols=True),
    }
    lock = threading.Lock()

    def advance(kind: str, count: int) -> None:
        with lock:
            bars[kind].update(count)

    def text_worker(report: WorkerReport) -> None:
        with _LOAD_LOCK:
            text = spec.load_text(plan.text_device)
        stage.track(*text.modules.values())
        for chunk in _chunks(condition_keys, batch_size):
            if stage.stop.is_set():
                return
            items = encode_captions(spec, text, [plan.conditions[k] for k in chunk], batch_size=len(chunk))
            for key, item in zip(chunk, items, strict=True):
                cache.write("conditions", key, item, plan.condition_info[key])
            report.items += len(chunk)
            advance("conditions", len(chunk))
        for chunk in _chunks(clip_condition_keys, batch_size):
            if stage.stop.is_set():
                return
            write_clip_conditions(spec, plan, text, chunk)
            report.items += len(chunk)
            advance("conditions", len(chunk))
        del text

    # Clips are decoded by a thread pool, a few batches ahead of the VAE workers, which take whole batches
    # (fixed compositions, so results do not depend on timing) from one queue.
    work: queue.Queue = queue.Queue(maxsize=2 * len(plan.vae_devices))
    pool = ThreadPoolExecutor(max(1, decode_workers), thread_name_prefix="vidtune-decode")

    def decode(key: str) -> Decoded:
        preprocess, path = plan.latent_preprocess[key], plan.latents[key]
        return preprocess.read(path), preprocess.read_audio(path)

    def producer(report: WorkerReport) -> None:
        for chunk in _same_shape_chunks(latent_keys, plan, batch_size):
            if not _put(work, (chunk, [pool.submit(decode, key) for key in chunk]), stage.stop):
                return
            report.items += len(chunk)
        for _ in plan.vae_devices:
            _put(work, None, stage.stop)

    def vae_worker(device: torch.device, report: WorkerReport) -> None:
        with _LOAD_LOCK:
            vae = spec.load_vae(device)
        # The VAE, or a wrapper (e.g. VAE + image encoder) and what it holds.
        stage.track(vae, *getattr(vae, "__dict__", {}).values())
        while not stage.stop.is_set():
            try:
                job = work.get(timeout=0.1)
            except queue.Empty:
                continue
            if job is None:
                break
            chunk, futures = job
            videos, audio = stack_decoded([future.result() for future in futures])
            generators = [latent_draw_generator(key) for key in chunk]
            items = _latent_items(spec, vae, videos, audio, plan.store, generators, None, None,
                                  plan.latent_preprocess[chunk[0]].frame_rate)
            for key, item in zip(chunk, items, strict=True):
                cache.write("latents", key, item, plan.latent_info[key])
            report.items += len(chunk)
            advance("latents", len(chunk))
        del vae

    try:
        if condition_keys or clip_condition_keys:
            stage.start("text", str(plan.text_device), text_worker)
        if latent_keys:
            stage.start("decode", "cpu", producer)
            for number, device in enumerate(plan.vae_devices):
                stage.start(f"vae{number}", str(device), lambda report, device=device: vae_worker(device, report))
        stage.join()
    finally:
        stage.stop.set()
        pool.shutdown(wait=True, cancel_futures=True)
        for bar in bars.values():
            bar.close()
    # The workers dropped their components; reference counting frees them unless they sit in a cycle.
    if any(ref() is not None for ref in stage.loaded):
        gc.collect()
    return stage.reports


def write_clip_conditions(spec: ModelSpec, plan: CachePlan, text: TextComponents, keys: Sequence[str]) -> list[Tensors]:
    """Encode captions with their clip window's pictures (read as the window's latents read it), write them and
    return them."""
    entries = [plan.clip_conditions[key] for key in keys]
    items = encode_clip_captions(spec, text, [entry.caption for entry in entries],
                                 [entry.frames() for entry in entries], batch_size=len(entries))
    for key, item in zip(keys, items, strict=True):
        plan.cache.write("clip_conditions", key, item, plan.clip_condition_info[key])
    return items


def _same_shape_chunks(keys: list[str], plan: CachePlan, size: int) -> Iterator[list[str]]:
    """Chunks of up to `size` keys whose clips are read to one shape (one bucket) and play at one frame rate (a
    window's sound lasts frames / rate), so each stacks into a batch."""
    by_shape: dict[tuple[int, int, int, float | None], list[str]] = {}
    for key in keys:
        pre = plan.latent_preprocess[key]
        by_shape.setdefault((pre.frames, pre.height, pre.width, pre.frame_rate), []).append(key)
    for group in by_shape.values():
        yield from (list(chunk) for chunk in _chunks(group, size))


def release_memory(devices: Sequence[torch.device]) -> None:
    """Give the memory of released components back to the device (the CUDA caching allocator)."""
    if any(device.type == "cuda" for device in devices) and torch.cuda.is_available():
        torch.cuda.empty_cache()


def distributed_world(rank: int | None = None, world: int | None = None) -> tuple[int, int]:
    """(rank, world size): given, else torch.distributed's, else torchrun's RANK / WORLD_SIZE, else (0, 1)."""
    if rank is not None and world is not None:
        return rank, world
    return parallel.rank(), parallel.world_size()


def precompute(config: Config, clips: list[Clip] | None = None, *, progress: bool | None = None,
               rank: int | None = None, world: int | None = None) -> PrecomputeSummary:
    """Fill the cache for a config's dataset; returns counts (see `PrecomputeSummary.line`) and the plan."""
    started = time.perf_counter()
    progress = config.logging.progress if progress is None else progress
    spec = build_spec(config)
    # A training run says which clips have sound when it opens its batches; `vidtune precompute` says it here.
    sound = None
    if clips is None:
        clips = load_clips(config, spec, progress=progress)
        sound = sound_line(spec.name, clips) if spec.audio_format() is not None else None
    cache = CacheStore(cache_root(config))
    cache.prepare()
    cache.remove_stale_temporary_files()
    plan = build_plan(config, spec, clips, cache)
    rank, world = distributed_world(rank, world)

    # gloo even beside GPUs: the ranks only exchange a few counts (and a training run's nccl group is reused).
    with parallel.process_group(backend="gloo", this_rank=rank, world=world) as distributed:
        condition_todo, condition_reused, bad_conditions = _check_existing(
            cache, "conditions", shard(list(plan.conditions), rank, world))
        latent_todo, latent_reused, bad_latents = _check_existing(
            cache, "latents", shard(list(plan.latents), rank, world))
        clip_todo, clip_reused, bad_clip_conditions = _check_existing(
            cache, "clip_conditions", shard(list(plan.clip_conditions), rank, world))
        reports = run_encoders(spec, plan, condition_todo, latent_todo, batch_size=config.precompute.batch_size,
                               decode_workers=max(1, config.data.num_workers), progress=progress,
                               clip_condition_keys=clip_todo)
        input_todo, input_reused, bad_inputs = _check_existing(cache, "inputs", shard(list(plan.inputs), rank, world))
        if input_todo and distributed:
            parallel.barrier()  # an input is encoded on its clip's latent grid, which another rank may have written
        run_input_encoders(spec, plan, input_todo, progress=progress)
        if condition_todo or latent_todo or input_todo or clip_todo:
            release_memory([plan.text_device, *plan.vae_devices])
        counts = [len(condition_todo), condition_reused, len(latent_todo), latent_reused,
                  bad_conditions + bad_latents + bad_inputs + bad_clip_conditions, len(input_todo), input_reused,
                  len(clip_todo), clip_reused]
        if distributed:
            # Also waits for every rank: all entries exist after this.
            counts = [int(v) for v in parallel.all_reduce_sum(counts, dtype=torch.long)]
            parallel.barrier()

    return PrecomputeSummary(
        *counts[:5], seconds=time.perf_counter() - started, rank=rank, world=world, cache_dir=cache.root,
        workers=reports, computed_keys={"conditions": condition_todo, "latents": latent_todo, "inputs": input_todo,
                                        "clip_conditions": clip_todo},
        plan=plan, sound=sound, inputs_computed=counts[5], inputs_reused=counts[6],
        clip_conditions_computed=counts[7], clip_conditions_reused=counts[8],
    )


def run_input_encoders(spec: ModelSpec, plan: CachePlan, keys: list[str], progress: bool = True) -> None:
    """Compute and write the given input entries, after the clips' latents they are encoded beside; the VAE is
    loaded only for a kind it encodes (masks need none)."""
    if not keys:
        return
    vae = None
    if any(needs_vae(plan.inputs[key]) for key in keys):
        with _LOAD_LOCK:
            vae = spec.load_vae(plan.vae_devices[0])
    for key in tqdm(keys, desc="inputs", unit="input", disable=not progress, dynamic_ncols=True):
        write_input_entry(spec, plan, vae, key)
    del vae


def write_input_entry(spec: ModelSpec, plan: CachePlan, vae: torch.nn.Module | None, key: str) -> Tensors:
    """Encode one input entry on its clip window's latent grid, write it and return it."""
    entry = plan.inputs[key]
    try:
        latents = plan.cache.read("latents", entry.latent_key)
    except (FileNotFoundError, CorruptEntryError):  # gone since: computed again first
        latents = recompute_entry_latents(spec, plan, entry.latent_key)
    pixels: dict[str, Any] = {entry.kind: entry.pixels()}
    if entry.control_key is not None:  # the window's control clip, read as its own entry reads it: [3, F, H, W]
        control = plan.latent_preprocess[entry.control_key].read(plan.latents[entry.control_key])
        pixels[CONTROL_INPUT] = control.transpose(0, 1)
    item = encode_clip_inputs(spec, vae, pixels, as_posterior(latents))
    plan.cache.write("inputs", key, item, plan.input_info[key])
    return item


def needs_vae(entry: InputEntry) -> bool:
    """A mask alone is pooled onto the latent grid; any other input, or a mask encoded with its control clip, is
    VAE-encoded."""
    return entry.kind != "mask" or entry.control_key is not None


def recompute_entry_latents(spec: ModelSpec, plan: CachePlan, key: str) -> Tensors:
    with _LOAD_LOCK:
        vae = spec.load_vae(plan.vae_devices[0])
    (item,) = encode_videos(spec, vae, [plan.latents[key]], batch_size=1, preprocess=plan.latent_preprocess[key],
                            store=plan.store, generators=[latent_draw_generator(key)], decode_workers=0)
    plan.cache.write("latents", key, item, plan.latent_info[key])
    return {k: v.detach().cpu() for k, v in item.items()}


def recompute_entry(config: Config, spec: ModelSpec, plan: CachePlan, kind: str, key: str) -> Tensors:
    """Compute one entry again (it was missing or damaged when training read it), write it, release the
    component it needed, and return it."""
    if kind == "inputs":
        vae = None
        if needs_vae(plan.inputs[key]):
            with _LOAD_LOCK:
                vae = spec.load_vae(plan.vae_devices[0])
        item = write_input_entry(spec, plan, vae, key)
        del vae
        release_memory([plan.text_device, *plan.vae_devices])
        return dict(item)
    if kind == "clip_conditions":
        with _LOAD_LOCK:
            text = spec.load_text(plan.text_device)
        (item,) = write_clip_conditions(spec, plan, text, [key])
        del text
        release_memory([plan.text_device, *plan.vae_devices])
        return {k: v.detach().cpu() for k, v in item.items()}
    if kind == "conditions":
        with _LOAD_LOCK:
            text = spec.load_text(plan.text_device)
        (item,) = encode_captions(spec, text, [plan.conditions[key]], batch_size=1)
        del text
        info = plan.condition_info[key]
    else:
        with _LOAD_LOCK:
            vae = spec.load_vae(plan.vae_devices[0])
        (item,) = encode_videos(spec, vae, [plan.latents[key]], batch_size=1, preprocess=plan.latent_preprocess[key],
                                store=plan.store, generators=[latent_draw_generator(key)], decode_workers=0)
        del vae
        info = plan.latent_info[key]
    plan.cache.write(kind, key, item, info)
    release_memory([plan.text_device, *plan.vae_devices])
    return {k: v.detach().cpu() for k, v in item.items()}
