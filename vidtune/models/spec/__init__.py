"""The ModelSpec contract: what a model family provides, and nothing about how it is trained.

A spec knows how to load its components, how to turn captions and clips into the tensors its denoiser
takes, how to call the denoiser, which objective its scheduler implies, and how to sample and save in
its diffusers pipeline's format. Trainers only ever talk to this interface.

Each job is a part in its own module, and `ModelSpec` is their composition (see docs/architecture.md):
    loading.py    components, model_index.json, source and hub checks, dtypes;
    encoding.py   captions and clips into conditions and latents, clip shapes, cache identity, sound format;
    denoising.py  the denoiser's call, each clip's error, the objective, per-visit conditions, control packing;
    sampling.py   the family's pipeline and `sample`;
    formats.py    LoRA targets and files, initial adapters, denoiser folders, ComfyUI names.
Shared conventions (tensor keys, the latent layout) are in base.py, clip-shape rules in shapes.py. Everything
imported from `vidtune.models.spec` is re-exported here.
"""

from __future__ import annotations

from vidtune.models.spec.base import (
    CONTROL_INPUT,
    CONTROL_LATENTS,
    FRAME_RATE,
    LOSS_MASK,
    LOSS_MASK_BY_FRAME,
    POSTERIOR_KEYS,
    Conditions,
    Latents,
    SpecBase,
    draw_latent,
    frames_to_pil,
)
from vidtune.models.spec.denoising import Denoising
from vidtune.models.spec.encoding import Encoding
from vidtune.models.spec.formats import (
    ALL_LINEAR,
    ATTENTION_TARGETS,
    FEED_FORWARD_TARGETS,
    JOINT_ATTENTION_TARGETS,
    Formats,
)
from vidtune.models.spec.hooks import DenoiserHooks
from vidtune.models.spec.loading import Loading, TextComponents, VAEWithExtras, resolve_dtype
from vidtune.models.spec.sampling import GeneratedSample, SampleOutput, Sampling, StepCallback, step_callback
from vidtune.models.spec.shapes import (
    PUBLISHED_SHAPE_RULES,
    frame_count_problem,
    nearest_multiple,
    raise_shape_problems,
    shape_rule,
    side_problems,
)


class ModelSpec(Denoising, Sampling, Formats, Loading, Encoding, DenoiserHooks):
    """One model family: the six parts composed (the sixth, `DenoiserHooks`: what generic code asks about the
    denoiser module besides computing with it). A family subclasses it, sets the class attributes and implements
    the abstract methods (`check_video_shape`, `prepare_conditions`, `prepare_latents`, `forward`, `pipeline`),
    overriding any part's method its model needs.

    Composed by inheritance, not held as part objects: every caller keeps calling `spec.<method>` and a family
    overrides a method of any part in its one class, as before the split. Denoising extends Loading (it reads the
    denoiser's config and the scheduler) and Sampling extends Encoding (a pipeline call takes encoded captions); no
    other part reads another."""


__all__ = [
    "ALL_LINEAR",
    "ATTENTION_TARGETS",
    "CONTROL_INPUT",
    "CONTROL_LATENTS",
    "FEED_FORWARD_TARGETS",
    "FRAME_RATE",
    "JOINT_ATTENTION_TARGETS",
    "LOSS_MASK",
    "LOSS_MASK_BY_FRAME",
    "POSTERIOR_KEYS",
    "PUBLISHED_SHAPE_RULES",
    "Conditions",
    "DenoiserHooks",
    "Denoising",
    "Encoding",
    "Formats",
    "GeneratedSample",
    "Latents",
    "Loading",
    "ModelSpec",
    "SampleOutput",
    "Sampling",
    "SpecBase",
    "StepCallback",
    "TextComponents",
    "VAEWithExtras",
    "draw_latent",
    "frame_count_problem",
    "frames_to_pil",
    "nearest_multiple",
    "raise_shape_problems",
    "resolve_dtype",
    "shape_rule",
    "side_problems",
    "step_callback",
]
