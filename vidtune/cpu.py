"""How many CPU threads torch computes with.

torch starts one intra-op thread per core it sees. On a shared machine, or in a container limited to fewer CPUs than
the host has, those threads wait on each other and a step can take ten times as long as with one thread. vidtune
picks the count itself: the cores this process may really use (affinity, container quota, physical cores; shared
among the processes of a torchrun launch on this machine), less the data-loading workers, less one core kept free
for everything else (the system, other users), at least 1. Each torch op waits for its slowest thread, so one
thread that must share its core with other work stalls them all: on a busy 2-core machine the quickstart ran a step
in 0.50 s with 1 thread and 1.71 s with 2. `training.cpu_threads` or an explicit OMP_NUM_THREADS decide instead.
"""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

import psutil

from vidtune.config import Config

logger = logging.getLogger(__name__)
_announced = False


def usable_cores() -> int:
    """Cores this process may run on: the fewest of its CPU affinity, the container's CPU quota (cgroup v2 or v1)
    and the machine's physical cores."""
    counts = [os.cpu_count() or 1]
    if hasattr(os, "sched_getaffinity"):
        counts.append(len(os.sched_getaffinity(0)))
    quota = _cgroup_quota()
    if quota is not None:
        counts.append(max(1, math.floor(quota)))
    counts.append(psutil.cpu_count(logical=False) or counts[0])  # None where the system cannot tell
    return max(1, min(counts))


def _cgroup_quota() -> float | None:
    """CPUs allowed by the container's quota, or None when there is none (or it cannot be read)."""
    try:
        v2 = Path("/sys/fs/cgroup/cpu.max")
        if v2.is_file():
            quota, period = v2.read_text().split()[:2]
            return None if quota == "max" else int(quota) / int(period)
        v1 = Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us")
        if v1.is_file():
            quota = int(v1.read_text())
            period = int((v1.parent / "cpu.cfs_period_us").read_text())
            return None if quota <= 0 else quota / period
    except (OSError, ValueError):
        return None
    return None


def pick_cpu_threads(config: Config, cores: int | None = None) -> tuple[int, str]:
    """(threads, why) for this process."""
    if config.training.cpu_threads:
        return config.training.cpu_threads, "training.cpu_threads"
    explicit = os.environ.get("OMP_NUM_THREADS", "").strip()
    if explicit.isdigit() and int(explicit) > 0:
        return int(explicit), "OMP_NUM_THREADS"
    cores = cores or usable_cores()
    local_processes = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    share = max(1, cores // local_processes)
    workers = 0 if config.precompute.enabled else config.data.num_workers
    threads = max(1, share - workers - 1)
    why = f"{cores} usable cores"
    if local_processes > 1:
        why += f" shared by {local_processes} processes"
    if workers:
        why += f", less {workers} data workers"
    return threads, why + ", less one kept free"


def configure_cpu_threads(config: Config) -> int:
    """Set torch's intra-op thread count for this process (said once, by the main process)."""
    # Here, not at the top: the `vidtune` command imports this module before it knows it needs torch.
    import torch

    from vidtune import parallel

    threads, why = pick_cpu_threads(config)
    torch.set_num_threads(threads)
    global _announced
    if not _announced and parallel.is_main():
        _announced = True
        message = f"CPU threads: {threads} ({why}; training.cpu_threads=N to change)."
        if torch.device(parallel.resolve_device(config.training.device)).type == "cpu":
            print(message, flush=True)
        else:
            logger.info(message)
    return threads
