"""First-frame conditioning of the LTX families: a share of the samples (model.first_frame_conditioning; Lightricks'
defaults 0.1 for text-to-video, 0.5 for LTX-2 image-to-video) get their first latent frame clean, timestep 0 there,
and no loss on it; and `ltx-2-i2v` trains and samples through LTX2ImageToVideoPipeline."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.datasets import pair_samples
from tests.helpers.runs import record_references
from vidtune.config import ModelConfig
from vidtune.data.video import ClipWindow, read_clip
from vidtune.errors import ConfigError
from vidtune.models import first_frame
from vidtune.models.ltx_2 import AUDIO_LATENTS, UNGUIDED
from vidtune.models.registry import get_spec_class
from vidtune.trainers import build_trainer

CPU = torch.device("cpu")
FRAMES, HEIGHT, WIDTH = 9, 32, 32
DRAWS = 20_000


def spec_of(family: str, folder, **model):
    return get_spec_class(family)(ModelConfig(name=family, pretrained=str(folder), **model), frame_rate=24.0)


@pytest.mark.parametrize(("family", "model", "expected"), [
    ("ltx-video", {}, 0.1),
    ("ltx-2", {}, 0.1),
    ("ltx-2-i2v", {}, 0.5),
    ("ltx-video", {"first_frame_conditioning": 0.3}, 0.3),
    ("ltx-video-i2v", {"first_frame_conditioning": 0.25}, 0.25),
])
def test_the_share_of_samples_given_their_first_frame(tiny_model_dir, family, model, expected):
    spec = spec_of(family, tiny_model_dir(family), **model)
    x0 = torch.zeros(DRAWS, 1, 3, 1, 1)
    drawn = spec.visit_conditions(x0, torch.arange(DRAWS), seed=0)[first_frame.GIVEN]
    # Binomial: 4 standard deviations of the mean at 20,000 draws is under 0.015.
    assert float(drawn.mean()) == pytest.approx(expected, abs=4 * (expected * (1 - expected) / DRAWS) ** 0.5)
    # Seeded by the visit: the same positions draw the same samples, another seed others.
    assert torch.equal(drawn, spec.visit_conditions(x0, torch.arange(DRAWS), seed=0)[first_frame.GIVEN])
    assert not torch.equal(drawn, spec.visit_conditions(x0, torch.arange(DRAWS), seed=1)[first_frame.GIVEN])


def test_no_draw_for_a_still_nor_at_zero_and_every_sample_for_image_to_video(tiny_model_dir):
    still = torch.zeros(64, 1, 1, 1, 1)
    assert float(spec_of("ltx-video", tiny_model_dir("ltx-video"), first_frame_conditioning=1.0)
                 .visit_conditions(still, torch.arange(64), 0)[first_frame.GIVEN].sum()) == 0.0
    assert spec_of("ltx-2", tiny_model_dir("ltx-2"), first_frame_conditioning=0.0).visit_conditions(
        torch.zeros(4, 1, 3, 1, 1), torch.arange(4), 0) == {}
    # ltx-video-i2v conditions every sample unless told otherwise (no draw: the forward gives every first frame).
    assert spec_of("ltx-video-i2v", tiny_model_dir("ltx-video-i2v")).visit_conditions(
        torch.zeros(4, 1, 3, 1, 1), torch.arange(4), 0) == {}


def test_families_without_it_refuse_the_setting(make_config):
    config = make_config("wan", model={"first_frame_conditioning": 0.1})
    with pytest.raises(ConfigError, match=r"model\.first_frame_conditioning=0\.1: wan takes no first-frame"):
        build_trainer(config).check_inputs()


def test_ltx_video_i2v_keyframes_need_every_sample_conditioned(tiny_model_dir):
    spec = spec_of("ltx-video-i2v", tiny_model_dir("ltx-video-i2v"), condition_frames=[0, 8],
                   first_frame_conditioning=0.5)
    with pytest.raises(ConfigError, match="first frame only"):
        spec.check_video_shape(FRAMES, HEIGHT, WIDTH)


@pytest.mark.parametrize("family", ["ltx-video", "ltx-2", "ltx-2-i2v", "ltx-video-i2v"])
def test_a_given_first_frame_is_clean_at_timestep_0_and_out_of_the_loss(tiny_model_dir, family):
    """Sample 0 is given its first frame, sample 1 not: noise on sample 0's first latent frame never reaches the
    denoiser, its first frame's tokens run at timestep 0, and its error there is no loss; sample 1 is untouched."""
    spec = spec_of(family, tiny_model_dir(family), first_frame_conditioning=0.5)
    text, vae, denoiser = spec.load_text_components(CPU), spec.load_vae(CPU), spec.load_denoiser(CPU)
    videos = torch.rand(2, FRAMES, 3, HEIGHT, WIDTH, generator=torch.Generator().manual_seed(0)) * 2 - 1
    latents = spec.prepare_latents(vae, videos)
    x0 = latents["latents_mean"]
    conditions = {**spec.prepare_conditions(text, ["a red circle"] * 2),
                  **{k: v for k, v in latents.items() if k not in ("latents_mean", "latents_std")}}
    drawn = first_frame.draw(1.0, x0, torch.arange(2), seed=0)
    drawn[first_frame.GIVEN] = torch.tensor([1.0, 0.0])
    if family == "ltx-video-i2v":  # its condition is the frame encoded alone; only which samples is drawn
        drawn = {first_frame.GIVEN: drawn[first_frame.GIVEN]}
    conditions.update(drawn)
    noisy = torch.randn_like(x0)
    other = noisy.clone()
    other[:, :, 0] += 5.0
    timesteps = torch.tensor([700.0, 700.0])
    seen: list[dict] = []
    denoiser.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs), with_kwargs=True)
    with torch.no_grad():
        first = spec.forward(denoiser, conditions, noisy, timesteps)
        second = spec.forward(denoiser, conditions, other, timesteps)
    torch.testing.assert_close(first[0], second[0])
    assert (first[1] - second[1]).abs().max() > 1e-4
    tokens_per_frame = (HEIGHT // 4) * (WIDTH // 4)
    timestep = seen[0]["timestep"]
    assert timestep.shape == (2, 3 * tokens_per_frame)
    assert torch.all(timestep[0, :tokens_per_frame] == 0) and torch.all(timestep[0, tokens_per_frame:] == 700)
    assert torch.all(timestep[1] == 700)
    if AUDIO_LATENTS in conditions:  # LTX-2: the sound keeps the clip's timestep
        assert seen[0]["audio_timestep"].tolist() == [700.0, 700.0]

    error = torch.zeros_like(x0)
    error[:, :, 0] = 100.0
    error[:, :, 1:] = 1.0
    assert spec.per_clip_error(error, conditions).tolist() == pytest.approx([1.0, (100.0 + 2.0) / 3])


def test_ltx2_i2v_training_gives_the_denoiser_what_its_pipeline_gives(tiny_model_dir, shapes_dataset):
    """The first step of LTX2ImageToVideoPipeline and training with the first frame given: the image's latent clean
    in the first frame's tokens at timestep 0, the rest at the step's timestep, the same rotary rate and sound."""
    spec = spec_of("ltx-2-i2v", tiny_model_dir("ltx-2-i2v"))
    text, vae, denoiser = spec.load_text_components(CPU), spec.load_vae(CPU), spec.load_denoiser(CPU)
    clip = read_clip(pair_samples(shapes_dataset)[0].video, ClipWindow(FRAMES, HEIGHT, WIDTH))
    seen: list[dict] = []
    denoiser.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs), with_kwargs=True)
    pipeline = spec.pipeline(text, vae, denoiser)
    pipeline.set_progress_bar_config(disable=True)
    assert type(pipeline).__name__ == "LTX2ImageToVideoPipeline"
    # Without re-compressing the image (`image_crf`, a sampling-time imitation of a video's compression: training
    # clips carry their own), both sides give the frame's latent.
    pipeline(prompt="a red circle", num_frames=FRAMES, height=HEIGHT, width=WIDTH, num_inference_steps=2,
             guidance_scale=1.0, generator=torch.Generator().manual_seed(0), output_type="latent", image_crf=0,
             max_sequence_length=spec.max_sequence_length, **UNGUIDED, **spec.pipeline_inputs(clip))
    from_pipeline = seen[0]

    latents = spec.prepare_latents(vae, clip[None])
    conditions = {**spec.prepare_conditions(text, ["a red circle"]), AUDIO_LATENTS: latents[AUDIO_LATENTS],
                  **first_frame.draw(1.0, latents["latents_mean"], torch.arange(1), seed=0)}
    patch = denoiser.config.patch_size
    noisy = pipeline._unpack_latents(from_pipeline["hidden_states"], 3, HEIGHT // 4 // patch, WIDTH // 4 // patch,
                                     patch, denoiser.config.patch_size_t)
    with torch.no_grad():
        spec.forward(denoiser, conditions, noisy, torch.tensor([1000.0]))
    from_training = seen[-1]
    tokens_per_frame = (HEIGHT // 4) * (WIDTH // 4)
    # The pipeline encodes the frame alone (the posterior's mode), training takes the clip's first latent frame: the
    # causal VAE makes them the same.
    torch.testing.assert_close(from_training["hidden_states"], from_pipeline["hidden_states"], atol=1e-4, rtol=0)
    torch.testing.assert_close(from_training["timestep"], from_pipeline["timestep"].float())
    assert torch.all(from_training["timestep"][:, :tokens_per_frame] == 0)
    for key in ("fps", "audio_num_frames", "num_frames"):
        assert from_training[key] == from_pipeline[key], key
    torch.testing.assert_close(from_training["audio_timestep"], from_pipeline["audio_timestep"].float())


def test_ltx2_i2v_trains_and_validates_from_the_first_clip(make_config):
    config = make_config("ltx-2-i2v", training={"steps": 2, "learning_rate": 5e-2}, lora={"rank": 4, "alpha": 4},
                         validation={"enabled": True, "every": 2, "num_inference_steps": 2})
    trainer = build_trainer(config)
    seen, _ = record_references(trainer)
    result = trainer.run()
    assert result.weights_path.is_file() and result.sample_paths
    assert seen and all(frames >= 1 for frames in seen)
    assert all(loss == loss for loss in result.losses)
