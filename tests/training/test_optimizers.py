"""optimizer.name: every optimizer trains and resumes bit for bit (its state is in the checkpoint); a missing
package names its pip extra; optimizer.cpu_offload is refused off CUDA."""

from __future__ import annotations

import math
import sys

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.runs import run_stopped_at
from vidtune import checkpoint
from vidtune.errors import ConfigError
from vidtune.optim import OPTIMIZERS, check_optimizer
from vidtune.trainers import build_trainer

LORA_FILE = "pytorch_lora_weights.safetensors"
# All of them run on the CPU with the tested packages (bitsandbytes' paged one falls back to its plain kind).
CPU_OPTIMIZERS = list(OPTIMIZERS)
CLASS_NAMES = {"adamw": "AdamW", "adamw8bit": "AdamW8bit", "paged_adamw8bit": "PagedAdamW8bit",
               "adamw8bit_ao": "AdamW8bit", "adamw4bit_ao": "AdamW4bit", "adamw_fp8_ao": "AdamWFp8",
               "prodigy": "Prodigy", "came": "CAME", "adafactor": "Adafactor"}

LOW_BIT = {"adamw8bit", "paged_adamw8bit", "adamw8bit_ao", "adamw4bit_ao", "adamw_fp8_ao"}


def _is_low_bit(value) -> bool:
    """bitsandbytes keeps uint8 tensors; torchao keeps tensor subclasses (OptimState8bit, ...)."""
    return isinstance(value, torch.Tensor) and (value.dtype == torch.uint8 or type(value).__name__.startswith(
        "OptimState"))


@pytest.mark.parametrize("name", CPU_OPTIMIZERS)
def test_each_optimizer_trains_and_resumes_bit_for_bit(make_config, tmp_path, name):
    # lora.rank 128 gives adapter matrices of 4096 values (the tiny model is 32 wide): the sizes the 8-bit, 4-bit
    # and float8 optimizers quantize (smaller ones keep plain fp32 state).
    settings = {"training": {"steps": 5, "learning_rate": 1.0 if name == "prodigy" else 1e-3},
                "optimizer": {"name": name, "weight_decay": 0.01}, "lora": {"rank": 128, "alpha": 128},
                "checkpoint": {"every": 2}}
    reference = build_trainer(make_config(**settings, output_dir=str(tmp_path / "reference")))
    result = reference.run()
    assert type(reference.context.state.optimizer).__name__ == CLASS_NAMES[name]
    assert all(math.isfinite(loss) for loss in result.losses)
    if name in LOW_BIT:
        assert any(_is_low_bit(value) for state in reference.context.state.optimizer.state.values()
                   for value in state.values()), "the optimizer state is quantized"
    # lora_B starts at zero: a trained adapter has moved it.
    trained = load_file(tmp_path / "reference" / LORA_FILE)
    assert any(v.abs().sum() > 0 for k, v in trained.items() if "lora_B" in k)

    out = tmp_path / "stopped"
    trainer = build_trainer(make_config(**settings, output_dir=str(out)))
    run_stopped_at(trainer, 3)
    _, saved = checkpoint.load(out / "checkpoints" / "step-00000003")
    assert saved["optimizer"]["state"], "the checkpoint holds the optimizer's per-parameter state"

    settings["checkpoint"] = {"every": 2, "resume": "latest"}
    build_trainer(make_config(**settings, output_dir=str(out))).run()
    resumed = load_file(out / LORA_FILE)
    assert resumed.keys() == trained.keys()
    for key in trained:
        assert torch.equal(resumed[key], trained[key]), key


@pytest.mark.parametrize("name", ["adafactor", "came", "adamw"])
def test_a_resumed_optimizer_takes_the_configs_settings_and_only_those_it_knows(make_config, tmp_path, name):
    settings = {"training": {"steps": 2}, "optimizer": {"name": name}, "checkpoint": {"every": 1}}
    build_trainer(make_config(**settings, output_dir=str(tmp_path))).run()
    settings["training"]["steps"] = 3
    settings["optimizer"] = {"name": name, "weight_decay": 0.25, "beta1": 0.5}
    settings["checkpoint"] = {"every": 1, "resume": "latest"}
    trainer = build_trainer(make_config(**settings, output_dir=str(tmp_path)))
    trainer.run()
    fresh = type(trainer.context.state.optimizer)([torch.nn.Parameter(torch.zeros(2, 2))]).param_groups[0]
    for group in trainer.context.state.optimizer.param_groups:
        assert group["weight_decay"] == 0.25
        # Nothing added that this optimizer does not take (its own step count and the schedule's rate aside).
        assert group.keys() - fresh.keys() <= {"initial_lr", "step"}
        if "betas" in group:
            assert group["betas"][0] == 0.5


def test_a_missing_package_names_the_pip_extra(make_config, monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "prodigyopt", None)  # import prodigyopt raises ImportError
    config = make_config(optimizer={"name": "prodigy"}, output_dir=str(tmp_path / "run"))
    with pytest.raises(ConfigError, match=r"optimizer\.name=prodigy needs the package prodigyopt") as raised:
        build_trainer(config).run()
    assert "pip install 'vidtune[prodigy]'" in str(raised.value)
    assert str(raised.value).splitlines()[-1].startswith("What to do:")
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before training


def test_cpu_offload_is_refused_off_cuda(make_config, tmp_path):
    config = make_config(optimizer={"cpu_offload": True}, output_dir=str(tmp_path / "run"))
    with pytest.raises(ConfigError, match=r"optimizer\.cpu_offload needs a CUDA device") as raised:
        build_trainer(config).run()
    assert str(raised.value).splitlines()[-1].startswith("What to do:")
    with pytest.raises(ConfigError):
        check_optimizer(config, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", ["adamw", "adamw8bit", "paged_adamw8bit", "adamw8bit_ao"])
@pytest.mark.parametrize("cpu_offload", [False, True])
def test_optimizers_on_cuda_resume_bit_for_bit(make_config, tmp_path, name, cpu_offload):
    if cpu_offload and name != "adamw" and name != "adamw8bit_ao":
        pytest.skip("CPUOffloadOptimizer wraps torch-style optimizers")
    settings = {"training": {"steps": 5, "device": "cuda"}, "optimizer": {"name": name, "cpu_offload": cpu_offload},
                "lora": {"rank": 128, "alpha": 128}, "checkpoint": {"every": 2}}
    reference = build_trainer(make_config(**settings, output_dir=str(tmp_path / "reference")))
    reference.run()
    if cpu_offload:
        assert "CPUOffloadOptimizer" in [cls.__name__ for cls in type(reference.context.state.optimizer).__mro__]
    out = tmp_path / "stopped"
    trainer = build_trainer(make_config(**settings, output_dir=str(out)))
    run_stopped_at(trainer, 3)
    settings["checkpoint"] = {"every": 2, "resume": "latest"}
    build_trainer(make_config(**settings, output_dir=str(out))).run()
    trained, resumed = load_file(tmp_path / "reference" / LORA_FILE), load_file(out / LORA_FILE)
    for key in trained:
        assert torch.equal(resumed[key], trained[key]), key
