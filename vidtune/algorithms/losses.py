"""The training losses, one function of (context, batch) each, and what they share.

Every loss draws a visit's inputs the same way (`noisy_inputs`: latent, noise level, noise and caption dropout
from the visit's own generator, so a resumed run draws exactly what it would have) and returns a `LossOutput`: the
micro-batch's summed loss and, where it is a denoising loss, each sample's loss and noise levels for
metrics.jsonl. `loss_function(traits)` picks the one an algorithm trains with:

- `denoising_loss`: each clip's weighted error of the denoiser's prediction (`clip_losses`: the spec's training
  error and the objective's loss weights); the held-out score (`vidtune.evaluation`) and `vidtune plan`'s traced
  step call the same `clip_losses`;
- `control_loss`: the same, with the control latents handed to the widened input layer;
- `guidance_distillation_loss`: the error to the frozen teacher's guided prediction;
- `step_distillation_loss`: the error to the velocity of one Euler step over the teacher's window;
- `preservation_loss` (`training.preserve_base`, added to the denoising loss by `with_preservation`): the error of
  the adapter's prediction to the base model's on captions without the trigger word.

Each clip's loss is multiplied by its source's `loss_weight` (`source_weighted`), and the regularization sources'
share is logged apart.

A new loss is one more function here with the signature of `LossFunction`, named by `loss_function`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch
from torch import nn

from vidtune import parallel
from vidtune.algorithms import AlgorithmTraits
from vidtune.data.buckets import visit_generator
from vidtune.data.inputs import input_key
from vidtune.models.spec import (
    CONTROL_LATENTS,
    LOSS_MASK,
    LOSS_MASK_BY_FRAME,
    POSTERIOR_KEYS,
    Conditions,
    ModelSpec,
    draw_latent,
)
from vidtune.objectives import FlowMatching, per_clip_levels
from vidtune.schedulers import sampling_sigmas

if TYPE_CHECKING:
    from vidtune.algorithms.part import AlgorithmPart
    from vidtune.batches import Batch
    from vidtune.config import Config
    from vidtune.objectives import Objective
    from vidtune.parallel.strategy import Strategy

# The names of a loss's parts in metrics.jsonl.
REGULARIZATION = "loss/regularization"
PRESERVATION = "loss/preservation"
# Seed offsets of the draws a visit adds (a guidance scale, a window): apart from its noise, so those stay as in lora.
GUIDANCE_SEED_OFFSET = 7
WINDOW_SEED_OFFSET = 11


class LossContext(Protocol):
    """What a loss reads of the training set-up (`vidtune.training.context.TrainingContext` has all of it)."""

    @property
    def config(self) -> Config: ...
    @property
    def spec(self) -> ModelSpec: ...
    @property
    def objective(self) -> Objective: ...
    @property
    def device(self) -> torch.device: ...
    @property
    def bf16(self) -> bool: ...
    @property
    def denoiser(self) -> nn.Module: ...  # the plain denoiser (its dtype, the held-out score's forwards)
    @property
    def trained_denoiser(self) -> nn.Module: ...  # what training calls: the data-parallel wrapper, or the denoiser
    @property
    def part(self) -> AlgorithmPart: ...
    @property
    def strategy(self) -> Strategy: ...
    @property
    def empty_caption(self) -> Conditions: ...  # caption dropout's `empty` caption (empty when unused)
    @property
    def step(self) -> int: ...  # the optimizer step being taken


@dataclass(frozen=True)
class LossOutput:
    """A micro-batch's loss: the sum over its samples, and (a denoising loss) each sample's loss and its noise
    levels by metrics key ("sigmas" or "timesteps"; other streams' too), for metrics.jsonl."""

    total: torch.Tensor
    sample_losses: torch.Tensor | None = None
    levels: dict[str, torch.Tensor] = field(default_factory=dict)
    # Named shares of `total` logged beside it (summed like it): "loss/regularization", "loss/preservation".
    parts: dict[str, torch.Tensor] = field(default_factory=dict)


LossFunction = Callable[["LossContext", "Batch"], LossOutput]


@dataclass
class NoisyInputs:
    """What the denoiser sees for one micro-batch, and what it should predict."""

    conditions: Conditions
    noisy: torch.Tensor
    timesteps: torch.Tensor
    target: torch.Tensor
    levels: torch.Tensor  # the objective's noise levels (sigmas or DDPM timesteps; [B, F] per frame), loss weights
    x0: torch.Tensor | None = None  # the clean latents and the noise they were mixed with (for distillation)
    noise: torch.Tensor | None = None
    # Other streams' noise levels by metrics key (LTX-2's "audio_sigmas"), as `ModelSpec.stream_noise` drew them.
    stream_levels: dict[str, torch.Tensor] = field(default_factory=dict)


# ----- the inputs every loss draws ---------------------------------------------------------------------------------
def noisy_inputs(context: LossContext, batch: Batch) -> NoisyInputs:
    """Draw each clip's latent, noise level, noise and caption dropout from its visit's own generator."""
    config, spec = context.config, context.spec
    seed = config.training.seed
    generators = [visit_generator(seed, int(position)) for position in batch.positions]
    latents = spec.training_latents(batch.latents)
    tokens = spec.token_count(latents[POSTERIOR_KEYS[0]].shape[1:])  # one bucket shape a batch
    # The step's noise levels: the family may narrow them per step, alike on every rank (vidtune/models/spec/hooks.py).
    objective = spec.step_objective(context.objective, config, context.step, tokens)
    frames = latents[POSTERIOR_KEYS[0]].shape[2]  # latent frames, for per-frame noise levels
    levels = torch.cat([objective.sample_noise_levels(1, g, tokens, frames=frames) for g in generators])
    x0 = torch.cat([
        draw_latent({k: latents[k][i : i + 1] for k in POSTERIOR_KEYS}, g) for i, g in enumerate(generators)
    ]).float()
    noise = torch.cat([torch.randn(x0.shape[1:], generator=g).unsqueeze(0) for g in generators]).to(x0.device)
    conditions = batch.conditions
    if config.data.drops_captions():  # each clip's own probability: its source's, else data.caption_dropout
        drop = torch.tensor([float(torch.rand(1, generator=g)) < float(p) for g, p in zip(generators,
                                                                                           batch.dropout, strict=True)])
        conditions = apply_caption_dropout(context, conditions, drop)
    # Video-derived conditions (e.g. first-frame latents) never take part in caption dropout, nor do the other
    # streams' noise, drawn last from each visit's generator.
    conditions = {**conditions, **{k: v for k, v in latents.items() if k not in POSTERIOR_KEYS},
                  **spec.visit_conditions(x0, batch.positions, seed)}
    conditions = with_loss_mask(config, conditions)
    stream_inputs, stream_levels = (spec.stream_noise(objective, batch.latents, generators)
                                    if context.part.traits.stream_noise_levels else ({}, {}))
    return NoisyInputs({**conditions, **stream_inputs}, objective.noisy(x0, noise, levels),
                       objective.timesteps(levels).to(x0.device), objective.target(x0, noise, levels),
                       levels, x0, noise, stream_levels)


def with_loss_mask(config: Config, conditions: Conditions) -> Conditions:
    """`training.masked_loss`: each clip's mask on the latent grid (its `input_mask`, among the video-derived
    conditions) as the loss mask `spec.clip_error` weights its error by; the conditions as they are otherwise."""
    if not config.training.masked_loss:
        return conditions
    mask = conditions[input_key("mask")]
    by_frame = {LOSS_MASK_BY_FRAME: torch.ones(mask.shape[0], dtype=torch.bool)} \
        if config.training.masked_loss_area == "frame" else {}
    return {**conditions, LOSS_MASK: mask, **by_frame}


def apply_caption_dropout(context: LossContext, conditions: Conditions, drop: torch.Tensor) -> Conditions:
    """The dropped clips' caption replaced by the empty one (`data.caption_dropout_technique: empty`) or zeros."""
    if not bool(drop.any()):
        return conditions
    if context.config.data.caption_dropout_technique == "zero":
        replacement = context.spec.empty_conditions(conditions)
    else:
        replacement = {k: v.expand_as(conditions[k]) for k, v in context.empty_caption.items()}
    mask = drop.to(conditions[next(iter(conditions))].device)
    return {
        key: torch.where(mask.view(-1, *([1] * (value.ndim - 1))), replacement[key].to(value), value)
        for key, value in conditions.items()
    }


# ----- denoising ---------------------------------------------------------------------------------------------------
def clip_losses(context: LossContext, inputs: NoisyInputs, denoiser: nn.Module | None = None) -> torch.Tensor:
    """Each clip's weighted error [B] for these inputs: what training sums, and what the held-out score averages
    (`denoiser`: the module to call; default the one training calls). With a control input (`control`), the control
    latents among the inputs' video-derived conditions are appended to the denoiser's input (`in_context`: to its
    sequence, as reference tokens)."""
    if denoiser is None:
        denoiser = context.trained_denoiser
    traits, conditions = context.part.traits, inputs.conditions
    control = contextlib.nullcontext()
    if traits.in_context:  # the control latents join the sequence as the family places reference tokens
        conditions = context.spec.in_context_conditions(conditions, conditions[CONTROL_LATENTS],
                                                        context.config.control.with_audio)
    elif traits.control:
        control = context.part.control_given(conditions[CONTROL_LATENTS])
    with control, torch.autocast(context.device.type, dtype=torch.bfloat16, enabled=context.bf16):
        per_clip = context.spec.training_error(denoiser, conditions, inputs.noisy.to(context.denoiser.dtype),
                                               inputs.timesteps, inputs.target)
    return per_clip * context.objective.loss_weights(inputs.levels).to(per_clip.device)


def source_weighted(context: LossContext, batch: Batch, per_clip: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Each clip's loss times its source's `loss_weight`, and the regularization clips' share of their sum
    ("loss/regularization", logged whenever a source has `role: regularization`)."""
    weighted = per_clip * batch.loss_weights.to(per_clip)
    if not context.config.data.regularizes():
        return weighted, {}
    share = (weighted * batch.regularization.to(weighted.device)).sum()
    return weighted, {REGULARIZATION: share.detach()}


def denoising_loss(context: LossContext, batch: Batch) -> LossOutput:
    """Sum over the micro-batch of each clip's weighted mean squared error (with the control latents, for a control
    algorithm), each clip's times its source's `loss_weight`."""
    inputs = noisy_inputs(context, batch)
    losses, parts = source_weighted(context, batch, clip_losses(context, inputs))
    return LossOutput(losses.sum(), losses.detach(),
                      {context.objective.level_name: per_clip_levels(inputs.levels), **inputs.stream_levels}, parts)


control_loss = denoising_loss  # `clip_losses` hands a control algorithm's latents to the widened layer


# ----- preserving the base model -----------------------------------------------------------------------------------
def preservation_loss(context: LossContext, batch: Batch) -> LossOutput:
    """`training.preserve_base`: W x each clip's mean squared error between the adapter's prediction and the base
    model's (the same denoiser with its adapter off), both on the visit's preservation caption at the visit's noisy
    latents (the ones `noisy_inputs` draws for the denoising loss: the same generators)."""
    options = context.config.training.preserve_base
    assert options is not None
    inputs = noisy_inputs(context, batch)
    video_derived = {k: v for k, v in inputs.conditions.items() if k not in batch.conditions}
    conditions = {**video_derived, **batch.preserve}
    noisy = inputs.noisy.to(context.denoiser.dtype)
    with context.part.teacher() as base:
        target = predict(context, base, conditions, noisy, inputs.timesteps, None)
    prediction = predict(context, context.trained_denoiser, conditions, noisy, inputs.timesteps, None)
    per_clip = options.weight * context.spec.per_clip_error((prediction - target).pow(2), conditions)
    return LossOutput(per_clip.sum(), parts={PRESERVATION: per_clip.sum().detach()})


def with_preservation(loss: LossFunction) -> LossFunction:
    """`loss` plus `preservation_loss`: their totals and parts summed, `loss`'s per-clip notes kept."""

    def preserving(context: LossContext, batch: Batch) -> LossOutput:
        main, kept = loss(context, batch), preservation_loss(context, batch)
        return LossOutput(main.total + kept.total, main.sample_losses, main.levels, {**main.parts, **kept.parts})

    return preserving


# ----- guidance distillation ---------------------------------------------------------------------------------------
def guided_prediction(cond: torch.Tensor, uncond: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """Classifier-free guidance: uncond + w * (cond - uncond), one w per clip."""
    w = scales.to(cond).view(-1, *([1] * (cond.ndim - 1)))
    return uncond + w * (cond - uncond)


def guidance_scales(config: Config, batch: Batch) -> torch.Tensor:
    """Each clip's guidance scale: `guidance_scale`, or drawn from `guidance_range` by the visit's generator."""
    options = config.distillation
    if options.guidance_range is None:
        return torch.full((len(batch.positions),), options.guidance_scale)
    low, high = options.guidance_range
    seed = config.training.seed + GUIDANCE_SEED_OFFSET
    draws = [float(torch.rand(1, generator=visit_generator(seed, int(p)))) for p in batch.positions]
    return low + (high - low) * torch.tensor(draws)


def predict(context: LossContext, denoiser: nn.Module, conditions: Conditions, noisy: torch.Tensor,
            timesteps: torch.Tensor, embedded: torch.Tensor | None) -> torch.Tensor:
    """One forward; `embedded`: the guidance embedding's scale per clip (None: the family's own)."""
    extra = {} if embedded is None else {"guidance_scale": embedded}
    with torch.autocast(context.device.type, dtype=torch.bfloat16, enabled=context.bf16):
        return context.spec.forward(denoiser, conditions, noisy, timesteps, **extra).float()


def teacher_prediction(context: LossContext, conditions: Conditions, noisy: torch.Tensor, timesteps: torch.Tensor,
                       scales: torch.Tensor) -> torch.Tensor:
    """uncond + w (cond - uncond) of the frozen model against the part's negative prompt; video-derived conditions
    are kept in both."""
    negative = context.part.negative
    uncond = {**conditions, **{k: v.expand_as(conditions[k]).to(conditions[k]) for k, v in negative.items()}}
    with context.part.teacher() as teacher:
        cond_prediction = predict(context, teacher, conditions, noisy, timesteps, None)
        uncond_prediction = predict(context, teacher, uncond, noisy, timesteps, None)
    return guided_prediction(cond_prediction, uncond_prediction, scales)


def guidance_distillation_loss(context: LossContext, batch: Batch) -> LossOutput:
    """Sum over the micro-batch of each clip's mean squared error to the teacher's guided prediction."""
    inputs = noisy_inputs(context, batch)
    noisy = inputs.noisy.to(context.denoiser.dtype)
    scales = guidance_scales(context.config, batch)
    target = teacher_prediction(context, inputs.conditions, noisy, inputs.timesteps, scales)
    embedded = scales if context.config.distillation.guidance_range is not None else None
    prediction = predict(context, context.trained_denoiser, inputs.conditions, noisy, inputs.timesteps, embedded)
    per_clip, parts = source_weighted(context, batch,
                                      context.spec.per_clip_error((prediction - target).pow(2), inputs.conditions))
    return LossOutput(per_clip.sum(), per_clip.detach(),
                      {context.objective.level_name: per_clip_levels(inputs.levels), **inputs.stream_levels}, parts)


# ----- step distillation -------------------------------------------------------------------------------------------
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


def teacher_sigmas(config: Config) -> torch.Tensor:
    """The teacher's N sampling sigmas (and the final 0), through which the student's K windows are cut."""
    return sampling_sigmas(config.distillation.teacher_steps, config.distillation.sigma_shift)


def windows(config: Config, batch: Batch) -> torch.Tensor:
    """Each clip's window (0 .. K - 1), from the visit's own generator."""
    seed, count = config.training.seed + WINDOW_SEED_OFFSET, config.distillation.student_steps
    return torch.cat([torch.randint(0, count, (1,), generator=visit_generator(seed, int(position)))
                      for position in batch.positions])


def missing_teacher_forwards(context: LossContext, count: int) -> int:
    """Sharded weights (FSDP, ZeRO-3): each forward gathers every block's weights from all ranks, so each rank must
    run as many teacher forwards as the rank whose windows start latest. How many this rank, which needs `count`,
    adds (agreed before any of them runs: the agreement is a collective too)."""
    if not context.strategy.forwards_gather_weights or not parallel.is_distributed():
        return 0
    return max(parallel.gather_objects(count)) - count


def window_starts(context: LossContext, teacher: nn.Module, inputs: NoisyInputs, first: torch.Tensor,
                  sigmas: torch.Tensor) -> torch.Tensor:
    """Each clip's latents at its window's first teacher sigma (index `first` into `sigmas`): the clip noised to it
    (`window_start: data`), or the teacher's Euler path to it from the visit's noise (`teacher`)."""
    spec, objective, bf16 = context.spec, context.objective, context.bf16
    if context.config.distillation.window_start == "data":
        return objective.noisy(inputs.x0, inputs.noise, sigmas[first])
    extra = missing_teacher_forwards(context, sum(first.tolist()))
    starts = []
    for i, index in enumerate(first.tolist()):
        conditions = {key: value[i: i + 1] for key, value in inputs.conditions.items()}
        starts.append(sample_euler(spec, objective, teacher, conditions, inputs.noise[i: i + 1],
                                   sigmas[: index + 1], bf16))
    conditions = {key: value[:1] for key, value in inputs.conditions.items()}
    for _ in range(extra):  # results dropped: they run while this rank would wait for the others anyway
        velocity(spec, objective, teacher, conditions, inputs.noise[:1], sigmas[:1], bf16)
    return torch.cat(starts)


def step_distillation_loss(context: LossContext, batch: Batch) -> LossOutput:
    """Sum over the micro-batch of each clip's mean squared error to its window's one-step velocity."""
    config, spec, objective = context.config, context.spec, context.objective
    inputs = noisy_inputs(context, batch)  # its latents, noise and (dropped-out) caption; its noise level unused
    sigmas = teacher_sigmas(config)
    per_window = config.distillation.teacher_steps // config.distillation.student_steps
    first = windows(config, batch) * per_window
    # Each clip's N/K + 1 teacher sigmas, from its window's start to its end.
    paths = torch.stack([sigmas[i: i + per_window + 1] for i in first.tolist()])
    with context.part.teacher() as teacher:
        z_start = window_starts(context, teacher, inputs, first, sigmas)
        z_end = sample_euler(spec, objective, teacher, inputs.conditions, z_start, paths, context.bf16)
    target = window_target(objective, z_start, z_end, paths[:, 0], paths[:, -1])
    with torch.autocast(context.device.type, dtype=torch.bfloat16, enabled=context.bf16):
        prediction = spec.forward(context.trained_denoiser, inputs.conditions, z_start.to(context.denoiser.dtype),
                                  objective.timesteps(paths[:, 0]).to(z_start.device))
    per_clip, parts = source_weighted(context, batch,
                                      spec.per_clip_error((prediction.float() - target).pow(2), inputs.conditions))
    return LossOutput(per_clip.sum(), parts=parts)


def loss_function(traits: AlgorithmTraits, preserve_base: bool = False) -> LossFunction:
    """The loss an algorithm trains with (`preserve_base`: with `preservation_loss` added; the config refuses it
    for algorithms without `traits.preserves_base`)."""
    if traits.learns_sampling_steps:
        return step_distillation_loss
    if traits.teacher_guidance:
        return guidance_distillation_loss
    loss = control_loss if traits.control else denoising_loss
    return with_preservation(loss) if preserve_base and traits.preserves_base else loss
