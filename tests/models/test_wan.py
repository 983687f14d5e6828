"""Wan 2.1 conventions (text and image-to-video) that the contract and overfit tests would not pin down alone."""

from __future__ import annotations

import pytest
import torch
from diffusers import DDIMScheduler, UniPCMultistepScheduler

from vidtune.config import ModelConfig
from vidtune.errors import ConfigError
from vidtune.models.tiny import TINY_SHAPES, reference_videos
from vidtune.models.wan import WanImageToVideoSpec, WanSpec, frames_to_pil
from vidtune.objectives import DDPM, FlowMatching, objective_from_scheduler

CPU = torch.device("cpu")
CAPTIONS = ["a red circle moving left", "A  blue square,   spinning slowly"]


def _spec(cls, folder, **model):
    return cls(ModelConfig(name=cls.name, pretrained=str(folder), **model))


def _videos(family: str, batch: int = 2) -> torch.Tensor:
    frames, size, _ = TINY_SHAPES[family]
    return reference_videos(frames, size)[:batch]


# ----- objective ---------------------------------------------------------------------------------------
def test_unipc_with_flow_sigmas_is_flow_matching():
    wan = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    objective = objective_from_scheduler(wan, sampling="uniform")
    assert isinstance(objective, FlowMatching)
    assert not objective.invert_timesteps
    # Either flag is enough; a UniPC solver of a DDPM model stays DDPM.
    assert isinstance(objective_from_scheduler(UniPCMultistepScheduler(prediction_type="flow_prediction")),
                      FlowMatching)
    assert isinstance(objective_from_scheduler(UniPCMultistepScheduler(prediction_type="epsilon")), DDPM)
    assert isinstance(objective_from_scheduler(DDIMScheduler()), DDPM)


def test_unipc_flow_timesteps_are_sigma_times_1000():
    """What the denoiser is told at inference is what training tells it: timestep = sigma * 1000."""
    scheduler = UniPCMultistepScheduler(prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=3.0)
    scheduler.set_timesteps(10)
    sigmas = scheduler.sigmas[:-1]
    assert (sigmas[:-1] > sigmas[1:]).all()  # from noise to data
    torch.testing.assert_close(scheduler.timesteps.float(), (sigmas * 1000).float(), atol=1.0, rtol=0)
    torch.testing.assert_close(FlowMatching().timesteps(sigmas.float()), (sigmas * 1000).float())


# ----- text-to-video -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def wan_folder(tiny_model_dir):
    return tiny_model_dir("wan")


def test_prepare_conditions_equal_the_pipeline_encode_prompt(wan_folder):
    spec = _spec(WanSpec, wan_folder)
    text = spec.load_text_components(CPU)
    conditions = spec.prepare_conditions(text, CAPTIONS)
    pipeline = spec.pipeline(text, spec.load_vae(CPU), spec.load_denoiser(CPU))
    with torch.no_grad():
        embeds, _ = pipeline.encode_prompt(CAPTIONS, do_classifier_free_guidance=False, device=CPU,
                                           max_sequence_length=spec.max_sequence_length)
    assert conditions["prompt_embeds"].shape == (2, 512, 32)
    torch.testing.assert_close(conditions["prompt_embeds"], embeds)
    # Trimmed to each cleaned caption's tokens (runs of spaces collapse) and zero padded.
    lengths = (conditions["prompt_embeds"].abs().sum(-1) > 0).sum(-1)
    cleaned = [" ".join(caption.split()) for caption in CAPTIONS]
    tokens = text["tokenizer"](cleaned, padding="max_length", max_length=512, return_tensors="pt")
    assert lengths.tolist() == tokens.attention_mask.sum(-1).tolist()


def test_max_sequence_length_defaults_to_the_pipeline_and_follows_the_config(wan_folder):
    assert _spec(WanSpec, wan_folder).max_sequence_length == 512
    assert _spec(WanSpec, wan_folder, max_sequence_length=64).max_sequence_length == 64


def test_latents_are_normalised_as_the_pipeline_denormalises_them(wan_folder):
    spec = _spec(WanSpec, wan_folder)
    vae = spec.load_vae(CPU)
    videos = _videos("wan")
    latents = spec.prepare_latents(vae, videos)
    with torch.no_grad():
        raw = vae.encode(videos.permute(0, 2, 1, 3, 4)).latent_dist
    # WanPipeline decodes latents / (1 / std) + mean.
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    inverse_std = 1.0 / torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    torch.testing.assert_close(latents["latents_mean"] / inverse_std + mean, raw.mean)
    torch.testing.assert_close(latents["latents_std"] / inverse_std, raw.std)
    # Realistic statistics (set from real clips by the tiny writer) and a narrow posterior.
    assert 0.5 < float(latents["latents_mean"].std()) < 2.0
    assert float(latents["latents_std"].max()) < 0.05


# ----- image-to-video -------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def i2v_folder(tiny_model_dir):
    return tiny_model_dir("wan-i2v")


def test_image_conditions_equal_the_pipeline(i2v_folder):
    spec = _spec(WanImageToVideoSpec, i2v_folder)
    encoders = spec.load_vae(CPU)
    videos = _videos("wan-i2v")
    frames, height, width = TINY_SHAPES["wan-i2v"]
    latents = spec.prepare_latents(encoders, videos)
    pipeline = spec.pipeline(spec.load_text_components(CPU), encoders, spec.load_denoiser(CPU))
    for index in range(videos.shape[0]):
        image = frames_to_pil(videos[index, :1])[0]
        with torch.no_grad():
            embeds = pipeline.encode_image(image, CPU)
            pixels = pipeline.video_processor.preprocess(image, height=height, width=width).float()
            _, condition = pipeline.prepare_latents(pixels, 1, 16, height, width, frames, torch.float32, CPU,
                                                    torch.Generator().manual_seed(0))
        torch.testing.assert_close(latents["image_embeds"][index : index + 1], embeds)
        # The clip's frame is u / 127.5 - 1 and the pipeline's u / 255 * 2 - 1 of the same uint8 image.
        torch.testing.assert_close(latents["image_condition"][index : index + 1], condition, atol=1e-4, rtol=1e-4)
    # Mask channels: the first latent frame (the given image) is 1, the rest 0.
    mask = latents["image_condition"][:, :4]
    assert mask[:, :, 0].eq(1).all() and mask[:, :, 1:].eq(0).all()


def test_i2v_samples_from_the_reference_image(i2v_folder):
    spec = _spec(WanImageToVideoSpec, i2v_folder)
    videos = _videos("wan-i2v")
    spec.prepare_latents(spec.load_vae(CPU), videos)  # encoding clips leaves nothing behind in the spec
    with pytest.raises(Exception, match="reference"):
        spec.pipeline_inputs()
    assert spec.pipeline_inputs(videos[1])["image"].tobytes() == frames_to_pil(videos[1, :1])[0].tobytes()


def test_i2v_needs_512_text_tokens(i2v_folder):
    assert _spec(WanImageToVideoSpec, i2v_folder).max_sequence_length == 512
    spec = _spec(WanImageToVideoSpec, i2v_folder, max_sequence_length=128)
    frames, height, width = TINY_SHAPES["wan-i2v"]
    with pytest.raises(ConfigError, match="max_sequence_length"):
        spec.check_video_shape(frames, height, width)
