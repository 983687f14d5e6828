"""LoRA target presets (`lora.target_modules: attention | attention+ffn | all-linear`), for every family."""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from safetensors import safe_open
from torch import nn

from vidtune.algorithms.build import build_part, build_spec
from vidtune.algorithms.lora import LoRAPart, linear_module_names
from vidtune.batches import Batch
from vidtune.config import Config
from vidtune.errors import ConfigError
from vidtune.models.registry import available_models, get_spec_class
from vidtune.models.spec import ALL_LINEAR, ModelSpec
from vidtune.trainers import build_trainer
from vidtune.training import loop, setup
from vidtune.training.context import TrainingContext

CPU = torch.device("cpu")


def _matches(name: str, target: str) -> bool:
    """peft's rule for a list of target names: the module's path is the name or ends with `.name`."""
    return name == target or name.endswith(f".{target}")


def parameters_without_gradient(context: TrainingContext, batch: Batch) -> list[str]:
    """The names of the trained parameters the backward pass of `batch`'s loss leaves without a gradient, taken as
    the run's loop takes it."""
    loop.forward_backward(context, batch, sync=True, notes=[])
    names = {id(p): name for name, p in context.denoiser.named_parameters()}
    return [names[id(p)] for p in context.parameters if p.grad is None]


def first_batch(context: TrainingContext) -> Batch:
    with contextlib.closing(context.batches()) as stream:
        return next(stream)


def first_step_parameters_without_gradient(trainer) -> list[str]:
    """Set `trainer`'s run up and take the backward pass of its first micro-batch (nothing is saved: the question is
    only which parameters the loss reaches); the names of the trained parameters left without a gradient."""
    context = trainer.set_up()
    return parameters_without_gradient(context, first_batch(context))


def trained_names(context: TrainingContext) -> list[str]:
    names = {id(p): name for name, p in context.denoiser.named_parameters()}
    return sorted(names[id(p)] for p in context.parameters)


def with_lora_targets(context: TrainingContext, config: Config) -> TrainingContext:
    """`context` with the denoiser `config`'s LoRA targets adapt, set up by the run's own `load_denoiser` (the same
    samples, encoders and strategy)."""
    part = build_part(config, context.spec)
    denoiser, parameters = setup.load_denoiser(config, context.spec, part, context.inputs, context.device,
                                               context.strategy)
    denoiser.train()
    return dataclasses.replace(context, config=config, part=part, denoiser=denoiser, trained_denoiser=denoiser,
                               parameters=parameters)


@pytest.mark.parametrize("family", available_models())
def test_every_preset_names_linear_layers_of_the_familys_denoiser(make_config, family):
    config = make_config(family)
    spec = get_spec_class(family)(config.model, frame_rate=config.frame_rate)
    denoiser = spec.load_denoiser(CPU)
    # A 1x1 convolution is a linear layer applied at each position (Sana Video's feed-forward is made of them).
    pointwise = {name for name, module in denoiser.named_modules()
                 if isinstance(module, nn.Conv1d | nn.Conv2d | nn.Conv3d) and module.groups == 1
                 and all(size == 1 for size in module.kernel_size)}
    linear = linear_module_names(denoiser)
    adaptable = set(linear) | pointwise
    # Every family has the three shared presets (a family may add its own, e.g. Wan VACE's per-stack ones).
    assert {"attention", "attention+ffn", ALL_LINEAR} <= set(spec.lora_presets)
    assert spec.default_lora_targets == spec.lora_presets[spec.default_lora_preset] == spec.lora_presets["attention"]
    assert set(spec.lora_presets["attention"]) < set(spec.lora_presets["attention+ffn"])
    for preset, targets in spec.lora_presets.items():
        if preset == ALL_LINEAR:
            continue
        for target in targets:
            assert any(_matches(name, target) for name in adaptable), f"{family} {preset}: {target} matches no layer"
    # Feed-forward layers are what `attention+ffn` adds (a name that only matched attention would pass above).
    added = set(spec.lora_presets["attention+ffn"]) - set(spec.lora_presets["attention"])
    assert added and all("ff" in target or "mlp" in target or "feed_forward" in target for target in added)

    # `all-linear` resolves to names that adapt every linear layer and nothing else.
    config = make_config(family, lora={"target_modules": ALL_LINEAR})
    part = build_part(config, build_spec(config))
    assert isinstance(part, LoRAPart)
    targets = part.resolve_targets(linear)
    adapted = {name for name, module in denoiser.named_modules() if any(_matches(name, t) for t in targets)}
    assert adapted == set(linear)


def test_a_preset_adapts_its_layers_and_the_adapter_says_which(make_config, tmp_path):
    config = make_config(training={"steps": 1}, lora={"target_modules": "attention+ffn", "rank": 4, "alpha": 4})
    trainer = build_trainer(config)
    result = trainer.run()
    adapted = {name.rsplit(".lora_A", 1)[0] for name, _ in trainer.context.denoiser.named_parameters()
               if ".lora_A." in name}
    assert any(name.endswith("ff.net.2") for name in adapted) and any(name.endswith("attn2.to_k") for name in adapted)
    assert not any(name.endswith("proj_out") for name in adapted)
    with safe_open(result.weights_path, "pt") as saved:
        metadata = saved.metadata()
    assert "ff.net.0.proj" in metadata["lora_adapter_metadata"]

    # The default is the family's `attention` preset.
    trainer = build_trainer(make_config(training={"steps": 1}, output_dir=str(tmp_path / "default")))
    trainer.run()
    adapted = {n for n, p in trainer.context.denoiser.named_parameters() if p.requires_grad}
    assert adapted and not any(".ff." in name for name in adapted)
    assert any(".attn1.to_out.0." in name for name in adapted)


def test_an_unknown_preset_names_the_familys_presets(make_config):
    with pytest.raises(ConfigError, match=r"'attention\+mlp' is not a preset of ltx-video .*attention\+ffn"):
        build_trainer(make_config(lora={"target_modules": "attention+mlp"})).run()


def test_linear_module_names_are_the_linear_layers():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Sequential(nn.Linear(2, 2)))
    assert linear_module_names(model) == ["0", "2.0"]


@pytest.mark.parametrize("family", available_models())
def test_every_adapter_a_preset_adds_takes_part_in_the_loss(make_config, family, tmp_path):
    """Training on several GPUs (DDP) needs every trainable parameter in the graph: no preset may adapt a layer
    whose output the loss never sees."""
    # LTX-2's clips here have no sound: by default they train with the audio stream cut off, which leaves the
    # audio-video cross-attention out of the step, and the denoiser says so to DDP (checked below). With the audio
    # stream present (`silence`), every adapter of every preset must take part.
    sound = {"clips_without_sound": "silence"} if get_spec_class(family).audio_format is not ModelSpec.audio_format \
        else {}
    configs = {preset: make_config(family, model=sound, training={"steps": 1},
                                   lora={"target_modules": preset, "rank": 2}, output_dir=str(tmp_path / preset))
               for preset in ("attention", "attention+ffn", ALL_LINEAR)}
    # One run set up (its samples encoded once); each preset's denoiser set up as a run of that preset sets it up,
    # which for the run's own preset trains what the run trains.
    context = build_trainer(configs["attention"]).set_up()
    batch = first_batch(context)
    for preset, config in configs.items():
        adapted = with_lora_targets(context, config)
        if preset == "attention":
            assert trained_names(adapted) == trained_names(context)
        unused = parameters_without_gradient(adapted, batch)
        assert not unused, f"{family} {preset}: {unused[:5]}"


def test_ltx_2_clips_without_sound_tell_ddp_of_the_cross_attention_they_leave_out(make_config, tmp_path):
    """A micro-batch of clips without sound trains with the audio stream cut off: its audio-video cross-attention
    adapters get no gradient, so the denoiser declares it and DDP looks for unused parameters."""
    trainer = build_trainer(make_config("ltx-2", training={"steps": 1}, lora={"target_modules": "attention",
                                                                              "rank": 2}))
    unused = first_step_parameters_without_gradient(trainer)
    assert unused and all("audio_to_video_attn" in name or "video_to_audio_attn" in name for name in unused), unused
    assert trainer.context.denoiser.leaves_parameters_unused
    silence = build_trainer(make_config("ltx-2", model={"clips_without_sound": "silence"},
                                        output_dir=str(tmp_path / "silence")))
    assert not silence.spec.load_denoiser(torch.device("cpu")).leaves_parameters_unused
