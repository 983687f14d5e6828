"""CogVideoX conventions (text and image-to-video) that the contract and overfit tests would not pin down alone."""

from __future__ import annotations

import pytest
import torch

from vidtune.config import ModelConfig, TrainingConfig
from vidtune.errors import ConfigError
from vidtune.models.cogvideox import CogVideoXI2VSpec, CogVideoXSpec
from vidtune.models.tiny import TINY_SHAPES, reference_videos
from vidtune.objectives import DDPM

CPU = torch.device("cpu")
CAPTIONS = ["a red circle moving left", "A  blue square,   spinning slowly on a dark background"]


def _spec(cls, folder, **model):
    return cls(ModelConfig(name=cls.name, pretrained=str(folder), **model))


def _videos(family: str, batch: int = 2) -> torch.Tensor:
    frames, size, _ = TINY_SHAPES[family]
    return reference_videos(frames, size)[:batch]


def _components(spec):
    return spec.load_text_components(CPU), spec.load_vae(CPU), spec.load_denoiser(CPU)


@pytest.fixture(scope="module")
def t2v_folder(tiny_model_dir):
    return tiny_model_dir("cogvideox")


@pytest.fixture(scope="module")
def i2v_folder(tiny_model_dir):
    return tiny_model_dir("cogvideox-i2v")


# ----- text ----------------------------------------------------------------------------------------------
def test_prepare_conditions_equal_the_pipeline_encode_prompt(t2v_folder):
    spec = _spec(CogVideoXSpec, t2v_folder)
    text, vae, denoiser = _components(spec)
    pipeline = spec.pipeline(text, vae, denoiser)
    # The pipeline pads to the transformer's max_text_seq_length (226 in released checkpoints; 16 here).
    assert spec.max_sequence_length == denoiser.config.max_text_seq_length == 16
    expected, _ = pipeline.encode_prompt(CAPTIONS, do_classifier_free_guidance=False,
                                         max_sequence_length=spec.max_sequence_length, device=CPU)
    conditions = spec.prepare_conditions(text, CAPTIONS)
    assert set(conditions) == {"prompt_embeds"}
    torch.testing.assert_close(conditions["prompt_embeds"], expected)


def test_sequence_length_defaults_to_the_transformer_and_absolute_embeddings_allow_no_other(t2v_folder, i2v_folder):
    assert _spec(CogVideoXSpec, t2v_folder, max_sequence_length=None).max_sequence_length == 16  # unset: the family's
    assert _spec(CogVideoXSpec, t2v_folder, max_sequence_length=8).max_sequence_length == 8  # rotary only: free
    frames, size, _ = TINY_SHAPES["cogvideox-i2v"]
    spec = _spec(CogVideoXI2VSpec, i2v_folder, max_sequence_length=8)  # learned positional embeddings
    with pytest.raises(ConfigError, match="max_sequence_length=16"):
        spec.check_video_shape(frames, size, size)


# ----- objective -----------------------------------------------------------------------------------------
def test_objective_is_the_schedulers_v_prediction_unweighted(t2v_folder):
    spec = _spec(CogVideoXSpec, t2v_folder)
    scheduler = spec.load_scheduler()
    objective = spec.objective(TrainingConfig())
    assert isinstance(objective, DDPM) and objective.prediction_type == "v_prediction"
    assert not objective.snr_weighting
    # The scheduler's SNR shift and zero-terminal-SNR rescaling are in the training alphas.
    torch.testing.assert_close(objective.alphas_cumprod, scheduler.alphas_cumprod)
    assert float(objective.alphas_cumprod[-1]) < 1e-6


def test_unweighted_v_loss_is_cogvideox_weighted_x0_loss(t2v_folder):
    """CogVideoX's scripts: loss = mean(1 / (1 - a_t) * (get_velocity(output, noisy, t) - x0)^2): the same number."""
    spec = _spec(CogVideoXSpec, t2v_folder)
    scheduler = spec.load_scheduler()
    objective = spec.objective(TrainingConfig())
    generator = torch.Generator().manual_seed(0)
    x0, noise, output = (torch.randn(4, 4, 2, 4, 4, generator=generator) for _ in range(3))
    levels = torch.tensor([0.0, 10.0, 500.0, 998.0])
    noisy = objective.noisy(x0, noise, levels)
    ours = (output - objective.target(x0, noise, levels)).pow(2).flatten(1).mean(1) * objective.loss_weights(levels)
    timesteps = levels.long()
    x0_prediction = scheduler.get_velocity(output, noisy, timesteps)
    weights = 1 / (1 - scheduler.alphas_cumprod[timesteps].float())
    theirs = (weights.view(-1, 1, 1, 1, 1) * (x0_prediction - x0) ** 2).flatten(1).mean(1)
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-5)


# ----- latents -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["cogvideox", "cogvideox-i2v"])
def test_rotary_embeddings_are_the_pipelines(family, tiny_model_dir):
    spec = _spec(CogVideoXI2VSpec if family.endswith("i2v") else CogVideoXSpec, tiny_model_dir(family))
    text, vae, denoiser = _components(spec)
    pipeline = spec.pipeline(text, vae, denoiser)
    frames, size, _ = TINY_SHAPES[family]
    latent_frames = (frames - 1) // 4 + 1
    ours = spec.rotary_embeddings(denoiser, latent_frames, size // 8, size // 8, CPU)
    expected = pipeline._prepare_rotary_positional_embeddings(size, size, latent_frames, CPU)
    assert ours is not None
    for mine, theirs in zip(ours, expected, strict=True):
        torch.testing.assert_close(mine, theirs)


@pytest.mark.parametrize("frames", [13, 9])
def test_pipeline_decodes_training_latents_to_the_vae_reconstruction(t2v_folder, frames):
    """Normalisation: the latents the trainer teaches, put in the pipeline's loop, decode to the VAE's own output.
    9 frames (3 latent frames, temporal patch 2): the padding frame in front is the one the pipeline drops."""
    spec = _spec(CogVideoXSpec, t2v_folder)
    text, vae, denoiser = _components(spec)
    pipeline = spec.pipeline(text, vae, denoiser)
    pipeline.set_progress_bar_config(disable=True)
    _, size, _ = TINY_SHAPES["cogvideox"]
    videos = reference_videos(frames, size)[:1]
    latents = spec.prepare_latents(vae, videos)["latents_mean"]

    def inject(pipe, step, timestep, tensors):
        return {"latents": latents.permute(0, 2, 1, 3, 4)} if step == pipe.num_timesteps - 1 else {}

    decoded = pipeline(prompt="a", num_frames=frames, height=size, width=size, num_inference_steps=2,
                       guidance_scale=1.0, max_sequence_length=spec.max_sequence_length, output_type="pt",
                       callback_on_step_end=inject).frames
    with torch.no_grad():
        raw = vae.encode(videos.permute(0, 2, 1, 3, 4)).latent_dist.mean
        expected = (vae.decode(raw).sample / 2 + 0.5).clamp(0, 1).permute(0, 2, 1, 3, 4)
    torch.testing.assert_close(decoded, expected, atol=1e-4, rtol=1e-4)


def test_shape_rules_follow_the_temporal_patch_and_learned_embeddings(t2v_folder, i2v_folder):
    spec = _spec(CogVideoXSpec, t2v_folder)  # temporal patch 2: an odd latent frame count is padded
    spec.check_video_shape(13, 32, 16)
    spec.check_video_shape(9, 32, 32)
    with pytest.raises(ConfigError, match=r"data.frames=10 must be 4k\+1 for this model; nearest valid values: 9 or 1"):
        spec.check_video_shape(10, 32, 32)
    # CogVideoX 1.5 slices a rotary table of sample_height x sample_width latents (4 x 4 here: 32 pixels).
    with pytest.raises(ConfigError, match=r"data.width=48: .*at most 32; nearest valid value: 32"):
        spec.check_video_shape(13, 32, 48)
    i2v = _spec(CogVideoXI2VSpec, i2v_folder)  # no temporal patch, positional embeddings learned for 32 x 32
    i2v.check_video_shape(13, 32, 32)
    with pytest.raises(ConfigError, match=r"data.width=48: .*fit 32 only; nearest valid value: 32"):
        i2v.check_video_shape(9, 32, 48)


def test_cogvideox_1_5_pads_an_odd_latent_frame_count_like_its_pipeline(t2v_folder):
    """9 frames are 3 latent frames, and the temporal patch is 2: the latents get the first latent frame once more in
    front, the grid the pipeline denoises (it generates one frame more and drops the first before decoding)."""
    spec = _spec(CogVideoXSpec, t2v_folder)
    text, vae, denoiser = _components(spec)
    videos = reference_videos(9, 32)[:1]
    latents = spec.prepare_latents(vae, videos)
    with torch.no_grad():
        unpadded = vae.encode(videos.permute(0, 2, 1, 3, 4)).latent_dist.mean * vae.config.scaling_factor
    assert unpadded.shape[2] == 3 and latents["latents_mean"].shape[2] == 4
    torch.testing.assert_close(latents["latents_mean"], torch.cat([unpadded[:, :, :1], unpadded], dim=2))
    assert latents["latents_std"].shape == latents["latents_mean"].shape
    pipeline = spec.pipeline(text, vae, denoiser)
    pipeline.set_progress_bar_config(disable=True)
    with torch.no_grad():
        sampled = spec.sample(pipeline, "a", frames=9, height=32, width=32, num_inference_steps=2,
                              generator=torch.Generator().manual_seed(0), output="latents").latents
        prediction = spec.forward(denoiser, spec.prepare_conditions(text, ["a"]), latents["latents_mean"],
                                  torch.tensor([500]))
        video = spec.sample(pipeline, "a", frames=9, height=32, width=32, num_inference_steps=2,
                            generator=torch.Generator().manual_seed(0)).frames
    assert sampled.shape == prediction.shape == latents["latents_mean"].shape
    assert video.shape == (9, 3, 32, 32)  # the pipeline drops the padding before decoding


# ----- image-to-video ------------------------------------------------------------------------------------
def test_image_latents_are_the_pipelines_first_frame_latents(i2v_folder):
    spec = _spec(CogVideoXI2VSpec, i2v_folder)
    spec.image_noise_log_sigma = None  # compare without the training-time noise augmentation
    text, vae, denoiser = _components(spec)
    pipeline = spec.pipeline(text, vae, denoiser)
    frames, size, _ = TINY_SHAPES["cogvideox-i2v"]
    videos = _videos("cogvideox-i2v")
    latents = spec.prepare_latents(vae, videos)
    image_latents = latents["image_latents"]
    assert image_latents.shape == latents["latents_mean"].shape  # [B, C, F, H, W]
    assert (image_latents[:, :, 1:] == 0).all()
    _, expected = pipeline.prepare_latents(videos[:, 0], 2, 4, frames, size, size, torch.float32, CPU,
                                           torch.Generator().manual_seed(0))
    # Both are posterior samples of a narrow posterior; they agree to a few posterior standard deviations.
    tolerance = 6 * float(latents["latents_std"].max())
    torch.testing.assert_close(image_latents, expected.permute(0, 2, 1, 3, 4), atol=tolerance, rtol=0)


def test_image_noise_augmentation_is_fixed_per_clip(i2v_folder):
    spec = _spec(CogVideoXI2VSpec, i2v_folder)
    vae = spec.load_vae(CPU)
    videos = _videos("cogvideox-i2v", 3)
    first = spec.prepare_latents(vae, videos)["image_latents"]
    again = spec.prepare_latents(vae, videos[[2, 0]])["image_latents"]  # other batch, other positions
    torch.testing.assert_close(again, first[[2, 0]])
    clean = _spec(CogVideoXI2VSpec, i2v_folder)
    clean.image_noise_log_sigma = None
    assert (clean.prepare_latents(vae, videos)["image_latents"] - first).abs().max() > 1e-3


def test_sampling_starts_from_the_reference_video(i2v_folder):
    spec = _spec(CogVideoXI2VSpec, i2v_folder)
    text, vae, denoiser = _components(spec)
    pipeline = spec.pipeline(text, vae, denoiser)
    pipeline.set_progress_bar_config(disable=True)
    frames, size, _ = TINY_SHAPES["cogvideox-i2v"]
    videos = _videos("cogvideox-i2v")

    def sample(reference=None):
        return spec.sample(pipeline, "a", frames=frames, height=size, width=size, num_inference_steps=2,
                           generator=torch.Generator().manual_seed(0), reference=reference, output="latents").latents

    with pytest.raises(Exception, match="reference"):
        sample()
    first = sample(videos[0])
    assert (sample(videos[1]) - first).abs().max() > 1e-4


def test_cogvideox_1_5_image_to_video_pads_an_odd_latent_frame_count_like_its_pipeline(tmp_path):
    """CogVideoX 1.5 I2V, 9 frames: 3 latent frames and a temporal patch of 2. The latents get the first latent frame
    once more in front; the image condition is the pipeline's: the first frame's latents in latent frame 0, zeros in
    the other three. The pipeline samples that grid and drops the padding frame before decoding."""
    from vidtune.models.tiny.cogvideox import write_tiny_cogvideox

    folder = write_tiny_cogvideox(tmp_path / "cogvideox-1.5-i2v", image_to_video=True, version_1_5=True)
    spec = _spec(CogVideoXI2VSpec, folder)
    spec.image_noise_log_sigma = None  # compare without the training-time noise augmentation
    spec.check_video_shape(9, 32, 32)  # accepted, not refused
    text, vae, denoiser = _components(spec)
    videos = reference_videos(9, 32)[:1]
    latents = spec.prepare_latents(vae, videos)
    with torch.no_grad():
        unpadded = vae.encode(videos.permute(0, 2, 1, 3, 4)).latent_dist.mean * vae.config.scaling_factor
    assert unpadded.shape[2] == 3 and latents["latents_mean"].shape[2] == 4
    torch.testing.assert_close(latents["latents_mean"], torch.cat([unpadded[:, :, :1], unpadded], dim=2))
    pipeline = spec.pipeline(text, vae, denoiser)
    pipeline.set_progress_bar_config(disable=True)
    # The pipeline asks prepare_latents for its padded frame count (13 frames: 4 latent frames).
    _, expected = pipeline.prepare_latents(videos[:, 0], 1, 4, 13, 32, 32, torch.float32, CPU,
                                           torch.Generator().manual_seed(0))
    image_latents = latents["image_latents"]
    assert image_latents.shape == latents["latents_mean"].shape == expected.permute(0, 2, 1, 3, 4).shape
    assert (image_latents[:, :, 1:] == 0).all() and image_latents[:, :, 0].abs().sum() > 0
    tolerance = 6 * float(latents["latents_std"].max())  # two samples of one narrow posterior
    torch.testing.assert_close(image_latents, expected.permute(0, 2, 1, 3, 4), atol=tolerance, rtol=0)
    with torch.no_grad():
        prediction = spec.forward(denoiser, {**spec.prepare_conditions(text, ["a"]), "image_latents": image_latents},
                                  latents["latents_mean"], torch.tensor([500]))
        sampled = spec.sample(pipeline, "a", frames=9, height=32, width=32, num_inference_steps=2,
                              generator=torch.Generator().manual_seed(0), reference=videos[0], output="latents").latents
        video = spec.sample(pipeline, "a", frames=9, height=32, width=32, num_inference_steps=2,
                            generator=torch.Generator().manual_seed(0), reference=videos[0]).frames
    assert sampled.shape == prediction.shape == latents["latents_mean"].shape
    assert video.shape == (9, 3, 32, 32)  # the padding frame is dropped before decoding
