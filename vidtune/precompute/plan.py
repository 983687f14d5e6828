"""Which cache entries a config needs, and the key of each: what makes the cache never stale.

A condition's key covers the spec's `condition_identity()` (the family, its format version, the caption
length, and the constants its `prepare_conditions` reads, e.g. HunyuanVideo's prompt template), the identity
of every text component (tokenizers and encoders), the text encoder dtype (and `memory.text_encoder_weights`
when set) and the caption text. A latent's key
covers the spec's `latent_identity()` (the family, its format version, and the constants its `prepare_latents`
reads, e.g. an image-to-video family's first-frame noise), the identity and dtype of the VAE (and image
encoder), the preprocessing (the bucket's frames and size, resize mode, fps, the window's first frame, and for a
family that tells its denoiser a frame rate the clip's rate, which its entry stores), the clip's
content hash, the storage mode and `memory.vae_tiling` when on. A clip has one entry per window it offers
(see `data.frame_sampling` and `precompute.windows_per_clip`). Nothing
else is in a key: settings that do not change the tensors (validation, LoRA, the optimizer) keep the cache,
and a change that touches only one kind re-encodes only that kind.

A caption encoded with pictures of its clip window (a family whose `reads_clip_in_conditions`) has a key of its own,
covering the condition's parts, `clip_condition_identity()` and its components, the caption, the clip's content hash
and the window it is read with (frames, size, resize, fps, start): editing a caption or a clip re-encodes only the
entries that read it.

A component's identity is its hub id + commit (or revision), or, for a local folder, a hash of the contents
of its files; a clip's identity is the hash of its content, not its name. Hashes are memoised in the cache
folder by (path, size, mtime, ctime, inode), so only new or changed files are read.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from vidtune import parallel
from vidtune.algorithms import traits_of
from vidtune.config import Config
from vidtune.data.audio import AudioFormat, ClipAudio, read_audio
from vidtune.data.buckets import window_starts
from vidtune.data.captions import preservation_caption, shuffle_variants
from vidtune.data.input_files import InputRead, control_window, frames_tensor, input_reads
from vidtune.data.inputs import INPUT_KINDS
from vidtune.data.sources import Clip
from vidtune.data.video import ClipWindow, read_clip
from vidtune.errors import ConfigError
from vidtune.models.spec import ModelSpec
from vidtune.precompute.cache import CacheStore, Fingerprints, entry_key
from vidtune.processors import apply_processor, configured_processor, control_downscale, processor_identity

# Bump when `read_clip` changes what it returns for the same arguments.
PREPROCESS_VERSION = 2
TEXT_COMPONENT_PREFIXES = ("text_encoder", "tokenizer")


def cache_root(config: Config) -> Path:
    """`precompute.cache_dir`, or `.vidtune-cache` in the first dataset's folder (a metadata file's folder)."""
    if config.precompute.cache_dir:
        return Path(config.precompute.cache_dir).expanduser().absolute()
    first = config.data.sources()[0]
    folder = Path(first.path).parent if first.type == "metadata" else Path(first.root)
    return (folder / ".vidtune-cache").expanduser().absolute()


def text_component_names(spec: ModelSpec) -> tuple[str, ...]:
    """The tokenizers and text encoders of a spec (e.g. text_encoder, tokenizer, text_encoder_2, tokenizer_2)."""
    return tuple(n for n in spec.required_components() if n.startswith(TEXT_COMPONENT_PREFIXES))


def video_component_names(spec: ModelSpec) -> tuple[str, ...]:
    """What `spec.load_vae` loads: the VAE, plus e.g. the image encoder of an image-to-video family."""
    text = set(text_component_names(spec))
    return tuple(n for n in spec.required_components() if n not in text and n not in ("transformer", "scheduler"))


def _hub_commit(repo_id: str, subfolder: str | None, revision: str | None) -> str | None:
    """The commit a hub revision resolves to in the local hub cache (what from_pretrained would load)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        filename = f"{subfolder}/config.json" if subfolder else "config.json"
        found = try_to_load_from_cache(repo_id, filename, revision=revision)
    except Exception:  # a malformed id or an unusual cache: fall back to the revision name
        return None
    if not isinstance(found, str):
        return None
    parts = Path(found).parts
    return parts[parts.index("snapshots") + 1] if "snapshots" in parts else None


def component_identity(spec: ModelSpec, component: str, fingerprints: Fingerprints) -> str:
    """`local:<hash of the folder's files>` or `hub:<id>@<commit or revision>/<subfolder>`."""
    source, subfolder = spec.component_source(component)
    local = Path(source).expanduser()
    if local.is_dir():
        folder = local / subfolder if subfolder else local
        if not folder.is_dir():
            raise ConfigError(f"model: the {component} folder {folder} does not exist")
        return "local:" + fingerprints.tree(folder)
    revision = spec.config.revision
    commit = _hub_commit(source, subfolder, revision)
    return f"hub:{source}@{commit or revision or 'main'}/{subfolder or ''}"


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class Preprocess:
    """How a clip (or still) becomes the tensor the VAE sees (what `VideoCaptionDataset` / `read_clip` do)."""

    frames: int
    height: int
    width: int
    fps: float | None = None
    resize: str = "crop"  # read_clip: crop / fit / stretch to the size
    start: int = 0  # the window's first source frame
    # Control training with `control.processor`: (name, sorted options) of the processor the clip goes through.
    processor: tuple[str, tuple[tuple[str, Any], ...]] | None = None
    # A family that trains on the clip's sound (`spec.audio_format()`): the window's sound is read too.
    audio: AudioFormat | None = None
    # A family that tells its denoiser a frame rate (`spec.clip_frame_rate`): the clip's, stored in its entry.
    frame_rate: float | None = None

    @classmethod
    def from_config(cls, config: Config) -> Preprocess:
        """The one-bucket shorthand's preprocessing, from the first frame."""
        data = config.data
        return cls(data.frames, data.height, data.width, data.fps, data.resize)

    @property
    def window(self) -> ClipWindow:
        """The frames and size `read` decodes."""
        return ClipWindow(self.frames, self.height, self.width, self.fps, self.start, self.resize)

    def read(self, path: str | Path) -> torch.Tensor:
        video = read_clip(path, self.window)
        if self.processor is None:
            return video
        name, options = self.processor
        return apply_processor(name, dict(options), video)

    def read_audio(self, path: str | Path) -> ClipAudio | None:
        """The window's sound, as `VideoCaptionDataset` reads it; None when this preprocessing reads none."""
        if self.audio is None:
            return None
        return read_audio(path, self.frames, self.start, self.audio)

    def describe(self) -> dict[str, Any]:
        described = {"frames": self.frames, "height": self.height, "width": self.width, "fps": self.fps,
                     "resize": self.resize, "start": self.start, "version": PREPROCESS_VERSION}
        if self.processor is not None:  # only then: keys of unprocessed clips stay what they were
            described["processor"] = processor_identity(self.processor[0], dict(self.processor[1]))
        if self.audio is not None:  # likewise: only the families that read sound have it in their keys
            described["audio"] = self.audio.describe()
        if self.frame_rate is not None:  # and those that store the clip's frame rate
            described["frame_rate"] = self.frame_rate
        return described


def precompute_device(name: str, training_device: str, key: str) -> torch.device:
    """A precompute device: `auto` is the training device (`vidtune.parallel.resolve_device`'s rule, so under
    torchrun this rank's GPU); an explicit name (the setting `key`) is taken as given, as several VAE workers
    may use several GPUs."""
    return parallel.resolve_device(training_device) if name == "auto" else parallel.parse_device(name, key)


@dataclass(frozen=True)
class InputEntry:
    """One cached input of one clip window (`vidtune.data.inputs`): its kind, how its pixels are read (one read per
    file), and the clip window's latent entry, whose grid it is encoded on."""

    kind: str
    reads: tuple[InputRead, ...]
    latent_key: str
    where: str  # the clip's file and line, for messages
    # A kind the spec encodes with the clip's control clip (`inputs_with_control`): the control window's latent
    # entry, whose clip and preprocessing give its pixels.
    control_key: str | None = None

    def pixels(self) -> torch.Tensor | list[torch.Tensor]:
        """What the dataset gives for it: [3, F, H, W] in [-1, 1], a list of [3, 1, H, W] for an `images` kind."""
        read = [frames_tensor(one.frames()) for one in self.reads]
        return read if INPUT_KINDS[self.kind].media == "images" else read[0]


@dataclass(frozen=True)
class ClipConditionEntry:
    """One caption encoded with pictures of one clip window (`ModelSpec.prepare_clip_conditions`): the caption, and
    the clip and window its pictures are read from, as the window's latents read it."""

    caption: str
    clip: Path
    preprocess: Preprocess

    def frames(self) -> torch.Tensor:
        """The window's frames [F, 3, H, W] in [-1, 1], read as its latents read them."""
        return self.preprocess.read(self.clip)


@dataclass
class CachePlan:
    """Per-sample keys and the unique entries they point to, for one config and dataset."""

    cache: CacheStore
    store: str
    text_device: torch.device
    vae_devices: list[torch.device]
    text_dtype: torch.dtype
    vae_dtype: torch.dtype
    condition_keys: list[str] = field(default_factory=list)  # one per sample
    latent_keys: list[str] = field(default_factory=list)  # one per sample: its first window
    latent_windows: list[list[str]] = field(default_factory=list)  # per sample: every window it offers
    # Control training: per sample, its control clip's entry for each of those windows (empty without control).
    control_windows: list[list[str]] = field(default_factory=list)
    # Per sample, kind -> its input's entry for each of those windows (`spec.input_kinds`; empty without inputs).
    input_windows: list[dict[str, list[str]]] = field(default_factory=list)
    inputs: dict[str, InputEntry] = field(default_factory=dict)  # key -> what it is made of, dataset order
    input_info: dict[str, dict[str, Any]] = field(default_factory=dict)
    conditions: dict[str, str] = field(default_factory=dict)  # key -> caption, dataset order
    latents: dict[str, Path] = field(default_factory=dict)  # key -> clip, dataset order
    latent_preprocess: dict[str, Preprocess] = field(default_factory=dict)  # key -> how its clip is read
    condition_info: dict[str, dict[str, Any]] = field(default_factory=dict)
    latent_info: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Per sample, its caption's fixed tag shuffles (`shuffle_tags`: `precompute.caption_shuffles`; else its key).
    condition_variants: list[list[str]] = field(default_factory=list)
    caption_variants: list[list[str]] = field(default_factory=list)  # the same shuffles' text, without the trigger
    # `training.preserve_base`: every preservation caption a visit may read -> its key.
    preserve_keys: dict[str, str] = field(default_factory=dict)
    empty_key: str | None = None  # the empty prompt, for caption dropout technique `empty`
    # Every prompt the run reads beyond the clips' captions (prompt -> key): see `extra_prompts`.
    prompt_keys: dict[str, str] = field(default_factory=dict)
    # A family whose captions read their clip (`spec.reads_clip_in_conditions`): key -> what it is made of, and per
    # sample, per window, the key of each of its caption variants (empty otherwise).
    clip_conditions: dict[str, ClipConditionEntry] = field(default_factory=dict)
    clip_condition_info: dict[str, dict[str, Any]] = field(default_factory=dict)
    clip_condition_windows: list[list[list[str]]] = field(default_factory=list)


def plan_inputs(plan: CachePlan, spec: ModelSpec, clip: Clip, kinds: tuple[str, ...], windows: list[ClipWindow],
                latent_keys: list[str], latent_parts: dict[str, Any],
                control_keys: list[str] | None = None) -> dict[str, list[str]]:
    """The entries of a clip's inputs, one per window: keyed by the input files' content, how they are read (the
    window's frames, size, resize), how the spec encodes the kind and on which latent grid (the window's shape
    under the latents' own identity), so a changed mask is computed again alone; a kind encoded with the control
    clip (`spec.inputs_with_control`) by that window's control entry too (`control_keys`)."""
    found: dict[str, list[str]] = {}
    for kind in kinds:
        if kind not in clip.inputs and not (kind == "mask" and clip.mask_rect is not None):
            continue
        with_control = kind in spec.inputs_with_control and bool(control_keys)
        for number, (window, latent_key) in enumerate(zip(windows, latent_keys, strict=True)):
            reads = input_reads(clip, kind, window)
            described = [{**one.describe(), "file": plan.cache.fingerprints.file(one.path) if one.path else None}
                         for one in reads]
            parts = {**latent_parts, "spec": spec.input_identity(kind), "reads": described,
                     "grid": {"frames": window.frames, "height": window.height, "width": window.width}}
            control_key = control_keys[number] if with_control and control_keys else None
            if control_key is not None:
                parts["control"] = control_key
            key = entry_key("inputs", parts)
            found.setdefault(kind, []).append(key)
            plan.inputs.setdefault(key, InputEntry(kind, reads, latent_key, clip.where, control_key))
            plan.input_info.setdefault(key, {"kind": kind, "clip": str(clip.video), "reads": described})
    return found


def extra_prompts(config: Config) -> list[str]:
    """The prompts a run encodes beside its captions: the empty one of caption dropout's `empty` technique, and
    guidance distillation's teacher's unconditional caption (`distillation.negative_prompt`, empty by default)."""
    prompts = []
    if config.data.drops_captions() and config.data.caption_dropout_technique == "empty":
        prompts.append("")
    if traits_of(config).teacher_guidance:
        prompts.append(config.distillation.negative_prompt)
    return list(dict.fromkeys(prompts))


def build_plan(config: Config, spec: ModelSpec, clips: list[Clip], cache: CacheStore | None = None) -> CachePlan:
    """Every key a config needs (hashing clips and weights it has not seen before). `clips` come from
    `load_dataset` (each with its probe and bucket)."""
    cache = cache or CacheStore(cache_root(config))
    options = config.precompute
    fallback = config.training.device
    text_device = precompute_device(options.text_device, fallback, "precompute.text_device")
    vae_devices = [precompute_device(name, fallback, "precompute.vae_devices") for name in options.vae_devices]
    text_dtype = spec.component_dtype("text_encoder", text_device)
    video_components = video_component_names(spec)
    video_dtypes = {tuple(dtype_name(spec.component_dtype(n, device)) for n in video_components)
                    for device in vae_devices}
    if len(video_dtypes) > 1:
        raise ConfigError(
            f"precompute.vae_devices {options.vae_devices} would run the VAE in different dtypes; use devices "
            "of one kind, or set model.vae_dtype"
        )
    vae_dtypes = {spec.component_dtype("vae", device) for device in vae_devices}
    plan = CachePlan(cache, options.store, text_device, vae_devices, text_dtype, vae_dtypes.pop())

    fingerprints = cache.fingerprints
    # Each kind gets only its own side of the spec's identity: a prompt template change leaves latents alone.
    text_parts = {
        "spec": spec.condition_identity(),
        "components": {name: component_identity(spec, name, fingerprints) for name in text_component_names(spec)},
        "dtype": dtype_name(plan.text_dtype),
    }
    if config.memory.text_encoder_weights != "auto":  # only then: the keys of existing caches stay as they were
        text_parts["weights"] = config.memory.text_encoder_weights
    latent_parts = {
        "spec": spec.latent_identity(),
        "components": {name: component_identity(spec, name, fingerprints) for name in video_components},
        "dtype": dtype_name(plan.vae_dtype),
        "dtypes": dict(zip(video_components, video_dtypes.pop(), strict=True)),
        "store": options.store,
    }
    if config.memory.vae_tiling:  # tiles blend where they overlap: other latents (existing keys stay as they were)
        latent_parts["vae_tiling"] = True
    data, shapes = config.data, config.data.bucket_shapes()
    processor = configured_processor(config)
    downscale = control_downscale(config)
    audio_format = spec.audio_format()
    input_kinds = spec.input_kinds(config)

    def condition(caption: str) -> str:
        key = entry_key("conditions", {**text_parts, "caption": caption})
        plan.conditions.setdefault(key, caption)
        plan.condition_info.setdefault(key, {"caption": caption})
        return key

    clip_text_parts = {**text_parts, "clip_spec": spec.clip_condition_identity(),
                       "clip_components": {name: component_identity(spec, name, fingerprints)
                                           for name in spec.clip_condition_components()}}

    def clip_condition(caption: str, path: Path, content_hash: str, preprocess: Preprocess) -> str:
        """A caption encoded with a window's pictures: keyed by the caption, the text components, the clip's
        content and the window it is read with (editing either re-encodes only the entries that read it)."""
        window = preprocess.describe()
        key = entry_key("clip_conditions", {**clip_text_parts, "caption": caption, "clip": content_hash,
                                            "window": window})
        plan.clip_conditions.setdefault(key, ClipConditionEntry(caption, Path(path), preprocess))
        plan.clip_condition_info.setdefault(key, {"caption": caption, "clip": str(path), "clip_sha256": content_hash,
                                                  **window})
        return key

    seed, shuffles, preserve = config.training.seed, options.caption_shuffles, config.training.preserve_base
    for clip in clips:
        # A clip whose tags are shuffled offers fixed shuffles, one drawn per visit (vidtune/data/captions.py).
        untriggered = shuffle_variants(clip.style, clip.untriggered, seed, clip.index, shuffles)
        plan.caption_variants.append(untriggered)
        variants = [condition(clip.style.with_trigger(text)) for text in untriggered]
        plan.condition_keys.append(variants[0])  # without shuffling: the caption itself
        plan.condition_variants.append(variants)
        if preserve is not None and not preserve.prompts:
            for text in untriggered:
                caption = preservation_caption(text, clip.style, None, preserve.class_word, seed, 0)
                plan.preserve_keys[caption] = condition(caption)
        clip_hash = fingerprints.file(clip.video)
        frames, height, width = shapes[clip.bucket or 0]
        starts = [0]
        if clip.info is not None and not clip.is_image:
            starts = window_starts(clip.info, frames, data.fps, data.frame_sampling, options.windows_per_clip)
        # Control training (or a family whose conditioning reads a control clip): the control clip's latents are
        # keyed like any clip's, over the same windows.
        # With `control.processor`, the control is the clip itself through the processor.
        sources = [(clip.video, clip_hash, None)]
        if traits_of(config).control or spec.reads_control_clip:
            if processor is not None:
                sources.append((clip.video, clip_hash, processor))
            elif clip.control is not None:
                sources.append((clip.control, fingerprints.file(clip.control), None))
        keys: list[list[str]] = [[] for _ in sources]
        rate = spec.clip_frame_rate(clip, data.fps)
        clip_audio = audio_format if audio_format is None or rate is None else replace(audio_format, frame_rate=rate)
        for start in starts:
            for number, ((path, content_hash, processed), windows) in enumerate(zip(sources, keys, strict=True)):
                # The clip's sound and rate go with its own latents; control clips give only their video latents.
                audio, clip_rate = (clip_audio, rate) if number == 0 else (None, None)
                scale = 1 if number == 0 else downscale  # in-context: control clips read smaller, framed alike
                window = ClipWindow(frames, height // scale, width // scale, data.fps, start, data.resize)
                if number and path == clip.control:  # a control clip of another frame rate: read at the clip's times
                    window = control_window(clip, window)
                preprocess = Preprocess(frames, window.height, window.width, window.fps, data.resize, window.start,
                                        processed, audio, clip_rate)
                key = entry_key("latents", {**latent_parts, "preprocess": preprocess.describe(), "clip": content_hash})
                windows.append(key)
                plan.latents.setdefault(key, path)
                plan.latent_preprocess.setdefault(key, preprocess)
                plan.latent_info.setdefault(key, {"clip": str(path), "clip_sha256": content_hash,
                                                  **preprocess.describe(), "store": options.store})
        plan.latent_keys.append(keys[0][0])
        plan.latent_windows.append(keys[0])
        plan.control_windows.append(keys[1] if len(keys) > 1 else [])
        windows = [ClipWindow(frames, height, width, data.fps, start, data.resize) for start in starts]
        if spec.reads_clip_in_conditions:
            plan.clip_condition_windows.append([
                [clip_condition(clip_text, clip.video, clip_hash, Preprocess(frames, height, width, data.fps,
                                                                             data.resize, start))
                 for clip_text in (clip.style.with_trigger(text) for text in untriggered)]
                for start in starts])
        plan.input_windows.append(plan_inputs(plan, spec, clip, input_kinds, windows, keys[0], latent_parts,
                                              keys[1] if len(keys) > 1 else None))
    plan.prompt_keys = {prompt: condition(prompt) for prompt in extra_prompts(config)}
    if preserve is not None and preserve.prompts:
        plan.preserve_keys = {prompt: condition(prompt) for prompt in preserve.prompts}
    if config.data.drops_captions() and config.data.caption_dropout_technique == "empty":
        plan.empty_key = plan.prompt_keys[""]
    return plan
