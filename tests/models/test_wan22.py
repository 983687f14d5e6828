"""Wan 2.2: TI2V-5B's timestep per latent token and kept-clean first frame, and the A14B two-expert models (routing
by the boundary, an adapter per expert, each loaded into its pipeline transformer, one expert alone, exact resume)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from peft import LoraConfig
from safetensors.torch import load_file

from tests.helpers.datasets import one_clip_dataset, pair_samples
from tests.helpers.runs import overfit_config, run_stopped_at
from tests.helpers.wan22 import BOUNDARY, spec_of, two_expert_config
from vidtune import checkpoint
from vidtune.config import TrainingConfig
from vidtune.data.video import ClipWindow, read_clip
from vidtune.errors import ConfigError
from vidtune.export.comfyui_workflow import workflow_file
from vidtune.export.command import export_checkpoint
from vidtune.models.experts import TwoExperts
from vidtune.models.spec import POSTERIOR_KEYS
from vidtune.models.tiny.wan22 import TWO_EXPERT_SHAPE, write_tiny_wan22
from vidtune.outputs import LORA_WEIGHTS, LORA_WEIGHTS_2, comfyui_lora_weights
from vidtune.sampling import load_pipeline
from vidtune.trainers import build_trainer

CPU = torch.device("cpu")
# Steps, peak learning rate, visits of the clip a step: measured 0.090 (T2V) and 0.096 (I2V) against the bound 0.15.
TWO_EXPERT_OVERFIT = (1000, 8e-3, 8)
I2V_TWO_EXPERT_OVERFIT = (500, 1e-2, 4)


# One input for either tiny expert: latents [1, 4, 3, 4, 4], a caption's embedding, a timestep.
EXPERT_INPUTS = {"hidden_states": torch.randn(1, 4, 3, 4, 4, generator=torch.Generator().manual_seed(3)),
                 "timestep": torch.tensor([600.0]), "return_dict": False,
                 "encoder_hidden_states": torch.randn(1, 512, 32, generator=torch.Generator().manual_seed(4))}


def pipeline_experts_compute_the_trained_ones(out: Path, trainer) -> dict[str, torch.Tensor]:
    """`vidtune sample`'s path (load_pipeline) on a two-expert run's output: each of its experts computes what the
    trainer's trained expert does; returns each expert's output."""
    run = load_pipeline(out, device="cpu")
    outputs = {}
    for name in ("transformer", "transformer_2"):
        with torch.no_grad():
            outputs[name] = getattr(run.pipeline, name)(**EXPERT_INPUTS)[0]
            trained = trainer.context.denoiser.expert(name)(**EXPERT_INPUTS)[0]
        torch.testing.assert_close(outputs[name], trained, rtol=1e-4, atol=1e-5)
    return outputs


@pytest.fixture(scope="module")
def two_expert_dir(tmp_path_factory) -> Path:
    return write_tiny_wan22(tmp_path_factory.mktemp("wan22-a14b"), two_experts=True, boundary_ratio=BOUNDARY)


# ----- TI2V-5B -----------------------------------------------------------------------------------------------------
def test_ti2v_gives_each_latent_token_its_timestep_and_image_to_video_keeps_the_first_frame(tiny_model_dir):
    """What the pipelines hand the transformer with expand_timesteps: `mask[:, ::2, ::2] * t` flattened per token,
    the mask 0 on an image-to-video first frame, whose latent is the image's clean one."""
    spec = spec_of("wan2.2-i2v", tiny_model_dir("wan2.2-i2v"))
    denoiser = spec.load_denoiser(CPU).eval()
    latents = torch.randn(2, 4, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    first = torch.randn(2, 4, 1, 4, 4, generator=torch.Generator().manual_seed(1))
    prompt = torch.randn(2, 512, 32, generator=torch.Generator().manual_seed(2))
    timesteps = torch.tensor([900.0, 250.0])
    conditions = {"prompt_embeds": prompt, "first_frame_latents": first}
    mask = torch.ones(1, 1, 3, 4, 4)
    mask[:, :, 0] = 0
    with torch.no_grad():
        ours = spec.forward(denoiser, conditions, latents, timesteps)
        expected = torch.cat([
            denoiser(hidden_states=((1 - mask) * first[i:i + 1] + mask * latents[i:i + 1]),
                     timestep=(mask[0][0][:, ::2, ::2] * t).flatten()[None], encoder_hidden_states=prompt[i:i + 1],
                     return_dict=False)[0]
            for i, t in enumerate(timesteps)])
    torch.testing.assert_close(ours, expected)
    # The first frame is the image, not a prediction: its error is not part of the loss.
    error = torch.zeros(1, 4, 3, 2, 2)
    error[:, :, 0] = 5.0
    assert float(spec.per_clip_error(error, conditions)) == 0.0
    assert float(spec_of("wan2.2", tiny_model_dir("wan2.2")).per_clip_error(error, conditions)) > 0


def test_ti2v_reads_its_rule_from_the_wan22_vae(tiny_model_dir):
    spec = spec_of("wan2.2", tiny_model_dir("wan2.2"))
    assert spec.expand_timesteps and not spec.two_experts
    with pytest.raises(ConfigError, match=r"data.height=48 must be a multiple of 32"):
        spec.check_video_shape(9, 48, 64)
    assert spec.validation_guidance_scale == 5.0


def test_experts_on_a_one_transformer_model_are_refused(tiny_model_dir):
    spec = spec_of("wan2.2", tiny_model_dir("wan2.2"), experts="high_noise")
    with pytest.raises(ConfigError, match=r"model.experts=high_noise: .* one transformer"):
        spec.check_source()


# ----- A14B: two experts --------------------------------------------------------------------------------------------
def test_two_experts_route_each_sample_by_the_boundary(two_expert_dir):
    spec = spec_of("wan2.2", two_expert_dir)
    denoiser = spec.load_denoiser(CPU).eval()
    assert isinstance(denoiser, TwoExperts) and denoiser.boundary_timestep == BOUNDARY * 1000
    latents = torch.randn(2, 4, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    prompt = torch.randn(2, 512, 32, generator=torch.Generator().manual_seed(1))
    timesteps = torch.tensor([700.0, 300.0])  # one each side
    with torch.no_grad():
        mixed = spec.forward(denoiser, {"prompt_embeds": prompt}, latents, timesteps)
        high = denoiser.transformer(hidden_states=latents[:1], timestep=timesteps[:1],
                                    encoder_hidden_states=prompt[:1], return_dict=False)[0]
        low = denoiser.transformer_2(hidden_states=latents[1:], timestep=timesteps[1:],
                                     encoder_hidden_states=prompt[1:], return_dict=False)[0]
    torch.testing.assert_close(mixed, torch.cat([high, low]))
    assert not torch.allclose(high, denoiser.transformer_2(hidden_states=latents[:1], timestep=timesteps[:1],
                                                           encoder_hidden_states=prompt[:1], return_dict=False)[0])


@pytest.mark.parametrize(("experts", "high_side"), [("high_noise", True), ("low_noise", False)])
def test_one_expert_trains_only_on_its_side_of_the_boundary(two_expert_dir, experts, high_side):
    spec = spec_of("wan2.2", two_expert_dir, experts=experts)
    objective = spec.objective(TrainingConfig(sigma_sampling="logit_normal"))
    generator = torch.Generator().manual_seed(0)
    timesteps = torch.cat([objective.timesteps(objective.sample_noise_levels(1, generator)) for _ in range(64)])
    assert bool(((timesteps >= BOUNDARY * 1000) == high_side).all())
    assert float(timesteps.max() - timesteps.min()) > 100  # a range, not one value


def test_two_expert_models_refuse_what_cannot_train_two(make_config, two_expert_dir, tmp_path, monkeypatch):
    config = two_expert_config(make_config, model={"experts": "low_noise"},
                               training={"algorithm": "step-distillation"})(two_expert_dir)
    with pytest.raises(ConfigError, match=r"(?s)model.experts=low_noise with training.algorithm=step-distillation: "
                                          r".*both students train"):
        build_trainer(config).run()
    config = two_expert_config(make_config, model={"experts": "high_noise"},
                               training={"algorithm": "guidance-distillation"},
                               distillation={"student": "full"})(two_expert_dir)
    with pytest.raises(ConfigError, match=r"(?s)model.experts=high_noise with distillation.student=full"):
        build_trainer(config).run()
    config = two_expert_config(make_config, model={"experts": "high_noise"},
                               training={"algorithm": "full"})(two_expert_dir)
    with pytest.raises(ConfigError, match=r"(?s)model.experts=high_noise with training.algorithm=full"):
        build_trainer(config).run()
    # Under torchrun: sharded strategies cannot follow a rank that skips an expert (DDP can): routing per sample is
    # refused there.
    monkeypatch.setenv("WORLD_SIZE", "2")
    for strategy in ("fsdp", "deepspeed"):
        config = two_expert_config(make_config, model={"expert_routing": "sample"},
                                   parallel={"strategy": strategy})(two_expert_dir)
        with pytest.raises(ConfigError, match=rf"(?s)model.expert_routing=sample with parallel.strategy={strategy}: "
                                              r".*What to do: remove model.expert_routing"):
            spec_of("wan2.2", two_expert_dir, expert_routing="sample").check_training(config)
    spec_of("wan2.2", two_expert_dir).check_training(two_expert_config(make_config)(two_expert_dir))


def _at_first_step(trainer, load: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """The adapter as the first optimizer step finds it (at its first micro-batch's loss); with `load`, these weights
    put into it just before."""
    seen: dict[str, torch.Tensor] = {}
    original = trainer.loss

    def loss(*args, **kwargs):
        if not seen:
            if load is not None:
                trainer.part.load_state_dict(load)
            seen.update({k: v.detach().clone() for k, v in trainer.part.state_dict().items()})
        return original(*args, **kwargs)

    trainer.loss = loss
    return seen


def test_two_experts_start_from_a_two_expert_runs_adapters(make_config, two_expert_dir, tmp_path):
    """lora.init_from: a two-expert run's folder starts each expert from its own file; one expert takes its file
    alone. The first step's loss is the loaded adapters' (the same weights put in by hand give the same loss)."""
    def config(name: str, seed: int, steps: int = 1, **sections):
        # Seed 8: the first run's two steps draw noise levels on both sides of the boundary (both experts train).
        return two_expert_config(make_config, training={"steps": steps, "learning_rate": 5e-2, "batch_size": 2,
                                                        "seed": seed, "sigma_sampling": "uniform"},
                                 output_dir=str(tmp_path / name), **sections)(two_expert_dir)

    build_trainer(config("first", seed=8, steps=2)).run()
    first = tmp_path / "first"
    # The files as written, in the denoiser's naming: each expert's keys under its own prefix.
    by_hand = {f"{expert}.{key.removeprefix('transformer.')}": value
               for expert, name in (("transformer", LORA_WEIGHTS), ("transformer_2", LORA_WEIGHTS_2))
               for key, value in load_file(first / name).items()}
    assert all(any(float(v.abs().max()) > 0 for k, v in by_hand.items() if k.startswith(f"{e}.") and "lora_B" in k)
               for e in ("transformer", "transformer_2"))

    started = build_trainer(config("started", seed=7, lora={"rank": 4, "alpha": 4, "init_from": str(first)}))
    at_start = _at_first_step(started)
    loss = started.run().losses[0]
    assert at_start.keys() == by_hand.keys()
    assert all(torch.equal(at_start[key], by_hand[key]) for key in by_hand), "did not start at the adapters"
    reference = build_trainer(config("reference", seed=7))
    _at_first_step(reference, load=by_hand)
    assert reference.run().losses[0] == pytest.approx(loss, rel=1e-6)
    assert build_trainer(config("fresh", seed=7)).run().losses[0] != pytest.approx(loss, rel=1e-3)

    # One expert: its own file; the other expert keeps no adapter.
    low = build_trainer(config("low", seed=7, model={"experts": "low_noise"},
                               lora={"rank": 4, "alpha": 4, "init_from": str(first / LORA_WEIGHTS_2)}))
    low_start = _at_first_step(low)
    low.run()
    expected = {k: v for k, v in by_hand.items() if k.startswith("transformer_2.")}
    assert low_start.keys() == expected.keys() and all(torch.equal(low_start[k], expected[k]) for k in expected)

    # Refused before any model loads: one file for two adapters, a folder lacking an expert's file.
    with pytest.raises(ConfigError, match=r"(?s)is one adapter file, but model.experts=both.*What to do: give the "
                                          r"folder holding both files"):
        build_trainer(config("one-file", seed=7, lora={"init_from": str(first / LORA_WEIGHTS)})).run()
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / LORA_WEIGHTS).write_bytes((first / LORA_WEIGHTS).read_bytes())
    with pytest.raises(ConfigError, match=rf"(?s)lacks {LORA_WEIGHTS_2} .*What to do"):
        build_trainer(config("half-run", seed=7, lora={"init_from": str(tmp_path / "half")})).run()


@pytest.mark.parametrize(("algorithm", "student"), [
    ("guidance-distillation", "lora"), ("guidance-distillation", "full"), ("step-distillation", "lora")])
def test_two_expert_students_distil_their_own_expert_and_load_into_the_pipeline(make_config, two_expert_dir,
                                                                               algorithm, student):
    """Each expert's student (its own adapter) learns from the frozen expert itself: the teacher is the
    `TwoExperts` with its adapters off, routed by the same noise levels. Both adapters train, are written as the
    pipeline loads them, validate with both experts and load through `vidtune sample`'s path."""
    def config(name: str, steps: int, **distillation):
        # Seed 8: the first step's two clips fall on both sides of the boundary (guidance distillation).
        return two_expert_config(
            make_config, training={"algorithm": algorithm, "steps": steps, "learning_rate": 5e-2, "batch_size": 2,
                                   "seed": 8, "sigma_sampling": "uniform"},
            # 4 student steps start at sigmas 1, 0.75, 0.5, 0.25: the last window is the low-noise student's.
            distillation={"student_steps": 4, "teacher_steps": 4, "student": student, **distillation},
            validation={"enabled": name == "trained", "num_inference_steps": 4},
            output_dir=str(Path(make_config().output_dir).parent / name))(two_expert_dir)

    if algorithm == "guidance-distillation":
        # Guidance 1: the teacher's target is its own prediction, which the fresh students (adapters at zero) give
        # exactly, on both sides of the boundary, only if each student's teacher is its own expert.
        assert build_trainer(config("unguided", 1, guidance_scale=1.0)).run().losses == [0.0]
    trainer = build_trainer(config("trained", 3))
    result = trainer.run()
    assert result.losses[0] > 0 and result.sample_paths and all(path.is_file() for path in result.sample_paths)
    out = Path(trainer.config.output_dir)
    if student == "lora":
        for name in (LORA_WEIGHTS, LORA_WEIGHTS_2):
            adapter = load_file(out / name)
            assert any(float(v.abs().max()) > 0 for k, v in adapter.items() if "lora_B" in k), f"{name} did not train"
    else:  # both experts' students in full, beside each other as the pipeline's components
        assert (out / "transformer").is_dir() and (out / "transformer_2").is_dir()
    base = spec_of("wan2.2", two_expert_dir).load_denoiser(CPU).eval()
    for name, loaded in pipeline_experts_compute_the_trained_ones(out, trainer).items():
        with torch.no_grad():
            untrained = base.expert(name)(**EXPERT_INPUTS)[0]
        assert not torch.allclose(loaded, untrained), f"{name}: the student is the base expert"


def test_an_fp8_base_stores_both_experts_in_fp8_and_trains(make_config, two_expert_dir):
    """memory.base_weights=fp8 on the two-expert model: each expert's frozen layers are stored in float8 (layerwise
    casting per expert: the pair itself is no diffusers model), and a LoRA trains on both."""
    config = two_expert_config(make_config, memory={"base_weights": "fp8"},
                               training={"steps": 2, "learning_rate": 5e-2, "batch_size": 2,
                                         "sigma_sampling": "uniform"})(two_expert_dir)
    trainer = build_trainer(config)
    result = trainer.run()
    assert len(result.losses) == 2 and all(math.isfinite(loss) for loss in result.losses)
    for expert in trainer.context.denoiser.experts():
        stored = {module.base_layer.weight.dtype for name, module in expert.named_modules()
                  if name.endswith("attn1.to_q")}
        assert stored == {torch.float8_e4m3fn}


def test_each_experts_adapter_loads_into_its_transformer_and_changes_only_its_noise_range(make_config,
                                                                                         two_expert_dir):
    config = two_expert_config(make_config, training={"steps": 3, "learning_rate": 5e-2, "batch_size": 4,
                                                      "sigma_sampling": "uniform"})(two_expert_dir)
    trainer = build_trainer(config)
    trainer.run()
    out = Path(config.output_dir)
    high, low = load_file(out / LORA_WEIGHTS), load_file(out / LORA_WEIGHTS_2)
    for adapter in (high, low):
        assert adapter and all(k.startswith("transformer.") and "lora_" in k for k in adapter)
        assert any(float(v.abs().max()) > 0 for k, v in adapter.items() if "lora_B" in k), "an expert did not train"
    assert not all(torch.equal(high[k], low[k]) for k in high), "the experts share one adapter"
    # ComfyUI files named after the run: `<run>_comfyui` (high noise), `<run>_transformer_2_comfyui` (low noise).
    comfy_high_file, comfy_low_file = comfyui_lora_weights(out.name), comfyui_lora_weights(out.name, second=True)
    comfy_high, comfy_low = load_file(out / comfy_high_file), load_file(out / comfy_low_file)
    assert comfy_high.keys() == comfy_low.keys() and all(k.startswith("diffusion_model.blocks.") for k in comfy_high)

    # The files load into WanPipeline as diffusers' Wan 2.2 examples load them; each changes only its own steps.
    spec = trainer.spec
    frames, height, width = TWO_EXPERT_SHAPE
    fresh = spec.load_denoiser(CPU)
    pipeline = spec.pipeline(spec.load_text_components(CPU), spec.load_vae(CPU), fresh)
    pipeline.set_progress_bar_config(disable=True)

    def step_latents() -> tuple[list[float], list[torch.Tensor]]:
        steps: list[torch.Tensor] = []
        timesteps: list[float] = []

        def keep(_pipeline, _step, timestep, tensors):
            timesteps.append(float(timestep))
            steps.append(tensors["latents"].clone())
            return tensors

        spec.sample(pipeline, "a red circle", frames=frames, height=height, width=width, num_inference_steps=8,
                    generator=torch.Generator().manual_seed(0), callback=keep, output="latents")
        return timesteps, steps

    timesteps, base = step_latents()
    pipeline.load_lora_weights(str(out), weight_name=LORA_WEIGHTS_2, load_into_transformer_2=True)
    _, low_only = step_latents()
    first_low = next(i for i, t in enumerate(timesteps) if t < BOUNDARY * 1000)
    assert 0 < first_low < len(timesteps)
    for i in range(len(timesteps)):
        same = torch.equal(low_only[i], base[i])
        assert same == (i < first_low), f"step {i} (t={timesteps[i]:.0f}): the low-noise adapter's reach is wrong"
    pipeline.load_lora_weights(str(out), weight_name=LORA_WEIGHTS)
    _, both = step_latents()
    assert not torch.equal(both[0], base[0])

    # The ComfyUI files, read back by diffusers' converter for Wan LoRAs, sample what the diffusers files sample.
    pipeline = spec.pipeline(spec.load_text_components(CPU), spec.load_vae(CPU),
                             spec.load_denoiser(CPU))
    pipeline.set_progress_bar_config(disable=True)
    pipeline.load_lora_weights(str(out), weight_name=comfy_high_file)
    pipeline.load_lora_weights(str(out), weight_name=comfy_low_file, load_into_transformer_2=True)
    _, from_comfyui = step_latents()
    torch.testing.assert_close(from_comfyui[-1], both[-1], rtol=1e-4, atol=5e-5)

    # `vidtune sample`'s path loads both: its experts compute what the trained ones do.
    pipeline_experts_compute_the_trained_ones(out, trainer)


def test_one_low_noise_expert_writes_the_second_file_only(make_config, two_expert_dir, tmp_path):
    config = two_expert_config(make_config, model={"experts": "low_noise"},
                               training={"steps": 1, "learning_rate": 5e-2},
                               validation={"enabled": True, "num_inference_steps": 2})(two_expert_dir)
    trainer = build_trainer(config)
    result = trainer.run()
    out = Path(config.output_dir)
    assert (out / LORA_WEIGHTS_2).is_file() and not (out / LORA_WEIGHTS).exists()
    assert result.sample_paths and all(path.is_file() for path in result.sample_paths)  # validated with both
    export_checkpoint(out, tmp_path / "comfy", format="comfyui")
    assert sorted(path.name for path in (tmp_path / "comfy").iterdir()) == sorted(
        [comfyui_lora_weights(out.name, second=True), workflow_file(out.name)])  # its workflow loads that one file
    workflow = json.loads((tmp_path / "comfy" / workflow_file(out.name)).read_text())
    assert [node["inputs"]["lora_name"] for node in workflow.values()
            if node["class_type"] == "LoraLoaderModelOnly"] == [comfyui_lora_weights(out.name, second=True)]
    assert not any("lora_" in name for name, _ in trainer.context.denoiser.transformer.named_parameters())
    run = load_pipeline(out, device="cpu")
    assert any("lora_" in name for name, _ in run.pipeline.transformer_2.named_parameters())
    assert not any("lora_" in name for name, _ in run.pipeline.transformer.named_parameters())


def test_a_two_expert_run_resumes_bit_for_bit(make_config, two_expert_dir, tmp_path):
    def config(output: Path, **checkpointing):
        return two_expert_config(make_config, training={"steps": 4, "learning_rate": 1e-2},
                                 checkpoint={"every": 2, **checkpointing},
                                 output_dir=str(output))(two_expert_dir)

    build_trainer(config(tmp_path / "reference")).run()
    out = tmp_path / "stopped"
    trainer = build_trainer(config(out))
    run_stopped_at(trainer, 3)
    saved = checkpoint.load(out / "checkpoints" / "step-00000003")[0]
    assert {key.split(".")[0] for key in saved} == {"transformer", "transformer_2"}
    exported = export_checkpoint(out / "checkpoints" / "step-00000003", tmp_path / "exported")
    assert exported.name == LORA_WEIGHTS and (tmp_path / "exported" / LORA_WEIGHTS_2).is_file()
    build_trainer(config(out, resume="latest")).run()
    for name in (LORA_WEIGHTS, LORA_WEIGHTS_2):
        resumed, reference = load_file(out / name), load_file(tmp_path / "reference" / name)
        assert resumed.keys() == reference.keys() and resumed
        for key in resumed:
            assert torch.equal(resumed[key], reference[key]), (name, key)


def test_image_to_video_experts_take_the_first_frame_condition(make_config, tmp_path):
    """I2V-A14B: Wan 2.1's mask + first-frame channels concatenated to the input, no CLIP image tokens."""
    folder = write_tiny_wan22(tmp_path / "i2v-a14b", image_to_video=True, two_experts=True, boundary_ratio=BOUNDARY)
    spec = spec_of("wan2.2-i2v", folder)
    frames, height, width = TWO_EXPERT_SHAPE
    videos = torch.rand(1, frames, 3, height, width, generator=torch.Generator().manual_seed(0)) * 2 - 1
    latents = spec.prepare_latents(spec.load_vae(CPU), videos)
    assert set(latents) - set(POSTERIOR_KEYS) == {"image_condition"}
    assert latents["image_condition"].shape[1] == 4 + latents["latents_mean"].shape[1]
    denoiser = spec.load_denoiser(CPU)
    prompt = spec.prepare_conditions(spec.load_text_components(CPU), ["a red circle"])
    with torch.no_grad():
        prediction = spec.forward(denoiser, {**prompt, "image_condition": latents["image_condition"]},
                                  latents["latents_mean"], torch.tensor([400.0]))
    assert prediction.shape == latents["latents_mean"].shape


def overfit_two_experts(family: str, folder: Path, shapes_dataset: Path, tmp_path: Path, steps: int,
                        learning_rate: float, batch_size: int) -> tuple[float, float]:
    """Both experts of `folder` fine-tuned in full on one clip (each visit's noise level picks its expert), saved as
    `transformer/` + `transformer_2/`, then sampled by the family's pipeline switching experts at the boundary,
    through `vidtune sample`'s loading path (image-to-video from the clip's first frame). Returns the relative
    error of the sampled latents, trained and with the untrained experts."""
    frames, height, width = TWO_EXPERT_SHAPE
    clip = pair_samples(shapes_dataset)[0]
    data_root = one_clip_dataset(clip.video, clip.caption, tmp_path / "data")
    config = overfit_config(family, folder, data_root, tmp_path / "run", frames,
                            data={"height": height, "width": width},
                            training={"steps": steps, "learning_rate": learning_rate, "batch_size": batch_size},
                            optimizer={"warmup_steps": steps // 10})
    build_trainer(config).run()
    assert (tmp_path / "run" / "transformer_2").is_dir()

    run = load_pipeline(tmp_path / "run", device="cpu")
    spec = run.spec
    video = read_clip(clip.video, ClipWindow(frames, height, width))[None]
    x0 = spec.prepare_latents(spec.load_vae(CPU), video)["latents_mean"]
    run.pipeline.set_progress_bar_config(disable=True)

    def relative_error(pipeline) -> float:
        with torch.no_grad():
            sampled = spec.sample(pipeline, clip.caption, frames=frames, height=height, width=width,
                                  num_inference_steps=30, generator=torch.Generator().manual_seed(1),
                                  reference=video[0], output="latents").latents
        return float((sampled - x0).norm() / x0.norm())

    base = spec_of(family, folder)
    untrained = base.pipeline(base.load_text_components(CPU), base.load_vae(CPU), base.load_denoiser(CPU))
    untrained.set_progress_bar_config(disable=True)
    return relative_error(run.pipeline), relative_error(untrained)


@pytest.mark.slow
def test_two_experts_overfit_one_clip_then_sample_with_both_in_the_pipeline(two_expert_dir, shapes_dataset, tmp_path):
    """T2V-A14B-like: the clip comes back through WanPipeline with both trained experts."""
    trained, untrained = overfit_two_experts("wan2.2", two_expert_dir, shapes_dataset, tmp_path, *TWO_EXPERT_OVERFIT)
    print(f"wan2.2 two experts: relative error {trained:.3f} (untrained experts: {untrained:.3f})")
    assert trained < 0.15 < untrained


@pytest.mark.slow
def test_image_to_video_experts_overfit_one_clip_then_sample_with_both_in_the_pipeline(shapes_dataset, tmp_path):
    """I2V-A14B-like: WanImageToVideoPipeline with `transformer_2` and `boundary_ratio`, sampling from the clip's
    first frame (mask + first-frame channels), brings the clip back with both trained experts."""
    folder = write_tiny_wan22(tmp_path / "i2v-a14b", image_to_video=True, two_experts=True, boundary_ratio=BOUNDARY)
    trained, untrained = overfit_two_experts("wan2.2-i2v", folder, shapes_dataset, tmp_path, *I2V_TWO_EXPERT_OVERFIT)
    print(f"wan2.2-i2v two experts: relative error {trained:.3f} (untrained experts: {untrained:.3f})")
    assert trained < 0.15 < untrained


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_only_the_running_expert_holds_the_device(two_expert_dir):
    spec = spec_of("wan2.2", two_expert_dir)
    cuda = torch.device("cuda")
    denoiser = spec.load_denoiser(cuda).requires_grad_(False)  # as the LoRA trainer sets it up
    denoiser.add_adapter(LoraConfig(r=2, lora_alpha=2, target_modules=["to_q"]))
    latents = torch.randn(1, 4, 3, 4, 4, device=cuda)
    prompt = torch.randn(1, 512, 32, device=cuda)

    def devices(expert: torch.nn.Module, trainable: bool) -> set[str]:
        return {p.device.type for p in expert.parameters() if p.requires_grad == trainable}

    for timestep, running, idle in ((900.0, denoiser.transformer, denoiser.transformer_2),
                                    (100.0, denoiser.transformer_2, denoiser.transformer)):
        with torch.no_grad():
            denoiser(hidden_states=latents, timestep=torch.tensor([timestep], device=cuda),
                     encoder_hidden_states=prompt)
        assert devices(running, False) == {"cuda"} and devices(idle, False) == {"cpu"}
    assert devices(denoiser.transformer, True) == devices(denoiser.transformer_2, True) == {"cuda"}  # adapters stay
