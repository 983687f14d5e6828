"""Split downloaded wheels into carries: folders that each travel with one call to the GPU machine, beside the
working tree, within `--limit-mib` in all. Prints each call's carry path and command, fewest calls first.

Every call needs the wheels that vidtune imports at all (the dependencies and what they need: diffusers,
pydantic, av, ...); the optional features' wheels go, in order of what they let the run measure, into the first
call with room, each with what it needs. bitsandbytes ships a library for every CUDA and ROCm release (about
120 MB unpacked): only the one for the machine's CUDA (`--cuda`, torch's `torch.version.cuda` there) and the CPU
one are kept, so it fits beside the rest.

    python bench/gpu/carries.py .gpu-wheels/cp312/all [--limit-mib 60] [--cuda 130]
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from minimums import ROOT, lower_bounds, normalise

MIB = 1024**2
# Optional features in the order of what they let the GPU run measure, with the run.py sections they serve.
FEATURES = {
    "torchao": "options",  # int8 base weights, torchao optimizers, the CPU-offloaded optimizer
    "bitsandbytes": "options",  # nf4 base weights, 8-bit optimizers
    "prodigyopt": "options",
    "pytorch-optimizer": "options",
    "deepspeed": "tests",
    "fastapi": "tests",  # `vidtune studio` (its job queue is among the minimum-version tests)
    "uvicorn": "tests",
}


def wheel_name(path: Path) -> str:
    return normalise(path.name.split("-")[0])


def requirements(path: Path) -> set[str]:
    """The names a wheel requires (not those of its extras)."""
    with zipfile.ZipFile(path) as wheel:
        metadata = next(name for name in wheel.namelist() if name.endswith(".dist-info/METADATA"))
        lines = wheel.read(metadata).decode().splitlines()
    names = set()
    for line in lines:
        if line.startswith("Requires-Dist:") and "extra ==" not in line:
            names.add(normalise(re.match(r"[A-Za-z0-9_.\-]+", line.split(":", 1)[1].strip()).group()))
    return names


def closure(roots: set[str], wheels: dict[str, Path]) -> set[str]:
    """`roots` and every downloaded wheel they need, transitively (what the image has is not downloaded)."""
    found, todo = set(), [name for name in roots if name in wheels]
    while todo:
        name = todo.pop()
        if name not in found:
            found.add(name)
            todo.extend(need for need in requirements(wheels[name]) if need in wheels and need not in found)
    return found


def slim_bitsandbytes(path: Path, cuda: str, folder: Path) -> Path:
    """A copy of the bitsandbytes wheel with only the CPU library and the one for CUDA `cuda` (and RECORD to
    match): the same package for that machine."""
    keep = re.compile(rf"libbitsandbytes_(cpu|cuda{cuda})\.")
    target = folder / path.name
    with zipfile.ZipFile(path) as source, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as slim:
        names = [name for name in source.namelist()
                 if not re.search(r"libbitsandbytes_\w+\.(so|dylib|dll)$", name) or keep.search(name)]
        if not any(keep.search(name) and "cpu" not in name for name in names):
            raise SystemExit(f"{path.name} has no library for CUDA {cuda}; choose another --cuda")
        for name in names:
            data = source.read(name)
            if name.endswith(".dist-info/RECORD"):
                data = "".join(line + "\n" for line in data.decode().splitlines()
                               if line.split(",")[0] in names).encode()
            slim.writestr(source.getinfo(name), data)
    return target


def tree_bytes() -> int:
    """What travels with every call: tracked files and untracked ones git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                            capture_output=True).stdout.decode().split("\0")
    return sum((ROOT / name).stat().st_size for name in listed if name and (ROOT / name).is_file())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("wheels", type=Path, help="the folder prepare.sh downloaded into")
    parser.add_argument("--limit-mib", type=float, default=60.0)
    parser.add_argument("--cuda", default="130", help="the CUDA release of torch there, digits only (13.0 -> 130)")
    args = parser.parse_args(argv)
    base = args.wheels.parent
    for old in base.glob("call*"):
        shutil.rmtree(old)
    slimmed = base / "slim"
    shutil.rmtree(slimmed, ignore_errors=True)
    slimmed.mkdir()
    wheels = {wheel_name(path): path for path in sorted(args.wheels.glob("*.whl"))}
    if "bitsandbytes" in wheels:
        wheels["bitsandbytes"] = slim_bitsandbytes(wheels["bitsandbytes"], args.cuda, slimmed)
    size = {name: path.stat().st_size for name, path in wheels.items()}

    core = closure(set(lower_bounds(extras=[])), wheels)
    groups = [(feature, closure({feature}, wheels) - core) for feature in FEATURES if feature in wheels]
    placed = core | {name for _, names in groups for name in names}
    leftover = set(wheels) - placed
    if leftover:
        raise SystemExit(f"downloaded but needed by nothing vidtune declares: {sorted(leftover)}")
    tree = tree_bytes()
    room = args.limit_mib * MIB - tree
    core_bytes = sum(size[name] for name in core)
    if core_bytes > room:
        raise SystemExit(f"the wheels every call needs ({core_bytes / MIB:.1f} MiB) and the working tree "
                         f"({tree / MIB:.1f} MiB) exceed {args.limit_mib:g} MiB")

    calls: list[tuple[set[str], list[str]]] = []
    for feature, names in groups:
        extra = sum(size[name] for name in names)
        if core_bytes + extra > room:
            raise SystemExit(f"{feature} ({extra / MIB:.1f} MiB) does not fit beside the core wheels in one call")
        call = next((c for c in calls if core_bytes + sum(size[n] for n in c[0]) + extra <= room), None)
        if call is None:
            call = (set(), [])
            calls.append(call)
        call[0].update(names)
        call[1].append(feature)
    calls = calls or [(set(), [])]

    print(f"Working tree: {tree / MIB:.1f} MiB; limit per call {args.limit_mib:g} MiB (64 MiB in all is the most one "
          "call can take).")
    for index, (names, features) in enumerate(calls, 1):
        folder = base / f"call{index}"
        folder.mkdir()
        for name in sorted(core | names):
            shutil.copy2(wheels[name], folder / wheels[name].name)
        carried = sum(size[name] for name in core | names)
        relative = folder.resolve().relative_to(ROOT)
        only = ""
        if index > 1:  # later calls measure only what their features add
            only = " --only " + ",".join(sorted({FEATURES[feature] for feature in features}))
        print(f"\nCall {index}: {carried / MIB:.1f} MiB of wheels + {tree / MIB:.1f} MiB tree = "
              f"{(carried + tree) / MIB:.1f} MiB; features: {', '.join(features) or 'none'}")
        print(f"  carry: [\"{relative}\"]")
        print(f"  command: bash bench/gpu/run.sh --wheels {relative}{only}")
        for name in sorted(core | names):
            print(f"    {wheels[name].name}  {size[name] / MIB:.1f} MiB")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
