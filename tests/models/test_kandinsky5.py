"""Kandinsky 5 conventions that the contract and overfit tests would not pin down on their own: the two text encoders
as the pipeline runs them, each clip's own caption tokens (the transformer takes no text mask), the channels-last
latents, the resolution-dependent rotary scale, the image-to-video first frame, the Pro models' condition inputs and
NABLA's clip sizes."""

from __future__ import annotations

import json

import pytest
import torch

from vidtune.config import ModelConfig
from vidtune.errors import ConfigError
from vidtune.models.kandinsky5 import Kandinsky5ImageToVideoSpec, Kandinsky5Spec, rope_scale_factor
from vidtune.models.spec import frames_to_pil
from vidtune.models.tiny import TINY_SHAPES, reference_videos
from vidtune.trainers import build_trainer

CPU = torch.device("cpu")
CAPTIONS = ["a red circle moving from left to right", "a dog"]


def _spec(cls, folder):
    return cls(ModelConfig(name=cls.name, pretrained=str(folder)))


@pytest.fixture(scope="module")
def t2v(tiny_model_dir):
    spec = _spec(Kandinsky5Spec, tiny_model_dir("kandinsky-5"))
    return spec, spec.load_text_components(CPU), spec.load_vae(CPU), spec.load_denoiser(CPU)


@pytest.fixture(scope="module")
def i2v(tiny_model_dir):
    spec = _spec(Kandinsky5ImageToVideoSpec, tiny_model_dir("kandinsky-5-i2v"))
    return spec, spec.load_text_components(CPU), spec.load_vae(CPU), spec.load_denoiser(CPU)


def test_conditions_are_the_pipelines_encode_prompt_of_each_caption(t2v):
    """Qwen's tokens after the template's first 128, padded with their mask, and CLIP's pooled output: what
    `encode_prompt` gives for each caption alone (how the pipeline encodes a prompt)."""
    spec, text, vae, denoiser = t2v
    conditions = spec.prepare_conditions(text, CAPTIONS)
    pipeline = spec.pipeline(text, vae, denoiser)
    assert conditions["prompt_embeds"].shape[:2] == (2, spec.max_sequence_length) == (2, 512)
    counts = conditions["prompt_embeds_mask"].sum(dim=1).tolist()
    assert counts[0] > counts[1] > 0
    for row, caption in enumerate(CAPTIONS):
        with torch.no_grad():
            embeds, pooled, cu_seqlens = pipeline.encode_prompt([caption], device=CPU, max_sequence_length=512)
        assert cu_seqlens.tolist() == [0, counts[row]]
        torch.testing.assert_close(conditions["prompt_embeds"][row, :counts[row]], embeds[0])
        assert not conditions["prompt_embeds"][row, counts[row]:].any()
        assert conditions["prompt_embeds_mask"][row, :counts[row]].all()
        torch.testing.assert_close(conditions["pooled_projections"][row], pooled[0])
    assert not torch.allclose(conditions["pooled_projections"][0], conditions["pooled_projections"][1])


def test_forward_gives_each_clip_its_own_caption_tokens_as_the_pipelines_loop_does(t2v):
    """Two clips whose captions differ in length: each prediction is the transformer's call as the pipeline makes
    it for that clip alone (channels last, its tokens unpadded, text positions 0..n, the rotary scale of its size)."""
    spec, text, _, denoiser = t2v
    conditions = spec.prepare_conditions(text, CAPTIONS)
    noisy = torch.randn(2, 4, 3, 4, 4, generator=torch.Generator().manual_seed(0))
    timesteps = torch.tensor([800.0, 150.0])
    # As Kandinsky5T2VPipeline.prepare_latents: channels last, then zero condition latents and a zero mask.
    channels_last = noisy.permute(0, 2, 3, 4, 1)
    zeros = torch.zeros_like(channels_last)
    pipeline_input = torch.cat([channels_last, zeros, zeros[..., :1]], dim=-1)
    with torch.no_grad():
        ours = spec.forward(denoiser, conditions, noisy, timesteps)
        for row in range(2):
            count = int(conditions["prompt_embeds_mask"][row].sum())
            alone = denoiser(
                hidden_states=pipeline_input[row:row + 1],
                encoder_hidden_states=conditions["prompt_embeds"][row:row + 1, :count],
                pooled_projections=conditions["pooled_projections"][row:row + 1], timestep=timesteps[row:row + 1],
                visual_rope_pos=[torch.arange(3), torch.arange(2), torch.arange(2)], text_rope_pos=torch.arange(count),
                scale_factor=(1, 3.16, 3.16), sparse_params=None,
            ).sample.permute(0, 4, 1, 2, 3)
            torch.testing.assert_close(ours[row:row + 1], alone)
        padded = denoiser(
            hidden_states=pipeline_input[1:], encoder_hidden_states=conditions["prompt_embeds"][1:],
            pooled_projections=conditions["pooled_projections"][1:], timestep=timesteps[1:],
            visual_rope_pos=[torch.arange(3), torch.arange(2), torch.arange(2)], text_rope_pos=torch.arange(512),
            scale_factor=(1, 3.16, 3.16),
        ).sample.permute(0, 4, 1, 2, 3)
    assert not torch.allclose(ours[1:], padded, atol=1e-4)  # the padding would change the prediction


def test_rotary_scale_follows_the_pipelines_resolution_rule():
    assert rope_scale_factor(512, 768) == (1, 2, 2)
    assert rope_scale_factor(480, 854) == (1, 2, 2)
    assert rope_scale_factor(1024, 1024) == (1, 3.16, 3.16)
    assert rope_scale_factor(512, 1024) == (1, 3.16, 3.16)


def test_latents_are_the_scaled_posterior_and_come_back_from_the_pipeline_channels_last(t2v):
    spec, text, vae, denoiser = t2v
    frames, size, _ = TINY_SHAPES["kandinsky-5"]
    videos = reference_videos(frames, size)[:1]
    latents = spec.prepare_latents(vae, videos)
    with torch.no_grad():
        raw = vae.encode(videos.permute(0, 2, 1, 3, 4)).latent_dist.mean
    torch.testing.assert_close(latents["latents_mean"], raw * vae.config.scaling_factor)
    # The pipeline's latents are [B, F, H, W, C] (a step's also carry the condition channels of `visual_cond`).
    channels_last = torch.randn(1, 3, 4, 4, 9)
    back = spec.latents_from_pipeline(channels_last, frames, size, size)
    assert torch.equal(back, channels_last[..., :4].permute(0, 4, 1, 2, 3))
    pipeline = spec.pipeline(text, vae, denoiser)
    pipeline.set_progress_bar_config(disable=True)
    sample = spec.sample(pipeline, CAPTIONS[0], frames=frames, height=size, width=size, num_inference_steps=2,
                         generator=torch.Generator().manual_seed(0), output="latents").latents
    assert sample.shape == latents["latents_mean"].shape


def test_the_pipeline_samples_with_the_trained_lora_and_its_output_changes(make_config):
    config = make_config("kandinsky-5", training={"steps": 2, "learning_rate": 5e-2}, lora={"rank": 4, "alpha": 4})
    trainer = build_trainer(config)
    result = trainer.run()
    spec = trainer.spec
    frames, size, _ = TINY_SHAPES["kandinsky-5"]

    def sample(with_lora: bool) -> torch.Tensor:
        pipeline = spec.pipeline(spec.load_text_components(CPU), spec.load_vae(CPU), spec.load_denoiser(CPU))
        pipeline.set_progress_bar_config(disable=True)
        if with_lora:
            spec.load_lora(pipeline, result.output_dir)
        return spec.sample(pipeline, CAPTIONS[0], frames=frames, height=size, width=size, num_inference_steps=3,
                           generator=torch.Generator().manual_seed(0), output="latents").latents

    base, adapted = sample(False), sample(True)
    assert torch.isfinite(adapted).all()
    assert (adapted - base).abs().max() > 1e-3


def test_image_to_video_gives_the_first_frame_clean_with_its_mask_and_leaves_it_out_of_the_loss(i2v):
    """As Kandinsky5I2VPipeline: the image's latents in latent frame 0 of the latents, zero condition latents, a mask
    of ones on that frame; the pipeline never steps that frame, so the loss leaves it out."""
    spec, text, vae, denoiser = i2v
    frames, size, _ = TINY_SHAPES["kandinsky-5-i2v"]
    videos = reference_videos(frames, size)[:2]
    latents = spec.prepare_latents(vae, videos)
    # The image encoded alone, as the pipeline encodes it (the VAE's group norms make the clip's first latent frame
    # differ from it).
    pipeline = spec.pipeline(text, vae, denoiser)
    image = pipeline.video_processor.preprocess(frames_to_pil(videos[1, :1])[0], height=size, width=size)
    with torch.no_grad():
        alone = vae.encode(image.unsqueeze(2)).latent_dist.mean * vae.config.scaling_factor
    torch.testing.assert_close(latents["image_latents"][1:], alone, atol=2e-2, rtol=2e-2)
    assert not torch.allclose(latents["latents_mean"][1:, :, :1], alone, atol=2e-2, rtol=2e-2)

    noisy = torch.randn_like(latents["latents_mean"])
    hidden = spec.visual_input(latents, noisy.permute(0, 2, 3, 4, 1))
    assert hidden.shape[-1] == 2 * 4 + 1 == denoiser.config.in_visual_dim * 2 + 1
    assert torch.equal(hidden[:, :1, ..., :4], latents["image_latents"].permute(0, 2, 3, 4, 1))
    assert torch.equal(hidden[:, 1:, ..., :4], noisy.permute(0, 2, 3, 4, 1)[:, 1:])
    assert not hidden[..., 4:8].any()
    assert hidden[:, :1, ..., 8].eq(1).all() and not hidden[:, 1:, ..., 8].any()

    error = torch.ones(2, 4, 5, 2, 2)
    error[:, :, 0] = 100.0
    assert torch.equal(spec.per_clip_error(error, latents), torch.ones(2))


def _configs_with(tmp_path, source, name, **transformer):
    """A model folder holding `source`'s transformer and VAE configs, the transformer's changed by `transformer`
    (the shape rules and inputs read no weights)."""
    folder = tmp_path / name
    for component in ("transformer", "vae"):
        (folder / component).mkdir(parents=True)
        config = json.loads((source / component / "config.json").read_text())
        if component == "transformer":
            config |= transformer
        (folder / component / "config.json").write_text(json.dumps(config))
    return folder


def test_condition_inputs_are_zeros_for_text_to_video_and_absent_without_visual_cond(tmp_path, tiny_model_dir):
    """Every released Kandinsky 5 video transformer has `visual_cond`: the text-to-video pipeline appends zero
    condition latents and a zero mask, and so does training; a transformer without it takes the latents alone, and
    cannot be an image-to-video model."""
    source = tiny_model_dir("kandinsky-5")
    noisy = torch.randn(1, 3, 2, 2, 4)
    hidden = _spec(Kandinsky5Spec, source).visual_input({}, noisy)
    assert hidden.shape[-1] == 9
    assert torch.equal(hidden[..., :4], noisy) and not hidden[..., 4:].any()
    plain = _configs_with(tmp_path, source, "plain", visual_cond=False, in_visual_dim=4)
    assert torch.equal(_spec(Kandinsky5Spec, plain).visual_input({}, noisy), noisy)
    with pytest.raises(ConfigError, match="visual_cond is false"):
        _spec(Kandinsky5ImageToVideoSpec, plain).check_video_shape(9, 32, 32)


def test_nabla_checkpoints_take_sides_in_multiples_of_128(tmp_path, tiny_model_dir):
    source = tiny_model_dir("kandinsky-5")
    folder = _configs_with(tmp_path, source, "nabla", attention_type="nabla", attention_P=0.9, attention_wT=11,
                           attention_wH=3, attention_wW=3, attention_add_sta=True, attention_method="topcdf")
    spec = _spec(Kandinsky5Spec, folder)
    with pytest.raises(ConfigError, match=r"data.height=32 must be a multiple of 128.*\n.*data.width=32"):
        spec.check_video_shape(9, 32, 32)
    spec.check_video_shape(9, 128, 256)
    _spec(Kandinsky5Spec, source).check_video_shape(9, 32, 32)


@pytest.mark.parametrize("family", ["kandinsky-5", "kandinsky-5-i2v"])
def test_a_stopped_and_resumed_run_ends_bit_for_bit_like_one_left_alone(make_config, tmp_path, family):
    """Batches of two clips whose captions differ in length (each clip's own tokens, in two calls) and, for
    image-to-video, the image latents in the cache: resuming restores them all."""
    from safetensors.torch import load_file

    from tests.helpers.runs import run_stopped_at
    from vidtune.outputs import LORA_WEIGHTS

    settings = {"training": {"steps": 4, "batch_size": 2}, "checkpoint": {"every": 2},
                "precompute": {"enabled": True}}
    build_trainer(make_config(family, **settings, output_dir=str(tmp_path / "reference"))).run()
    out = tmp_path / "stopped"
    run_stopped_at(build_trainer(make_config(family, **settings, output_dir=str(out))), 3)
    settings["checkpoint"] = {"every": 2, "resume": "latest"}
    build_trainer(make_config(family, **settings, output_dir=str(out))).run()
    resumed, reference = load_file(out / LORA_WEIGHTS), load_file(tmp_path / "reference" / LORA_WEIGHTS)
    assert resumed.keys() == reference.keys() and resumed
    assert all(torch.equal(resumed[key], reference[key]) for key in resumed)


def test_image_to_video_refuses_stills_with_the_reason(make_config):
    """A still's one latent frame is the given image, out of the loss: nothing would be learnt (the loss would be the
    mean of nothing)."""
    spec = Kandinsky5ImageToVideoSpec(make_config("kandinsky-5-i2v").model)
    with pytest.raises(ConfigError, match="cannot train on stills"):
        spec.check_video_shape(1, 32, 32)
    spec.check_video_shape(17, 32, 32)
