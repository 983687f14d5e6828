"""The memory planner's answer for the settings form: the peak a config needs on one GPU of the memory given and,
when it does not fit, the fastest settings that make it fit (`vidtune plan --gpu-memory`'s suggestions)."""

from __future__ import annotations

from typing import Any

from vidtune.config import Config
from vidtune.memory.plan import GIB, plan_memory, traces_kept_on_disk
from vidtune.memory.report import machine_memory_gib
from vidtune.memory.suggest import fits, suggest


def plan_answer(config: Config, gpu_memory: float, host_memory: float | None = None) -> dict[str, Any]:
    host = machine_memory_gib() if host_memory is None else host_memory
    with traces_kept_on_disk():
        plan = plan_memory(config)
        fitting = fits(plan, gpu_memory, host)
        suggestion = None if fitting else suggest(config, gpu_memory, 1, host)
    answer = {**plan.to_json(), "gpu_memory_gib": gpu_memory, "host_memory_gib": round(host, 3), "fits": fitting,
              "suggested_overrides": suggestion.overrides if suggestion else []}
    if suggestion is not None:
        answer["suggested_peak_gib"] = round(suggestion.plan.peak / GIB, 3)
    answer["verdict"] = (f"Fits in {gpu_memory:g} GiB (peak {plan.peak / GIB:.2f} GiB)." if fitting else
                         f"Does not fit in {gpu_memory:g} GiB (peak {plan.peak / GIB:.2f} GiB); it fits with the "
                         f"settings below (peak {suggestion.plan.peak / GIB:.2f} GiB)." if suggestion else
                         f"Does not fit in {gpu_memory:g} GiB (peak {plan.peak / GIB:.2f} GiB), even with every "
                         "memory saver: train at a smaller size (data.frames, data.height, data.width) or a smaller "
                         "lora.rank.")
    return answer
