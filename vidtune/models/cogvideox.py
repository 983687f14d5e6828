"""CogVideoX (THUDM / Zhipu AI): T5 text encoder, causal 3D VAE, and a DiT over [B, F, C, H, W] latents.

Every convention below is read from CogVideoXPipeline / CogVideoXImageToVideoPipeline:
  * text: T5 over captions padded to exactly `max_sequence_length` tokens (the transformer's
    `max_text_seq_length`, 226 in released checkpoints), run without an attention mask; the transformer
    has no text mask either and attends to every token, padding included.
  * latents: the VAE posterior times `vae.config.scaling_factor` (the pipeline decodes latents / scaling_factor),
    with no mean shift. The transformer takes [B, F, C, H, W]; `forward` permutes from the shared
    [B, C, F, H, W] layout and back.
  * objective: DDPM with the scheduler's own `alphas_cumprod` (SNR shift, zero terminal SNR) and v-prediction.
  * 3D rotary embeddings, when `use_rotary_positional_embeddings`, computed by the pipeline's own function.
  * image-to-video: first-frame latents padded with zeros to the latent frame count and concatenated to the
    noisy latents on the channel dim; `ofs` = 2.0 where the transformer has an ofs embedding.
  * conditioning modes (image-to-video, `model.conditioning`): extension, last frame and first-last, each as latents
    placed in those channels (vidtune/models/given_modes.py, `ChannelModes`): the first frames of a clip encoded
    alone in its first latent frames, the last frame encoded alone in the last latent frame, zeros elsewhere, and
    sampled through CogVideoXImageToVideoPipeline given those latents (`CogVideoXGivenFramesPipeline`). Inpainting
    is refused: the condition has no mask channel, so a kept region's latents could not be told from zeros.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from types import SimpleNamespace
from typing import Any, ClassVar

import torch
from diffusers import (
    AutoencoderKLCogVideoX,
    CogVideoXDDIMScheduler,
    CogVideoXDPMScheduler,
    CogVideoXImageToVideoPipeline,
    CogVideoXPipeline,
    CogVideoXTransformer3DModel,
)
from torch import nn
from transformers import T5EncoderModel

from vidtune.errors import ConfigError, ModelError
from vidtune.models import conditioning, in_context
from vidtune.models.conditioning import Given
from vidtune.models.defaults import COGVIDEOX
from vidtune.models.given_modes import ChannelModes, compose
from vidtune.models.spec import (
    Conditions,
    Latents,
    ModelSpec,
    TextComponents,
    frame_count_problem,
    raise_shape_problems,
    shape_rule,
    side_problems,
)
from vidtune.outputs import LORA_WEIGHTS

logger = logging.getLogger(__name__)

# The keys of a modes run's conditions, each [B, C, F, H, W] over the latent frames the denoiser takes (zeros where it
# gives nothing): the first frame, the clip to extend and the last frame, each encoded alone. CogVideoX 1.5 pads an
# odd count with a frame in front (the pipeline drops it after denoising), where the pipeline places its image; the
# frames to extend sit over the clip's own latent frames, their first copied into the padding as the clip's is.
GIVEN_FIRST = "given_first_latents"
GIVEN_EXTENSION = "given_extension_latents"
GIVEN_LAST = "given_last_latents"


class CogVideoXGivenFramesPipeline(CogVideoXImageToVideoPipeline):
    """CogVideoXImageToVideoPipeline given a conditioning mode's latents in its image condition: `given_frames` ([B,
    3, K, H, W] in [-1, 1]: the first frame, or a clip to extend) in the first latent frames and `given_last` ([B, 3,
    1, H, W]) in the last, each encoded alone as the pipeline encodes its image (a posterior sample, scaled), zeros
    elsewhere; a clip to extend sits over the clip's own latent frames, after `given_padding` frames in front
    (CogVideoX 1.5), which take its first. Its `image` is then read for nothing else. Everything else is the
    pipeline's."""

    def __call__(self, *args: Any, given_frames: torch.Tensor | None = None, given_last: torch.Tensor | None = None,
                 given_padding: int | None = None, **kwargs: Any) -> Any:
        self._given = (given_frames, given_last, given_padding)
        try:
            return super().__call__(*args, **kwargs)
        finally:
            self._given = None

    def encode_given(self, pixels: torch.Tensor, generator: torch.Generator | None) -> torch.Tensor:
        """[B, F', C, H, W] latents of pixels [B, 3, K, H, W], as `prepare_latents` encodes the image."""
        latents = self.vae.encode(pixels.to(self.vae.device, self.vae.dtype)).latent_dist.sample(generator)
        scale = self.vae_scaling_factor_image
        latents = latents / scale if self.vae.config.invert_scale_latents else latents * scale
        return latents.permute(0, 2, 1, 3, 4)

    def prepare_latents(self, image: torch.Tensor, batch_size: int = 1, num_channels_latents: int = 16,
                        num_frames: int = 13, height: int = 60, width: int = 90, dtype: torch.dtype | None = None,
                        device: torch.device | None = None, generator: torch.Generator | None = None,
                        latents: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        latents, image_latents = super().prepare_latents(image, batch_size, num_channels_latents, num_frames, height,
                                                         width, dtype, device, generator, latents)
        given = getattr(self, "_given", None)
        if given is None or given[:2] == (None, None):
            return latents, image_latents
        frames, last, padding = given
        condition = torch.zeros_like(image_latents)  # [B, F, C, H, W], as the image's: F padded for CogVideoX 1.5
        if frames is not None:
            encoded = self.encode_given(frames, generator).to(condition)
            if padding is None:  # the first frame, where the pipeline places its image
                condition[:, : encoded.shape[1]] = encoded
            else:  # the frames to extend over the clip's own latent frames (`given_padding` in front)
                condition[:, padding: padding + encoded.shape[1]] = encoded
                condition[:, :padding] = encoded[:, :1]
        if last is not None:
            condition[:, -1:] = self.encode_given(last, generator).to(condition)
        return latents, condition


class CogVideoXSpec(ModelSpec):
    name = "cogvideox"
    # Conv2d over each frame's [C, H, W] (CogVideoX 1.5: a Linear over patches, channels most significant).
    control_input_layer = "patch_embed.proj"
    validation_guidance_scale = 6.0
    defaults = COGVIDEOX
    pipeline_class = CogVideoXPipeline
    # CogVideoX 1.5 (a temporal patch): a latent frame count that is not a multiple of the patch is padded at the
    # front with copies of the first latent frame. CogVideoXPipeline generates those `additional_frames` too and
    # drops them before decoding; CogVideoX's own fine-tuning scripts pad the clean latent the same way.
    pads_latent_frames: ClassVar[bool] = True

    # ----- shape rules, read from the VAE / transformer configs (no weights needed) --------------------
    @functools.cached_property
    def transformer_config(self) -> dict[str, Any]:
        return self.load_config(CogVideoXTransformer3DModel, "transformer")

    @functools.cached_property
    def compression(self) -> tuple[int, int, int, int | None]:
        """(VAE spatial ratio, VAE temporal ratio, patch size, temporal patch or None), as the pipeline reads them."""
        vae = self.load_config(AutoencoderKLCogVideoX, "vae")
        transformer = self.transformer_config
        spatial = 2 ** (len(vae["block_out_channels"]) - 1)
        temporal = int(vae["temporal_compression_ratio"])
        return spatial, temporal, transformer["patch_size"], transformer.get("patch_size_t")

    @functools.cached_property
    def max_sequence_length(self) -> int:
        """Caption tokens: the transformer's `max_text_seq_length` unless model.max_sequence_length says otherwise.

        Transformers with absolute (sin-cos or learned) positional embeddings cover exactly
        `max_text_seq_length` text tokens, so for them it is the only valid value.
        """
        transformer = self.transformer_config
        native = int(transformer.get("max_text_seq_length", 226))
        length = self.config.max_sequence_length or native
        absolute = not transformer.get("use_rotary_positional_embeddings", False) or transformer.get(
            "use_learned_positional_embeddings", False
        )
        if length != native and absolute:
            raise ConfigError(
                f"model.max_sequence_length={length} does not fit this CogVideoX transformer: its positional "
                f"embeddings cover exactly {native} text tokens; set model.max_sequence_length={native} (or leave "
                "it unset)."
            )
        return length

    def check_video_shape(self, frames: int, height: int, width: int) -> None:
        vae_spatial, temporal, patch, patch_t = self.compression
        spatial = vae_spatial * patch
        latent_multiple = 1 if self.pads_latent_frames else patch_t or 1
        problems = [frame_count_problem(frames, temporal, latent_multiple), *side_problems(height, width, spatial)]
        transformer = self.transformer_config
        for key, value, sample in (("data.height", height, transformer["sample_height"]),
                                   ("data.width", width, transformer["sample_width"])):
            size = sample * vae_spatial
            if value % spatial != 0:
                continue
            if transformer.get("use_learned_positional_embeddings", False) and value != size:
                # Learned positional embeddings exist for one latent size only (CogVideoX-5b-I2V: 480 x 720).
                problems.append(
                    f"{key}={value}: this model's learned positional embeddings fit {size} only; "
                    f"nearest valid value: {size}"
                )
            elif patch_t and transformer.get("use_rotary_positional_embeddings", False) and value > size:
                # CogVideoX 1.5 slices its rotary table, which covers sample_height x sample_width latents.
                problems.append(
                    f"{key}={value}: this model's rotary embeddings cover at most {size}; nearest valid value: "
                    f"{size // spatial * spatial}"
                )
        raise_shape_problems("CogVideoX", problems, self, shape_rule(temporal, latent_multiple, spatial))
        _ = self.max_sequence_length  # fails early on a text length the transformer cannot take

    # ----- loading ---------------------------------------------------------------------------------
    text_encoder_class = T5EncoderModel
    vae_class = AutoencoderKLCogVideoX
    denoiser_class = CogVideoXTransformer3DModel

    def load_scheduler(self) -> CogVideoXDDIMScheduler | CogVideoXDPMScheduler:
        source, subfolder = self.component_source("scheduler")
        try:
            config = CogVideoXDDIMScheduler.load_config(source, subfolder=subfolder, revision=self.config.revision)
        except (OSError, ValueError) as error:
            raise ModelError(f"Could not read the scheduler config of {self.name} from {source}: {error}") from None
        # Released checkpoints ship either scheduler (2b: DDIM, 5b: DPM); both share the training schedule.
        cls = CogVideoXDPMScheduler if config.get("_class_name") == "CogVideoXDPMScheduler" else CogVideoXDDIMScheduler
        return self.load_component(cls, "scheduler")

    # The objective is the default one: DDPM v-prediction on the scheduler's alphas_cumprod, *unweighted*.
    # CogVideoX's own fine-tuning scripts weight by 1 / (1 - alpha_bar_t), but they weight the error of the
    # x0 estimate (`scheduler.get_velocity(model_output, noisy, t)` = sqrt(a) x_t - sqrt(1 - a) v); since
    # x0_pred - x0 = -sqrt(1 - a) (v_pred - v), that weighted x0 loss *is* the plain v-prediction MSE.
    # Enabling `snr_weighting` on the v target would weight twice (tests/models/test_cogvideox.py checks this).

    # ----- tensors ---------------------------------------------------------------------------------
    @torch.no_grad()
    def prepare_conditions(self, text: TextComponents, captions: list[str]) -> Conditions:
        """T5 embeddings exactly as CogVideoXPipeline.encode_prompt computes them (no mask anywhere)."""
        tokenizer, text_encoder = text["tokenizer"], text["text_encoder"]
        tokens = tokenizer(
            list(captions),
            padding="max_length",
            max_length=self.max_sequence_length,
            truncation=True,
            add_special_tokens=True,
            return_tensors="pt",
        )
        embeds = text_encoder(tokens.input_ids.to(text_encoder.device))[0]
        return {"prompt_embeds": embeds}

    @torch.no_grad()
    def prepare_latents(self, vae: nn.Module, videos: torch.Tensor) -> Latents:
        # The VAE's layout is the shared training layout; the pipeline decodes latents / scaling_factor.
        latents = self.normalised_posterior(self.vae_posterior(vae, videos), vae.config.scaling_factor)
        padding = self.latent_padding(latents["latents_mean"].shape[2])
        if padding:
            latents = {key: torch.cat([value[:, :, :1].expand(-1, -1, padding, -1, -1), value], dim=2)
                       for key, value in latents.items()}
        return latents

    def latent_padding(self, latent_frames: int) -> int:
        """Latent frames put before the clip's (see `pads_latent_frames`): CogVideoXPipeline's `additional_frames`."""
        patch_t = self.transformer_config.get("patch_size_t")
        return (-latent_frames) % patch_t if patch_t and self.pads_latent_frames else 0

    @staticmethod
    def rotary_embeddings(denoiser: nn.Module, frames: int, height: int, width: int,
                          device: torch.device) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The pipeline's 3D rotary embeddings for a latent grid of frames x height x width.

        Calls CogVideoXPipeline._prepare_rotary_positional_embeddings itself, with a VAE scale of 1 since
        the sizes given are already latent sizes (the pipeline divides pixel sizes by its VAE scale).
        """
        if not denoiser.config.use_rotary_positional_embeddings:
            return None
        view = SimpleNamespace(vae_scale_factor_spatial=1, transformer=denoiser)
        return CogVideoXPipeline._prepare_rotary_positional_embeddings(view, height, width, frames, device)

    def pack_control(self, control: torch.Tensor, denoiser: nn.Module,
                     hidden: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The transformer reads [B, F, C, H, W]: channels on dimension 2."""
        return control.permute(0, 2, 1, 3, 4), 2

    def forward(
        self, denoiser: nn.Module, conditions: Conditions, noisy_latents: torch.Tensor, timesteps: torch.Tensor
    ) -> torch.Tensor:
        _, _, frames, height, width = noisy_latents.shape
        hidden = noisy_latents.permute(0, 2, 1, 3, 4)  # [B, F, C, H, W], the transformer's layout
        if "image_latents" in conditions:  # image-to-video: first-frame latents on the channel dim
            image = self.image_condition(conditions, noisy_latents).permute(0, 2, 1, 3, 4).to(hidden)
            hidden = torch.cat([hidden, image], dim=2)
        ofs = None if denoiser.config.ofs_embed_dim is None else hidden.new_full((1,), 2.0)
        prediction = denoiser(
            hidden_states=hidden,
            encoder_hidden_states=conditions["prompt_embeds"],
            timestep=timesteps,
            ofs=ofs,
            image_rotary_emb=self.rotary_embeddings(denoiser, frames, height, width, hidden.device),
            return_dict=False,
        )[0]
        return prediction.permute(0, 2, 1, 3, 4)

    # ----- ComfyUI ------------------------------------------------------------------------------------
    def comfyui_absent(self) -> str:
        return (f"ComfyUI's core has no CogVideoX model, so there is no ComfyUI file to write. In ComfyUI, CogVideoX "
                f"runs through the ComfyUI-CogVideoXWrapper nodes, whose CogVideoLoraSelect node loads the diffusers "
                f"file ({LORA_WEIGHTS}, renamed as you like) from ComfyUI/models/CogVideo/loras.")

    # ----- pipeline and outputs ----------------------------------------------------------------------
    def pipeline(self, text: TextComponents, vae: nn.Module, denoiser: nn.Module) -> Any:
        return self.pipeline_class(
            tokenizer=text["tokenizer"],
            text_encoder=text["text_encoder"],
            vae=vae,
            transformer=denoiser,
            scheduler=self.load_scheduler(),
        )

    def latents_from_pipeline(self, latents: torch.Tensor, frames: int, height: int, width: int) -> torch.Tensor:
        return latents.permute(0, 2, 1, 3, 4)  # [B, F, C, H, W] -> [B, C, F, H, W]

    def image_condition(self, conditions: Conditions, noisy_latents: torch.Tensor) -> torch.Tensor:
        """[B, C, F, H, W]: the image-to-video latents on the channels beside the noisy ones."""
        return conditions["image_latents"].to(noisy_latents)


def _content_generator(frame: torch.Tensor) -> torch.Generator:
    """A generator seeded from a frame's pixels: the same clip always gets the same draw."""
    digest = hashlib.blake2b(frame.detach().float().cpu().contiguous().numpy().tobytes(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") % 2**63)


class CogVideoXI2VSpec(ChannelModes, CogVideoXSpec):
    """CogVideoX image-to-video (CogVideoXImageToVideoPipeline conventions).

    Training condition (`prepare_latents` key "image_latents", layout [B, C, F, H, W] like the latents):
    the clip's first frame, noise-augmented on pixels with sigma = exp(N(-3, 0.5)) as in CogVideoX's own
    I2V training scripts, encoded alone, a posterior sample times scaling_factor (divided by it where the
    VAE config sets `invert_scale_latents`, as the pipeline does), zero-padded to the latent frame count.
    The augmentation noise is drawn from a generator seeded by the frame's content: each clip gets one
    fixed augmentation, the same with on-the-fly and precomputed latents, after resuming and on any rank
    (like CogVideoX's scripts with precomputed latents), rather than a new one per visit.

    Sampling: the pipeline needs the first frame as its `image`: that of the `reference` clip handed to
    `sample` (validation gives the first dataset clip).
    """

    name = "cogvideox-i2v"
    image_to_video = True
    conditioning_refusal = ("its condition is latents on channels beside the noisy ones with no mask channel, so a "
                            "kept region (inpainting) could not be told from latents that are zero; it takes the "
                            "first frames of a clip and the last frame (CogVideoXImageToVideoPipeline with those "
                            "latents placed).")
    conditioning_modes = ("extension", "last_frame", "first_last")
    modes_pipeline = "CogVideoXImageToVideoPipeline"
    # CogVideoX 1.5 I2V: an odd latent frame count is padded like the text-to-video latents (the first latent frame
    # in front). CogVideoXImageToVideoPipeline then denoises one latent frame more, with the image condition in
    # latent frame 0 and zeros after it, and drops the first frame before decoding: `prepare_latents` builds that
    # condition over the padded count.
    pipeline_class = CogVideoXImageToVideoPipeline
    image_noise_log_sigma: tuple[float, float] | None = (-3.0, 0.5)  # (mean, std) of log sigma; None: no noise

    def latent_identity(self) -> dict[str, Any]:
        noise = self.image_noise_log_sigma
        identity = {**super().latent_identity(), "image_noise_log_sigma": None if noise is None else list(noise)}
        if self.modes_on:
            identity["given_latents"] = {"extension_frames": self.config.conditioning.extension_frames,
                                         "last_frame": self.takes_last_frame}
        return identity

    def given_latents(self, vae: nn.Module, pictures: torch.Tensor) -> torch.Tensor:
        """[B, C, F', h, w]: pictures [B, K, 3, H, W] encoded alone as the pipeline encodes its image, after CogVideoX's
        own noise augmentation (see the class), its draws from a generator seeded by the pictures' content."""
        noisy, generators = [], []
        for picture in pictures:
            picture = picture.float().cpu()  # [K, 3, H, W]
            generator = _content_generator(picture)
            if self.image_noise_log_sigma is not None:
                mean, std = self.image_noise_log_sigma
                sigma = torch.exp(torch.randn(1, generator=generator) * std + mean)
                picture = picture + torch.randn(picture.shape, generator=generator) * sigma
            noisy.append(picture)
            generators.append(generator)
        pixels = torch.stack(noisy).to(device=vae.device, dtype=vae.dtype).permute(0, 2, 1, 3, 4)  # [B, 3, K, H, W]
        posterior = vae.encode(pixels).latent_dist
        eps = torch.cat([torch.randn(posterior.mean.shape[1:], generator=g).unsqueeze(0) for g in generators])
        latents = posterior.mean + posterior.std * eps.to(posterior.mean)  # a posterior sample, like the pipeline's
        scale = vae.config.scaling_factor
        return latents / scale if vae.config.get("invert_scale_latents", False) else latents * scale

    @torch.no_grad()
    def prepare_latents(self, vae: nn.Module, videos: torch.Tensor) -> Latents:
        latents = super().prepare_latents(vae, videos)
        image = self.given_latents(vae, videos[:, :1])  # the first frame alone, as the pipeline encodes its image
        frames = latents["latents_mean"].shape[2]
        padding = image.new_zeros(*image.shape[:2], frames - 1, *image.shape[3:])
        latents["image_latents"] = torch.cat([image, padding], dim=2)
        if self.modes_on:  # each mode's condition, as CogVideoXGivenFramesPipeline places it
            empty = torch.zeros_like(latents["image_latents"])
            latents[GIVEN_FIRST] = latents["image_latents"]
            if self.config.conditioning.extension > 0 and self.extension_latent_frames < frames:
                extension = empty.clone()
                given = self.given_latents(vae, videos[:, : self.config.conditioning.extension_frames])
                padding = self.latent_padding((videos.shape[1] - 1) // self.compression[1] + 1)
                extension[:, :, padding: padding + given.shape[2]] = given
                extension[:, :, :padding] = given[:, :, :1]
                latents[GIVEN_EXTENSION] = extension
            if self.takes_last_frame:
                last = empty.clone()
                last[:, :, -1:] = self.given_latents(vae, videos[:, -1:])
                latents[GIVEN_LAST] = last
        return latents

    def visit_conditions(self, x0: torch.Tensor, positions: torch.Tensor, seed: int) -> Conditions:
        """With `model.conditioning`, each sample's mode (the first frame for the rest)."""
        return self.draw_channel_modes(x0, positions, seed) if self.modes_on else {}

    def image_condition(self, conditions: Conditions, noisy_latents: torch.Tensor) -> torch.Tensor:
        """[B, C, F, H, W]: the latents on the channels beside the noisy ones: the first frame's, or each sample's by
        its drawn mode."""
        if conditioning.MODE not in conditions:
            return conditions["image_latents"].to(noisy_latents)
        return compose(conditions[conditioning.MODE], conditions[GIVEN_FIRST].to(noisy_latents),
                       conditions.get(GIVEN_EXTENSION), conditions.get(GIVEN_LAST))

    def check_video_shape(self, frames: int, height: int, width: int) -> None:
        super().check_video_shape(frames, height, width)
        problems = self.extension_problems(frames) if self.modes_on else []
        if problems:
            raise ConfigError("The conditioning modes do not fit:\n" + "\n".join(f"  - {p}" for p in problems)
                              + "\nWhat to do: fix model.conditioning as said above.")

    def pipeline_inputs(self, reference: torch.Tensor | None = None) -> dict[str, Any]:
        # The pipeline takes images in [0, 1] (it resizes them if needed) and normalises them to [-1, 1] itself.
        first_frame = self.given_reference(reference)[0].detach().float().cpu()
        return {"image": ((first_frame + 1.0) / 2.0).clamp(0.0, 1.0).unsqueeze(0)}

    def call_pipeline(self, pipeline: Any, prompt: str, frames: int, height: int, width: int,
                      num_inference_steps: int, guidance_scale: float, generator: torch.Generator, output_type: str,
                      reference: torch.Tensor | None = None, callback: Any = None, given: Given | None = None) -> Any:
        """A conditioning mode samples through CogVideoXGivenFramesPipeline over the components of `pipeline`."""
        if given is not None and given.mode != "first_frame":
            placing = in_context.pipeline_like(CogVideoXGivenFramesPipeline, pipeline)
            placing.set_progress_bar_config(**getattr(pipeline, "_progress_bar_config", {}))
            pipeline = placing
        return super().call_pipeline(pipeline, prompt, frames, height, width, num_inference_steps, guidance_scale,
                                     generator, output_type, reference, callback, given=given)

    def given_inputs(self, given: Given, frames: int, height: int, width: int) -> dict[str, Any]:
        """The pipeline's `image` (the first given picture: it needs one) and the mode's pictures, [1, 3, K, H, W]:
        the first frame or the clip to extend (`given_frames`), the last frame (`given_last`)."""
        if given.mode == "first_frame":
            return self.pipeline_inputs(given.frames)
        self.check_given_frames(given, frames)
        pictures = given.frames if given.frames is not None else given.last
        assert pictures is not None
        inputs = self.pipeline_inputs(pictures)
        if given.frames is not None:
            inputs["given_frames"] = given.frames.permute(1, 0, 2, 3).unsqueeze(0).float()
        if given.mode == "extension":
            inputs["given_padding"] = self.latent_padding(self.latent_grid(frames, height, width)[0])
        if given.last is not None:
            inputs["given_last"] = given.last[-1:].permute(1, 0, 2, 3).unsqueeze(0).float()
        return inputs

