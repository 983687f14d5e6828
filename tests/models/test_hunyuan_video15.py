"""HunyuanVideo 1.5 conventions that the contract and overfit tests would not pin down on their own: the text and
glyph encoders as the pipeline runs them, the trimmed padding, the image-to-video conditions, the guider."""

from __future__ import annotations

import pytest
import torch

from vidtune.config import ModelConfig
from vidtune.errors import ConfigError
from vidtune.models.hunyuan_video15 import HunyuanVideo15ImageToVideoSpec, HunyuanVideo15Spec
from vidtune.models.tiny import TINY_SHAPES, reference_videos
from vidtune.models.wan import frames_to_pil

CPU = torch.device("cpu")
CAPTIONS = ['a red circle with the sign "OPEN"', "A blue square, spinning slowly on a dark background"]


@pytest.fixture(scope="module")
def t2v(tiny_model_dir):
    folder = tiny_model_dir("hunyuan-video-1.5")
    spec = HunyuanVideo15Spec(ModelConfig(name="hunyuan-video-1.5", pretrained=str(folder)))
    return spec, spec.load_text_components(CPU), spec.load_vae(CPU), spec.load_denoiser(CPU)


@pytest.fixture(scope="module")
def i2v(tiny_model_dir):
    folder = tiny_model_dir("hunyuan-video-1.5-i2v")
    spec = HunyuanVideo15ImageToVideoSpec(ModelConfig(name="hunyuan-video-1.5-i2v", pretrained=str(folder)))
    return spec, spec.load_text_components(CPU), spec.load_vae(CPU), spec.load_denoiser(CPU)


def test_conditions_equal_the_pipeline_encode_prompt_and_quoted_text_reaches_byt5(t2v):
    spec, text, vae, denoiser = t2v
    conditions = spec.prepare_conditions(text, CAPTIONS)
    pipeline = spec.pipeline(text, vae, denoiser)
    with torch.no_grad():
        embeds, mask, glyph, glyph_mask = pipeline.encode_prompt(CAPTIONS, device=CPU, batch_size=2)
    assert conditions["prompt_embeds"].shape == (2, 1000, text["text_encoder"].config.hidden_size)
    torch.testing.assert_close(conditions["prompt_embeds"], embeds)
    assert torch.equal(conditions["prompt_embeds_mask"], mask.bool())
    torch.testing.assert_close(conditions["prompt_embeds_2"], glyph)
    assert torch.equal(conditions["prompt_embeds_mask_2"], glyph_mask.bool())
    # Only the quoted text goes to ByT5 ('Text "OPEN". '); a caption without quotes has none.
    assert int(conditions["prompt_embeds_mask_2"][0].sum()) == len('Text "OPEN". ') + 1  # + ByT5's eos
    assert not conditions["prompt_embeds_mask_2"][1].any() and not conditions["prompt_embeds_2"][1].any()
    assert not torch.allclose(conditions["prompt_embeds"][0], conditions["prompt_embeds"][1])


def test_forward_equals_the_transformer_on_the_pipelines_full_padding(t2v):
    """Training trims text padding and gives one masked image token; the pipeline pads to 1000 + 256 tokens and
    729 zero image tokens. Masked tokens take no part, so the predictions agree."""
    spec, text, _, denoiser = t2v
    conditions = spec.prepare_conditions(text, CAPTIONS)
    noisy = torch.randn(2, 4, 3, 2, 2, generator=torch.Generator().manual_seed(0))
    timesteps = torch.tensor([800.0, 150.0])
    with torch.no_grad():
        ours = spec.forward(denoiser, conditions, noisy, timesteps)
        zeros = torch.zeros(2, 5, 3, 2, 2)
        pipeline_like = denoiser(
            hidden_states=torch.cat([noisy, zeros], dim=1), timestep=timesteps,
            encoder_hidden_states=conditions["prompt_embeds"],
            encoder_attention_mask=conditions["prompt_embeds_mask"].float(),
            encoder_hidden_states_2=conditions["prompt_embeds_2"],
            encoder_attention_mask_2=conditions["prompt_embeds_mask_2"].float(),
            image_embeds=torch.zeros(2, 729, denoiser.config.image_embed_dim), return_dict=False,
        )[0]
    assert conditions["prompt_embeds_mask"].sum(dim=1).max() < 1000  # the padding was there to trim
    torch.testing.assert_close(ours, pipeline_like, atol=1e-5, rtol=1e-4)


def test_image_to_video_conditions_are_the_pipelines(i2v):
    """The first frame's latents and mask in latent frame 0 and its SigLIP tokens, as the image-to-video pipeline
    computes them from the same image."""
    spec, text, encoders, denoiser = i2v
    frames, size, _ = TINY_SHAPES["hunyuan-video-1.5-i2v"]
    videos = reference_videos(frames, size)[:2]
    latents = spec.prepare_latents(encoders, videos)
    pipeline = spec.pipeline(text, encoders, denoiser)
    image = frames_to_pil(videos[1, :1])[0]
    noisy = torch.randn_like(latents["latents_mean"][1:])
    with torch.no_grad():
        condition, mask = pipeline.prepare_cond_latents_and_mask(noisy, image, 1, size, size, torch.float32, CPU)
        image_embeds = pipeline.encode_image(image, 1, CPU, torch.float32)
    ours = spec.condition_input({"image_latents": latents["image_latents"][1:]}, noisy)
    # The pipeline's image goes through PIL: the same uint8 frame gives the same latents up to float rounding.
    torch.testing.assert_close(ours[:, :-1], condition, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(ours[:, -1:], mask)
    torch.testing.assert_close(latents["image_embeds"][1:], image_embeds, atol=1e-4, rtol=1e-4)
    assert condition[:, :, 1:].abs().sum() == 0 and condition[:, :, 0].abs().sum() > 0


def test_image_to_video_samples_only_at_the_pipelines_bucket(i2v):
    spec, *_ = i2v
    _, size, _ = TINY_SHAPES["hunyuan-video-1.5-i2v"]
    assert spec.pipeline_size(size, size) == {}
    with pytest.raises(ConfigError, match=r"(?s)samples 32x64 images at 16x32 .*What to do: sample at 16x32"):
        spec.pipeline_size(32, 64)


@pytest.mark.parametrize("scale", [1.0, 4.0])
def test_the_validation_scale_is_the_guiders(t2v, scale):
    """Guidance 1 runs one transformer call a step; above 1 the guider adds the empty prompt's."""
    spec, text, vae, denoiser = t2v
    pipeline = spec.pipeline(text, vae, denoiser)
    pipeline.set_progress_bar_config(disable=True)
    calls = []
    handle = denoiser.register_forward_pre_hook(lambda module, args: calls.append(1))
    frames, height, width = TINY_SHAPES["hunyuan-video-1.5"]
    kept = {}

    def keep(_pipeline, _step, _timestep, tensors):
        kept["latents"] = tensors["latents"]
        return tensors

    try:
        video = spec.sample(pipeline, "a red circle", frames=frames, height=height, width=width, num_inference_steps=2,
                            guidance_scale=scale, generator=torch.Generator().manual_seed(0), callback=keep).frames
    finally:
        handle.remove()
    assert pipeline.guider.guidance_scale == scale
    assert len(calls) == 2 * (2 if scale > 1 else 1)
    assert video.shape == (frames, 3, height, width) and kept["latents"].shape == (1, 4, 3, 2, 2)


def test_a_meanflow_transformer_is_refused_before_loading(tiny_model_dir, tmp_path):
    import json
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir("hunyuan-video-1.5"), folder)
    config_path = folder / "transformer" / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "use_meanflow": True}))
    spec = HunyuanVideo15Spec(ModelConfig(name="hunyuan-video-1.5", pretrained=str(folder)))
    with pytest.raises(ConfigError, match=r"(?s)step-distilled .*What to do: train the non-distilled"):
        spec.check_video_shape(9, 32, 32)
