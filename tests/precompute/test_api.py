"""The functional API: usable without a trainer, batched, placed on the device and dtype asked for."""

from __future__ import annotations

import pytest
import torch

from vidtune.config import ModelConfig
from vidtune.data.video import ClipWindow, read_clip
from vidtune.models.ltx_video import LTXVideoSpec
from vidtune.models.tiny import TINY_SHAPES
from vidtune.precompute import Preprocess, encode_captions, encode_videos, shard, stack_items

FRAMES, HEIGHT, WIDTH = TINY_SHAPES["ltx-video"]
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    spec = LTXVideoSpec(ModelConfig(name="ltx-video", pretrained=str(tiny_model_dir("ltx-video"))))
    return spec, spec.load_text_components(CPU), spec.load_vae(CPU)


def test_captions_batched_equal_one_by_one_and_are_placed_as_asked(tiny):
    spec, text, _ = tiny
    captions = ["a red circle", "a blue square moving left", "", "a green star"]
    batched = encode_captions(spec, text, captions, batch_size=3)
    assert len(batched) == 4 and batched[0]["prompt_embeds"].shape == (128, 32)  # one dict per caption
    for caption, item in zip(captions, batched, strict=True):
        (alone,) = encode_captions(spec, text, [caption], batch_size=1)
        for key in item:
            torch.testing.assert_close(item[key], alone[key], rtol=1e-5, atol=1e-6)
    assert not torch.equal(batched[0]["prompt_embeds"], batched[1]["prompt_embeds"])
    # The functional API computes what the spec computes for a whole batch.
    reference = spec.prepare_conditions(text, captions[:3])
    assert all(torch.equal(stack_items(batched[:3])[k], reference[k]) for k in reference)

    half = encode_captions(spec, text, captions[:1], device="cpu", dtype=torch.bfloat16)[0]
    assert half["prompt_embeds"].dtype == torch.bfloat16
    assert half["prompt_attention_mask"].dtype == torch.bool  # only floating tensors are cast


def test_videos_from_tensors_paths_or_samples(tiny, shapes_dataset):
    spec, _, vae = tiny
    clips = sorted((shapes_dataset / "clips").glob("*.mp4"))[:3]
    preprocess = Preprocess(FRAMES, HEIGHT, WIDTH)
    videos = torch.stack([read_clip(c, ClipWindow(FRAMES, HEIGHT, WIDTH)) for c in clips])

    from_tensor = encode_videos(spec, vae, videos, batch_size=3)
    from_paths = encode_videos(spec, vae, clips, batch_size=3, preprocess=preprocess, decode_workers=2)
    reference = spec.prepare_latents(vae, videos)
    assert len(from_tensor) == len(from_paths) == 3
    for number, (a, b) in enumerate(zip(from_tensor, from_paths, strict=True)):
        assert set(a) == {"latents_mean", "latents_std"}
        for key in a:
            assert torch.equal(a[key], b[key])  # decoding in threads changes nothing
            assert torch.equal(a[key], reference[key][number])
    with pytest.raises(ValueError, match="preprocess"):
        encode_videos(spec, vae, clips[:1])


def test_stored_samples_are_drawn_from_the_posterior(tiny):
    spec, _, vae = tiny
    videos = torch.rand(2, FRAMES, 3, HEIGHT, WIDTH) * 2 - 1
    posterior = encode_videos(spec, vae, videos)
    drawn = encode_videos(spec, vae, videos, store="sample",
                          generators=[torch.Generator().manual_seed(s) for s in (1, 2)])
    again = encode_videos(spec, vae, videos, store="sample",
                          generators=[torch.Generator().manual_seed(s) for s in (1, 2)])
    for item, same, reference in zip(drawn, again, posterior, strict=True):
        assert set(item) == {"latents"}  # half of what a posterior entry holds
        assert torch.equal(item["latents"], same["latents"])
        deviation = (item["latents"] - reference["latents_mean"]) / reference["latents_std"]
        assert 0 < deviation.abs().max() < 6 and abs(float(deviation.std()) - 1) < 0.2


@pytest.mark.parametrize(("count", "world"), [(0, 2), (1, 3), (7, 2), (10, 3), (9, 4), (5, 5)])
def test_shards_have_no_duplicates_and_no_gaps(count, world):
    items = [f"key{i}" for i in range(count)]
    shares = [shard(items, rank, world) for rank in range(world)]
    flat = [item for share in shares for item in share]
    assert sorted(flat) == sorted(items) and len(flat) == len(set(flat))
    assert max(map(len, shares)) - min(map(len, shares)) <= 1
    with pytest.raises(ValueError):
        shard(items, world, world)
