"""LTX-Video image-to-video: what training gives the denoiser must be what LTXConditionPipeline (0.9.5+ layout) or
LTXImageToVideoPipeline (0.9.0 / 0.9.1 layout) gives it: clean condition tokens at timestep 0, the keyframes'
extra tokens and rotary positions; and the clean tokens stay out of the loss."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.datasets import pair_samples
from tests.helpers.runs import record_references
from vidtune.config import ModelConfig
from vidtune.data.video import ClipWindow, read_clip
from vidtune.errors import ConfigError
from vidtune.models.ltx_video import LTXVideoImageToVideoSpec, vae_downsampling_steps
from vidtune.trainers import build_trainer

CPU = torch.device("cpu")
FRAMES, HEIGHT, WIDTH = 9, 32, 32


def i2v_spec(folder, condition_frames=(0,)) -> LTXVideoImageToVideoSpec:
    model = ModelConfig(name="ltx-video-i2v", pretrained=str(folder), condition_frames=list(condition_frames))
    return LTXVideoImageToVideoSpec(model, frame_rate=24.0)


@pytest.fixture
def clip(shapes_dataset):
    return read_clip(pair_samples(shapes_dataset)[0].video, ClipWindow(FRAMES, HEIGHT, WIDTH))


def pipeline_and_training_inputs(spec: LTXVideoImageToVideoSpec, clip: torch.Tensor, **call: object):
    """The denoiser's keyword inputs at the pipeline's first step (sigma 1), at training's for the same noisy
    latents, conditions and timestep, and how far apart the two may be: the pipeline draws its condition latents
    from the posterior, training gives its mean (a few posterior stds)."""
    text, vae, denoiser = spec.load_text_components(CPU), spec.load_vae(CPU), spec.load_denoiser(CPU)
    seen: list[dict] = []
    denoiser.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs), with_kwargs=True)
    pipeline = spec.pipeline(text, vae, denoiser)
    pipeline.set_progress_bar_config(disable=True)
    pipeline(prompt="a red circle", num_frames=FRAMES, height=HEIGHT, width=WIDTH, num_inference_steps=2,
             guidance_scale=1.0, generator=torch.Generator().manual_seed(0), output_type="latent",
             **spec.pipeline_inputs(clip), **call)
    from_pipeline = seen[0]

    conditions = {**spec.prepare_conditions(text, ["a red circle"]), **spec.prepare_latents(vae, clip[None])}
    frames = (FRAMES - 1) // 4 + 1
    extra = len(spec.keyframes(frames)) * (HEIGHT // 4) * (WIDTH // 4)
    patch = denoiser.config.patch_size
    noisy = pipeline._unpack_latents(from_pipeline["hidden_states"][:, extra:], frames, HEIGHT // 4 // patch,
                                     WIDTH // 4 // patch, patch, denoiser.config.patch_size_t)
    with torch.no_grad():
        spec.forward(denoiser, conditions, noisy, torch.tensor([1000.0]))
    return from_pipeline, seen[-1], 6 * float(conditions["latents_std"].max())


def test_condition_pipeline_inputs_match_training_with_the_first_frame_and_a_keyframe(tiny_model_dir, clip):
    spec = i2v_spec(tiny_model_dir("ltx-video-i2v"), condition_frames=(0, 8))
    assert spec.uses_condition_pipeline
    # Noise on the condition tokens is a sampling-time option; without it both sides give them clean.
    from_pipeline, from_training, atol = pipeline_and_training_inputs(spec, clip, image_cond_noise_scale=0.0)

    tokens_per_frame = (HEIGHT // 4) * (WIDTH // 4)
    # The keyframe's tokens come first, then the video's: 1 + 3 latent frames of 8 x 8 tokens.
    assert from_pipeline["hidden_states"].shape[1] == 4 * tokens_per_frame
    torch.testing.assert_close(from_training["hidden_states"], from_pipeline["hidden_states"], atol=atol, rtol=0)
    torch.testing.assert_close(from_training["video_coords"], from_pipeline["video_coords"])
    timestep = from_training["timestep"]
    torch.testing.assert_close(timestep, from_pipeline["timestep"].float())
    # Timestep 0 on the keyframe's and the first frame's tokens, sigma * 1000 on the rest.
    assert torch.all(timestep[:, : 2 * tokens_per_frame] == 0)
    assert torch.all(timestep[:, 2 * tokens_per_frame:] == 1000)
    # The keyframe sits at frame 8 of the clip, in seconds at 24 fps.
    assert float(from_training["video_coords"][0, 0, 0]) == pytest.approx(8 / 24.0)


def test_older_checkpoints_sample_with_the_image_to_video_pipeline_as_trained(tiny_model_dir, clip):
    """A scheduler with dynamic shifting (0.9.0 / 0.9.1) cannot take LTXConditionPipeline's timesteps: the same
    spec samples those with LTXImageToVideoPipeline and trains with its rotary scale."""
    spec = i2v_spec(tiny_model_dir("ltx-video"))
    assert not spec.uses_condition_pipeline
    from_pipeline, from_training, atol = pipeline_and_training_inputs(spec, clip)
    assert "video_coords" not in from_training
    assert from_training["rope_interpolation_scale"] == pytest.approx(from_pipeline["rope_interpolation_scale"])
    torch.testing.assert_close(from_training["hidden_states"], from_pipeline["hidden_states"], atol=atol, rtol=0)
    torch.testing.assert_close(from_training["timestep"], from_pipeline["timestep"].float())


def test_the_first_frame_is_given_not_predicted(tiny_model_dir, clip):
    """Noise on the first latent frame never reaches the denoiser, the condition does, and its error is no loss."""
    spec = i2v_spec(tiny_model_dir("ltx-video-i2v"))
    text, vae, denoiser = spec.load_text_components(CPU), spec.load_vae(CPU), spec.load_denoiser(CPU)
    conditions = {**spec.prepare_conditions(text, ["a red circle"]), **spec.prepare_latents(vae, clip[None])}
    assert conditions["condition_latents"].shape == (1, 8, 1, 8, 8)
    noisy = torch.randn(1, 8, 3, 8, 8, generator=torch.Generator().manual_seed(0))
    other = noisy.clone()
    other[:, :, 0] += 5.0
    timesteps = torch.tensor([600.0])
    with torch.no_grad():
        first = spec.forward(denoiser, conditions, noisy, timesteps)
        second = spec.forward(denoiser, conditions, other, timesteps)
        moved = spec.forward(denoiser, {**conditions, "condition_latents": conditions["condition_latents"] + 1.0},
                             noisy, timesteps)
    torch.testing.assert_close(first, second)
    assert (moved[:, :, 1:] - first[:, :, 1:]).abs().max() > 1e-4

    error = torch.zeros(1, 8, 3, 8, 8)
    error[:, :, 0] = 100.0
    assert float(spec.per_clip_error(error, conditions)) == 0.0
    error[:, :, 2] = 1.0
    assert float(spec.per_clip_error(error, conditions)) == pytest.approx(0.5)


@pytest.mark.parametrize(("frames", "expected"), [
    ([0, 0], "names a frame twice"),
    ([0, 9], "frame(s) [9] lie outside the 9 frames"),
])
def test_bad_condition_frames_are_named(tiny_model_dir, frames, expected):
    with pytest.raises(ConfigError, match=r"model\.condition_frames") as raised:
        i2v_spec(tiny_model_dir("ltx-video-i2v"), frames).check_video_shape(FRAMES, HEIGHT, WIDTH)
    assert expected in str(raised.value) and "What to do:" in str(raised.value)


def test_keyframes_need_a_checkpoint_the_condition_pipeline_samples(tiny_model_dir):
    with pytest.raises(ConfigError, match="LTXImageToVideoPipeline"):
        i2v_spec(tiny_model_dir("ltx-video"), (0, 8)).check_video_shape(FRAMES, HEIGHT, WIDTH)


def test_vae_ratios_are_read_from_either_layout():
    """0.9.0 / 0.9.1 halve space and time in each scaling block; 0.9.5+ name what each block halves."""
    older = {"spatio_temporal_scaling": [True, True, True, False]}
    assert vae_downsampling_steps(older) == (3, 3)
    newer = {"spatio_temporal_scaling": [True, True, True, True],
             "downsample_type": ["spatial", "temporal", "spatiotemporal", "spatiotemporal"]}
    assert vae_downsampling_steps(newer) == (3, 3)
    tiny = {"spatio_temporal_scaling": [True, True, True, False],
            "downsample_type": ["spatial", "temporal", "spatiotemporal", "conv"]}
    assert vae_downsampling_steps(tiny) == (2, 2)


def test_condition_frames_are_part_of_the_latents_identity_only(tiny_model_dir):
    """Other condition frames are other cached latents (each clip's condition latents), the same captions."""
    first, keyframes = (i2v_spec(tiny_model_dir("ltx-video-i2v"), frames) for frames in ([0], [0, 8]))
    assert first.latent_identity() != keyframes.latent_identity()
    assert first.condition_identity() == keyframes.condition_identity()


def test_a_keyframe_run_trains_and_validates_from_its_keyframes(make_config, tmp_path):
    """The whole path with a keyframe: condition latents per clip, the loss, and validation sampling from the first
    clip's frames 0 and 8 with LTXConditionPipeline."""
    config = make_config("ltx-video-i2v", model={"condition_frames": [0, 8]},
                         training={"steps": 2, "learning_rate": 5e-2}, lora={"rank": 4, "alpha": 4},
                         validation={"enabled": True, "every": 2, "num_inference_steps": 2})
    trainer = build_trainer(config)
    seen, original = record_references(trainer)
    result = trainer.run()
    assert result.weights_path.is_file() and result.sample_paths
    assert seen and all(frames == 9 for frames in seen)  # the reference reaches frame 8
    inputs = original(read_clip(trainer.context.clips[0].video, ClipWindow(9, HEIGHT, WIDTH)))
    assert [condition.frame_index for condition in inputs["conditions"]] == [0, 8]
