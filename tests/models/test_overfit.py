"""The correctness test that matters: overfit one clip with the trainer, then sample it with the family's own pipeline.

A wrong target, timestep direction, packing, normalisation or rotary scale leaves the training loss
looking fine but makes the pipeline sample something else; this test sees it. The clip is trained the way a
user trains: `build_trainer(config).run()`, a full fine-tune from the precompute cache, so the trainer's latent
sampling, objective wiring, caption handling and cache are what it proves. The settings (steps, learning rate,
bound) live beside each family's tiny model (`OverfitSettings` in vidtune/models/tiny/<module>.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers.datasets import one_clip_dataset, pair_samples
from tests.helpers.runs import FRAME_RATE, overfit_config
from tests.helpers.sound import add_tone
from vidtune.config import ModelConfig
from vidtune.data.audio import AudioBatch, read_audio
from vidtune.data.video import ClipWindow, read_clip
from vidtune.models.registry import available_models, get_spec_class, tiny_family
from vidtune.models.sound import AUDIO_LATENTS
from vidtune.models.spec import GeneratedSample, Latents, ModelSpec
from vidtune.trainers import build_trainer

CPU = torch.device("cpu")


def trains_sound(family: str) -> bool:
    return get_spec_class(family).audio_format is not ModelSpec.audio_format


def sample_with_pipeline(family: str, pretrained: Path, transformer: Path | None, video: Path, caption: str,
                         frames: int | None = None) -> tuple[Latents, GeneratedSample]:
    """The clip's latents (and, for a family that trains on sound, its sound's) and what the family's pipeline samples
    for its caption with the trained transformer (None: the untrained one), both in the training layout."""
    tiny_frames, height, width = tiny_family(family).shape
    frames = frames or tiny_frames
    subfolders = {"transformer": str(transformer)} if transformer is not None else {}
    model = ModelConfig(name=family, pretrained=str(pretrained), subfolders=subfolders)
    spec = get_spec_class(family)(model, FRAME_RATE)
    text, vae, denoiser = spec.load_text_components(CPU), spec.load_vae(CPU), spec.load_denoiser(CPU)
    clip = read_clip(video, ClipWindow(frames, height, width))[None]
    sound = AudioBatch.stack([read_audio(video, frames, 0, spec.audio_format())]) if trains_sound(family) else None
    latents = spec.prepare_latents(vae, clip, sound) if sound is not None else spec.prepare_latents(vae, clip)
    pipeline = spec.pipeline(text, vae, denoiser.eval())
    pipeline.set_progress_bar_config(disable=True)
    with torch.no_grad():
        # Image-to-video families sample from the clip's first frame; a family following a control clip, the clip.
        sampled = spec.sample(pipeline, caption, frames=frames, height=height, width=width, num_inference_steps=30,
                              generator=torch.Generator().manual_seed(1), reference=clip[0], output="latents")
    return latents, sampled


def relative(sampled: torch.Tensor, clean: torch.Tensor) -> float:
    return float((sampled - clean).norm() / clean.norm())


@pytest.mark.slow
@pytest.mark.parametrize("family", available_models())
def test_overfit_one_clip_then_sample_with_pipeline(family, tiny_model_dir, shapes_dataset, tmp_path):
    clip = pair_samples(shapes_dataset)[0]
    data_root = one_clip_dataset(clip.video, clip.caption, tmp_path / "data")
    video = data_root / clip.video.name
    if trains_sound(family):
        # A family that trains on sound (LTX-2, MiniMax H3) overfits a clip with a stereo tone: both streams train
        # together, as its pipeline samples them, and the sound's latents are held to the video's bound where the
        # family's tiny model says so.
        add_tone(video)
    spec_class = get_spec_class(family)
    if spec_class.reads_control_clip and spec_class.control_input_kind is None:
        # A family that follows a control clip (Wan VACE) is given the clip itself, as it samples (`reference`); one
        # that takes it as one of its own inputs (Wan Animate's pose) trains and samples here without one (black
        # pose).
        (data_root / "controls.txt").write_text(video.name + "\n")
    pretrained = tiny_model_dir(family)
    result = build_trainer(overfit_config(family, pretrained, data_root, tmp_path / "run")).run()
    assert result.final_step == tiny_family(family).overfit.steps

    torch.manual_seed(0)
    latents, sample = sample_with_pipeline(family, pretrained, result.weights_path, video, clip.caption)
    x0, sampled = latents["latents_mean"], sample.latents
    assert sampled.shape == x0.shape
    settings = tiny_family(family).overfit
    bound = settings.bound
    relative_error = relative(sampled, x0)
    random_error = relative(torch.randn_like(x0), x0)
    # The untrained model through the same pipeline, seed and caption: what training brought the error down from.
    _, untrained = sample_with_pipeline(family, pretrained, pretrained / "transformer", video, clip.caption)
    untrained_error = relative(untrained.latents, x0)
    sound = ""
    if settings.audio_bound is not None:
        audio = latents[AUDIO_LATENTS]
        assert sample.audio_latents.shape == audio.shape
        audio_error, untrained_audio = relative(sample.audio_latents, audio), relative(untrained.audio_latents, audio)
        sound = (f"; audio latents {audio_error:.3f} (bound {settings.audio_bound}; untrained model: "
                 f"{untrained_audio:.3f})")
    print(f"{family}: relative error {relative_error:.3f} (bound {bound}; untrained model: {untrained_error:.3f}; "
          f"random latent: {random_error:.3f}){sound}")
    assert relative_error < bound, (
        f"{family}: sampled latents are {relative_error:.3f} away (untrained: {untrained_error:.2f}, random: "
        f"{random_error:.2f})"
    )
    assert relative_error < untrained_error / 2
    if settings.audio_bound is not None:
        assert audio_error < settings.audio_bound, f"{family}: sampled audio latents are {audio_error:.3f} away{sound}"
        assert audio_error < untrained_audio / 2


def overfit_odd_latent_count(family: str, pretrained: Path, shapes_dataset: Path, tmp_path: Path,
                             frames: int) -> tuple[torch.Tensor, float, float]:
    """Overfit `frames` frames of one clip with `pretrained` (a CogVideoX 1.5 layout: temporal patch 2) and sample
    them with the family's pipeline: the clip's latents and the relative errors, trained and untrained."""
    clip = pair_samples(shapes_dataset)[0]
    data_root = one_clip_dataset(clip.video, clip.caption, tmp_path / "data")
    result = build_trainer(overfit_config(family, pretrained, data_root, tmp_path / "run", frames)).run()
    torch.manual_seed(0)
    latents, sampled = sample_with_pipeline(family, pretrained, result.weights_path, clip.video, clip.caption, frames)
    x0 = latents["latents_mean"]
    assert sampled.latents.shape == x0.shape
    _, untrained = sample_with_pipeline(family, pretrained, pretrained / "transformer", clip.video, clip.caption,
                                        frames)
    return x0, relative(sampled.latents, x0), relative(untrained.latents, x0)


@pytest.mark.slow
def test_cogvideox_1_5_overfits_with_an_odd_latent_frame_count(tiny_model_dir, shapes_dataset, tmp_path):
    """9 frames: 3 latent frames for a temporal patch of 2, padded in front as CogVideoXPipeline pads; the pipeline
    samples the padded grid, so the trained clip comes back frame for frame, padding included."""
    family, frames = "cogvideox", 9
    x0, trained, untrained = overfit_odd_latent_count(family, tiny_model_dir(family), shapes_dataset, tmp_path,
                                                      frames)
    assert x0.shape[2] == 4
    print(f"cogvideox, {frames} frames: relative error {trained:.3f} (untrained model: {untrained:.3f})")
    assert trained < tiny_family(family).overfit.bound and trained < untrained / 2


@pytest.mark.slow
def test_cogvideox_1_5_image_to_video_overfits_with_an_odd_latent_frame_count(shapes_dataset, tmp_path):
    """CogVideoX 1.5 I2V layout (temporal patch 2, rotary embeddings only), 9 frames: 3 latent frames padded to 4
    in front; CogVideoXImageToVideoPipeline samples the padded grid from the clip's first frame (the image latent
    in latent frame 0, zeros after it), so the trained clip comes back, padding included."""
    from vidtune.models.tiny.cogvideox import write_tiny_cogvideox

    family, frames = "cogvideox-i2v", 9
    pretrained = write_tiny_cogvideox(tmp_path / "cogvideox-1.5-i2v", image_to_video=True, version_1_5=True)
    x0, trained, untrained = overfit_odd_latent_count(family, pretrained, shapes_dataset, tmp_path, frames)
    assert x0.shape[2] == 4
    print(f"cogvideox-i2v (1.5), {frames} frames: relative error {trained:.3f} (untrained model: {untrained:.3f})")
    assert trained < tiny_family(family).overfit.bound and trained < untrained / 2
