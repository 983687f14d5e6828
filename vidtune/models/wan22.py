"""Wan 2.2 (Alibaba): the TI2V-5B model and the A14B two-expert models, through diffusers' Wan pipelines.

`wan2.2` samples with WanPipeline, `wan2.2-i2v` with WanImageToVideoPipeline. What a model folder is, is read from
its `model_index.json`, as the pipelines read it:
    TI2V-5B (`expand_timesteps: true`): one transformer, the Wan 2.2 VAE (48 latent channels, 16x spatial
        compression through a 2x2 pixel patch), and one timestep per latent token. Text-to-video gives every token
        the sample's timestep; image-to-video replaces the first latent frame by the clean latent of the image and
        gives its tokens timestep 0, so that frame is a condition, not a prediction (its error is left out of the
        loss, as the pipeline discards its prediction).
    A14B (`boundary_ratio` and a `transformer_2`): two experts of Wan 2.1's shape; `transformer` serves timesteps
        >= boundary_ratio * 1000 (high noise), `transformer_2` the rest. `model.experts` says which train:
        `both` (default; each sample's timestep picks its expert, each expert gets its own adapter), `high_noise`
        or `low_noise` (one expert; training then samples only noise levels on its side of the boundary). The
        denoiser is a `TwoExperts` module either way (see vidtune/models/experts.py), so validation samples with
        both. The adapters are saved as the pipeline loads them: the high-noise one as
        `pytorch_lora_weights.safetensors` (into `transformer`), the low-noise one as
        `pytorch_lora_weights_transformer_2.safetensors` (`load_lora_weights(..., load_into_transformer_2=True)`).
        I2V-A14B conditions like Wan 2.1 image-to-video (mask channels + first-frame latents concatenated to the
        input) but without CLIP image tokens.
Text, latent normalisation and the objective are Wan 2.1's (see vidtune/models/wan.py).
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any, ClassVar

import torch
from diffusers import WanImageToVideoPipeline, WanPipeline
from torch import nn

from vidtune import parallel
from vidtune.algorithms import traits_of
from vidtune.config import Config, TrainingConfig
from vidtune.errors import ConfigError, ModelError
from vidtune.export.comfyui_workflow import ModelFiles, WorkflowLayout, wan_parts
from vidtune.models.conditioning import LATENTS, MODE, Given, ModeName, give, is_mode
from vidtune.models.defaults import WAN_22
from vidtune.models.experts import EXPERT_NAMES, NoiseRange, StepRouted, TwoExperts, expert_file
from vidtune.models.spec import Conditions, Latents, StepCallback, TextComponents
from vidtune.models.wan import WAN_TEXT_ENCODERS, WanImageConditioning, WanSpec
from vidtune.models.wan_modes import FIRST_LAST_CONDITION, REGION_MODES
from vidtune.objectives import Objective
from vidtune.outputs import LORA_WEIGHTS

NUM_TRAIN_TIMESTEPS = 1000  # Wan's schedulers; the pipelines' boundary is boundary_ratio times this
# What `model.experts` names, and the expert each one trains.
EXPERTS = {"both": EXPERT_NAMES, "high_noise": ("transformer",), "low_noise": ("transformer_2",)}


def second_expert_file(weight_name: str) -> str:
    """The low-noise expert's adapter file beside `weight_name`: `pytorch_lora_weights.safetensors` ->
    `pytorch_lora_weights_transformer_2.safetensors` (the name diffusers' Wan 2.2 examples load)."""
    return expert_file(weight_name, "transformer_2")


class Wan22Spec(WanSpec):
    name = "wan2.2"
    pipeline_class = WanPipeline
    # Published sampling settings (Wan2.2's configs): TI2V-5B guidance 5, T2V-A14B 4 (high noise) / 3 (low noise).
    published_guidance: ClassVar[dict[str, float]] = {"ti2v": 5.0, "two_experts": 4.0}
    defaults = WAN_22

    # ----- what the model folder is ---------------------------------------------------------------------------
    @functools.cached_property
    def pipeline_config(self) -> dict[str, Any]:
        """The model folder's model_index.json (the pipeline's `boundary_ratio`, `expand_timesteps`, components),
        required: without it a folder does not say which Wan 2.2 it holds."""
        return self.model_index or self.read_model_index()

    @property
    def expand_timesteps(self) -> bool:
        """TI2V-5B: one timestep per latent token."""
        return bool(self.pipeline_config.get("expand_timesteps", False))

    @property
    def boundary_ratio(self) -> float | None:
        return self.pipeline_config.get("boundary_ratio")

    @property
    def two_experts(self) -> bool:
        """A14B: a boundary and a second transformer (model_index.json lists `transformer_2` with a class)."""
        entry = self.pipeline_config.get("transformer_2")
        return self.boundary_ratio is not None and isinstance(entry, (list, tuple)) and entry[-1] is not None

    @property
    def boundary_timestep(self) -> float:
        return float(self.boundary_ratio) * NUM_TRAIN_TIMESTEPS

    @property
    def trained_experts(self) -> tuple[str, ...]:
        return EXPERTS[self.config.experts or "both"]

    @property
    def validation_guidance_scale(self) -> float:  # type: ignore[override]
        return self.published_guidance["two_experts" if self.two_experts else "ti2v"]

    def required_components(self) -> tuple[str, ...]:
        return (*super().required_components(), *(("transformer_2",) if self.two_experts else ()))

    def comfyui_workflow(self) -> WorkflowLayout | None:
        """A14B (`video_wan2_2_14B_t2v` / `_i2v`): the two experts' fp8 files, split at the boundary; TI2V-5B
        (`video_wan2_2_5B_ti2v`): one model, its own VAE, Wan22ImageToVideoLatent (with the start image for
        image-to-video)."""
        kind = "i2v" if self.image_to_video else "t2v"
        if self.two_experts:
            experts = tuple(f"wan2.2_{kind}_{expert}_noise_14B_fp8_scaled.safetensors" for expert in ("high", "low"))
            files = ModelFiles(experts, WAN_TEXT_ENCODERS, "wan", "wan_2.1_vae.safetensors")
            return WorkflowLayout(files, functools.partial(wan_parts, image=self.image_to_video,
                                                           latent_node="EmptyHunyuanLatentVideo"),
                                  boundary=self.boundary_ratio)
        files = ModelFiles(("wan2.2_ti2v_5B_fp16.safetensors",), WAN_TEXT_ENCODERS, "wan", "wan2.2_vae.safetensors")
        return WorkflowLayout(files, functools.partial(wan_parts, image=self.image_to_video,
                                                       latent_node="Wan22ImageToVideoLatent"))

    def check_source(self) -> None:
        super().check_source()
        if self.config.expert_routing is not None and not self.two_experts:
            raise ConfigError(
                f"model.expert_routing={self.config.expert_routing}: {self.config.pretrained} has one transformer, "
                "so there are no experts to route to.\nWhat to do: remove model.expert_routing (it is for the "
                "two-expert A14B models)."
            )
        if self.config.experts is not None and not self.two_experts:
            raise ConfigError(
                f"model.experts={self.config.experts}: {self.config.pretrained} has one transformer (its "
                "model_index.json names no transformer_2 and no boundary_ratio), so there are no experts to "
                "choose.\nWhat to do: remove model.experts (it is for the two-expert A14B models)."
            )

    def check_training(self, config: Config) -> None:
        if not self.two_experts:
            return
        traits = traits_of(config)
        if traits.control and len(self.trained_experts) == 1:
            # The pipeline runs both experts on every control sample: an expert left as loaded would ignore it.
            raise ConfigError(
                f"model.experts={self.config.experts} with training.algorithm={config.training.algorithm}: the "
                "pipeline samples with both experts, and each takes the control clip through its own widened input "
                "layer, so both train.\nWhat to do: remove model.experts (both)."
            )
        if traits.learns_sampling_steps and len(self.trained_experts) == 1:
            # The student's K sampling steps cross the boundary: every window needs a trained student.
            raise ConfigError(
                f"model.experts={self.config.experts} with training.algorithm={config.training.algorithm}: the "
                f"student's {config.distillation.student_steps} sampling steps run both experts, so both students "
                "train.\nWhat to do: remove model.experts (both)."
            )
        self.expert_routing(config)  # its refusals, before any long work (`step_objective` resolves it again)
        if traits.trains_base_weights and len(self.trained_experts) == 1:
            full = ("distillation.student=full" if traits.chooses_student
                    else f"training.algorithm={config.training.algorithm}")
            raise ConfigError(
                f"model.experts={self.config.experts} with {full}: a full fine-tune of "
                f"{self.name} trains and saves both experts.\n"
                "What to do: remove model.experts (both), or train one expert's LoRA (training.algorithm=lora)."
            )

    def expert_routing(self, config: Config) -> str:
        """`model.expert_routing`, checked, or its default: `step` when both experts train under FSDP or DeepSpeed
        on several processes, else `sample`."""
        strategy, routing = config.parallel.strategy, self.config.expert_routing
        sharded = parallel.world_size() > 1 and strategy in ("fsdp", "deepspeed")
        both = len(self.trained_experts) == 2
        if routing == "step" and not both:
            raise ConfigError(f"model.expert_routing=step with model.experts={self.config.experts}: one expert "
                              "trains, so every step runs it already.\nWhat to do: remove model.expert_routing.")
        if routing == "sample" and sharded and both:
            # A rank whose samples all fall on one expert would skip the other expert's sharded collectives while
            # the other ranks wait in them; DDP instead finds the skipped parameters (vidtune/parallel/ddp.py).
            raise ConfigError(
                f"model.expert_routing=sample with parallel.strategy={strategy}: a step could run one expert on "
                "one process and the other on another, which sharded training cannot follow.\nWhat to do: remove "
                "model.expert_routing (under fsdp and deepspeed each step trains one expert on every process), or "
                "set parallel.strategy=ddp."
            )
        resolved = routing or ("step" if sharded and both else "sample")
        if resolved == "step" and traits_of(config).learns_sampling_steps:
            where = f"parallel.strategy={strategy}" if routing is None else "model.expert_routing=step"
            raise ConfigError(
                f"{where} with training.algorithm={config.training.algorithm} on two experts: each step would have to "
                "train one expert, but the student's windows of sampling steps pick their experts by its schedule.\n"
                "What to do: set parallel.strategy=ddp (or train on one process) and remove model.expert_routing."
            )
        return resolved

    def initial_adapters(self, path: Path) -> dict[str, Path]:
        """Two experts: a folder holding each trained expert's file (a two-expert run's output_dir:
        `pytorch_lora_weights.safetensors` for the high-noise expert, `..._transformer_2.safetensors` for the
        low-noise one), or, when one expert trains (`model.experts`), that expert's file itself."""
        if not self.two_experts:
            return super().initial_adapters(path)
        files = {"transformer": LORA_WEIGHTS, "transformer_2": second_expert_file(LORA_WEIGHTS)}
        if path.is_dir():
            wanted = {f"{name}.": path / files[name] for name in self.trained_experts}
            missing = [file.name for file in wanted.values() if not file.is_file()]
            if missing:
                raise ConfigError(
                    f"lora.init_from: the folder {path} lacks {' and '.join(missing)} (model.experts="
                    f"{self.config.experts or 'both'} starts each trained expert from its own file).\nWhat to do: give "
                    "the output_dir of a two-expert run, or a folder holding those files."
                )
            return wanted
        if not path.is_file():
            raise ConfigError(f"lora.init_from: {path} is neither a file nor a folder.\nWhat to do: give a two-expert "
                              f"run's output_dir (it holds {' and '.join(files.values())}).")
        if len(self.trained_experts) == 2:
            raise ConfigError(
                f"lora.init_from: {path} is one adapter file, but model.experts=both trains an adapter for each of "
                f"the two experts of {self.config.pretrained}.\nWhat to do: give the folder holding both files "
                f"({' and '.join(files.values())}; e.g. a two-expert run's output_dir), or train one expert "
                "(model.experts=high_noise or low_noise)."
            )
        return {f"{self.trained_experts[0]}.": path}

    def component_dtype(self, component: str, device: torch.device) -> torch.dtype:
        # The second expert is a transformer too: model.transformer_dtype applies to it.
        return super().component_dtype("transformer" if component == "transformer_2" else component, device)

    # ----- denoiser and objective -----------------------------------------------------------------------------
    def load_denoiser(self, device: torch.device, load_on: torch.device | None = None) -> nn.Module:
        """TI2V-5B: its transformer. A14B: both experts as one `TwoExperts` module (the untrained one too, for
        validation); on a GPU the idle expert's frozen weights are kept in CPU memory once training runs.
        `load_on`: where the weights are placed first (quantized base weights: host memory; see
        vidtune/offload.py)."""
        if not self.two_experts:
            return super().load_denoiser(device, load_on)
        dtype = self.component_dtype("transformer", device)
        experts = [self.load_component(self.denoiser_class, name, torch_dtype=dtype) for name in EXPERT_NAMES]
        pair = TwoExperts(*experts, boundary_timestep=self.boundary_timestep, trained=self.trained_experts,
                          device=device, offload=device.type != "cpu")
        untrained = [expert for name, expert in zip(EXPERT_NAMES, experts, strict=True)
                     if name not in self.trained_experts]
        for expert in untrained:
            expert.requires_grad_(False)
        # Both start on the device, so that adapters, optimizer state and the weights' average are made there;
        # with offloading, the first forward moves the idle expert's frozen weights out.
        return pair.to(load_on or device)

    def objective(self, training: TrainingConfig) -> Objective:
        """One expert of two: only noise levels on its side of the boundary (the pipeline never asks it others).
        Both: the scheduler's objective (routed per step, where the run needs it, by `step_objective`)."""
        objective = super().objective(training)
        if not self.two_experts or len(self.trained_experts) == 2:
            return objective
        if self.trained_experts == ("transformer",):
            return NoiseRange(objective, self.boundary_timestep, float("inf"))
        return NoiseRange(objective, float("-inf"), self.boundary_timestep)

    def step_objective(self, objective: Objective, config: Config, step: int, tokens: int | None = None
                       ) -> Objective:
        """Both experts routed per step (`model.expert_routing` for this run: `step`): the noise levels of the
        step's expert, drawn alike on every rank; else `objective` itself."""
        if not self.two_experts or len(self.trained_experts) != 2 or self.expert_routing(config) != "step":
            return objective
        return StepRouted(objective, self.boundary_timestep, config.training.seed).for_step(step, tokens)

    # ----- what generic code asks of the denoiser ------------------------------------------------------------
    def denoiser_parts(self, denoiser: nn.Module) -> dict[str, nn.Module]:
        """Two experts: each, by its pipeline component name (its keys' prefix)."""
        if isinstance(denoiser, TwoExperts):
            return {name: denoiser.expert(name) for name in EXPERT_NAMES}
        return super().denoiser_parts(denoiser)

    def control_parts(self, denoiser: nn.Module) -> dict[str, nn.Module]:
        """Two experts: each trained one (`check_training` lets control runs train both)."""
        if isinstance(denoiser, TwoExperts):
            return {name: denoiser.expert(name) for name in denoiser.trained}
        return super().control_parts(denoiser)

    def control_target(self, denoiser: nn.Module, pipeline: Any) -> nn.Module:
        """Two experts: the module holding both (the pipeline calls each expert, the router knows them)."""
        return denoiser if isinstance(denoiser, TwoExperts) else super().control_target(denoiser, pipeline)

    def keep_weights_placed(self, denoiser: nn.Module) -> None:
        """Two experts: the idle expert's frozen weights stay where they are instead of moving to host memory."""
        if isinstance(denoiser, TwoExperts):
            denoiser.offload = False

    def parts_taking_turns(self, denoiser: nn.Module, device: torch.device, batch_size: int) -> list[nn.Module]:
        """Two experts on a GPU with one clip per micro-batch: one expert runs at a time, the idle one's frozen
        weights wait in host memory (a larger batch may hold clips of both experts, and keeps both on the device;
        on a CPU both stay where they are)."""
        if isinstance(denoiser, TwoExperts) and device.type == "cuda" and batch_size == 1:
            return denoiser.experts()
        return super().parts_taking_turns(denoiser, device, batch_size)

    # ----- tensors ---------------------------------------------------------------------------------------------
    def token_timesteps(self, denoiser: nn.Module, timesteps: torch.Tensor, latents: torch.Tensor,
                        clean_first_frame: bool) -> torch.Tensor:
        """TI2V-5B's timestep per latent token ([B, tokens]), as the pipelines build it: the sample's timestep
        everywhere, 0 on a kept-clean first frame."""
        _, patch_h, patch_w = denoiser.config.patch_size
        batch, _, frames, height, width = latents.shape
        mask = torch.ones(batch, frames, height // patch_h, width // patch_w, device=latents.device)
        if clean_first_frame:
            mask[:, 0] = 0
        return (mask * timesteps.to(latents.device).view(batch, 1, 1, 1)).flatten(1)

    def forward(
        self, denoiser: nn.Module, conditions: Conditions, noisy_latents: torch.Tensor, timesteps: torch.Tensor
    ) -> torch.Tensor:
        if self.expand_timesteps:
            timesteps = self.token_timesteps(denoiser, timesteps, noisy_latents, clean_first_frame=False)
        return super().forward(denoiser, conditions, noisy_latents, timesteps)

    # ----- pipeline and outputs --------------------------------------------------------------------------------
    def pipeline_experts(self, denoiser: nn.Module) -> dict[str, Any]:
        """The pipeline's transformer arguments: one transformer, or both experts with the boundary."""
        if isinstance(denoiser, TwoExperts):
            return {"transformer": denoiser.transformer, "transformer_2": denoiser.transformer_2,
                    "boundary_ratio": self.boundary_ratio}
        return {"transformer": denoiser, "expand_timesteps": self.expand_timesteps}

    def pipeline(self, text: TextComponents, vae: nn.Module, denoiser: nn.Module) -> Any:
        return WanPipeline(tokenizer=text["tokenizer"], text_encoder=text["text_encoder"], vae=vae,
                           scheduler=self.load_scheduler(), **self.pipeline_experts(denoiser))

    def denoiser_folders(self, denoiser: nn.Module) -> dict[str, nn.Module]:
        """A full fine-tune of both experts: `transformer/` and `transformer_2/`, as the pipeline's components."""
        if isinstance(denoiser, TwoExperts):
            return {name: denoiser.expert(name) for name in EXPERT_NAMES}
        return super().denoiser_folders(denoiser)

    def save_lora(self, folder: Path, state_dict: dict[str, torch.Tensor], metadata: dict | None,
                  weight_name: str = LORA_WEIGHTS) -> Path:
        """One expert's adapter keys carry no prefix (TI2V-5B) and go to `weight_name`; a `TwoExperts` adapter's
        `transformer.` keys go there too and its `transformer_2.` keys to `second_expert_file(weight_name)`, each
        in the format `load_lora_weights` reads. Returns the high-noise file, or the low-noise one alone."""
        if not any(key.startswith(f"{name}.") for key in state_dict for name in EXPERT_NAMES):
            return super().save_lora(folder, state_dict, metadata, weight_name)
        written = []
        for name, file_name in (("transformer", weight_name), ("transformer_2", second_expert_file(weight_name))):
            part = {key.removeprefix(f"{name}."): value for key, value in state_dict.items()
                    if key.startswith(f"{name}.")}
            if part:  # the same format for both: `load_into_transformer_2=True` picks the expert when loading
                written.append(super().save_lora(folder, part, metadata, file_name))
        return written[0]

    def load_lora(self, pipeline: Any, folder: Path, weight_name: str = LORA_WEIGHTS) -> None:
        """Both experts' adapters of a run folder into the pipeline: `weight_name` into `transformer`, its
        `_transformer_2` file into `transformer_2`, each when present."""
        base = weight_name.replace("_transformer_2", "")
        high, low = Path(folder) / base, Path(folder) / second_expert_file(base)
        if not high.is_file() and not low.is_file():
            raise ModelError(f"{folder} holds neither {high.name} nor {low.name}.\nWhat to do: give the folder of a "
                             "finished run.")
        if high.is_file():
            self.load_adapter_file(pipeline, high)
        if low.is_file():
            if getattr(pipeline, "transformer_2", None) is None:
                raise ModelError(f"{low} is a low-noise expert's adapter, but {self.config.pretrained} has no second "
                                 "expert.\nWhat to do: load it with the two-expert model it was trained on.")
            self.load_adapter_file(pipeline, low, "transformer_2")


class Wan22ImageToVideoSpec(WanImageConditioning, Wan22Spec):
    """Wan 2.2 image-to-video: TI2V-5B from an image, or I2V-A14B. The image is the first frame of the `reference`
    clip (validation gives the first dataset clip)."""

    name = "wan2.2-i2v"
    image_to_video = True
    pipeline_class = WanImageToVideoPipeline
    published_guidance: ClassVar[dict[str, float]] = {"ti2v": 5.0, "two_experts": 3.5}

    def wan_modes(self) -> tuple[ModeName, ...]:
        """A14B: extension, first-last (the pipeline's `last_image`: no CLIP tokens to give it) and inpainting, all
        through its image condition. TI2V-5B: extension and inpainting in place, as it takes its first image (the
        given latents where the pipeline's `first_frame_mask` is 0, their tokens at timestep 0)."""
        return REGION_MODES if self.expand_timesteps else ("extension", "first_last", "inpaint")

    @property
    def conditioning_refusal(self) -> str:  # type: ignore[override]
        if self.expand_timesteps:
            return ("WanImageToVideoPipeline gives TI2V-5B (`expand_timesteps`) what it keeps in place and ignores "
                    "`last_image`, so no last frame")
        return "WanImageToVideoPipeline always takes a first image, so no last frame alone"

    def given_region(self, conditions: Conditions, shape: torch.Size | tuple[int, ...]) -> torch.Tensor:
        """TI2V: the kept region in whole tokens (a token runs at one timestep: given only when all its cells are),
        and the first latent frame of a sample drawing no mode (plain image-to-video: the image in place)."""
        region = super().given_region(conditions, shape)
        if not self.expand_timesteps:
            return region
        _, patch_h, patch_w = self.compression[2]
        frames, height, width = shape[-3:]
        whole = -torch.nn.functional.max_pool3d(-region, (1, patch_h, patch_w))
        region = whole.repeat_interleave(patch_h, dim=3).repeat_interleave(patch_w, dim=4)[..., :height, :width]
        plain = ~is_mode(conditions[MODE].flatten(), REGION_MODES).to(region.device)
        if frames > 1:  # a still trains unconditioned, as without modes
            region[:, :, 0] = torch.where(plain.view(-1, 1, 1, 1), torch.ones_like(region[:, :, 0]),
                                          region[:, :, 0])
        return region

    def in_place_modes(self, denoiser: nn.Module, conditions: Conditions, noisy_latents: torch.Tensor,
                       timesteps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """TI2V with drawn modes: the noisy latents with each sample's given region clean (the image's own latent as
        the first frame of a plain sample), and a timestep per token, 0 on the given tokens."""
        given = self.given_region(conditions, noisy_latents.shape)
        clean = conditions[LATENTS].to(noisy_latents)
        if noisy_latents.shape[2] > 1:
            plain = ~is_mode(conditions[MODE].flatten(), REGION_MODES).to(clean.device).view(-1, 1, 1, 1, 1)
            first = torch.where(plain, conditions["first_frame_latents"].to(clean), clean[:, :, :1])
            clean = torch.cat([first, clean[:, :, 1:]], dim=2)
        _, patch_h, patch_w = denoiser.config.patch_size
        learnt = (1.0 - given[:, 0, :, ::patch_h, ::patch_w]).flatten(1)
        return give(noisy_latents, clean, given), learnt * timesteps.to(learnt).view(-1, 1)

    def latent_identity(self) -> dict[str, Any]:
        # TI2V keeps the image's own latent; A14B builds Wan 2.1's mask + first-frame condition.
        return {**super().latent_identity(), "first_frame": "latent" if self.expand_timesteps else "mask+latents"}

    @torch.no_grad()
    def prepare_latents(self, vae: nn.Module, videos: torch.Tensor) -> Latents:
        latents = super().prepare_latents(vae, videos)
        first_frames = videos[:, 0]
        if self.expand_timesteps:
            # The image alone through the VAE (argmax), normalised: what the pipeline puts in the first frame.
            pixels = first_frames.to(device=vae.device, dtype=vae.dtype).unsqueeze(2)
            latents["first_frame_latents"] = self.normalise(vae, vae.encode(pixels).latent_dist.mode())
        else:
            latents["image_condition"] = self.image_condition(vae, first_frames, videos.shape[1])
            if self.takes_first_last:  # the pipeline's `last_image` condition, for the samples drawing first-last
                latents[FIRST_LAST_CONDITION] = self.image_condition(vae, first_frames, videos.shape[1],
                                                                     videos[:, -1])
        return latents

    def with_first_frame(self, conditions: Conditions, noisy_latents: torch.Tensor) -> torch.Tensor:
        """TI2V: the noisy latents with the first frame replaced by the image's clean latent (the pipeline's
        `(1 - mask) * condition + mask * latents`)."""
        first = conditions["first_frame_latents"].to(noisy_latents.dtype)
        return torch.cat([first, noisy_latents[:, :, 1:]], dim=2)

    def forward(
        self, denoiser: nn.Module, conditions: Conditions, noisy_latents: torch.Tensor, timesteps: torch.Tensor
    ) -> torch.Tensor:
        dtype = noisy_latents.dtype
        if self.expand_timesteps and MODE in conditions:
            hidden_states, timesteps = self.in_place_modes(denoiser, conditions, noisy_latents, timesteps)
        elif self.expand_timesteps and noisy_latents.shape[2] == 1:
            # A still (one latent frame) would be the image itself: it trains unconditioned, as text-to-image.
            hidden_states = noisy_latents
            timesteps = self.token_timesteps(denoiser, timesteps, noisy_latents, clean_first_frame=False)
        elif self.expand_timesteps:
            hidden_states = self.with_first_frame(conditions, noisy_latents)
            timesteps = self.token_timesteps(denoiser, timesteps, noisy_latents, clean_first_frame=True)
        else:
            conditions = self.mode_conditions(conditions)
            hidden_states = torch.cat([noisy_latents, conditions["image_condition"].to(dtype)], dim=1)
        return denoiser(
            hidden_states=hidden_states,
            timestep=timesteps.to(noisy_latents.device),
            encoder_hidden_states=conditions["prompt_embeds"].to(dtype),
            return_dict=False,
        )[0]

    def per_clip_error(self, error: torch.Tensor, conditions: Conditions) -> torch.Tensor:
        """TI2V: the first frame is the image, not a prediction (the pipeline discards it): left out of the loss
        (a still, one latent frame, trains unconditioned: all of it counts). A14B's modes: `WanConditioningModes`."""
        if MODE in conditions:
            return super().per_clip_error(error, conditions)
        if self.expand_timesteps and error.shape[2] > 1:
            error = error[:, :, 1:]
        return error.flatten(1).mean(dim=1)

    def pipeline(self, text: TextComponents, vae: nn.Module, denoiser: nn.Module) -> Any:
        return self.region_pipeline_class()(tokenizer=text["tokenizer"], text_encoder=text["text_encoder"], vae=vae,
                                       scheduler=self.load_scheduler(), image_processor=None, image_encoder=None,
                                       **self.pipeline_experts(denoiser))

    def call_pipeline(self, pipeline: Any, prompt: str, frames: int, height: int, width: int,
                      num_inference_steps: int, guidance_scale: float, generator: torch.Generator, output_type: str,
                      reference: torch.Tensor | None = None, callback: StepCallback | None = None,
                      given: Given | None = None) -> Any:
        """TI2V: the pipeline puts the image's latent into the first frame only after its loop, so a step callback
        is shown the latents with that frame already in place (what the pipeline returns after the last step);
        the pipeline's own latents are left as they are."""
        if callback is None or not self.expand_timesteps or given is not None:
            return super().call_pipeline(pipeline, prompt, frames, height, width, num_inference_steps,
                                         guidance_scale, generator, output_type, reference, callback, given)
        first = self.pipeline_first_frame(pipeline, reference, frames, height, width)

        def with_image(pipe: Any, step: int, timestep: Any, tensors: dict[str, Any]) -> dict[str, Any]:
            latents = tensors["latents"]
            shown = torch.cat([first.to(latents), latents[:, :, 1:]], dim=2)
            result = dict(callback(pipe, step, timestep, {**tensors, "latents": shown}))
            if result.get("latents") is shown:
                result["latents"] = latents
            return result

        return super().call_pipeline(pipeline, prompt, frames, height, width, num_inference_steps, guidance_scale,
                                     generator, output_type, reference, with_image)

    @torch.no_grad()
    def pipeline_first_frame(self, pipeline: Any, reference: torch.Tensor | None, frames: int, height: int,
                             width: int) -> torch.Tensor:
        """The first-frame latent the pipeline computes from the reference image (its own `prepare_latents`)."""
        image = self.pipeline_inputs(reference)["image"]
        pixels = pipeline.video_processor.preprocess(image, height=height, width=width)
        device = next(pipeline.vae.parameters()).device
        _, condition, _ = pipeline.prepare_latents(
            pixels.to(device, torch.float32), 1, pipeline.vae.config.z_dim, height, width, frames, torch.float32,
            device, torch.Generator(device=device).manual_seed(0))
        return condition

    def pipeline_inputs(self, reference: torch.Tensor | None = None) -> dict[str, Any]:
        return {"image": self.first_frame_image(reference)}

