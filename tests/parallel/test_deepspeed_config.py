"""The DeepSpeed config vidtune derives from its own, a user JSON on top, and the settings refused before any work."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from vidtune.config import build_config
from vidtune.errors import ConfigError, TrainingError
from vidtune.parallel.deepspeed import check_resumable, deepspeed_config
from vidtune.parallel.zero_reshard import to_universal


def _config(tmp_path: Path, override: dict | str | None = None, **sections) -> object:
    parallel = {"strategy": "deepspeed", **sections.pop("parallel", {})}
    if override is not None:
        path = tmp_path / "ds.json"
        path.write_text(override if isinstance(override, str) else json.dumps(override))
        parallel["deepspeed_config"] = str(path)
    return build_config({
        "model": {"name": "ltx-video", "pretrained": str(tmp_path)},
        "data": {"root": str(tmp_path), "frames": 9, "height": 32, "width": 32},
        "training": {"batch_size": 2, "gradient_accumulation": 3, "max_grad_norm": 0.5,
                     **sections.pop("training", {})},
        "parallel": parallel,
        **sections,
    })


def test_derived_from_the_training_settings(tmp_path):
    derived = deepspeed_config(_config(tmp_path, parallel={"zero_stage": 3}), world=4)
    assert derived["train_micro_batch_size_per_gpu"] == 2
    assert derived["gradient_accumulation_steps"] == 3
    assert derived["train_batch_size"] == 2 * 3 * 4
    assert derived["gradient_clipping"] == 0.5
    assert derived["zero_optimization"] == {"stage": 3}
    assert derived["zero_allow_untested_optimizer"] is True
    assert "bf16" not in derived and "fp16" not in derived  # float32 weights, autocast forward


@pytest.mark.parametrize(("offload", "stage", "expected"), [
    ("none", 2, set()),
    ("optimizer", 2, {"offload_optimizer"}),
    ("all", 3, {"offload_optimizer", "offload_param"}),
])
def test_offload(tmp_path, offload, stage, expected):
    zero = deepspeed_config(_config(tmp_path, parallel={"zero_stage": stage, "offload": offload}), world=2)
    assert {key for key in zero["zero_optimization"] if key.startswith("offload")} == expected
    assert all(zero["zero_optimization"][key]["device"] == "cpu" for key in expected)


def test_a_json_file_overrides_keys_nested_ones_merged(tmp_path):
    override = {"zero_optimization": {"overlap_comm": True, "reduce_bucket_size": 1000}, "gradient_clipping": 2.0}
    merged = deepspeed_config(_config(tmp_path, override, parallel={"zero_stage": 2}), world=2)
    assert merged["zero_optimization"] == {"stage": 2, "overlap_comm": True, "reduce_bucket_size": 1000}
    assert merged["gradient_clipping"] == 2.0
    # Keys the loop relies on may be repeated when they agree.
    same = deepspeed_config(_config(tmp_path, {"train_batch_size": 12}), world=2)
    assert same["train_batch_size"] == 12


@pytest.mark.parametrize(("override", "sections", "words"), [
    ({"train_micro_batch_size_per_gpu": 4}, {}, ["train_micro_batch_size_per_gpu=4", "takes 2",
                                                "training.batch_size=2", "What to do: remove"]),
    ({"bf16": {"enabled": True}}, {}, ["enables bf16", "training.precision=bf16"]),
    ("{ not json", {}, ["parallel.deepspeed_config=", "line 1, column 3", "What to do: fix the JSON"]),
    ("[1, 2]", {}, ["a JSON list, not an object"]),
    (None, {"parallel": {"zero_stage": 2, "offload": "all"}}, ["parallel.offload=all", "parallel.zero_stage=2",
                                                               "What to do: set parallel.zero_stage=3"]),
    (None, {"parallel": {"zero_stage": 3}, "training": {"ema_decay": 0.99}}, ["training.ema_decay", "stage 3"]),
    (None, {"optimizer": {"cpu_offload": True}}, ["optimizer.cpu_offload", "parallel.offload=optimizer"]),
])
def test_refused_with_the_key_named(tmp_path, override, sections, words):
    with pytest.raises(ConfigError) as raised:
        deepspeed_config(_config(tmp_path, override, **sections), world=2)
    message = str(raised.value)
    assert all(word in message for word in words), message
    assert "What to do:" in message


def test_a_missing_json_file_is_named(tmp_path):
    config = _config(tmp_path, parallel={"deepspeed_config": str(tmp_path / "absent.json")})
    with pytest.raises(ConfigError, match=r"parallel.deepspeed_config=.*absent.json: cannot read it"):
        deepspeed_config(config, world=1)


def test_a_checkpoint_of_another_strategy_is_refused(tmp_path):
    with pytest.raises(TrainingError, match=r"has no DeepSpeed state \(zero/\).*What to do: resume it with that"):
        check_resumable(tmp_path)
    (tmp_path / "zero").mkdir()
    check_resumable(tmp_path)  # any number of processes: another one re-cuts the shards (test_deepspeed.py)


def test_shards_that_cannot_be_converted_for_another_number_of_processes_are_named(tmp_path, monkeypatch):
    monkeypatch.setenv("DS_ACCELERATOR", "cpu")
    (tmp_path / "state").mkdir()
    message = r"(?s)Could not convert the DeepSpeed checkpoint .*state for another number of processes: " \
              r"FileNotFoundError.*What to do: resume it on as many"
    with pytest.raises(TrainingError, match=message):
        to_universal(tmp_path / "state", tmp_path / "universal")
