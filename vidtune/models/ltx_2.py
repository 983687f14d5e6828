"""LTX-2 (Lightricks): Gemma 3 text encoder and text connectors, video and audio VAEs, and a DiT that denoises video
and audio together (LTX2Pipeline).

Training is joint, as sampling is: the transformer always runs its audio stream beside the video one, and the two
see each other through audio-to-video and video-to-audio attention. A clip with an audio track trains both streams:
its window's sound (resampled to the audio VAE's rate and channels) becomes LTX-2's log-mel spectrogram, which the
audio VAE encodes; the audio latents are noised at a sigma of their own, drawn apart from the video's with the
audio's token count (`stream_noise`, as ltx-trainer's `flexible` strategy), and the loss is the video's
flow-matching error plus `model.audio_loss_weight` times the audio's. A clip without an audio track trains video
only, as ltx-trainer's video-only runs: the video stream does not attend to the audio stream (the transformer's
`isolate_modalities`) and the audio error is left out. Conventions taken from LTX2Pipeline and LTX-2's audio processing:
    text: the caption, stripped, left-padded to `max_sequence_length` tokens (1024, or the tokenizer's
        `model_max_length` when shorter), every hidden state of Gemma 3 stacked on the last dim, then the text
        connectors (frozen), which give the video and audio streams their embeddings and the mask;
    video latents: the VAE posterior normalised per channel with the VAE's `latents_mean` / `latents_std` and
        `scaling_factor`, packed into tokens like LTX-Video's;
    audio latents: [B, L, C * mel] (channels and latent mel bins on the last dim), normalised with the audio VAE's
        `latents_mean` / `latents_std`; L = round(frames / frame_rate * sample_rate / hop / 4); the log-mel
        spectrogram of the sound: STFT magnitude (Hann window of 1024, hop `mel_hop_length`, centred), Slaney mel
        filterbank of `mel_bins` over 0 Hz to Nyquist, log(max(mel, 1e-5)); its first 4 L frames (silence where the
        sound is shorter), which the causal audio VAE encodes into L latent frames;
    rotary positions: the transformer's own, from the latent grids and the frame rate (`fps`, per sample);
    frame_rate: each clip's own (`ModelSpec.clip_frame_rate`), for its positions and its sound's length L, as the
        official trainer cuts a clip's sound to its frames / fps;
    first-frame conditioning (`model.first_frame_conditioning`): see vidtune/models/first_frame.py;
    conditioning modes (`model.conditioning`: extension, last frame, first and last, inpainting), as
        LTX2ConditionPipeline gives them: a latent-index-0 condition (the first frame, a clip to extend) in place, its
        tokens at timestep 0; a condition at a later latent index (the last frame, index -1) encoded alone and appended
        after the video's tokens as a keyframe, clean, at the rotary time of that latent frame's first pixel frame
        ((index - 1) x temporal ratio + 1, one frame long); inpainting keeps a region in place the same way
        (`LTX2RegionConditionPipeline`). The given latents stay out of the loss (vidtune/models/given_modes.py).
"""

from __future__ import annotations

import contextlib
import functools
import math
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from diffusers import (
    AutoencoderKLLTX2Audio,
    AutoencoderKLLTX2Video,
    FlowMatchEulerDiscreteScheduler,
    LTX2ConditionPipeline,
    LTX2ImageToVideoPipeline,
    LTX2InContextPipeline,
    LTX2Pipeline,
    LTX2VideoTransformer3DModel,
)
from diffusers.models.autoencoders.autoencoder_kl_ltx2_audio import (
    LATENT_DOWNSAMPLE_FACTOR as AUDIO_LATENT_DOWNSAMPLING,
)
from diffusers.pipelines.ltx2 import LTX2ReferenceCondition, LTX2TextConnectors
from diffusers.pipelines.ltx2.pipeline_ltx2_condition import LTX2VideoCondition, retrieve_latents
from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder, LTX2VocoderWithBWE
from diffusers.utils.torch_utils import randn_tensor
from torch import nn
from transformers import AutoTokenizer, Gemma3ForConditionalGeneration, Gemma4UnifiedForConditionalGeneration

from vidtune.algorithms import traits_of
from vidtune.config import Config
from vidtune.data.audio import AudioBatch, AudioFormat, log_mel_spectrogram
from vidtune.data.sources import Clip
from vidtune.errors import ConfigError, ModelError
from vidtune.export.comfyui import Rule
from vidtune.export.comfyui_models import ComfyUIModel, ltxav
from vidtune.export.comfyui_workflow import ModelFiles, WorkflowLayout, ltx2_parts
from vidtune.models import conditioning, first_frame, in_context, key_mask
from vidtune.models.conditioning import Given
from vidtune.models.defaults import LTX_2
from vidtune.models.given_modes import InPlaceModes
from vidtune.models.ltx_video import vae_downsampling_steps
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
    TextComponents,
    VAEWithExtras,
    frame_count_problem,
    frames_to_pil,
    raise_shape_problems,
    shape_rule,
    side_problems,
)
from vidtune.objectives import NUM_TRAIN_TIMESTEPS, Objective, flow_matching_noisy, flow_matching_target

DEFAULT_MAX_SEQUENCE_LENGTH = 1024  # LTX2Pipeline's default
# LTX2Pipeline's arguments that turn off its other guidances (spatio-temporal, modality, rescale, the audio's).
UNGUIDED = {"stg_scale": 0.0, "modality_scale": 1.0, "guidance_rescale": 0.0, "audio_guidance_scale": 1.0,
            "audio_stg_scale": 0.0, "audio_modality_scale": 1.0, "audio_guidance_rescale": 0.0}
# diffusers' names of the audio-video cross-attention modulations -> the original checkpoint's (`av_ca_*_adaln_single`).
ORIGINAL_MODULATIONS = {"video_scale_shift": "video_scale_shift", "video_a2v_gate": "a2v_gate",
                        "audio_scale_shift": "audio_scale_shift", "audio_v2a_gate": "v2a_gate"}
# In-context training's keys: each sample's reference latents [B, C, F, H', W'] (placed beside the noisy tokens), and
# [B] set where every sample trains its video cut off from the audio stream (`control.with_audio: false`).
REFERENCE_LATENTS = "reference_latents"
VIDEO_ONLY = "video_only"
# The key of the last frame encoded alone [B, C, 1, h, w] (a run with a last-frame mode): LTX2ConditionPipeline encodes
# an image condition by itself.
LAST_FRAME = "last_frame_latents"
# LTX-2's audio processing (its audio encoder's settings; diffusers' audio VAE config does not hold them): the STFT
# window, and the log-mel floor (log(clamp(mel, 1e-5))): silence is this value in every bin.
N_FFT = 1024
MEL_FLOOR = 1e-5
SILENT_LOG_MEL = math.log(MEL_FLOOR)
# The classes LTX2Pipeline accepts, and loads as model_index.json names them: LTX-2's vocoder (24 kHz) or the vocoder
# with bandwidth extension of LTX-2.3 (48 kHz); Gemma 3, or Gemma 4 (its text encoding is the same).
VOCODERS = (LTX2Vocoder, LTX2VocoderWithBWE)
TEXT_ENCODERS = (Gemma3ForConditionalGeneration, Gemma4UnifiedForConditionalGeneration)


class LTX2Autoencoders(VAEWithExtras):
    """What `LTX2Spec.load_vae` returns: the video VAE (which training encodes with) and the audio VAE and vocoder
    the pipeline needs to render a sample's sound. Opaque to trainers."""

    def __init__(self, vae: nn.Module, audio_vae: nn.Module, vocoder: nn.Module) -> None:
        super().__init__(vae)
        self.audio_vae = audio_vae
        self.vocoder = vocoder


def encode_log_mel(audio_vae: nn.Module, log_mel: torch.Tensor) -> torch.Tensor:
    """Log-mel spectrograms [B, channels, T, mel bins] -> the audio VAE's posterior means packed [B, L, C * mel] and
    normalised as LTX2Pipeline normalises audio latents (the mean: the audio posterior is narrow)."""
    latents = audio_vae.encode(log_mel).latent_dist.mean
    packed = LTX2Pipeline._pack_audio_latents(latents)
    if packed.shape[-1] != audio_vae.latents_mean.numel():
        raise ModelError(
            f"The audio VAE gives latents of {latents.shape[1]} channels x {latents.shape[-1]} mel bins, but its "
            f"latents_mean holds {audio_vae.latents_mean.numel()} values.\nWhat to do: use an audio_vae whose "
            "base_channels equals latent_channels x mel_bins / 4 (as LTX-2's checkpoints do)."
        )
    return LTX2Pipeline._normalize_audio_latents(packed.float(), audio_vae.latents_mean.float(),
                                                 audio_vae.latents_std.float())


class CrossModalGate:
    """Per-sample gating of LTX-2's audio-to-video and video-to-audio attentions: inside `closed_for(rows)` the
    outputs of both are zero for `rows`, which thus train as an isolated call (`isolate_modalities`) trains them.
    The hooks stay on the denoiser and read the current rows, so a compiled block sees one hook throughout."""

    NAMES = ("audio_to_video_attn", "video_to_audio_attn")

    def __init__(self) -> None:
        self.keep: torch.Tensor | None = None  # [B, 1, 1]: 1.0 where the attentions' outputs count
        self.gated = 0  # outputs gated inside the current `closed_for`

    def attach(self, denoiser: nn.Module) -> None:
        for name, module in denoiser.named_modules():
            if name.rsplit(".", 1)[-1] in self.NAMES:
                module.register_forward_hook(self._gate)

    def _gate(self, module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor | None:
        if self.keep is None:
            return None
        self.gated += 1
        return output * self.keep.to(device=output.device, dtype=output.dtype)

    @contextlib.contextmanager
    def closed_for(self, rows: torch.Tensor) -> Iterator[None]:
        self.keep, self.gated = (~rows).float().view(-1, 1, 1), 0
        try:
            yield
        finally:
            self.keep = None
        if not self.gated:  # a denoiser not loaded by this spec: the clips without sound would hear the others
            raise RuntimeError("LTX-2's cross-modal gate is not on this denoiser (load it with the spec's "
                               "load_denoiser)")


def keyframe_coords(denoiser: nn.Module, batch: int, height: int, width: int, pixel_frame: int, fps: Any,
                    spatial: int) -> torch.Tensor:
    """[B, 3, tokens, 2] rotary coordinates of a one-frame keyframe of `height` x `width` latents placed at
    `pixel_frame`, as LTX2ConditionPipeline places an image at a latent index above 0: in pixels, each patch's start
    and end, the time axis one frame long, [k, k + 1), in seconds (divided by `fps`: a float, or [B, 1, 1] per
    sample), the rows and columns times the VAE's spatial ratio, with no causal shift."""
    config = denoiser.config
    patch = config.patch_size
    device = denoiser.device
    rows = torch.arange(0, height, patch, dtype=torch.float32, device=device)
    columns = torch.arange(0, width, patch, dtype=torch.float32, device=device)
    row, column = (grid.flatten() for grid in torch.meshgrid(rows, columns, indexing="ij"))
    time = torch.tensor([pixel_frame, pixel_frame + 1], dtype=torch.float32, device=device)
    time = (time.view(1, 1, 2) / fps).expand(batch, row.numel(), 2)
    rows = torch.stack([row, row + patch], dim=-1) * spatial
    columns = torch.stack([column, column + patch], dim=-1) * spatial
    return torch.stack([time, rows.expand(batch, -1, -1), columns.expand(batch, -1, -1)], dim=1)


class LTX2RegionConditionPipeline(LTX2ConditionPipeline):
    """LTX2ConditionPipeline given a region of a clip to keep (inpainting / outpainting): `given_region` ([1, 1, F, H,
    W] on the latent grid, 1.0 kept) with the clip as its one condition, at latent index 0. The kept latents (the
    clip encoded as the pipeline encodes a condition) start clean, and the pipeline's own per-token conditioning mask
    (1 on the kept tokens) runs them at timestep 0 and keeps them through the steps; everything else is the
    pipeline's."""

    def __call__(self, *args: Any, given_region: torch.Tensor | None = None, **kwargs: Any) -> Any:
        self._given_region = given_region
        try:
            return super().__call__(*args, **kwargs)
        finally:
            self._given_region = None

    def prepare_latents(self, conditions: Any = None, batch_size: int = 1, num_channels_latents: int = 128,
                        height: int = 512, width: int = 768, num_frames: int = 121, frame_rate: float = 24.0,
                        noise_scale: float = 1.0, dtype: torch.dtype | None = None,
                        device: torch.device | None = None, generator: torch.Generator | None = None,
                        latents: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, None]:
        region = getattr(self, "_given_region", None)
        if region is None:
            return super().prepare_latents(conditions, batch_size, num_channels_latents, height, width, num_frames,
                                           frame_rate, noise_scale, dtype, device, generator, latents)
        conditions = [conditions] if isinstance(conditions, LTX2VideoCondition) else list(conditions or [])
        if len(conditions) != 1 or conditions[0].index != 0 or latents is not None:
            raise ValueError("a given region takes the clip it keeps as the one condition, at index 0")
        (pixels,), _, _, _ = self.preprocess_conditions(conditions, height, width, num_frames, device=device)
        clean = retrieve_latents(self.vae.encode(pixels), generator=generator, sample_mode="argmax")
        clean = self._normalize_latents(clean, self.vae.latents_mean, self.vae.latents_std).to(device, dtype=dtype)
        patch, patch_t = self.transformer_spatial_patch_size, self.transformer_temporal_patch_size
        clean = self._pack_latents(clean, patch, patch_t).expand(batch_size, -1, -1)
        mask = self._pack_latents(region.to(device, dtype=dtype).expand(batch_size, -1, -1, -1, -1), patch,
                                  patch_t).amin(dim=-1, keepdim=True)
        noise = randn_tensor(clean.shape, generator=generator, device=device, dtype=dtype)
        scaled = (1.0 - mask) * noise_scale  # as the pipeline noises a condition of strength `mask`
        return noise * scaled + clean * (1.0 - scaled), mask, clean * mask, None


class LTX2Spec(InPlaceModes, ModelSpec):
    name = "ltx-2"
    conditioning_refusal = ("ltx-2 samples from text, or in a mode with LTX2ConditionPipeline; ltx-2-i2v (the same "
                            "checkpoints) samples from a first frame with LTX2ImageToVideoPipeline.")
    # Each as LTX2ConditionPipeline samples it (see the module): extension and inpainting in place, the last frame as
    # a keyframe's extra tokens.
    conditioning_modes = ("extension", "last_frame", "first_last", "inpaint")
    modes_pipeline = "LTX2ConditionPipeline"
    control_input_layer = "proj_in"  # the video stream's Linear over packed patches [B, F*H*W, C*pt*p*p]
    validation_guidance_scale = 3.0  # LTX2Pipeline's default
    frame_rate_conditioned = True
    # ltx-trainer's text-to-video strategy: `first_frame_conditioning_p` defaults to 0.1 (text_to_video.py).
    first_frame_conditioning = 0.1
    defaults = LTX_2
    text_encoder_class = Gemma3ForConditionalGeneration
    vae_class = AutoencoderKLLTX2Video
    denoiser_class = LTX2VideoTransformer3DModel
    loads_single_file = True  # Lightricks' ltx-2-*.safetensors (the whole model: only its transformer is read)
    scheduler_class = FlowMatchEulerDiscreteScheduler
    pipeline_class = LTX2Pipeline
    in_context_pipeline_class = LTX2InContextPipeline  # in-context-lora samples with it

    @classmethod
    def context_parallel_plan(cls) -> dict[str, Any] | str:
        """Both streams split, not only the video as diffusers' plan does (the audio would run whole on every rank,
        its gradient counted once per rank, and its queries would see one rank's video only): the video and audio
        tokens, each stream's caption and mask, first-frame conditioning's per-token timesteps, the four rotary
        tables (self-attention and audio-video cross-attention, per stream: the token axis is the second last in
        both of diffusers' layouts, [B, T, D] interleaved and [B, H, T, D / 2] split), and both predictions
        gathered. Every attention then has both sides split; cross-attention between the streams (keys of another
        length than the queries) gathers its keys whole (vidtune/parallel/context_attention.py)."""
        from diffusers.models._modeling_parallel import ContextParallelInput, ContextParallelOutput

        tokens = ContextParallelInput(split_dim=1, expected_dims=3)
        rotary = ContextParallelInput(split_dim=-2, split_output=True)
        return {
            "": {"hidden_states": tokens, "audio_hidden_states": tokens,
                 "encoder_hidden_states": tokens, "audio_encoder_hidden_states": tokens,
                 "encoder_attention_mask": ContextParallelInput(split_dim=1, expected_dims=2),
                 "audio_encoder_attention_mask": ContextParallelInput(split_dim=1, expected_dims=2),
                 # [B, tokens] with a first frame given; a [B] timestep stays whole.
                 "timestep": ContextParallelInput(split_dim=1, expected_dims=2),
                 "audio_timestep": ContextParallelInput(split_dim=1, expected_dims=2)},
            **{rope: {0: rotary, 1: rotary}
               for rope in ("rope", "audio_rope", "cross_attn_rope", "cross_attn_audio_rope")},
            "proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
            "audio_proj_out": ContextParallelOutput(gather_dim=1, expected_dims=3),
        }

    def context_token_counts(self, frames: int, height: int, width: int, frame_rate: float | None
                             ) -> dict[str, int]:
        spatial, temporal, patch, patch_t = self.compression
        latent_frames = (frames - 1) // temporal + 1
        video = latent_frames // patch_t * (height // (spatial * patch)) * (width // (spatial * patch))
        return {"video tokens": video, "audio latent frames": self.audio_latent_length(frames, frame_rate),
                "caption tokens (model.max_sequence_length)": self.max_sequence_length}

    def native_max_sequence_length(self) -> int:
        """LTX2Pipeline's 1024 tokens, or fewer where the tokenizer holds fewer."""
        tokenizer = self.load_component(AutoTokenizer, "tokenizer")
        return min(DEFAULT_MAX_SEQUENCE_LENGTH, int(tokenizer.model_max_length))

    def load_denoiser(self, device: torch.device, load_on: torch.device | None = None) -> nn.Module:
        """A clip without sound trains with the audio stream cut off (`model.clips_without_sound: video-only`), which
        leaves the audio-video cross-attention out of that step: DDP is told to look for such parameters
        (vidtune/parallel/ddp.py), as a rank's micro-batch may be all silent while another's is not."""
        denoiser = super().load_denoiser(device, load_on)
        denoiser.leaves_parameters_unused = self.config.clips_without_sound == "video-only"
        if denoiser.leaves_parameters_unused:
            self.cross_modal_gate.attach(denoiser)
        if self.takes_last_frame:  # a batch may mix samples with and without the last frame's keyframe tokens
            self.key_mask.attach(denoiser)
        return denoiser

    @functools.cached_property
    def key_mask(self) -> key_mask.KeyMask:
        return key_mask.KeyMask("attn1", "video_to_audio_attn")

    @functools.cached_property
    def cross_modal_gate(self) -> CrossModalGate:
        return CrossModalGate()

    @property
    def audio_loss_weight(self) -> float:
        return self.config.audio_loss_weight

    def latent_identity(self) -> dict[str, Any]:
        # The audio track's length follows the frame rate the clip is told about; its latents come from the clip's
        # own sound through the log-mel settings below (earlier caches held silence for every clip: other keys).
        identity = {**super().latent_identity(), "frame_rate": self.frame_rate,
                    "audio": {"source": "clip", "n_fft": N_FFT, "mel_floor": MEL_FLOOR}}
        if self.takes_last_frame:
            identity["last_frame"] = "encoded alone"
        return identity

    def audio_format(self) -> AudioFormat:
        """The audio VAE's sample rate and channels (LTX-2's: 16 kHz stereo), at the frame rate the clip is told."""
        return self._audio_format

    @functools.cached_property
    def _audio_format(self) -> AudioFormat:
        # Read once: the data path asks for every batch.
        audio = self.load_config(AutoencoderKLLTX2Audio, "audio_vae")
        channels = int(audio.get("in_channels", 2))
        if channels not in (1, 2):
            raise ModelError(
                f"{self.describe_file('audio_vae', 'config.json')} says in_channels={channels}; vidtune reads a clip's "
                "sound as mono (1) or stereo (2).\nWhat to do: use an LTX-2 audio VAE of 1 or 2 input channels (the "
                "released ones take 2)."
            )
        return AudioFormat(int(audio["sample_rate"]), channels, self.frame_rate)

    def required_components(self) -> tuple[str, ...]:
        return (*super().required_components(), "connectors", "audio_vae", "vocoder")

    def check_source(self) -> None:
        """Also: the text encoder and vocoder are of classes LTX2Pipeline accepts (before anything loads)."""
        super().check_source()
        self.component_class("text_encoder", TEXT_ENCODERS)
        self.component_class("vocoder", VOCODERS)

    # ----- shape rules, read from the configs -------------------------------------------------------------------
    @functools.cached_property
    def compression(self) -> tuple[int, int, int, int]:
        """(VAE spatial ratio, VAE temporal ratio, transformer patch size, transformer temporal patch)."""
        vae = self.load_config(AutoencoderKLLTX2Video, "vae")
        spatial_steps, temporal_steps = vae_downsampling_steps(vae)
        spatial = vae.get("spatial_compression_ratio") or vae["patch_size"] * 2**spatial_steps
        temporal = vae.get("temporal_compression_ratio") or vae["patch_size_t"] * 2**temporal_steps
        transformer = self.load_config(LTX2VideoTransformer3DModel, "transformer")
        return spatial, temporal, transformer.get("patch_size", 1), transformer.get("patch_size_t", 1)

    @functools.cached_property
    def audio_latents_per_second(self) -> float:
        """Audio latent frames per second of video, as LTX2Pipeline computes them from the audio VAE's config."""
        audio = self.load_config(AutoencoderKLLTX2Audio, "audio_vae")
        return audio["sample_rate"] / audio["mel_hop_length"] / float(AUDIO_LATENT_DOWNSAMPLING)

    def audio_latent_length(self, frames: int, frame_rate: float | None = None) -> int:
        """Audio latent frames of a clip of `frames` frames at `frame_rate` (default: `frame_rate`), as LTX2Pipeline
        computes them."""
        return round(frames / (frame_rate or self.frame_rate) * self.audio_latents_per_second)

    def check_video_shape(self, frames: int, height: int, width: int) -> None:
        vae_spatial, temporal, patch, patch_t = self.compression
        raise_shape_problems("LTX-2", [
            frame_count_problem(frames, temporal, patch_t), *side_problems(height, width, vae_spatial * patch)
        ], self, shape_rule(temporal, patch_t, vae_spatial * patch))
        problems = self.extension_problems(frames) if self.modes_on else []
        if problems:
            raise ConfigError("The conditioning modes do not fit:\n" + "\n".join(f"  - {p}" for p in problems)
                              + "\nWhat to do: fix model.conditioning as said above.")

    def check_frame_settings(self, config: Config, clips: list[Clip]) -> None:
        """Also, before anything loads: the modes sample through LTX2ConditionPipeline, which takes no reference clip
        (an in-context run samples through LTX2InContextPipeline); and a last frame's keyframe tokens lengthen some
        samples' sequences, which a context-parallel split of equal parts cannot follow."""
        super().check_frame_settings(config, clips)
        enabled = config.model.conditioning.enabled
        if enabled and traits_of(config).in_context:
            raise ConfigError(
                f"model.conditioning ({', '.join(enabled)}) with training.algorithm={config.training.algorithm}: "
                "an in-context LoRA samples through LTX2InContextPipeline, which takes a reference clip and no "
                "conditioning mode.\nWhat to do: remove model.conditioning (model.first_frame_conditioning gives a "
                "share of the samples their first frame beside the reference), or train the modes in a run of "
                "their own.")
        if self.takes_last_frame and config.parallel.context.degree > 1:
            raise ConfigError(
                "model.conditioning.last_frame / first_last with parallel.context: the last frame's keyframe tokens "
                "make some samples' sequences longer than others, which context parallelism cannot split into equal "
                "parts.\nWhat to do: remove parallel.context, or train the last-frame modes without it.")

    # ----- loading ------------------------------------------------------------------------------------------
    def load_text_components(self, device: torch.device) -> TextComponents:
        """Gemma 3 and its tokenizer, and the text connectors that turn its hidden states into the transformer's
        video and audio text embeddings (frozen: LoRA and full fine-tuning train the transformer)."""
        tokenizer = self.load_component(AutoTokenizer, "tokenizer")
        dtype = self.component_dtype("text_encoder", device)
        text_encoder_class = self.component_class("text_encoder", TEXT_ENCODERS)
        text_encoder = self.load_component(text_encoder_class, "text_encoder", torch_dtype=dtype)
        connectors = self.load_component(LTX2TextConnectors, "connectors", torch_dtype=dtype)
        for module in (text_encoder, connectors):
            module.requires_grad_(False).eval().to(device)
        return TextComponents({"tokenizer": tokenizer, "text_encoder": text_encoder, "connectors": connectors})

    def load_vae(self, device: torch.device) -> LTX2Autoencoders:
        vae = super().load_vae(device)
        dtype = self.component_dtype("vae", device)
        audio_vae = self.load_component(AutoencoderKLLTX2Audio, "audio_vae", torch_dtype=dtype)
        vocoder = self.load_component(self.component_class("vocoder", VOCODERS), "vocoder", torch_dtype=dtype)
        return LTX2Autoencoders(vae, audio_vae.requires_grad_(False).eval().to(device),
                                vocoder.requires_grad_(False).eval().to(device))

    # ----- tensors ------------------------------------------------------------------------------------------
    @torch.no_grad()
    def prepare_conditions(self, text: TextComponents, captions: list[str]) -> Conditions:
        """The connectors' video and audio embeddings and mask, as LTX2Pipeline computes them."""
        tokenizer, text_encoder, connectors = text["tokenizer"], text["text_encoder"], text["connectors"]
        tokenizer.padding_side = "left"  # Gemma takes chat-style prompts left-padded
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        tokens = tokenizer([caption.strip() for caption in captions], padding="max_length",
                           max_length=self.max_sequence_length, truncation=True, add_special_tokens=True,
                           return_tensors="pt")
        device = text_encoder.device
        mask = tokens.attention_mask.to(device)
        hidden = text_encoder(input_ids=tokens.input_ids.to(device), attention_mask=mask,
                              output_hidden_states=True).hidden_states
        embeds = torch.stack(hidden, dim=-1).flatten(2, 3).to(text_encoder.dtype)
        video, audio, connector_mask = connectors(embeds, mask, padding_side="left")
        return {"prompt_embeds": video, "audio_prompt_embeds": audio, "prompt_attention_mask": connector_mask}

    @torch.no_grad()
    def prepare_latents(self, vae: LTX2Autoencoders, videos: torch.Tensor, audio: AudioBatch | None = None) -> Latents:
        """The video posterior, the clip's audio latents and whether it has sound (`AUDIO_PRESENT`). `audio`: each
        window's sound (`audio_format`) and the rate its frames play at, which sets the sound's length; without it, or
        for a clip without a track, the latents of silence of the clip's duration, marked absent."""
        video_vae = vae.vae
        posterior = self.vae_posterior(video_vae, videos)
        mean_shift = video_vae.latents_mean.view(1, -1, 1, 1, 1).to(posterior.mean)
        scale = (video_vae.config.scaling_factor / video_vae.latents_std).view(1, -1, 1, 1, 1).to(posterior.mean)
        batch, frames = videos.shape[:2]
        rate = audio.frame_rate if audio is not None else None
        audio_latents = self.silent_audio_latents(vae.audio_vae, frames, rate).expand(batch, -1, -1).clone()
        present = torch.zeros(batch, 1, dtype=torch.bool)  # a flag: read as one by the planner and its measurement
        if audio is not None and bool(audio.present.any()):
            heard = audio.present.nonzero().flatten().tolist()  # silence is encoded once per length, not per clip
            audio_latents[heard] = self.sound_latents(vae.audio_vae, audio.waveforms[heard], frames, rate)
            present[heard] = True
        latents = {**self.normalised_posterior(posterior, scale, mean_shift), AUDIO_LATENTS: audio_latents,
                   AUDIO_PRESENT: present.to(audio_latents.device)}
        if self.takes_last_frame:  # the last frame as LTX2ConditionPipeline encodes an image condition: alone
            last = self.vae_posterior(video_vae, videos[:, -1:])
            latents[LAST_FRAME] = self.normalised_posterior(last, scale, mean_shift)["latents_mean"]
        return latents

    def log_mel(self, audio_vae: nn.Module, waveforms: torch.Tensor, frames: int,
                frame_rate: float | None = None) -> torch.Tensor:
        """[B, channels, samples] at the audio VAE's rate -> LTX-2's log-mel spectrogram [B, channels, 4 L, mel bins]
        of a clip of `frames` frames: the frames the causal audio VAE encodes into the clip's L latent frames
        (trimmed, or padded with silence where the sound is shorter)."""
        config = audio_vae.config
        log_mel = log_mel_spectrogram(waveforms, config.sample_rate, N_FFT, config.mel_hop_length, config.mel_bins,
                                      floor=MEL_FLOOR)
        wanted = AUDIO_LATENT_DOWNSAMPLING * self.audio_latent_length(frames, frame_rate)
        missing = wanted - log_mel.shape[2]
        if missing > 0:
            log_mel = torch.nn.functional.pad(log_mel, (0, 0, 0, missing), value=SILENT_LOG_MEL)
        return log_mel[:, :, :wanted]

    def sound_latents(self, audio_vae: nn.Module, waveforms: torch.Tensor, frames: int,
                      frame_rate: float | None = None) -> torch.Tensor:
        """[B, L, C * mel]: the audio VAE's normalised latents of each clip's sound."""
        log_mel = self.log_mel(audio_vae, waveforms.to(audio_vae.device), frames, frame_rate)
        return encode_log_mel(audio_vae, log_mel.to(audio_vae.dtype))

    def silent_audio_latents(self, audio_vae: nn.Module, frames: int, frame_rate: float | None = None) -> torch.Tensor:
        """[1, L, C * mel]: the audio VAE's normalised latents of silence lasting `frames` frames at `frame_rate` (once
        per length: every clip of a shape and rate shares them)."""
        by_length = self._silence.setdefault(audio_vae, {})
        length = self.audio_latent_length(frames, frame_rate)
        if length not in by_length:
            by_length[length] = encode_log_mel(audio_vae, self.silent_log_mel(audio_vae, frames, frame_rate))
        return by_length[length]

    def silent_log_mel(self, audio_vae: nn.Module, frames: int, frame_rate: float | None = None) -> torch.Tensor:
        """[1, channels, 4 L, mel bins] of silence: what `log_mel` gives for a silent clip of `frames` frames."""
        config = audio_vae.config
        mel_frames = AUDIO_LATENT_DOWNSAMPLING * self.audio_latent_length(frames, frame_rate)
        return torch.full((1, config.in_channels, mel_frames, config.mel_bins), SILENT_LOG_MEL,
                          device=audio_vae.device, dtype=audio_vae.dtype)

    @functools.cached_property
    def _silence(self) -> weakref.WeakKeyDictionary[nn.Module, dict[int, torch.Tensor]]:
        # Per audio VAE object (a reloaded VAE gets its own entries), per audio latent length.
        return weakref.WeakKeyDictionary()

    def audio_noise(self, timesteps: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        """Noise for each clip's audio latents, keyed by the clip's timestep (vidtune/models/sound.py)."""
        return keyed_noise(timesteps, like)

    def stream_noise(self, objective: Objective, latents: Conditions,
                     generators: list[torch.Generator]) -> tuple[Conditions, dict[str, torch.Tensor]]:
        """Each clip's audio sigma, drawn from the training distribution with the audio's own token count (its
        latent frames), and its audio noise, both from the clip's generator (ltx-trainer's `flexible` strategy
        draws the audio's sigma apart from the video's). A clip without sound logs no audio sigma (NaN)."""
        return draw_audio_noise(objective, latents, generators, latents[AUDIO_LATENTS].shape[1])

    heard = staticmethod(heard)

    def joint_forward(self, denoiser: nn.Module, conditions: Conditions, noisy_latents: torch.Tensor,
                      timesteps: torch.Tensor, isolated: bool = False
                      ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One call of the transformer on both streams: (video prediction [B, C, F, H, W], audio prediction
        [B, L, C * mel], audio target). The audio is noised at the conditions' `AUDIO_SIGMAS` with their
        `AUDIO_NOISE` (training); without them at the video's sigma (timestep / 1000) with noise keyed by the
        timestep, as LTX2Pipeline steps both streams with one schedule. `isolated`: neither stream attends to the
        other (a clip without sound trains the video alone)."""
        patch, patch_t = denoiser.config.patch_size, denoiser.config.patch_size_t
        batch, _, frames, height, width = noisy_latents.shape
        clean_audio = conditions[AUDIO_LATENTS].float()
        if AUDIO_SIGMAS in conditions:
            audio_sigmas = conditions[AUDIO_SIGMAS].detach().float().cpu()
            audio_noise = conditions[AUDIO_NOISE].to(clean_audio)
        else:
            audio_sigmas = timesteps.detach().float().cpu() / NUM_TRAIN_TIMESTEPS
            audio_noise = self.audio_noise(timesteps, clean_audio)
        noisy_audio = flow_matching_noisy(clean_audio, audio_noise, audio_sigmas)
        timesteps = timesteps.to(noisy_latents.device)
        audio_timesteps = (audio_sigmas * NUM_TRAIN_TIMESTEPS).to(timesteps)
        mask = conditions["prompt_attention_mask"]
        rates = self.frame_rates(conditions, batch)
        # One rate: a float, as the pipelines pass it; several: [B, 1, 1], dividing each sample's time coordinates.
        fps = float(rates[0]) if bool((rates == rates[0]).all()) \
            else rates.float().to(noisy_latents.device).view(-1, 1, 1)
        if conditioning.MODE in conditions:  # a drawn mode's given latents, as LTX2ConditionPipeline gives them
            tokens, video_timesteps, placed, target_tokens = self.place_given(denoiser, conditions, noisy_latents,
                                                                              timesteps, fps)
        else:
            noisy_latents, given = first_frame.give(noisy_latents, conditions)
            tokens = LTX2Pipeline._pack_latents(noisy_latents, patch, patch_t)
            # Timestep 0 on a given first frame's tokens (as LTX2ImageToVideoPipeline's `timestep * (1 - mask)`);
            # the audio keeps the clip's.
            video_timesteps = first_frame.token_timesteps(timesteps, given, (height // patch) * (width // patch),
                                                          tokens.shape[1]) if bool(given.any()) else timesteps
            target_tokens, placed = tokens.shape[1], {}
        if REFERENCE_LATENTS in conditions:  # in-context: the reference's clean tokens after the video's
            tokens, video_timesteps, placed = in_context.append_reference(
                denoiser, tokens, video_timesteps, conditions[REFERENCE_LATENTS].to(tokens), (frames, height, width),
                fps)
        video_prediction, audio_prediction = denoiser(
            hidden_states=tokens,
            audio_hidden_states=noisy_audio.to(noisy_latents.dtype),
            encoder_hidden_states=conditions["prompt_embeds"],
            audio_encoder_hidden_states=conditions["audio_prompt_embeds"],
            timestep=video_timesteps,
            audio_timestep=audio_timesteps,
            sigma=timesteps,
            audio_sigma=audio_timesteps,
            encoder_attention_mask=mask,
            audio_encoder_attention_mask=mask,
            num_frames=frames // patch_t,
            height=height // patch,
            width=width // patch,
            fps=fps,
            audio_num_frames=clean_audio.shape[1],
            isolate_modalities=isolated,
            use_cross_timestep=True,  # LTX2Pipeline's default
            return_dict=False,
            **placed,
        )
        if "attention_kwargs" in placed and not self.key_mask.used:  # the padding would be attended to
            raise RuntimeError("ltx-2's key mask is not on this denoiser (load it with the spec's load_denoiser)")
        video_prediction = LTX2Pipeline._unpack_latents(video_prediction[:, :target_tokens], frames // patch_t,
                                                        height // patch, width // patch, patch, patch_t)
        return video_prediction, audio_prediction, flow_matching_target(clean_audio, audio_noise)

    def place_given(self, denoiser: nn.Module, conditions: Conditions, noisy_latents: torch.Tensor,
                    timesteps: torch.Tensor, fps: Any) -> tuple[torch.Tensor, torch.Tensor, dict[str, Any], int]:
        """(tokens, per-token timesteps, the denoiser's `video_coords` where keyframe tokens are appended, the video's
        token count) of a batch of drawn modes in one token layout: each sample's given region clean in place at
        timestep 0 (LTX2ConditionPipeline's `t * (1 - conditioning_mask)`), and, where the batch's samples are given
        their last frame, its latents encoded alone appended as a keyframe at the last latent frame (index -1)."""
        patch, patch_t = denoiser.config.patch_size, denoiser.config.patch_size_t
        batch, _, frames, height, width = noisy_latents.shape
        given = self.given_region(conditions, noisy_latents.shape)
        clean = conditions[conditioning.LATENTS].to(noisy_latents)
        tokens = LTX2Pipeline._pack_latents(conditioning.give(noisy_latents, clean, given), patch, patch_t)
        token_mask = LTX2Pipeline._pack_latents(given.to(tokens), patch, patch_t).amin(dim=-1)
        if timesteps.ndim == 0:
            timesteps = timesteps.expand(batch)
        video_timesteps = timesteps.to(token_mask)[:, None] * (1.0 - token_mask)
        video_tokens = tokens.shape[1]
        last = conditioning.is_mode(conditions[conditioning.MODE], conditioning.LAST_FRAME_MODES)
        if not bool(last.any()):
            return tokens, video_timesteps, {}, video_tokens
        keyframe = LTX2Pipeline._pack_latents(conditions[LAST_FRAME].to(tokens), patch, patch_t)
        pixel_frame = (frames - 2) * self.compression[1] + 1  # the pipeline's (latent index - 1) x ratio + 1
        video_coords = denoiser.rope.prepare_video_coords(batch, frames // patch_t, height // patch, width // patch,
                                                          tokens.device, fps=fps)
        coords = keyframe_coords(denoiser, batch, height, width, pixel_frame, fps, self.compression[0])
        placed: dict[str, Any] = {"video_coords": torch.cat([video_coords, coords.to(video_coords)], dim=2)}
        if not bool(last.all()):
            # Both layouts in one call: the keyframe's tokens of the samples not given it are padding, out of the
            # keys of their video self-attention and of the audio's attention to the video.
            keep = torch.cat([torch.ones(tokens.shape[:2], dtype=torch.bool, device=tokens.device),
                              last.to(tokens.device)[:, None].expand(-1, keyframe.shape[1])], dim=1)
            placed.update(key_mask.padded_call(keep))
        return (torch.cat([tokens, keyframe], dim=1), torch.cat([video_timesteps, video_timesteps.new_zeros(
            batch, keyframe.shape[1])], dim=1), placed, video_tokens)

    def predict(self, denoiser: nn.Module, conditions: Conditions, noisy_latents: torch.Tensor,
                timesteps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """`joint_forward` with the clips with sound joint and those without kept from the audio stream (isolated,
        or gated by `cross_modal_gate` where a micro-batch holds both). A batch of drawn modes mixing token layouts
        (a last frame's keyframe tokens beside samples without) runs in one call, the padding masked (`place_given`).
        """
        heard = self.heard(conditions, noisy_latents.shape[0])
        if VIDEO_ONLY in conditions:  # in-context training without `control.with_audio`: video alone
            return self.joint_forward(denoiser, conditions, noisy_latents, timesteps, isolated=True)
        if self.config.clips_without_sound == "silence":  # every clip beside the audio stream (silence where none)
            return self.joint_forward(denoiser, conditions, noisy_latents, timesteps)
        if bool(heard.all()) or not bool(heard.any()):
            return self.joint_forward(denoiser, conditions, noisy_latents, timesteps, isolated=not bool(heard.any()))
        # Both kinds in one micro-batch: one call, the cross-modal attentions' outputs zeroed for the clips without
        # sound. Their video then computes exactly what an isolated call gives, and every parameter is used once
        # per backward (two calls would hand DistributedDataParallel each parameter's gradient twice).
        with self.cross_modal_gate.closed_for(~heard):
            return self.joint_forward(denoiser, conditions, noisy_latents, timesteps)

    def forward(
        self, denoiser: nn.Module, conditions: Conditions, noisy_latents: torch.Tensor, timesteps: torch.Tensor
    ) -> torch.Tensor:
        """The video prediction (the audio stream runs beside it; a clip without sound is not shown it)."""
        return self.predict(denoiser, conditions, noisy_latents, timesteps)[0]

    def training_error(self, denoiser: nn.Module, conditions: Conditions, noisy_latents: torch.Tensor,
                       timesteps: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The video's mean squared error plus `model.audio_loss_weight` times the audio's, per clip; a clip without
        sound (`AUDIO_PRESENT` 0) adds no audio error, and its video does not see the audio stream: it trains video
        only."""
        video, audio, audio_target = self.predict(denoiser, conditions, noisy_latents, timesteps)
        video_error = self.clip_error((video.float() - target).pow(2), conditions)
        audio_error = (audio.float() - audio_target).pow(2).flatten(1).mean(dim=1)
        heard = self.heard(conditions, video.shape[0]).float().to(audio_error.device)
        return video_error + self.audio_loss_weight * heard * audio_error

    def per_clip_error(self, squared_error: torch.Tensor, conditions: Conditions) -> torch.Tensor:
        """A first frame given clean (first-frame conditioning) is not predicted: it stays out of the loss; so does a
        drawn mode's given region."""
        if conditioning.MODE in conditions:
            return self.modes_error(squared_error, conditions)
        return first_frame.per_clip_error(squared_error, conditions)

    def visit_conditions(self, x0: torch.Tensor, positions: torch.Tensor, seed: int) -> Conditions:
        """With `model.conditioning`, each sample's mode (its first frame among them); else first-frame
        conditioning's draw."""
        if self.modes_on:
            return self.draw_modes(x0, positions, seed, self.first_frame_probability)
        return super().visit_conditions(x0, positions, seed)

    def in_context_conditions(self, conditions: Conditions, reference: torch.Tensor, with_audio: bool) -> Conditions:
        """The reference latents beside the conditions (`joint_forward` places their tokens as
        LTX2InContextPipeline does); without `with_audio` no sample hears its sound nor adds an audio error, as
        ltx-trainer's IC-LoRA trains video only by default."""
        conditions = {**conditions, REFERENCE_LATENTS: reference}
        if with_audio:
            return conditions
        silent = torch.zeros(reference.shape[0], 1, dtype=torch.bool, device=reference.device)
        return {**conditions, AUDIO_PRESENT: silent, VIDEO_ONLY: ~silent.flatten()}

    def in_context_pipeline(self, pipeline: Any) -> LTX2InContextPipeline:
        """LTX2InContextPipeline over the same components as `pipeline` (LTX2Pipeline's)."""
        return in_context.pipeline_like(LTX2InContextPipeline, pipeline)

    def reference_inputs(self, reference: torch.Tensor, downscale_factor: int, attention_strength: float
                         ) -> dict[str, Any]:
        """LTX2InContextPipeline's arguments for a reference clip [F, 3, H', W'] in [-1, 1], already at the clip's
        size over `downscale_factor` (so the pipeline's own resize keeps it as training read it)."""
        return {"reference_conditions": [LTX2ReferenceCondition(frames=frames_to_pil(reference), strength=1.0)],
                "reference_downscale_factor": downscale_factor,
                "conditioning_attention_strength": attention_strength}

    def pack_control(self, control: torch.Tensor, denoiser: nn.Module,
                     hidden: torch.Tensor) -> tuple[torch.Tensor, int]:
        """Packed like the video latents, channels on the last dimension (as LTX-Video), before zero controls for a
        keyframe's extra tokens, which follow the clip's (they take no control)."""
        config = denoiser.config
        packed = LTX2Pipeline._pack_latents(control, config.patch_size, config.patch_size_t)
        extra = hidden.shape[1] - packed.shape[1]
        return torch.cat([packed, packed.new_zeros(packed.shape[0], extra, packed.shape[2])], dim=1), -1

    def comfyui_lora_rules(self) -> list[Rule]:
        """The original LTX-2 checkpoint's names (Lightricks' ltx-core, which ComfyUI loads), as diffusers' LTX-2
        converter for non-diffusers LoRAs reads them back: the blocks' attentions and feed-forwards and the caption
        projections keep their names; the patch projections and the timestep / cross-attention modulation
        embeddings are named otherwise."""
        attention = r"(?:attn[12]|audio_attn[12]|audio_to_video_attn|video_to_audio_attn)\.(?:to_[qkv]|to_out\.0)"
        block = rf"transformer_blocks\.\d+\.(?:{attention}|(?:audio_)?ff\.net\.(?:0\.proj|2))"
        embedding = r"(emb\.timestep_embedder\.linear_[12]|linear)"
        return [
            Rule(f"({block})", r"\1"),
            Rule(r"((?:audio_)?caption_projection\.linear_[12])", r"\1"),
            Rule(r"((?:audio_)?proj_out)", r"\1"),
            Rule(r"proj_in", "patchify_proj"),
            Rule(r"audio_proj_in", "audio_patchify_proj"),
            Rule(rf"time_embed\.{embedding}", r"adaln_single.\1"),
            Rule(rf"audio_time_embed\.{embedding}", r"audio_adaln_single.\1"),
            *[Rule(rf"av_cross_attn_{ours}\.{embedding}", rf"av_ca_{original}_adaln_single.\1")
              for ours, original in ORIGINAL_MODULATIONS.items()],
        ]

    def comfyui_model(self) -> ComfyUIModel:
        return ltxav(self.load_config(LTX2VideoTransformer3DModel, "transformer"))

    def comfyui_workflow(self) -> WorkflowLayout:
        """Lightricks' single checkpoint (model, both VAEs, text connectors) with Comfy-Org's Gemma 3 12B, as
        `video_ltx2_t2v` / `video_ltx2_3_t2v` load them: LTX-2.3's (the bandwidth-extending vocoder) or LTX-2's;
        LTXVScheduler, as LTX-Video."""
        newer = self.component_class("vocoder", VOCODERS) is LTX2VocoderWithBWE
        checkpoint = "ltx-2.3-22b-dev-fp8.safetensors" if newer else "ltx-2-19b-dev-fp8.safetensors"
        files = ModelFiles(checkpoint=checkpoint, text_encoders=("gemma_3_12B_it_fp4_mixed.safetensors",))
        return WorkflowLayout(files, functools.partial(ltx2_parts, image=self.image_to_video), scheduler="ltxv")

    # ----- pipeline and outputs -----------------------------------------------------------------------------
    def pipeline(self, text: TextComponents, vae: LTX2Autoencoders, denoiser: nn.Module) -> LTX2Pipeline:
        return self.pipeline_class(
            scheduler=self.load_scheduler(), vae=vae.vae, audio_vae=vae.audio_vae, text_encoder=text["text_encoder"],
            tokenizer=text["tokenizer"], connectors=text["connectors"], transformer=denoiser, vocoder=vae.vocoder,
        )

    def pipeline_inputs(self, reference: torch.Tensor | None = None) -> dict[str, Any]:
        return {"frame_rate": self.frame_rate}

    def latents_from_pipeline(self, latents: torch.Tensor, frames: int, height: int, width: int) -> torch.Tensor:
        """A step's latents (packed tokens, normalised; LTX2ConditionPipeline's with keyframe tokens after the
        video's) in the training layout."""
        spatial, temporal, patch, patch_t = self.compression
        latent_frames = ((frames - 1) // temporal + 1) // patch_t
        rows, columns = height // spatial // patch, width // spatial // patch
        return LTX2Pipeline._unpack_latents(latents[:, :latent_frames * rows * columns], latent_frames, rows, columns,
                                            patch, patch_t)

    def call_pipeline(self, pipeline: Any, prompt: str, frames: int, height: int, width: int,
                      num_inference_steps: int, guidance_scale: float, generator: torch.Generator, output_type: str,
                      reference: torch.Tensor | None = None, callback: Any = None, given: Given | None = None) -> Any:
        """A conditioning mode samples through LTX2ConditionPipeline (its region-keeping subclass) over the
        components of `pipeline`; the rest through `pipeline` itself."""
        if given is not None and given.mode != "first_frame":
            condition = in_context.pipeline_like(LTX2RegionConditionPipeline, pipeline)
            condition.set_progress_bar_config(**getattr(pipeline, "_progress_bar_config", {}))
            pipeline = condition
        return super().call_pipeline(pipeline, prompt, frames, height, width, num_inference_steps, guidance_scale,
                                     generator, output_type, reference, callback, given=given)

    def frame_condition(self, picture: Any, last: bool, frames: int) -> LTX2VideoCondition:
        """LTX2ConditionPipeline's condition at a latent index: 0, or -1 (the last latent frame) for the last frame."""
        return LTX2VideoCondition(frames=picture, index=-1 if last else 0)

    def sampled_latents(self, pipeline: Any, result: Any, frames: int, height: int, width: int) -> GeneratedSample:
        """The video latents [B, C, F, H, W] and the audio latents [B, L, C * mel], normalised as training normalises
        them (LTX2Pipeline's `output_type="latent"` gives them denormalised)."""
        vae, audio_vae = pipeline.vae, pipeline.audio_vae
        video = result.frames.float()
        shift = vae.latents_mean.view(1, -1, 1, 1, 1).to(video)
        video = (video - shift) * (vae.config.scaling_factor / vae.latents_std.view(1, -1, 1, 1, 1).to(video))
        audio = LTX2Pipeline._pack_audio_latents(result.audio.float())
        audio = LTX2Pipeline._normalize_audio_latents(audio, audio_vae.latents_mean.float(),
                                                      audio_vae.latents_std.float())
        return GeneratedSample(latents=video, audio_latents=audio)

    def sampled_video(self, pipeline: Any, result: Any) -> GeneratedSample:
        """The video and its sound: LTX2Pipeline decodes the audio latents with the audio VAE and the vocoder, which
        gives the waveform [channels, samples] at its `output_sampling_rate` (LTX2Vocoder's one rate; the
        bandwidth-extended rate of LTX2VocoderWithBWE, whose `input_sampling_rate` is its first stage's), clamped to
        [-1, 1], the range a sound track holds: a vocoder configured without its final tanh can leave it."""
        return GeneratedSample(result.frames[0].float() * 2.0 - 1.0, result.audio[0].float().clamp(-1.0, 1.0),
                               int(pipeline.vocoder.config.output_sampling_rate))

    def guidance_inputs(self, guidance_scale: float) -> dict[str, Any]:
        """Without guidance (scale 1) LTX2Pipeline's other guidances (spatio-temporal, modality, rescale, the
        audio's) are off too, so a step is one plain forward: what `sample(output="latents")` compares with training."""
        return UNGUIDED if guidance_scale <= 1.0 else {}


class LTX2ImageToVideoSpec(LTX2Spec):
    """LTX-2 from a first frame, sampled with LTX2ImageToVideoPipeline (the image's latent clean, timestep 0 on its
    tokens, the sound generated from noise beside it).

    Trained as Lightricks' image-to-video recipe trains it (ltx-trainer configs/i2v_lora.yaml: a `first_frame`
    condition of `probability: 0.5`): half the samples are given their first latent frame clean (timestep 0 on its
    tokens, left out of the loss), the rest train as text-to-video; `model.first_frame_conditioning` sets the share.
    The causal video VAE encodes the first frame into the first latent frame on its own, so the clip's first latent
    frame is what the pipeline makes of the image."""

    name = "ltx-2-i2v"
    image_to_video = True
    pipeline_class = LTX2ImageToVideoPipeline
    # LTX2InContextPipeline takes a first frame as a condition of its own: in-context runs use ltx-2, whose
    # `model.first_frame_conditioning` gives a share of samples their first frame beside the reference.
    in_context_pipeline_class = None
    first_frame_conditioning = 0.5  # ltx-trainer configs/i2v_lora.yaml: first_frame `probability: 0.5`

    def pipeline_inputs(self, reference: torch.Tensor | None = None) -> dict[str, Any]:
        return {"image": self.first_frame_image(reference), "frame_rate": self.frame_rate}
