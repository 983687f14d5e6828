"""LoRA options: DoRA (`lora.use_dora`) and starting from an existing adapter (`lora.init_from`)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load_file, save_file

from vidtune.data.video import ClipWindow, read_clip
from vidtune.errors import ConfigError
from vidtune.models.registry import available_models
from vidtune.models.tiny import TINY_SHAPES
from vidtune.trainers import build_trainer

CPU = torch.device("cpu")
LORA_FILE = "pytorch_lora_weights.safetensors"


@pytest.mark.parametrize("family", available_models())
def test_dora_trains_magnitudes_and_its_adapter_loads_in_the_family_pipeline(make_config, family):
    config = make_config(family, training={"steps": 1, "learning_rate": 5e-2}, lora={"rank": 4, "alpha": 4,
                                                                                     "use_dora": True})
    trainer = build_trainer(config)
    fresh = {}
    original = trainer.part.configure

    def remember(denoiser, *args, **kwargs):
        parameters = original(denoiser, *args, **kwargs)
        fresh.update({k: v.clone() for k, v in get_peft_model_state_dict(denoiser).items()})
        return parameters

    trainer.part.configure = remember
    result = trainer.run()
    trained = get_peft_model_state_dict(trainer.context.denoiser)
    magnitudes = [key for key in trained if "lora_magnitude_vector" in key]
    assert magnitudes, "no DoRA magnitudes"
    assert any(not torch.equal(trained[key], fresh[key]) for key in magnitudes), "the magnitudes did not train"

    # The saved adapter loads with the family pipeline's own load_lora_weights, magnitudes included, and the
    # pipeline then samples what the trained denoiser samples.
    saved = load_file(result.weights_path)
    assert any("lora_magnitude_vector" in key for key in saved)
    spec = trainer.spec
    pipeline = spec.pipeline(trainer.context.text, trainer.context.vae, spec.load_denoiser(CPU))
    pipeline.set_progress_bar_config(disable=True)
    pipeline.load_lora_weights(config.output_dir)
    loaded = get_peft_model_state_dict(pipeline.transformer, adapter_name="default_0")
    assert loaded.keys() == trained.keys()
    assert all(torch.equal(loaded[key], trained[key]) for key in trained)
    frames, height, width = TINY_SHAPES[family]
    reference = read_clip(trainer.context.clips[0].video, ClipWindow(1, height, width)) if spec.image_to_video else None

    def sample(pipe):
        return spec.sample(pipe, "a red circle", frames=frames, height=height, width=width, num_inference_steps=2,
                           generator=torch.Generator().manual_seed(0), reference=reference).frames

    trained_pipeline = spec.pipeline(trainer.context.text, trainer.context.vae, trainer.context.denoiser.eval())
    trained_pipeline.set_progress_bar_config(disable=True)
    torch.testing.assert_close(sample(pipeline), sample(trained_pipeline), rtol=1e-4, atol=1e-5)


def test_dora_and_fp8_base_weights_are_refused_together(make_config):
    with pytest.raises(ConfigError, match=r"lora\.use_dora cannot be combined with memory\.base_weights=fp8"):
        make_config(lora={"use_dora": True}, memory={"fp8_base_weights": True})


def _first_step_weights(trainer) -> dict[str, torch.Tensor]:
    """Record the adapter as it is when the first optimizer step starts (at its first micro-batch's loss)."""
    seen: dict[str, torch.Tensor] = {}
    original = trainer.loss

    def loss(*args, **kwargs):
        if not seen:
            seen.update({k: v.detach().clone() for k, v in trainer.part.state_dict().items()})
        return original(*args, **kwargs)

    trainer.loss = loss
    return seen


def _comfy_format(source: Path, target: Path) -> Path:
    """The adapter as ComfyUI writes LTX-Video adapters (`diffusion_model.` keys), which diffusers converts."""
    weights = load_file(source)
    save_file({"diffusion_model." + k.removeprefix("transformer."): v for k, v in weights.items()}, target)
    return target


@pytest.mark.parametrize("file_format", ["diffusers", "comfyui"])
def test_a_run_started_from_an_adapter_starts_at_its_weights_and_trains_on(make_config, tmp_path, file_format):
    settings = {"training": {"steps": 2, "learning_rate": 5e-2}, "lora": {"rank": 4, "alpha": 4}}
    first = build_trainer(make_config(**settings, output_dir=str(tmp_path / "first")))
    adapter = first.run().weights_path
    if file_format == "comfyui":
        adapter = _comfy_format(adapter, tmp_path / "comfy.safetensors")
    expected = {k.removeprefix("transformer."): v for k, v in load_file(tmp_path / "first" / LORA_FILE).items()}

    second = build_trainer(make_config(training={"steps": 2, "learning_rate": 5e-2, "seed": 7},
                                       lora={"rank": 4, "alpha": 4, "init_from": str(adapter)},
                                       output_dir=str(tmp_path / "second")))
    at_start = _first_step_weights(second)
    result = second.run()
    assert at_start.keys() == expected.keys()
    assert all(torch.equal(at_start[key], expected[key]) for key in expected), "did not start at the adapter"
    final = {k.removeprefix("transformer."): v for k, v in load_file(result.weights_path).items()}
    assert any(not torch.equal(final[key], expected[key]) for key in expected), "did not train on"

    # Without init_from, the same run starts elsewhere (a fresh adapter: lora_B zero).
    fresh = build_trainer(make_config(training={"steps": 1, "seed": 7}, lora={"rank": 4, "alpha": 4},
                                      output_dir=str(tmp_path / "fresh")))
    fresh_start = _first_step_weights(fresh)
    fresh.run()
    assert all(fresh_start[k].abs().max() == 0 for k in fresh_start if "lora_B" in k)


@pytest.mark.parametrize(("change", "message"), [
    ({"rank": 8, "alpha": 8}, r"is an adapter of rank 4, but lora.rank is 8.*\nWhat to do: set lora.rank=4"),
    ({"alpha": 8}, r"has alpha 4, but lora.alpha is 8.*\nWhat to do: set lora.alpha=4"),
    ({"use_dora": True}, r"is a plain LoRA adapter, but lora.use_dora is true"),
    ({"target_modules": "attention+ffn"},
     r"does not adapt the same layers.*\n  - it lacks 4 layers this adapter has, e.g. transformer_blocks.0.ff.net.0"
     r".*\nWhat to do: set lora.target_modules=\[attn1.to_k,.*to_v\]"),
])
def test_an_adapter_that_does_not_fit_is_refused_plainly(make_config, tmp_path, change, message):
    first = build_trainer(make_config(training={"steps": 1}, lora={"rank": 4, "alpha": 4},
                                      output_dir=str(tmp_path / "first")))
    adapter = first.run().weights_path
    lora = {"rank": 4, "alpha": 4, "init_from": str(adapter), **change}
    with pytest.raises(ConfigError, match=message) as error:
        build_trainer(make_config(lora=lora, output_dir=str(tmp_path / "second"))).run()
    assert str(error.value).startswith(f"lora.init_from: {adapter}")
    assert not (tmp_path / "second" / LORA_FILE).exists()


def test_a_missing_init_from_file_fails_before_loading_anything(make_config, tmp_path, monkeypatch):
    trainer = build_trainer(make_config(lora={"init_from": str(tmp_path / "nope.safetensors")}))
    monkeypatch.setattr("vidtune.training.setup.load_denoiser",
                        lambda *args, **kwargs: pytest.fail("loaded the model first"))
    with pytest.raises(ConfigError, match=r"lora.init_from: .*nope.safetensors is not a file\.\nWhat to do"):
        trainer.run()
