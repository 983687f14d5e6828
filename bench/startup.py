"""How long each `vidtune` command takes to start: the seconds until it answers (help, `config show`, and the
error exits a mistyped config or a missing folder gives), as a ratio to `python -c "import vidtune"` measured in
the same run. A command that imports only what it needs before answering stays near 1x; one that imports torch,
transformers and diffusers first is many times slower.

Each command runs `--repeats` times in a fresh interpreter (`python -m vidtune ...`, the worktree's code), in
turns with the baseline so that a busy machine slows both alike; the median is reported, with the exit code.

    python bench/startup.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
BASELINE = ("python -c 'import vidtune'", [sys.executable, "-c", "import vidtune"])


def commands(work: Path) -> list[tuple[str, list[str]]]:
    """(label, argv after `python -m vidtune`) of each command, with a config and folders under `work`."""
    config = work / "my.yaml"
    config.write_text(yaml.safe_dump({"model": {"name": "ltx-video", "pretrained": str(work / "no-model")},
                                      "data": {"root": str(work)}, "output_dir": str(work / "run")}))
    typo = [str(config), "training.stepz=10"]  # an unknown key: the config is refused before anything starts
    return [
        ("vidtune --help", ["--help"]),
        ("vidtune train --help", ["train", "--help"]),
        ("vidtune config show", ["config", "show"]),
        ("vidtune config show my.yaml", ["config", "show", str(config)]),
        ("vidtune train (unknown key)", ["train", *typo]),
        ("vidtune data check (unknown key)", ["data", "check", *typo]),
        ("vidtune precompute (unknown key)", ["precompute", *typo]),
        ("vidtune cache info (unknown key)", ["cache", "info", *typo]),
        ("vidtune plan (unknown key)", ["plan", *typo]),
        ("vidtune train (no model folder)", ["train", str(config)]),
        ("vidtune sample (no run folder)", ["sample", str(work / "no-run"), "--prompt", "x"]),
        ("vidtune export (no checkpoint)", ["export", str(work / "no-run"), "--output", str(work / "out")]),
    ]


def seconds(argv: list[str], env: dict[str, str]) -> tuple[float, int]:
    started = time.perf_counter()
    result = subprocess.run(argv, capture_output=True, env=env, cwd=ROOT, timeout=600)
    return time.perf_counter() - started, result.returncode


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    with tempfile.TemporaryDirectory() as folder:
        runs = [(label, [sys.executable, "-m", "vidtune", *argv]) for label, argv in commands(Path(folder))]
        seconds(BASELINE[1], env)  # warm the file cache once
        baseline: list[float] = []
        timings: dict[str, list[float]] = {label: [] for label, _ in runs}
        codes: dict[str, int] = {}
        for _ in range(args.repeats):
            for label, argv in runs:
                baseline.append(seconds(BASELINE[1], env)[0])
                took, codes[label] = seconds(argv, env)
                timings[label].append(took)
    base = statistics.median(baseline)
    print(f"baseline {BASELINE[0]}: {base:.3f} s (median of {len(baseline)})")
    print(f"{'command':<36}{'exit':>5}{'median s':>10}{'x baseline':>12}")
    for label, values in timings.items():
        median = statistics.median(values)
        print(f"{label:<36}{codes[label]:>5}{median:>10.3f}{median / base:>12.1f}")


if __name__ == "__main__":
    main()
