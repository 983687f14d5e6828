"""Training on several real processes on the CPU (gloo): ports, what each spawned rank runs, and the two-ranks
against one-process comparison."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import socket
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from safetensors.torch import load_file

from vidtune import parallel
from vidtune.config import build_config
from vidtune.errors import VidtuneError
from vidtune.outputs import LORA_WEIGHTS_2
from vidtune.trainers import build_trainer
from vidtune.training.stop import TrainingInterrupted

LORA_FILE = "pytorch_lora_weights.safetensors"
LORA_FILE_2 = LORA_WEIGHTS_2  # the low-noise expert's adapter


def free_port() -> int:
    """A TCP port free on this machine now, for a process group's rendezvous."""
    with socket.socket() as handle:
        handle.bind(("127.0.0.1", 0))
        return handle.getsockname()[1]


def run_port(out: str, index: int, wait_s: float = 600.0) -> int:
    """The rendezvous port of a rank's `index`-th run: rank 0 picks a free one just before the run (one picked when
    the test started may be another process's by then) and leaves it in OUT, where the other ranks read it."""
    path = Path(out, f"port-{index}")
    if os.environ["RANK"] == "0":
        written = path.with_name(path.name + ".tmp")
        written.write_text(str(free_port()))
        written.replace(path)
    deadline = time.monotonic() + wait_s
    while not path.is_file():
        if time.monotonic() > deadline:
            raise TimeoutError(f"rank 0 gave no port for run {index} in {wait_s:.0f} s")
        time.sleep(0.05)
    return int(path.read_text())


def _train_each(runs: list[tuple[str, dict, dict]], out: str) -> dict:
    return {name: _train(config, run_port(out, index), **options)
            for index, (name, config, options) in enumerate(runs)}


def _train(config: dict, port: int, stop_on: tuple[int, int] | None = None, unused: bool = False) -> dict:
    """One run of this rank under a fresh process group (set up by the trainer from the environment, as under
    torchrun); `stop_on=(rank, micro_batch)` sends that rank SIGTERM during that micro-batch; `unused` adds a
    trainable parameter the denoiser never uses."""
    os.environ["MASTER_PORT"] = str(port)
    trainer = build_trainer(build_config(config))
    if unused:
        configure = trainer.part.configure

        def with_unused(denoiser, *args, **kwargs):
            denoiser.register_parameter("never_used", torch.nn.Parameter(torch.zeros(3)))
            return [*configure(denoiser, *args, **kwargs), denoiser.never_used]

        trainer.part.configure = with_unused
    positions: list[int] = []
    original = trainer.loss

    def recording(context, batch):
        positions.extend(int(p) for p in batch.positions)
        if stop_on is not None and stop_on == (int(os.environ["RANK"]), len(positions)):
            os.kill(os.getpid(), signal.SIGTERM)
        return original(context, batch)

    trainer.loss = recording
    try:
        result = trainer.run()
    except TrainingInterrupted as stopped:
        return {"positions": positions, "exit_code": stopped.exit_code, "message": str(stopped)}
    except VidtuneError as error:  # TrainingError, and the refusals of a strategy's settings
        return {"positions": positions, "error": str(error)}
    return {"positions": positions, "losses": result.losses, "weights": str(result.weights_path)}


def rank_main(rank: int, world: int, runs: list[tuple[str, dict, dict]], out: str) -> None:
    """What `mp.spawn` runs on each rank: every (name, config, options) of `runs` under its own port (`run_port`),
    the results written to OUT/rank<rank>.json."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      HF_HUB_OFFLINE="1")
    torch.set_num_threads(1)
    parallel.TIMEOUT = timedelta(seconds=120)  # a broken collective fails the test instead of hanging for an hour
    results = _train_each(runs, out)
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))


# What every spawned rank imports before it runs: loaded once by the forkserver, which forks each rank from itself.
RANK_IMPORTS = ["torch", "torch.distributed", "vidtune.trainers", "tests.helpers.distributed"]


def spawn_ranks(function: Callable[..., None], args: tuple, nprocs: int) -> None:
    """`mp.spawn` with the forkserver start method: the ranks are forked from a server process that imported
    RANK_IMPORTS once (per test process), instead of each fresh interpreter importing torch, diffusers and peft
    again (seconds per rank). The server never ran torch code, so its forks start with no threads or process group
    of its own."""
    multiprocessing.set_forkserver_preload(RANK_IMPORTS)
    mp.start_processes(function, args=args, nprocs=nprocs, join=True, start_method="forkserver")


def two_ranks_against_one_process(make_config, tmp_path: Path, settings: dict, atol: float = 1e-4,
                                  files: tuple[str, ...] = (LORA_FILE,)) -> list[dict]:
    """Train `settings` on two spawned ranks x its batch (`training.batch_size`, 1 unless set) and in this process
    with twice that batch: the same adapter files `files` (within rtol 1e-3 / `atol`), each trained, and on both
    ranks the same logged losses (rel 1e-4). Returns each rank's results (`_train`'s)."""
    runs = [("ddp", make_config(output_dir=str(tmp_path / "ddp"), **settings).to_dict(), {})]
    out = tmp_path / "results"
    out.mkdir()
    spawn_ranks(rank_main, (2, runs, str(out)), nprocs=2)
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
    for result in ranks:
        assert "error" not in result["ddp"], result["ddp"]
    batch = settings["training"].get("batch_size", 1)
    single = make_config(output_dir=str(tmp_path / "single"), **{
        **settings, "training": {**settings["training"], "batch_size": 2 * batch}})
    single_result = build_trainer(single).run()
    for name in files:
        expected, trained = (load_file(tmp_path / run / name) for run in ("single", "ddp"))
        assert expected.keys() == trained.keys()
        assert any(v.abs().max() > 0 for k, v in trained.items() if "lora_B" in k), name
        for key in expected:
            torch.testing.assert_close(trained[key], expected[key], rtol=1e-3, atol=atol)
    for result in ranks:
        assert result["ddp"]["losses"] == pytest.approx(single_result.losses, rel=1e-4)
    return [result["ddp"] for result in ranks]


def deepspeed_rank_main(rank: int, world: int, runs: list[tuple[str, dict, dict]], out: str) -> None:
    """`rank_main` for DeepSpeed on the CPU (its accelerator set to cpu, a longer collective timeout)."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                      HF_HUB_OFFLINE="1", DS_ACCELERATOR="cpu")
    torch.set_num_threads(1)
    # A broken collective fails the test instead of hanging for an hour; a loaded CI machine still gets minutes.
    parallel.TIMEOUT = timedelta(seconds=300)
    results = _train_each(runs, out)
    Path(out, f"rank{rank}.json").write_text(json.dumps(results))
