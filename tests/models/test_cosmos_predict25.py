"""Cosmos Predict 2.5 conventions that the contract and overfit tests would not pin down alone: the caption encoding,
the latents' normalisation, the conditioning frames as Cosmos2_5_PredictBasePipeline gives them, and their draw."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from safetensors.torch import load_file, save_file

from tests.helpers.runs import run_stopped_at
from vidtune.config import ModelConfig, build_config
from vidtune.errors import ConfigError, ModelError
from vidtune.models.cosmos_predict25 import (
    CONDITION_FRAMES,
    CONDITION_LATENTS,
    CosmosPredict25Spec,
    CosmosPredict25VideoToWorldSpec,
    condition_draw,
)
from vidtune.models.tiny import TINY_SHAPES, reference_videos
from vidtune.trainers import build_trainer

CPU = torch.device("cpu")
CAPTIONS = ["a red circle moving left", "a blue square, spinning slowly"]
FAMILY = "cosmos-predict-2.5"


def _spec(cls, folder, **model):
    return cls(ModelConfig(name=cls.name, pretrained=str(folder), **model))


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir(FAMILY)


@pytest.fixture(scope="module")
def loaded(folder):
    spec = _spec(CosmosPredict25Spec, folder)
    text, vae, denoiser = spec.load_text_components(CPU), spec.load_vae(CPU), spec.load_denoiser(CPU)
    pipeline = spec.pipeline(text, vae, denoiser)
    pipeline.set_progress_bar_config(disable=True)
    return spec, text, vae, denoiser, pipeline


def _clips(batch: int = 2) -> torch.Tensor:
    frames, size, _ = TINY_SHAPES[FAMILY]
    return reference_videos(frames, size)[:batch]


def _transformer_calls(denoiser) -> tuple[list[dict], object]:
    calls: list[dict] = []

    def record(module, args, kwargs):
        calls.append({key: kwargs[key].detach().clone() for key in ("hidden_states", "timestep", "condition_mask")})

    return calls, denoiser.register_forward_pre_hook(record, with_kwargs=True)


# ----- text and latents ------------------------------------------------------------------------------------
def test_conditions_equal_the_pipelines_prompt_embeddings(loaded):
    spec, text, _, denoiser, pipeline = loaded
    assert spec.max_sequence_length == 512
    conditions = spec.prepare_conditions(text, CAPTIONS)
    # Every Qwen layer after the embedding (2 of 16 features), concatenated: what crossattn_proj takes.
    assert conditions["prompt_embeds"].shape == (2, 512, denoiser.config.crossattn_proj_in_channels) == (2, 512, 32)
    with torch.no_grad():
        embeds, _ = pipeline.encode_prompt(CAPTIONS, do_classifier_free_guidance=False, device=CPU)
    torch.testing.assert_close(conditions["prompt_embeds"], embeds)
    # The system turn is part of what is encoded: the caption alone encodes otherwise.
    assert "system_prompt" in spec.condition_identity()


def test_latents_are_normalised_as_the_pipeline_denormalises_them(loaded):
    spec, _, vae, _, _ = loaded
    videos = _clips()
    latents = spec.prepare_latents(vae, videos)
    raw = vae.encode(videos.permute(0, 2, 1, 3, 4)).latent_dist
    # Cosmos2_5_PredictBasePipeline decodes latents / (1 / latents_std) + latents_mean.
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    torch.testing.assert_close(latents["latents_mean"] / (1.0 / std) + mean, raw.mean, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(latents["latents_std"] * std, raw.std, atol=1e-6, rtol=1e-5)
    assert torch.equal(latents[CONDITION_LATENTS], latents["latents_mean"][:, :, :2])


def test_shape_rules_name_the_frames_and_the_multiple_of_16(loaded):
    spec = loaded[0]
    spec.check_video_shape(9, 32, 48)
    with pytest.raises(ConfigError) as caught:
        spec.check_video_shape(10, 40, 32)
    message = str(caught.value)
    assert "data.frames=10" in message and "data.height=40 must be a multiple of 16" in message


# ----- the conditioning frames ------------------------------------------------------------------------------
@pytest.mark.parametrize("count", [1, 2])
def test_forward_gives_the_transformer_what_the_video_to_world_pipeline_gives_it(folder, loaded, count):
    """One step of the pipeline from a clip's first 4 (count - 1) + 1 frames, and the training forward on the same
    noisy latents: the clip's clean latents on the given frames, the condition mask, sigma per latent frame with
    1e-4 on the given ones, the same prediction."""
    _, text, vae, denoiser, pipeline = loaded
    spec = _spec(CosmosPredict25VideoToWorldSpec, folder)
    frames, size, _ = TINY_SHAPES[FAMILY]
    clip = _clips(1)
    calls, hook = _transformer_calls(denoiser)
    with torch.no_grad():
        pipeline(prompt=CAPTIONS[0], video=clip[0, : 4 * (count - 1) + 1].permute(1, 0, 2, 3)[None],
                 num_latent_conditional_frames=count, num_frames=frames, height=size, width=size,
                 num_inference_steps=2, guidance_scale=1.0, generator=torch.Generator().manual_seed(0),
                 output_type="latent")
    hook.remove()
    given = calls[0]
    conditions = {**spec.prepare_conditions(text, CAPTIONS[:1]), **spec.prepare_latents(vae, clip),
                  CONDITION_FRAMES: torch.tensor([float(count)])}
    noisy = given["hidden_states"].clone()
    noisy[:, :, :count] = torch.randn_like(noisy[:, :, :count])  # training's noise there is replaced by the clip
    sigma = float(given["timestep"].flatten().max())
    calls, hook = _transformer_calls(denoiser)
    with torch.no_grad():
        prediction = spec.forward(denoiser, conditions, noisy, torch.tensor([sigma * 1000.0]))
    hook.remove()
    ours = calls[0]
    assert ours["timestep"].shape == given["timestep"].shape == (1, 1, 3, 1, 1)
    torch.testing.assert_close(ours["timestep"], given["timestep"].float())
    assert ours["timestep"].flatten()[:count].tolist() == pytest.approx([1e-4] * count)
    assert torch.equal(ours["condition_mask"], given["condition_mask"].to(ours["condition_mask"]))
    assert float(ours["condition_mask"][:, :, :count].min()) == 1.0 and float(ours["condition_mask"][:, :, count:]
                                                                                .max()) == 0.0
    # The pipeline encodes the frames it is given (their mode); the clip's own first latent frames are those.
    torch.testing.assert_close(ours["hidden_states"], given["hidden_states"].to(ours["hidden_states"]),
                               atol=2e-3, rtol=0)
    with torch.no_grad():
        theirs = denoiser(**{k: v for k, v in given.items()}, encoder_hidden_states=conditions["prompt_embeds"],
                          padding_mask=noisy.new_zeros(1, 1, size, size), return_dict=False)[0]
    torch.testing.assert_close(prediction[:, :, count:], theirs[:, :, count:], atol=2e-3, rtol=0)


def test_given_frames_stay_out_of_the_loss(loaded):
    spec = loaded[0]
    error = torch.ones(3, 4, 3, 2, 2)
    error[:, :, 0] = 7.0
    error[:, :, 1] = 5.0
    per_clip = spec.per_clip_error(error, {CONDITION_FRAMES: torch.tensor([0.0, 1.0, 2.0])})
    assert per_clip.tolist() == pytest.approx([13.0 / 3, 3.0, 1.0])
    # Without a draw (validation), every frame counts.
    assert spec.per_clip_error(error, {}).tolist() == pytest.approx([13.0 / 3] * 3)


def test_the_draw_follows_the_makers_shares_and_the_setting(folder):
    positions = torch.arange(4000)
    counts = condition_draw(0.5, torch.zeros(1, 4, 3, 2, 2), positions, seed=3)
    shares = [float((counts == k).float().mean()) for k in (0, 1, 2)]
    assert shares == pytest.approx([0.5, 0.25, 0.25], abs=0.03)  # the makers' {0: 0.5, 1: 0.25, 2: 0.25}
    assert torch.equal(counts, condition_draw(0.5, torch.zeros(1, 4, 3, 2, 2), positions, seed=3))  # per visit
    # A clip of two latent frames is never given both (nothing left to predict), one of one frame nothing.
    assert float(condition_draw(1.0, torch.zeros(1, 4, 2, 2, 2), positions[:50], 0).max()) == 1.0
    assert float(condition_draw(1.0, torch.zeros(1, 4, 1, 2, 2), positions[:50], 0).max()) == 0.0
    text_to_world = _spec(CosmosPredict25Spec, folder)
    assert text_to_world.first_frame_probability == 0.5
    assert _spec(CosmosPredict25Spec, folder, first_frame_conditioning=0.0).visit_conditions(
        torch.zeros(2, 4, 3, 2, 2), torch.tensor([0, 1]), 0) == {}
    video_to_world = _spec(CosmosPredict25VideoToWorldSpec, folder)
    drawn = video_to_world.visit_conditions(torch.zeros(200, 4, 3, 2, 2), torch.arange(200), 0)[CONDITION_FRAMES]
    assert set(drawn.tolist()) == {1.0, 2.0}
    # Without a draw (held-out score) video-to-world gives the pipeline's two frames.
    assert video_to_world.condition_frames({}, torch.zeros(2, 4, 3, 2, 2)).tolist() == [2.0, 2.0]
    config = build_config({"model": {"name": video_to_world.name, "pretrained": str(folder),
                                     "first_frame_conditioning": 0.5}, "data": {"root": "."}})
    with pytest.raises(ConfigError, match=r"first_frame_conditioning=0\.5: cosmos-predict-2\.5-v2w takes no"):
        video_to_world.check_frame_settings(config, [])


def test_video_to_world_samples_from_the_reference_clips_first_five_frames(folder, loaded):
    _, _, vae, _, pipeline = loaded
    spec = _spec(CosmosPredict25VideoToWorldSpec, folder)
    frames, size, _ = TINY_SHAPES[FAMILY]
    clip = _clips(1)
    assert spec.reference_frame_count(frames) == 5
    inputs = spec.pipeline_inputs(clip[0])
    assert inputs["num_latent_conditional_frames"] == 2
    assert torch.equal(inputs["video"], clip[0, :5].permute(1, 0, 2, 3)[None])
    assert spec.pipeline_inputs(clip[0, :1])["num_latent_conditional_frames"] == 1
    with pytest.raises(ModelError, match="pass the clip as `reference`"):
        spec.pipeline_inputs(None)
    sampled = spec.sample(pipeline, CAPTIONS[0], frames=frames, height=size, width=size, num_inference_steps=4,
                          generator=torch.Generator().manual_seed(0), reference=clip[0], output="latents").latents
    # The given frames come back as the clip's own (the pipeline walks them from noise to the clip in a line).
    x0 = spec.prepare_latents(vae, clip)["latents_mean"]
    assert float((sampled[:, :, :2] - x0[:, :, :2]).norm() / x0[:, :, :2].norm()) < 0.02


def test_a_single_file_is_refused_with_the_reason(folder, tmp_path):
    path = tmp_path / "transformer.safetensors"
    save_file({"x": torch.zeros(1)}, str(path))
    spec = _spec(CosmosPredict25Spec, folder, transformer_file=str(path))
    with pytest.raises(ModelError, match=r"(?s)model\.transformer_file: .*Cosmos 1\.0 and Cosmos Predict 2 files.*"
                                         r"What to do: use the model in the diffusers layout"):
        spec.check_source()


def test_a_released_checkpoint_samples_only_through_nvidias_guardrail(tmp_path, folder):
    if importlib.util.find_spec("cosmos_guardrail") is not None:
        pytest.skip("cosmos_guardrail is installed here")
    spec = _spec(CosmosPredict25Spec, tmp_path)  # a folder without the tiny model's marker
    with pytest.raises(ModelError, match=r"pip install cosmos_guardrail"):
        spec.safety_checker()
    # A run that validates is refused before anything loads; one without samples trains.
    data = {"model": {"name": spec.name, "pretrained": str(tmp_path)}, "data": {"root": "."}}
    with pytest.raises(ConfigError, match=r"(?s)^validation\.enabled: .*validation\.enabled: false"):
        spec.check_training(build_config(data))
    spec.check_training(build_config({**data, "validation": {"enabled": False}}))
    # The tiny test model (random weights, the marker beside it) samples without it.
    assert _spec(CosmosPredict25Spec, folder).safety_checker().check_text_safety("a red circle")


# ----- a trained LoRA in the pipeline, resume ---------------------------------------------------------------
@pytest.mark.parametrize("family", [FAMILY, "cosmos-predict-2.5-v2w"])
def test_a_trained_lora_changes_what_the_pipeline_samples(make_config, family):
    config = make_config(family, training={"steps": 2, "learning_rate": 5e-2},
                         lora={"rank": 4, "alpha": 4, "target_modules": "attention+ffn"})
    trainer = build_trainer(config)
    result = trainer.run()
    spec = trainer.spec
    pipeline = spec.pipeline(spec.load_text_components(CPU), spec.load_vae(CPU), spec.load_denoiser(CPU))
    pipeline.set_progress_bar_config(disable=True)
    frames, height, width = TINY_SHAPES[family]
    reference = _clips(1)[0] if spec.image_to_video else None

    def sample() -> torch.Tensor:
        return spec.sample(pipeline, "a red circle", frames=frames, height=height, width=width,
                           num_inference_steps=2, generator=torch.Generator().manual_seed(0), reference=reference,
                           guidance_scale=spec.validation_guidance_scale).frames

    plain = sample()
    spec.load_lora(pipeline, result.weights_path.parent, result.weights_path.name)
    adapted = sample()
    assert plain.shape == adapted.shape == (frames, 3, height, width)
    assert (plain - adapted).abs().max() > 1e-4
    assert any("ff.net.2.lora_A" in name for name, _ in pipeline.transformer.named_parameters())


@pytest.mark.parametrize("family", [FAMILY, "cosmos-predict-2.5-v2w"])
def test_a_run_stopped_and_resumed_ends_bit_for_bit_as_one_left_alone(make_config, tmp_path, family):
    """With the conditioning frames drawn per visit (both names draw them)."""

    def config(output, **checkpointing):
        return make_config(family, training={"steps": 4, "learning_rate": 1e-2},
                           lora={"rank": 4, "alpha": 4, "dropout": 0.1}, checkpoint={"every": 2, **checkpointing},
                           output_dir=str(output))

    reference = build_trainer(config(tmp_path / "reference")).run()
    out = tmp_path / "stopped"
    run_stopped_at(build_trainer(config(out)), 3)
    resumed = build_trainer(config(out, resume="latest")).run()
    expected, found = load_file(reference.weights_path), load_file(resumed.weights_path)
    assert expected.keys() == found.keys() and expected
    assert all(torch.equal(expected[key], found[key]) for key in expected)
