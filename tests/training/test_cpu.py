"""The CPU thread count: the usable cores less the data workers less one, unless the user says otherwise."""

from __future__ import annotations

import torch

from vidtune import cpu
from vidtune.config import load_config

REQUIRED = ["model.name=ltx-video", "model.pretrained=some/model", "data.root=clips"]


def test_automatic_count_leaves_room_for_workers_and_other_work(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert cpu.pick_cpu_threads(load_config(None, [*REQUIRED, "data.num_workers=2"]), cores=8)[0] == 5
    assert cpu.pick_cpu_threads(load_config(None, [*REQUIRED, "data.num_workers=0"]), cores=2)[0] == 1
    assert cpu.pick_cpu_threads(load_config(None, [*REQUIRED, "data.num_workers=4"]), cores=2)[0] == 1
    # Precomputed runs read the cache in the main process: no workers to leave cores for.
    config = load_config(None, [*REQUIRED, "data.num_workers=2", "precompute.enabled=true"])
    assert cpu.pick_cpu_threads(config, cores=8)[0] == 7
    # torchrun: the processes on this machine share its cores.
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    threads, why = cpu.pick_cpu_threads(load_config(None, [*REQUIRED, "data.num_workers=1"]), cores=8)
    assert threads == 2 and "shared by 2 processes" in why


def test_the_user_decides_with_the_config_or_omp_num_threads(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu.pick_cpu_threads(load_config(None, REQUIRED), cores=16) == (3, "OMP_NUM_THREADS")
    config = load_config(None, [*REQUIRED, "training.cpu_threads=6"])
    assert cpu.pick_cpu_threads(config, cores=16) == (6, "training.cpu_threads")


def test_usable_cores_respects_affinity_and_quota(monkeypatch):
    monkeypatch.setattr(cpu.os, "cpu_count", lambda: 64)
    monkeypatch.setattr(cpu, "_cgroup_quota", lambda: 2.5)
    assert cpu.usable_cores() <= 2


def test_configure_sets_torch_and_says_it_once(monkeypatch, capsys):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(cpu, "_announced", False)
    before = torch.get_num_threads()
    try:
        config = load_config(None, [*REQUIRED, "training.cpu_threads=1", "training.device=cpu"])
        assert cpu.configure_cpu_threads(config) == 1 and torch.get_num_threads() == 1
        cpu.configure_cpu_threads(config)
    finally:
        torch.set_num_threads(before)
    assert capsys.readouterr().out.count("CPU threads: 1 (training.cpu_threads") == 1
