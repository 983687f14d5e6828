"""Data parallelism under torchrun: one process (rank) per device, each reading its own samples.

torchrun sets RANK, WORLD_SIZE and LOCAL_RANK (and MASTER_ADDR / MASTER_PORT) for every process it starts.
`process_group` sets torch.distributed up from them (nccl between GPUs, gloo on CPU) and takes it down at the
end; the helpers below (`rank`, `world_size`, `is_main`, `barrier`, ...) then say who this process is. Without
those variables there is one process: every helper is a no-op and the training code path is unchanged.

`DataParallel` wraps the denoiser for training (gradients averaged by DistributedDataParallel); `on_main` runs
what only rank 0 does (writing checkpoints, final weights, samples) so that its result, or its error, reaches
every rank: a failure there stops all ranks instead of leaving them waiting.
"""

from __future__ import annotations

import contextlib
import os
import pickle
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any, TypeVar

import torch

from vidtune.errors import ConfigError

T = TypeVar("T")

# Rank 0 alone writes checkpoints and renders validation samples while the others wait in a collective; with a
# big model that can take many minutes, more than NCCL's default 10-minute timeout. A rank that really fails
# ends the run long before this: its exception propagates and torchrun stops the other ranks.
TIMEOUT = timedelta(minutes=60)


def _dist() -> Any:
    import torch.distributed as dist

    return dist


def is_initialized() -> bool:
    dist = _dist()
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    """This process's rank: torch.distributed's, else torchrun's RANK, else 0."""
    return _dist().get_rank() if is_initialized() else int(os.environ.get("RANK", 0))


def world_size() -> int:
    """The number of processes: torch.distributed's, else torchrun's WORLD_SIZE, else 1."""
    return _dist().get_world_size() if is_initialized() else int(os.environ.get("WORLD_SIZE", 1))


def local_rank() -> int:
    """This process's rank on its machine (torchrun's LOCAL_RANK): the GPU it uses."""
    return int(os.environ.get("LOCAL_RANK", 0))


def context_degree(configured: int) -> int:
    """The ranks that share one sample's tokens (`parallel.context`'s degree) under torchrun; 1 in one process."""
    return configured if world_size() > 1 else 1


def data_rank(context: int = 1) -> int:
    """This process's data group (`context`: the configured context degree): ranks are numbered data-major, the
    ranks of a group adjacent (vidtune/parallel/context.py). Without context parallelism: the rank."""
    return rank() // context_degree(context)


def data_world(context: int = 1) -> int:
    """The number of data groups: the processes that read different samples."""
    return world_size() // context_degree(context)


def is_main() -> bool:
    return rank() == 0


def is_distributed() -> bool:
    """More than one process, talking over a process group."""
    return is_initialized() and world_size() > 1


def barrier() -> None:
    if is_distributed():
        _dist().barrier()


def parse_device(name: str, key: str) -> torch.device:
    """A device the config names under `key`: a typo, or a GPU this machine does not have, is a ConfigError
    (torch would fail later, deep in a model's `.to`)."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ConfigError(f"{key}={name!r} is not a device; use auto, cpu, cuda or cuda:N") from None
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            found = f"{count} CUDA device(s)" if count else "no CUDA device (or this torch is built without CUDA)"
            raise ConfigError(f"{key}={name}: this machine has {found}; use auto or cpu, or another device index")
    return device


def resolve_device(name: str) -> torch.device:
    """`training.device` -> this process's device. Under torchrun, `auto` and `cuda` mean cuda:LOCAL_RANK."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = parse_device(name, "training.device")
    if world_size() <= 1 or device.type != "cuda":
        return device
    if device.index is not None:
        raise ConfigError(f"training.device={name} would put every torchrun process on one GPU; use auto or cuda "
                          "(each process then takes the GPU of its LOCAL_RANK).")
    count = torch.cuda.device_count()
    if local_rank() >= count:
        raise ConfigError(f"torchrun started process LOCAL_RANK={local_rank()} on a machine with {count} GPU(s); "
                          "start at most one process per GPU (--nproc_per_node).")
    return torch.device("cuda", local_rank())


def backend_for(device: torch.device | None) -> str:
    return "nccl" if device is not None and device.type == "cuda" else "gloo"


@contextlib.contextmanager
def process_group(device: torch.device | None = None, backend: str | None = None, *, this_rank: int | None = None,
                  world: int | None = None) -> Iterator[bool]:
    """torch.distributed for this block: the group already in use, or one set up here from torchrun's environment
    (MASTER_ADDR, MASTER_PORT; `this_rank` / `world` override RANK / WORLD_SIZE) and destroyed on the way out.

    Yields whether there is more than one process. `backend` defaults to nccl for a CUDA `device`, else gloo.
    One process: nothing is set up."""
    world = world_size() if world is None else world
    if world <= 1:
        yield False
        return
    dist = _dist()
    created = not dist.is_initialized()
    if created:
        backend = backend or backend_for(device)
        if backend == "nccl":
            torch.cuda.set_device(device if device is not None else local_rank())
        dist.init_process_group(backend, rank=rank() if this_rank is None else this_rank, world_size=world,
                                timeout=TIMEOUT, store=_restart_store(world))
    try:
        yield True
    except BaseException:
        if created:
            close_process_group(meet=False)
        raise
    if created:
        close_process_group(meet=True)


# How long the closing process waits without the GIL before destroying its group (see `close_process_group`).
SETTLE_S = 0.2


def close_process_group(meet: bool, destroy: Callable[[], None] | None = None) -> None:
    """Destroy this process's group; `meet`: every rank gets here first (gloo aborts a process whose peer closed
    its connections while its own group still runs); `destroy`: an engine's own way of destroying it.

    gloo's worker thread drops a finished collective's tensors, which takes the GIL, while destroying the group
    joins that thread with the GIL held: a moment without the GIL first lets the thread finish, or both would wait
    for each other for ever."""
    dist = _dist()
    if meet:
        dist.barrier()
    time.sleep(SETTLE_S)
    (destroy or dist.destroy_process_group)()


def _restart_store(world: int) -> Any:
    """After torchrun restarted the processes (`--max-restarts`): the agent's store, with keys of this attempt only.

    torchrun keeps one store across restarts; without a prefix the restarted processes read the addresses the
    processes of the failed attempt published there, and gloo waits for them until it times out. None (the
    default env:// rendezvous) on the first attempt and outside torchrun."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    if attempt == "0" or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    dist = _dist()
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False,
                          timeout=TIMEOUT)
    return dist.PrefixStore(f"vidtune/attempt-{attempt}", store)


def _collective_device() -> torch.device:
    """Where tensors of a collective live: the current GPU for nccl, else the CPU."""
    if _dist().get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def all_reduce_sum(values: Sequence[float], dtype: torch.dtype = torch.float64) -> list[Any]:
    """The element-wise sum of `values` over all ranks (every rank gets it); one process: the values."""
    if not is_distributed():
        return list(values)
    tensor = torch.tensor(list(values), dtype=dtype, device=_collective_device())
    _dist().all_reduce(tensor)
    return tensor.cpu().tolist()


def gather_objects(value: Any) -> list[Any]:
    """Every rank's `value` (picklable), in rank order, on every rank; one process: [value]."""
    if not is_distributed():
        return [value]
    gathered: list[Any] = [None] * world_size()
    _dist().all_gather_object(gathered, value)
    return gathered


def broadcast_object(value: Any) -> Any:
    """Rank 0's `value` (picklable), on every rank; one process: the value."""
    if not is_distributed():
        return value
    holder = [value if is_main() else None]
    _dist().broadcast_object_list(holder, src=0)
    return holder[0]


def _portable(error: Exception) -> Exception:
    """`error` itself if it survives pickling (to be raised on the other ranks), else a RuntimeError saying it."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RuntimeError(f"{type(error).__name__}: {error}")


def on_main(function: Callable[[], T]) -> T:
    """Run `function` on rank 0 only and return its result on every rank; an exception it raises is raised on
    every rank, so no rank is left waiting for one that stopped. One process: `function()`."""
    if not is_distributed():
        return function()
    outcome: tuple[bool, Any] = (True, None)
    failed: Exception | None = None
    if is_main():
        try:
            outcome = (True, function())
        except Exception as error:
            failed = error
            outcome = (False, _portable(error))
    ok, value = broadcast_object(outcome)
    if failed is not None:
        raise failed
    if not ok:
        raise value
    return value
