from pathlib import Path

import pytest
import yaml
from pydantic import BaseModel

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


def test_a_key_in_the_wrong_section_names_the_section_it_belongs_to(tmp_path):
    with pytest.raises(ConfigError) as error:
        load_config(None, [*REQUIRED, "training.rank=8", "steps=300", "lerning_rate=1e-4"])
    message = str(error.value)
    assert "training.rank: unknown key. Did you mean 'lora.rank'?" in message
    assert "steps: unknown key. Did you mean 'training.steps'?" in message
    assert "lerning_rate: unknown key. Did you mean 'training.learning_rate'?" in message
    # In a file: the line, and every section the key belongs to.
    (tmp_path / "my.yaml").write_text("model: {name: ltx-video, pretrained: m}\ndata: {root: d}\nenabled: false\n")
    with pytest.raises(ConfigError) as error:
        load_config(tmp_path / "my.yaml")
    assert "line 3: enabled: unknown key. Did you mean " in str(error.value)
    assert "'validation.enabled'" in str(error.value) and "'precompute.enabled'" in str(error.value)


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
    assert "Set optimizer.warmup_steps to at most 6" in message  # what to do, with the number
    assert "model" not in message.split("\n", 1)[1]  # the input is not dumped


def test_paths_in_a_file_are_relative_to_its_folder_and_on_the_command_line_to_the_current_one(tmp_path,
                                                                                              monkeypatch):
    project, elsewhere = tmp_path / "project", tmp_path / "elsewhere"
    (project / "models" / "tiny").mkdir(parents=True)
    elsewhere.mkdir()
    (project / "my.yaml").write_text(
        "model: {name: ltx-video, pretrained: models/tiny, subfolders: {transformer: ./other/transformer}}\n"
        "data: {root: clips}\nprecompute: {cache_dir: ../cache}\ncheckpoint: {resume: runs/a}\noutput_dir: runs/a\n"
    )
    monkeypatch.chdir(elsewhere)
    config = load_config("../project/my.yaml")
    assert config.data.root == str(project / "clips")
    assert config.output_dir == str(project / "runs" / "a")
    assert config.precompute.cache_dir == str(tmp_path / "cache")
    assert config.checkpoint.resume == str(project / "runs" / "a")
    assert config.model.pretrained == str(project / "models" / "tiny")  # an existing folder, not a hub id
    assert config.model.subfolders["transformer"] == str(project / "other" / "transformer")

    config = load_config("../project/my.yaml", ["output_dir=out", "data.root=../clips2", "checkpoint.resume=latest",
                                                "model.pretrained=Lightricks/LTX-Video"])
    assert config.output_dir == str(elsewhere / "out") and config.data.root == str(tmp_path / "clips2")
    assert config.checkpoint.resume == "latest" and config.model.pretrained == "Lightricks/LTX-Video"
    # The default output_dir is where the command runs; the resolved config written to a run shows absolute paths.
    config = load_config(None, REQUIRED)
    assert config.output_dir == str(elsewhere / "outputs" / "run") and config.data.root == str(elsewhere / "clips")
    written = yaml.safe_load(write_resolved_config(config, tmp_path / "run").read_text())
    assert Path(written["data"]["root"]).is_absolute() and Path(written["output_dir"]).is_absolute()


def test_a_bad_key_is_blamed_where_it_was_written(tmp_path):
    (tmp_path / "my.yaml").write_text("model: {name: ltx-video, pretrained: m}\ndata:\n  root: d\n  frames: 0\n")
    with pytest.raises(ConfigError) as error:
        load_config(tmp_path / "my.yaml", ["training.stepz=3"])
    message = str(error.value)
    file_part, command_part = message.split("On the command line:")[0], message.split("On the command line:")[1]
    assert "training.stepz: unknown key" in command_part and "training.stepz" not in file_part
    assert f"In {tmp_path / 'my.yaml'}:\n  - line 4: data.frames: Input should be greater than 0" in message
    assert message.splitlines()[-1].startswith("What to do:")
    # A file's bad value replaced on the command line by another bad one is the command line's.
    with pytest.raises(ConfigError) as error:
        load_config(tmp_path / "my.yaml", ["data.frames=-1"])
    assert "On the command line:\n  - data.frames: Input should be greater than 0 (got -1)" in str(error.value)
    assert "my.yaml" not in str(error.value)


def test_config_show_prints_every_key_with_its_value_and_meaning(tmp_path, capsys, monkeypatch):
    from vidtune.cli import main

    assert main(["config", "show"]) == 0
    shown = capsys.readouterr().out
    values = yaml.safe_load(shown)  # the output is a config file to start from
    lines, section = {}, None
    for text in shown.splitlines():
        if not text.startswith(("#", " ")):
            section = text.split(":")[0]
            lines[(section,)] = text
        elif text.startswith("  "):
            lines[(section, text.split(":")[0].strip())] = text
    for name, field in Config.model_fields.items():
        assert field.description and field.description in lines[(name,)]
        section = field.annotation
        keys = section.model_fields if isinstance(section, type) and issubclass(section, BaseModel) else {}
        for key, sub in keys.items():
            assert key in values[name], f"{name}.{key}"
            assert sub.description and f"{sub.description}" in lines[(name, key)], lines[(name, key)]
    assert values["training"]["steps"] == 1000 and values["model"]["name"] is None
    assert "REQUIRED, not set. Model family" in shown

    monkeypatch.chdir(tmp_path)
    (tmp_path / "my.yaml").write_text("model: {name: ltx-video, pretrained: some/model}\ndata: {root: clips}\n")
    assert main(["config", "show", "my.yaml", "training.steps=7"]) == 0
    values = yaml.safe_load(capsys.readouterr().out)
    assert values["training"]["steps"] == 7 and values["data"]["root"] == str(tmp_path / "clips")
    assert values["output_dir"] == str(tmp_path / "outputs" / "run")


def test_train_help_lists_the_sections_and_points_at_config_show(capsys):
    from vidtune.cli import main

    with pytest.raises(SystemExit):
        main(["train", "--help"])
    text = capsys.readouterr().out
    for name in Config.model_fields:
        assert f"\n  {name} " in text
    assert "vidtune config show [CONFIG]" in text
