"""The LTX families tell the denoiser each clip's own frame rate (on the fly and from the cache), and LTX-2 cuts each
clip's sound to its frames / that rate, as Lightricks' trainers do."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from vidtune.data.synthetic import render_shapes_dataset
from vidtune.data.video import read_frames, write_video
from vidtune.errors import ConfigError
from vidtune.models.ltx_2 import LTX2Spec
from vidtune.models.spec import FRAME_RATE
from vidtune.precompute.plan import build_plan
from vidtune.trainers import build_trainer

CLIP_FRAMES = 17


def write_tone(path: Path, fps: float, rate: int = 48000) -> None:
    """Rewrite the clip at `path` at `fps`, with a stereo tone lasting as long as its frames."""
    frames = np.stack(read_frames(path, list(range(CLIP_FRAMES))))
    wave = 0.5 * np.sin(2 * np.pi * 1000.0 * np.arange(round(CLIP_FRAMES / fps * rate)) / rate)
    write_video(path, frames, fps, audio=np.stack([wave, wave]).astype(np.float32), sample_rate=rate)


@pytest.fixture(scope="module")
def clip_30fps(tmp_path_factory) -> Path:
    """One 30 fps clip (17 frames, 32x32) with a tone as its sound track."""
    folder = render_shapes_dataset(tmp_path_factory.mktemp("fps30"), num_clips=1, num_frames=CLIP_FRAMES, height=32,
                                   width=32, fps=30, seed=0)
    write_tone(folder / "clips" / "clip_000.mp4", 30.0)
    return folder


@pytest.fixture(scope="module")
def mixed_rates(tmp_path_factory) -> Path:
    """Two clips: clip 0 at 24 fps, clip 1 at 30 fps."""
    folder = render_shapes_dataset(tmp_path_factory.mktemp("mixed"), num_clips=2, num_frames=CLIP_FRAMES, height=32,
                                   width=32, fps=24, seed=0)
    path = folder / "clips" / "clip_001.mp4"
    write_video(path, np.stack(read_frames(path, list(range(CLIP_FRAMES)))), 30.0)
    return folder


def first_step_inputs(config) -> tuple[object, object, dict]:
    """(trainer, first batch, the denoiser's keyword inputs at the first training step)."""
    trainer = build_trainer(config)
    trainer.set_up()
    batch = next(trainer.context.source.batches(0))
    seen: list[dict] = []
    context = trainer.context
    hook = context.denoiser.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs),
                                                      with_kwargs=True)
    try:
        with torch.no_grad():
            context.loss(context, batch)
    finally:
        hook.remove()
    return trainer, batch, seen[0]


@pytest.mark.parametrize("precompute", [False, True], ids=["on-the-fly", "cache"])
def test_a_30_fps_clip_trains_ltx2_at_30_fps_with_a_30th_of_a_second_of_sound_a_frame(
        make_config, clip_30fps, tmp_path, monkeypatch, precompute):
    heard: list[tuple[float | None, int]] = []
    original = LTX2Spec.prepare_latents

    def record(self, vae, videos, audio=None):
        heard.append((None if audio is None else audio.frame_rate, int(audio.waveforms.shape[-1])))
        return original(self, vae, videos, audio)

    monkeypatch.setattr(LTX2Spec, "prepare_latents", record)
    config = make_config("ltx-2", data_root=clip_30fps,
                         precompute={"enabled": precompute, "cache_dir": str(tmp_path / "cache")})
    assert config.frame_rate == 24.0  # the family's: what every clip was told before
    trainer, batch, inputs = first_step_inputs(config)
    frames = config.data.frames
    spec = trainer.spec

    assert batch.latents[FRAME_RATE].flatten().tolist() == [30.0]
    # Positions: the transformer's time coordinates are frame / fps.
    assert inputs["fps"] == 30.0
    # Sound: 9 frames at 30 fps are 0.3 s, 4800 samples at 16 kHz, 8 latent frames (9 at 24 fps).
    assert heard == [(30.0, round(frames / 30.0 * 16000))]
    assert spec.audio_latent_length(frames, 30.0) != spec.audio_latent_length(frames, 24.0)
    assert inputs["audio_num_frames"] == inputs["audio_hidden_states"].shape[1] == spec.audio_latent_length(frames,
                                                                                                            30.0)
    if precompute:  # the rate is the entry's, and part of its key
        plan = trainer.context.source.cached.plan
        assert [info["frame_rate"] for info in plan.latent_info.values()] == [30.0]
        assert [info["audio"]["frame_rate"] for info in plan.latent_info.values()] == [30.0]


def test_the_clip_rate_is_part_of_the_cache_key(make_config, clip_30fps, tmp_path):
    """Entries of a clip told its own rate are not those of the same clip told the family's (nor earlier entries
    without a stored rate)."""
    keys = {}
    for own in (True, False):
        config = make_config("ltx-video", data_root=clip_30fps, model={"clip_frame_rate": own},
                             precompute={"enabled": True, "cache_dir": str(tmp_path / "cache")})
        trainer = build_trainer(config)
        plan = build_plan(config, trainer.spec, trainer.check_inputs().clips)
        keys[own] = plan.latent_keys[0]
        assert [info["frame_rate"] for info in plan.latent_info.values()] == [30.0 if own else 25.0]
    assert keys[True] != keys[False]


def test_data_fps_resamples_and_tells_that_rate(make_config, clip_30fps):
    config = make_config("ltx-video", data_root=clip_30fps, data={"fps": 15})
    _, batch, inputs = first_step_inputs(config)
    assert batch.latents[FRAME_RATE].flatten().tolist() == [15.0]
    temporal = 4  # the tiny VAE's temporal ratio
    assert inputs["rope_interpolation_scale"][0] == pytest.approx(temporal / 15.0)


def test_ltx_video_tells_each_sample_of_a_mixed_batch_its_own_rate(make_config, mixed_rates):
    config = make_config("ltx-video", data_root=mixed_rates, training={"batch_size": 2})
    trainer, batch, inputs = first_step_inputs(config)
    temporal = trainer.spec.compression[1]
    rates = batch.latents[FRAME_RATE].flatten()
    assert sorted(rates.tolist()) == [24.0, 30.0]
    expected = [temporal / rates[i].item() for i in range(2)]
    assert inputs["rope_interpolation_scale"][0].flatten().tolist() == pytest.approx(expected)


def test_ltx_video_with_clip_rate_off_tells_every_clip_the_model_rate(make_config, mixed_rates):
    config = make_config("ltx-video", data_root=mixed_rates, model={"clip_frame_rate": False, "frame_rate": 20},
                         training={"batch_size": 2})
    _, batch, inputs = first_step_inputs(config)
    assert batch.latents[FRAME_RATE].flatten().tolist() == [20.0, 20.0]
    assert inputs["rope_interpolation_scale"][0] == pytest.approx(4 / 20.0)


def test_ltx2_refuses_batches_of_clips_at_several_rates_before_training(make_config, mixed_rates):
    config = make_config("ltx-2", data_root=mixed_rates, training={"batch_size": 2})
    with pytest.raises(ConfigError) as raised:
        build_trainer(config).check_inputs()
    message = str(raised.value)
    assert "24 fps (videos.txt line 1)" in message and "30 fps (videos.txt line 2)" in message
    assert "data.fps" in message and "What to do:" in message
    # One rate for all (resampled) is fine.
    build_trainer(make_config("ltx-2", data_root=mixed_rates, training={"batch_size": 2},
                              data={"fps": 24})).check_inputs()


@pytest.mark.parametrize("family", ["ltx-video", "ltx-2", "ltx-video-i2v"])
def test_a_batch_of_two_rates_predicts_what_each_sample_alone_predicts(tiny_model_dir, family):
    """The per-sample rate reaches the transformer's rotary embedding as it should: a batch at 24 and 30 fps gives
    each sample what it gets alone, told its rate as the single float the pipelines pass."""
    from vidtune.config import ModelConfig
    from vidtune.models.registry import get_spec_class

    spec = get_spec_class(family)(ModelConfig(name=family, pretrained=str(tiny_model_dir(family))), frame_rate=24.0)
    cpu = torch.device("cpu")
    text, vae, denoiser = spec.load_text_components(cpu), spec.load_vae(cpu), spec.load_denoiser(cpu)
    videos = torch.rand(2, 9, 3, 32, 32, generator=torch.Generator().manual_seed(0)) * 2 - 1
    latents = spec.prepare_latents(vae, videos)
    conditions = {**spec.prepare_conditions(text, ["a red circle", "a blue square"]),
                  **{k: v for k, v in latents.items() if k not in ("latents_mean", "latents_std")},
                  FRAME_RATE: torch.tensor([[24.0], [30.0]], dtype=torch.float64)}
    noisy = torch.randn_like(latents["latents_mean"])
    timesteps = torch.tensor([500.0, 500.0])
    with torch.no_grad():
        together = spec.forward(denoiser, conditions, noisy, timesteps)
        alone = [spec.forward(denoiser, {k: v[i : i + 1] for k, v in conditions.items()}, noisy[i : i + 1],
                              timesteps[i : i + 1]) for i in range(2)]
        told_24 = spec.forward(denoiser, {**{k: v[1:] for k, v in conditions.items()},
                                          FRAME_RATE: torch.tensor([[24.0]], dtype=torch.float64)},
                               noisy[1:], timesteps[1:])
    for i in range(2):
        torch.testing.assert_close(together[i : i + 1], alone[i], atol=1e-5, rtol=1e-4)
    assert (told_24 - alone[1]).abs().max() > 1e-4  # the rate matters
