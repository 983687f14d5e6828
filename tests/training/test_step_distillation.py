"""Few-step distillation (piecewise rectified flow): the student's K Euler steps land nearer the teacher's N-step
samples than the teacher's own K steps do."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from vidtune.algorithms.distillation import StepDistillationPart
from vidtune.algorithms.lora import LoRAPart
from vidtune.algorithms.losses import sample_euler, window_target
from vidtune.errors import ConfigError
from vidtune.models.registry import available_models
from vidtune.models.tiny import TINY_SHAPES
from vidtune.objectives import FlowMatching
from vidtune.schedulers import sampling_sigmas
from vidtune.trainers import build_trainer

K, N = 2, 16


def _distil(make_config, family: str, steps: int, learning_rate: float):
    config = make_config(
        family,
        training={"steps": steps, "algorithm": "step-distillation", "learning_rate": learning_rate, "batch_size": 2},
        lora={"rank": 32, "alpha": 32, "target_modules": "all-linear"},
        distillation={"student_steps": K, "teacher_steps": N},
        optimizer={"lr_scheduler": "cosine"},
    )
    trainer = build_trainer(config)
    return trainer, trainer.run()


def _samples(trainer, seed: int = 99, count: int = 2):
    """(student K-step, teacher K-step, teacher N-step) samples from the same held-out noise and the clips'
    captions."""
    batch = next(iter(trainer.context.source.batches(0)))
    g = torch.Generator().manual_seed(seed)
    noise = torch.randn((count, *batch.latents["latents_mean"].shape[1:]), generator=g)
    conditions = {k: v[:1].expand(count, *v.shape[1:]) for k, v in batch.conditions.items()}
    conditions |= {k: v[:1].expand(count, *v.shape[1:]) for k, v in batch.latents.items()
                   if k not in ("latents_mean", "latents_std")}
    trainer.context.denoiser.eval()
    with torch.no_grad():
        student = sample_euler(trainer.spec, trainer.context.objective,
                               trainer.context.denoiser, conditions, noise, sampling_sigmas(K))
        with trainer.part.teacher() as teacher:
            few = sample_euler(trainer.spec, trainer.context.objective, teacher, conditions, noise, sampling_sigmas(K))
            many = sample_euler(trainer.spec, trainer.context.objective, teacher, conditions, noise, sampling_sigmas(N))
    return student, few, many


def test_sampling_sigmas_of_k_steps_are_every_n_over_kth_of_n_steps():
    for shift in (1.0, 3.0):
        torch.testing.assert_close(sampling_sigmas(N, shift)[:: N // K], sampling_sigmas(K, shift))
    assert sampling_sigmas(4).tolist() == [1.0, 0.75, 0.5, 0.25, 0.0]


@pytest.mark.parametrize(("family", "steps", "learning_rate"), [("ltx-video", 200, 3e-3), ("wan", 300, 3e-3)])
def test_the_student_samples_in_k_steps_what_the_teacher_samples_in_n(make_config, family, steps, learning_rate):
    trainer, result = _distil(make_config, family, steps, learning_rate)
    assert isinstance(trainer.part, StepDistillationPart) and isinstance(trainer.part.inner, LoRAPart)
    student, few, many = _samples(trainer)
    ours, theirs = (student - many).pow(2).mean().sqrt().item(), (few - many).pow(2).mean().sqrt().item()
    print(f"{family}: student K-step {ours:.4g}, teacher K-step {theirs:.4g}, ratio {theirs / ours:.1f}")
    assert theirs / ours >= 2.0, (ours, theirs)
    assert trainer.config.validation.num_inference_steps == K and trainer.config.validation.guidance_scale == 1.0
    assert (result.output_dir / "pytorch_lora_weights.safetensors").is_file()


def test_ddpm_families_are_refused(make_config):
    trainer = build_trainer(make_config("cogvideox", training={"algorithm": "step-distillation"}))
    with pytest.raises(ConfigError, match=r"step-distillation distils flow-matching models; cogvideox") as error:
        trainer.run()
    assert "What to do:" in str(error.value)


def test_teacher_steps_must_be_a_multiple_of_student_steps(make_config):
    with pytest.raises(ConfigError, match=r"teacher_steps \(10\) must be a multiple of distillation.student_steps"):
        make_config(training={"algorithm": "step-distillation"}, distillation={"student_steps": 4, "teacher_steps": 10})


@pytest.mark.parametrize("family", [name for name in available_models() if not name.startswith("cogvideox")])
def test_every_flow_matching_family_takes_step_distillation_steps(make_config, family):
    trainer = build_trainer(make_config(family, training={"algorithm": "step-distillation", "steps": 2},
                                        distillation={"student_steps": 2, "teacher_steps": 4}))
    losses = trainer.run().losses
    assert all(math.isfinite(loss) for loss in losses) and losses[0] > 0
    assert any(v.abs().max() > 0 for k, v in trainer.part.state_dict().items() if "lora_B" in k)


class _Ideal:
    """A spec whose denoiser predicts the exact target towards one known clean latent, under `objective`'s
    conventions (Mochi's inverted timesteps and negated target included)."""

    def __init__(self, objective: FlowMatching, x0: torch.Tensor) -> None:
        self.objective, self.x0 = objective, x0

    def forward(self, denoiser, conditions, latents, timesteps):
        t = timesteps.float() / 1000.0
        sigma = (1.0 - t if self.objective.invert_timesteps else t).view(-1, 1, 1)
        noise = (latents - (1.0 - sigma) * self.x0) / sigma
        return self.objective.target(self.x0, noise, sigma.flatten())


@pytest.mark.parametrize("inverted", [False, True], ids=["sigma-timesteps", "mochi-convention"])
def test_euler_sampling_follows_the_objectives_convention(inverted):
    """With the exact prediction, Euler steps from noise land on the clean latent in either convention: the sign
    the teacher's steps and the student's target undo is the objective's."""
    objective = FlowMatching(invert_timesteps=inverted, negate_target=inverted)
    x0, noise = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    spec = _Ideal(objective, x0)
    denoiser = SimpleNamespace(dtype=torch.float32)  # only its dtype is read
    torch.testing.assert_close(sample_euler(spec, objective, denoiser, {}, noise, sampling_sigmas(4, 2.0)), x0)
    # The student's target: one Euler step over a window with it lands where the teacher's steps did.
    start, end = torch.tensor([0.8, 0.8]), torch.tensor([0.3, 0.3])
    z_start, z_end = torch.randn(2, 3, 4), torch.randn(2, 3, 4)
    student = SimpleNamespace(forward=lambda d, c, latents, t: window_target(objective, z_start, z_end, start, end))
    torch.testing.assert_close(sample_euler(student, objective, denoiser, {}, z_start, torch.stack([start, end], 1)),
                               z_end)


def test_a_full_student_is_refused(make_config):
    with pytest.raises(ConfigError, match=r"distillation.student=full works with training.algorithm=guidance-distil"):
        make_config(training={"algorithm": "step-distillation"}, distillation={"student": "full"})


@pytest.mark.parametrize("family", ["ltx-video", "wan", "mochi", "hunyuan-video"])
def test_the_pipeline_queries_the_student_where_euler_sampling_does(make_config, family):
    """Validation and `vidtune sample` run the family's pipeline with the student's scheduler: the denoiser is
    called at the timesteps of `sample_euler` over `sampling_sigmas(K, shift)` (not the pipeline's own schedule:
    LTX-Video's resolution shift, Wan's UniPC, Mochi's linear-quadratic sigmas), and steps through those sigmas."""
    shift = 3.0
    trainer = build_trainer(make_config(family, training={"algorithm": "step-distillation", "steps": 1},
                                        distillation={"student_steps": K, "teacher_steps": N, "sigma_shift": shift}))
    trainer.set_up()
    told: list[float] = []

    def record(module, args, kwargs):
        told.append(float(kwargs["timestep"].flatten()[0]))

    trainer.context.denoiser.register_forward_pre_hook(record, with_kwargs=True)
    frames, height, width = TINY_SHAPES[family]
    context = trainer.context
    pipeline = trainer.spec.pipeline(context.text, context.vae, context.denoiser)
    with torch.no_grad(), trainer.part.sampling(pipeline, context.vae, context.clips) as pipeline:
        trainer.spec.sample(pipeline, "a red circle", frames=frames, height=height, width=width, num_inference_steps=K,
                            generator=torch.Generator().manual_seed(0), output="latents")
        through_pipeline, told[:] = list(told), []
        batch = next(iter(trainer.context.source.batches(0)))
        conditions = trainer.spec.prepare_conditions(trainer.context.text, ["a red circle"])
        noise = torch.randn_like(batch.latents["latents_mean"][:1])
        sample_euler(trainer.spec, trainer.context.objective,
                               trainer.context.denoiser, conditions, noise, sampling_sigmas(K, shift))
    assert len(through_pipeline) == K
    assert through_pipeline == pytest.approx(told, rel=1e-5, abs=1e-3)
    expected = sampling_sigmas(K, shift)
    if trainer.context.objective.invert_timesteps:  # Mochi: the scheduler steps over 1 - sigma
        expected = 1 - expected
    torch.testing.assert_close(pipeline.scheduler.sigmas.cpu().float(), expected)


def test_vidtune_sample_steps_a_student_through_its_own_sigmas(make_config):
    from vidtune.sampling import load_pipeline
    from vidtune.schedulers import StudentEulerScheduler

    config = make_config(training={"algorithm": "step-distillation", "steps": 1},
                         distillation={"student_steps": K, "teacher_steps": N, "sigma_shift": 2.0})
    build_trainer(config).run()
    scheduler = load_pipeline(config.output_dir, device="cpu").pipeline.scheduler
    assert isinstance(scheduler, StudentEulerScheduler) and scheduler.sigma_shift == 2.0
    scheduler.set_timesteps(K)
    torch.testing.assert_close(scheduler.sigmas, sampling_sigmas(K, 2.0))
