"""adapter.type lokr / loha: the settings refused with their keys, quantized base weights, resume bit for bit with
the weights' average, lora.init_from, `vidtune export`, and the algorithms and models that train an adapter (a
control run, a distilled student, Wan 2.2's two experts). That each trains and loads for every family is
tests/models/test_contract.py's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tests.helpers.runs import run_stopped_at
from tests.helpers.wan22 import two_expert_config
from vidtune.cli import main as cli_main
from vidtune.errors import ConfigError
from vidtune.models.tiny.wan22 import write_tiny_wan22
from vidtune.outputs import LORA_EMA_WEIGHTS, LORA_WEIGHTS, LORA_WEIGHTS_2, comfyui_lora_weights
from vidtune.sampling import load_pipeline
from vidtune.trainers import build_trainer

PREFIX = {"lokr": "lokr_", "loha": "hada_"}


@pytest.mark.parametrize(("sections", "message"), [
    ({"adapter": {"type": "lokr"}, "lora": {"use_dora": True}},
     r"lora\.use_dora works with adapter\.type=lora only: peft has no DoRA for lokr"),
    ({"adapter": {"type": "loha"}, "lora": {"dropout": 0.1}},
     r"lora\.dropout drops LoRA's input features.*adapter\.rank_dropout"),
    ({"adapter": {"type": "loha", "decompose_both": True}}, r"adapter\.decompose_factor and adapter\.decompose_both "
                                                            r"are LoKr's; adapter\.type is loha"),
    ({"adapter": {"rank_dropout": 0.1}}, r"adapter\.rank_dropout is a setting of adapter\.type=lokr or loha"),
    ({"adapter": {"type": "lokr", "decompose_factor": 0}}, r"adapter\.decompose_factor=0: use -1 or a positive"),
    ({"adapter": {"type": "lokr"}, "memory": {"base_weights": "nf4"}},
     r"memory\.base_weights=nf4 cannot be combined with adapter\.type=lokr: .* 4-bit storage packs"),
    ({"adapter": {"type": "loha"}, "training": {"algorithm": "full"}},
     r"adapter\.type=loha is an adapter, but training\.algorithm=full trains the denoiser's own weights"),
], ids=["dora", "dropout", "lokr-knob", "lycoris-knob-on-lora", "factor", "nf4", "full"])
def test_settings_that_make_no_sense_with_the_adapter_type_are_refused_naming_their_keys(make_config, sections,
                                                                                         message):
    with pytest.raises(ConfigError, match=message):
        make_config(**sections)


def _base_storage(denoiser: torch.nn.Module) -> set[str]:
    return {type(module.weight).__name__ if type(module.weight).__name__ == "Int8Tensor" else str(module.weight.dtype)
            for name, module in denoiser.named_modules() if name.endswith("attn1.to_q.base_layer")}


@pytest.mark.parametrize(("kind", "base_weights", "storage", "adapter"), [
    ("lokr", "int8", "Int8Tensor", {"decompose_both": True, "decompose_factor": 4, "rank_dropout": 0.2,
                                    "module_dropout": 0.2}),
    ("loha", "fp8", "torch.float8_e4m3fn", {"rank_dropout": 0.2}),
])
def test_a_stopped_and_resumed_run_ends_bit_for_bit_like_one_left_alone(make_config, tmp_path, kind, base_weights,
                                                                        storage, adapter):
    """Over quantized base weights, with the kind's own dropouts (they draw from the global RNG, which a checkpoint
    restores) and the weights' average: the adapter and its average equal an uninterrupted run's."""
    settings = {"training": {"steps": 5, "ema_decay": 0.8, "learning_rate": 1e-2}, "checkpoint": {"every": 2},
                "lora": {"rank": 2, "alpha": 2}, "adapter": {"type": kind, **adapter},
                "memory": {"base_weights": base_weights}}
    reference = build_trainer(make_config(**settings, output_dir=str(tmp_path / "reference")))
    reference.run()
    assert _base_storage(reference.context.denoiser) == {storage}
    out = tmp_path / "stopped"
    run_stopped_at(build_trainer(make_config(**settings, output_dir=str(out))), 3)
    settings["checkpoint"] = {"every": 2, "resume": "latest"}
    build_trainer(make_config(**settings, output_dir=str(out))).run()
    for name in (LORA_WEIGHTS, LORA_EMA_WEIGHTS):
        ours, theirs = load_file(out / name), load_file(tmp_path / "reference" / name)
        assert ours.keys() == theirs.keys() and all(PREFIX[kind] in key for key in ours)
        assert all(torch.equal(ours[key], theirs[key]) for key in ours), name
    # The adapter loads into the plain (unquantized) pipeline, as a run's result does: `vidtune sample`'s way.
    pipeline = load_pipeline(out).pipeline
    loaded = {k.removesuffix(".default") for k in pipeline.transformer.state_dict() if PREFIX[kind] in k}
    assert {k.removeprefix("transformer.") for k in load_file(out / LORA_WEIGHTS)} == loaded


def test_init_from_starts_at_the_adapter_and_refuses_another_kind(make_config, tmp_path):
    settings = {"training": {"steps": 1, "learning_rate": 5e-2}, "lora": {"rank": 2, "alpha": 2},
                "adapter": {"type": "lokr"}}
    first = build_trainer(make_config(**settings, output_dir=str(tmp_path / "first"))).run().weights_path
    expected = {k.removeprefix("transformer."): v for k, v in load_file(first).items()}
    second = build_trainer(make_config(lora={"rank": 2, "alpha": 2, "init_from": str(first)}, adapter={"type": "lokr"},
                                       training={"steps": 1, "seed": 7}, output_dir=str(tmp_path / "2")))
    started: dict[str, torch.Tensor] = {}
    original = second.loss

    def loss(*args, **kwargs):  # the adapter as the first step starts
        started.update({k: v.detach().clone() for k, v in second.part.state_dict().items()} if not started else {})
        return original(*args, **kwargs)

    second.loss = loss
    second.run()
    assert started.keys() == expected.keys() and all(torch.equal(started[k], expected[k]) for k in expected)
    with pytest.raises(ConfigError, match=r"is a LoKr adapter, but adapter\.type is loha\.\nWhat to do: set "
                                          r"adapter\.type=lokr"):
        build_trainer(make_config(lora={"rank": 2, "alpha": 2, "init_from": str(first)}, adapter={"type": "loha"},
                                  output_dir=str(tmp_path / "3"))).run()
    with pytest.raises(ConfigError, match=r"has alpha 2, but lora\.alpha is 4.*\nWhat to do: set lora\.alpha=2"):
        build_trainer(make_config(lora={"rank": 2, "alpha": 4, "init_from": str(first)}, adapter={"type": "lokr"},
                                  output_dir=str(tmp_path / "4"))).run()


@pytest.mark.parametrize("kind", ["lokr", "dora"])
def test_export_writes_a_checkpoints_adapter_and_comfyui_file_as_the_run_did(make_config, tmp_path, kind):
    """`vidtune export` of the last checkpoint gives the run's own files; a DoRA checkpoint's ComfyUI file is
    computed from the base model, loaded for it."""
    kinds = {"adapter": {"type": kind}} if kind != "dora" else {"lora": {"rank": 2, "use_dora": True}}
    config = make_config(**({"lora": {"rank": 2}} | kinds), training={"steps": 2, "learning_rate": 1e-2},
                         checkpoint={"every": 2})
    build_trainer(config).run()
    run = Path(config.output_dir)
    assert cli_main(["export", str(run / "checkpoints" / "step-00000002"), "--output", str(tmp_path / "e")]) == 0
    comfyui = [path.name for path in (tmp_path / "e").iterdir() if path.name.endswith("_comfyui.safetensors")]
    assert len(comfyui) == 1
    for ours, theirs in ((LORA_WEIGHTS, LORA_WEIGHTS), (comfyui[0], comfyui_lora_weights(run.name))):
        exported, written = load_file(tmp_path / "e" / ours), load_file(run / theirs)
        assert exported.keys() == written.keys()
        for key in written:
            torch.testing.assert_close(exported[key], written[key], rtol=0, atol=0)
    if kind == "dora":
        assert any(key.endswith(".dora_scale") for key in load_file(run / comfyui_lora_weights(run.name)))


@pytest.mark.parametrize(("algorithm", "kind", "family"), [("control-lora", "lokr", "ltx-video"),
                                                           ("step-distillation", "loha", "wan")])
def test_the_algorithms_that_train_an_adapter_train_the_kind(make_config, shapes_dataset, tmp_path, algorithm, kind,
                                                             family):
    from tests.helpers.datasets import control_dataset

    data = {"data_root": control_dataset(shapes_dataset, tmp_path / "data")[0]} if algorithm == "control-lora" else {}
    config = make_config(family, **data, training={"steps": 1, "algorithm": algorithm, "learning_rate": 5e-2},
                         lora={"rank": 2, "alpha": 2}, adapter={"type": kind},
                         distillation={"student_steps": 1, "teacher_steps": 2})
    trainer = build_trainer(config)
    result = trainer.run()
    saved = load_file(result.weights_path)
    assert saved and all(PREFIX[kind] in key for key in saved)
    assert any(float(value.abs().max()) > 0 for value in saved.values())


def test_two_experts_train_a_lokr_each_and_load_into_both(make_config, tmp_path):
    pretrained = write_tiny_wan22(tmp_path / "model", two_experts=True, boundary_ratio=0.5)
    config = two_expert_config(make_config, training={"steps": 2, "learning_rate": 5e-2, "batch_size": 2, "seed": 8,
                                                      "sigma_sampling": "uniform"},
                               adapter={"type": "lokr"}, output_dir=str(tmp_path / "run"))(pretrained)
    build_trainer(config).run()
    pipeline = load_pipeline(tmp_path / "run").pipeline
    for component, file in (("transformer", LORA_WEIGHTS), ("transformer_2", LORA_WEIGHTS_2)):
        saved = load_file(tmp_path / "run" / file)
        assert saved and all("lokr_" in key for key in saved)
        loaded = getattr(pipeline, component).state_dict()
        assert all(torch.equal(loaded[_peft_key(key)], value) for key, value in saved.items()), component
    assert (tmp_path / "run" / comfyui_lora_weights("run", second=True)).is_file()


def _peft_key(key: str) -> str:
    """A file's key as the module's state dict names it (peft keeps each tensor under the adapter's name)."""
    name = key.removeprefix("transformer.")
    return f"{name}.default"
