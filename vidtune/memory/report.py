"""`vidtune plan`: the plan as a table (or one JSON object), and with a budget whether it fits and what would."""

from __future__ import annotations

import json
import shlex

from vidtune.config import Config, load_config
from vidtune.errors import ConfigError
from vidtune.memory.plan import GIB, MemoryPlan, plan_memory, traces_kept_on_disk
from vidtune.memory.suggest import HOST_RESERVE_GIB, fits, suggest

UNSET = "(unset)"


def load_plan_config(path: str | None, overrides: list[str]) -> Config:
    """A config as `vidtune train` reads it; the dataset is not needed for a plan (data.root may stay unset)."""
    if path is None and not overrides:
        raise ConfigError("No config given: vidtune plan needs a config file and/or section.key=value settings.\n"
                          "What to do: run e.g. vidtune plan my.yaml, or vidtune plan model.name=ltx-video "
                          "model.pretrained=Lightricks/LTX-Video.")
    config = load_config(path, overrides, required_placeholder=UNSET)
    for key, value in (("model.name", config.model.name), ("model.pretrained", config.model.pretrained)):
        if value == UNSET:
            raise ConfigError(f"{key}: required, but not set.\nWhat to do: set it in the config file or as "
                              f"{key}=... on the command line.")
    from vidtune.models.registry import get_spec_class

    get_spec_class(config.model.name)  # an unknown family named plainly
    return config


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


def machine_memory_gib() -> float:
    """This machine's RAM."""
    import psutil

    return psutil.virtual_memory().total / GIB


def run_plan(path: str | None, overrides: list[str], gpu_memory: float | None, as_json: bool, gpus: int,
             host_memory: float | None = None) -> int:
    config = load_plan_config(path, overrides)
    if host_memory is not None and host_memory <= HOST_RESERVE_GIB:
        raise ConfigError(f"--host-memory {host_memory:g}: too little; the system itself takes about "
                          f"{HOST_RESERVE_GIB:g} GiB.\nWhat to do: give the host's RAM in GiB, e.g. --host-memory 64.")
    host = machine_memory_gib() if host_memory is None else host_memory
    with traces_kept_on_disk():  # the same question comes again while settings are chosen
        plan = plan_memory(config, gpus)
        fitting = gpu_memory is not None and fits(plan, gpu_memory, host)
        suggestion = suggest(config, gpu_memory, gpus, host) if gpu_memory is not None and not fitting else None
        # Nothing fits this host: what a larger host would allow (the traces are at hand, so it costs little).
        larger_host = suggest(config, gpu_memory, gpus) if gpu_memory is not None and not fitting and \
            suggestion is None else None
    result = plan.to_json()
    if gpu_memory is not None:
        result["gpu_memory_gib"] = gpu_memory
        result["host_memory_gib"] = round(host, 3)
        result["fits"] = fitting
        result["suggested_overrides"] = suggestion.overrides if suggestion else []
        if suggestion:
            result["suggested_peak_gib"] = round(suggestion.plan.peak / GIB, 3)
            result["suggested_training_gib"] = suggestion.plan.to_json()["training_gib"]
            result["suggested_host_gib"] = round(suggestion.plan.host_peak / GIB, 3)
        elif not result["fits"]:
            result["suggestion"] = None
    if as_json:
        print(json.dumps(result))
        return 0
    print(table(plan))
    if gpu_memory is None:
        return 0
    if result["fits"]:
        print(f"\nFits in {gpu_memory:g} GiB (host memory: {plan.host_peak / GIB:.2f} of {host:.1f} GiB).")
    elif suggestion is not None:
        words = ["vidtune", "train", *([path] if path else []), *overrides, *suggestion.overrides]
        print(f"\nDoes not fit in {gpu_memory:g} GiB (with {host:.1f} GiB of host memory). It fits with these settings "
              f"(the fastest combination found; peak {suggestion.plan.peak / GIB:.2f} GiB, host memory "
              f"{suggestion.plan.host_peak / GIB:.2f} GiB):\n  {' '.join(suggestion.overrides)}\n"
              f"For example:\n  {shlex.join(words)}")
    elif larger_host is not None:
        print(f"\nDoes not fit in {gpu_memory:g} GiB with {host:.1f} GiB of host memory. With more host memory it "
              f"fits with these settings (peak {larger_host.plan.peak / GIB:.2f} GiB), which need "
              f"{larger_host.plan.host_peak / GIB:.2f} GiB of host memory (plus about {HOST_RESERVE_GIB:g} GiB for "
              f"the system):\n  {' '.join(larger_host.overrides)}\nWhat to do: train on a machine with more RAM "
              "(plan for it with --host-memory GIB), or at a smaller size (data.frames, data.height, data.width).")
    else:
        print(f"\nDoes not fit in {gpu_memory:g} GiB (with {host:.1f} GiB of host memory), even with every memory "
              "saver vidtune has.\nWhat to do: train at "
              "a smaller size (data.frames, data.height, data.width), with a smaller lora.rank, on a larger GPU, or "
              "on several (parallel.strategy=fsdp, then plan with --gpus N).")
    return 0
