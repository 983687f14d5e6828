"""The schema of a vidtune config: its sections, every key's type, default, range and allowed values, and the
checks across keys.

A config is immutable (`frozen`): it is made once, by `vidtune.config.load.build_config`, and a changed copy is
made with `config.model_copy(update=...)`, so no part of a run sees a value another part changed. Reading files,
overrides and reporting problems live in `vidtune.config.load`.
"""

from __future__ import annotations

import sys
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from vidtune.algorithms import ALGORITHM_NAMES, algorithm_traits
from vidtune.data.inputs import INPUT_KINDS, rectangle_problem, unknown_kind_problem

DType = Literal["auto", "float32", "bfloat16", "float16"]


class Section(BaseModel):
    """Base of every section: unknown keys are errors, and a made section is never changed (assigning raises)."""

    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())


class ConditioningConfig(Section):
    """Conditioning modes of image-to-video families (`model.conditioning`): each a share of the training samples,
    drawn per sample; the rest follow model.first_frame_conditioning. docs/algorithms.md has a worked example each."""

    extension: float = Field(0.0, ge=0, le=1, description="Share of samples given the first `extension_frames` "
                             "frames of their clip clean (video extension; the rest learnt).")
    extension_frames: int = Field(9, ge=1, description="Frames given in video extension (a multiple of the VAE's "
                                  "temporal ratio plus one: 9, 17, ... for LTX-Video).")
    last_frame: float = Field(0.0, ge=0, le=1, description="Share of samples given their last frame (sampled from "
                              "a last frame).")
    first_last: float = Field(0.0, ge=0, le=1, description="Share of samples given their first and last frames.")
    inpaint: float = Field(0.0, ge=0, le=1, description="Share of samples given their clip outside the mask "
                           "(inpainting / outpainting; the masked region learnt): the clip's `mask` input where the "
                           "data gives one, else `mask_rectangle`.")
    mask_rectangle: tuple[float, float, float, float] = Field(
        (0.25, 0.25, 0.75, 0.75), description="Inpainting without a mask input: the rectangle (left, top, right, "
        "bottom, fractions of the frame) that is generated (`mask_rectangle_generated: inside`) or kept (`outside`).")
    mask_rectangle_generated: Literal["inside", "outside"] = Field(
        "inside", description="`inside`: inpainting, the rectangle is generated; `outside`: outpainting, the rest is.")
    validation_mode: Literal["first_frame", "extension", "last_frame", "first_last", "inpaint"] | None = Field(
        None, description="The mode validation samples with; default: the mode with the largest share.")

    @model_validator(mode="after")
    def _check(self) -> ConditioningConfig:
        total = self.extension + self.last_frame + self.first_last + self.inpaint
        if total > 1:
            raise ValueError(f"model.conditioning: the shares extension + last_frame + first_last + inpaint add up to "
                             f"{total:g}, above 1; lower them so they sum to 1 at most")
        left, top, right, bottom = self.mask_rectangle
        if not (0 <= left < right <= 1 and 0 <= top < bottom <= 1):
            raise ValueError(f"model.conditioning.mask_rectangle={list(self.mask_rectangle)}: give left < right and "
                             "top < bottom, each between 0 and 1")
        return self

    @property
    def enabled(self) -> dict[str, float]:
        """The modes other than first-frame with a share above 0."""
        shares = {"extension": self.extension, "last_frame": self.last_frame, "first_last": self.first_last,
                  "inpaint": self.inpaint}
        return {mode: share for mode, share in shares.items() if share > 0}


class ModelConfig(Section):
    name: str = Field(description="Model family, e.g. `ltx-video`.")
    pretrained: str = Field(description="Hub id or local folder in the diffusers layout.")
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit).")
    dtype: DType = Field("auto", description="Weights dtype of frozen components; auto: bf16 on GPU, fp32 on CPU.")
    text_encoder_dtype: DType | None = Field(None, description="Overrides `dtype` for the text encoder(s).")
    vae_dtype: DType | None = Field(None, description="Overrides `dtype` for the VAE.")
    transformer_dtype: DType | None = Field(None, description="Overrides `dtype` for the denoiser.")
    subfolders: dict[str, str] = Field(
        default_factory=dict,
        description="Per-component path override, e.g. {transformer: /path/to/other/transformer}.",
    )
    transformer_file: str | None = Field(
        None,
        description="The denoiser from one .safetensors file in its original or ComfyUI layout (e.g. "
        "`wan2.1_t2v_14B_fp8_e4m3fn.safetensors`), through diffusers' single-file converter; everything else (text "
        "encoders, VAE, scheduler, the transformer's config.json) comes from `model.pretrained`. float8 files: kept "
        "in float8 with `memory.base_weights: fp8`, else upcast; ComfyUI's scaled fp8 likewise, with its scales (else "
        "dequantised). Families: docs/models.md (\"Training from a single-file checkpoint\").",
    )
    transformer_2_file: str | None = Field(
        None,
        description="Two-expert models (Wan 2.2 A14B): the low-noise expert (`transformer_2`) from one file, as "
        "`transformer_file` gives the high-noise one.",
    )
    max_sequence_length: int | None = Field(
        None, gt=0, description="Tokens kept per caption; default: the family's own (LTX-Video 128, CogVideoX 226)."
    )
    frame_rate: float | None = Field(
        None, gt=0, description="Frame rate samples are generated at and written with; the denoiser is told it in "
        "training for stills, clips that do not say their rate, and every clip with model.clip_frame_rate off; "
        "default: data.fps, else the family's (docs/models.md)."
    )
    clip_frame_rate: bool = Field(
        True,
        description="LTX families (ltx-video, ltx-2 and their i2v): tell the denoiser each clip's own frame rate, "
        "read from the file (data.fps when set: clips are resampled to it), as Lightricks' trainers do; LTX-2 "
        "also cuts each clip's sound to frames / that rate. false: every clip is told model.frame_rate. Other "
        "families take no frame rate.",
    )
    first_frame_conditioning: float | None = Field(
        None,
        ge=0,
        le=1,
        description="LTX families: the probability that a training sample is given its first latent frame clean "
        "(timestep 0 there, left out of the loss), as image-to-video sampling gives it. Default: the family's "
        "(ltx-video, ltx-2: 0.1; ltx-2-i2v: 0.5; ltx-video-i2v: 1; docs/models.md). minimax-h3 (default 0): the "
        "share of samples trained in its keyframe workflow from their first frame. Other families: unset.",
    )
    experts: Literal["both", "high_noise", "low_noise"] | None = Field(
        None,
        description="Two-expert models (Wan 2.2 A14B): which experts train. `both` (the default for them): each "
        "sample's noise level picks its expert by the pipeline's boundary_ratio, each expert gets its own adapter; "
        "`high_noise` / `low_noise`: one expert, trained only on noise levels of its side of the boundary. Not for "
        "one-transformer models.",
    )
    expert_routing: Literal["sample", "step"] | None = Field(
        None,
        description="Two-expert models with both experts training: how noise levels pick the expert. `sample`: each "
        "sample's own noise level picks it (a batch may run both); `step`: each optimizer step trains one expert, "
        "the same on every process, drawn with probability equal to its share of the noise levels, and each "
        "sample's level is drawn inside that expert's band (each sample's level keeps its distribution). Default: "
        "`step` under parallel.strategy fsdp or deepspeed on several processes (their collectives need every "
        "process to run the same expert), else `sample`. See docs/wan22.md.",
    )
    guidance_scale: float | None = Field(
        None,
        gt=0,
        description="Embedded guidance of guidance-distilled families (HunyuanVideo), given to the denoiser in "
        "training and used again when sampling; default: the family's (HunyuanVideo: 1.0, the unguided "
        "data distribution). Ignored by families without a guidance embedding.",
    )
    audio_loss_weight: float = Field(
        1.0,
        ge=0,
        description="ltx-2, minimax-h3: weight of the audio stream's flow-matching loss beside the video's "
        "(the loss is video + "
        "weight x audio; 0 leaves the audio stream untaught, which drifts from what it samples).",
    )
    clips_without_sound: Literal["video-only", "leave-out", "silence"] = Field(
        "video-only",
        description="ltx-2, minimax-h3: what a sample without an audio track does: `video-only` trains its video "
        "with the audio "
        "stream cut off (as ltx-trainer's video-only runs); `leave-out` drops it from the run, with one line saying "
        "how many (as ltx-trainer's audio runs); `silence` trains its video beside the audio stream noised silence, "
        "its audio error left out (the video learns with the audio stream present, as LTX2Pipeline samples).",
    )
    conditioning: ConditioningConfig = Field(
        default_factory=ConditioningConfig,
        description="Image-to-video families: conditioning modes beside first-frame conditioning (video extension, "
        "last frame, first and last frames, inpainting), each a share of the samples. Which family takes which: "
        "docs/models.md (\"Conditioning modes\").",
    )
    condition_frames: list[Annotated[int, Field(ge=0)]] = Field(
        default_factory=lambda: [0],
        min_length=1,
        description="ltx-video-i2v: the frames of each clip (0-based, within data.frames) the model is conditioned "
        "on, kept clean in training and given as images when sampling: [0] is image-to-video from the first "
        "frame; more are keyframes (e.g. [0, 48]). Ignored by other families.",
    )
    animate_mode: Literal["animate", "replace"] | None = Field(
        None,
        description="wan-animate: `animate` (the default) moves the reference image's character by each clip's pose "
        "and face videos on a blank scene; `replace` puts the character into each clip's `background` input where "
        "its `mask` input is white (WanAnimatePipeline's `mode`), so every clip then needs both (docs/models.md, "
        "\"Wan Animate\"). Other families: unset.",
    )
    animate_segment_conditioning: float = Field(
        0.0,
        ge=0,
        le=1,
        description="wan-animate: the share of samples trained as a later segment of a long video (the clip's "
        "first `animate_segment_frames` frames given as the previous segment's last ones, as WanAnimatePipeline "
        "generates clips longer than `segment_frame_length`); 0: every sample is a first segment. Animate mode only.",
    )
    animate_segment_frames: Literal[1, 5] = Field(
        1,
        description="wan-animate: the frames a later segment is given from the previous one "
        "(WanAnimatePipeline's `prev_segment_conditioning_frames`: 1, its default, or 5).",
    )
    attention_backend: str = Field(
        "auto",
        description="Attention kernel of the denoiser, through diffusers' attention dispatcher: `native` (torch's "
        "scaled_dot_product_attention), `flash`, `_flash_3`, `xformers`, `flex`, ... (any backend the installed "
        "diffusers offers that has a backward pass); auto: the fastest installed one for training on this device "
        "(FlashAttention 3 on Hopper, FlashAttention 2, else native). CogVideoX and Mochi take native only.",
    )

    @model_validator(mode="after")
    def _check_single_files(self) -> ModelConfig:
        for component in ("transformer", "transformer_2"):
            if getattr(self, f"{component}_file") and self.subfolders.get(component):
                raise ValueError(f"model.{component}_file and model.subfolders.{component} both give the {component}; "
                                 f"keep one of them")
        return self

    def single_file(self, component: str) -> str | None:
        """The single file a component loads from (`transformer_file`, `transformer_2_file`), or None."""
        return {"transformer": self.transformer_file, "transformer_2": self.transformer_2_file}.get(component)


class _SourceBase(Section):
    repeats: int = Field(1, ge=1, description="How often each sample of this source is seen per epoch.")
    weight: float | None = Field(
        None, gt=0, description="How often this source is drawn relative to the others: its share of the draws is "
        "weight / (sum of the training sources' weights), whatever its number of samples; within it, each sample "
        "equally often. Set on every training source or on none (none: each sample `repeats` times an epoch); not "
        "with `repeats` (see docs/datasets.md)."
    )
    role: Literal["train", "regularization"] = Field(
        "train", description="`regularization`: prior-preservation clips of what the base model already makes (as "
        "DreamBooth-style trainers use): trained like the others with their loss times `loss_weight`, reported "
        "apart as `loss/regularization` in metrics.jsonl, never picked by validation.eval_clips nor as the default "
        "validation prompt."
    )
    loss_weight: float = Field(
        1.0, ge=0, description="Each of this source's samples' loss is multiplied by this (e.g. 0.5 for "
        "regularization clips)."
    )
    caption_prefix: str = Field(
        "", description="Written before every caption of this source, with a space (for a trigger word: `trigger`)."
    )
    trigger: str | None = Field(
        None, description="A trigger word added to every caption of this source (where: `trigger_position`); "
        "training.preserve_base trains on the captions without it."
    )
    trigger_position: Literal["prefix", "suffix"] = Field(
        "prefix", description="Where `trigger` goes: before the caption (`prefix`, with a comma after it when "
        "`shuffle_tags`) or after it (`suffix`)."
    )
    caption_dropout: float | None = Field(
        None, ge=0.0, le=1.0, description="This source's probability of dropping a caption; unset: "
        "data.caption_dropout."
    )
    shuffle_tags: bool = Field(
        False, description="Tag-style captions (`tag1, tag2, ...`): the comma-separated tags are shuffled at every "
        "draw (the trigger stays where `trigger_position` puts it). From the cache: one of "
        "precompute.caption_shuffles fixed shuffles per visit."
    )
    keep_tokens: int = Field(
        0, ge=0, description="With `shuffle_tags`: this many leading tags stay in place (kohya's keep_tokens)."
    )
    eval: bool = Field(
        False, description="Held out: this source's samples are never trained on, only scored for the held-out score "
        "(see validation.eval_clips and docs/evaluation.md)."
    )
    mask_rect: tuple[float, float, float, float] | None = Field(
        None, description="A mask for every clip of this source without a mask file: the rectangle `[x0, y0, x1, y1]` "
        "(fractions of the width and height, from the top left) is white (learnt), the rest black (see "
        "training.masked_loss and docs/data.md)."
    )

    @model_validator(mode="after")
    def _check_inputs(self) -> _SourceBase:
        for kind in getattr(self, "inputs", {}):
            problem = unknown_kind_problem(kind)
            if problem:
                raise ValueError(f"inputs: {problem}")
        if self.mask_rect is not None:
            problem = rectangle_problem(self.mask_rect)
            if problem:
                raise ValueError(problem)
        return self

    @model_validator(mode="after")
    def _check_caption_options(self) -> _SourceBase:
        if self.keep_tokens and not self.shuffle_tags:
            raise ValueError(f"keep_tokens={self.keep_tokens} works with shuffle_tags=true only (it keeps leading "
                             "tags in place while the others are shuffled); set shuffle_tags: true or remove "
                             "keep_tokens")
        if self.weight is not None and self.repeats != 1:
            raise ValueError(f"weight={self.weight} and repeats={self.repeats} both set: with weights a source's "
                             "share of the draws is its weight and repeats would be ignored; remove repeats (or "
                             "weight, on every source)")
        if self.role == "regularization" and self.eval:
            raise ValueError("role: regularization and eval: true both set: a held-out source is never trained on; "
                             "remove one of them")
        if self.trigger is not None and not self.trigger.strip():
            raise ValueError("trigger is empty: write the trigger word, or remove the key")
        return self


class PairsSource(_SourceBase):
    """Two lists in one folder: one clip path a line, and the caption of the clip on the same line."""

    type: Literal["pairs"] = Field(description="`pairs`: a clip list and a caption list, line by line.")
    root: str = Field(description="Folder holding the two lists (in a file: relative to its folder).")
    videos: str = Field("videos.txt", description="File with one clip or image path a line (relative to root).")
    prompts: str = Field("prompts.txt", description="File with one caption a line, same order.")
    controls: str = Field("controls.txt", description="Control training: file with one control clip path a line, "
                          "same order (read only by `control-*` algorithms and in-context-lora).")
    inputs: dict[str, str] = Field(
        default_factory=dict, description="Per-clip inputs, kind -> a list file beside the clip list (line n: the "
        f"input of the clip on line n; an empty line: none; images separated by `|`). Kinds: {', '.join(INPUT_KINDS)} "
        "(docs/data.md)."
    )


class FolderSource(_SourceBase):
    """Every clip and image in a folder (and its subfolders), each with a same-name .txt caption beside it."""

    type: Literal["folder"] = Field(description="`folder`: clips and images with a .txt caption beside each.")
    root: str = Field(description="The folder (in a file: relative to its folder).")


class MetadataSource(_SourceBase):
    """A spreadsheet (.csv with a header row) or a .jsonl file (one JSON object a line)."""

    type: Literal["metadata"] = Field(description="`metadata`: a .csv or .jsonl file naming clips and captions.")
    path: str = Field(description="The .csv or .jsonl file; clip paths in it are relative to its folder.")
    video_column: str = Field("video", description="Column (CSV) or key (JSONL) holding the clip or image path.")
    caption_column: str = Field("caption", description="Column (CSV) or key (JSONL) holding the caption.")
    control_column: str | None = Field(
        None, description="Control training: column (CSV) or key (JSONL) holding the control clip's path."
    )
    inputs: dict[str, str] = Field(
        default_factory=dict, description="Per-clip inputs, kind -> the column (CSV) or key (JSONL) holding its path "
        f"(empty: none; images separated by `|`, or a JSON list). Kinds: {', '.join(INPUT_KINDS)} (docs/data.md)."
    )


DatasetSource = Annotated[PairsSource | FolderSource | MetadataSource, Field(discriminator="type")]
SOURCE_TYPES: tuple[type[Section], ...] = (PairsSource, FolderSource, MetadataSource)


class DataConfig(Section):
    root: str | None = Field(
        None, description="One `pairs` dataset: the folder holding videos.txt and prompts.txt (in a file: relative "
        "to its folder). Or use `datasets`."
    )
    videos: str = Field("videos.txt", description="With `root`: file with one clip path a line (relative to root).")
    prompts: str = Field("prompts.txt", description="With `root`: file with one caption a line, same order.")
    controls: str = Field("controls.txt", description="With `root`, control training: file with one control clip "
                          "path a line, same order.")
    datasets: list[DatasetSource] | None = Field(
        None, description="Several sources, each `{type: pairs | folder | metadata, ...}` with optional `repeats` "
        "or `weight`, `role`, `loss_weight` and caption options (see docs/datasets.md). Instead of `root`."
    )
    frames: int = Field(49, gt=0, description="Frames per training clip (the one-bucket shorthand); "
                        "unset: the family's (docs/models.md).")
    height: int = Field(512, gt=0, description="Height of the training clips in pixels (the one-bucket "
                        "shorthand); unset: the family's (docs/models.md).")
    width: int = Field(768, gt=0, description="Width of the training clips in pixels (the one-bucket "
                        "shorthand); unset: the family's (docs/models.md).")
    buckets: list[tuple[int, int, int]] | None = Field(
        None, description="Shapes `[[frames, height, width], ...]`: each sample goes to the bucket of nearest aspect "
        "ratio whose frames it can fill (images: one-frame buckets); a batch holds one bucket. Instead of "
        "frames / height / width."
    )
    resize: Literal["crop", "fit", "stretch"] = Field(
        "crop", description="To the bucket's size: `crop` covers it and cuts the centre; `fit` fits inside and pads "
        "with black; `stretch` distorts."
    )
    frame_sampling: Literal["start", "random", "middle"] = Field(
        "random", description="Which frames of a longer clip: from its start, a start drawn per visit (seeded), or "
        "the middle. With precompute, `random` picks among precompute.windows_per_clip cached windows."
    )
    fps: float | None = Field(None, gt=0, description="Resample clips to this rate; default: native frames.")
    num_workers: int = Field(2, ge=0, description="Decoding worker processes.")
    frame_store_mib: int | None = Field(
        None,
        ge=0,
        description="On-the-fly training: MiB of decoded, resized windows (uint8) kept for later epochs, so each "
        "window is decoded once; in shared memory (/dev/shm) when the system has it, else the temp folder; removed "
        "after the run. null: up to 2048, at most half the free space there; 0: decode every visit.",
    )
    encoded_store_mib: int = Field(
        1024,
        ge=0,
        description="MiB of host memory for the text encoders' outputs per caption and the VAE posterior per window: "
        "on the fly, kept so each is encoded once (what the precompute cache keeps on disk); from the cache, kept "
        "after their first read. 0: encode (or read) every visit.",
    )
    caption_dropout: float = Field(0.0, ge=0.0, le=1.0, description="Probability of dropping a caption (a "
                                   "source's own `caption_dropout` overrides it).")
    caption_dropout_technique: Literal["empty", "zero"] = Field(
        "empty", description="`empty`: encode an empty prompt; `zero`: zero the embedding."
    )

    @model_validator(mode="after")
    def _one_way_to_name_the_data(self) -> DataConfig:
        if self.root is None and not self.datasets:
            raise ValueError("data: set data.root (a folder with videos.txt and prompts.txt) or data.datasets "
                             "(a list of sources, see docs/datasets.md)")
        if self.root is not None and self.datasets:
            raise ValueError("data: set either data.root or data.datasets, not both (add the root folder to the "
                             "list as {type: pairs, root: ...})")
        training = [(number, source) for number, source in enumerate(self.datasets or []) if not source.eval]
        weighted = [number for number, source in training if source.weight is not None]
        if weighted and len(weighted) != len(training):
            unset = [f"data.datasets[{number}]" for number, source in training if source.weight is None]
            raise ValueError(f"data.datasets: {', '.join(unset)} {'has' if len(unset) == 1 else 'have'} no weight "
                             "while other training sources have one; set `weight` on every training source (or on "
                             "none)")
        for number, (frames, height, width) in enumerate(self.buckets or []):
            if min(frames, height, width) <= 0:
                raise ValueError(f"data.buckets[{number}] = [{frames}, {height}, {width}]: frames, height and width "
                                 "must be positive")
        return self

    def sources(self) -> list[PairsSource | FolderSource | MetadataSource]:
        """The datasets, with `root` as the one-dataset shorthand."""
        if self.datasets:
            return list(self.datasets)
        return [PairsSource(type="pairs", root=str(self.root), videos=self.videos, prompts=self.prompts,
                            controls=self.controls)]

    def drops_captions(self) -> bool:
        """Whether any caption may be dropped (`caption_dropout` here or on a source)."""
        own = [source.caption_dropout for source in self.sources() if source.caption_dropout is not None]
        return self.caption_dropout > 0 or any(value > 0 for value in own)

    def regularizes(self) -> bool:
        """Whether a training source has `role: regularization` (its loss is then logged apart)."""
        return any(source.role == "regularization" for source in self.sources() if not source.eval)

    def bucket_shapes(self) -> list[tuple[int, int, int]]:
        """The buckets, with frames / height / width as the one-bucket shorthand."""
        return [tuple(bucket) for bucket in self.buckets] if self.buckets else [(self.frames, self.height, self.width)]


class PreserveBaseConfig(Section):
    """Differential output preservation: the adapter is taught to leave the base model's prediction unchanged on
    captions without the trigger word."""

    weight: float = Field(gt=0, description="W of the extra loss W x mse(adapter's prediction, base model's "
                          "prediction) on the preservation captions, at the visit's noisy latents (ai-toolkit's "
                          "diff_output_preservation_multiplier: 1.0).")
    prompts: list[Annotated[str, Field(min_length=1)]] | None = Field(
        None, min_length=1, description="The preservation captions, one drawn per visit; null: each clip's caption "
        "without its source's trigger (replaced by `class_word`)."
    )
    class_word: str = Field(
        "", description="With prompts null: the word the trigger is replaced by in the preservation caption (e.g. "
        "`person`, as ai-toolkit's diff_output_preservation_class); empty: the trigger is removed."
    )


class TrainingConfig(Section):
    algorithm: Literal["lora", "full", "control-lora", "control-full", "in-context-lora", "guidance-distillation",
                       "step-distillation"] = Field(
        "lora", description="`lora`: train adapters, save them; `full`: train the denoiser's own weights (see `full`); "
        "`control-lora` / `control-full`: also take a control clip per sample, concatenated to the latents "
        "(see `control`); `in-context-lora`: a LoRA that reads each sample's control clip as clean tokens beside the "
        "video's (LTX-2's IC-LoRA, see `control`); `guidance-distillation` / `step-distillation`: distil the frozen "
        "model into a student "
        "(see `distillation`)."
    )
    steps: int = Field(1000, gt=0, description="Optimizer steps.")
    batch_size: int = Field(1, gt=0, description="Clips per micro-batch (per process under torchrun).")
    gradient_accumulation: int = Field(1, gt=0, description="Micro-batches per optimizer step.")
    learning_rate: float = Field(1e-4, gt=0, description="Peak learning rate of the optimizer.")
    seed: int = Field(42, ge=0, description="Seed of the data order, noise and initial adapter weights.")
    precision: Literal["auto", "fp32", "bf16"] = Field(
        "auto", description="Compute precision of the denoiser; auto: bf16 on GPU, fp32 on CPU."
    )
    max_grad_norm: float | None = Field(1.0, gt=0, description="Gradient clipping; null disables it.")
    gradient_checkpointing: bool = Field(
        False, description="Recompute activations in the backward pass: less memory, slower steps."
    )
    compile: bool = Field(
        False,
        description="torch.compile each transformer block (regional: one block's compile time, reused by all), once "
        "per bucket shape; the compile time is logged apart from the step time, per bucket shape. Works with LoRA, "
        "full fine-tuning, gradient checkpointing, memory.base_weights (fp8, int8), DDP and FSDP. Validation "
        "samples run eagerly.",
    )
    sigma_sampling: Literal["uniform", "logit_normal", "token_shifted_logit_normal"] = Field(
        "logit_normal",
        description="How training noise levels are drawn: `uniform`; `logit_normal` (sigmoid of a normal); "
        "`token_shifted_logit_normal`: a logit-normal whose mean grows with the clip's token count (Lightricks' "
        "trainers: 0.95 at 1024 tokens, 2.05 at 4096). Unset: the family's (docs/models.md).",
    )
    logit_mean: float = Field(0.0, description="Mean of the logit-normal noise levels (>0: noisier); with "
                              "token_shifted_logit_normal, added to the token count's mean.")
    logit_std: float = Field(1.0, gt=0, description="Spread of the logit-normal noise levels.")
    sigma_stretch: bool = Field(
        False, description="token_shifted_logit_normal: stretch the draws so the distribution's 0.5th..99.9th "
        "percentiles span [0, 1] (LTX-2's ltx-trainer); unset: the family's (docs/models.md).")
    sigma_uniform_fraction: float = Field(
        0.0, ge=0, lt=1, description="token_shifted_logit_normal: the share of noise levels drawn uniformly instead "
        "(LTX-2's ltx-trainer: 0.1); unset: the family's (docs/models.md).")
    sigma_shift: float = Field(1.0, gt=0, description="Shift of sampled sigmas towards noise (>1) or data (<1); "
                             "unset: the family's (docs/models.md).")
    loss_weighting: Literal["none", "bell"] = Field(
        "none", description="Weight of each sample's loss by its noise level (flow matching): `none`; `bell`: "
        "DiffSynth-Studio's, heaviest mid-range and 0 at pure noise, normalised over the sigma_shift grid (with "
        "sigma_sampling uniform and sigma_shift 5: DiffSynth-Studio's Wan recipe).")
    frame_noise: Literal["shared", "independent", "non_decreasing"] = Field(
        "shared", description="Noise levels across a clip's latent frames (flow matching): `shared`, one for the "
        "clip; `independent`, one per frame; `non_decreasing`, one per frame, later frames never less noisy "
        "(diffusion forcing, SkyReels V2's). Per-frame levels need a denoiser told a timestep per frame "
        "(skyreels-v2-df). Unset: the family's (docs/models.md).")
    device: str = Field(
        "auto", description="auto: cuda if available, else cpu. Under torchrun auto / cuda: cuda:LOCAL_RANK."
    )
    cpu_threads: int | None = Field(
        None,
        gt=0,
        description="Threads torch computes with on the CPU; null: OMP_NUM_THREADS when set, else the cores this "
        "process may use (CPU affinity, container quota) less data.num_workers less one, at least 1.",
    )
    ema_decay: float | None = Field(
        None,
        gt=0,
        lt=1,
        description="Keep an exponential moving average of the trained weights with this decay per step (e.g. "
        "0.999); validation samples use it, and it is saved beside the weights (`*_ema`). null: off.",
    )
    skip_nonfinite_steps: int = Field(
        0,
        ge=0,
        description="Steps with a NaN/inf loss or gradient that may be skipped (nothing applied) before the run "
        "stops; 0 stops at the first one. A skipped step still counts towards `steps`.",
    )
    preserve_base: PreserveBaseConfig | None = Field(
        None, description="Adapter algorithms (lora): also train the adapter to leave the base model's prediction "
        "unchanged on captions without the trigger word: `{weight: W, prompts: [...] or null, class_word: ''}`: the "
        "extra loss W x mse(adapter's prediction, base model's prediction) at the visit's noisy latents, on one of "
        "`prompts` drawn per visit or (null) the clip's caption without its source's `trigger`, replaced by "
        "`class_word` (empty: removed). See docs/algorithms.md. null: off.",
    )
    masked_loss: bool = Field(
        False, description="Weight each clip's loss by its mask (a `mask` input, or its source's `mask_rect`), "
        "downsampled to the latent grid as the VAE downsamples; white is learnt, black left out; normalised by the "
        "mask's area, so an all-white mask is the plain loss. Every training clip needs a mask. Per-element "
        "denoising losses only (lora, full, control-*). See docs/algorithms.md.",
    )
    masked_loss_area: Literal["mask", "frame"] = Field(
        "mask", description="With masked_loss, what the weighted error is averaged over: the mask's area (`mask`: an "
        "all-white mask is the plain loss, a small region trains as strongly as a large one) or the whole frame "
        "(`frame`, as kohya's sd-scripts `--masked_loss`: a small region weighs less).",
    )


class OptimizerConfig(Section):
    name: Literal["adamw", "adamw8bit", "paged_adamw8bit", "adamw8bit_ao", "adamw4bit_ao", "adamw_fp8_ao", "prodigy",
                  "came", "adafactor"] = Field(
        "adamw",
        description="The optimizer: `adamw` (torch); `adamw8bit`, `paged_adamw8bit` (pip extra `bitsandbytes`); "
        "`adamw8bit_ao`, `adamw4bit_ao`, `adamw_fp8_ao` (extra `torchao`; AdamW with 8-bit, 4-bit or float8 "
        "moments); `prodigy` (extra `prodigy`; sets its own step size: use training.learning_rate=1.0); `came` "
        "(extra `came`); `adafactor` (torch's). See docs/memory.md.",
    )
    weight_decay: float = Field(1e-4, ge=0, description="Weight decay (every optimizer).")
    beta1: float = Field(0.9, ge=0, lt=1, description="First-moment decay (AdamW kinds, prodigy, came).")
    beta2: float = Field(0.999, ge=0, lt=1, description="Second-moment decay (AdamW kinds, prodigy, came).")
    eps: float = Field(1e-8, gt=0, description="Epsilon of the AdamW kinds and prodigy.")
    cpu_offload: bool = Field(
        False,
        description="CUDA only: keep the optimizer state on the CPU and step there (torchao's CPUOffloadOptimizer "
        "around the chosen optimizer, pip extra `torchao`); saves the state's GPU memory, costs speed.",
    )
    lr_scheduler: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="Learning-rate schedule after the warmup (linear and cosine decay to 0)."
    )
    warmup_steps: int = Field(0, ge=0, description="Steps of linear warmup from 0 to the learning rate.")


class LoRAConfig(Section):
    rank: int = Field(16, gt=0, description="LoRA rank: the adapter's size and capacity.")
    alpha: float = Field(16.0, gt=0, description="LoRA scale numerator: the update is scaled by alpha / rank.")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA input (adapter.type=lora; LoKr and "
                           "LoHa have adapter.rank_dropout).")
    target_modules: str | list[str] | None = Field(
        None,
        description="What to adapt: a preset of the model family (`attention`, `attention+ffn`, `all-linear`) or "
        "a list of module names (a name adapts every module whose path ends with it, e.g. [to_q, to_v]); "
        "default: `attention`. See docs/algorithms.md.",
    )
    use_dora: bool = Field(
        False,
        description="DoRA: also learn a magnitude per output feature of each adapted weight (a little slower; the "
        "adapter still loads with the family's `load_lora_weights`). adapter.type=lora only.",
    )
    init_from: str | None = Field(
        None,
        description="Start from an existing adapter file (.safetensors) instead of a fresh one: the diffusers "
        "format, or another format the family's diffusers loader converts. Its rank, alpha, targets and DoRA "
        "must match lora.*. Wan 2.2 two-expert models: the folder of a two-expert run (a file per expert), or with "
        "model.experts=high_noise / low_noise that expert's file.",
    )


class AdapterConfig(Section):
    """What kind of adapter an adapter algorithm trains (see docs/algorithms.md, "Adapter types").

    `lora.rank`, `lora.alpha`, `lora.target_modules` and `lora.init_from` apply to every type (LoKr and LoHa scale
    their delta by alpha / rank as LoRA does); `lora.dropout` and `lora.use_dora` are LoRA's own.
    """

    type: Literal["lora", "lokr", "loha"] = Field(
        "lora", description="`lora`: low-rank B @ A; `lokr`: a Kronecker product of two small factors (LyCORIS "
        "LoKr); `loha`: the elementwise product of two low-rank products (LyCORIS LoHa). Through peft's LoraConfig, "
        "LoKrConfig, LoHaConfig."
    )
    decompose_factor: int = Field(
        -1, description="lokr: the size of the first Kronecker factor's dimensions (a divisor of each layer's "
        "sizes); -1: the most square split (peft's and LyCORIS' default)."
    )
    decompose_both: bool = Field(
        False, description="lokr: also split the first Kronecker factor into two rank-`lora.rank` matrices."
    )
    rank_dropout: float = Field(
        0.0, ge=0, lt=1, description="lokr, loha: dropout of the delta's rows while training."
    )
    module_dropout: float = Field(
        0.0, ge=0, lt=1, description="lokr, loha: the chance that a step leaves a module's whole delta out."
    )


class FullConfig(Section):
    """Which denoiser weights a full fine-tune trains, by parameter name (fnmatch patterns, `*` matches dots).

    A parameter trains when it matches one of `trainable_patterns` and none of `frozen_patterns`.
    Names are those of `denoiser.named_parameters()`, e.g. `transformer_blocks.0.attn1.to_q.weight`.
    """

    trainable_patterns: list[str] = Field(
        default_factory=lambda: ["*"], description="Parameters to train; default: all of them."
    )
    frozen_patterns: list[str] = Field(
        default_factory=list, description="Parameters to keep frozen, e.g. ['patchify_proj.*', 'time_embed.*']."
    )


class DistillationConfig(Section):
    """The teacher is the frozen base model; the student learns from it (see docs/algorithms.md)."""

    student: Literal["lora", "full"] = Field(
        "lora", description="guidance-distillation: what the student trains (`lora`, set by `lora`; or `full`, set "
        "by `full`). step-distillation trains a LoRA student."
    )
    guidance_scale: float = Field(
        5.0, ge=1.0, description="guidance-distillation: the teacher's classifier-free guidance the student learns "
        "to produce in one forward."
    )
    negative_prompt: str = Field(
        "", description="guidance-distillation: the teacher's unconditional caption; default: the empty caption."
    )
    guidance_range: tuple[float, float] | None = Field(
        None, description="guidance-distillation, families with a guidance embedding (HunyuanVideo): learn every "
        "scale in [low, high], given to the student's embedding (validation samples at `guidance_scale`); null: "
        "`guidance_scale` only."
    )
    student_steps: int = Field(
        4, gt=0, description="step-distillation: the sampling steps the student is trained for (K)."
    )
    teacher_steps: int = Field(
        32, gt=0, description="step-distillation: the teacher's Euler steps over the same noise range (N, a "
        "multiple of student_steps)."
    )
    window_start: Literal["data", "teacher"] = Field(
        "teacher", description="step-distillation: where a window's start comes from: `teacher`, the teacher's "
        "own Euler path from the visit's noise (what K-step sampling meets; up to N teacher forwards a visit); "
        "`data`: the clip noised to the window's start (N/K teacher forwards a visit)."
    )
    sigma_shift: float = Field(
        1.0, gt=0, description="step-distillation: shift of the sampling sigmas towards noise (>1), as "
        "FlowMatchEulerDiscreteScheduler's `shift`; student and teacher steps both follow it."
    )

    @model_validator(mode="after")
    def _check(self) -> DistillationConfig:
        if self.teacher_steps % self.student_steps:
            raise ValueError(f"distillation.teacher_steps ({self.teacher_steps}) must be a multiple of "
                             f"distillation.student_steps ({self.student_steps})")
        if self.guidance_range is not None and not 0 < self.guidance_range[0] <= self.guidance_range[1]:
            raise ValueError(f"distillation.guidance_range {list(self.guidance_range)} must be [low, high] with "
                             "0 < low <= high")
        low, high = self.guidance_range or (self.guidance_scale, self.guidance_scale)
        if not low <= self.guidance_scale <= high:
            raise ValueError(f"distillation.guidance_scale ({self.guidance_scale:g}), the scale a student of a range "
                             f"is validated at, must lie in distillation.guidance_range {list(self.guidance_range)}")
        return self


class CheckpointConfig(Section):
    every: int = Field(500, ge=0, description="Save every N steps; 0 saves only at the end.")
    keep: int = Field(2, gt=0, description="How many of the newest checkpoints to keep.")
    resume: str | None = Field(
        None,
        description="`latest`: continue from the newest checkpoint in output_dir (or start if there is none); "
        "or the path of a checkpoint folder (or of a run folder, meaning its newest checkpoint).",
    )


class ValidationConfig(Section):
    enabled: bool = Field(True, description="Sample videos with the trained weights at the end of the run.")
    prompts: list[str] = Field(default_factory=list, description="Default: the first caption of the dataset.")
    num_inference_steps: int = Field(30, gt=0, description="Denoising steps of each validation sample.")
    guidance_scale: float | None = Field(
        None, ge=0, description="Classifier-free guidance of the samples; default: the family's recommended value."
    )
    every: int = Field(0, ge=0, description="Also sample every N steps; 0: only at the end of the run.")
    sampler: Literal["pipeline", "comfyui"] = Field(
        "pipeline", description="How samples are denoised. `pipeline`: the family's diffusers pipeline with its "
        "own scheduler (the model makers' sampling). `comfyui`: Euler through the sigmas ComfyUI computes for "
        "`comfyui_scheduler` and `comfyui_shift`, exactly what the run's ComfyUI workflow (<run>_workflow.json) "
        "samples. Applies to validation and `vidtune sample`. See docs/comfyui.md.",
    )
    comfyui_scheduler: Literal["simple", "normal", "sgm_uniform", "beta", "linear_quadratic", "ltxv"] | None = Field(
        None, description="The ComfyUI scheduler of the run's workflow and of `sampler: comfyui`. Default: the "
        "family's (LTX-Video and LTX-2: `ltxv`, LTXVScheduler; Mochi: `linear_quadratic`, Genmo's; the others: "
        "`simple`).",
    )
    comfyui_shift: float | None = Field(
        None, gt=0, description="The shift of the workflow's ModelSamplingSD3 node (and of `sampler: comfyui`). "
        "Default: the shift of the family's diffusers scheduler (`shift`, or UniPC's `flow_shift`). Not used by "
        "`ltxv` (its shift follows the clip size) or `linear_quadratic`.",
    )
    seed: int = Field(0, ge=0, description="Seed of the validation samples' noise (and of the held-out score's).")
    frames: int | None = Field(None, gt=0, description="Default: a shape the run trains: with data.buckets the first "
                               "bucket of more than one frame's, else data.frames.")
    height: int | None = Field(None, gt=0, description="Default: as frames (that bucket's, else data.height).")
    width: int | None = Field(None, gt=0, description="Default: as frames (that bucket's, else data.width).")
    eval_clips: int = Field(
        0, ge=0, description="Set aside this many samples of the training sources for the held-out score (spread "
        "evenly over the dataset, named when the run starts), no longer trained on; samples of a source marked "
        "`eval: true` are held out too. The score is taken before the first step, at every validation and checkpoint "
        "step and at the end (metrics.jsonl, eval_loss.png); the run names its best checkpoint. See "
        "docs/evaluation.md.",
    )
    train_on_eval_clips: bool = Field(
        False, description="Also train on the samples `eval_clips` sets aside: the score then measures how well the "
        "run fits them, not how it does on clips it never saw.",
    )
    eval_noise_levels: list[Annotated[float, Field(gt=0, lt=1)]] = Field(
        default_factory=lambda: [0.1, 0.3, 0.5, 0.7, 0.9],
        min_length=1,
        description="The noise levels (0: clean, 1: pure noise; DDPM families: that fraction of the training "
        "timesteps) each held-out sample is scored at; the score is logged per level and as their mean.",
    )
    eval_noise_draws: int = Field(
        1, ge=1, description="Noises (and latents) drawn per held-out sample, the same at every evaluation (seeded "
        "by validation.seed); more give a steadier score for one forward each per level.",
    )

    @model_validator(mode="after")
    def _distinct_levels(self) -> ValidationConfig:
        if len(set(self.eval_noise_levels)) != len(self.eval_noise_levels):
            raise ValueError(f"validation.eval_noise_levels {self.eval_noise_levels} names a level twice; list each "
                             "once")
        return self


class ControlConfig(Section):
    processor: Literal["canny"] | None = Field(
        None, description="Control training: compute each sample's control clip from its target clip instead of "
        "reading control clips; `canny`: OpenCV edges (pip install 'vidtune[canny]')."
    )
    canny_low: float = Field(100.0, ge=0, description="`canny`: the lower hysteresis threshold (0-255 grey).")
    canny_high: float = Field(200.0, ge=0, description="`canny`: the upper hysteresis threshold (0-255 grey).")
    reference_downscale_factor: int = Field(
        1, ge=1, description="in-context-lora: the control clip is read at 1/N of the clip's height and width (the "
        "same frames and framing), N times fewer reference tokens; its positions are scaled back onto the clip's. "
        "Written into the LoRA's metadata and passed to LTX2InContextPipeline when sampling."
    )
    with_audio: bool = Field(
        False, description="in-context-lora: also train the audio stream on clips with sound. false (ltx-trainer's "
        "IC-LoRA default): every sample trains video only, cut off from the audio stream."
    )
    attention_strength: float = Field(
        1.0, ge=0.0, le=1.0, description="in-context-lora sampling: how strongly the generated video and the "
        "reference tokens attend to each other (LTX2InContextPipeline's `conditioning_attention_strength`); "
        "training always attends fully."
    )


class MemoryConfig(Section):
    base_weights: Literal["auto", "fp8", "int8", "nf4"] = Field(
        "auto",
        description="Adapter algorithms (lora, control-lora, a LoRA student) only: how the frozen denoiser "
        "weights are stored. `auto`: the model dtype; `fp8`: float8 (e4m3), each layer upcast as it runs (half "
        "of bf16); `int8`: torchao int8 weight-only (half of bf16; pip extra `torchao`); `nf4`: bitsandbytes "
        "4-bit NormalFloat, QLoRA (a quarter of bf16; pip extra `bitsandbytes`). The adapter trains in fp32 and "
        "loads into the normal pipeline. Replaces `memory.fp8_base_weights: true`, still read as "
        "`base_weights: fp8`. See docs/memory.md.",
    )

    text_encoder_weights: Literal["auto", "fp8", "int8", "nf4"] = Field(
        "auto",
        description="How the frozen text encoders are stored wherever captions are encoded (precompute, on-the-fly "
        "encoding, validation, `vidtune sample`): the options of `base_weights` (an 8B Llama or an 11B T5 alone "
        "fills a consumer GPU). Changes the embeddings a little: precomputed captions are encoded again.",
    )
    blocks_to_swap: int = Field(
        0, ge=0,
        description="Block swap: the frozen weights of the last N transformer blocks live in pinned CPU memory and "
        "are copied to the GPU just before their forward and backward, overlapped with compute. 0: off. Adapter "
        "algorithms only; needs `training.gradient_checkpointing` (or `activation_offload`). CUDA only (a notice "
        "elsewhere). See docs/memory.md.",
    )
    activation_offload: bool = Field(
        False,
        description="Keep the activations saved for the backward pass in pinned CPU memory instead of on the GPU. "
        "CUDA only (a notice elsewhere).",
    )
    vae_tiling: bool = Field(
        False,
        description="Encode and decode clips with the VAE in overlapping tiles (and one clip at a time) during "
        "precompute, on-the-fly encoding, validation and `vidtune sample`: far less memory for large clips. Tiled "
        "latents differ slightly: the cache keys them apart.",
    )

    @model_validator(mode="before")
    @classmethod
    def _migrate_fp8_base_weights(cls, data: Any) -> Any:
        """The key `fp8_base_weights` of earlier versions: `true` is `base_weights: fp8`, `false` the default."""
        if not isinstance(data, dict) or "fp8_base_weights" not in data:
            return data
        data = dict(data)
        old = data.pop("fp8_base_weights")
        if old not in (True, False, "true", "false"):
            raise ValueError(f"memory.fp8_base_weights must be true or false, not {old!r}; it is now written "
                             "memory.base_weights=fp8")
        if old in (True, "true"):
            if data.get("base_weights", "fp8") != "fp8":
                raise ValueError(f"memory.fp8_base_weights=true contradicts memory.base_weights="
                                 f"{data['base_weights']}; remove memory.fp8_base_weights (it is now written "
                                 "memory.base_weights=fp8)")
            data["base_weights"] = "fp8"
            print("memory.fp8_base_weights is deprecated: it is read as memory.base_weights=fp8 (write that "
                  "instead).", file=sys.stderr, flush=True)
        return data


class WandbConfig(Section):
    project: str = Field(description="The Weights & Biases project to log to (required).")
    name: str | None = Field(None, description="The run's name; default: the output_dir's folder name.")
    mode: Literal["online", "offline"] = Field(
        "online", description="online: send as it trains; offline: keep it under output_dir/wandb (`wandb sync`)."
    )


class LoggingConfig(Section):
    progress: bool = Field(True, description="Show progress bars.")
    log_every: int = Field(1, gt=0, description="Write metrics every N optimizer steps.")
    tensorboard: bool = Field(
        False, description="Also write TensorBoard event files to output_dir/tensorboard (pip extra `tensorboard`)."
    )
    wandb: WandbConfig | None = Field(
        None, description="Also log to Weights & Biases, e.g. {project: my-loras, mode: offline} (pip extra `wandb`)."
    )


class PrecomputeConfig(Section):
    enabled: bool = Field(
        False, description="Encode captions and clips into the cache first, then train from it (off: on the fly)."
    )
    cache_dir: str | None = Field(
        None, description="Where the cache lives; default: .vidtune-cache in the first dataset's folder."
    )
    text_device: str = Field("auto", description="Device of the text encoder(s); auto: training.device.")
    vae_devices: list[str] = Field(
        default_factory=lambda: ["auto"],
        min_length=1,
        description="Devices of the VAE, one copy each, run concurrently with the text encoder(s).",
    )
    batch_size: int = Field(4, gt=0, description="Captions / clips per encoder call.")
    windows_per_clip: int = Field(
        1, ge=1, description="With data.frame_sampling=random: fixed windows cached per clip (evenly spaced from its "
        "start to its end), one picked per visit; 1 caches the start only."
    )
    caption_shuffles: int = Field(
        8, ge=1, description="Sources with `shuffle_tags`: fixed shuffles of each caption cached, one drawn per visit "
        "(on the fly every visit shuffles afresh)."
    )
    store: Literal["posterior", "sample"] = Field(
        "posterior",
        description="`posterior`: VAE mean and std, a fresh latent every step; `sample`: one fixed latent "
        "(half the disk).",
    )


class ContextConfig(Section):
    ulysses: int = Field(
        1, ge=1, description="Context parallelism, Ulysses: ranks that split each sample's tokens and swap them for "
        "attention heads with one all-to-all before and after attention (the heads must divide by it). See "
        "docs/distributed.md.",
    )
    ring: int = Field(
        1, ge=1, description="Context parallelism, ring: ranks that split each sample's tokens and pass the keys and "
        "values round for attention (any head count). The context degree is ulysses x ring; the processes are data "
        "groups of that many ranks.",
    )

    @property
    def degree(self) -> int:
        """How many ranks share one sample's tokens."""
        return self.ulysses * self.ring


class ParallelConfig(Section):
    strategy: Literal["auto", "ddp", "fsdp", "deepspeed"] = Field(
        "auto",
        description="How several processes (torchrun, the deepspeed launcher) share the work. `auto`: `ddp` with "
        "several processes, nothing in one; `ddp`: every rank holds the whole model; `fsdp`: torch's FSDP2 shards "
        "weights, gradients and optimizer state over the ranks; `deepspeed`: DeepSpeed ZeRO (pip extra "
        "`deepspeed`). See docs/distributed.md.",
    )
    reshard_after_forward: bool = Field(
        True, description="`fsdp`: free each block's gathered weights after its forward (less memory, one more "
        "all-gather in the backward).",
    )
    cpu_offload: bool = Field(False, description="`fsdp`: keep the sharded weights and optimizer state in CPU memory.")
    replicate_degree: int = Field(
        1, ge=1, description="`fsdp`: HSDP — shard inside groups of world_size / replicate_degree ranks (one node) "
        "and replicate across the groups (nodes). 1: shard over all ranks.",
    )
    load_on_rank0: Literal["auto"] | bool = Field(
        "auto", description="`fsdp`: rank 0 alone reads the denoiser's weights (into CPU memory); the other ranks "
        "build it without weights (meta device) and receive their shards from rank 0 after sharding, so a node holds "
        "the whole weights once instead of once per GPU. `auto`: on with several processes; false: every rank reads "
        "the weights.",
    )
    zero_stage: Literal[1, 2, 3] = Field(
        2, description="`deepspeed`: ZeRO stage — 1 shards the optimizer state, 2 also the gradients, 3 also the "
        "weights.",
    )
    offload: Literal["none", "optimizer", "all"] = Field(
        "none", description="`deepspeed`: move the optimizer state (`optimizer`) or also the weights (`all`, ZeRO 3) "
        "to CPU memory.",
    )
    deepspeed_config: str | None = Field(
        None, description="`deepspeed`: a DeepSpeed JSON file whose keys override the ones vidtune derives from this "
        "config (in a file: relative to its folder).",
    )
    context: ContextConfig = Field(
        default_factory=ContextConfig, description="Context parallelism: each sample's token sequence split over "
        "`ulysses` x `ring` ranks (activations divided by that degree), composed with `ddp` or `fsdp` over the data "
        "groups. See docs/distributed.md.",
    )

    @model_validator(mode="after")
    def _check(self) -> ParallelConfig:
        if self.load_on_rank0 is True and self.strategy != "fsdp":
            raise ValueError(f"parallel.load_on_rank0=true needs parallel.strategy=fsdp (it is {self.strategy}): only "
                             "FSDP fills the other ranks' weights from rank 0. What to do: set parallel.strategy=fsdp, "
                             "or remove parallel.load_on_rank0.")
        if self.context.degree > 1 and self.strategy == "deepspeed":
            raise ValueError("parallel.context splits each sample over ranks with ddp or fsdp; DeepSpeed keeps the "
                             "training loop to itself. What to do: set parallel.strategy=fsdp (it shards weights like "
                             "ZeRO-3), or remove parallel.context.")
        if self.context.degree > 1 and self.replicate_degree > 1:
            raise ValueError("parallel.context with parallel.replicate_degree > 1: FSDP then shards over the whole "
                             "data x context mesh. What to do: remove parallel.replicate_degree.")
        return self


DEFAULT_CAPTION_INSTRUCTION = (
    "Describe this {media} as a caption for training a text-to-video model, in one paragraph of plain English in "
    "the present tense: the main subjects and what they look like, what they do and how they move, the setting, the "
    "lighting and colours, and the camera's framing and movement. Describe only what is visible. Do not begin with "
    "'The {media} shows' and do not mention that it is a {media}."
)


class CaptionConfig(Section):
    model: str = Field(
        "Qwen/Qwen2.5-VL-7B-Instruct",
        description="The vision-language model `vidtune caption` writes captions with: a hub id or local folder of "
        "a Qwen2-VL, Qwen2.5-VL or Qwen3-VL model (e.g. Qwen/Qwen3-VL-8B-Instruct).",
    )
    fps: float = Field(2.0, gt=0, description="Frames per second of each clip the model sees (Qwen's own default).")
    max_frames: int = Field(32, gt=0, description="At most this many frames of a clip; a longer clip gets this "
                            "many, spread over its whole length.")
    max_pixels: int = Field(200704, ge=3136, description="Pixels per frame, at most (448 x 448): each frame is "
                            "resized to fit, keeping its aspect ratio. More sees finer detail, at more memory.")
    instruction: str = Field(
        DEFAULT_CAPTION_INSTRUCTION,
        description="What the model is asked; `{media}` becomes `video` or `image`.",
    )
    prefix: str = Field("", description="Written before every caption, with a space (e.g. a trigger word).")
    max_new_tokens: int = Field(256, gt=0, description="Longest caption, in the model's tokens.")
    batch_size: int = Field(1, gt=0, description="Clips captioned in one model call (more takes more GPU memory).")
    device: str = Field("auto", description="auto (a GPU when there is one), cpu, cuda or cuda:N.")
    dtype: DType = Field("auto", description="Weights dtype; auto: bfloat16 on a GPU, float32 on the CPU.")


class Config(Section):
    model: ModelConfig = Field(description="Which model family and weights to train (required).")
    data: DataConfig = Field(description="Your clips and captions, and the clip shape (required).")
    training: TrainingConfig = Field(
        default_factory=TrainingConfig, description="Algorithm, steps, batch, learning rate, device, precision."
    )
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig, description="Optimizer and LR schedule.")
    lora: LoRAConfig = Field(default_factory=LoRAConfig, description="The adapter (training.algorithm=lora).")
    full: FullConfig = Field(
        default_factory=FullConfig, description="Which weights train (training.algorithm=full)."
    )
    adapter: AdapterConfig = Field(
        default_factory=AdapterConfig, description="The adapter's kind: LoRA, LoKr or LoHa (adapter algorithms)."
    )
    distillation: DistillationConfig = Field(
        default_factory=DistillationConfig,
        description="Teacher and student (training.algorithm=guidance-distillation or step-distillation).",
    )
    checkpoint: CheckpointConfig = Field(
        default_factory=CheckpointConfig, description="How often to save, how many to keep, resuming."
    )
    validation: ValidationConfig = Field(
        default_factory=ValidationConfig, description="Sample videos made with the trained weights."
    )
    memory: MemoryConfig = Field(default_factory=MemoryConfig, description="Memory savers.")
    control: ControlConfig = Field(
        default_factory=ControlConfig,
        description="Control training (training.algorithm=control-lora/control-full/in-context-lora)."
    )
    logging: LoggingConfig = Field(default_factory=LoggingConfig, description="Progress bars and metrics.")
    parallel: ParallelConfig = Field(
        default_factory=ParallelConfig, description="Several processes: DDP, FSDP2 or DeepSpeed ZeRO."
    )
    precompute: PrecomputeConfig = Field(
        default_factory=PrecomputeConfig, description="Encoding captions and clips once, into a cache."
    )
    caption: CaptionConfig = Field(
        default_factory=CaptionConfig, description="`vidtune caption`: the model that writes captions and its settings."
    )
    output_dir: str = Field(
        "outputs/run", description="Folder for everything a run writes (in a file: relative to its folder; the "
        "default: to the current folder)."
    )

    @model_validator(mode="after")
    def _check_consistency(self) -> Config:
        if self.optimizer.warmup_steps > self.training.steps:
            raise ValueError(
                f"optimizer.warmup_steps ({self.optimizer.warmup_steps}) is larger than training.steps "
                f"({self.training.steps}): the learning rate would still be rising when the run ends. Set "
                f"optimizer.warmup_steps to at most {self.training.steps} (a tenth, "
                f"{max(1, self.training.steps // 10)}, is common), or raise training.steps"
            )
        base_weights = self.memory.base_weights
        algorithm = self.training.algorithm
        traits = algorithm_traits(algorithm, self.distillation.student)
        if base_weights != "auto" and traits.trains_base_weights and not traits.chooses_student:
            raise ValueError(
                f"memory.base_weights={base_weights} works with adapter algorithms (lora, control-lora, a LoRA "
                f"student) only: {algorithm} trains the base weights, which cannot be stored "
                "quantized; set memory.base_weights=auto"
            )
        if traits.distils and not traits.chooses_student and self.distillation.student == "full":
            choosers = " or ".join(name for name in ALGORITHM_NAMES if algorithm_traits(name).chooses_student)
            raise ValueError(
                f"distillation.student=full works with training.algorithm={choosers} only: "
                f"{algorithm} trains a LoRA student; remove distillation.student"
            )
        if base_weights != "auto" and traits.trains_base_weights and traits.chooses_student:
            raise ValueError(
                f"memory.base_weights={base_weights} works with a LoRA student only: a full student trains those "
                "weights; set memory.base_weights=auto or remove distillation.student"
            )
        self._check_adapter()
        if self.training.masked_loss and not traits.weights_elements:
            raise ValueError(
                f"training.masked_loss works with a per-element denoising loss (lora, full, control-lora, "
                f"control-full): {algorithm} learns from the frozen model's outputs, not from the clip's pixels; "
                "remove training.masked_loss"
            )
        if self.training.preserve_base is not None:
            self._check_preserve_base(traits)
        if base_weights != "auto" and self.lora.use_dora:
            raise ValueError(
                f"lora.use_dora cannot be combined with memory.base_weights={base_weights}: DoRA computes with the "
                "whole frozen weight, which quantized storage does not give; turn one of them off"
            )
        return self

    def _check_adapter(self) -> None:
        """Settings that make no sense with `adapter.type`, each naming its keys."""
        adapter, lora, base_weights = self.adapter, self.lora, self.memory.base_weights
        kind = adapter.type
        if kind == "lora":
            # Values, not the keys set: a run's resolved config names every key with its default.
            lycoris = [key for key in ("decompose_factor", "decompose_both", "rank_dropout", "module_dropout")
                       if getattr(adapter, key) != AdapterConfig.model_fields[key].default]
            if lycoris:
                raise ValueError(f"adapter.{lycoris[0]} is a setting of adapter.type=lokr or loha, but adapter.type "
                                 "is lora; set adapter.type, or remove it")
            return
        traits = algorithm_traits(self.training.algorithm, self.distillation.student)
        if traits.trains_base_weights:
            student = " (distillation.student=full)" if traits.chooses_student else ""
            raise ValueError(f"adapter.type={kind} is an adapter, but training.algorithm={self.training.algorithm}"
                             f"{student} trains the denoiser's own weights; remove adapter.type or train an adapter")
        if lora.use_dora:
            raise ValueError(f"lora.use_dora works with adapter.type=lora only: peft has no DoRA for {kind}; remove "
                             "lora.use_dora or set adapter.type=lora")
        if lora.dropout:
            raise ValueError(f"lora.dropout drops LoRA's input features, which {kind} has no place for; use "
                             "adapter.rank_dropout (or adapter.module_dropout) instead")
        if kind == "loha" and (adapter.decompose_factor != -1 or adapter.decompose_both):
            raise ValueError("adapter.decompose_factor and adapter.decompose_both are LoKr's; adapter.type is loha")
        if adapter.decompose_factor == 0 or adapter.decompose_factor < -1:
            raise ValueError(f"adapter.decompose_factor={adapter.decompose_factor}: use -1 or a positive divisor "
                             "of the layers' sizes")
        if base_weights == "nf4":
            raise ValueError(f"memory.base_weights=nf4 cannot be combined with adapter.type={kind}: peft's {kind} "
                             "layers shape their delta like the base weight, which 4-bit storage packs; use "
                             "memory.base_weights=int8 or fp8, or adapter.type=lora")

    def _check_preserve_base(self, traits: Any) -> None:
        if not traits.preserves_base:
            raise ValueError(
                f"training.preserve_base works with training.algorithm=lora only: {self.training.algorithm} "
                f"{'trains the base weights' if traits.trains_base_weights else 'has no plain adapter to switch off'}"
                " (the base prediction is the same denoiser with its adapter off); remove training.preserve_base"
            )
        options = self.training.preserve_base
        if options is not None and options.prompts is None and not any(
                source.trigger for source in self.data.sources() if not source.eval):
            raise ValueError(
                "training.preserve_base has no preservation captions: set `trigger` on the sources whose captions "
                "should teach it (their captions without it preserve the base), or list training.preserve_base."
                "prompts"
            )

    @property
    def frame_rate(self) -> float:
        """The frame rate samples are generated at; in training, the one the denoiser is told for clips without their
        own (the LTX families tell each clip its own rate: `ModelSpec.clip_frame_rate`)."""
        return self.model.frame_rate or self.data.fps or 25.0

    def to_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


def required_keys() -> dict[str, list[str]]:
    """Section -> its keys without a default (all of them text: model.name, model.pretrained, data.root)."""
    found: dict[str, list[str]] = {}
    for name, field_info in Config.model_fields.items():
        annotation = field_info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel) and field_info.is_required():
            found[name] = [key for key, sub in annotation.model_fields.items() if sub.is_required()]
    return found
