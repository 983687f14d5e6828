"""The ModelSpec contract, checked for every registered family (a new family is covered by registering it)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from vidtune.data.video import ClipWindow, read_clip
from vidtune.models import registry
from vidtune.models.registry import available_models, get_spec_class, tiny_family
from vidtune.models.spec import POSTERIOR_KEYS, draw_latent
from vidtune.models.tiny import TINY_SHAPES, TINY_WRITERS
from vidtune.trainers import build_trainer

FAMILIES = available_models()
CPU = torch.device("cpu")


def test_every_family_has_a_tiny_model():
    """Each registered family declares its tiny model beside the others (models/tiny/<spec module>.py)."""
    for family in FAMILIES:
        tiny = tiny_family(family)
        assert callable(tiny.write) and len(tiny.shape) == 3, family
        assert tiny.overfit.steps > 0 and tiny.overfit.learning_rate > 0, family
        assert 0 < tiny.overfit.bound <= 0.15, f"{family}: the overfit bound is never raised to pass"
    assert set(TINY_WRITERS) == set(TINY_SHAPES) == set(FAMILIES)


def test_a_family_without_a_tiny_model_is_named(monkeypatch):
    monkeypatch.setitem(registry.SPECS, "made-up", "vidtune.models.made_up:MadeUpSpec")
    with pytest.raises(LookupError, match=r"'made-up' has no tiny model: add vidtune/models/tiny/made_up\.py"):
        tiny_family("made-up")
    monkeypatch.setitem(registry.SPECS, "ltx-video-2", "vidtune.models.ltx_video:LTXVideoSpec")
    with pytest.raises(LookupError, match=r"'ltx-video-2' has no tiny model: .*ltx_video\.py declares none"):
        tiny_family("ltx-video-2")


@pytest.fixture(params=FAMILIES)
def family(request) -> str:
    return request.param


def _spec(make_config, family):
    config = make_config(family)
    return config, get_spec_class(family)(config.model, frame_rate=config.frame_rate)


def _videos(family, batch=2):
    frames, height, width = TINY_SHAPES[family]
    return torch.rand(batch, frames, 3, height, width, generator=torch.Generator().manual_seed(0)) * 2 - 1


def test_components_load_and_shapes_agree(make_config, family):
    config, spec = _spec(make_config, family)
    spec.check_source()
    spec.check_video_shape(config.data.frames, config.data.height, config.data.width)
    text = spec.load_text_components(CPU)
    vae = spec.load_vae(CPU)
    denoiser = spec.load_denoiser(CPU)

    conditions = spec.prepare_conditions(text, ["a red circle", "a blue square moving left"])
    assert all(value.shape[0] == 2 for value in conditions.values())
    latents = spec.prepare_latents(vae, _videos(family))
    assert latents["latents_mean"].shape == latents["latents_std"].shape
    assert latents["latents_mean"].shape[0] == 2
    # Narrow posterior, as for a trained VAE (see calm_*_vae_posterior in models/tiny.py).
    assert latents["latents_std"].max() < 0.05

    objective = spec.objective(config.training)
    x0 = draw_latent(latents, torch.Generator().manual_seed(0))
    noise = torch.randn_like(x0)
    levels = objective.sample_noise_levels(2, torch.Generator().manual_seed(0), spec.token_count(x0.shape[1:]))
    noisy = objective.noisy(x0, noise, levels)
    video_conditions = {k: v for k, v in latents.items() if k not in POSTERIOR_KEYS}
    with torch.no_grad():
        prediction = spec.forward(denoiser, {**conditions, **video_conditions}, noisy, objective.timesteps(levels))
    assert prediction.shape == objective.target(x0, noise, levels).shape


@pytest.mark.parametrize("bad", ["frames", "height"])
def test_shape_rules_name_nearest_valid_values(make_config, family, bad):
    from vidtune.errors import ConfigError

    _, spec = _spec(make_config, family)
    frames, height, width = TINY_SHAPES[family]
    with pytest.raises(ConfigError, match=f"data.{bad}.*nearest valid"):
        spec.check_video_shape(frames + 1 if bad == "frames" else frames,
                               height + 1 if bad == "height" else height, width)


@pytest.fixture(scope="module")
def base_samples() -> dict[str, torch.Tensor]:
    """Each family's sample on its base weights, made once per module: every adapter kind is compared with it."""
    return {}


def _base_pipeline(trainer, family: str,
                   base_samples: dict[str, torch.Tensor]) -> tuple[Any, Callable[[], torch.Tensor], torch.Tensor]:
    """The family's diffusers pipeline on the base weights (the run's own text encoders and VAE, which training
    leaves as they are, and a fresh denoiser), a function sampling two steps of it (the first training clip's first
    frame as its image, for image-to-video) with a fixed seed, and that sample on the base weights."""
    spec = trainer.spec
    encoders = trainer.context.encoders
    pipeline = spec.pipeline(encoders.text, encoders.vae, spec.load_denoiser(CPU))
    pipeline.set_progress_bar_config(disable=True)
    frames, height, width = TINY_SHAPES[family]
    reference = read_clip(trainer.context.clips[0].video, ClipWindow(1, height, width)) if spec.image_to_video else None

    def sample() -> torch.Tensor:
        return spec.sample(pipeline, "a red circle", frames=frames, height=height, width=width, num_inference_steps=2,
                           generator=torch.Generator().manual_seed(0), reference=reference).frames

    if family not in base_samples:
        base_samples[family] = sample()
    return pipeline, sample, base_samples[family]


def test_lora_step_changes_only_adapter_and_adapter_loads_in_pipeline(make_config, family, base_samples):
    config = make_config(family, training={"steps": 1, "learning_rate": 5e-2}, lora={"rank": 4, "alpha": 4})
    trainer = build_trainer(config)
    result = trainer.run()
    fresh = trainer.spec.load_denoiser(CPU).state_dict()
    trained = trainer.context.denoiser.state_dict()
    adapter = {k for k in trained if "lora_" in k}
    assert adapter, "no adapter weights"
    for key, value in trained.items():
        if key in adapter:
            continue
        assert torch.equal(value, fresh[key.replace(".base_layer", "")]), f"base weight {key} changed"
    initial_b = [v for k, v in trained.items() if "lora_B" in k]
    assert any(v.abs().max() > 0 for v in initial_b), "lora_B is still zero: the adapter did not train"

    saved = load_file(result.weights_path)
    assert saved and all(k.startswith("transformer.") and "lora_" in k for k in saved)

    # The adapter loads into the family's own diffusers pipeline and changes what it produces.
    pipeline, sample, plain = _base_pipeline(trainer, family, base_samples)
    pipeline.load_lora_weights(config.output_dir)
    adapted = sample()
    assert plain.shape == adapted.shape
    assert (plain - adapted).abs().max() > 1e-4


def test_full_fine_tune_saves_a_transformer_the_family_class_loads(make_config, family):
    config = make_config(family, training={"algorithm": "full", "steps": 1, "learning_rate": 1e-3})
    trainer = build_trainer(config)
    result = trainer.run()
    fresh = trainer.spec.load_denoiser(CPU)
    trained = dict(trainer.context.denoiser.named_parameters())
    assert any(not torch.equal(p, trained[n]) for n, p in fresh.named_parameters()), "nothing trained"
    loaded = type(fresh).from_pretrained(result.weights_path)
    for name, parameter in loaded.named_parameters():
        assert torch.equal(parameter, trained[name].to(parameter.dtype)), name


@pytest.mark.parametrize("kind", ["lokr", "loha"])
def test_lokr_and_loha_train_and_load_in_the_pipeline(make_config, family, kind, base_samples):
    """Each LyCORIS kind trains on every family (only its own tensors change), and its file loads into the family's
    pipeline (through peft: diffusers' video pipelines load LoRA files only) and changes what it produces."""
    config = make_config(family, training={"steps": 1, "learning_rate": 5e-2}, lora={"rank": 2, "alpha": 2},
                         adapter={"type": kind})
    trainer = build_trainer(config)
    result = trainer.run()
    prefix = {"lokr": "lokr_", "loha": "hada_"}[kind]
    trained = trainer.context.denoiser.state_dict()
    adapter = {k: v for k, v in trained.items() if prefix in k}
    assert adapter and not any("lora_" in k for k in trained), "not the requested adapter kind"
    saved = load_file(result.weights_path)
    assert saved and all(k.startswith("transformer.") and prefix in k for k in saved)

    pipeline, sample, plain = _base_pipeline(trainer, family, base_samples)
    trainer.spec.load_lora(pipeline, result.weights_path.parent, result.weights_path.name)
    loaded = {k: v for k, v in pipeline.transformer.state_dict().items() if prefix in k}
    assert loaded.keys() == adapter.keys() and all(torch.equal(loaded[k], adapter[k]) for k in adapter)
    adapted = sample()
    assert plain.shape == adapted.shape
    assert (plain - adapted).abs().max() > 1e-5
