"""`vidtune plan --gpu-memory`'s "For example" command: pasted as printed, it trains the planned config."""

from __future__ import annotations

import json
import shlex

from vidtune.cli import _load, main
from vidtune.memory.report import DATA_ROOT_PLACEHOLDER
from vidtune.models.tiny import TINY_SHAPES


def _example(capsys, words: list[str]) -> list[str]:
    assert main([*words, "--json"]) == 0
    peak = json.loads(capsys.readouterr().out.splitlines()[-1])["peak_gib"]
    assert main([*words, "--gpu-memory", str(0.9 * peak)]) == 0
    lines = capsys.readouterr().out.splitlines()
    at = next(number for number, line in enumerate(lines) if line.startswith("For example"))
    command = shlex.split(lines[at + 1])
    assert command[:2] == ["vidtune", "train"]
    return [lines[at], *command[2:]]


def test_the_example_of_a_plan_without_data_says_what_to_add_and_then_loads(tiny_model_dir, shapes_dataset, capsys):
    frames, height, width = TINY_SHAPES["ltx-video"]
    words = ["plan", "model.name=ltx-video", f"model.pretrained={tiny_model_dir('ltx-video')}",
             f"data.frames={frames}", f"data.height={height}", f"data.width={width}", "training.device=cpu",
             "training.algorithm=full"]
    heading, *arguments = _example(capsys, words)
    assert f"data.root is not set: replace {DATA_ROOT_PLACEHOLDER} with the folder holding your clips" in heading
    assert f"data.root={DATA_ROOT_PLACEHOLDER}" in arguments
    # With the placeholder replaced, the pasted command's config is valid and holds the suggested settings.
    pasted = [f"data.root={shapes_dataset}" if item == f"data.root={DATA_ROOT_PLACEHOLDER}" else item
              for item in arguments]
    config = _load(pasted)
    assert config.data.root == str(shapes_dataset) and config.data.width == width

    # With data.root given, the example is the command as it is.
    heading, *arguments = _example(capsys, [*words, f"data.root={shapes_dataset}"])
    assert heading == "For example:" and DATA_ROOT_PLACEHOLDER not in " ".join(arguments)
    assert _load(arguments).data.root == str(shapes_dataset)


def test_a_missing_data_root_is_not_blamed_on_a_data_key_that_was_set(capsys):
    assert main(["train", "model.name=ltx-video", "model.pretrained=some/model", "data.width=832"]) == 2
    error = capsys.readouterr().err
    assert "data: set data.root (a folder with videos.txt and prompts.txt) or data.datasets" in error
    assert "data.width=832" not in error and "Value error" not in error and "got {" not in error
