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
from vidtune.models.defaults import COGVIDEOX
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

    def pack_control(self, control: torch.Tensor, denoiser: nn.Module) -> tuple[torch.Tensor, int]:
        """The transformer reads [B, F, C, H, W]: channels on dimension 2."""
        return control.permute(0, 2, 1, 3, 4), 2

    def forward(
        self, denoiser: nn.Module, conditions: Conditions, noisy_latents: torch.Tensor, timesteps: torch.Tensor
    ) -> torch.Tensor:
        _, _, frames, height, width = noisy_latents.shape
        hidden = noisy_latents.permute(0, 2, 1, 3, 4)  # [B, F, C, H, W], the transformer's layout
        if "image_latents" in conditions:  # image-to-video: first-frame latents on the channel dim
            image = conditions["image_latents"].permute(0, 2, 1, 3, 4).to(hidden)
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


def _content_generator(frame: torch.Tensor) -> torch.Generator:
    """A generator seeded from a frame's pixels: the same clip always gets the same draw."""
    digest = hashlib.blake2b(frame.detach().float().cpu().contiguous().numpy().tobytes(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") % 2**63)


class CogVideoXI2VSpec(CogVideoXSpec):
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
    conditioning_refusal = ("CogVideoXImageToVideoPipeline takes one first image, as channels beside the first "
                            "latent frame (zeros after it); no other frame, clip or mask.")
    # CogVideoX 1.5 I2V: an odd latent frame count is padded like the text-to-video latents (the first latent frame
    # in front). CogVideoXImageToVideoPipeline then denoises one latent frame more, with the image condition in
    # latent frame 0 and zeros after it, and drops the first frame before decoding: `prepare_latents` builds that
    # condition over the padded count.
    pipeline_class = CogVideoXImageToVideoPipeline
    image_noise_log_sigma: tuple[float, float] | None = (-3.0, 0.5)  # (mean, std) of log sigma; None: no noise

    def latent_identity(self) -> dict[str, Any]:
        noise = self.image_noise_log_sigma
        return {**super().latent_identity(), "image_noise_log_sigma": None if noise is None else list(noise)}

    @torch.no_grad()
    def prepare_latents(self, vae: nn.Module, videos: torch.Tensor) -> Latents:
        latents = super().prepare_latents(vae, videos)
        firsts, generators = [], []
        for video in videos:
            first = video[:1].float().cpu()  # [1, 3, H, W]
            generator = _content_generator(first)
            if self.image_noise_log_sigma is not None:
                mean, std = self.image_noise_log_sigma
                sigma = torch.exp(torch.randn(1, generator=generator) * std + mean)
                first = first + torch.randn(first.shape, generator=generator) * sigma
            firsts.append(first)
            generators.append(generator)
        pixels = torch.stack(firsts).to(device=vae.device, dtype=vae.dtype).permute(0, 2, 1, 3, 4)  # [B, 3, 1, H, W]
        posterior = vae.encode(pixels).latent_dist  # the first frame alone, as the pipeline encodes its image
        eps = torch.cat([torch.randn(posterior.mean.shape[1:], generator=g).unsqueeze(0) for g in generators])
        image = posterior.mean + posterior.std * eps.to(posterior.mean)  # a posterior sample, like the pipeline's
        scale = vae.config.scaling_factor
        image = image / scale if vae.config.get("invert_scale_latents", False) else image * scale
        padding = image.new_zeros(*image.shape[:2], latents["latents_mean"].shape[2] - 1, *image.shape[3:])
        latents["image_latents"] = torch.cat([image, padding], dim=2)
        return latents

    def pipeline_inputs(self, reference: torch.Tensor | None = None) -> dict[str, Any]:
        # The pipeline takes images in [0, 1] (it resizes them if needed) and normalises them to [-1, 1] itself.
        first_frame = self.given_reference(reference)[0].detach().float().cpu()
        return {"image": ((first_frame + 1.0) / 2.0).clamp(0.0, 1.0).unsqueeze(0)}
