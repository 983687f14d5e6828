"""Download wheels for another Python and platform, and then every dependency of theirs that the image lacks.

pip's resolver cannot be told that a package is present in another environment (it would resolve torch and its
CUDA libraries again), so dependencies are followed here: each wheel's Requires-Dist (markers evaluated for the
target Python on Linux x86_64), less what the image has, downloaded with `pip download --no-deps`, until nothing
is missing. Versions: the pins given, else pip's choice within the requirement and the constraints.

    python bench/gpu/download.py DEST --python-version 3.12 --image bench/gpu/image_packages.txt \
        -r wanted.txt -c constraints.txt
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import zipfile
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement

sys.path.insert(0, str(Path(__file__).resolve().parent))

from minimums import listed, normalise

PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_18_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"]


def target_environment(python_version: str) -> dict[str, str]:
    environment = default_environment()
    environment.update({"python_version": python_version, "python_full_version": f"{python_version}.0",
                        "sys_platform": "linux", "platform_system": "Linux", "platform_machine": "x86_64",
                        "os_name": "posix", "implementation_name": "cpython",
                        "platform_python_implementation": "CPython"})
    return environment


def wheel_requirements(path: Path, environment: dict[str, str]) -> list[Requirement]:
    with zipfile.ZipFile(path) as wheel:
        metadata = next(name for name in wheel.namelist() if name.endswith(".dist-info/METADATA"))
        lines = wheel.read(metadata).decode().splitlines()
    found = []
    for line in lines:
        if line.startswith("Requires-Dist:"):
            requirement = Requirement(line.split(":", 1)[1].strip())
            if requirement.marker is None or requirement.marker.evaluate({**environment, "extra": ""}):
                found.append(requirement)
    return found


def download(specs: list[str], dest: Path, python_version: str, constraints: Path | None) -> None:
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary=:all:",
               "--python-version", python_version, "--implementation", "cp", "-d", str(dest)]
    command += [part for platform in PLATFORMS for part in ("--platform", platform)]
    if constraints:
        command += ["-c", str(constraints)]
    subprocess.run([*command, *specs], check=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dest", type=Path)
    parser.add_argument("--python-version", required=True)
    parser.add_argument("--image", type=Path, required=True, help="the packages the image has (not downloaded)")
    parser.add_argument("-r", "--requirements", type=Path, required=True)
    parser.add_argument("-c", "--constraints", type=Path)
    parser.add_argument("--image-needs", type=Path,
                        help="write here what the downloaded wheels need from the image (one requirement a line)")
    args = parser.parse_args(argv)
    args.dest.mkdir(parents=True, exist_ok=True)
    image = listed(args.image)
    environment = target_environment(args.python_version)
    specs = [line.strip() for line in args.requirements.read_text().splitlines() if line.strip()]
    while specs:
        download(specs, args.dest, args.python_version, args.constraints)
        have = {normalise(path.name.split("-")[0]): path for path in args.dest.glob("*.whl")}
        wanted, from_image = {}, set()
        for path in have.values():
            for requirement in wheel_requirements(path, environment):
                name = normalise(requirement.name)
                if name in image:
                    from_image.add(name)
                elif name not in have:
                    wanted[name] = f"{name}{requirement.specifier}"
        specs = sorted(wanted.values())
    if args.image_needs:
        args.image_needs.write_text("".join(f"{name}\n" for name in sorted(from_image)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
