"""Training from the cache: the same batches as on the fly, and no text encoder or VAE held while training."""

from __future__ import annotations

import functools
import logging
import typing
import weakref

import numpy as np
import pytest
import torch
from PIL import Image

from vidtune.algorithms import algorithm_traits
from vidtune.algorithms.losses import apply_caption_dropout
from vidtune.batches import CachedBatches, EncodedBatches
from vidtune.config import TrainingConfig
from vidtune.models.ltx_video import LTXVideoSpec
from vidtune.trainers import build_trainer
from vidtune.training import loop


def _batches(config, count):
    trainer = build_trainer(config)
    trainer.set_up()
    stream = trainer.context.source.batches(0)
    out = []
    for _ in range(count):
        batch = next(stream)
        out.append((batch.positions.tolist(), batch.indices.tolist(), batch.conditions, batch.latents))
    return trainer, out


@pytest.mark.parametrize(("batch_size", "precompute_batch", "exact"), [(1, 1, True), (2, 4, False)])
def test_a_batch_read_from_the_cache_equals_the_batch_computed_on_the_fly(
    config_for, tmp_path, batch_size, precompute_batch, exact
):
    def config(enabled, name):
        # The same frames both ways: `middle` is one fixed window (`random` draws any start on the fly, see below).
        return config_for(training={"batch_size": batch_size, "seed": 3}, output_dir=str(tmp_path / name),
                          precompute={"enabled": enabled, "batch_size": precompute_batch},
                          data={"frame_sampling": "middle"})

    live_trainer, live = _batches(config(False, "live"), 5)
    cached_trainer, cached = _batches(config(True, "cached"), 5)
    assert isinstance(live_trainer.context.source, EncodedBatches)
    assert isinstance(cached_trainer.context.source, CachedBatches)
    for (positions, indices, conditions, latents), (c_positions, c_indices, c_conditions, c_latents) in zip(
        live, cached, strict=True
    ):
        assert positions == c_positions and indices == c_indices
        for expected, got in ((conditions, c_conditions), (latents, c_latents)):
            assert expected.keys() == got.keys()
            for key in expected:
                assert got[key].dtype == expected[key].dtype and got[key].device == expected[key].device
                if exact or not expected[key].is_floating_point():
                    assert torch.equal(got[key], expected[key]), key
                else:  # the VAE batched differently: float rounding only
                    torch.testing.assert_close(got[key], expected[key], rtol=1e-4, atol=1e-5)


def test_random_frames_from_the_cache_pick_among_the_cached_windows(config_for, tmp_path):
    """`random` with precompute: each clip caches `windows_per_clip` windows; a visit reads the one its position
    draws, which is the batch the on-the-fly path computes at that window's start."""
    from vidtune.data.buckets import visit_window, window_starts
    from vidtune.precompute import encode_videos

    config = config_for(training={"seed": 5}, precompute={"windows_per_clip": 3}, data={"frame_sampling": "random"})
    trainer, cached = _batches(config, 8)
    plan = trainer.context.source.cached.plan
    frames = config.data.frames
    assert [len(windows) for windows in plan.latent_windows] == [3] * 4  # 17-frame clips, 9 frames: starts 0, 4, 8
    assert {plan.latent_preprocess[key].start for windows in plan.latent_windows for key in windows} == {0, 4, 8}
    vae = trainer.spec.load_vae(torch.device("cpu"))
    chosen = set()
    for positions, indices, _, latents in cached:
        window = visit_window(3, "random", 5, positions[0])
        chosen.add(window)
        clip = trainer.context.clips[indices[0]]
        start = window_starts(clip.info, frames, None, "random", 3)[window]
        preprocess = plan.latent_preprocess[plan.latent_windows[indices[0]][window]]
        assert preprocess.start == start
        (expected,) = encode_videos(trainer.spec, vae, [clip], batch_size=1, preprocess=preprocess, decode_workers=0)
        # The cache may encode several windows in one VAE batch, which rounds a few values otherwise than one window
        # alone (seen up to 1.03e-5 with two threads); another window's latents differ by orders more.
        torch.testing.assert_close(latents["latents_mean"][0], expected["latents_mean"], rtol=1e-4, atol=5e-5)
    assert len(chosen) > 1, "visits should draw different windows"


@pytest.mark.parametrize("family", ["hunyuan-video", "wan-i2v", "cogvideox-i2v"])
def test_families_with_two_text_encoders_or_image_conditions(config_for, tmp_path, family):
    """Every key a spec returns is cached: second text encoder outputs, image embeddings, first-frame latents."""
    start = {"frame_sampling": "start"}
    live = _batches(config_for(family=family, precompute={"enabled": False}, output_dir=str(tmp_path / "l"),
                               data=start), 2)[1]
    cached = _batches(config_for(family=family, precompute={"batch_size": 1}, output_dir=str(tmp_path / "c"),
                                 data=start), 2)[1]
    for (_, indices, conditions, latents), (_, c_indices, c_conditions, c_latents) in zip(live, cached, strict=True):
        assert indices == c_indices
        for expected, got in ((conditions, c_conditions), (latents, c_latents)):
            assert expected.keys() == got.keys()
            for key in expected:
                torch.testing.assert_close(got[key], expected[key], rtol=1e-4, atol=1e-5)
    if family != "hunyuan-video":
        assert set(latents) > {"latents_mean", "latents_std"}  # video-derived conditions are cached too


def test_same_seed_same_losses_from_the_cache_and_on_the_fly(config_for, tmp_path):
    losses = []
    for enabled in (False, True):
        config = config_for(training={"steps": 3, "seed": 5}, output_dir=str(tmp_path / f"run-{enabled}"),
                            precompute={"enabled": enabled, "batch_size": 1})
        losses.append(build_trainer(config).run().losses)
    assert losses[0] == losses[1]


def test_training_from_the_cache_never_loads_the_encoders(config_for, tmp_path, monkeypatch, capsys):
    events: list[str] = []
    loaded: list[weakref.ref] = []
    real_text, real_vae = LTXVideoSpec.load_text_components, LTXVideoSpec.load_vae
    real_step = loop.forward_backward

    def load_text(self, device):
        events.append("load text")
        text = real_text(self, device)
        loaded.append(weakref.ref(text["text_encoder"]))
        return text

    def load_vae(self, device):
        events.append("load vae")
        vae = real_vae(self, device)
        loaded.append(weakref.ref(vae))
        return vae

    def forward_backward(*args, **kwargs):
        events.append("step")
        return real_step(*args, **kwargs)

    monkeypatch.setattr(LTXVideoSpec, "load_text_components", load_text)
    monkeypatch.setattr(LTXVideoSpec, "load_vae", load_vae)
    monkeypatch.setattr(loop, "forward_backward", forward_backward)

    # A cold cache: precompute loads the encoders, and they are gone before training starts.
    trainer = build_trainer(config_for(output_dir=str(tmp_path / "cold")))
    trainer.set_up()
    assert sorted(events) == ["load text", "load vae"]
    assert loaded and all(ref() is None for ref in loaded), "an encoder is still alive after precompute"
    assert not trainer.context.encoders.loaded

    # A warm cache: a whole run, validation included, loads them only for validation, after the last step.
    events.clear()
    config = config_for(training={"steps": 3}, validation={"enabled": True, "num_inference_steps": 1},
                        output_dir=str(tmp_path / "warm"))
    result = build_trainer(config).run()
    assert events == ["step"] * 3 + ["load text", "load vae"]
    assert len(result.sample_paths) == 1
    assert "conditions: 0 computed, 4 reused; latents: 0 computed, 4 reused" in capsys.readouterr().out.splitlines()

    # And without validation, not at all.
    events.clear()
    build_trainer(config_for(training={"steps": 2}, output_dir=str(tmp_path / "novalidation"))).run()
    assert events == ["step"] * 2


@pytest.mark.parametrize("technique", ["empty", "zero"])
def test_caption_dropout_from_the_cache(config_for, tmp_path, technique):
    data = {"caption_dropout": 1.0, "caption_dropout_technique": technique}
    live = build_trainer(config_for(data=data, precompute={"enabled": False}, output_dir=str(tmp_path / "live")))
    live.set_up()
    cached = build_trainer(config_for(data=data, training={"steps": 2}, output_dir=str(tmp_path / "cached")))
    cached.run()
    conditions = next(cached.context.source.batches(0)).conditions
    dropped = apply_caption_dropout(cached.context, conditions, torch.tensor([True]))
    if technique == "empty":
        assert cached.context.empty_caption.keys() == live.context.empty_caption.keys()
        for key, value in live.context.empty_caption.items():
            assert torch.equal(cached.context.empty_caption[key], value)
            assert torch.equal(dropped[key], value)
    else:
        assert cached.context.empty_caption == {}
        assert torch.count_nonzero(dropped["prompt_embeds"]) == 0
        assert torch.equal(dropped["prompt_attention_mask"], conditions["prompt_attention_mask"])


def test_an_entry_damaged_after_precompute_is_computed_again_when_read(config_for, tmp_path, caplog):
    trainer = build_trainer(config_for(output_dir=str(tmp_path / "run")))
    trainer.set_up()
    plan = trainer.context.source.cached.plan
    key = plan.latent_keys[2]
    good = plan.cache.read("latents", key)
    path = plan.cache.path("latents", key)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40
    path.write_bytes(bytes(data))
    with caplog.at_level(logging.WARNING):
        item = trainer.context.source.cached[2]
    assert any("checksum" in r.getMessage() and path.name in r.getMessage() for r in caplog.records)
    for name, value in good.items():
        torch.testing.assert_close(item["latents"][name], value, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(plan.cache.read("latents", key)["latents_mean"], good["latents_mean"],
                               rtol=1e-4, atol=1e-5)  # and the entry is whole again


def test_stored_samples_train_with_the_stored_latent(config_for, tmp_path):
    trainer = build_trainer(config_for(precompute={"store": "sample"}, training={"steps": 2},
                                       output_dir=str(tmp_path / "run")))
    result = trainer.run()
    assert len(result.losses) == 2
    cached = trainer.context.source.cached
    item = cached[0]
    assert torch.count_nonzero(item["latents"]["latents_std"]) == 0
    stored = cached.plan.cache.read("latents", cached.plan.latent_keys[0])["latents"]
    assert torch.equal(item["latents"]["latents_mean"], stored)


@pytest.mark.parametrize("family", ["cogvideox-i2v", "wan-i2v"])
def test_validation_samples_do_not_depend_on_how_many_vae_workers_precomputed(config_for, tmp_path, family):
    """Image-to-video sampling starts from the first dataset clip whatever order the VAE workers encoded the
    clips in: the spec keeps nothing from `prepare_latents`."""

    def samples(vae_devices: list[str], name: str) -> list[np.ndarray]:
        config = config_for(family=family, training={"steps": 1},
                            validation={"enabled": True, "num_inference_steps": 2},
                            precompute={"vae_devices": vae_devices, "batch_size": 1,
                                        "cache_dir": str(tmp_path / f"cache-{name}")},
                            output_dir=str(tmp_path / name))
        trainer = build_trainer(config)
        result = trainer.run()
        # What a spec may hold: its config (and the settings it is given), and what it derives from it once (cached
        # properties).
        derived = {name for cls in type(trainer.spec).__mro__ for name, value in vars(cls).items()
                   if isinstance(value, functools.cached_property)}
        assert set(vars(trainer.spec)) <= {"config", "frame_rate", "text_encoder_weights", "vae_tiling", "base_weights",
                                           *derived}, \
            vars(trainer.spec)
        return [np.asarray(Image.open(path.with_suffix(".png"))) for path in result.sample_paths]

    one, two = samples(["cpu"], "one-worker"), samples(["cpu", "cpu"], "two-workers")
    assert len(one) == len(two) == 1
    assert np.array_equal(one[0], two[0])


ALGORITHMS = typing.get_args(TrainingConfig.model_fields["algorithm"].annotation)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_every_algorithm_trains_from_the_cache_with_default_settings(config_for, tmp_path, algorithm):
    """Each algorithm with its defaults (caption dropout off, the empty negative prompt), from the cache: the
    plan holds every prompt the trainer reads (guidance distillation's teacher's negative prompt included)."""
    traits = algorithm_traits(algorithm)
    control = {"processor": "canny"} if traits.control else {}  # the control clips: the data's
    family = {"family": "ltx-2"} if traits.in_context else {}  # the family that trains in context
    config = config_for(training={"algorithm": algorithm, "steps": 1}, control=control, **family,
                        output_dir=str(tmp_path / algorithm))
    result = build_trainer(config).run()
    assert len(result.losses) == 1 and all(np.isfinite(result.losses))


def test_guidance_distillation_reads_its_negative_prompt_from_the_cache(config_for, tmp_path, monkeypatch):
    """The teacher's negative prompt is cached with the captions and equals the one encoded on the fly; training
    from a warm cache loads no text encoder."""
    distillation = {"negative_prompt": "blurry, low quality"}
    live = build_trainer(config_for(training={"algorithm": "guidance-distillation"}, distillation=distillation,
                                    precompute={"enabled": False}, output_dir=str(tmp_path / "live")))
    live.set_up()
    config = config_for(training={"algorithm": "guidance-distillation", "steps": 1}, distillation=distillation,
                        output_dir=str(tmp_path / "cold"))
    build_trainer(config).run()  # a cold cache: precompute encodes the negative prompt with the captions

    def no_text_encoder(self, device):
        raise AssertionError("the text encoders were loaded while training from a warm cache")

    monkeypatch.setattr(LTXVideoSpec, "load_text_components", no_text_encoder)
    warm = build_trainer(config_for(training={"algorithm": "guidance-distillation", "steps": 1},
                                    distillation=distillation, output_dir=str(tmp_path / "warm")))
    warm.run()
    assert warm.part.negative.keys() == live.part.negative.keys()
    for key, value in live.part.negative.items():
        assert torch.equal(warm.part.negative[key], value), key
