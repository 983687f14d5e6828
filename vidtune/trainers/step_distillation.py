"""Few-step distillation: a LoRA student that samples in K Euler steps what the frozen model samples in N.

The method is progressive distillation (Salimans & Ho 2022, "Progressive Distillation for Fast Sampling of
Diffusion Models") in the flow-matching (Euler) parametrisation, in one stage of N/K teacher steps per student step
instead of repeated halvings, as trajectory distillation does. The sigma range [1, 0] is cut into K windows at the
K-step sampling sigmas (`sampling_sigmas(K, shift)`, every (N/K)-th of the N-step ones). For each visit: a window k,
its start z_start on the teacher's Euler path from the visit's noise (`distillation.window_start: teacher`), or the
clip noised to the window's start (`data`, cheaper), and the teacher's N/K Euler steps from there to the window's
end (z_end). The student, at z_start and the window's start sigma, learns the velocity whose one Euler step lands
there: (z_end - z_start) / (s_end - s_start). So the student's K-step Euler sampling retraces the teacher's N-step
path window by window.

Why this one: it needs only the ODE the flow-matching families already sample with (no second trained network, no
adversarial loss, no consistency boundary conditions), its targets are exact teacher results, and it trains the
same LoRA as `lora`, saved the same way. We tried PeRFlow's variant (the straight line between z_start and z_end
learnt at every point of the window): K-step Euler sampling only queries the window starts, and on the tiny models
the student came 1.7x nearer the teacher's N-step samples than the teacher's own K steps, against 27x for learning
the starts alone. DDPM families (CogVideoX) are refused: their pipelines sample another ODE (DDIM / DPM-Solver over
alphas) that these Euler windows do not describe.

The student is sampled with K Euler steps over `sampling_sigmas(K, distillation.sigma_shift)` and no guidance
(`sample_euler`); the teacher's steps are unguided. Validation and `vidtune sample` run the family's pipeline with
its scheduler replaced by `vidtune.schedulers.StudentEulerScheduler`, which steps through exactly those sigmas.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn

from vidtune import parallel
from vidtune.batches import Batch
from vidtune.config import Config
from vidtune.data.buckets import visit_generator
from vidtune.errors import ConfigError
from vidtune.models.spec import Conditions, ModelSpec
from vidtune.objectives import FlowMatching
from vidtune.schedulers import sampling_sigmas, student_scheduler
from vidtune.trainers.base import NoisyInputs
from vidtune.trainers.guidance_distillation import student_validation_config
from vidtune.trainers.lora import LoRATrainer

# Seed offset of a visit's window draws: apart from its noise, so those stay as in `lora`.
WINDOW_SEED_OFFSET = 11


def velocity(spec: ModelSpec, objective: FlowMatching, denoiser: nn.Module, conditions: Conditions,
             latents: torch.Tensor, sigmas: torch.Tensor, bf16: bool = False) -> torch.Tensor:
    """d latents / d sigma as the denoiser predicts it (the objective's target, its sign undone), per clip sigma."""
    with torch.autocast(latents.device.type, dtype=torch.bfloat16, enabled=bf16):
        prediction = spec.forward(denoiser, conditions, latents.to(denoiser.dtype),
                                  objective.timesteps(sigmas).to(latents.device)).float()
    return -prediction if objective.negate_target else prediction


def sample_euler(spec: ModelSpec, objective: FlowMatching, denoiser: nn.Module, conditions: Conditions,
                 latents: torch.Tensor, sigmas: torch.Tensor, bf16: bool = False) -> torch.Tensor:
    """Euler steps of the flow ODE through `sigmas`: one schedule [S + 1] for all clips, or one per clip [B, S + 1]."""
    sigmas = sigmas.expand(latents.shape[0], -1) if sigmas.ndim == 1 else sigmas
    latents = latents.float()
    for i in range(sigmas.shape[1] - 1):
        step = (sigmas[:, i + 1] - sigmas[:, i]).to(latents).view(-1, *([1] * (latents.ndim - 1)))
        latents = latents + step * velocity(spec, objective, denoiser, conditions, latents, sigmas[:, i], bf16)
    return latents


def window_target(objective: FlowMatching, start_latents: torch.Tensor, end_latents: torch.Tensor,
                  start: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    """The prediction (in the objective's sign convention) whose one Euler step from `start` to `end` sigma leads
    from `start_latents` to `end_latents`."""
    jump = (end - start).to(start_latents).view(-1, *([1] * (start_latents.ndim - 1)))
    straight = (end_latents - start_latents) / jump
    return -straight if objective.negate_target else straight


def step_distillation_config(config: Config) -> Config:
    """Validation samples as the student is meant to be used: no guidance and, unless set, K steps."""
    config = student_validation_config(config)
    if "num_inference_steps" not in config.validation.model_fields_set:
        validation = config.validation.model_copy(update={"num_inference_steps": config.distillation.student_steps})
        config = config.model_copy(update={"validation": validation})
    return config


class StepDistillationTrainer(LoRATrainer):
    algorithm = "step-distillation"
    resume_fixed_keys = (*LoRATrainer.resume_fixed_keys, "distillation.student_steps", "distillation.teacher_steps",
                         "distillation.sigma_shift", "distillation.window_start")
    stream_noise_levels = False  # the student learns sampling steps, where every stream follows the video's sigmas

    def __init__(self, config: Config) -> None:
        super().__init__(step_distillation_config(config))
        options = self.config.distillation
        self.teacher_sigmas = sampling_sigmas(options.teacher_steps, options.sigma_shift)

    def check_inputs(self) -> None:
        super().check_inputs()
        if not isinstance(self.objective, FlowMatching):
            raise ConfigError(
                f"training.algorithm: step-distillation distils flow-matching models; {self.spec.name} samples with "
                "a DDPM scheduler, whose solver the student's straight windows do not describe.\nWhat to do: use a "
                "flow-matching family (ltx-video, hunyuan-video, mochi, wan, wan-i2v), or training.algorithm=lora / "
                "guidance-distillation for this one."
            )

    def sampling_pipeline(self) -> Any:
        """The family's pipeline stepping through the student's own K sigmas (see vidtune/schedulers.py)."""
        pipeline = super().sampling_pipeline()
        pipeline.scheduler = student_scheduler(pipeline.scheduler, self.config.distillation.sigma_shift)
        return pipeline

    def teacher(self) -> contextlib.AbstractContextManager[nn.Module]:
        return self.frozen_base()

    def windows(self, batch: Batch) -> torch.Tensor:
        """Each clip's window (0 .. K - 1), from the visit's own generator."""
        seed, count = self.config.training.seed + WINDOW_SEED_OFFSET, self.config.distillation.student_steps
        return torch.cat([torch.randint(0, count, (1,), generator=visit_generator(seed, int(position)))
                          for position in batch.positions])

    def window_starts(self, teacher: nn.Module, inputs: NoisyInputs, first: torch.Tensor) -> torch.Tensor:
        """Each clip's latents at its window's first teacher sigma (index `first`): the clip noised to it
        (`window_start: data`), or the teacher's Euler path to it from the visit's noise (`teacher`)."""
        sigmas = self.teacher_sigmas[first]
        if self.config.distillation.window_start == "data":
            return self.objective.noisy(inputs.x0, inputs.noise, sigmas)
        extra = self.missing_teacher_forwards(sum(first.tolist()))
        starts = []
        for i, index in enumerate(first.tolist()):
            conditions = {key: value[i: i + 1] for key, value in inputs.conditions.items()}
            starts.append(sample_euler(self.spec, self.objective, teacher, conditions, inputs.noise[i: i + 1],
                                       self.teacher_sigmas[: index + 1], self.use_bf16))
        conditions = {key: value[:1] for key, value in inputs.conditions.items()}
        for _ in range(extra):  # results dropped: they run while this rank would wait for the others anyway
            velocity(self.spec, self.objective, teacher, conditions, inputs.noise[:1], self.teacher_sigmas[:1],
                     self.use_bf16)
        return torch.cat(starts)

    def missing_teacher_forwards(self, count: int) -> int:
        """Sharded weights (FSDP, ZeRO-3): each forward gathers every block's weights from all ranks, so each rank
        must run as many teacher forwards as the rank whose windows start latest. How many this rank, which needs
        `count`, adds (agreed before any of them runs: the agreement is a collective too)."""
        if not self.strategy.forwards_gather_weights or not parallel.is_distributed():
            return 0
        return max(parallel.gather_objects(count)) - count

    def compute_loss(self, batch: Batch) -> torch.Tensor:
        """Sum over the micro-batch of each clip's mean squared error to its window's one-step velocity."""
        inputs = self.noisy_inputs(batch)  # its latents, noise and (dropped-out) caption; its noise level unused
        per_window = self.config.distillation.teacher_steps // self.config.distillation.student_steps
        first = self.windows(batch) * per_window
        # Each clip's N/K + 1 teacher sigmas, from its window's start to its end.
        paths = torch.stack([self.teacher_sigmas[i: i + per_window + 1] for i in first.tolist()])
        with self.teacher() as teacher:
            z_start = self.window_starts(teacher, inputs, first)
            z_end = sample_euler(self.spec, self.objective, teacher, inputs.conditions, z_start, paths, self.use_bf16)
        target = window_target(self.objective, z_start, z_end, paths[:, 0], paths[:, -1])
        denoiser = self.denoiser if self.trained_denoiser is None else self.trained_denoiser
        with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.use_bf16):
            prediction = self.spec.forward(denoiser, inputs.conditions, z_start.to(self.denoiser.dtype),
                                           self.objective.timesteps(paths[:, 0]).to(z_start.device))
        return self.spec.per_clip_error((prediction.float() - target).pow(2), inputs.conditions).sum()
