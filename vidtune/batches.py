"""The seeded, resumable stream of training batches: one interface, from the cache or encoded on the fly.

A `Batch` holds what the loss needs: the conditions (text encoders' outputs), the latents (the VAE posterior
and any video-derived conditions) of samples of one bucket, and the stream positions of its samples, which seed
each visit's randomness (see `vidtune.data.buckets`). Two sources give the same batches for the same config
(with `data.frame_sampling` `start` or `middle`; `random` draws any start on the fly, one of the cached windows
from the cache):

- `CachedBatches` reads precomputed entries (`vidtune.precompute`), kept in memory after their first read; on a
  GPU a background thread reads ahead of the step. The encoders are never loaded.
- `EncodedBatches` decodes clips in DataLoader workers (each window once: later visits read it back from the
  `FrameStore`) and encodes them in this process with the functional API the precompute stage uses
  (`encode_captions`, `encode_videos`), each caption and window once (`EncodedStore`) while they fit.

On CUDA, loaded batches are pinned and copied without blocking, so the step waits neither for a read nor a copy.

Both also give the conditions of the empty caption, for caption dropout with the `empty` technique.
"""

from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from torch import nn
from torch.utils.data import DataLoader

from vidtune import parallel
from vidtune.config import Config
from vidtune.data.audio import AudioBatch
from vidtune.data.buckets import BatchSchedule, ScheduleSampler
from vidtune.data.captions import preservation_caption
from vidtune.data.dataset import VideoCaptionDataset, collate_samples
from vidtune.data.encoded_store import EncodedStore
from vidtune.data.frame_store import FrameStore
from vidtune.data.sources import Clip, draw_weights
from vidtune.models.spec import (
    CONTROL_INPUT,
    CONTROL_LATENTS,
    FRAME_RATE,
    Conditions,
    Latents,
    ModelSpec,
    TextComponents,
)
from vidtune.precompute import (
    CachedClips,
    collate_cached,
    encode_captions,
    encode_clip_captions,
    encode_clip_inputs,
    encode_videos,
    stack_items,
)
from vidtune.processors import configured_processor, control_downscale

T = TypeVar("T")


@dataclass
class Batch:
    conditions: Conditions
    latents: Latents
    positions: torch.Tensor  # [B] long: each clip's position in the stream
    indices: torch.Tensor  # [B] long: each clip's index in the dataset
    # `training.preserve_base`: the conditions of each visit's preservation caption (empty when off).
    preserve: Conditions = field(default_factory=dict)
    # Per clip, from its source: the probability its caption is dropped, its loss weight, whether it regularizes.
    dropout: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    loss_weights: torch.Tensor = field(default_factory=lambda: torch.zeros(0))
    regularization: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.bool))


class BatchSource(ABC):
    """Batches of `training.batch_size` samples of one bucket, for this rank, from any position of the stream, on
    `device`. The samples come from `load_dataset` (each with its bucket)."""

    read_ahead = 0  # batches a background thread loads ahead of the step (0: the loader's own workers do)

    def __init__(self, config: Config, clips: Sequence[Clip], device: torch.device) -> None:
        self.config = config
        self.clips = list(clips)
        self.device = device
        self.schedule = BatchSchedule([clip.bucket or 0 for clip in self.clips], [clip.repeats for clip in self.clips],
                                      config.training.batch_size, config.training.seed, draw_weights(self.clips))

    def batches(self, start_position: int) -> Iterator[Batch]:
        """The endless stream from `start_position` (samples consumed so far by all ranks)."""
        # The ranks of a data group (parallel.context) share their samples: each holds part of their tokens.
        context = self.config.parallel.context.degree
        sampler = ScheduleSampler(self.schedule, start_position, rank=parallel.data_rank(context),
                                  world=parallel.data_world(context))
        loaded = self.loader(sampler)
        for raw in read_ahead(loaded, self.read_ahead) if self.read_ahead else loaded:
            conditions, latents = self.encode(raw)
            clips = [self.clips[int(index)] for index in raw["index"]]
            preserve = self.preservation(raw) if self.config.training.preserve_base is not None else {}
            dropout = self.config.data.caption_dropout
            yield Batch(to_device(conditions, self.device), to_device(latents, self.device), raw["position"],
                        raw["index"], to_device(preserve, self.device),
                        torch.tensor([dropout if clip.style.dropout is None else clip.style.dropout for clip in clips]),
                        torch.tensor([clip.loss_weight for clip in clips]),
                        torch.tensor([clip.regularization for clip in clips]))

    @abstractmethod
    def loader(self, sampler: ScheduleSampler) -> DataLoader:
        """Batches of items at `sampler`'s keys, each with its "position"."""

    @abstractmethod
    def encode(self, raw: dict[str, Any]) -> tuple[Conditions, Latents]:
        """(conditions, latents) of one loaded batch."""

    @abstractmethod
    def preservation(self, raw: dict[str, Any]) -> Conditions:
        """The conditions of each visit's preservation caption (`training.preserve_base`) of one loaded batch."""

    @abstractmethod
    def prompt(self, caption: str) -> Conditions:
        """The conditions of a caption that is not a clip's (an empty or negative prompt), a batch of one, on
        `device`."""

    def empty_caption(self) -> Conditions:
        """The conditions of the empty caption, a batch of one, on `device`."""
        return self.prompt("")


class CachedBatches(BatchSource):
    """Batches read from the precompute cache (an entry that is damaged or gone is computed again)."""

    def __init__(self, config: Config, clips: Sequence[Clip], device: torch.device, cached: CachedClips) -> None:
        super().__init__(config, clips, device)
        self.cached = cached
        # On a GPU a thread reads (and pins) the next batches while the device computes. On the CPU the read (and,
        # after the first epoch, a copy from memory) costs a fraction of a millisecond, and a thread would only
        # take the GIL and a core from the step.
        self.read_ahead = 2 if device.type == "cuda" else 0

    def loader(self, sampler: ScheduleSampler) -> DataLoader:
        # Reading an entry is far cheaper than a step: no worker processes (nor their memory) needed.
        return DataLoader(self.cached, batch_sampler=sampler, num_workers=0, collate_fn=collate_cached,
                          pin_memory=self.device.type == "cuda")

    def encode(self, raw: dict[str, Any]) -> tuple[Conditions, Latents]:
        return raw["conditions"], raw["latents"]

    def preservation(self, raw: dict[str, Any]) -> Conditions:
        return raw["preserve"]

    def prompt(self, caption: str) -> Conditions:
        return to_device(self.cached.prompt_conditions(caption), self.device)


class EncodedBatches(BatchSource):
    """Clips decoded by `data.num_workers` worker processes and encoded here, batch by batch."""

    def __init__(self, config: Config, clips: Sequence[Clip], device: torch.device, spec: ModelSpec,
                 text: TextComponents, vae: nn.Module) -> None:
        super().__init__(config, clips, device)
        self.spec = spec
        self.text = text
        self.vae = vae
        self.store = FrameStore.create(config.data.frame_store_mib, config.data.num_workers)
        self.encoded = EncodedStore(config.data.encoded_store_mib * 2**20)

    def loader(self, sampler: ScheduleSampler) -> DataLoader:
        data = self.config.data
        rates = [self.spec.clip_frame_rate(clip, data.fps) for clip in self.clips]
        dataset = VideoCaptionDataset(self.clips, data.bucket_shapes(), data.fps, data.resize, data.frame_sampling,
                                      self.config.training.seed, configured_processor(self.config), self.store,
                                      self.spec.audio_format(), rates if any(r is not None for r in rates) else None,
                                      self.spec.input_kinds(self.config), control_downscale(self.config))
        return DataLoader(
            dataset,
            batch_sampler=sampler,
            num_workers=data.num_workers,
            collate_fn=collate_samples,
            pin_memory=self.device.type == "cuda",
            persistent_workers=data.num_workers > 0,
            prefetch_factor=2 if data.num_workers > 0 else None,
        )

    def encode(self, raw: dict[str, Any]) -> tuple[Conditions, Latents]:
        captions = raw["caption"]

        def encode_captions_at(picks: list[int]) -> list[Conditions]:
            chosen = [captions[i] for i in picks]
            return encode_captions(self.spec, self.text, chosen, batch_size=len(picks), device="cpu")

        def encode_windows_at(picks: list[int]) -> list[Latents]:
            # Windows of one frame rate at a time: the rate sets how long a window's sound lasts (a family whose
            # sound follows the rate never batches clips of several rates: `ModelSpec.check_frame_settings`).
            rates = raw.get("frame_rate")
            by_rate: dict[float | None, list[int]] = {}
            for pick in picks:
                by_rate.setdefault(None if rates is None else float(rates[pick]), []).append(pick)
            encoded: dict[int, Latents] = {}
            for rate, chosen in by_rate.items():
                audio = AudioBatch(raw["audio"], raw["audio_present"], rate).select(chosen) if "audio" in raw else None
                latents = encode_videos(self.spec, self.vae, raw["video"][chosen], batch_size=len(chosen),
                                        device="cpu", audio=audio)
                if "control" in raw:  # control training: the control clips' latents, from the same VAE
                    controls = encode_videos(self.spec, self.vae, raw["control"][chosen], batch_size=len(chosen),
                                             device="cpu")
                    latents = [{**item, CONTROL_LATENTS: control["latents_mean"]}
                               for item, control in zip(latents, controls, strict=True)]
                if "inputs" in raw:  # per-clip inputs, each encoded as the precompute stage encodes it
                    latents = [{**item, **encode_clip_inputs(self.spec, self.vae, self.clip_inputs(raw, pick), item)}
                               for pick, item in zip(chosen, latents, strict=True)]
                if rate is not None:  # each sample's rate goes beside its latents, as the cache stores it
                    latents = [{**item, FRAME_RATE: torch.tensor([rate], dtype=torch.float64)} for item in latents]
                encoded.update(zip(chosen, latents, strict=True))
            return [encoded[pick] for pick in picks]

        # A window is its clip, bucket and start frame: the same frames (and sound), so the same posterior, at every
        # visit.
        windows = [("window", *key) for key in zip(raw["index"].tolist(), raw["bucket"].tolist(),
                                                   raw["start"].tolist(), strict=True)]
        conditions = self.encoded.items([("caption", caption) for caption in captions], encode_captions_at)
        latents = self.encoded.items(windows, encode_windows_at)
        if self.spec.reads_clip_in_conditions:  # each caption with its window's pictures, beside the latents
            def encode_with_frames_at(picks: list[int]) -> list[Conditions]:
                return encode_clip_captions(self.spec, self.text, [captions[i] for i in picks],
                                            [raw["video"][i] for i in picks], batch_size=len(picks), device="cpu")

            with_clip = self.encoded.items([("clip caption", caption, *window) for caption, window in
                                            zip(captions, windows, strict=True)], encode_with_frames_at)
            latents = [{**item, **extra} for item, extra in zip(latents, with_clip, strict=True)]
        return stack_items(conditions), stack_items(latents)

    def clip_inputs(self, raw: dict[str, Any], pick: int) -> dict[str, Any]:
        """One sample's inputs as `encode_clip_inputs` takes them; with its control clip ([3, F, H, W]) when one of
        them is encoded with it (`ModelSpec.inputs_with_control`)."""
        inputs = {kind: values[pick] for kind, values in raw["inputs"].items()}
        if "control" in raw and any(kind in self.spec.inputs_with_control for kind in inputs):
            inputs[CONTROL_INPUT] = raw["control"][pick].transpose(0, 1)
        return inputs

    def preservation(self, raw: dict[str, Any]) -> Conditions:
        options, seed = self.config.training.preserve_base, self.config.training.seed
        assert options is not None
        captions = [preservation_caption(untriggered, self.clips[int(index)].style, options.prompts,
                                         options.class_word, seed, int(position))
                    for untriggered, index, position in zip(raw["untriggered"], raw["index"], raw["position"],
                                                            strict=True)]

        def encode_at(picks: list[int]) -> list[Conditions]:
            chosen = [captions[i] for i in picks]
            return encode_captions(self.spec, self.text, chosen, batch_size=len(picks), device="cpu")

        return stack_items(self.encoded.items([("caption", caption) for caption in captions], encode_at))

    def prompt(self, caption: str) -> Conditions:
        return to_device(stack_items(encode_captions(self.spec, self.text, [caption], batch_size=1)), self.device)


def to_device(tensors: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    return {key: value.to(device, non_blocking=True) for key, value in tensors.items()}


def read_ahead(items: Iterable[T], depth: int) -> Iterator[T]:
    """`items`, loaded up to `depth` ahead by a background thread; its errors are raised here, in order.

    The iterator is created in the caller's thread, at the first `next`: a DataLoader draws its base seed from the
    global RNG then, exactly when it would without the thread (a resumed run restores its RNGs after that)."""
    iterator = iter(items)
    loaded: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=depth)
    finished = threading.Event()

    def put(kind: str, value: Any) -> bool:
        while not finished.is_set():
            try:
                loaded.put((kind, value), timeout=0.1)
                return True
            except queue.Full:
                continue
        return False  # the consumer is gone

    def load() -> None:
        try:
            for item in iterator:
                if not put("item", item):
                    return
        except BaseException as error:  # handed to the consumer, which raises it
            put("error", error)
            return
        put("end", None)

    thread = threading.Thread(target=load, name="vidtune-read-ahead", daemon=True)
    thread.start()
    try:
        while True:
            kind, value = loaded.get()
            if kind == "error":
                raise value
            if kind == "end":
                return
            yield value
    finally:
        finished.set()
        # No thread outlives the stream: one still reading at interpreter exit can abort the process.
        thread.join()
