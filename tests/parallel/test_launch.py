"""The launchers' environments read into torchrun's variables (`vidtune.parallel.launch`)."""

from __future__ import annotations

import pytest

from vidtune.errors import ConfigError
from vidtune.parallel.launch import adopt_launcher_environment

SLURM = {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "MASTER_ADDR": "node-a"}


def test_srun_tasks_become_torchrun_ranks():
    env = dict(SLURM)
    assert adopt_launcher_environment(env) == "slurm"
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["MASTER_PORT"]) == ("5", "8", "1", "29500")


@pytest.mark.parametrize("env", [
    {**SLURM, "RANK": "0", "WORLD_SIZE": "2"},  # srun torchrun ...: torchrun's variables win
    {**SLURM, "SLURM_NTASKS": "1"},  # one task: one process
    {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"},  # torchrun, accelerate launch
    {},
])
def test_other_launchers_are_left_alone(env):
    before = dict(env)
    assert adopt_launcher_environment(env) is None
    assert env == before


def test_srun_without_master_addr_says_what_to_add():
    env = {key: value for key, value in SLURM.items() if key != "MASTER_ADDR"}
    with pytest.raises(ConfigError, match=r"task 5 of 8.*export MASTER_ADDR=\$\(scontrol show hostnames"):
        adopt_launcher_environment(env)
    assert "RANK" not in env
