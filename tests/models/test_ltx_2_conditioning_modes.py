"""LTX-2's conditioning modes (model.conditioning): what training gives the denoiser equals what
LTX2ConditionPipeline gives it at its first step for every mode (keyframe tokens and their rotary times included),
the given latents are clean and out of the loss, and a batch mixing token layouts predicts each sample as alone."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.datasets import pair_samples
from vidtune.config import ModelConfig
from vidtune.data.video import ClipWindow, read_clip
from vidtune.errors import ConfigError
from vidtune.models import conditioning
from vidtune.models.conditioning import Given
from vidtune.models.ltx_2 import AUDIO_LATENTS, LAST_FRAME, LTX2Spec
from vidtune.models.sound import AUDIO_PRESENT

CPU = torch.device("cpu")
FRAMES, HEIGHT, WIDTH = 9, 32, 32
LATENT = (3, 8, 8)  # latent frames, height, width of a tiny LTX-2 clip
TOKENS = 64  # tokens of one latent frame
CAPTION = "a red circle"
MODES = {"extension": 0.25, "extension_frames": 5, "last_frame": 0.25, "first_last": 0.25, "inpaint": 0.25}


@pytest.fixture(scope="module")
def parts(tiny_model_dir):
    spec = LTX2Spec(ModelConfig(name="ltx-2", pretrained=str(tiny_model_dir("ltx-2")), conditioning=MODES),
                    frame_rate=24.0)
    return spec, spec.load_text_components(CPU), spec.load_vae(CPU), spec.load_denoiser(CPU)


@pytest.fixture(scope="module")
def clip(shapes_dataset):
    return read_clip(pair_samples(shapes_dataset)[0].video, ClipWindow(FRAMES, HEIGHT, WIDTH))


def training_conditions(spec, text, vae, videos: torch.Tensor, captions: list[str], modes: list[str]) -> dict:
    latents = spec.prepare_latents(vae, videos)
    return {**spec.prepare_conditions(text, captions),
            **{key: value for key, value in latents.items() if key not in ("latents_mean", "latents_std")},
            conditioning.MODE: torch.tensor([float(conditioning.code(mode)) for mode in modes]),
            conditioning.LATENTS: latents["latents_mean"]}


def given_of(mode: str, clip: torch.Tensor) -> Given:
    return {"extension": Given("extension", frames=clip[:5]), "last_frame": Given("last_frame", last=clip[-1:]),
            "first_last": Given("first_last", frames=clip[:1], last=clip[-1:]),
            "inpaint": Given("inpaint", frames=clip)}[mode]


@pytest.mark.parametrize("mode", ["extension", "last_frame", "first_last", "inpaint"])
def test_training_gives_the_denoiser_what_the_condition_pipeline_gives_it(parts, clip, mode):
    spec, text, vae, denoiser = parts
    seen: list[dict] = []
    hook = denoiser.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs), with_kwargs=True)
    original = spec.given_inputs

    def uncompressed(given, frames, height, width):  # images as they are (no H.264 round trip): training's pixels
        inputs = original(given, frames, height, width)
        for condition in inputs["conditions"]:
            condition.crf = 0
        return inputs

    try:
        spec.given_inputs = uncompressed
        pipeline = spec.pipeline(text, vae, denoiser)
        pipeline.set_progress_bar_config(disable=True)
        spec.sample(pipeline, CAPTION, frames=FRAMES, height=HEIGHT, width=WIDTH, num_inference_steps=2,
                    generator=torch.Generator().manual_seed(0), output="latents", given=given_of(mode, clip))
        from_pipeline = seen[0]
        conditions = training_conditions(spec, text, vae, clip[None], [CAPTION], [mode])
        noisy = pipeline._unpack_latents(from_pipeline["hidden_states"][:, :3 * TOKENS], *LATENT, 1, 1)
        with torch.no_grad():
            spec.forward(denoiser, conditions, noisy, torch.tensor([1000.0]))
        from_training = seen[-1]
    finally:
        hook.remove()
        del spec.given_inputs
    extra = TOKENS if mode in conditioning.LAST_FRAME_MODES else 0
    assert from_pipeline["hidden_states"].shape[1] == 3 * TOKENS + extra
    torch.testing.assert_close(from_training["hidden_states"], from_pipeline["hidden_states"], atol=1e-4, rtol=0)
    timestep = from_training["timestep"]
    torch.testing.assert_close(timestep, from_pipeline["timestep"].float())
    given_tokens = {"extension": 2 * TOKENS, "last_frame": TOKENS, "first_last": 2 * TOKENS,
                    "inpaint": 3 * (64 - 16)}[mode]
    assert int((timestep == 0).sum()) == given_tokens
    assert int((timestep == 1000).sum()) == timestep.numel() - given_tokens
    if extra:  # the keyframe after the video's tokens, at the last latent frame's first pixel frame, in seconds
        torch.testing.assert_close(from_training["video_coords"], from_pipeline["video_coords"])
        assert float(from_training["video_coords"][0, 0, -1, 0]) == pytest.approx(5 / 24.0)
        assert LAST_FRAME in conditions


@pytest.mark.parametrize("mode", ["extension", "first_last", "inpaint"])
def test_the_given_latents_are_clean_and_out_of_the_loss(parts, clip, mode):
    """Noise on the given region never reaches the denoiser, and its error is no loss; the rest is untouched."""
    spec, text, vae, denoiser = parts
    conditions = training_conditions(spec, text, vae, clip[None], [CAPTION], [mode])
    given = spec.given_region(conditions, conditions[conditioning.LATENTS].shape)
    assert 0 < float(given.sum()) < given.numel()
    noisy = torch.randn(1, 8, *LATENT, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        first = spec.forward(denoiser, conditions, noisy, torch.tensor([600.0]))
        second = spec.forward(denoiser, conditions, noisy + 5.0 * given, torch.tensor([600.0]))
        third = spec.forward(denoiser, conditions, noisy + 5.0 * (1 - given), torch.tensor([600.0]))
    torch.testing.assert_close(first, second)
    assert (first - third).abs().max() > 1e-4
    error = 100.0 * given.expand(1, 8, *LATENT).clone() + (1 - given)
    assert float(spec.per_clip_error(error, conditions)) == pytest.approx(1.0)


@pytest.mark.parametrize("sound", [False, True])
def test_a_batch_mixing_token_layouts_runs_each_sample_as_alone(parts, clip, sound):
    """A last-frame sample (keyframe tokens) beside an extension sample, in one call: both streams predicted as
    alone. With sound, the audio attends to the video: not to the other sample's keyframe padding either."""
    spec, text, vae, denoiser = parts
    conditions = training_conditions(spec, text, vae, torch.stack([clip, clip.flip(0)]), [CAPTION, "a blue square"],
                                     ["last_frame", "extension"])
    assert conditions[AUDIO_LATENTS].shape[0] == 2
    conditions[AUDIO_PRESENT] = torch.full((2, 1), sound)  # the shapes clips are silent: both heard, or neither
    noisy = torch.randn(2, 8, *LATENT, generator=torch.Generator().manual_seed(1))
    timesteps = torch.tensor([300.0, 800.0])
    with torch.no_grad():
        both = spec.predict(denoiser, conditions, noisy, timesteps)
        alone = [spec.predict(denoiser, {k: v[i:i + 1] for k, v in conditions.items()}, noisy[i:i + 1],
                              timesteps[i:i + 1]) for i in range(2)]
    for together, *apart in zip(both, *alone, strict=True):
        torch.testing.assert_close(together, torch.cat(apart), atol=1e-5, rtol=1e-5)


def test_an_extension_that_does_not_fit_the_clip_is_named(tiny_model_dir):
    def spec(**modes):
        return LTX2Spec(ModelConfig(name="ltx-2-i2v", pretrained=str(tiny_model_dir("ltx-2")), conditioning=modes),
                        frame_rate=24.0)

    with pytest.raises(ConfigError, match=r"extension_frames=6: LTX2ConditionPipeline takes a clip of k x 4 \+ 1 "
                                          r"frames; use 5 or 9"):
        spec(extension=0.5, extension_frames=6).check_video_shape(FRAMES, HEIGHT, WIDTH)
    with pytest.raises(ConfigError, match="nothing is left to learn"):
        spec(extension=0.5, extension_frames=9).check_video_shape(FRAMES, HEIGHT, WIDTH)


def test_modes_with_an_in_context_run_or_last_frames_with_context_parallelism_are_refused(make_config):
    """Before anything loads: an in-context LoRA samples through LTX2InContextPipeline (no modes); a last frame's
    keyframe tokens cannot be split into the equal parts of context parallelism."""
    config = make_config("ltx-2", model={"conditioning": {"extension": 0.5, "last_frame": 0.3}})
    spec = LTX2Spec(config.model, frame_rate=24.0)
    spec.check_frame_settings(config, [])  # a plain run takes them
    in_context = config.model_copy(update={"training": config.training.model_copy(
        update={"algorithm": "in-context-lora"})})
    with pytest.raises(ConfigError, match=r"model.conditioning \(extension, last_frame\) with training.algorithm="
                                          r"in-context-lora: .*LTX2InContextPipeline"):
        spec.check_frame_settings(in_context, [])
    split = config.model_copy(update={"parallel": config.parallel.model_copy(update={
        "context": config.parallel.context.model_copy(update={"ulysses": 2})})})
    with pytest.raises(ConfigError, match=r"last_frame / first_last with parallel\.context"):
        spec.check_frame_settings(split, [])
