"""`vidtune plan`: the plan as a table (or one JSON object), and with a budget whether it fits and what would."""

from __future__ import annotations

import json
import shlex
import sys

from vidtune.config import Config
from vidtune.config_docs import NOT_SET
from vidtune.errors import ConfigError
from vidtune.memory.plan import GIB, MemoryPlan, plan_memory, traces_kept_on_disk
from vidtune.memory.suggest import HEADROOM_SHARE, HOST_RESERVE_GIB, fits, suggest, usable_gib

# Stands for the clips' folder in a printed command when the plan was made without one.
DATA_ROOT_PLACEHOLDER = "/path/to/your/clips"


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def table(plan: MemoryPlan) -> str:
    frames, height, width = plan.shape
    gpus = f", per GPU of {plan.world_size}" if plan.world_size > 1 else ""
    lines = [f"{plan.family} ({plan.architecture}), {frames}x{height}x{width}, on {plan.device}{gpus}", "",
             "training"]
    lines += [f"  {name:<22}{value / GIB:>9.2f} GiB" for name, value in plan.training.items()]
    lines += [f"  {'= training peak':<22}{plan.training_peak / GIB:>9.2f} GiB", "",
              "precompute (each stage alone on its device)"]
    lines += [f"  {name.removeprefix('precompute: '):<22}{value / GIB:>9.2f} GiB"
              for name, value in plan.precompute.items()]
    lines += ["", f"peak: {plan.peak / GIB:.2f} GiB", *plan.notes]
    if plan.host or plan.host_loading:
        lines += ["", "host memory (the memory savers' share)"]
        lines += [f"  {name:<22}{value / GIB:>9.2f} GiB" for name, value in plan.host.items()]
        if plan.host_loading:
            lines.append(f"  {'loading (a moment)':<22}{plan.host_loading / GIB:>9.2f} GiB")
    return "\n".join(lines)


def train_example(config: Config, path: str | None, overrides: list[str], added: list[str]) -> str:
    """"For example:" and the `vidtune train` command that runs the plan's config with `added`. A plan needs no
    data, training does: without data.root / data.datasets the command holds a placeholder the text points at."""
    words = ["vidtune", "train", *([path] if path else []), *overrides]
    note = ""
    if config.data.root == NOT_SET and not config.data.datasets:
        words.append(f"data.root={DATA_ROOT_PLACEHOLDER}")
        note = (f" (data.root is not set: replace {DATA_ROOT_PLACEHOLDER} with the folder holding your clips, "
                "videos.txt and prompts.txt)")
    return f"For example{note}:\n  {shlex.join([*words, *added])}"


def machine_memory_gib() -> float:
    """This machine's RAM."""
    import psutil

    return psutil.virtual_memory().total / GIB


def headroom_words() -> str:
    """Why a plan keeps part of the card free, in words."""
    return (f"{HEADROOM_SHARE:.0%} of the card, kept below it because the plan does not count the allocator's "
            "rounding, fragmentation or the CUDA context")


def run_plan(config: Config, path: str | None, overrides: list[str], gpu_memory: float | None, as_json: bool,
             gpus: int, host_memory: float | None = None) -> int:
    """Print the plan of `config` (read from `path` and `overrides`, which the example command repeats)."""
    if host_memory is not None and host_memory <= HOST_RESERVE_GIB:
        raise ConfigError(f"--host-memory {host_memory:g}: too little; the system itself takes about "
                          f"{HOST_RESERVE_GIB:g} GiB.\nWhat to do: give the host's RAM in GiB, e.g. --host-memory 64.")
    host = machine_memory_gib() if host_memory is None else host_memory
    # What each wait is doing, on stderr (stdout stays the table, or the JSON object).
    say(f"Tracing one training step of {config.model.name} on the meta device (no weights loaded) ...")
    with traces_kept_on_disk():  # the same question comes again while settings are chosen
        plan = plan_memory(config, gpus)
        fitting = gpu_memory is not None and fits(plan, gpu_memory, host)
        usable = usable_gib(gpu_memory) if gpu_memory is not None else None
        if gpu_memory is not None and not fitting:
            say(f"Peak {plan.peak / GIB:.2f} GiB (host memory {plan.host_peak / GIB:.2f} of {host:.1f} GiB) is over "
                f"{usable:.3g} GiB, the {HEADROOM_SHARE:.0%} of {gpu_memory:g} GiB a plan may fill: tracing "
                "combinations of memory savers for the fastest one that fits ...")
        suggestion = suggest(config, gpu_memory, gpus, host) if gpu_memory is not None and not fitting else None
        # Nothing fits this host: what a larger host would allow (the traces are at hand, so it costs little).
        larger_host = suggest(config, gpu_memory, gpus) if gpu_memory is not None and not fitting and \
            suggestion is None else None
    result = plan.to_json()
    frames, height, width = plan.shape
    size = f"at {frames}x{height}x{width} (frames x height x width)"
    if gpu_memory is not None:
        result["gpu_memory_gib"] = gpu_memory
        result["usable_gpu_memory_gib"] = round(usable, 3)  # what a plan may fill of the card: its headroom kept
        result["host_memory_gib"] = round(host, 3)
        result["fits"] = fitting
        result["suggested_overrides"] = suggestion.overrides if suggestion else []
        if suggestion:
            result["suggested_peak_gib"] = round(suggestion.plan.peak / GIB, 3)
            result["suggested_training_gib"] = suggestion.plan.to_json()["training_gib"]
            result["suggested_host_gib"] = round(suggestion.plan.host_peak / GIB, 3)
        elif not result["fits"]:
            result["suggestion"] = None
            if larger_host is not None:  # what the text says too: the settings a host with more RAM allows
                result["with_more_host_memory"] = {
                    "overrides": larger_host.overrides, "peak_gib": round(larger_host.plan.peak / GIB, 3),
                    "host_gib": round(larger_host.plan.host_peak / GIB, 3),
                    "host_gib_with_system": round(larger_host.plan.host_peak / GIB + HOST_RESERVE_GIB, 3)}
    if as_json:
        print(json.dumps(result))
        return 0
    print(table(plan))
    if gpu_memory is None:
        return 0
    if result["fits"]:
        print(f"\nFits in {gpu_memory:g} GiB {size}: peak {plan.peak / GIB:.2f} GiB, within the {usable:.1f} GiB a "
              f"plan may fill ({headroom_words()}; host memory: {plan.host_peak / GIB:.2f} of {host:.1f} GiB).")
    elif suggestion is not None:
        print(f"\nDoes not fit in {gpu_memory:g} GiB {size} with {host:.1f} GiB of host memory. It fits with these "
              "settings "
              f"(the fastest combination found; peak {suggestion.plan.peak / GIB:.2f} GiB, within the {usable:.1f} GiB "
              f"a plan may fill: {headroom_words()}; host memory "
              f"{suggestion.plan.host_peak / GIB:.2f} GiB):\n  {' '.join(suggestion.overrides)}\n"
              f"{train_example(config, path, overrides, suggestion.overrides)}")
    elif larger_host is not None:
        print(f"\nDoes not fit in {gpu_memory:g} GiB {size} with {host:.1f} GiB of host memory. With more host "
              f"memory it fits with these settings (peak {larger_host.plan.peak / GIB:.2f} GiB), which need "
              f"{larger_host.plan.host_peak / GIB:.2f} GiB of host memory (plus about {HOST_RESERVE_GIB:g} GiB for "
              f"the system):\n  {' '.join(larger_host.overrides)}\nWhat to do: train on a machine with more RAM "
              "(plan for it with --host-memory GIB), or at a smaller size (data.frames, data.height, data.width).")
    else:
        print(f"\nDoes not fit in {gpu_memory:g} GiB {size} with {host:.1f} GiB of host memory, even with every "
              "memory saver vidtune has.\nWhat to do: train at "
              "a smaller size (data.frames, data.height, data.width), with a smaller lora.rank, on a larger GPU, or "
              "on several (parallel.strategy=fsdp, then plan with --gpus N).")
    return 0
