"""A config is made once and never changed: every section refuses assignment, family defaults come as a new config,
and changed copies are made with `model_copy(update=...)`."""

from __future__ import annotations

import typing

import pytest
from pydantic import BaseModel, ValidationError

from vidtune.algorithms import ALGORITHM_NAMES
from vidtune.config import Config, TrainingConfig, build_config, load_config
from vidtune.errors import ConfigError
from vidtune.models.defaults import CONFIG_KEYS, FAMILY_DEFAULTS, apply_family_defaults

REQUIRED = ["model.name=wan", "model.pretrained=some/model", "data.root=clips"]
SECTIONS = [name for name, field in Config.model_fields.items()
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)]


def _assignments(config: Config) -> list[tuple[BaseModel, str, object]]:
    """(object, key, a value of that key) for the first key of every section, a nested source, and the top level."""
    found: list[tuple[BaseModel, str, object]] = [(config, "output_dir", "elsewhere")]
    for name in SECTIONS:
        section = getattr(config, name)
        key = next(iter(type(section).model_fields))
        found.append((section, key, getattr(section, key)))
    source = config.data.datasets[0]
    found.append((source, "repeats", 2))
    found.append((config.logging.wandb, "project", "other"))
    return found


@pytest.mark.parametrize("made_by", ["load_config", "build_config"])
def test_every_section_of_a_made_config_refuses_assignment(made_by, tmp_path):
    overrides = ["model.name=wan", "model.pretrained=some/model", "data.datasets=[{type: folder, root: clips}]",
                 "logging.wandb={project: mine}", f"output_dir={tmp_path / 'run'}"]
    config = load_config(None, overrides) if made_by == "load_config" else build_config(
        load_config(None, overrides).to_dict())
    before = config.to_dict()
    for target, key, value in _assignments(config):
        with pytest.raises(ValidationError, match="frozen"):
            setattr(target, key, value)
    assert config.to_dict() == before
    # A changed copy is the way to a different value; the original keeps its own.
    copy = config.model_copy(update={"training": config.training.model_copy(update={"steps": 7})})
    assert copy.training.steps == 7 and config.training.steps == before["training"]["steps"]


def test_family_defaults_come_as_a_new_config_and_leave_the_given_one_alone():
    unresolved = Config.model_validate({"model": {"name": "wan", "pretrained": "m"}, "data": {"root": "d",
                                                                                           "height": 256}})
    before = unresolved.to_dict()
    resolved = apply_family_defaults(unresolved)
    assert resolved is not unresolved and unresolved.to_dict() == before
    wan = FAMILY_DEFAULTS["wan"]
    assert (resolved.data.frames, resolved.data.height, resolved.data.width) == (wan.frames, 256, wan.width)
    assert resolved.model.frame_rate == wan.fps and resolved.training.sigma_shift == wan.sigma_shift
    # The filled keys are still the family's, not the user's: only the key set stays in model_fields_set.
    assert resolved.data.model_fields_set == unresolved.data.model_fields_set == {"root", "height"}
    assert not {key for (section, key) in CONFIG_KEYS if section == "training"} & resolved.training.model_fields_set
    assert "frame_rate" not in resolved.model.model_fields_set
    with pytest.raises(ValidationError, match="frozen"):
        resolved.data.frames = 9


def test_the_default_output_dir_is_made_absolute_in_a_frozen_config(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    config = load_config(None, REQUIRED)
    assert config.output_dir == str(tmp_path / "outputs" / "run")
    with pytest.raises(ValidationError, match="frozen"):
        config.output_dir = "outputs/run"


def test_cache_info_with_a_cache_dir_reports_on_that_folder(tmp_path, monkeypatch):
    from vidtune import cli
    from vidtune.precompute import info

    seen = []

    def report(config, root=None, verify=False, progress=False):
        seen.append((config, root))
        return info.CacheReport(tmp_path, {}, {})

    monkeypatch.setattr(info, "cache_report", report)
    path = tmp_path / "my.yaml"
    path.write_text("model: {name: wan, pretrained: some/model}\ndata: {root: clips}\n")
    assert cli.main(["cache", "info", str(path), "--cache-dir", str(tmp_path / "cache")]) == 0
    (config, root), = seen
    assert config.precompute.cache_dir == root == str(tmp_path / "cache")


def test_the_allowed_algorithms_are_the_algorithms_module_s():
    assert typing.get_args(TrainingConfig.model_fields["algorithm"].annotation) == ALGORITHM_NAMES


@pytest.mark.parametrize(("overrides", "message"), [
    (["training.algorithm=full", "memory.base_weights=fp8"], "memory.base_weights=fp8 works with adapter algorithms "
     "(lora, control-lora, a LoRA student) only: full trains the base weights, which cannot be stored quantized; "
     "set memory.base_weights=auto"),
    (["training.algorithm=control-full", "memory.base_weights=nf4", "distillation.student=full"],
     "memory.base_weights=nf4 works with adapter algorithms (lora, control-lora, a LoRA student) only: control-full "
     "trains the base weights"),
    (["training.algorithm=step-distillation", "distillation.student=full", "memory.base_weights=int8"],
     "distillation.student=full works with training.algorithm=guidance-distillation only: step-distillation trains "
     "a LoRA student; remove distillation.student"),
    (["training.algorithm=guidance-distillation", "distillation.student=full", "memory.base_weights=fp8"],
     "memory.base_weights=fp8 works with a LoRA student only: a full student trains those weights; set "
     "memory.base_weights=auto or remove distillation.student"),
])
def test_algorithm_checks_name_the_keys(overrides, message):
    with pytest.raises(ConfigError) as error:
        load_config(None, [*REQUIRED, *overrides])
    assert message in str(error.value)


@pytest.mark.parametrize("overrides", [
    ["training.algorithm=lora", "distillation.student=full", "memory.base_weights=fp8"],
    ["training.algorithm=control-lora", "memory.base_weights=nf4"],
    ["training.algorithm=guidance-distillation", "memory.base_weights=fp8"],
    ["training.algorithm=guidance-distillation", "distillation.student=full"],
    ["training.algorithm=step-distillation", "memory.base_weights=int8"],
])
def test_algorithm_checks_let_adapters_and_choosing_students_through(overrides):
    config = load_config(None, [*REQUIRED, *overrides])
    for override in overrides:
        key, value = override.split("=")
        section, name = key.split(".")
        assert getattr(getattr(config, section), name) == value
