"""LTX-2 specifics that must match what LTX2Pipeline does: the text embeddings after the connectors, every input the
transformer's two streams take, the silent audio track's latents, and the joint video + audio loss (a clip's own sound
through the data path: tests/models/test_ltx_2_audio.py)."""

from __future__ import annotations

import pytest
import torch

from vidtune.config import ModelConfig
from vidtune.models.ltx_2 import AUDIO_LATENTS, AUDIO_PRESENT, SILENT_LOG_MEL, LTX2Spec, encode_log_mel

CPU = torch.device("cpu")
FRAMES, HEIGHT, WIDTH = 9, 32, 32


def _spec(folder, **model) -> LTX2Spec:
    return LTX2Spec(ModelConfig(name="ltx-2", pretrained=str(folder), **model), frame_rate=24.0)


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("ltx-2")


@pytest.fixture(scope="module")
def parts(folder):
    spec = _spec(folder)
    return spec, spec.load_text_components(CPU), spec.load_vae(CPU), spec.load_denoiser(CPU)


def test_forward_gives_both_streams_what_the_pipeline_gives_them(parts):
    spec, text, vae, denoiser = parts
    seen: list[dict] = []
    hook = denoiser.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs), with_kwargs=True)
    try:
        pipeline = spec.pipeline(text, vae, denoiser)
        pipeline.set_progress_bar_config(disable=True)
        spec.sample(pipeline, "a red circle", frames=FRAMES, height=HEIGHT, width=WIDTH, num_inference_steps=2,
                    generator=torch.Generator().manual_seed(0), output="latents")
        assert len(seen) == 2  # unguided: one plain forward a step
        from_pipeline = seen[0]

        conditions = spec.prepare_conditions(text, ["a red circle"])
        videos = torch.zeros(1, FRAMES, 3, HEIGHT, WIDTH)
        conditions[AUDIO_LATENTS] = spec.prepare_latents(vae, videos)[AUDIO_LATENTS]
        with torch.no_grad():
            spec.forward(denoiser, conditions, torch.randn(1, 8, 3, 8, 8), torch.tensor([1000.0]))
        from_training = seen[-1]
    finally:
        hook.remove()

    for key in ("encoder_hidden_states", "audio_encoder_hidden_states"):
        torch.testing.assert_close(from_training[key], from_pipeline[key])
    assert torch.equal(from_training["encoder_attention_mask"], from_pipeline["encoder_attention_mask"])
    assert from_training["encoder_hidden_states"].shape[1] == spec.max_sequence_length == 32  # the tokenizer's
    for key in ("num_frames", "height", "width", "fps", "audio_num_frames", "use_cross_timestep"):
        assert from_training[key] == from_pipeline[key], key
    assert from_training["audio_hidden_states"].shape == from_pipeline["audio_hidden_states"].shape
    # The pipeline's first step is sigma 1 -> timestep 1000 for both streams, the scale training uses.
    assert float(from_pipeline["timestep"][0]) == pytest.approx(1000.0)
    torch.testing.assert_close(from_training["sigma"], from_pipeline["sigma"].float())
    # The pipeline hands the rotary positions it builds; the transformer builds the same ones from the grids.
    torch.testing.assert_close(from_pipeline["video_coords"],
                               denoiser.rope.prepare_video_coords(1, 3, 8, 8, CPU, fps=24.0))
    torch.testing.assert_close(from_pipeline["audio_coords"],
                               denoiser.audio_rope.prepare_audio_coords(1, from_training["audio_num_frames"], CPU))


def test_a_clip_without_sound_gets_the_audio_latents_of_silence_of_its_duration(parts):
    spec, _, vae, _ = parts
    latents = spec.prepare_latents(vae, torch.rand(2, FRAMES, 3, HEIGHT, WIDTH) * 2 - 1)
    audio = latents[AUDIO_LATENTS]
    length = spec.audio_latent_length(FRAMES)
    assert length == round(FRAMES / 24.0 * 16000 / 160 / 4)  # LTX2Pipeline's audio_num_frames
    assert audio.shape == (2, length, 8)
    assert torch.equal(audio[0], audio[1])  # silence does not depend on the picture
    assert torch.equal(latents[AUDIO_PRESENT], torch.zeros(2, 1, dtype=torch.bool))  # and is not taught (video only)
    config = vae.audio_vae.config
    # 4 L log-mel frames: what the causal audio VAE encodes into L latent frames.
    silence = torch.full((1, config.in_channels, 4 * length, config.mel_bins), SILENT_LOG_MEL)
    torch.testing.assert_close(audio[:1], encode_log_mel(vae.audio_vae, silence))
    # Another duration, another track; the same one comes from the per-shape cache.
    assert spec.silent_audio_latents(vae.audio_vae, 17).shape[1] == spec.audio_latent_length(17) > length
    assert spec.silent_audio_latents(vae.audio_vae, FRAMES) is spec.silent_audio_latents(vae.audio_vae, FRAMES)


def test_the_loss_is_the_video_error_plus_the_weighted_audio_error_of_clips_with_sound(parts, folder):
    spec, text, vae, denoiser = parts
    conditions = spec.prepare_conditions(text, ["a", "b"])
    conditions[AUDIO_LATENTS] = spec.prepare_latents(vae, torch.zeros(2, FRAMES, 3, HEIGHT, WIDTH))[AUDIO_LATENTS]
    conditions[AUDIO_PRESENT] = torch.tensor([[1.0], [1.0]])
    noisy, target = torch.randn(2, 8, 3, 8, 8), torch.randn(2, 8, 3, 8, 8)
    timesteps = torch.tensor([250.0, 900.0])
    with torch.no_grad():
        video, audio, audio_target = spec.joint_forward(denoiser, conditions, noisy, timesteps)
        error = spec.training_error(denoiser, conditions, noisy, timesteps, target)
        halved = _spec(folder, audio_loss_weight=0.5).training_error(denoiser, conditions, noisy, timesteps, target)
        silent_first = {**conditions, AUDIO_PRESENT: torch.tensor([[0.0], [1.0]])}
        video_only = spec.training_error(denoiser, silent_first, noisy, timesteps, target)
        other_audio = spec.training_error(denoiser, {**silent_first, AUDIO_LATENTS: conditions[AUDIO_LATENTS] + 1},
                                          noisy, timesteps, target)
        alone = spec.joint_forward(denoiser, {k: v[:1] for k, v in conditions.items()}, noisy[:1], timesteps[:1],
                                   isolated=True)[0]
    video_error = (video - target).pow(2).flatten(1).mean(1)
    audio_error = (audio - audio_target).pow(2).flatten(1).mean(1)
    torch.testing.assert_close(error, video_error + audio_error)
    torch.testing.assert_close(halved, video_error + 0.5 * audio_error)
    # A clip without sound trains video only: no audio error, and its video does not attend to the audio stream
    # (whatever that holds), while the clip with sound in the same batch trains both streams jointly.
    alone_error = (alone - target[:1]).pow(2).flatten(1).mean(1)
    torch.testing.assert_close(video_only, torch.cat([alone_error, video_error[1:] + audio_error[1:]]))
    torch.testing.assert_close(other_audio[0], video_only[0])
    assert not torch.allclose(alone_error, video_error[:1])  # the joint forward would have shown it the audio
    # The audio target is the flow-matching velocity of the clip's own noise, drawn per clip from its timestep.
    noise = spec.audio_noise(timesteps, conditions[AUDIO_LATENTS])
    torch.testing.assert_close(audio_target, noise - conditions[AUDIO_LATENTS])
    torch.testing.assert_close(spec.audio_noise(timesteps[1:], conditions[AUDIO_LATENTS][1:]), noise[1:])
    assert not torch.equal(noise[0], noise[1])
