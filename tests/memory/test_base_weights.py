"""memory.base_weights: the frozen denoiser stored in float8, int8 or NF4 while an fp32 adapter trains. Each trains
close to the unquantized run, its adapter loads into the plain pipeline, and a resumed run equals an uninterrupted
one bit for bit."""

from __future__ import annotations

import math
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.runs import run_stopped_at
from vidtune.errors import ConfigError
from vidtune.trainers import build_trainer

LORA_FILE = "pytorch_lora_weights.safetensors"
# Largest relative difference of any step's loss from the unquantized run's, over 4 steps of the tiny LTX-Video
# model on the CPU. Measured over 8 steps: fp8 1.5e-3, int8 5.4e-4, nf4 1.0e-2 (docs/memory.md); the bounds
# leave room for other seeds and platforms.
TOLERANCE = {"fp8": 5e-3, "int8": 2e-3, "nf4": 3e-2}


def _storage(denoiser: torch.nn.Module) -> set[str]:
    """How the frozen weight under the adapter's `to_q` layers is stored."""
    kinds = set()
    for name, module in denoiser.named_modules():
        if name.endswith("attn1.to_q.base_layer") or (name.endswith("attn1.to_q") and hasattr(module, "weight")):
            weight = module.weight
            if type(weight).__name__ == "Int8Tensor":
                kinds.add(f"int8:{weight.qdata.dtype}")
            elif type(weight).__name__ == "Params4bit":
                kinds.add(f"nf4:{weight.dtype}:{weight.quant_type}")
            else:
                kinds.add(str(weight.dtype))
    return kinds


EXPECTED_STORAGE = {"fp8": {"torch.float8_e4m3fn"}, "int8": {"int8:torch.int8"}, "nf4": {"nf4:torch.uint8:nf4"}}


@pytest.mark.parametrize("option", ["fp8", "int8", "nf4"])
def test_quantized_base_weights_train_close_to_the_plain_run_and_load_in_a_plain_pipeline(
        make_config, tiny_model_dir, tmp_path, option):
    from diffusers import LTXPipeline

    plain = build_trainer(make_config(output_dir=str(tmp_path / "plain"))).run()
    config = make_config(memory={"base_weights": option}, output_dir=str(tmp_path / option))
    trainer = build_trainer(config)
    result = trainer.run()

    assert _storage(trainer.context.denoiser) == EXPECTED_STORAGE[option]
    adapter = [p for p in trainer.context.denoiser.parameters() if p.requires_grad]
    assert adapter and all(p.dtype == torch.float32 and type(p.data) is torch.Tensor for p in adapter)
    assert all(math.isfinite(loss) for loss in result.losses)
    differences = [abs(a - b) / abs(b) for a, b in zip(result.losses, plain.losses, strict=True)]
    assert max(differences) < TOLERANCE[option], differences
    assert max(differences) > 0, "the quantized run computes with other weights than the plain one"

    saved = load_file(tmp_path / option / LORA_FILE)
    assert saved and all(v.dtype == torch.float32 for v in saved.values())
    pipeline = LTXPipeline.from_pretrained(tiny_model_dir("ltx-video"))
    pipeline.set_progress_bar_config(disable=True)
    pipeline.load_lora_weights(config.output_dir)
    loaded = {name: p for name, p in pipeline.transformer.named_parameters() if "lora_B" in name}
    assert loaded and any(p.abs().sum() > 0 for p in loaded.values())  # the trained adapter, not a fresh one
    video = trainer.spec.sample(pipeline, "a red circle", frames=9, height=32, width=32, num_inference_steps=2,
                                generator=torch.Generator().manual_seed(0)).frames
    assert torch.isfinite(video).all()


def _stop_at_the_third_micro_batch_and_resume(make_config, settings: dict, out):
    """A run of `settings` stopped by SIGINT during its third micro-batch, then resumed to the end; returns its
    output_dir."""
    trainer = build_trainer(make_config(**settings, output_dir=str(out)))
    run_stopped_at(trainer, 3)
    resume = {**settings, "checkpoint": {**settings["checkpoint"], "resume": "latest"}}
    build_trainer(make_config(**resume, output_dir=str(out))).run()
    return out


@pytest.mark.parametrize("option", ["fp8", "int8", "nf4"])
def test_quantized_base_weights_resume_bit_for_bit(make_config, tmp_path, option):
    settings = {"training": {"steps": 5}, "checkpoint": {"every": 2}, "memory": {"base_weights": option}}
    build_trainer(make_config(**settings, output_dir=str(tmp_path / "reference"))).run()
    out = _stop_at_the_third_micro_batch_and_resume(make_config, settings, tmp_path / "stopped")
    reference, resumed = load_file(tmp_path / "reference" / LORA_FILE), load_file(out / LORA_FILE)
    assert reference.keys() == resumed.keys() and reference
    for key in reference:
        assert torch.equal(reference[key], resumed[key]), key


def test_the_old_fp8_key_is_read_as_base_weights_fp8(make_config, capsys):
    config = make_config(memory={"fp8_base_weights": True})
    assert config.memory.base_weights == "fp8"
    assert "fp8_base_weights" not in config.to_dict()["memory"]
    assert "memory.fp8_base_weights is deprecated" in capsys.readouterr().err
    assert make_config(memory={"fp8_base_weights": False}).memory.base_weights == "auto"
    with pytest.raises(ConfigError, match=r"memory\.fp8_base_weights=true contradicts memory\.base_weights=int8"):
        make_config(memory={"fp8_base_weights": True, "base_weights": "int8"})


@pytest.mark.parametrize(("option", "module", "extra"), [("int8", "torchao.quantization", "torchao"),
                                                         ("nf4", "bitsandbytes", "bitsandbytes")])
def test_a_missing_package_names_the_pip_extra(make_config, monkeypatch, tmp_path, option, module, extra):
    monkeypatch.setitem(sys.modules, module, None)  # importing it raises ImportError
    config = make_config(memory={"base_weights": option}, output_dir=str(tmp_path / "run"))
    with pytest.raises(ConfigError, match=rf"memory\.base_weights={option} needs the package {extra}") as raised:
        build_trainer(config).run()
    assert str(raised.value).splitlines()[-1] == f"What to do: pip install 'vidtune[{extra}]', or set " \
                                                 "memory.base_weights=auto."
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_quantized_base_weights_need_an_adapter(make_config):
    with pytest.raises(ConfigError, match=r"memory\.base_weights=int8 works with adapter algorithms"):
        make_config(training={"algorithm": "full"}, memory={"base_weights": "int8"})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("option", ["fp8", "int8", "nf4"])
def test_quantized_base_weights_on_cuda_in_bf16(make_config, tmp_path, option):
    settings = {"model": {"dtype": "bfloat16"}, "training": {"steps": 5, "device": "cuda", "precision": "bf16"},
                "checkpoint": {"every": 2}, "memory": {"base_weights": option}}
    reference = build_trainer(make_config(**settings, output_dir=str(tmp_path / "reference")))
    result = reference.run()
    assert _storage(reference.context.denoiser) == EXPECTED_STORAGE[option]
    assert all(math.isfinite(loss) for loss in result.losses)
    out = _stop_at_the_third_micro_batch_and_resume(make_config, settings, tmp_path / "stopped")
    reference_weights, resumed = load_file(tmp_path / "reference" / LORA_FILE), load_file(out / LORA_FILE)
    for key in reference_weights:
        assert torch.equal(reference_weights[key], resumed[key]), key
