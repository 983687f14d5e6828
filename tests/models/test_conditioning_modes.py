"""Conditioning modes (model.conditioning): each sample's mode drawn from its stream position, what training gives
the denoiser equal to what LTXConditionPipeline gives it at its first step for every mode, the given latents out of
the loss, and the families that cannot take a mode refused before loading, naming the family, the mode and why."""

from __future__ import annotations

import pytest
import torch

from tests.helpers.datasets import pair_samples
from vidtune.config import ConditioningConfig, ModelConfig
from vidtune.data.video import ClipWindow, read_clip
from vidtune.errors import ConfigError, ModelError
from vidtune.models import conditioning, first_frame
from vidtune.models.conditioning import Given
from vidtune.models.ltx_video import LAST_FRAME, LTXVideoImageToVideoSpec
from vidtune.models.registry import get_spec_class

CPU = torch.device("cpu")
FRAMES, HEIGHT, WIDTH = 9, 32, 32
LATENT = (3, 8, 8)  # latent frames, height, width of a tiny LTX-Video clip
CAPTION = "a red circle"


def modes_spec(folder, **modes) -> LTXVideoImageToVideoSpec:
    model = ModelConfig(name="ltx-video-i2v", pretrained=str(folder), conditioning=modes)
    return LTXVideoImageToVideoSpec(model, frame_rate=24.0)


@pytest.fixture
def clip(shapes_dataset):
    return read_clip(pair_samples(shapes_dataset)[0].video, ClipWindow(FRAMES, HEIGHT, WIDTH))


def test_each_sample_draws_its_mode_from_its_position_with_the_configured_shares():
    modes = ConditioningConfig(extension=0.2, last_frame=0.1, first_last=0.1, inpaint=0.3)
    shares = conditioning.shares(modes, first_frame=1.0)
    assert shares == pytest.approx({"first_frame": 0.3, "extension": 0.2, "last_frame": 0.1, "first_last": 0.1,
                                    "inpaint": 0.3})
    positions = torch.arange(4000)
    allowed = dict.fromkeys(conditioning.MODES, True)
    codes = conditioning.draw_modes(shares, positions, seed=3, allowed=allowed)
    for mode, share in shares.items():
        assert float((codes == conditioning.code(mode)).float().mean()) == pytest.approx(share, abs=0.03)
    # A sample's draw depends on its position alone: any batch holding it, in any order, draws the same mode.
    picked = torch.tensor([17, 3, 2999])
    assert torch.equal(conditioning.draw_modes(shares, picked, 3, allowed), codes[picked])
    assert not torch.equal(conditioning.draw_modes(shares, positions, 4, allowed), codes)
    # First-frame conditioning alone draws exactly the samples it always drew.
    alone = conditioning.draw_modes({"first_frame": 0.4}, positions, 3, allowed)
    given = first_frame.draw(0.4, torch.zeros(4000, 1, 2, 1, 1), positions, 3)[first_frame.GIVEN]
    assert torch.equal(alone == conditioning.code("first_frame"), given > 0)


def test_regions_of_each_mode_on_the_latent_grid():
    rectangle = conditioning.rectangle_region((0.25, 0.25, 0.75, 0.75), "inside", *LATENT)
    assert rectangle.shape == (1, 1, *LATENT)
    assert float(rectangle[0, 0, 0, 2:6, 2:6].sum()) == 0 and float(rectangle.sum()) == 3 * (64 - 16)
    outside = conditioning.rectangle_region((0.25, 0.25, 0.75, 0.75), "outside", *LATENT)
    assert torch.equal(outside, 1 - rectangle)
    codes = torch.tensor([conditioning.code(mode) for mode in conditioning.MODES] + [conditioning.NONE],
                         dtype=torch.float)
    region = conditioning.region(codes, (6, 4, *LATENT), extension_latent_frames=2, inpaint_region=rectangle)
    first, extension, last, first_last, inpaint, none = region
    assert float(first[:, 0].min()) == 1 and float(first[:, 1:].max()) == 0
    assert float(extension[:, :2].min()) == 1 and float(extension[:, 2].max()) == 0
    assert float(last.max()) == 0 and float(none.max()) == 0  # the last frame is extra tokens, not in place
    assert torch.equal(first_last, first) and torch.equal(inpaint, rectangle[0])
    # A mask (1: generated) keeps only the cells it leaves wholly black.
    mask = torch.zeros(1, 1, 1, HEIGHT, WIDTH)
    mask[..., 5, 9] = 1.0
    kept = conditioning.mask_region(mask, *LATENT)
    assert float(kept.sum()) == 3 * 63 and float(kept[0, 0, :, 1, 2].max()) == 0


def pipeline_and_training_inputs(spec: LTXVideoImageToVideoSpec, clip: torch.Tensor, given: Given, code: float):
    """The denoiser's inputs at the pipeline's first step for `given`, training's for the same noisy latents and a
    sample drawn with mode `code`, and how far apart they may be (the pipeline draws its condition latents from the
    posterior, training gives the mean: a few posterior stds)."""
    text, vae, denoiser = spec.load_text_components(CPU), spec.load_vae(CPU), spec.load_denoiser(CPU)
    seen: list[dict] = []
    denoiser.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs), with_kwargs=True)
    pipeline = spec.pipeline(text, vae, denoiser)
    pipeline.set_progress_bar_config(disable=True)
    pipeline(prompt=CAPTION, num_frames=FRAMES, height=HEIGHT, width=WIDTH, num_inference_steps=2,
             guidance_scale=1.0, generator=torch.Generator().manual_seed(0), output_type="latent",
             image_cond_noise_scale=0.0, **spec.given_inputs(given, FRAMES, HEIGHT, WIDTH))
    from_pipeline = seen[0]
    latents = spec.prepare_latents(vae, clip[None])
    conditions = {**spec.prepare_conditions(text, [CAPTION]),
                  **{key: value for key, value in latents.items() if key not in ("latents_mean", "latents_std")},
                  conditioning.MODE: torch.tensor([code]), conditioning.LATENTS: latents["latents_mean"]}
    extra = from_pipeline["hidden_states"].shape[1] - 3 * 64
    noisy = pipeline._unpack_latents(from_pipeline["hidden_states"][:, extra:], *LATENT, 1, 1)
    with torch.no_grad():
        spec.forward(denoiser, conditions, noisy, torch.tensor([1000.0]))
    return from_pipeline, seen[-1], conditions, 6 * float(latents["latents_std"].max())


@pytest.mark.parametrize("mode", ["extension", "last_frame", "first_last", "inpaint"])
def test_training_gives_the_denoiser_what_the_condition_pipeline_gives_it(tiny_model_dir, clip, mode):
    spec = modes_spec(tiny_model_dir("ltx-video-i2v"), **{mode: 0.5, "extension_frames": 5})
    spec.check_video_shape(FRAMES, HEIGHT, WIDTH)
    given = {"extension": Given("extension", frames=clip[:5]), "last_frame": Given("last_frame", last=clip[-1:]),
             "first_last": Given("first_last", frames=clip[:1], last=clip[-1:]),
             "inpaint": Given("inpaint", frames=clip)}[mode]
    from_pipeline, from_training, conditions, atol = pipeline_and_training_inputs(spec, clip, given,
                                                                                  conditioning.code(mode))
    tokens_per_frame = 64
    extra = tokens_per_frame if mode in conditioning.LAST_FRAME_MODES else 0
    assert from_pipeline["hidden_states"].shape[1] == 3 * tokens_per_frame + extra
    torch.testing.assert_close(from_training["hidden_states"], from_pipeline["hidden_states"], atol=atol, rtol=0)
    torch.testing.assert_close(from_training["video_coords"], from_pipeline["video_coords"])
    timestep = from_training["timestep"]
    torch.testing.assert_close(timestep, from_pipeline["timestep"].float())
    given_tokens = {"extension": 2 * tokens_per_frame, "last_frame": tokens_per_frame,
                    "first_last": 2 * tokens_per_frame, "inpaint": 3 * (64 - 16)}[mode]
    assert int((timestep == 0).sum()) == given_tokens
    assert int((timestep == 1000).sum()) == timestep.numel() - given_tokens
    if extra:  # the last frame's extra tokens sit at the clip's last frame, in seconds at 24 fps
        assert float(from_training["video_coords"][0, 0, 0]) == pytest.approx((FRAMES - 1) / 24.0)
        assert LAST_FRAME in conditions


@pytest.mark.parametrize("mode", ["extension", "first_last", "inpaint"])
def test_the_given_latents_are_clean_and_out_of_the_loss(tiny_model_dir, clip, mode):
    """Noise on the given region never reaches the denoiser, and its error is no loss; the rest is untouched."""
    spec = modes_spec(tiny_model_dir("ltx-video-i2v"), **{mode: 0.5, "extension_frames": 5})
    text, vae, denoiser = spec.load_text_components(CPU), spec.load_vae(CPU), spec.load_denoiser(CPU)
    latents = spec.prepare_latents(vae, clip[None])
    conditions = {**spec.prepare_conditions(text, [CAPTION]),
                  **{key: value for key, value in latents.items() if key not in ("latents_mean", "latents_std")},
                  conditioning.MODE: torch.tensor([float(conditioning.code(mode))]),
                  conditioning.LATENTS: latents["latents_mean"]}
    given = spec.given_region(conditions, latents["latents_mean"].shape)
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


def test_a_batch_mixing_token_layouts_runs_each_sample_as_alone(tiny_model_dir, clip):
    """A last-frame sample (extra tokens) beside an extension sample: each predicted as in a batch of its own."""
    spec = modes_spec(tiny_model_dir("ltx-video-i2v"), extension=0.5, last_frame=0.5, extension_frames=5)
    text, vae, denoiser = spec.load_text_components(CPU), spec.load_vae(CPU), spec.load_denoiser(CPU)
    videos = torch.stack([clip, clip.flip(0)])
    latents = spec.prepare_latents(vae, videos)
    conditions = {**spec.prepare_conditions(text, [CAPTION, "a blue square"]),
                  **{key: value for key, value in latents.items() if key not in ("latents_mean", "latents_std")},
                  conditioning.MODE: torch.tensor([float(conditioning.code("last_frame")),
                                                   float(conditioning.code("extension"))]),
                  conditioning.LATENTS: latents["latents_mean"]}
    noisy = torch.randn(2, 8, *LATENT, generator=torch.Generator().manual_seed(1))
    timesteps = torch.tensor([300.0, 800.0])
    with torch.no_grad():
        both = spec.forward(denoiser, conditions, noisy, timesteps)
        alone = [spec.forward(denoiser, {k: v[i:i + 1] for k, v in conditions.items()}, noisy[i:i + 1],
                              timesteps[i:i + 1]) for i in range(2)]
    torch.testing.assert_close(both, torch.cat(alone), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("family", "why"), [
    ("ltx-video", "LTXPipeline"),
    ("sana-video-i2v", "first image"),  # the Wan families: tests/models/test_wan_conditioning_modes.py
    ("kandinsky-5-i2v", "first image"),
])
def test_a_family_without_a_mode_is_refused_before_loading(tiny_model_dir, family, why):
    spec = get_spec_class(family)(ModelConfig(name=family, pretrained=str(tiny_model_dir(family)),
                                              conditioning={"inpaint": 0.3, "last_frame": 0.2}))
    with pytest.raises(ConfigError, match=f"{family} cannot train last-frame or inpaint conditioning") as raised:
        spec.check_conditioning_modes(spec.config.conditioning)
    assert why in str(raised.value) and "model.conditioning.last_frame and model.conditioning.inpaint" \
        in str(raised.value)
    with pytest.raises(ModelError, match=f"{family} cannot sample last-frame"):
        spec.check_given(Given("last_frame", last=torch.zeros(1, 3, HEIGHT, WIDTH)))


def test_modes_that_do_not_fit_the_clip_are_named(tiny_model_dir):
    spec = modes_spec(tiny_model_dir("ltx-video-i2v"), extension=0.5, extension_frames=6)
    with pytest.raises(ConfigError, match=r"extension_frames=6: LTXConditionPipeline takes a clip of k x 4 \+ 1 "
                                          r"frames; use 5 or 9"):
        spec.check_video_shape(FRAMES, HEIGHT, WIDTH)
    with pytest.raises(ConfigError, match="nothing is left to learn"):
        modes_spec(tiny_model_dir("ltx-video-i2v"), extension=0.5, extension_frames=9).check_video_shape(
            FRAMES, HEIGHT, WIDTH)
    older = modes_spec(tiny_model_dir("ltx-video"), inpaint=0.5)  # a 0.9.1-layout checkpoint
    with pytest.raises(ConfigError, match="LTXImageToVideoPipeline"):
        older.check_video_shape(FRAMES, HEIGHT, WIDTH)
    with pytest.raises(ModelError, match=r"LTXImageToVideoPipeline .* not inpaint conditioning"):
        older.check_given(Given("inpaint", frames=torch.zeros(FRAMES, 3, HEIGHT, WIDTH)))
    with pytest.raises(ValueError, match=r"add up to 1\.2"):
        ConditioningConfig(extension=0.6, inpaint=0.6)
