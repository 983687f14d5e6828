"""LTX-2 trains on a clip's own sound: read with its frames, turned into LTX-2's log-mel spectrogram and encoded by
the audio VAE, alike on the fly and from the precompute cache; a clip without an audio track trains video only."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.distributed import LORA_FILE, rank_main, spawn_ranks
from vidtune.data.audio import AudioBatch, AudioFormat, read_audio
from vidtune.data.synthetic import render_shapes_dataset
from vidtune.data.video import read_frames, write_video
from vidtune.errors import ConfigError
from vidtune.models.ltx_2 import (
    AUDIO_LATENTS,
    AUDIO_NOISE,
    AUDIO_PRESENT,
    AUDIO_SIGMAS,
    SILENT_LOG_MEL,
    encode_log_mel,
)
from vidtune.precompute import precompute
from vidtune.trainers import build_trainer
from vidtune.training.loop import noise_row

CLIP_FRAMES, FPS = 17, 24


def write_tone(path: Path, hz: float, rate: int = 48000) -> None:
    """Rewrite the clip at `path` with a stereo tone of `hz` as its sound track."""
    frames = np.stack(read_frames(path, list(range(CLIP_FRAMES))))
    wave = 0.5 * np.sin(2 * np.pi * hz * np.arange(round(CLIP_FRAMES / FPS * rate)) / rate)
    write_video(path, frames, FPS, audio=np.stack([wave, 0.7 * wave]).astype(np.float32), sample_rate=rate)


@pytest.fixture(scope="module")
def sound_dataset(tmp_path_factory) -> Path:
    """Two clips (17 frames, 32x32, 24 fps): clip 0 with a 1 kHz tone as its sound, clip 1 without a sound track."""
    folder = render_shapes_dataset(tmp_path_factory.mktemp("sound"), num_clips=2, num_frames=CLIP_FRAMES, height=32,
                                   width=32, fps=FPS, seed=0)
    write_tone(folder / "clips" / "clip_000.mp4", 1000.0)
    return folder


def first_batch(config):
    trainer = build_trainer(config)
    trainer.set_up()
    return trainer, next(trainer.context.source.batches(0))


def test_sound_latents_differ_from_silence_and_the_cache_gives_what_on_the_fly_computes(
        make_config, sound_dataset, tmp_path, capsys):
    def config(enabled: bool, name: str):
        return make_config("ltx-2", data_root=sound_dataset, training={"batch_size": 2},
                           precompute={"enabled": enabled, "cache_dir": str(tmp_path / "cache"), "batch_size": 2},
                           output_dir=str(tmp_path / name))

    live_trainer, live = first_batch(config(False, "live"))
    cached_trainer, cached = first_batch(config(True, "cached"))
    # One line per run says which clips train with sound.
    said = capsys.readouterr().out.count("ltx-2: 1 of 2 samples have an audio track")
    assert said == 2
    assert live.indices.tolist() == cached.indices.tolist()
    for key in live.latents:
        torch.testing.assert_close(cached.latents[key], live.latents[key], rtol=1e-4, atol=1e-5)
    heard = live.indices.tolist().index(0)  # clip 0 has the tone, clip 1 no track
    assert live.latents[AUDIO_PRESENT][:, 0].tolist() == [float(i == heard) for i in range(2)]
    spec = live_trainer.spec
    silence = spec.silent_audio_latents(live_trainer.context.vae.audio_vae, 9)[0]
    assert torch.equal(live.latents[AUDIO_LATENTS][1 - heard], silence)
    assert (live.latents[AUDIO_LATENTS][heard] - silence).abs().max() > 0.2
    # The tone's latents are the audio VAE's of its log-mel spectrogram (4 L frames for L latent frames).
    audio_vae = live_trainer.context.vae.audio_vae
    sound = read_audio(sound_dataset / "clips" / "clip_000.mp4", 9, 0, spec.audio_format())
    assert sound.present and sound.waveform.shape == (2, 6000)  # 9 frames at 24 fps, 16 kHz
    log_mel = spec.log_mel(audio_vae, sound.waveform[None], 9)
    assert log_mel.shape == (1, 2, 4 * spec.audio_latent_length(9), audio_vae.config.mel_bins)
    assert log_mel.max() > SILENT_LOG_MEL + 5
    torch.testing.assert_close(live.latents[AUDIO_LATENTS][heard], encode_log_mel(audio_vae, log_mel)[0])
    # A silent sound track gives exactly the latents of a clip without one (the log-mel floor in every bin).
    torch.testing.assert_close(spec.sound_latents(audio_vae, torch.zeros(1, 2, 6000), 9)[0], silence)
    # The cache key follows the sound: entries of the earlier silent tracks are never read as these.
    plan = cached_trainer.context.source.cached.plan
    assert {info["audio"]["sample_rate"] for info in plan.latent_info.values()} == {16000}
    assert spec.latent_identity()["audio"]["source"] == "clip"
    # `vidtune precompute` (which loads the clips itself) says it too; every entry is reused.
    summary = precompute(config(True, "cached"), progress=False)
    assert summary.latents_reused == 2
    assert summary.sound is not None and "1 of 2 samples have an audio track" in summary.sound


def test_same_losses_from_the_cache_and_on_the_fly_with_sound(make_config, sound_dataset, tmp_path):
    losses = []
    for enabled in (False, True):
        config = make_config("ltx-2", data_root=sound_dataset, training={"steps": 3, "seed": 5},
                             precompute={"enabled": enabled, "cache_dir": str(tmp_path / "cache"), "batch_size": 1},
                             output_dir=str(tmp_path / f"run-{enabled}"))
        losses.append(build_trainer(config).run().losses)
    assert losses[0] == losses[1]


def test_training_draws_the_audio_its_own_sigma_and_keeps_clips_without_sound_from_the_audio(
        make_config, sound_dataset, tmp_path):
    """Each clip's audio sigma is drawn apart from its video's and handed to the transformer as `audio_timestep` /
    `audio_sigma`; the clip without sound is kept from the audio stream (its video predicted as an isolated call
    predicts it) in the same call as the clip with sound (one call: DDP sees each parameter used once);
    metrics.jsonl logs both clips' sigmas and the heard clip's audio sigma."""
    config = make_config("ltx-2", data_root=sound_dataset, training={"batch_size": 2, "steps": 2},
                         output_dir=str(tmp_path / "run"))
    trainer, batch = first_batch(config)
    calls: list[dict] = []
    context = trainer.context
    hook = context.denoiser.register_forward_pre_hook(lambda module, args, kwargs: calls.append(kwargs),
                                                      with_kwargs=True)
    try:
        output = context.loss(context, batch)
    finally:
        hook.remove()
    noise = noise_row([(output.levels, output.sample_losses)])
    heard = batch.indices.tolist().index(0)  # clip 0 has the tone
    video_sigmas, audio_sigmas = noise["sigmas"], noise[AUDIO_SIGMAS]
    assert audio_sigmas[1 - heard] != audio_sigmas[1 - heard]  # NaN: no sound, no audio sigma (null in the file)
    assert 0 < audio_sigmas[heard] < 1 and audio_sigmas[heard] != pytest.approx(video_sigmas[heard])
    [joint] = calls
    assert joint["isolate_modalities"] is False
    torch.testing.assert_close(joint["timestep"], torch.tensor(video_sigmas) * 1000)
    torch.testing.assert_close(joint["audio_timestep"][heard], torch.tensor(1000 * audio_sigmas[heard]))
    torch.testing.assert_close(joint["audio_sigma"], joint["audio_timestep"])

    # The one call predicts each clip's video as a call of its own kind does: the heard clip's with the audio
    # stream, the other's isolated from it (a random model: the audio stream changes the video prediction).
    spec, denoiser = trainer.spec, context.denoiser
    for block in denoiser.transformer_blocks:  # the cross-modal attentions count: their gates are not at zero
        torch.nn.init.normal_(block.video_a2v_cross_attn_scale_shift_table, std=0.5)
        torch.nn.init.normal_(block.audio_a2v_cross_attn_scale_shift_table, std=0.5)
    generator = torch.Generator().manual_seed(0)
    conditions = {**batch.conditions, **batch.latents, AUDIO_SIGMAS: torch.tensor([0.4, 0.7]),
                  AUDIO_NOISE: torch.randn(batch.latents[AUDIO_LATENTS].shape, generator=generator)}
    noisy = torch.randn(batch.latents["latents_mean"].shape, generator=generator)
    timesteps = torch.tensor([300.0, 600.0])
    with torch.no_grad():
        together = spec.predict(denoiser, conditions, noisy, timesteps)[0]
        for row, isolated in ((heard, False), (1 - heard, True)):
            own = spec.joint_forward(denoiser, {key: value[row:row + 1] for key, value in conditions.items()},
                                     noisy[row:row + 1], timesteps[row:row + 1], isolated=isolated)[0]
            other = spec.joint_forward(denoiser, {key: value[row:row + 1] for key, value in conditions.items()},
                                       noisy[row:row + 1], timesteps[row:row + 1], isolated=not isolated)[0]
            torch.testing.assert_close(together[row:row + 1], own, rtol=1e-5, atol=1e-5)
            assert (together[row:row + 1] - other).abs().max() > 1e-3
    # The audio sigma follows the audio's token count (its latent frames), not the video's.
    assert trainer.spec.token_count(batch.latents["latents_mean"].shape[1:]) != batch.latents[AUDIO_LATENTS].shape[1]

    rows = [json.loads(line) for line in (build_trainer(config).run().output_dir / "metrics.jsonl").read_text()
            .splitlines()]
    for row in rows:
        assert len(row["sigmas"]) == len(row[AUDIO_SIGMAS]) == 2
        assert sum(value is None for value in row[AUDIO_SIGMAS]) == 1


def test_clips_without_sound_can_be_left_out(make_config, sound_dataset, tmp_path, capsys):
    config = make_config("ltx-2", data_root=sound_dataset, model={"clips_without_sound": "leave-out"},
                         output_dir=str(tmp_path / "run"))
    trainer = build_trainer(config)
    inputs = trainer.check_inputs()
    assert [clip.video.name for clip in inputs.clips] == ["clip_000.mp4"]  # the clip with the tone
    assert "ltx-2: 1 of 2 samples have no audio track and are left out" in capsys.readouterr().out
    # Nothing left to train: said before anything loads, naming the setting.
    silent = render_shapes_dataset(tmp_path / "silent", num_clips=1, num_frames=CLIP_FRAMES, height=32, width=32,
                                   fps=FPS, seed=1)
    with pytest.raises(ConfigError, match=r"model\.clips_without_sound"):
        build_trainer(make_config("ltx-2", data_root=silent, model={"clips_without_sound": "leave-out"},
                                  output_dir=str(tmp_path / "run2"))).check_inputs()


def test_the_audio_format_is_the_audio_vaes(tiny_model_dir):
    from vidtune.config import ModelConfig
    from vidtune.models.ltx_2 import LTX2Spec

    spec = LTX2Spec(ModelConfig(name="ltx-2", pretrained=str(tiny_model_dir("ltx-2"))), frame_rate=25.0)
    assert spec.audio_format() == AudioFormat(16000, 2, 25.0)


@pytest.mark.slow
def test_a_trained_model_samples_the_sound_it_learnt_beside_the_video(tiny_model_dir, sound_dataset, tmp_path):
    """The audio stream is taught the clip's own sound: after a short full fine-tune on the clip with a tone,
    LTX2Pipeline samples audio latents near the tone's, and the video near the clip (the family's overfit test holds
    the 0.15 bound)."""
    from tests.helpers.datasets import one_clip_dataset
    from tests.helpers.runs import overfit_config
    from vidtune.config import ModelConfig
    from vidtune.data.video import ClipWindow, read_clip
    from vidtune.models.ltx_2 import LTX2Spec

    folder = tiny_model_dir("ltx-2")
    clip, caption = sound_dataset / "clips" / "clip_000.mp4", "a tone"
    frames, height, width = 9, 32, 32
    config = overfit_config("ltx-2", folder, one_clip_dataset(clip, caption, tmp_path / "data"), tmp_path / "run",
                            training={"steps": 300}, optimizer={"warmup_steps": 30})
    weights = build_trainer(config).run().weights_path

    def errors(transformer) -> tuple[float, float]:
        subfolders = {"transformer": str(transformer)} if transformer else {}
        spec = LTX2Spec(ModelConfig(name="ltx-2", pretrained=str(folder), subfolders=subfolders), frame_rate=24.0)
        text, vae, denoiser = spec.load_text_components(CPU), spec.load_vae(CPU), spec.load_denoiser(CPU)
        sound = AudioBatch.stack([read_audio(clip, frames, 0, spec.audio_format())])
        latents = spec.prepare_latents(vae, read_clip(clip, ClipWindow(frames, height, width))[None], audio=sound)
        pipeline = spec.pipeline(text, vae, denoiser.eval())
        pipeline.set_progress_bar_config(disable=True)
        with torch.no_grad():
            sampled = spec.sample(pipeline, caption, frames=frames, height=height, width=width,
                                  num_inference_steps=30, generator=torch.Generator().manual_seed(1), output="latents")
            video, audio = sampled.latents, sampled.audio_latents
        x0, tone = latents["latents_mean"], latents[AUDIO_LATENTS]
        # Root mean square errors, in the normalised latents' units (the pipeline starts both from unit noise).
        return float((video - x0).pow(2).mean().sqrt()), float((audio - tone).pow(2).mean().sqrt())

    video_error, audio_error = errors(weights)
    untrained_video, untrained_audio = errors(None)
    print(f"ltx-2 with sound, 300 steps: RMS error of the video latents {video_error:.3f} (untrained "
          f"{untrained_video:.3f}), of the audio latents {audio_error:.3f} (untrained {untrained_audio:.3f})")
    assert audio_error < untrained_audio / 2
    assert video_error < untrained_video / 2


CPU = torch.device("cpu")


@pytest.mark.slow
def test_two_ranks_train_micro_batches_mixing_clips_with_and_without_sound(make_config, sound_dataset, tmp_path):
    """`model.clips_without_sound: video-only` under DistributedDataParallel, two clips a rank's micro-batch, one
    with sound and one without: one call of the denoiser per micro-batch, so each parameter's gradient reaches DDP
    once; the ranks train what one process trains with the four samples in one batch."""
    settings = {"data_root": sound_dataset, "training": {"steps": 2, "batch_size": 2, "learning_rate": 1e-2}}
    runs = [("ddp", make_config("ltx-2", output_dir=str(tmp_path / "ddp"), **settings).to_dict(), {})]
    out = tmp_path / "results"
    out.mkdir()
    spawn_ranks(rank_main, (2, runs, str(out)), nprocs=2)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for result in ranks:
        assert "error" not in result["ddp"], result["ddp"]
    single = build_trainer(make_config("ltx-2", output_dir=str(tmp_path / "single"), **{
        **settings, "training": {**settings["training"], "batch_size": 4}})).run()
    assert ranks[0]["ddp"]["losses"] == pytest.approx(single.losses, rel=1e-4)
    expected, trained = (load_file(tmp_path / run / LORA_FILE) for run in ("single", "ddp"))
    for key in expected:
        torch.testing.assert_close(trained[key], expected[key], rtol=1e-3, atol=1e-4)
