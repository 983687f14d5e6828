"""Commands import what they need when they need it: help, `config show`, a refused config and a model folder that
is not there answer without torch, transformers or diffusers (seconds of imports). Checked in a fresh interpreter, by
what it imported."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import yaml

HEAVY = ("torch", "transformers", "diffusers", "peft", "av")


def test_help_config_show_and_early_errors_import_no_heavy_library(tmp_path):
    config = tmp_path / "my.yaml"
    config.write_text(yaml.safe_dump({"model": {"name": "ltx-video", "pretrained": str(tmp_path / "model")},
                                      "data": {"root": str(tmp_path)}, "output_dir": str(tmp_path / "run")}))
    typo = [str(config), "training.stepz=10"]
    runs = [["--help"], ["train", "--help"], ["config", "show"], ["config", "show", str(config), "lora.rank=8"],
            ["train", *typo], ["data", "check", *typo], ["precompute", *typo], ["cache", "info", *typo],
            ["plan", *typo], ["plan", "model.name=nonexistent", "model.pretrained=x"],
            ["train", str(config)], ["data", "check", str(config)],  # a model folder that does not exist
            ["sample", str(tmp_path / "no-run"), "--prompt", "x"],  # a run or checkpoint that is not there
            ["export", str(tmp_path / "no-run"), "--output", str(tmp_path / "out")]]
    script = textwrap.dedent(f"""
        import contextlib, io, json, sys
        from vidtune.cli import main
        found = []
        for argv in {runs!r}:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                try:
                    code = main(argv)
                except SystemExit as exit:  # --help
                    code = exit.code
            found.append([argv, code, [name for name in {HEAVY!r} if name in sys.modules]])
        print(json.dumps(found))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    found = json.loads(result.stdout.splitlines()[-1])
    assert [code for _, code, _ in found] == [0, 0, 0, 0, 2, 2, 2, 2, 2, 2, 2, 2, 2, 2]
    for argv, _, heavy in found:
        assert heavy == [], f"vidtune {' '.join(argv)} imported {heavy}"
