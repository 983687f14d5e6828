"""Print pyproject.toml's declared lower bounds as exact pins (`name==X`), one a line, for pip.

Installing these proves the declared minimums: CI builds an environment from them and runs tests in it.

    python bench/gpu/minimums.py                              # dependencies and every optional feature
    python bench/gpu/minimums.py --only-in bench/gpu/image_packages.txt   # what the GPU machine's image has
    python bench/gpu/minimums.py --not-in bench/gpu/image_packages.txt    # what must be carried there
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# Extras left out by default: test tooling, and experiment trackers that the GPU run does not use.
SKIPPED_EXTRAS = ("test", "wandb", "cosmos")


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def lower_bounds(extras: list[str] | None = None) -> dict[str, str]:
    """name -> the version after `>=` for each dependency and each chosen extra's packages."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    optional = project["optional-dependencies"]
    chosen = [name for name in optional if name not in SKIPPED_EXTRAS] if extras is None else extras
    unknown = [name for name in chosen if name not in optional]
    if unknown:
        raise SystemExit(f"pyproject.toml has no extra named {unknown}; it has {sorted(optional)}")
    bounds = {}
    for spec in [*project["dependencies"], *(spec for name in chosen for spec in optional[name])]:
        match = re.fullmatch(r"([A-Za-z0-9_.\-]+)\s*>=\s*([0-9][0-9A-Za-z.]*)", spec.strip())
        if not match:
            raise SystemExit(f"pyproject.toml: {spec!r} has no plain '>=' lower bound; give it one")
        bounds[normalise(match[1])] = match[2]
    return bounds


def listed(path: Path) -> set[str]:
    lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    return {normalise(line) for line in lines if line}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--extras", help="comma-separated extras to include (default: all but test and wandb)")
    parser.add_argument("--only-in", type=Path, help="keep only packages listed in this file")
    parser.add_argument("--not-in", type=Path, help="leave out packages listed in this file")
    args = parser.parse_args(argv)
    bounds = lower_bounds(args.extras.split(",") if args.extras else None)
    if args.only_in:
        bounds = {name: version for name, version in bounds.items() if name in listed(args.only_in)}
    if args.not_in:
        bounds = {name: version for name, version in bounds.items() if name not in listed(args.not_in)}
    sys.stdout.write("".join(f"{name}=={version}\n" for name, version in sorted(bounds.items())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
