"""model.pretrained pointing at the wrong folder: the message names the folder to use, or what the folder is."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from vidtune.config import load_config
from vidtune.errors import ModelError
from vidtune.models.registry import get_spec_class


def _check(pretrained: str | Path, config_file: Path | None = None) -> str:
    if config_file is None:
        config = load_config(None, ["model.name=ltx-video", f"model.pretrained={pretrained}", "data.root=."])
    else:
        config = load_config(config_file)
    spec = get_spec_class(config.model.name)(config.model, frame_rate=config.frame_rate)
    with pytest.raises(ModelError) as error:
        spec.check_source()
    return str(error.value)


def test_a_folder_holding_the_model_folder_names_it(tmp_path, tiny_model_dir):
    parent = tmp_path / "vidtune-quickstart"  # as the quickstart lays it out
    (parent / "data").mkdir(parents=True)
    (parent / "tiny-ltx-video").symlink_to(tiny_model_dir("ltx-video"), target_is_directory=True)
    message = _check(parent)
    assert f"model.pretrained: {parent} is not a complete ltx-video model folder; missing subfolder(s):" in message
    assert f"The model folder is inside it: {parent / 'tiny-ltx-video'}." in message
    assert f"What to do: set model.pretrained={parent / 'tiny-ltx-video'}." in message


def test_a_run_folder_is_a_run_not_a_base_model(tmp_path, tiny_model_dir):
    run = tmp_path / "my-run"
    checkpoint = run / "checkpoints" / "step-00000100"
    checkpoint.mkdir(parents=True)
    base = tiny_model_dir("ltx-video")
    (run / "config.yaml").write_text(yaml.safe_dump({"model": {"name": "ltx-video", "pretrained": str(base)}}))
    (run / "pytorch_lora_weights.safetensors").write_bytes(b"weights")
    (checkpoint / "pytorch_lora_weights.safetensors").write_bytes(b"weights")
    message = _check(run)
    assert f"model.pretrained: {run} is a vidtune run (the weights it trained), not a base model." in message
    assert f"set model.pretrained to the base model it trained from, {base}" in message
    assert f"to continue from its LoRA, add lora.init_from={run / 'pytorch_lora_weights.safetensors'}" in message
    assert f"to generate videos with it, run vidtune sample {run} --prompt" in message
    message = _check(checkpoint)
    assert f"{checkpoint} is a checkpoint of a vidtune run, not a base model." in message
    assert f"lora.init_from={checkpoint / 'pytorch_lora_weights.safetensors'}" in message


def test_a_relative_path_that_is_no_folder_names_the_folder_it_looked_at(tmp_path):
    (tmp_path / "configs").mkdir()
    path = tmp_path / "configs" / "my.yaml"
    path.write_text(yaml.safe_dump({"model": {"name": "ltx-video", "pretrained": "models/tiny-ltx-video"},
                                    "data": {"root": "."}}))
    message = _check("", config_file=path)
    assert "model.pretrained: models/tiny-ltx-video is not in this machine's hub cache" in message
    assert (f"As a folder it was looked for at {tmp_path / 'configs' / 'models' / 'tiny-ltx-video'}, which does "
            "not exist (a relative path in a config file is relative to the file's folder") in message
