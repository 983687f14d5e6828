"""Guidance distillation: the student's one forward learns the teacher's guided prediction, on held-out noise,
timesteps and captions; the teacher is the frozen base (shared weights for a LoRA student)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from vidtune.algorithms.distillation import GuidanceDistillationPart
from vidtune.algorithms.full import FullPart
from vidtune.algorithms.lora import LoRAPart
from vidtune.algorithms.losses import guidance_scales, guided_prediction, predict, teacher_prediction
from vidtune.data.synthetic import BACKGROUNDS, COLORS, DIRECTIONS, SHAPES, ShapeClip, render_shapes_dataset
from vidtune.errors import CheckpointError, ConfigError
from vidtune.export.command import export_checkpoint
from vidtune.models.registry import available_models
from vidtune.models.tiny import TINY_SHAPES
from vidtune.trainers import build_trainer

SCALE = 4.0


@pytest.fixture(scope="module")
def many_captions(tmp_path_factory) -> Path:
    """Sixteen clips, each with its own caption: enough for the student to learn guidance as a function of it."""
    return render_shapes_dataset(tmp_path_factory.mktemp("many"), num_clips=16, num_frames=33, height=48, width=48,
                                 seed=3)


def held_out_captions(dataset: Path, count: int) -> list[str]:
    """Captions in the dataset's words that none of its clips has."""
    seen = set((dataset / "prompts.txt").read_text().splitlines())
    combos = (ShapeClip(s, c, b, d).caption for d in DIRECTIONS for b in BACKGROUNDS for c in COLORS for s in SHAPES)
    return [caption for caption in combos if caption not in seen][::7][:count]


def _distil(make_config, family: str, steps: int, data_root: Path | None = None, **sections):
    settings = {"training": {"steps": steps, "algorithm": "guidance-distillation", "learning_rate": 3e-3,
                             "sigma_sampling": "uniform", "sigma_shift": 1.0, "batch_size": 2},
                "lora": {"rank": 32, "alpha": 32, "target_modules": "all-linear"},
                "distillation": {"guidance_scale": SCALE}, "optimizer": {"lr_scheduler": "cosine"}}
    for key, value in sections.items():
        settings[key] = {**settings.get(key, {}), **value}
    trainer = build_trainer(make_config(family, data_root=data_root, **settings))
    return trainer, trainer.run()


def _held_out(trainer, count: int = 4, seed: int = 1234):
    """Noisy latents (the clips' latents with fresh noise), timesteps and captions that training never saw."""
    batch = next(iter(trainer.context.source.batches(0)))
    g = torch.Generator().manual_seed(seed)
    x0 = batch.latents["latents_mean"][:1].expand(count, *batch.latents["latents_mean"].shape[1:]).float()
    noise = torch.randn(x0.shape, generator=g)
    levels = torch.rand(count, generator=g) * 0.9 + 0.05
    captions = held_out_captions(Path(trainer.config.data.root), count)
    conditions = trainer.spec.prepare_conditions(trainer.context.text, captions)
    extra = {k: v[:1].expand(count, *v.shape[1:]) for k, v in batch.latents.items() if k not in ("latents_mean",
                                                                                                "latents_std")}
    objective = trainer.context.objective
    return {**conditions, **extra}, objective.noisy(x0, noise, levels), objective.timesteps(levels)


def _distances(trainer, scale: float = SCALE, embedded: bool = False) -> tuple[float, float]:
    """(RMS distance of the student's forward to the teacher's guided prediction, that of the base's
    conditional forward) on held-out inputs; `embedded`: the student is given the scale by its embedding."""
    conditions, noisy, timesteps = _held_out(trainer)
    scales = torch.full((noisy.shape[0],), scale)
    trainer.context.denoiser.eval()
    with torch.no_grad():
        guided = teacher_prediction(trainer.context, conditions, noisy, timesteps, scales)
        student = predict(trainer.context, trainer.context.denoiser, conditions, noisy, timesteps,
                          scales if embedded else None)
        with trainer.part.teacher() as teacher:
            base = predict(trainer.context, teacher, conditions, noisy, timesteps, None)
    return (student - guided).pow(2).mean().sqrt().item(), (base - guided).pow(2).mean().sqrt().item()


def _pipeline_distances(trainer, prompt: str) -> tuple[float, float]:
    """Through the family's pipeline, from the same seed: (RMS distance of the student at guidance 1 to the
    teacher at guidance SCALE, that of the base at guidance 1)."""
    frames, height, width = TINY_SHAPES[trainer.spec.name]
    pipeline = trainer.spec.pipeline(trainer.context.text, trainer.context.vae, trainer.context.denoiser)

    def sample(scale: float) -> torch.Tensor:
        return trainer.spec.sample(pipeline, prompt, frames=frames, height=height, width=width, num_inference_steps=4,
                                   guidance_scale=scale, generator=torch.Generator().manual_seed(5),
                                   output="latents").latents.float()

    with torch.no_grad():
        student = sample(1.0)
        with trainer.part.teacher():
            teacher, base = sample(SCALE), sample(1.0)
    return (student - teacher).pow(2).mean().sqrt().item(), (base - teacher).pow(2).mean().sqrt().item()


def test_guided_prediction_is_uncond_plus_scale_times_the_difference():
    cond, uncond = torch.full((2, 3), 2.0), torch.full((2, 3), 1.0)
    out = guided_prediction(cond, uncond, torch.tensor([1.0, 3.0]))
    assert out[0].tolist() == [2.0] * 3 and out[1].tolist() == [4.0] * 3


@pytest.mark.parametrize(("family", "steps", "learning_rate"),
                         [("ltx-video", 200, 3e-3), ("wan", 800, 3e-3), ("hunyuan-video", 300, 3e-3)])
def test_the_student_gives_the_guided_prediction_in_one_forward(make_config, many_captions, family, steps,
                                                                 learning_rate):
    trainer, result = _distil(make_config, family, steps=steps, data_root=many_captions,
                              training={"learning_rate": learning_rate})
    assert isinstance(trainer.part, GuidanceDistillationPart) and isinstance(trainer.part.inner, LoRAPart)
    student, base = _distances(trainer)
    print(f"{family}: student {student:.4g}, base {base:.4g}, ratio {base / student:.1f}")
    assert base / student >= 5.0, (student, base)
    # The teacher is the frozen base: the adapters are back on after each teacher call, and nothing else trained.
    assert all(p.requires_grad for n, p in trainer.context.denoiser.named_parameters() if "lora_" in n)
    assert not any(p.requires_grad for n, p in trainer.context.denoiser.named_parameters() if "lora_" not in n)
    assert (result.output_dir / "pytorch_lora_weights.safetensors").is_file()
    assert trainer.config.validation.guidance_scale == 1.0  # the student is sampled without guidance
    if family == "ltx-video":
        student, base = _pipeline_distances(trainer, held_out_captions(many_captions, 1)[0])
        print(f"{family} pipeline: student {student:.4g}, base {base:.4g}, ratio {base / student:.1f}")
        assert base / student >= 3.0, (student, base)


def test_a_full_student_learns_against_a_frozen_copy(make_config, many_captions):
    trainer, _ = _distil(make_config, "ltx-video", steps=40, data_root=many_captions,
                         training={"learning_rate": 3e-4}, distillation={"student": "full"})
    assert isinstance(trainer.part, GuidanceDistillationPart) and isinstance(trainer.part.inner, FullPart)
    frozen_teacher = trainer.part.inner.frozen_teacher
    student, base = _distances(trainer)
    assert base / student >= 2.0, (student, base)
    # The teacher kept the original weights while the student's moved.
    moved = [n for n, p in trainer.context.denoiser.named_parameters()
             if not torch.equal(p.detach(), frozen_teacher.get_parameter(n).to(p.dtype))]
    assert moved and not any(p.requires_grad for p in frozen_teacher.parameters())


def test_a_guidance_range_needs_a_guidance_embedding(make_config):
    trainer = build_trainer(make_config(training={"algorithm": "guidance-distillation"},
                                        distillation={"guidance_range": [2.0, 6.0]}))
    with pytest.raises(ConfigError, match=r"distillation.guidance_range: ltx-video has no guidance embedding"):
        trainer.run()
    assert trainer.context is None  # refused before the model loads


def test_a_negative_prompt_is_the_teachers_unconditional_caption(make_config):
    trainer = build_trainer(make_config(training={"algorithm": "guidance-distillation", "steps": 1},
                                        distillation={"negative_prompt": "blurry, static"}))
    trainer.run()
    expected = trainer.spec.prepare_conditions(trainer.context.text, ["blurry, static"])
    empty = trainer.context.source.empty_caption()
    for key, value in expected.items():
        torch.testing.assert_close(trainer.part.negative[key], value)
    assert any(not torch.equal(trainer.part.negative[k], empty[k]) for k in empty if empty[k].is_floating_point())


def test_a_guidance_embedding_learns_a_range_of_scales(make_config, many_captions):
    """HunyuanVideo: each visit draws its scale from the range; the student is told it by its embedding and gives
    the teacher's guided prediction at scales it was never given exactly."""
    trainer, _ = _distil(make_config, "hunyuan-video", steps=300, data_root=many_captions,
                         distillation={"guidance_range": [2.0, 6.0]})
    drawn = guidance_scales(trainer.config, next(iter(trainer.context.source.batches(0))))
    assert ((drawn >= 2.0) & (drawn <= 6.0)).all() and len(set(drawn.tolist())) == len(drawn)
    for scale in (2.7, 5.3):
        student, base = _distances(trainer, scale, embedded=True)
        print(f"hunyuan-video at {scale}: student {student:.4g}, base {base:.4g}, ratio {base / student:.1f}")
        assert base / student >= 2.0, (scale, student, base)


@pytest.mark.parametrize("family", available_models())
def test_every_family_takes_guidance_distillation_steps(make_config, family):
    """Two steps on each family (image-to-video ones keep their first-frame conditions in both teacher calls):
    the loss is finite and not zero at the start (the student begins as the unguided base), and the adapter moves."""
    trainer = build_trainer(make_config(family, training={"algorithm": "guidance-distillation", "steps": 2}))
    losses = trainer.run().losses
    assert all(math.isfinite(loss) for loss in losses) and losses[0] > 0
    assert any(v.abs().max() > 0 for k, v in trainer.part.state_dict().items() if "lora_B" in k)


def test_a_distilled_adapter_exports_for_comfyui_and_a_full_student_does_not(make_config, tmp_path):
    for student in ("lora", "full"):
        config = make_config(training={"algorithm": "guidance-distillation", "steps": 1},
                             distillation={"student": student}, output_dir=str(tmp_path / student))
        build_trainer(config).run()
        # `vidtune sample` reads the run's config: the student samples at guidance 1 there too.
        assert yaml.safe_load((tmp_path / student / "config.yaml").read_text())["validation"]["guidance_scale"] == 1.0
        if student == "lora":
            written = export_checkpoint(tmp_path / student, tmp_path / "exported", format="comfyui")
            assert written.is_file() and load_file(written)
        else:
            with pytest.raises(CheckpointError, match="guidance-distillation fine-tune; --format comfyui"):
                export_checkpoint(tmp_path / student, tmp_path / "refused", format="comfyui")


def test_from_the_cache_a_negative_prompt_is_encoded_with_encoders_loaded_for_it(make_config, tmp_path):
    config = make_config(training={"algorithm": "guidance-distillation", "steps": 2},
                         distillation={"negative_prompt": "blurry, static"},
                         precompute={"enabled": True, "cache_dir": str(tmp_path / "cache")})
    trainer = build_trainer(config)
    losses = trainer.run().losses
    # Training never held them.
    assert not trainer.context.encoders.loaded and all(math.isfinite(loss) for loss in losses)
    text = trainer.spec.load_text_components(trainer.device)
    for key, value in trainer.spec.prepare_conditions(text, ["blurry, static"]).items():
        torch.testing.assert_close(trainer.part.negative[key], value)


def test_a_student_of_a_range_is_validated_at_the_distillation_scale(make_config, monkeypatch):
    """Validation tells the student's embedding `distillation.guidance_scale`; the teacher's embedding
    (`model.guidance_scale`, what training's spec tells it) stays as it is."""
    config = make_config("hunyuan-video", training={"algorithm": "guidance-distillation", "steps": 1},
                         distillation={"guidance_range": [2.0, 6.0], "guidance_scale": 3.5},
                         validation={"enabled": True, "num_inference_steps": 1})
    trainer = build_trainer(config)
    seen = []
    original = type(trainer.spec).sample

    def recording(spec, *args, **kwargs):
        seen.append((spec.guidance_scale, kwargs.get("guidance_scale")))
        return original(spec, *args, **kwargs)

    monkeypatch.setattr(type(trainer.spec), "sample", recording)
    trainer.run()
    assert seen == [(3.5, 1.0)] and trainer.spec.guidance_scale == 1.0
    with pytest.raises(ConfigError, match=r"must lie in distillation.guidance_range \[2.0, 6.0\]"):
        make_config(training={"algorithm": "guidance-distillation"},
                    distillation={"guidance_range": [2.0, 6.0], "guidance_scale": 7.0})


def test_sampling_a_range_student_tells_its_embedding_the_chosen_scale(make_config, tmp_path):
    """`vidtune sample` / `load_pipeline`: a student of a range is told `distillation.guidance_scale` by default (as
    its validation), `--embedded-guidance G` within the range otherwise; a family without a guidance embedding
    refuses the option."""
    from safetensors.torch import load_file as load_latents

    from vidtune.errors import VidtuneError
    from vidtune.sampling import load_pipeline, sample_run

    config = make_config("hunyuan-video", training={"algorithm": "guidance-distillation", "steps": 1},
                         distillation={"guidance_range": [2.0, 6.0], "guidance_scale": 3.5},
                         output_dir=str(tmp_path / "student"))
    build_trainer(config).run()
    latents = []
    for requested, told in ((None, 3.5), (5.0, 5.0)):
        run = load_pipeline(config.output_dir, device="cpu", embedded_guidance=requested)
        assert run.spec.guidance_scale == told
        path = tmp_path / f"{told}.safetensors"
        sample_run(run, "a red circle", tmp_path / f"{told}.mp4", latents=path, num_inference_steps=2)
        latents.append(load_latents(path)["latents"])
    assert (latents[0] - latents[1]).abs().max() > 1e-5  # the embedding does see the scale
    with pytest.raises(VidtuneError, match=r"--embedded-guidance 7: the student learned the scales 2 to 6"):
        load_pipeline(config.output_dir, device="cpu", embedded_guidance=7.0)

    plain = make_config("ltx-video", training={"steps": 1}, output_dir=str(tmp_path / "ltx"))
    build_trainer(plain).run()
    with pytest.raises(VidtuneError, match=r"--embedded-guidance: ltx-video has no guidance embedding"):
        load_pipeline(plain.output_dir, device="cpu", embedded_guidance=3.0)
