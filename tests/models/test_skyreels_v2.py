"""SkyReels V2 conventions beyond the contract and overfit tests: the Wan 2.1 conventions hold through SkyReels V2's
own pipelines and transformer, prompts reach the pipelines as embeddings, the image encoder's class is the
checkpoint's, and a diffusion-forcing transformer with a frame-rate input is refused before anything loads."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from diffusers import SkyReelsV2Transformer3DModel
from diffusers.pipelines.skyreels_v2 import pipeline_skyreels_v2
from diffusers.pipelines.wan.pipeline_wan import prompt_clean as wan_prompt_clean
from safetensors.torch import load_file
from transformers import CLIPVisionModelWithProjection

from tests.helpers.runs import run_stopped_at
from vidtune.config import ModelConfig
from vidtune.errors import ConfigError, ModelError
from vidtune.models.skyreels_v2 import SkyReelsV2DiffusionForcingSpec, SkyReelsV2ImageToVideoSpec, SkyReelsV2Spec
from vidtune.models.spec import FRAME_RATE
from vidtune.models.tiny import TINY_SHAPES, reference_videos
from vidtune.models.tiny.skyreels_v2 import write_tiny_skyreels_v2
from vidtune.models.wan import frames_to_pil
from vidtune.outputs import LORA_WEIGHTS
from vidtune.trainers import build_trainer

CPU = torch.device("cpu")
CAPTIONS = ["a red circle moving left", "A  blue square,   spinning slowly"]


def _spec(cls, folder, **model):
    return cls(ModelConfig(name=cls.name, pretrained=str(folder), **model))


def _videos(family: str, batch: int = 2) -> torch.Tensor:
    frames, size, _ = TINY_SHAPES[family]
    return reference_videos(frames, size)[:batch]


@pytest.fixture(scope="module")
def t2v_folder(tiny_model_dir):
    return tiny_model_dir("skyreels-v2")


@pytest.fixture(scope="module")
def i2v_folder(tiny_model_dir):
    return tiny_model_dir("skyreels-v2-i2v")


def test_prepare_conditions_equal_the_pipeline_encode_prompt(t2v_folder, monkeypatch):
    spec = _spec(SkyReelsV2Spec, t2v_folder)
    text = spec.load_text_components(CPU)
    pipeline = spec.pipeline(text, spec.load_vae(CPU), spec.load_denoiser(CPU))
    assert type(pipeline).__name__ == "SkyReelsV2Pipeline"
    # SkyReelsV2Pipeline cleans prompts with ftfy unconditionally; compare with the cleaning vidtune applies (ftfy
    # when installed, as Wan's pipelines).
    monkeypatch.setattr(pipeline_skyreels_v2, "prompt_clean", wan_prompt_clean)
    with torch.no_grad():
        embeds, _ = pipeline.encode_prompt(CAPTIONS, do_classifier_free_guidance=False, device=CPU,
                                           max_sequence_length=spec.max_sequence_length)
    torch.testing.assert_close(spec.prepare_conditions(text, CAPTIONS)["prompt_embeds"], embeds)


def test_sampling_hands_the_pipeline_embeddings(t2v_folder):
    spec = _spec(SkyReelsV2Spec, t2v_folder)
    text = spec.load_text_components(CPU)
    pipeline = spec.pipeline(text, spec.load_vae(CPU), spec.load_denoiser(CPU))
    guided = spec.prompt_inputs(pipeline, "a red circle", guidance_scale=6.0)
    embeds = spec.prepare_conditions(text, ["a red circle", ""])["prompt_embeds"]
    torch.testing.assert_close(guided["prompt_embeds"], embeds[:1])
    torch.testing.assert_close(guided["negative_prompt_embeds"], embeds[1:])
    assert "negative_prompt_embeds" not in spec.prompt_inputs(pipeline, "a red circle", guidance_scale=1.0)


def test_the_training_forward_is_the_pipeline_transformer_call(t2v_folder):
    """The pipeline calls the transformer with hidden_states, timestep t (sigma * 1000, one per sample) and the
    prompt embeddings: the training forward must give the same prediction for the same inputs."""
    spec = _spec(SkyReelsV2Spec, t2v_folder)
    denoiser = spec.load_denoiser(CPU)
    assert isinstance(denoiser, SkyReelsV2Transformer3DModel)
    conditions = spec.prepare_conditions(spec.load_text_components(CPU), CAPTIONS)
    latents = torch.randn(2, 4, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    timesteps = torch.tensor([900.0, 250.0])
    with torch.no_grad():
        ours = spec.forward(denoiser, conditions, latents, timesteps)
        theirs = denoiser(hidden_states=latents, timestep=timesteps, encoder_hidden_states=conditions["prompt_embeds"],
                          return_dict=False)[0]
        other_time = spec.forward(denoiser, conditions, latents, timesteps.flip(0))
    torch.testing.assert_close(ours, theirs)
    assert (ours - other_time).abs().max() > 1e-4  # the timestep reaches the prediction


def test_latents_are_normalised_as_the_pipeline_denormalises_them(t2v_folder):
    spec = _spec(SkyReelsV2Spec, t2v_folder)
    vae = spec.load_vae(CPU)
    videos = _videos("skyreels-v2")
    latents = spec.prepare_latents(vae, videos)
    with torch.no_grad():
        raw = vae.encode(videos.permute(0, 2, 1, 3, 4)).latent_dist
    # SkyReelsV2Pipeline decodes latents / (1 / std) + mean.
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    torch.testing.assert_close(latents["latents_mean"] / inverse_std + mean, raw.mean)


def test_image_conditions_equal_the_pipeline(i2v_folder):
    spec = _spec(SkyReelsV2ImageToVideoSpec, i2v_folder)
    encoders = spec.load_vae(CPU)
    assert isinstance(encoders.image_encoder, CLIPVisionModelWithProjection)  # the class model_index.json names
    videos = _videos("skyreels-v2-i2v")
    frames, height, width = TINY_SHAPES["skyreels-v2-i2v"]
    latents = spec.prepare_latents(encoders, videos)
    pipeline = spec.pipeline(spec.load_text_components(CPU), encoders, spec.load_denoiser(CPU))
    assert type(pipeline).__name__ == "SkyReelsV2ImageToVideoPipeline"
    for index in range(videos.shape[0]):
        image = frames_to_pil(videos[index, :1])[0]
        with torch.no_grad():
            embeds = pipeline.encode_image(image, CPU)
            pixels = pipeline.video_processor.preprocess(image, height=height, width=width).float()
            _, condition = pipeline.prepare_latents(pixels, 1, 4, height, width, frames, torch.float32, CPU,
                                                    torch.Generator().manual_seed(0))
        torch.testing.assert_close(latents["image_embeds"][index : index + 1], embeds)
        torch.testing.assert_close(latents["image_condition"][index : index + 1], condition, atol=1e-4, rtol=1e-4)


def test_an_image_encoder_of_another_class_is_refused(i2v_folder, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(i2v_folder, folder)
    index = json.loads((folder / "model_index.json").read_text())
    index["image_encoder"] = ["transformers", "SiglipVisionModel"]
    (folder / "model_index.json").write_text(json.dumps(index))
    with pytest.raises(ModelError, match=r"SiglipVisionModel.*CLIPVisionModelWithProjection or CLIPVisionModel"):
        _spec(SkyReelsV2ImageToVideoSpec, folder).load_vae(CPU)


def test_a_transformer_with_a_frame_rate_input_is_refused_before_loading(t2v_folder, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(t2v_folder, folder)
    config_file = folder / "transformer" / "config.json"
    config = json.loads(config_file.read_text())
    config["inject_sample_info"] = True
    config_file.write_text(json.dumps(config))
    frames, height, width = TINY_SHAPES["skyreels-v2"]
    _spec(SkyReelsV2Spec, t2v_folder).check_video_shape(frames, height, width)  # the plain model passes
    with pytest.raises(ModelError, match=r"transformer.*config\.json.*inject_sample_info"):
        _spec(SkyReelsV2Spec, folder).check_video_shape(frames, height, width)


def test_the_comfyui_file_names_wan_layers(t2v_folder):
    """ComfyUI loads SkyReels V2 checkpoints as Wan 2.1 models (`WAN21`): the file's names are Wan's originals."""
    spec = _spec(SkyReelsV2Spec, t2v_folder)
    model = spec.comfyui_model()
    assert model.name == "WAN21"
    assert "blocks.0.self_attn.q" in model.weights and "blocks.1.ffn.2" in model.weights


# ----- diffusion forcing ------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def sample_info_folder(tmp_path_factory):
    """A tiny diffusion-forcing model with the frame-rate embedding (`inject_sample_info`, as the DF-1.3B model)."""
    return write_tiny_skyreels_v2(tmp_path_factory.mktemp("skyreels-df-fps"), diffusion_forcing=True,
                                  sample_info=True)


def test_the_diffusion_forcing_forward_is_the_pipeline_transformer_call(sample_info_folder):
    """The pipeline calls the transformer one sample at a time with a timestep per latent frame,
    enable_diffusion_forcing and the frame-rate class (0 for 16 fps, else 1); the training forward gives the same
    prediction for a batch, per-frame timesteps or one per clip."""
    spec = SkyReelsV2DiffusionForcingSpec(ModelConfig(name="skyreels-v2-df", pretrained=str(sample_info_folder)),
                                          frame_rate=16.0)
    denoiser = spec.load_denoiser(CPU)
    assert denoiser.config.inject_sample_info
    conditions = spec.prepare_conditions(spec.load_text_components(CPU), CAPTIONS)
    latents = torch.randn(2, 4, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    timesteps = torch.tensor([[100.0, 500.0, 900.0], [300.0, 300.0, 700.0]])
    with torch.no_grad():
        ours = spec.forward(denoiser, conditions, latents, timesteps)
        theirs = torch.cat([denoiser(hidden_states=latents[i : i + 1], timestep=timesteps[i : i + 1],
                                     encoder_hidden_states=conditions["prompt_embeds"][i : i + 1],
                                     enable_diffusion_forcing=True, fps=[0], return_dict=False)[0]
                            for i in range(2)])
        other_rate = spec.forward(denoiser, {**conditions, FRAME_RATE: torch.tensor([[24.0], [24.0]])}, latents,
                                  timesteps)
        synchronous = spec.forward(denoiser, conditions, latents, torch.tensor([300.0, 300.0]))
        expanded = spec.forward(denoiser, conditions, latents, torch.full((2, 3), 300.0))
    torch.testing.assert_close(ours, theirs)
    assert (ours - other_rate).abs().max() > 1e-4  # the frame-rate class reaches the prediction
    torch.testing.assert_close(synchronous, expanded)
    assert spec.pipeline_inputs() == {"fps": 16, "ar_step": 0}


def test_diffusion_forcing_trains_with_non_decreasing_noise_per_frame(make_config, monkeypatch):
    config = make_config("skyreels-v2-df", training={"steps": 2, "batch_size": 2})
    assert config.training.frame_noise == "non_decreasing"  # the family's default
    seen = []
    forward = SkyReelsV2DiffusionForcingSpec.forward

    def recording(self, denoiser, conditions, noisy_latents, timesteps):
        seen.append((noisy_latents.shape, timesteps.detach().clone()))
        return forward(self, denoiser, conditions, noisy_latents, timesteps)

    monkeypatch.setattr(SkyReelsV2DiffusionForcingSpec, "forward", recording)
    result = build_trainer(config).run()
    shape, timesteps = seen[0]
    assert timesteps.shape == (2, shape[2])  # a timestep per latent frame
    assert (timesteps[:, 1:] >= timesteps[:, :-1]).all() and (timesteps[:, 1:] > timesteps[:, :-1]).any()
    rows = [json.loads(line) for line in (result.output_dir / "metrics.jsonl").read_text().splitlines()]
    logged = [row["sigmas"] for row in rows if "sigmas" in row]
    assert logged and all(len(sigmas) == 2 for sigmas in logged)  # one level per clip: its frames' mean


def test_the_sampled_frame_rate_class_changes_the_sample(sample_info_folder):
    """Validation and `vidtune sample` hand the pipeline the run's frame rate, whose class the 1.3B model embeds."""
    def sample(rate: float) -> torch.Tensor:
        spec = SkyReelsV2DiffusionForcingSpec(ModelConfig(name="skyreels-v2-df", pretrained=str(sample_info_folder)),
                                              frame_rate=rate)
        pipeline = spec.pipeline(spec.load_text_components(CPU), spec.load_vae(CPU), spec.load_denoiser(CPU))
        pipeline.set_progress_bar_config(disable=True)
        frames, height, width = TINY_SHAPES["skyreels-v2-df"]
        return spec.sample(pipeline, "a red circle", frames=frames, height=height, width=width,
                           num_inference_steps=2, generator=torch.Generator().manual_seed(0), output="latents").latents

    sixteen, again, other = sample(16.0), sample(16.0), sample(24.0)
    torch.testing.assert_close(sixteen, again)
    assert (sixteen - other).abs().max() > 1e-4


def test_control_training_of_a_model_with_the_frame_rate_embedding_is_refused(make_config, sample_info_folder):
    config = make_config("skyreels-v2-df", training={"algorithm": "control-lora"})
    model = config.model.model_copy(update={"pretrained": str(sample_info_folder)})
    config = config.model_copy(update={"model": model})
    with pytest.raises(ConfigError, match=r"training\.algorithm=control-lora: .*inject_sample_info"):
        build_trainer(config).run()


def test_a_family_told_one_timestep_per_clip_refuses_per_frame_noise(make_config):
    config = make_config("skyreels-v2", training={"frame_noise": "independent"})
    with pytest.raises(ConfigError, match=r"training\.frame_noise=independent: skyreels-v2's denoiser"):
        build_trainer(config).run()


@pytest.mark.slow
@pytest.mark.parametrize(("family", "hub_id", "parameters"), [
    ("skyreels-v2", "Skywork/SkyReels-V2-T2V-14B-540P-Diffusers", 14.3e9),
    ("skyreels-v2-i2v", "Skywork/SkyReels-V2-I2V-14B-540P-Diffusers", 16.4e9),
    ("skyreels-v2-df", "Skywork/SkyReels-V2-DF-1.3B-540P-Diffusers", 1.44e9),
])
def test_plan_works_offline_for_the_published_checkpoints(family, hub_id, parameters):
    """`vidtune plan` from the shipped architectures (HF_HUB_OFFLINE=1 in the tests), tracing a step: the
    diffusion-forcing 1.3B model's per-frame timesteps and frame-rate class, the image-to-video model's image inputs.
    The weights are the denoiser's parameters in bf16 (the LoRA's are small beside them)."""
    from vidtune.config import build_config
    from vidtune.memory.plan import plan_memory

    config = build_config({"model": {"name": family, "pretrained": hub_id},
                           "data": {"root": ".", "frames": 17, "height": 256, "width": 256},
                           "precompute": {"enabled": True}})
    plan = plan_memory(config)
    assert 0.9 < plan.training["weights"] / (2 * parameters) < 1.12, plan.training
    assert plan.peak >= plan.training_peak > plan.training["weights"]


def test_a_stopped_run_resumes_bit_for_bit(make_config, tmp_path):
    """Stopped at step 3 of 5 and resumed, a diffusion-forcing run ends with the adapter and losses of one left alone:
    the per-frame noise levels are drawn again from each visit's own generator."""
    family = "skyreels-v2-df"
    settings = {"training": {"steps": 5, "batch_size": 2}, "checkpoint": {"every": 2}, "lora": {"dropout": 0.1}}
    build_trainer(make_config(family, **settings, output_dir=str(tmp_path / "reference"))).run()
    out = tmp_path / "stopped"
    run_stopped_at(build_trainer(make_config(family, **settings, output_dir=str(out))), 3)
    settings["checkpoint"] = {"every": 2, "resume": "latest"}
    build_trainer(make_config(family, **settings, output_dir=str(out))).run()
    resumed, reference = load_file(out / LORA_WEIGHTS), load_file(tmp_path / "reference" / LORA_WEIGHTS)
    assert resumed.keys() == reference.keys() and resumed
    assert all(torch.equal(resumed[key], reference[key]) for key in reference)

    def losses(run):
        return [json.loads(row)["loss"] for row in (run / "metrics.jsonl").read_text().splitlines()]

    assert losses(out) == losses(tmp_path / "reference") and len(losses(out)) == 5
