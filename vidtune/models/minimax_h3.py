"""MiniMax H3 (MiniMax): a Qwen3-VL text encoder, a video VAE and a mono audio VAE, and one transformer that denoises
text, sound and picture as a single packed sequence (diffusers' MiniMaxH3ModularPipeline, text-to-video-and-audio).

Training is joint, as sampling is: every step packs `[text | audio | video]` rows the way the pipeline's layout block
does (the same function builds them, with its rotary grid and modality tags), and the transformer predicts both
streams in one call. A clip with an audio track trains both: its window's sound (stereo, resampled to the audio VAE's
rate) is encoded by the mono audio VAE channel by channel; the audio latents are noised at a level of their own,
drawn apart from the video's with the audio's token count and the audio schedule's shift (`stream_noise`); the loss
is the video's error plus `model.audio_loss_weight` times the audio's. A clip without sound follows
`model.clips_without_sound` as LTX-2's does: `video-only` packs no audio rows (the video attends to none), `silence`
packs the encoded silence and leaves its error out. Conventions taken from the modular pipeline's blocks:
    text: the caption verbatim, no chat template and no special tokens, Qwen3-VL's `hidden_states[50]` (the
        pipeline's `text_encoder_layer`); its rows carry the text tag, at rotary time 0..n-1; no padding reaches the
        transformer (the cache pads, `prompt_attention_mask` says how many rows are real);
    video latents: pixels in [0, 1] normalised with ImageNet's mean and std (the VAE's convention), the posterior
        normalised per channel with the VAE's `latents_mean` / `latents_std`; 17 n + 5 frames give 5 n + 2 latent
        frames, patched into rows frame-major;
    audio latents: [B, 2, L, C], the stereo channels as two items of the mono audio VAE, its posterior mode normalised
        with the audio VAE's `latents_mean` / `latents_std`; L = round(frames / 24 * 40) (the model's 24 fps and 40
        audio latents per second), packed channel-major;
    timesteps: the scheduler's t = 1 - sigma, unscaled in [0, 1], one per modality's rows (text rows share the
        video's), and the prediction is the data-ward velocity x0 - noise (MiniMaxH3Scheduler.step:
        x0 = x_t + sigma * v): vidtune's flow matching with inverted timesteps and a negated target.
The checkpoint is guidance-distilled: the pipeline has no guidance scale and no negative prompt.
The keyframe workflow (`fl2va`) gives a first and / or a last frame twice each, built with the pipeline's own functions
and blocks: as an anchor whose rows lead the video rows (`keyframe_latents`, noised to t = 0.999 and held there, out of
the prediction), and in the caption's presentation as a Qwen3-VL vision block (`keyframe_prompt_inputs`). Training
takes it as conditioning modes, each a share of the samples drawn per visit: the first frame
(`model.first_frame_conditioning`), the last frame and both (`model.conditioning.last_frame` / `first_last`). The
clip window's own first / last frame is the keyframe; its anchor latents are encoded beside the clip's latents, and
the caption is encoded with the mode's keyframes per caption and clip window (`prepare_clip_conditions`, cached as its
own entry kind). A sample drawn text-only reads the plain caption. Each clip of a micro-batch runs as its own packed
sequence, so a micro-batch mixes the modes freely.
"""

from __future__ import annotations

import functools
import math
from typing import Any, ClassVar

import torch
from diffusers import (
    AutoencoderKLMiniMaxH3,
    AutoencoderKLMiniMaxH3Audio,
    MiniMaxH3ModularPipeline,
    MiniMaxH3Scheduler,
    MiniMaxH3Transformer3DModel,
)
from diffusers.modular_pipelines.minimax_h3.before_denoise import (
    MiniMaxH3PrepareLayoutStep,
    MiniMaxH3SetTimestepsStep,
    patchify_video_latents,
)
from diffusers.modular_pipelines.minimax_h3.before_encoder import MiniMaxH3ResizeStep
from diffusers.modular_pipelines.minimax_h3.encoders import (
    MiniMaxH3FL2VATextEncoderStep,
    encode_vae_condition,
    get_qwen3vl_prompt_embeds,
)
from diffusers.modular_pipelines.minimax_h3.modular_blocks_minimax_h3 import MiniMaxH3Blocks
from diffusers.modular_pipelines.minimax_h3.modular_pipeline import (
    MINIMAX_H3_AUDIO_CHANNELS,
    MINIMAX_H3_AUDIO_TAG,
    MINIMAX_H3_FPS,
    MINIMAX_H3_TEXT_TAG,
    MINIMAX_H3_VIDEO_TAG,
    audio_latent_num_frames,
)
from diffusers.modular_pipelines.modular_pipeline import SequentialPipelineBlocks
from PIL import Image
from torch import nn
from transformers import AutoImageProcessor, ProcessorMixin, Qwen3VLForConditionalGeneration

from vidtune.config import Config, TrainingConfig
from vidtune.data.audio import AudioBatch, AudioFormat
from vidtune.errors import ConfigError, ModelError
from vidtune.export.comfyui import Rule
from vidtune.export.comfyui_models import ComfyUIModel, minimax_h3
from vidtune.models import conditioning
from vidtune.models.conditioning import Given
from vidtune.models.defaults import MINIMAX_H3
from vidtune.models.sound import (
    AUDIO_LATENTS,
    AUDIO_NOISE,
    AUDIO_PRESENT,
    AUDIO_SIGMAS,
    draw_audio_noise,
    heard,
    keyed_noise,
)
from vidtune.models.spec import (
    Conditions,
    GeneratedSample,
    Latents,
    ModelSpec,
    StepCallback,
    TextComponents,
    VAEWithExtras,
    frames_to_pil,
    raise_shape_problems,
    side_problems,
)
from vidtune.objectives import NUM_TRAIN_TIMESTEPS, FlowMatching, Objective, flow_matching_noisy

# The pipeline's own constants (MiniMaxH3ModularPipeline's properties, fixed for the released model).
TEXT_ENCODER_LAYER = 50  # `text_encoder_layer`: the Qwen3-VL hidden state the transformer reads
PIXEL_MEAN = (0.485, 0.456, 0.406)  # `pixel_mean` / `pixel_std`: the video VAE's ImageNet convention
PIXEL_STD = (0.229, 0.224, 0.225)
MAX_SECONDS = 15.0  # `max_duration`: the longest video the layout block samples
# The keyframe workflow's (`fl2va`) anchor recipe (the pipeline's `keyframe_noise_aug` and `keyframe_encode_seed`):
# an anchor is noised to t = 0.999 and held at max(t, 0.999); its posterior is sampled under its own seed 42.
KEYFRAME_T = 0.999
KEYFRAME_SEED = 42
# Training's anchor noise comes from a generator of the visit's stream position under this offset of the seed.
ANCHOR_SEED_OFFSET = 13
# Keys of keyframe anchors in the conditions: the clean first-frame and last-frame latents [B, C, 1, H, W] (normalised
# as the pipeline's keyframe encoder normalises them), and the noise [B, C, A, H, W] a sample's A anchors are noised
# with, in packed order (the pipeline's one draw per condition).
KEYFRAME_LATENTS = "keyframe_latents"
KEYFRAME_LAST_LATENTS = "keyframe_last_latents"
KEYFRAME_NOISE = "keyframe_noise"
ANCHOR_LATENTS = {"first": KEYFRAME_LATENTS, "last": KEYFRAME_LAST_LATENTS}  # each end's anchor key
# The keyframe workflow's modes: which ends of the video each anchors, in the pipeline's packed order (`image` then
# `last_image`, MiniMaxH3ResizeStep).
KEYFRAME_MODES: dict[str, tuple[str, ...]] = {"first_frame": ("first",), "last_frame": ("last",),
                                              "first_last": ("first", "last")}
# The caption rows the cache holds per caption (the pipeline takes the prompt whole; longer captions are cut).
DEFAULT_MAX_SEQUENCE_LENGTH = 512


def presentation_keys(mode: str) -> tuple[str, str, str]:
    """Keys of a caption encoded with a keyframe mode's pictures (`prepare_clip_conditions`): the presentation's hidden
    states [B, L, D] (padded), which rows are real [B, L], and each row's modality tag [B, L] (vision blocks: video)."""
    return f"{mode}_prompt_embeds", f"{mode}_prompt_attention_mask", f"{mode}_text_token_tags"


KEYFRAME_PROMPT_EMBEDS, KEYFRAME_PROMPT_MASK, KEYFRAME_TEXT_TAGS = presentation_keys("first_frame")


class TextOnlyTokenTypes:
    """The one thing `get_qwen3vl_prompt_embeds` asks Qwen3VLProcessor for: the token types of a presentation,
    all text (0) for a caption (a keyframe's vision block, which would need the image processor, never occurs)."""

    @staticmethod
    def create_mm_token_type_ids(input_ids: list[list[int]]) -> list[list[int]]:
        return [[0] * len(ids) for ids in input_ids]


class KeyframeTokenTypes:
    """What the pipeline's keyframe text encoder asks Qwen3VLProcessor for: its image processor, and the token types
    of a presentation by Qwen3-VL's own rule (`create_mm_token_type_ids`: 1 on image tokens, 2 on video tokens).
    Stands in for Qwen3VLProcessor, whose video half (never used for a keyframe) needs torchvision."""

    def __init__(self, image_processor: Any, image_token_id: int, video_token_id: int) -> None:
        self.image_processor = image_processor
        self.image_token_ids, self.video_token_ids, self.audio_token_ids = [image_token_id], [video_token_id], []

    def create_mm_token_type_ids(self, input_ids: list[list[int]]) -> list[list[int]]:
        return ProcessorMixin.create_mm_token_type_ids(self, input_ids)  # type: ignore[arg-type]


class MiniMaxH3Pipeline(MiniMaxH3ModularPipeline):
    """MiniMaxH3ModularPipeline whose shortest video is one VAE chunk (17 + 5 frames) instead of 5 s: the released
    model was trained on 5 to 15 s, and its layout block refuses anything shorter, but a LoRA trained on short clips
    is previewed at their length (validation samples at the training shape). Every block is the pipeline's own."""

    @property
    def min_duration(self) -> float:
        return (self.vae_frames_per_chunk + self.vae_latents_per_chunk) / self.fps


class MiniMaxH3Autoencoders(VAEWithExtras):
    """What `MiniMaxH3Spec.load_vae` returns: the video VAE (which training encodes the frames with) and the audio VAE
    (which encodes the sound and renders a sample's). Opaque to trainers."""

    def __init__(self, vae: nn.Module, audio_vae: nn.Module) -> None:
        super().__init__(vae)
        self.audio_vae = audio_vae


def layout(text_tags: torch.Tensor | int, latent_frames: int, latent_height: int, latent_width: int,
           audio_latents: int, patch: tuple[int, int, int], keyframe_anchors: tuple[str, ...] = ()
           ) -> dict[str, torch.Tensor]:
    """The packed sequence of one clip, built by the pipeline's layout block: `position_ids`, `token_tags` and the
    rows of each modality (host tensors). `text_tags`: each text row's modality tag (the keyframe presentation's
    vision block is tagged video), or a count of caption rows (all text). With `keyframe_anchors` ("first" /
    "last"), one anchor frame's rows per keyframe lead the video rows, as the keyframe workflow lays them out."""
    if isinstance(text_tags, int):
        text_tags = torch.full((text_tags,), MINIMAX_H3_TEXT_TAG, dtype=torch.long)
    position_ids, token_tags, video_rows, audio_rows, text_indices, _, _ = (
        MiniMaxH3PrepareLayoutStep.build_packed_sequence(
            text_tags.cpu().long(), latent_frames, latent_height,
            latent_width, audio_latents, patch, MINIMAX_H3_AUDIO_CHANNELS, MINIMAX_H3_AUDIO_TAG, MINIMAX_H3_VIDEO_TAG,
            keyframe_anchors))
    return {"position_ids": position_ids, "token_tags": token_tags, "video_indices": video_rows,
            "audio_indices": audio_rows, "text_indices": text_indices}


def keyframe_latents(vae: nn.Module, frames: torch.Tensor) -> torch.Tensor:
    """Keyframes [B, 3, H, W] in [-1, 1] -> their anchor latents [B, C, 1, H', W'] as the pipeline's keyframe encoder
    makes them (`encode_vae_condition`): the 8-bit picture a user hands it, encoded alone, its posterior sampled
    under the keyframe seed, rounded to float16 and normalised."""
    pixels = ((frames.float().cpu() + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8)
    return torch.cat([encode_vae_condition(vae, picture[None, :, None].to(vae.device), PIXEL_MEAN, PIXEL_STD,
                                           KEYFRAME_SEED) for picture in pixels])


def noised_anchor(clean: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    """An anchor at the keyframe level: t * x0 + (1 - t) * noise with t = 0.999 (MiniMaxH3Scheduler.scale_noise)."""
    return KEYFRAME_T * clean + (1.0 - KEYFRAME_T) * noise


def unpatchify(rows: torch.Tensor, shape: tuple[int, ...], patch: tuple[int, int, int]) -> torch.Tensor:
    """Video rows [N, C * prod(patch)] back to latents [1, C, F, H, W] (the pipeline's after-denoise block)."""
    channels, frames, height, width = shape
    patch_t, patch_h, patch_w = patch
    rows = rows.reshape(1, frames // patch_t, height // patch_h, width // patch_w, channels, patch_t, patch_h, patch_w)
    return rows.permute(0, 4, 1, 5, 2, 6, 3, 7).reshape(1, channels, frames, height, width)


class MiniMaxH3Spec(ModelSpec):
    name = "minimax-h3"
    validation_guidance_scale = 1.0  # guidance-distilled: the pipeline takes no guidance scale
    defaults = MINIMAX_H3
    pipeline_class = MiniMaxH3Pipeline
    text_encoder_class = Qwen3VLForConditionalGeneration
    vae_class = AutoencoderKLMiniMaxH3
    denoiser_class = MiniMaxH3Transformer3DModel
    scheduler_class = MiniMaxH3Scheduler
    # MiniMax's original layout and ComfyUI's MiniMax H3 files: q, k and v stacked `[q; k; v]` as every published
    # single file holds them (diffusers' converter cannot tell a file merged by hand from MiniMaxAI's per-head
    # interleaved shards from one, and reads the stacked order); the pruned files (`adaln_t_table` in place of the
    # time embedder) are refused by the converter with that reason.
    loads_single_file = True
    float8_refusal = ("transformer casts each layer's input to that layer's weight dtype (its caption projection and "
                      "modulations), so float8 storage would make it compute in float8")
    # Off by default; a share above 0 trains that share of the samples in the keyframe workflow (`fl2va`) from the
    # clip's first frame, which validation and `vidtune sample --image` then sample with.
    first_frame_conditioning = 0.0
    conditioning_modes = ("last_frame", "first_last")  # the keyframe workflow's `last_image`, alone or after `image`
    conditioning_refusal: ClassVar[str] = (
        "its pipeline's keyframe workflow (`fl2va`) takes a first and / or a last frame, each as a Qwen3-VL vision "
        "block in the caption and an anchor in front of the generated rows; it has no clip to extend and no mask "
        "(extension, inpainting). Its reference workflow (`ref2va`) reads a second transformer (`transformer_ref`), "
        "with its own weights and layout, which vidtune does not load")
    control_refusal: ClassVar[str] = (
        "its transformer reads one packed sequence of text, sound and picture rows per clip, whose video rows a "
        "widened input layer cannot tell from the others.")

    # ----- loading ----------------------------------------------------------------------------------------------
    def required_components(self) -> tuple[str, ...]:
        return (*super().required_components(), "audio_vae", "audio_scheduler")

    def load_vae(self, device: torch.device) -> MiniMaxH3Autoencoders:
        vae = super().load_vae(device)
        audio_vae = self.load_component(AutoencoderKLMiniMaxH3Audio, "audio_vae",
                                        torch_dtype=self.component_dtype("vae", device))
        return MiniMaxH3Autoencoders(vae, audio_vae.requires_grad_(False).eval().to(device))

    def load_audio_scheduler(self) -> MiniMaxH3Scheduler:
        return self.load_component(MiniMaxH3Scheduler, "audio_scheduler")

    def native_max_sequence_length(self) -> int:
        return DEFAULT_MAX_SEQUENCE_LENGTH

    # ----- shapes -----------------------------------------------------------------------------------------------
    @functools.cached_property
    def compression(self) -> tuple[int, int, int, tuple[int, int, int]]:
        """(VAE spatial ratio, pixel frames per VAE chunk, latent frames a chunk keeps, transformer patch (t, h, w))."""
        vae = self.load_config(AutoencoderKLMiniMaxH3, "vae")
        spatial = math.prod(vae.get("spatial_downsample_factors", (2, 2, 2, 2, 1, 1)))
        temporal = math.prod(vae.get("temporal_downsample_factors", (1, 2, 2, 1, 1, 1)))
        clip_length = int(vae.get("clip_length", 17))
        transformer = self.load_config(MiniMaxH3Transformer3DModel, "transformer")
        return spatial, clip_length, math.ceil(clip_length / temporal), tuple(transformer.get("patch_size", (1, 2, 2)))

    def latent_frame_groups(self, frames: int, latent_frames: int) -> list[range]:
        """The VAE encodes `clip_length`-frame chunks (the last padded with its last frame), each causally padded in
        front to whole groups of the temporal ratio, and drops the last latent frames of the whole: a chunk's first
        latent frame is its first frame alone (or fewer padding frames), each next one the following ratio's frames."""
        _, clip_length, kept, _ = self.compression
        vae = self.load_config(AutoencoderKLMiniMaxH3, "vae")
        ratio = math.prod(vae.get("temporal_downsample_factors", (1, 2, 2, 1, 1, 1)))
        front = kept * ratio - clip_length  # the causal padding in front of each chunk
        groups = []
        for start in range(0, frames, clip_length):
            for index in range(kept):
                low = start + max(0, index * ratio - front)
                high = start + min(clip_length, (index + 1) * ratio - front)
                # Past the clip: the padding repeats its last frame.
                groups.append(range(low, min(high, frames)) if low < frames else range(frames - 1, frames))
        if len(groups) < latent_frames:
            return super().latent_frame_groups(frames, latent_frames)
        return groups[:latent_frames]

    def check_video_shape(self, frames: int, height: int, width: int) -> None:
        spatial, clip_length, kept, patch = self.compression
        problems = side_problems(height, width, spatial * patch[1], spatial * patch[2])
        if width < 2 * spatial * patch[2]:
            # The sound's two channels sit at the two ends of the video's width grid: on a canvas one patch wide they
            # share every rotary position, and the transformer cannot tell left from right.
            problems.append(f"data.width={width} must be at least {2 * spatial * patch[2]} (two patch columns): the "
                            "pipeline places the sound's left and right channels at the first and last column")
        valid = [clip_length * n + kept for n in range(1, 64) if clip_length * n + kept <= MAX_SECONDS * MINIMAX_H3_FPS]
        if frames not in valid:
            nearest = sorted(valid, key=lambda value: abs(value - frames))[:2]
            problems.append(f"data.frames={frames} must be {clip_length}k+{kept}, at most {MAX_SECONDS:g} s at "
                            f"{MINIMAX_H3_FPS} fps (the longest video the pipeline samples); nearest valid values: "
                            f"{' or '.join(str(value) for value in sorted(nearest))}")
        raise_shape_problems("MiniMax H3", problems, self,
                             f"frames {clip_length}k+{kept} up to {valid[-1] if valid else '?'}, sides multiples of "
                             f"{spatial * patch[1]}")

    def check_training(self, config: Config) -> None:
        """The model runs at 24 fps, and its sound lasts frames / 24 s: another frame rate would pair a clip's frames
        with sound of another length than the pipeline's. Its frozen weights cannot be stored in float8: the
        transformer casts its inputs to the dtype of the layer that reads them (the caption projection, each
        block's modulation), which would then be float8. Base-model preservation does not take the keyframe
        workflow: its captions are encoded alone."""
        if config.memory.base_weights == "fp8":
            raise ConfigError(f"memory.base_weights=fp8: {self.name}'s {self.float8_refusal}.\nWhat to do: set "
                              "memory.base_weights=int8 or nf4 (or auto); a float8 file (model.transformer_file) is "
                              "then upcast exactly.")
        if self.reads_clip_in_conditions and config.training.preserve_base is not None:
            raise ConfigError(
                "training.preserve_base with the keyframe workflow (model.first_frame_conditioning / "
                f"model.conditioning): {self.name}'s keyframed samples read their caption encoded with their "
                "keyframes, and the preservation captions are encoded alone.\nWhat to do: remove "
                "training.preserve_base, or train the text-to-video-and-audio workflow alone (no keyframe share).")
        if config.frame_rate != MINIMAX_H3_FPS:
            raise ConfigError(
                f"model.frame_rate / data.fps = {config.frame_rate:g}: {self.name} is a {MINIMAX_H3_FPS} fps model "
                f"(its pipeline samples {MINIMAX_H3_FPS} fps and pairs {MINIMAX_H3_FPS} frames with one second of "
                f"sound).\nWhat to do: set data.fps={MINIMAX_H3_FPS} (clips are resampled to it) and remove "
                "model.frame_rate.")

    # ----- tensors ----------------------------------------------------------------------------------------------
    def condition_identity(self) -> dict[str, Any]:
        return {**super().condition_identity(), "text_encoder_layer": TEXT_ENCODER_LAYER, "template": None}

    def latent_identity(self) -> dict[str, Any]:
        identity = {**super().latent_identity(), "pixels": [list(PIXEL_MEAN), list(PIXEL_STD)], "fps": MINIMAX_H3_FPS,
                    "audio": {"source": "clip", "channels": MINIMAX_H3_AUDIO_CHANNELS}}
        if self.reads_clip_in_conditions:  # only then: the keys of text-to-video caches stay as they were
            identity["keyframe"] = {"anchors": list(self.anchored_ends), "pixels": "8-bit, encoded alone",
                                    "seed": KEYFRAME_SEED}
        return identity

    # ----- the keyframe workflow's caption ---------------------------------------------------------------------
    @property
    def keyframe_modes(self) -> tuple[str, ...]:
        """The keyframe workflow's modes a share of the samples trains: first frame (`model.first_frame_conditioning`),
        last frame and both (`model.conditioning`)."""
        first = ("first_frame",) if self.first_frame_probability > 0 else ()
        return first + tuple(mode for mode in ("last_frame", "first_last") if mode in self.config.conditioning.enabled)

    @property
    def anchored_ends(self) -> tuple[str, ...]:
        """The ends of a clip ("first", "last") whose anchor latents the trained modes read."""
        ends = {end for mode in self.keyframe_modes for end in KEYFRAME_MODES[mode]}
        return tuple(end for end in ("first", "last") if end in ends)

    @property
    def reads_clip_in_conditions(self) -> bool:
        """A share of the samples trains the keyframe workflow: its caption is encoded with the clip's keyframes."""
        return bool(self.keyframe_modes)

    @property
    def samples_from_image(self) -> bool:
        """Trained in the keyframe workflow, validation and `vidtune sample --image` sample it from a first frame."""
        return self.image_to_video or self.first_frame_probability > 0

    def clip_condition_components(self) -> tuple[str, ...]:
        return ("processor",)  # Qwen3-VL's image processor: the keyframe's vision block

    def clip_condition_identity(self) -> dict[str, Any]:
        return {"presentation": "fl2va", "modes": {mode: list(KEYFRAME_MODES[mode]) for mode in self.keyframe_modes},
                "label": "<Picture i>: "}

    @functools.cached_property
    def image_processor(self) -> Any:
        return self.load_component(AutoImageProcessor, "processor")

    @torch.no_grad()
    def prepare_clip_conditions(self, text: TextComponents, captions: list[str], windows: torch.Tensor
                                ) -> Conditions:
        """Each caption in the keyframe workflow's presentation with each trained mode's keyframes, the window's first
        and / or last frame (`keyframe_prompt_inputs`: the pipeline's resize and keyframe text encoder blocks), padded
        with zeros to the presentation's rows before the caption plus `max_sequence_length` (one length per clip
        size); a longer caption is cut there, which the causal encoder's rows before the cut do not notice. Keys by
        mode (`presentation_keys`), with each row's modality tag."""
        height, width = windows.shape[-2:]
        tokenizer = text["tokenizer"]
        pictures = {"first": frames_to_pil(windows[:, 0]), "last": frames_to_pil(windows[:, -1])}
        # The caption's own rows: the presentation's rows before them do not depend on it.
        caption_rows = [len(tokenizer(caption, add_special_tokens=False)["input_ids"]) if caption else 0
                        for caption in captions]
        found: Conditions = {}
        for mode in self.keyframe_modes:
            ends = KEYFRAME_MODES[mode]
            embeds, masks, tags = [], [], []
            for index, caption in enumerate(captions):
                inputs = self.keyframe_prompt_inputs(
                    text, caption, pictures["first"][index] if "first" in ends else None, height, width,
                    last=pictures["last"][index] if "last" in ends else None)
                rows = inputs["prompt_embeds"].shape[1]
                length = rows - caption_rows[index] + self.max_sequence_length
                kept = min(rows, length)
                embeds.append(torch.nn.functional.pad(inputs["prompt_embeds"][0, :kept], (0, 0, 0, length - kept)))
                masks.append(torch.arange(length) < kept)
                tags.append(torch.nn.functional.pad(inputs["text_token_tags"][:kept].cpu(), (0, length - kept),
                                                    value=MINIMAX_H3_TEXT_TAG))
            embeds_key, mask_key, tags_key = presentation_keys(mode)
            found.update({embeds_key: torch.stack(embeds), mask_key: torch.stack(masks), tags_key: torch.stack(tags)})
        return found

    def visit_conditions(self, x0: torch.Tensor, positions: torch.Tensor, seed: int) -> Conditions:
        """With a keyframe mode trained: each sample's mode (or none), drawn from its stream position, and the noise
        its anchors are noised with, in packed order (from a generator of its own)."""
        if not self.keyframe_modes:
            return {}
        mode_shares = conditioning.shares(self.config.conditioning, self.first_frame_probability)
        codes = conditioning.draw_modes(mode_shares, positions, seed, {})
        anchors = max(len(KEYFRAME_MODES[mode]) for mode in self.keyframe_modes)
        anchor_shape = (x0.shape[1], anchors, *x0.shape[3:])
        noise = torch.stack([torch.randn(anchor_shape, generator=conditioning.visit_generator(seed + ANCHOR_SEED_OFFSET,
                                                                                            int(position)))
                             for position in positions.tolist()])
        return {conditioning.MODE: codes.to(x0.device), KEYFRAME_NOISE: noise.to(x0.device)}

    @torch.no_grad()
    def prepare_conditions(self, text: TextComponents, captions: list[str]) -> Conditions:
        """Qwen3-VL's `hidden_states[50]` of each caption's tokens (no template, no special tokens) by the pipeline's
        own `get_qwen3vl_prompt_embeds`, padded to `max_sequence_length` rows with zeros; the mask marks the real
        rows. An empty caption has none (the transformer then reads no text row)."""
        tokenizer, text_encoder = text["tokenizer"], text["text_encoder"]
        device, dim, length = text_encoder.device, text_encoder.config.text_config.hidden_size, self.max_sequence_length
        embeds, masks = [], []
        for caption in captions:
            ids = tokenizer([caption], add_special_tokens=False, truncation=True, max_length=length)["input_ids"][0]
            ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
            hidden = torch.zeros(1, 0, dim, device=device, dtype=text_encoder.dtype)
            if ids:
                hidden = get_qwen3vl_prompt_embeds(text_encoder, TextOnlyTokenTypes(), ids, {},
                                                   text_encoder_layer=TEXT_ENCODER_LAYER, device=device,
                                                   dtype=text_encoder.dtype)
            embeds.append(torch.nn.functional.pad(hidden[0], (0, 0, 0, length - len(ids))))
            masks.append((torch.arange(length) < len(ids)).to(device))
        return {"prompt_embeds": torch.stack(embeds), "prompt_attention_mask": torch.stack(masks)}

    def audio_format(self) -> AudioFormat:
        """The audio VAE's rate, in stereo (the pipeline's two channels), at the model's 24 fps."""
        return self._audio_format

    @functools.cached_property
    def _audio_format(self) -> AudioFormat:
        audio = self.load_config(AutoencoderKLMiniMaxH3Audio, "audio_vae")
        return AudioFormat(int(audio.get("sampling_rate", 32000)), MINIMAX_H3_AUDIO_CHANNELS, float(MINIMAX_H3_FPS))

    @torch.no_grad()
    def prepare_latents(self, vae: MiniMaxH3Autoencoders, videos: torch.Tensor,
                        audio: AudioBatch | None = None) -> Latents:
        """The video posterior, the clip's audio latents and whether it has sound (`AUDIO_PRESENT`); a clip without
        a track gets the latents of silence, marked absent."""
        video_vae = vae.vae
        mean = torch.tensor(PIXEL_MEAN).view(1, 1, 3, 1, 1)
        std = torch.tensor(PIXEL_STD).view(1, 1, 3, 1, 1)
        pixels = ((videos.float().cpu() + 1.0) / 2.0 - mean) / std
        posterior = self.vae_posterior(video_vae, pixels)
        latent_mean = torch.tensor(video_vae.config.latents_mean).view(1, -1, 1, 1, 1).to(posterior.mean)
        latent_std = torch.tensor(video_vae.config.latents_std).view(1, -1, 1, 1, 1).to(posterior.mean)
        batch, frames = videos.shape[:2]
        samples = self.audio_format().samples(frames)
        waveforms = torch.zeros(batch, MINIMAX_H3_AUDIO_CHANNELS, samples)
        present = torch.zeros(batch, 1, dtype=torch.bool)
        if audio is not None:  # a clip without a track is silence, whatever its waveform holds
            present[:, 0] = audio.present.cpu()
            heard_waveforms = audio.waveforms[:, :, :samples].float().cpu() * present.view(batch, 1, 1)
            waveforms[:, :, : heard_waveforms.shape[-1]] = heard_waveforms
        audio_latents = self.sound_latents(vae.audio_vae, waveforms, frames)
        keyframe = {}
        for end in self.anchored_ends:  # the keyframe workflow's anchors: the first / last frame as a user's picture
            keyframe[ANCHOR_LATENTS[end]] = keyframe_latents(
                video_vae, videos[:, 0 if end == "first" else -1]).to(audio_latents.device)
        return {**self.normalised_posterior(posterior, 1.0 / latent_std, latent_mean),
                AUDIO_LATENTS: audio_latents, AUDIO_PRESENT: present.to(audio_latents.device), **keyframe}

    def sound_latents(self, audio_vae: nn.Module, waveforms: torch.Tensor, frames: int) -> torch.Tensor:
        """[B, 2, samples] at the audio VAE's rate -> [B, 2, L, C]: each channel's posterior mode as the mono audio
        VAE gives it, normalised as the pipeline normalises audio latents, the first L = round(frames / 24 * 40)
        (silence where the sound is shorter)."""
        if audio_vae.config.latents_mean is None or audio_vae.config.latents_std is None:
            raise ModelError(f"{self.describe_file('audio_vae', 'config.json')} holds no latents_mean / latents_std, "
                             "which the pipeline normalises the audio latents with.\nWhat to do: use the released "
                             "MiniMax H3 audio VAE (its config.json holds both).")
        length = audio_latent_num_frames(frames)
        hop = audio_vae.hop_length
        missing = length * hop - waveforms.shape[-1]
        if missing > 0:
            waveforms = torch.nn.functional.pad(waveforms, (0, missing))
        batch, channels, samples = waveforms.shape
        flat = waveforms.reshape(batch * channels, 1, samples).to(audio_vae.device, audio_vae.dtype)
        latents = audio_vae.encode(flat).latent_dist.mode().float()[..., :length].transpose(1, 2)
        mean = torch.tensor(audio_vae.config.latents_mean).view(1, 1, -1).to(latents)
        std = torch.tensor(audio_vae.config.latents_std).view(1, 1, -1).to(latents)
        return ((latents - mean) / std).reshape(batch, channels, length, -1)

    # ----- objective and the audio stream -------------------------------------------------------------------
    def objective(self, training: TrainingConfig) -> Objective:
        """Flow matching told t = 1 - sigma with the data-ward velocity x0 - noise as its target: what
        MiniMaxH3Scheduler steps with (it has no config flag to read this from)."""
        return FlowMatching(sampling=training.sigma_sampling, logit_mean=training.logit_mean,
                            logit_std=training.logit_std, shift=training.sigma_shift, invert_timesteps=True,
                            negate_target=True, stretch=training.sigma_stretch,
                            uniform_fraction=training.sigma_uniform_fraction, weighting=training.loss_weighting,
                            frame_noise=self.checked_frame_noise(training))

    def stream_noise(self, objective: Objective, latents: Latents,
                     generators: list[torch.Generator]) -> tuple[Conditions, dict[str, torch.Tensor]]:
        """Each clip's audio sigma, drawn apart from the video's from the same distribution with the audio's own token
        count (its rows), and its audio noise, from the clip's generator (as LTX-2's)."""
        clean = latents[AUDIO_LATENTS]
        return draw_audio_noise(objective, latents, generators, clean.shape[1] * clean.shape[2])

    def joint_forward(self, denoiser: nn.Module, conditions: Conditions, noisy_latents: torch.Tensor,
                      timesteps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The transformer on each clip's packed sequence: (video prediction [B, C, F, H, W], audio prediction
        [B, 2, L, C], audio target). The audio is noised at the conditions' `AUDIO_SIGMAS` with their `AUDIO_NOISE`
        (training); without them at the video's sigma with noise keyed by the timestep. A clip without sound packs no
        audio rows under `model.clips_without_sound: video-only` (its audio prediction is zeros)."""
        patch = tuple(denoiser.config.patch_size)
        clean_audio = conditions[AUDIO_LATENTS].float()
        if AUDIO_SIGMAS in conditions:
            audio_sigmas = conditions[AUDIO_SIGMAS].detach().float().cpu()
            audio_noise = conditions[AUDIO_NOISE].to(clean_audio)
        else:
            audio_sigmas = timesteps.detach().float().cpu() / NUM_TRAIN_TIMESTEPS
            audio_sigmas = 1.0 - audio_sigmas  # timesteps are t = 1 - sigma
            audio_noise = keyed_noise(timesteps, clean_audio)
        noisy_audio = flow_matching_noisy(clean_audio, audio_noise, audio_sigmas)
        present = heard(conditions, noisy_latents.shape[0])
        silent_audio = self.config.clips_without_sound == "silence"
        modes = self.keyframe_modes_drawn(conditions, noisy_latents.shape[0])
        video_predictions, audio_predictions = [], []
        for index in range(noisy_latents.shape[0]):
            with_audio = bool(present[index]) or silent_audio
            latents = noisy_latents[index: index + 1]
            _, frames, height, width = latents.shape[1:]
            audio_rows = noisy_audio[index].reshape(-1, noisy_audio.shape[-1]) if with_audio else \
                noisy_audio.new_zeros(0, noisy_audio.shape[-1])
            video_rows = patchify_video_latents(latents, patch)
            anchors = KEYFRAME_MODES[modes[index]] if modes[index] else ()
            if anchors:  # the keyframe workflow: the anchors lead the video rows, in packed order
                noise = conditions[KEYFRAME_NOISE][index: index + 1].float()
                rows = [patchify_video_latents(noised_anchor(
                    conditions[ANCHOR_LATENTS[end]][index: index + 1].float(),
                    noise[:, :, number: number + 1]).to(latents), patch) for number, end in enumerate(anchors)]
                video_rows = torch.cat([*rows, video_rows])
            anchor_rows = video_rows.shape[0] - (frames * height * width) // math.prod(patch)
            text, text_tags = self.caption_rows(conditions, index, modes[index])
            text_rows = text.shape[0]
            packed = layout(text_tags, frames, height, width, clean_audio.shape[2] if with_audio else 0, patch,
                            anchors)
            t_video = float(timesteps[index]) / NUM_TRAIN_TIMESTEPS
            unique, row_timesteps = MiniMaxH3SetTimestepsStep.build_row_timesteps(
                packed["video_indices"], packed["audio_indices"], anchor_rows, 0, text_rows, t_video,
                1.0 - float(audio_sigmas[index]), max(t_video, KEYFRAME_T), 1.0)
            packed = {key: value.to(latents.device) for key, value in packed.items()}
            video, audio = denoiser(
                hidden_states=video_rows[None],
                audio_hidden_states=audio_rows[None].to(latents.dtype),
                encoder_hidden_states=text[None],
                timestep=unique.to(latents.device),
                timestep_indices=row_timesteps.to(latents.device),
                return_dict=False,
                **packed,
            )
            video_predictions.append(unpatchify(video[0, anchor_rows:], latents.shape[1:], patch))  # no anchor
            audio_predictions.append(audio[0].reshape(clean_audio.shape[1:]) if with_audio else
                                     torch.zeros_like(clean_audio[index]).to(video.dtype))
        target = clean_audio - audio_noise  # the data-ward velocity, as the video's
        return torch.cat(video_predictions), torch.stack(audio_predictions), target

    @staticmethod
    def keyframe_modes_drawn(conditions: Conditions, batch: int) -> list[str | None]:
        """Each sample's keyframe mode (None: text only): its drawn mode (`visit_conditions`); without a draw, the
        first frame's for every sample given a first-frame anchor and its noise."""
        if KEYFRAME_NOISE not in conditions:
            return [None] * batch
        if conditioning.MODE not in conditions:
            return ["first_frame" if KEYFRAME_LATENTS in conditions else None] * batch
        codes = conditions[conditioning.MODE].flatten().tolist()
        names = [conditioning.MODES[int(code) - 1] if int(code) != conditioning.NONE else None for code in codes]
        return [name if name in KEYFRAME_MODES else None for name in names]

    @staticmethod
    def caption_rows(conditions: Conditions, index: int, mode: str | None) -> tuple[torch.Tensor, torch.Tensor]:
        """One sample's text rows [N, D] and their modality tags [N]: its caption's, or in a keyframe mode the caption
        encoded with the mode's keyframes. A dropped caption (caption dropout) keeps the keyframes' labels and vision
        blocks: with the `empty` technique without the caption's rows (the pipeline's presentation of an empty prompt:
        the causal encoder's rows before the caption do not read it), with `zero` the caption's rows zeroed."""
        # Read on the host: `vidtune plan` traces on the meta device and knows the mask only as a host copy.
        plain_rows = int(conditions["prompt_attention_mask"][index].cpu().sum())
        plain = conditions["prompt_embeds"][index, :plain_rows]
        embeds_key, mask_key, tags_key = presentation_keys(mode or "")
        if mode is None or embeds_key not in conditions:
            return plain, torch.full((plain_rows,), MINIMAX_H3_TEXT_TAG, dtype=torch.long)
        rows = int(conditions[mask_key][index].cpu().sum())
        text = conditions[embeds_key][index, :rows]
        tags = conditions[tags_key][index, :rows].cpu().long()
        vision = (tags != MINIMAX_H3_TEXT_TAG).nonzero()
        caption_start = int(vision[-1]) + 1 if len(vision) else 0
        if plain_rows == 0:  # dropped (`empty`), or an empty caption: the presentation before the caption
            return text[:caption_start], tags[:caption_start]
        if not bool(plain.any()):  # dropped (`zero`): the caption's rows zeroed
            text = torch.cat([text[:caption_start], torch.zeros_like(text[caption_start:])])
        return text, tags

    def forward(self, denoiser: nn.Module, conditions: Conditions, noisy_latents: torch.Tensor,
                timesteps: torch.Tensor) -> torch.Tensor:
        """The video prediction (the audio stream runs beside it in the same sequence)."""
        return self.joint_forward(denoiser, conditions, noisy_latents, timesteps)[0]

    def training_error(self, denoiser: nn.Module, conditions: Conditions, noisy_latents: torch.Tensor,
                       timesteps: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The video's mean squared error plus `model.audio_loss_weight` times the audio's, per clip; a clip without
        sound adds no audio error."""
        video, audio, audio_target = self.joint_forward(denoiser, conditions, noisy_latents, timesteps)
        video_error = self.per_clip_error((video.float() - target).pow(2), conditions)
        audio_error = (audio.float() - audio_target).pow(2).flatten(1).mean(dim=1)
        present = heard(conditions, video.shape[0]).float().to(audio_error.device)
        return video_error + self.config.audio_loss_weight * present * audio_error

    def token_count(self, latent_shape: tuple[int, ...] | torch.Size) -> int:
        patch_t, patch_h, patch_w = self.compression[3]
        frames, height, width = (int(size) for size in latent_shape[-3:])
        return -(-frames // patch_t) * (height // patch_h) * (width // patch_w)

    # ----- ComfyUI ---------------------------------------------------------------------------------------------
    def comfyui_lora_rules(self) -> list[Rule]:
        """MiniMax's names, which ComfyUI's model keeps (diffusers' single-file converter, read backwards): q, k and
        v fused as `[q; k; v]` in `attn.qkv_proj`; the SwiGLU input `mlp.fc1` holding `[gate; value]` where diffusers'
        holds `[value; gate]`; `transformer_blocks` -> `blocks`, `token_refiner.refiner_blocks` ->
        `token_refiner.blocks`; the final layer's modulation and heads under `final_layer`."""
        config = self.load_config(MiniMaxH3Transformer3DModel, "transformer")
        inner = int(config.get("num_attention_heads", 56)) * int(config.get("attention_head_dim", 128))
        blocks = []
        renamed = (("transformer_blocks", "blocks"), (r"token_refiner\.refiner_blocks", "token_refiner.blocks"))
        for source, target in renamed:
            block, comfy_block = rf"{source}\.(\d+)", rf"{target}.\1"
            blocks += [
                *[Rule(rf"{block}\.attn\.to_{x}", f"{comfy_block}.attn.qkv_proj", part, (inner,) * 3)
                  for part, x in enumerate("qkv")],
                Rule(rf"{block}\.attn\.to_out\.0", f"{comfy_block}.attn.out_proj"),
                Rule(rf"{block}\.ff\.net\.0\.proj", f"{comfy_block}.mlp.fc1", swap_halves=True),
                Rule(rf"{block}\.ff\.net\.2", f"{comfy_block}.mlp.fc2"),
                Rule(rf"{block}\.adaln_proj\.linear", f"{comfy_block}.adaln_proj.linear"),
            ]
        return [
            *blocks,
            Rule(r"proj_in", "video_patch_proj"),
            Rule(r"audio_proj_in", "audio_patch_proj"),
            Rule(r"context_embedder", "condition_proj"),
            Rule(r"time_embedder\.linear_1", "time_embedder.proj_in"),
            Rule(r"time_embedder\.linear_2", "time_embedder.proj_out"),
            Rule(r"norm_out\.linear", "final_layer.adaln_proj.linear"),
            Rule(r"proj_out", "final_layer.video_out"),
            Rule(r"audio_proj_out", "final_layer.audio_out"),
        ]

    def comfyui_model(self) -> ComfyUIModel:
        return minimax_h3(self.load_config(MiniMaxH3Transformer3DModel, "transformer"))

    # ----- pipeline and outputs -----------------------------------------------------------------------------
    def pipeline(self, text: TextComponents, vae: MiniMaxH3Autoencoders, denoiser: nn.Module) -> Any:
        """MiniMaxH3Pipeline with its blocks but the text encoder's (layout, noise, the two schedules, the denoising
        loop, both decoders, and the keyframe workflow's resize and keyframe encoder, which run only when a keyframe
        is passed); the caption reaches it encoded (`prompt_inputs`), as the text encoder block needs
        Qwen3VLProcessor's image half only for keyframes."""
        blocks = MiniMaxH3Blocks()
        blocks.sub_blocks.pop("text_encoder")
        pipeline = self.pipeline_class(blocks=blocks)
        pipeline.update_components(transformer=denoiser, vae=vae.vae, audio_vae=vae.audio_vae,
                                   scheduler=self.load_scheduler(), audio_scheduler=self.load_audio_scheduler())
        pipeline.caption_encoder = text
        return pipeline

    def prompt_inputs(self, pipeline: Any, prompt: str, guidance_scale: float) -> dict[str, Any]:
        conditions = self.prepare_conditions(pipeline.caption_encoder, [prompt])
        rows = int(conditions["prompt_attention_mask"][0].sum())
        return {"prompt_embeds": conditions["prompt_embeds"][:, :rows],
                "text_token_tags": torch.full((rows,), MINIMAX_H3_TEXT_TAG, dtype=torch.long)}

    def keyframe_prompt_inputs(self, text: TextComponents, prompt: str, keyframe: Image.Image | None, height: int,
                               width: int, last: Image.Image | None = None) -> dict[str, Any]:
        """The caption as the keyframe workflow presents it (`"<Picture i>: "` and the Qwen3-VL vision block of each
        keyframe, the first then the `last`, then the caption), encoded by the pipeline's own blocks: its resize step
        puts the keyframes on the canvas, its keyframe text encoder encodes the presentation and tags the vision rows
        as video."""
        encoder = SequentialPipelineBlocks.from_blocks_dict(
            {"resize": MiniMaxH3ResizeStep(), "text_encoder": MiniMaxH3FL2VATextEncoderStep()}).init_pipeline()
        text_encoder = text["text_encoder"]
        encoder.update_components(text_encoder=text_encoder, tokenizer=text["tokenizer"], processor=KeyframeTokenTypes(
            self.image_processor, text_encoder.config.image_token_id, text_encoder.config.video_token_id))
        state = encoder(prompt=prompt, image=keyframe, last_image=last, height=height, width=width,
                        output=["prompt_embeds", "text_token_tags"])
        return {"prompt_embeds": state["prompt_embeds"], "text_token_tags": state["text_token_tags"]}

    def call_pipeline(self, pipeline: Any, prompt: str, frames: int, height: int, width: int,
                      num_inference_steps: int, guidance_scale: float, generator: torch.Generator, output_type: str,
                      reference: torch.Tensor | None = None, callback: StepCallback | None = None,
                      given: Given | None = None) -> Any:
        """One call of the modular pipeline (which takes no guidance scale and no step callback: with `callback`, the
        callback gets the final latents once). An image-to-video spec hands its `reference` clip's first frame to
        the pipeline's keyframe workflow: in the caption's presentation and as the first frame's anchor (as does a spec
        trained in the keyframe workflow, `model.first_frame_conditioning`; a text-to-video one ignores it); `given`:
        a keyframe mode's first and / or last frame, handed over the same way."""
        if guidance_scale != 1.0:
            raise ConfigError(
                f"validation.guidance_scale={guidance_scale:g}: {self.name} is guidance-distilled; its pipeline takes "
                "no guidance scale.\nWhat to do: remove validation.guidance_scale (or set it to 1).")
        # The pipeline steps num_inference_steps - 1 times (its schedule holds the terminal sigma): one more point
        # gives the steps asked for.
        inputs = self.prompt_inputs(pipeline, prompt, guidance_scale)
        first = last = None
        if given is not None:  # a keyframe mode: its first and / or last frame
            ends = KEYFRAME_MODES[given.mode]
            first = frames_to_pil(given.frames[:1])[0] if "first" in ends else None
            last = frames_to_pil(given.last[-1:])[0] if "last" in ends else None
        elif self.samples_from_image and reference is not None:
            first = self.first_frame_image(reference)
        if first is not None or last is not None:
            inputs = {**self.keyframe_prompt_inputs(pipeline.caption_encoder, prompt, first, height, width, last),
                      "image": first, "last_image": last}
        result = pipeline(**inputs, num_frames=frames, height=height,
                          width=width, num_inference_steps=num_inference_steps + 1, generator=generator,
                          output_type="pt", output=["videos", "audio", "sampling_rate", "latents", "audio_latents"])
        if callback is not None:
            callback(pipeline, num_inference_steps - 1, None, {"latents": result["latents"]})
        return result

    def sampled_latents(self, pipeline: Any, result: Any, frames: int, height: int, width: int) -> GeneratedSample:
        """The video latents [1, C, F, H, W] and the audio latents [1, 2, L, C], normalised as training normalises
        them (the pipeline's own normalised latents, before its decoders)."""
        return GeneratedSample(latents=result["latents"].float(),
                               audio_latents=result["audio_latents"].float().transpose(1, 2)[None])

    def sampled_video(self, pipeline: Any, result: Any) -> GeneratedSample:
        """The frames and the stereo sound track the audio VAE decodes, at its rate, clamped to [-1, 1]."""
        frames = result["videos"][0]
        return GeneratedSample(frames.float() * 2.0 - 1.0, result["audio"][0].float().clamp(-1.0, 1.0),
                               int(result["sampling_rate"]))
