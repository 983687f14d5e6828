"""The environment of the launchers vidtune runs under, read into torchrun's variables.

torchrun, `accelerate launch` (multi-GPU) and the `deepspeed` launcher all set RANK, WORLD_SIZE, LOCAL_RANK,
MASTER_ADDR and MASTER_PORT for every process they start; `vidtune.parallel` reads those. SLURM's `srun`, when it
starts the training processes itself (one task per GPU, no torchrun), sets SLURM_PROCID, SLURM_NTASKS and
SLURM_LOCALID instead: `adopt_launcher_environment` turns them into the torchrun variables, so the rest of vidtune
sees one convention. Under `srun torchrun ...` torchrun's own variables are already there and win.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

from vidtune.errors import ConfigError

DEFAULT_PORT = "29500"  # torchrun's default rendezvous port


def adopt_launcher_environment(environ: MutableMapping[str, str] | None = None) -> str | None:
    """Set RANK, WORLD_SIZE, LOCAL_RANK (and MASTER_PORT) from SLURM's variables when a job step started the
    processes without torchrun; returns the launcher found ("slurm"), or None when nothing was changed."""
    env = os.environ if environ is None else environ
    if "RANK" in env or "SLURM_PROCID" not in env or int(env.get("SLURM_NTASKS", "1")) <= 1:
        return None
    if "MASTER_ADDR" not in env:
        raise ConfigError(
            f"This process was started by SLURM's srun as task {env['SLURM_PROCID']} of {env['SLURM_NTASKS']}, but "
            "MASTER_ADDR (the address every task meets at) is not set. What to do: in the sbatch script, before "
            "srun, add: export MASTER_ADDR=$(scontrol show hostnames \"$SLURM_JOB_NODELIST\" | head -n 1) "
            "(see docs/distributed.md)."
        )
    env["RANK"] = env["SLURM_PROCID"]
    env["WORLD_SIZE"] = env["SLURM_NTASKS"]
    env["LOCAL_RANK"] = env.get("SLURM_LOCALID", "0")
    env.setdefault("MASTER_PORT", DEFAULT_PORT)
    return "slurm"
