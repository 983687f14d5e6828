from pathlib import Path

import pytest
import yaml

import vidtune
from vidtune.config import Config, load_config, parse_override, write_resolved_config
from vidtune.errors import ConfigError

REQUIRED = ["model.name=ltx-video", "model.pretrained=some/model", "data.root=clips"]
SHIPPED = sorted((Path(vidtune.__file__).parent / "configs").glob("*.yaml"))


def test_defaults_fill_everything_but_model_and_data():
    config = load_config(None, REQUIRED)
    assert config.training.algorithm == "lora" and config.training.steps > 0
    assert config.lora.rank > 0 and config.checkpoint.every >= 0 and config.output_dir
    assert config.data.caption_dropout == 0.0  # off by default


def test_overrides_are_typed_yaml_scalars():
    assert parse_override("training.steps=12") == (["training", "steps"], 12)
    # YAML 1.1 reads 3e-4 as text; the typed config still turns it into the float users mean.
    assert load_config(None, [*REQUIRED, "training.learning_rate=3e-4"]).training.learning_rate == 3e-4
    assert parse_override("lora.target_modules=[to_q, to_k]") == (["lora", "target_modules"], ["to_q", "to_k"])
    overrides = ["training.steps=500", "lora.rank=32", "training.gradient_checkpointing=true"]
    config = load_config(None, [*REQUIRED, *overrides])
    assert config.training.steps == 500 and config.lora.rank == 32 and config.training.gradient_checkpointing is True


def test_unknown_keys_are_errors_with_a_suggestion():
    with pytest.raises(ConfigError) as error:
        load_config(None, [*REQUIRED, "training.learning_rat=1e-4", "loras.rank=3"])
    message = str(error.value)
    assert "training.learning_rat: unknown key. Did you mean 'learning_rate'?" in message
    assert "loras: unknown key. Did you mean 'lora'?" in message


@pytest.mark.parametrize(
    ("override", "expected"),
    [
        ("training.algorithm=dreambooth", "training.algorithm: 'dreambooth' is not allowed; choose one of"),
        ("training.steps=0", "training.steps: Input should be greater than 0"),
        ("data.caption_dropout=1.5", "data.caption_dropout: Input should be less than or equal to 1"),
        ("training.batch_size=two", "training.batch_size: Input should be a valid integer"),
        ("badoverride", "must look like section.key=value"),
    ],
)
def test_bad_values_name_the_key_and_what_is_allowed(override, expected):
    with pytest.raises(ConfigError, match=expected.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, [*REQUIRED, override])


def test_missing_required_sections():
    with pytest.raises(ConfigError, match="model: required"):
        load_config(None, ["data.root=x"])


def test_yaml_and_toml_files(tmp_path):
    (tmp_path / "a.yaml").write_text("model: {name: ltx-video, pretrained: m}\ndata: {root: d, frames: 17}\n")
    (tmp_path / "a.toml").write_text('[model]\nname = "ltx-video"\npretrained = "m"\n[data]\nroot = "d"\nframes = 17\n')
    assert load_config(tmp_path / "a.yaml") == load_config(tmp_path / "a.toml")
    (tmp_path / "bad.yaml").write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match=r"bad\.yaml is not valid YAML"):
        load_config(tmp_path / "bad.yaml")
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "missing.yaml")


def test_resolved_config_round_trips(tmp_path):
    config = load_config(None, [*REQUIRED, "training.steps=9"])
    path = write_resolved_config(config, tmp_path)
    assert Config.model_validate(yaml.safe_load(path.read_text())) == config


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_loads_and_says_how_to_run_it(path):
    assert path.read_text().startswith("# Run with: vidtune train")
    config = load_config(path)
    assert config.model.name


def test_configuration_reference_is_up_to_date():
    from vidtune.config_docs import render

    committed = (Path(vidtune.__file__).parent.parent / "docs" / "configuration.md").read_text(encoding="utf-8")
    assert committed == render(), "run: python -m vidtune.config_docs > docs/configuration.md"


def test_cross_section_checks_name_both_keys_plainly():
    with pytest.raises(ConfigError) as error:
        load_config(None, [*REQUIRED, "training.steps=6", "optimizer.warmup_steps=10"])
    message = str(error.value)
    assert "optimizer.warmup_steps (10) is larger than training.steps (6)" in message
    assert "model" not in message.split("\n", 1)[1]  # the input is not dumped
