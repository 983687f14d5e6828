"""HunyuanVideo conventions that the contract and overfit tests would not pin down on their own."""

from __future__ import annotations

import pytest
import torch

from vidtune.config import ModelConfig
from vidtune.models.hunyuan_video import PROMPT_TEMPLATE, HunyuanVideoSpec
from vidtune.models.tiny import TINY_SHAPES, reference_videos

CPU = torch.device("cpu")
CAPTIONS = ["a red circle moving left", "A blue square, spinning slowly on a dark background"]


@pytest.fixture(scope="module")
def folder(tiny_model_dir):
    return tiny_model_dir("hunyuan-video")


def _spec(folder, **model) -> HunyuanVideoSpec:
    return HunyuanVideoSpec(ModelConfig(name="hunyuan-video", pretrained=str(folder), **model))


def test_prepare_conditions_equal_the_pipeline_encode_prompt(folder):
    spec = _spec(folder)
    text = spec.load_text_components(CPU)
    conditions = spec.prepare_conditions(text, CAPTIONS)
    pipeline = spec.pipeline(text, spec.load_vae(CPU), spec.load_denoiser(CPU))
    with torch.no_grad():
        embeds, pooled, mask = pipeline.encode_prompt(
            CAPTIONS, prompt_template=PROMPT_TEMPLATE, device=CPU, max_sequence_length=spec.max_sequence_length
        )
    assert conditions["prompt_embeds"].shape == (2, 256, text["text_encoder"].config.hidden_size)
    torch.testing.assert_close(conditions["prompt_embeds"], embeds)
    assert torch.equal(conditions["prompt_attention_mask"], mask.bool())
    torch.testing.assert_close(conditions["pooled_prompt_embeds"], pooled)
    # Different captions give different embeddings from both encoders.
    assert not torch.allclose(conditions["prompt_embeds"][0], conditions["prompt_embeds"][1])
    assert not torch.allclose(conditions["pooled_prompt_embeds"][0], conditions["pooled_prompt_embeds"][1])


def test_the_template_crop_leaves_exactly_the_caption(folder):
    """With Llama 3's split, the template's system part is `crop_start` tokens: the cropped sequence starts
    at the caption and the mask is a prefix (right padding), as the transformer expects."""
    spec = _spec(folder)
    tokenizer = spec.load_text_components(CPU)["tokenizer"]
    caption = "a red circle"
    full = tokenizer(PROMPT_TEMPLATE["template"].format(caption)).input_ids
    crop = PROMPT_TEMPLATE["crop_start"]
    assert tokenizer.decode(full[crop:]).startswith(caption)
    mask = spec.prepare_conditions(spec.load_text_components(CPU), [caption])["prompt_attention_mask"][0]
    length = int(mask.sum())
    assert mask[:length].all() and not mask[length:].any()
    assert length == len(full) - crop


def test_max_sequence_length_defaults_to_the_pipeline_and_follows_the_config(folder):
    assert _spec(folder).max_sequence_length == 256
    spec = _spec(folder, max_sequence_length=64)
    assert spec.max_sequence_length == 64
    assert spec.prepare_conditions(spec.load_text_components(CPU), ["a"])["prompt_embeds"].shape[1] == 64


def test_latents_are_scaled_as_the_pipeline_unscales_them(folder):
    spec = _spec(folder)
    vae = spec.load_vae(CPU)
    frames, size, _ = TINY_SHAPES["hunyuan-video"]
    videos = reference_videos(frames, size)[:2]
    latents = spec.prepare_latents(vae, videos)
    with torch.no_grad():
        raw = vae.encode(videos.permute(0, 2, 1, 3, 4)).latent_dist.mean
    torch.testing.assert_close(latents["latents_mean"] / vae.config.scaling_factor, raw)
    # The tiny VAE's scaling gives unit-scale latents, like the real checkpoint's 0.476986.
    assert 0.5 < float(latents["latents_mean"].std()) < 2.0


@pytest.mark.parametrize(("configured", "expected"), [(None, 1.0), (6.0, 6.0)])
def test_guidance_embedding_gets_the_configured_value(folder, configured, expected):
    spec = _spec(folder, guidance_scale=configured)
    denoiser = spec.load_denoiser(CPU)
    seen = {}

    def capture(module, args, kwargs):
        seen["guidance"] = kwargs["guidance"]

    denoiser.register_forward_pre_hook(capture, with_kwargs=True)
    text = spec.load_text_components(CPU)
    conditions = spec.prepare_conditions(text, ["a red circle"])
    with torch.no_grad():
        spec.forward(denoiser, conditions, torch.randn(1, 4, 3, 4, 4), torch.tensor([500.0]))
    torch.testing.assert_close(seen["guidance"], torch.tensor([expected * 1000.0]))
    # The pipeline is called with the same embedded guidance.
    pipeline = spec.pipeline(text, spec.load_vae(CPU), denoiser)
    pipeline.set_progress_bar_config(disable=True)
    frames, height, width = TINY_SHAPES["hunyuan-video"]
    spec.sample(pipeline, "a red circle", frames=frames, height=height, width=width, num_inference_steps=1,
                generator=torch.Generator().manual_seed(0), output="latents")
    torch.testing.assert_close(seen["guidance"], torch.tensor([expected * 1000.0]))
