"""Control training of Wan 2.2's two experts (A14B): each expert's own widened input layer, each sample's control
latents routed with it to its expert, a file per expert, both widened when sampling, exact resume."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.datasets import control_dataset
from tests.helpers.runs import run_stopped_at
from tests.helpers.wan22 import BOUNDARY, spec_of, two_expert_config
from vidtune.control import ExpertsControlInput, attach_control
from vidtune.errors import ConfigError
from vidtune.models.tiny.wan22 import write_tiny_wan22
from vidtune.outputs import LORA_WEIGHTS, LORA_WEIGHTS_2
from vidtune.sampling import load_pipeline, sample_run
from vidtune.trainers import build_trainer

CPU = torch.device("cpu")
CONTROL_FILES = ("control_input.safetensors", "control_input_transformer_2.safetensors")


@pytest.fixture(scope="module")
def two_expert_dir(tmp_path_factory) -> Path:
    return write_tiny_wan22(tmp_path_factory.mktemp("wan22-a14b-control"), two_experts=True,
                            boundary_ratio=BOUNDARY)


def test_each_sample_takes_its_own_control_rows_to_its_expert(two_expert_dir):
    """A batch split by the boundary: each expert computes its sample with that sample's control latents, through
    its own widened layer (as each expert called alone with its sample's control)."""
    spec = spec_of("wan2.2", two_expert_dir)
    denoiser = spec.load_denoiser(CPU).eval()
    control = attach_control(spec, denoiser)
    assert isinstance(control, ExpertsControlInput)
    layers = control.layers()
    assert set(layers) == {"transformer.patch_embedding", "transformer_2.patch_embedding"}
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in layers.values():  # the control inputs of each expert made non-zero (and different)
            layer.weight[:, control.in_features:].normal_(generator=generator)
    latents = torch.randn(2, 4, 3, 4, 4, generator=generator)
    controls = torch.randn(2, 4, 3, 4, 4, generator=generator)
    prompt = torch.randn(2, 512, 32, generator=generator)
    timesteps = torch.tensor([700.0, 300.0])  # one each side of the boundary
    with torch.no_grad():
        with control.given(controls):
            mixed = spec.forward(denoiser, {"prompt_embeds": prompt}, latents, timesteps)
        alone = []
        for row, name in enumerate(("transformer", "transformer_2")):
            with control.parts[name].given(controls[row:row + 1]):
                alone.append(denoiser.expert(name)(hidden_states=latents[row:row + 1], timestep=timesteps[row:row + 1],
                                                   encoder_hidden_states=prompt[row:row + 1], return_dict=False)[0])
        with control.given(controls.flip(0)):
            swapped = spec.forward(denoiser, {"prompt_embeds": prompt}, latents, timesteps)
    torch.testing.assert_close(mixed, torch.cat(alone))
    assert not torch.allclose(mixed, swapped)  # the controls do reach the experts, each its own rows


def test_control_needs_both_experts(make_config, two_expert_dir):
    config = two_expert_config(make_config, model={"experts": "high_noise"},
                               training={"algorithm": "control-lora"})(two_expert_dir)
    with pytest.raises(ConfigError, match=r"(?s)model.experts=high_noise with training.algorithm=control-lora: .*"
                                          r"What to do: remove model.experts"):
        spec_of("wan2.2", two_expert_dir, experts="high_noise").check_training(config)


def test_two_expert_control_lora_saves_a_file_per_expert_and_samples_with_both(make_config, two_expert_dir,
                                                                               shapes_dataset, tmp_path):
    root, _, _ = control_dataset(shapes_dataset, tmp_path / "data")
    out = tmp_path / "run"
    config = two_expert_config(make_config, data_root=root, output_dir=str(out),
                               # Seed 1: every step's two samples fall on both sides of the boundary.
                               training={"algorithm": "control-lora", "steps": 3, "learning_rate": 1e-2,
                                         "batch_size": 2, "sigma_sampling": "uniform", "seed": 1},
                               validation={"enabled": True, "num_inference_steps": 2})(two_expert_dir)
    trainer = build_trainer(config)
    routed = []  # the timesteps each step's batch ran with: split between the experts
    original = trainer.spec.forward

    def forward(denoiser, conditions, noisy, timesteps):
        routed.append(timesteps.detach().clone())
        return original(denoiser, conditions, noisy, timesteps)

    trainer.spec.forward = forward
    result = trainer.run()
    high = [bool(step[0] >= BOUNDARY * 1000) != bool(step[1] >= BOUNDARY * 1000) for step in routed]
    assert len(high) == 3 and all(high)
    assert result.sample_paths and all(path.is_file() for path in result.sample_paths)  # validated with both
    described = json.loads((out / "control.json").read_text())
    assert described["experts"] == ["transformer", "transformer_2"]
    assert (out / LORA_WEIGHTS).is_file() and (out / LORA_WEIGHTS_2).is_file()
    saved = {name: load_file(out / name)["weight"] for name in CONTROL_FILES}
    for weight in saved.values():  # each expert's control inputs trained (they start at zero)
        assert weight[:, described["in_features"]:].abs().max() > 0
    assert not torch.equal(*saved.values())
    run = load_pipeline(out, device="cpu")
    assert isinstance(run.control, ExpertsControlInput)
    for name, file_name in zip(("transformer", "transformer_2"), CONTROL_FILES, strict=True):
        expert = getattr(run.pipeline, name)
        assert torch.equal(expert.patch_embedding.weight, saved[file_name])
        assert any("lora_" in key for key, _ in expert.named_parameters())
    # `vidtune sample RUN`: both experts follow the run's first clip's control clip.
    written = sample_run(run, "a shape moving", tmp_path / "sample.mp4", num_inference_steps=2)
    assert written.is_file()


def test_a_resumed_two_expert_control_full_run_ends_bit_for_bit(make_config, two_expert_dir, shapes_dataset,
                                                               tmp_path):
    root, _, _ = control_dataset(shapes_dataset, tmp_path / "data")

    def config(output: Path, **checkpointing):
        return two_expert_config(make_config, data_root=root, output_dir=str(output),
                                 training={"algorithm": "control-full", "steps": 4, "learning_rate": 1e-3,
                                           "batch_size": 2, "sigma_sampling": "uniform", "ema_decay": 0.8,
                                           "seed": 1},
                                 checkpoint={"every": 2, **checkpointing})(two_expert_dir)

    build_trainer(config(tmp_path / "reference")).run()
    out = tmp_path / "stopped"
    trainer = build_trainer(config(out))
    run_stopped_at(trainer, 3)
    build_trainer(config(out, resume="latest")).run()
    files = [*CONTROL_FILES, "control_input_ema.safetensors", "control_input_ema_transformer_2.safetensors",
             *(f"{folder}/diffusion_pytorch_model.safetensors"
               for folder in ("transformer", "transformer_2", "transformer_ema", "transformer_2_ema"))]
    for name in files:
        resumed, reference = load_file(out / name), load_file(tmp_path / "reference" / name)
        assert resumed.keys() == reference.keys() and resumed, name
        for key in resumed:
            assert torch.equal(resumed[key], reference[key]), (name, key)
    # The saved experts are the base model's shape (the input layer cut back), so diffusers loads them as they are.
    in_features = json.loads((out / "control.json").read_text())["in_features"]
    for folder in ("transformer", "transformer_2"):
        weight = load_file(out / folder / "diffusion_pytorch_model.safetensors")["patch_embedding.weight"]
        assert weight.shape[1] == in_features
    run = load_pipeline(out, device="cpu")
    assert isinstance(run.control, ExpertsControlInput)
    assert run.pipeline.transformer_2.patch_embedding.weight.shape[1] > in_features
