"""`vidtune plan`: the plan as a table (or one JSON object), and with a budget whether it fits and what would."""

from __future__ import annotations

import json
import shlex

from vidtune.config import Config, load_config
from vidtune.errors import ConfigError
from vidtune.memory.plan import GIB, MemoryPlan, plan_memory
from vidtune.memory.suggest import suggest

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
    return "\n".join(lines)


def run_plan(path: str | None, overrides: list[str], gpu_memory: float | None, as_json: bool, gpus: int) -> int:
    config = load_plan_config(path, overrides)
    plan = plan_memory(config, gpus)
    result = plan.to_json()
    suggestion = None
    if gpu_memory is not None:
        suggestion = suggest(config, gpu_memory, gpus) if plan.peak > gpu_memory * GIB else None
        result["gpu_memory_gib"] = gpu_memory
        result["fits"] = plan.peak <= gpu_memory * GIB
        result["suggested_overrides"] = suggestion.overrides if suggestion else []
        if suggestion:
            result["suggested_peak_gib"] = round(suggestion.plan.peak / GIB, 3)
            result["suggested_training_gib"] = suggestion.plan.to_json()["training_gib"]
        elif not result["fits"]:
            result["suggestion"] = None
    if as_json:
        print(json.dumps(result))
        return 0
    print(table(plan))
    if gpu_memory is None:
        return 0
    if result["fits"]:
        print(f"\nFits in {gpu_memory:g} GiB.")
    elif suggestion is not None:
        words = ["vidtune", "train", *([path] if path else []), *overrides, *suggestion.overrides]
        print(f"\nDoes not fit in {gpu_memory:g} GiB. It fits with these settings (the fastest combination found; "
              f"peak {suggestion.plan.peak / GIB:.2f} GiB):\n  {' '.join(suggestion.overrides)}\n"
              f"For example:\n  {shlex.join(words)}")
    else:
        print(f"\nDoes not fit in {gpu_memory:g} GiB, even with every memory saver vidtune has.\nWhat to do: train at "
              "a smaller size (data.frames, data.height, data.width), with a smaller lora.rank, on a larger GPU, or "
              "on several (parallel.strategy=fsdp, then plan with --gpus N).")
    return 0
