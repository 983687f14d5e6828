"""Everything a short stay on a GPU machine can measure, in order of value, within a wall-clock budget.

Each finished row is written at once to gpu_results.json and gpu_results.md in `--out`, so a run cut short keeps
what it measured. Rows that cannot run on this device say why ("needs CUDA", "not installed: bitsandbytes");
a row that fails records the error and the run goes on. Sections, in order:

1. `env`: versions of torch, CUDA and every declared dependency, against pyproject.toml's minimums.
2. `tests`: every test marked `gpu`.
3. `lora`: per family, bf16 LoRA step time and peak memory (torch.cuda.max_memory_allocated) against
   `vidtune plan`'s prediction: the tiny model of each family, then real architectures with random weights
   (LTX-Video 2B, Wan 2.1 1.3B, CogVideoX 2b) at a stated clip shape.
4. `options`: on LTX-Video 2B, the step time and peak of fp8 / int8 / nf4 base weights, gradient checkpointing,
   activation offload, block swap, 8-bit and CPU-offloaded optimizers, each against plain bf16 LoRA.
5. `compile`: training.compile against eager.
6. `attention`: each attention backend that imports there.
7. `precompute`: clips per second of `precompute` (tiny LTX-Video; decoding and writing included).

    python bench/gpu/run.py --out results [--cpu] [--budget 480] [--only lora,options] [--families ltx-video,wan]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
sys.path[:0] = [str(HERE), str(ROOT / "bench")]
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from minimums import lower_bounds  # noqa: E402

SECTIONS = ("env", "tests", "lora", "options", "compile", "attention", "precompute", "context")
MIB = 1024**2
# Real architectures (random weights) and the clip shape each is measured at: frames, height, width.
REAL = [("ltx-video", "Lightricks/LTX-Video", "LTX-Video 2B", (49, 512, 768)),
        ("wan", "Wan-AI/Wan2.1-T2V-1.3B-Diffusers", "Wan 2.1 1.3B", (33, 480, 832)),
        ("cogvideox", "THUDM/CogVideoX-2b", "CogVideoX 2b", (49, 480, 720))]
BF16 = ["training.precision=bf16", "model.dtype=bfloat16", "lora.rank=32", "lora.alpha=32"]
# Memory options: (label, overrides, needs CUDA, the package it needs).
OPTIONS = [
    ("bf16 LoRA (baseline)", [], False, None),
    ("fp8 base weights", ["memory.base_weights=fp8"], False, None),
    ("int8 base weights", ["memory.base_weights=int8"], False, "torchao"),
    ("nf4 base weights", ["memory.base_weights=nf4"], True, "bitsandbytes"),
    ("gradient checkpointing", ["training.gradient_checkpointing=true"], False, None),
    ("activation offload", ["memory.activation_offload=true"], True, None),
    ("block swap (half the blocks) + checkpointing", ["memory.blocks_to_swap=HALF",
                                                      "training.gradient_checkpointing=true"], True, None),
    ("fp8 + checkpointing", ["memory.base_weights=fp8", "training.gradient_checkpointing=true"], False, None),
    ("adamw8bit (bitsandbytes)", ["optimizer.name=adamw8bit"], True, "bitsandbytes"),
    ("adamw8bit_ao (torchao)", ["optimizer.name=adamw8bit_ao"], True, "torchao"),
    ("CPU-offloaded optimizer", ["optimizer.cpu_offload=true"], True, "torchao"),
]


class Results:
    """The rows measured so far, rewritten to JSON and Markdown after each one."""

    def __init__(self, out: Path, device: str, budget: float) -> None:
        self.out, self.device, self.budget = out, device, budget
        self.started = time.perf_counter()
        self.rows: list[dict] = []
        out.mkdir(parents=True, exist_ok=True)

    def remaining(self) -> float:
        return self.budget - (time.perf_counter() - self.started)

    def add(self, section: str, name: str, status: str, **values: object) -> None:
        row = {"section": section, "name": name, "status": status, **values,
               "at_seconds": round(time.perf_counter() - self.started, 1)}
        self.rows.append(row)
        print(f"[{row['at_seconds']:6.1f} s] {section} | {name} | {status} | "
              f"{json.dumps(values, default=str)[:300]}", flush=True)
        self.write()

    def write(self) -> None:
        document = {"device": self.device, "budget_seconds": self.budget,
                    "elapsed_seconds": round(time.perf_counter() - self.started, 1), "rows": self.rows}
        (self.out / "gpu_results.json").write_text(json.dumps(document, indent=1, default=str) + "\n")
        (self.out / "gpu_results.md").write_text(markdown(document))


def _mib(value: object) -> str:
    return f"{value / MIB:,.1f}" if isinstance(value, int | float) else ""


def markdown(document: dict) -> str:
    lines = [f"GPU run on {document['device']}: {len(document['rows'])} rows in {document['elapsed_seconds']} s "
             f"(budget {document['budget_seconds']:.0f} s).", ""]
    section = None
    for row in document["rows"]:
        if row["section"] != section:
            section = row["section"]
            lines += ["", f"### {section}", "",
                      "| what | status | s/step | x baseline | peak MiB | x baseline | planned MiB | planned/peak "
                      "| note |",
                      "|---|---|---:|---:|---:|---:|---:|---:|---|"]
        step = row.get("seconds_per_step")
        peak, planned = row.get("peak_bytes"), row.get("planned_bytes")
        ratio = f"{planned / peak:.3f}" if isinstance(peak, int) and isinstance(planned, int) and peak else ""
        relative, memory = row.get("time_vs_baseline"), row.get("memory_vs_baseline")
        note = row.get("note") or row.get("error") or ""
        lines.append(f"| {row['name']} | {row['status']} | {f'{step:.3f}' if step else ''} | "
                     f"{f'{relative:.3f}' if relative else ''} | {_mib(peak)} | {f'{memory:.3f}' if memory else ''} | "
                     f"{_mib(planned)} | {ratio} | {str(note).replace('|', '/')[:200]} |")
    return "\n".join(lines) + "\n"


def installed(name: str) -> bool:
    try:
        metadata.version(name)
    except metadata.PackageNotFoundError:
        return False
    return True


def attempt(results: Results, section: str, name: str, estimate: float, measure: Callable[[], dict],
            needs_cuda: bool = False, package: str | None = None) -> dict | None:
    """One row: skipped with its reason, or measured (its values), or failed (the error, and the run goes on)."""
    import torch

    if needs_cuda and not torch.cuda.is_available():
        results.add(section, name, "needs CUDA")
        return None
    if package and not installed(package):
        results.add(section, name, f"not installed: {package}")
        return None
    if results.remaining() < estimate:
        results.add(section, name, "not reached (time)",
                    note=f"needs ~{estimate:.0f} s, {results.remaining():.0f} s left")
        return None
    started = time.perf_counter()
    try:
        values = measure()
    except Exception as error:  # recorded in the results; the next row still runs
        traceback.print_exc()
        results.add(section, name, "failed", error=f"{type(error).__name__}: {str(error).strip()[:300]}",
                    seconds=round(time.perf_counter() - started, 1))
        from steps import release_memory

        release_memory()
        return None
    results.add(section, name, "measured", **{**values, "seconds": round(time.perf_counter() - started, 1)})
    return values


# ----- sections -------------------------------------------------------------------------------------------
def section_env(results: Results) -> None:
    import torch

    cuda = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    results.add("env", "platform", "measured", python=platform.python_version(), torch=torch.__version__,
                cuda=torch.version.cuda, device_name=cuda, note=cuda or "no CUDA device: CUDA rows say so")
    for name, minimum in sorted(lower_bounds().items()):
        try:
            version = metadata.version(name)
        except metadata.PackageNotFoundError:
            results.add("env", name, "not installed", minimum=minimum)
            continue
        from packaging.version import Version

        ok = Version(version.split("+")[0]) >= Version(minimum)
        results.add("env", name, "measured" if ok else "below minimum", version=version, minimum=minimum,
                    note=f"{version} (minimum {minimum})")


TESTS_SHARE = 240.0  # seconds of the budget the `gpu` tests may take; the rest say so (rerun: --only tests)
OUTCOME = re.compile(r"^(?P<test>\S+::.+?) (?P<outcome>PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)(?: \((?P<why>.*)\))?"
                     r"\s*(?:\[\s*\d+%\])?$")
SUMMARY = re.compile(r"^(?P<outcome>FAILED|ERROR) (?P<test>\S+::\S+)(?: - (?P<message>.*))?$")


def section_tests(results: Results, cpu: bool) -> None:
    """Every test marked `gpu`, in one pytest process whose verbose lines become rows as they come: a run cut short
    by the time keeps the outcomes so far."""
    deadline = time.perf_counter() + min(TESTS_SHARE, results.remaining())
    command = [sys.executable, "-m", "pytest", "-v", "-rfEs", "-p", "no:cacheprovider", "-m", "gpu", "tests"]
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    started, tail, reasons = time.perf_counter(), [], set()
    process = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    timer = threading.Timer(max(1.0, deadline - time.perf_counter()), process.kill)
    timer.start()
    try:
        for line in process.stdout:
            line = line.rstrip()
            tail = [*tail[-20:], line]
            match = OUTCOME.match(line)
            if match:
                name, outcome = match["test"], match["outcome"]
                if outcome in ("PASSED", "XFAIL", "XPASS"):
                    counts["passed"] += 1
                    results.add("tests", name, "passed")
                elif outcome == "SKIPPED":
                    counts["skipped"] += 1
                    results.add("tests", name, "needs CUDA" if cpu else "skipped", note=match["why"] or "")
                else:
                    counts["failed"] += 1
                    results.add("tests", name, "failed")
                continue
            if line.startswith("SKIPPED ["):  # "SKIPPED [3] tests/x.py:12: needs a CUDA device"
                reasons.add(line.split(": ", 1)[-1])
                continue
            summary = SUMMARY.match(line)
            if summary:  # the failure's message, from the short summary at the end
                for row in reversed(results.rows):
                    if row["name"] == summary["test"] and row["status"] == "failed":
                        row["error"] = (summary["message"] or "")[:300]
                        break
                results.write()
        process.wait()
    finally:
        timer.cancel()
    cut = process.returncode < 0  # killed at the deadline
    status = "failed" if counts["failed"] or process.returncode not in (0, 5) else "passed"
    results.add("tests", "pytest -m gpu (all)", "not finished (time)" if cut else status, **counts,
                seconds=round(time.perf_counter() - started, 1),
                note="the rest: rerun with --only tests" if cut else (tail[-1] if tail else ""),
                skip_reasons=sorted(reasons))


class Models:
    """The tiny model folder of each family, written once."""

    def __init__(self, folder: Path) -> None:
        self.folder, self.written = folder, {}

    def tiny(self, family: str) -> Path:
        from vidtune.models.tiny import write_tiny_model

        if family not in self.written:
            self.written[family] = write_tiny_model(family, self.folder / family)
        return self.written[family]


def step_row(models: Models, family: str, shape: tuple, options: list[str], device: str,
             architecture: str | None, steps: int) -> Callable[[], dict]:
    def measure() -> dict:
        from steps import run_steps

        return run_steps(family, models.tiny(family), shape, options, device, architecture=architecture,
                         steps=steps).to_json()

    return measure


def section_lora(results: Results, models: Models, cpu: bool, device: str, families: list[str] | None) -> None:
    from vidtune.models.registry import available_models
    from vidtune.models.tiny import TINY_SHAPES

    precision = [] if cpu else BF16
    unknown = sorted(set(families or []) - set(available_models()))
    if unknown:
        raise SystemExit(f"--families: unknown {unknown}; choose from {', '.join(available_models())}")
    for family in families or available_models():
        shape = TINY_SHAPES[family]
        attempt(results, "lora", f"tiny {family} {'x'.join(map(str, shape))}", 20,
                step_row(models, family, shape, precision, device, None, 4))
    for family, hub_id, label, shape in REAL:
        attempt(results, "lora", f"{label} {'x'.join(map(str, shape))} rank 32", 90,
                step_row(models, family, shape, BF16, device, hub_id, 6), needs_cuda=True)


def _half_the_blocks(options: list[str], family: str, hub_id: str | None, tiny: Path) -> list[str]:
    if not any("HALF" in option for option in options):
        return options
    config_folder = tiny / "transformer" if hub_id is None else None
    if config_folder is None:
        from vidtune.memory.architectures import architecture_folder

        folder, _ = architecture_folder(hub_id, family)
        config_folder = Path(folder) / "transformer"
    layers = json.loads((config_folder / "config.json").read_text())["num_layers"]
    return [option.replace("HALF", str(max(1, layers // 2))) for option in options]


def section_options(results: Results, models: Models, cpu: bool, device: str) -> None:
    family, hub_id, label, shape = REAL[0]
    if cpu:  # the same rows on the tiny model (CUDA-only options say so)
        hub_id, label, shape = None, "tiny ltx-video", (9, 32, 32)
    base = [] if cpu else BF16
    baseline = None
    for name, options, needs_cuda, package in OPTIONS:
        def with_half(options: list[str] = options) -> dict:  # memory.blocks_to_swap=HALF: half the model's blocks
            resolved = _half_the_blocks(options, family, hub_id, models.tiny(family))
            return step_row(models, family, shape, [*base, *resolved], device, hub_id, 4 if cpu else 6)()

        values = attempt(results, "options", f"{label} {'x'.join(map(str, shape))}: {name}", 20 if cpu else 60,
                         with_half, needs_cuda=needs_cuda, package=package)
        if values and baseline is None and not options:
            baseline = values
        elif values and baseline:
            values_note = {"time_vs_baseline": values["seconds_per_step"] / baseline["seconds_per_step"]}
            if values.get("peak_bytes") and baseline.get("peak_bytes"):
                values_note["memory_vs_baseline"] = values["peak_bytes"] / baseline["peak_bytes"]
            results.rows[-1].update(values_note)
            results.write()


def section_compile(results: Results, models: Models, cpu: bool, device: str) -> None:
    family, hub_id, label, shape = REAL[0]
    if cpu:
        hub_id, label, shape = None, "tiny ltx-video", (9, 32, 32)
    base = [] if cpu else BF16
    eager = attempt(results, "compile", f"{label}: eager", 20 if cpu else 60,
                    step_row(models, family, shape, base, device, hub_id, 6))
    compiled = attempt(results, "compile", f"{label}: training.compile=true", 120 if cpu else 150,
                       step_row(models, family, shape, [*base, "training.compile=true"], device, hub_id, 8))
    if eager and compiled:
        results.rows[-1]["time_vs_baseline"] = compiled["seconds_per_step"] / eager["seconds_per_step"]
        results.write()


def section_attention(results: Results, models: Models, cpu: bool, device: str) -> None:
    import torch

    from vidtune.attention import CPU_BACKENDS, available_backend_names, resolve_attention_backend
    from vidtune.errors import ConfigError

    family, hub_id, label, shape = REAL[0]
    if cpu:
        hub_id, label, shape = None, "tiny ltx-video", (9, 32, 32)
    base = [] if cpu else BF16
    for name in available_backend_names():
        if cpu and name not in CPU_BACKENDS:
            results.add("attention", name, "needs CUDA")
            continue
        try:
            resolve_attention_backend(name, torch.device(device))
        except ConfigError as error:
            results.add("attention", name, "unavailable", note=str(error).splitlines()[0][:200])
            continue
        attempt(results, "attention", f"{label}: {name}", 20 if cpu else 45,
                step_row(models, family, shape, [*base, f"model.attention_backend={name}"], device, hub_id, 5))


def section_context(results: Results, cpu: bool, device: str) -> None:
    """bench/context.py on two GPUs (NCCL, bf16): one process against Ulysses 2 and ring 2 on the tiny LTX-Video, the
    tokens per rank, seconds per step and bytes per step of each; a machine with one GPU says so."""
    import torch

    if not cpu and torch.cuda.device_count() < 2:
        results.add("context", "ulysses 2, ring 2 (tiny ltx-video)", "needs 2 GPUs",
                    note=f"{torch.cuda.device_count()} CUDA device(s) here")
        return
    from context import measure  # bench/context.py (bench/ is on the path)

    def run() -> dict:
        measured = measure(4, 17 if cpu else 33, 64 if cpu else 256, device)
        base = measured["one process"]["seconds_per_step"]
        return {name: {**values, "time_vs_one_process": round(values["seconds_per_step"] / base, 3)}
                for name, values in measured.items()}

    attempt(results, "context", "ulysses 2, ring 2 (tiny ltx-video)", 120 if cpu else 90, run)


def section_precompute(results: Results, models: Models, device: str) -> None:
    def measure() -> dict:
        import precompute as bench_precompute

        from vidtune.data.synthetic import render_shapes_dataset
        from vidtune.models.tiny import write_tiny_ltx_video

        clips, frames, size = 16, 17, 96
        with tempfile.TemporaryDirectory() as folder:
            work = Path(folder)
            model = write_tiny_ltx_video(work / "model")
            root = render_shapes_dataset(work / "data", num_clips=clips, num_frames=frames, height=size, width=size)
            settings = argparse.Namespace(frames=frames, size=size, steps=1, batch_size=4)
            config = bench_precompute.make_config(model, root, work, "gpu", settings,
                                                  training={"device": device})
            seconds = bench_precompute.timed_precompute(config)
        return {"clips_per_second": round(clips / seconds, 2), "precompute_seconds": round(seconds, 2),
                "note": f"{clips} clips of {frames}x{size}x{size}, tiny LTX-Video, {clips / seconds:.1f} clips/s"}

    attempt(results, "precompute", "precompute clips/s", 40, measure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--cpu", action="store_true", help="a rehearsal without CUDA: CUDA-only rows say so")
    parser.add_argument("--budget", type=float, default=480.0, help="wall-clock seconds for the whole run")
    parser.add_argument("--only", help=f"comma-separated sections of {', '.join(SECTIONS)}")
    parser.add_argument("--families", help="comma-separated families of the tiny `lora` rows (default: all)")
    args = parser.parse_args(argv)
    only = args.only.split(",") if args.only else list(SECTIONS)
    unknown = sorted(set(only) - set(SECTIONS))
    if unknown:
        parser.error(f"--only: unknown section(s) {unknown}; choose from {', '.join(SECTIONS)}")
    import torch

    if not args.cpu and not torch.cuda.is_available():
        raise SystemExit("run.py: no CUDA device here; for a rehearsal on the CPU, pass --cpu")
    device = "cpu" if args.cpu else "cuda"
    name = "CPU (rehearsal)" if args.cpu else torch.cuda.get_device_name(0)
    results = Results(args.out, name, args.budget)
    with tempfile.TemporaryDirectory(prefix="vidtune-gpu-run-") as folder:
        models = Models(Path(folder))
        for section in SECTIONS:
            if section not in only:
                continue
            if section == "env":
                section_env(results)
            elif section == "tests":
                section_tests(results, args.cpu)
            elif section == "lora":
                section_lora(results, models, args.cpu, device,
                             args.families.split(",") if args.families else None)
            elif section == "options":
                section_options(results, models, args.cpu, device)
            elif section == "compile":
                section_compile(results, models, args.cpu, device)
            elif section == "attention":
                section_attention(results, models, args.cpu, device)
            elif section == "precompute":
                section_precompute(results, models, device)
            elif section == "context":
                section_context(results, args.cpu, device)
    failed = [row for row in results.rows if row["status"] in ("failed", "below minimum", "not installed")]
    results.write()
    print(f"{len(results.rows)} rows, {len(failed)} failed, in {time.perf_counter() - results.started:.0f} s; "
          f"results in {args.out}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
