"""Conditioning modes of the families whose given latents ride on channels beside the noisy ones (CogVideoX and
HunyuanVideo 1.5 image-to-video): what training gives the denoiser equals what the family's pipeline, given the mode's
latents, gives it at its first step (HunyuanVideo 1.5: its mask channel and image tokens too); each mode's latents sit
in its own latent frames, zeros elsewhere; every sample is conditioned (the first frame where no other mode is drawn);
CogVideoX's inpainting is refused before loading, saying why."""

from __future__ import annotations

import pytest
import torch

from vidtune.config import ModelConfig
from vidtune.errors import ConfigError, ModelError
from vidtune.models import conditioning
from vidtune.models.cogvideox import GIVEN_EXTENSION, GIVEN_FIRST, GIVEN_LAST, CogVideoXI2VSpec
from vidtune.models.conditioning import Given
from vidtune.models.hunyuan_video15 import HunyuanVideo15ImageToVideoSpec
from vidtune.models.tiny import TINY_SHAPES, reference_videos
from vidtune.models.tiny.cogvideox import write_tiny_cogvideox

CPU = torch.device("cpu")
CAPTION = "a red circle"
MODES = {"extension": 0.3, "extension_frames": 5, "last_frame": 0.3, "first_last": 0.3}


def cogvideox_parts(folder):
    spec = CogVideoXI2VSpec(ModelConfig(name="cogvideox-i2v", pretrained=str(folder), conditioning=MODES))
    spec.image_noise_log_sigma = None  # compare without the training-time noise augmentation
    return spec, spec.load_text_components(CPU), spec.load_vae(CPU), spec.load_denoiser(CPU)


@pytest.fixture(scope="module")
def cogvideox(tiny_model_dir):
    return cogvideox_parts(tiny_model_dir("cogvideox-i2v"))


@pytest.fixture(scope="module")
def cogvideox_15(tmp_path_factory):
    return cogvideox_parts(write_tiny_cogvideox(tmp_path_factory.mktemp("cogvideox-1.5-i2v"), image_to_video=True,
                                                version_1_5=True))


# CogVideoX 1.5 pads its 3 latent frames to 4 (a frame in front, which the pipeline drops after denoising): the first
# frame sits there, as the pipeline's image does; the frames to extend over the clip's own, the first copied in front.
@pytest.mark.parametrize(("version", "mode", "given_frames"), [
    ("1.0", "extension", [0, 1]), ("1.0", "last_frame", [2]), ("1.0", "first_last", [0, 2]),
    ("1.0", "first_frame", [0]), ("1.5", "extension", [0, 1, 2]), ("1.5", "last_frame", [3]),
    ("1.5", "first_last", [0, 3]),
])
def test_cogvideox_is_given_each_modes_latents_as_its_pipeline_gives_them(request, version, mode, given_frames):
    spec, text, vae, denoiser = request.getfixturevalue("cogvideox" if version == "1.0" else "cogvideox_15")
    frames, size, _ = TINY_SHAPES["cogvideox-i2v"]
    clip = reference_videos(frames, size)[0]  # [F, 3, H, W]
    seen: list[dict] = []
    hook = denoiser.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs), with_kwargs=True)
    given = {"extension": Given("extension", frames=clip[:5]), "last_frame": Given("last_frame", last=clip[-1:]),
             "first_last": Given("first_last", frames=clip[:1], last=clip[-1:]),
             "first_frame": Given("first_frame", frames=clip[:1])}[mode]
    try:
        pipeline = spec.pipeline(text, vae, denoiser)
        pipeline.set_progress_bar_config(disable=True)
        spec.sample(pipeline, CAPTION, frames=frames, height=size, width=size, num_inference_steps=2,
                    generator=torch.Generator().manual_seed(0), output="latents", given=given)
        from_pipeline = seen[0]["hidden_states"]  # [B, F, 2C, H, W]
        latents = spec.prepare_latents(vae, clip[None])
        conditions = {**spec.prepare_conditions(text, [CAPTION]),
                      **{key: value for key, value in latents.items() if key not in ("latents_mean", "latents_std")},
                      conditioning.MODE: torch.tensor([float(conditioning.code(mode))])}
        channels = latents["latents_mean"].shape[1]
        with torch.no_grad():
            spec.forward(denoiser, conditions, from_pipeline[:, :, :channels].permute(0, 2, 1, 3, 4),
                         torch.tensor([999]))
        from_training = seen[-1]["hidden_states"]
    finally:
        hook.remove()
    condition = from_training[0, :, channels:]  # [F, C, H, W]
    others = [frame for frame in range(condition.shape[0]) if frame not in given_frames]
    assert float(condition[given_frames].abs().min(dim=0).values.max()) > 0 and not condition[others].any()
    torch.testing.assert_close(from_training[:, :, :channels], from_pipeline[:, :, :channels])
    # Posterior samples of a narrow posterior (the pipeline's from its generator, training's from the content's).
    tolerance = 6 * float(latents["latents_std"].max())
    torch.testing.assert_close(from_training, from_pipeline, atol=tolerance, rtol=0)
    assert {GIVEN_FIRST, GIVEN_EXTENSION, GIVEN_LAST} <= set(latents)


def test_cogvideox_conditions_every_sample_and_refuses_inpainting_saying_why(cogvideox, tiny_model_dir):
    spec = cogvideox[0]
    codes = spec.visit_conditions(torch.zeros(4000, 1, 3, 1, 1), torch.arange(4000), 0)[conditioning.MODE]
    shares = {mode: float((codes == conditioning.code(mode)).float().mean()) for mode in conditioning.MODES}
    assert shares == pytest.approx({"first_frame": 0.1, "extension": 0.3, "last_frame": 0.3, "first_last": 0.3,
                                    "inpaint": 0.0}, abs=0.03)
    inpainting = CogVideoXI2VSpec(ModelConfig(name="cogvideox-i2v", pretrained=str(tiny_model_dir("cogvideox-i2v")),
                                              conditioning={"inpaint": 0.5}))
    with pytest.raises(ConfigError, match=r"cogvideox-i2v cannot train inpaint conditioning: .*no mask channel"):
        inpainting.check_conditioning_modes(inpainting.config.conditioning)
    with pytest.raises(ModelError, match="cogvideox-i2v cannot sample inpaint"):
        spec.check_given(Given("inpaint", frames=torch.zeros(9, 3, 32, 32)))


@pytest.fixture(scope="module")
def hunyuan(tiny_model_dir):
    spec = HunyuanVideo15ImageToVideoSpec(ModelConfig(
        name="hunyuan-video-1.5-i2v", pretrained=str(tiny_model_dir("hunyuan-video-1.5-i2v")),
        # The tiny latent grid is 2 x 2: inpainting learns its left half and keeps its right half.
        conditioning={**MODES, "first_last": 0.2, "inpaint": 0.1, "mask_rectangle": [0.0, 0.0, 0.5, 1.0]}))
    return spec, spec.load_text_components(CPU), spec.load_vae(CPU), spec.load_denoiser(CPU)


@pytest.mark.parametrize(("mode", "given_frames"), [("extension", [0, 1]), ("last_frame", [2]),
                                                    ("first_last", [0, 2]), ("inpaint", [0, 1, 2]),
                                                    ("first_frame", [0])])
def test_hunyuan_video_15_is_given_each_modes_latents_and_mask_as_its_pipeline_gives_them(hunyuan, mode,
                                                                                          given_frames):
    spec, text, vae, denoiser = hunyuan
    frames, size, _ = TINY_SHAPES["hunyuan-video-1.5-i2v"]
    clip = reference_videos(frames, size)[0]
    seen: list[dict] = []
    hook = denoiser.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs), with_kwargs=True)
    given = {"extension": Given("extension", frames=clip[:5]), "last_frame": Given("last_frame", last=clip[-1:]),
             "first_last": Given("first_last", frames=clip[:1], last=clip[-1:]),
             "inpaint": Given("inpaint", frames=clip), "first_frame": Given("first_frame", frames=clip[:1])}[mode]
    try:
        pipeline = spec.pipeline(text, vae, denoiser)
        pipeline.set_progress_bar_config(disable=True)
        spec.sample(pipeline, CAPTION, frames=frames, height=size, width=size, num_inference_steps=2,
                    generator=torch.Generator().manual_seed(0), output="latents", given=given)
        from_pipeline = seen[0]
        latents = spec.prepare_latents(vae, clip[None])
        conditions = {**spec.prepare_conditions(text, [CAPTION]),
                      **{key: value for key, value in latents.items() if key not in ("latents_mean", "latents_std")},
                      conditioning.MODE: torch.tensor([float(conditioning.code(mode))]),
                      conditioning.LATENTS: latents["latents_mean"]}
        channels = latents["latents_mean"].shape[1]
        with torch.no_grad():
            spec.forward(denoiser, conditions, from_pipeline["hidden_states"][:, :channels], torch.tensor([1000.0]))
        from_training = seen[-1]
    finally:
        hook.remove()
    mask = from_training["hidden_states"][0, -1]  # [F, H, W]
    cells = mask[0].numel()
    kept = {"inpaint": 3 * cells // 2}.get(mode, len(given_frames) * cells)
    assert int(mask.sum()) == kept and float(mask[[f for f in range(3) if f not in given_frames]].abs().sum()) == 0
    assert int(from_pipeline["hidden_states"][0, -1].sum()) == kept
    torch.testing.assert_close(from_training["hidden_states"], from_pipeline["hidden_states"], atol=1e-4, rtol=0)
    torch.testing.assert_close(from_training["image_embeds"], from_pipeline["image_embeds"], atol=1e-4, rtol=0)
