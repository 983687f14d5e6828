"""DeepSpeed ZeRO (`parallel.strategy: deepspeed`): the optimizer state (stage 1), also the gradients (2) and also
the weights (3) sharded over the ranks, driven with `deepspeed.initialize` from vidtune's config.

The DeepSpeed config is derived from vidtune's (`deepspeed_config`): batch sizes, accumulation, clipping, the ZeRO
stage and offload. A JSON file (`parallel.deepspeed_config`) may add or override keys, except the ones vidtune's
loop depends on (the batch sizes and the accumulation), which must then agree with `training.*`.

The optimizer stays vidtune's (`optimizer.name`, its LR schedule, its resume): DeepSpeed wraps it in its ZeRO
optimizer. Weights train in float32 (`training.precision: bf16` is autocast, as without DeepSpeed), so a gradient
norm that is not finite makes DeepSpeed discard the step, which is how vidtune skips a non-finite step here.

Checkpoints: every rank writes its shards with DeepSpeed's own `save_checkpoint` into a staging folder, which rank 0
then moves into vidtune's checkpoint folder (`zero/`) before that is renamed into place, beside the gathered
trainable weights (so `vidtune export` reads a DeepSpeed checkpoint like any other) and the rest of the training
state. Resuming loads the shards with `load_checkpoint`. On the same number of processes that is exact; on another
number (`vidtune.parallel.zero_reshard`), the shards are first converted into DeepSpeed's universal checkpoint (one
file per parameter and optimizer state, whole), from which every rank cuts its new shard.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from vidtune import parallel
from vidtune.checkpoint import ZERO_SHARDS, SavedState
from vidtune.config import Config
from vidtune.errors import ConfigError, TrainingError
from vidtune.outputs import checkpoints_root
from vidtune.parallel.checkpointers import Checkpointer, Record, TrainedParts
from vidtune.parallel.dcp import Weights
from vidtune.parallel.strategy import Strategy
from vidtune.parallel.zero_reshard import load_resharded

if TYPE_CHECKING:
    from vidtune.algorithms.part import AlgorithmPart

# The tag DeepSpeed's files are saved under inside the checkpoint's `zero/` (checkpoint.ZERO_SHARDS).
ZERO_TAG = "state"
# Keys of the DeepSpeed config that the training loop relies on: a JSON override must agree with them.
LOOP_KEYS = ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "train_batch_size")
INSTALL_HINT = "What to do: install it with `pip install 'vidtune[deepspeed]'`, or use parallel.strategy=ddp or fsdp."


def import_deepspeed(device_type: str = "cpu") -> Any:
    """`deepspeed`, imported for `device_type`, or a ConfigError saying how to get it."""
    # DeepSpeed picks its accelerator when it is imported; without a GPU it must be told to use the CPU.
    if device_type == "cpu":
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed
    except ImportError as error:
        raise ConfigError(f"parallel.strategy=deepspeed needs the deepspeed package, which could not be imported "
                          f"({error}). {INSTALL_HINT}") from None
    if device_type == "cpu":
        # DeepSpeed's CPU backend compiles a shared-memory all-reduce kernel when it starts (a minute with g++, an
        # error without it) that serves only its inference all-reduce; training's collectives go through gloo.
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
    return deepspeed


@contextlib.contextmanager
def process_group(device: torch.device) -> Iterator[bool]:
    """torch.distributed for a DeepSpeed run, set up here (unless in use already) and taken down through DeepSpeed,
    which also drops the groups it derived from it (a later run in this process would otherwise use dead ones).

    One process gets a group of one (DeepSpeed's engine needs a group; ZeRO offload is useful on one GPU too).
    Yields whether there is more than one process."""
    deepspeed = import_deepspeed(device.type)
    import torch.distributed as dist

    world = parallel.world_size()
    created = not dist.is_initialized()
    if created:
        backend = parallel.backend_for(device)
        if backend == "nccl":
            torch.cuda.set_device(device)
        if world > 1:
            dist.init_process_group(backend, rank=parallel.rank(), world_size=world, timeout=parallel.TIMEOUT)
        else:  # no rendezvous needed: an in-process store
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
            # DeepSpeed reads which device is this process's from the launchers' variables.
            for name in ("LOCAL_RANK", "RANK"):
                os.environ.setdefault(name, "0")
            os.environ.setdefault("WORLD_SIZE", "1")
    deepspeed.init_distributed(dist_backend=dist.get_backend())
    try:
        yield world > 1
    except BaseException:
        _restore_linear()
        if created:
            parallel.close_process_group(meet=False, destroy=deepspeed.comm.destroy_process_group)
        raise
    _restore_linear()
    if created:
        parallel.close_process_group(meet=world > 1, destroy=deepspeed.comm.destroy_process_group)


def _restore_linear() -> None:
    """ZeRO-3 replaces torch.nn.functional.linear process-wide with its memory-efficient version and leaves it so
    ("persists unless manually reset"); after the run, the original goes back, or every model used later in this
    process (float8 layerwise casting, torchao's int8 weights) would compute through DeepSpeed's."""
    from deepspeed.runtime.zero.partition_parameters import InsertPostInitMethodToModuleSubClasses as patcher

    original = getattr(patcher, "linear_bk", None)
    if original is not None:
        torch.nn.functional.linear = original


def read_override(config: Config) -> dict[str, Any]:
    """The user's DeepSpeed JSON (`parallel.deepspeed_config`), or {} without one."""
    path = config.parallel.deepspeed_config
    if path is None:
        return {}
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise ConfigError(f"parallel.deepspeed_config={path}: cannot read it ({error.strerror}). What to do: give "
                          "the path of a DeepSpeed JSON file (relative to the config file's folder), or remove the "
                          "key to use the settings vidtune derives.") from None
    try:
        loaded = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(f"parallel.deepspeed_config={path}: line {error.lineno}, column {error.colno}: "
                          f"{error.msg}. What to do: fix the JSON there.") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"parallel.deepspeed_config={path} holds a JSON {type(loaded).__name__}, not an object. "
                          "What to do: write the DeepSpeed settings as one JSON object ({\"key\": value, ...}).")
    return loaded


def _merge(base: dict[str, Any], override: dict[str, Any]) -> dict[str, Any]:
    """`base` with `override`'s keys, nested objects merged key by key."""
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def deepspeed_config(config: Config, world: int) -> dict[str, Any]:
    """The DeepSpeed config of this run on `world` processes: derived from vidtune's config, then the user's JSON
    (`parallel.deepspeed_config`) on top. Raises ConfigError for settings that cannot go together."""
    training, settings = config.training, config.parallel
    if settings.offload == "all" and settings.zero_stage != 3:
        raise ConfigError(f"parallel.offload=all moves the weights to CPU memory, which only ZeRO stage 3 does (this "
                          f"config has parallel.zero_stage={settings.zero_stage}). What to do: set "
                          "parallel.zero_stage=3, or parallel.offload=optimizer.")
    if config.optimizer.cpu_offload:
        raise ConfigError("optimizer.cpu_offload and parallel.strategy=deepspeed both move the optimizer to CPU "
                          "memory. What to do: remove optimizer.cpu_offload and set parallel.offload=optimizer.")
    if training.ema_decay is not None and settings.zero_stage == 3:
        raise ConfigError("training.ema_decay cannot follow weights that ZeRO stage 3 shards over the ranks. What to "
                          "do: use parallel.zero_stage=1 or 2 with training.ema_decay, or remove training.ema_decay.")
    zero: dict[str, Any] = {"stage": settings.zero_stage}
    pin = torch.cuda.is_available()
    if settings.offload in ("optimizer", "all"):
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": pin}
    if settings.offload == "all":
        zero["offload_param"] = {"device": "cpu", "pin_memory": pin}
    derived: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": training.batch_size,
        "gradient_accumulation_steps": training.gradient_accumulation,
        "train_batch_size": training.batch_size * training.gradient_accumulation * world,
        "gradient_clipping": training.max_grad_norm or 0.0,
        "zero_optimization": zero,
        # vidtune's optimizers (optimizer.name) are not in DeepSpeed's tested list; ZeRO handles any torch optimizer.
        "zero_allow_untested_optimizer": True,
        # With offload, run vidtune's optimizer on the CPU shards instead of insisting on DeepSpeed's compiled Adam.
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,  # vidtune logs the steps itself
    }
    merged = _merge(derived, read_override(config))
    for key in LOOP_KEYS:
        if merged[key] != derived[key]:
            raise ConfigError(
                f"parallel.deepspeed_config sets {key}={merged[key]}, but this run takes {derived[key]} (from "
                f"training.batch_size={training.batch_size}, training.gradient_accumulation="
                f"{training.gradient_accumulation} and {world} processes). What to do: remove {key} from the JSON "
                "file and set training.batch_size / training.gradient_accumulation instead.")
    for key in ("fp16", "bf16"):
        if merged.get(key, {}).get("enabled"):
            raise ConfigError(f"parallel.deepspeed_config enables {key}: vidtune keeps float32 weights and runs the "
                              "forward in autocast. What to do: remove the key and set training.precision=bf16.")
    return merged


def check_deepspeed(config: Config, device_type: str, resuming_from: Any = None) -> None:
    """Before any long work: DeepSpeed importable, the derived config valid and the checkpoint to resume (a
    `SavedState`, if any) one this run can continue (`parallel.strategy=deepspeed`)."""
    import_deepspeed(device_type)
    deepspeed_config(config, parallel.world_size())
    if resuming_from is not None:
        check_resumable(resuming_from.folder)


def check_resumable(folder: Path) -> None:
    """A DeepSpeed checkpoint (on any number of processes: see `DeepSpeedCheckpointer.read_engine_state`)."""
    if not (folder / ZERO_SHARDS).is_dir():
        raise TrainingError(f"The checkpoint {folder} has no DeepSpeed state ({ZERO_SHARDS}/): it was written by "
                            "another parallel.strategy. What to do: resume it with that strategy, or start from its "
                            f"weights in a new run (`vidtune export {folder} --output FOLDER`).")


class EngineCall:
    """What the trainer calls for forward: the DeepSpeed engine, answering `.config` / `.dtype`... for the model.

    The families' `spec.forward(denoiser, ...)` read the model's `config`, which the engine has as its own
    (DeepSpeed's config); calls go to the engine (its hooks gather ZeRO-3 weights), attributes to the model."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.engine(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine.module, name)


class DeepSpeedStrategy(Strategy):
    """The trainer's view of DeepSpeed: wrap, accumulate, backward, clip, step, checkpoints, gathered weights."""

    name = "deepspeed"
    # The engine exists before a checkpoint is restored: each rank reads its own shards into it.
    wraps_before_restore = True
    # The engine keeps the optimizer state and gradients: checkpoints hold its own files (`zero/`).
    engine_checkpoints = True

    def __init__(self, config: Config, device: torch.device) -> None:
        super().__init__(config, device)
        self.deepspeed = import_deepspeed(device.type)
        self.zero_stage = config.parallel.zero_stage
        # ZeRO-3 partitions the weights: every forward gathers them from all ranks, as FSDP's do.
        self.forwards_gather_weights = self.zero_stage == 3
        self.engine: Any = None
        self.optimizer: Any = None  # DeepSpeed's ZeRO optimizer around vidtune's
        self.trainable: list[nn.Parameter] = []

    # ----- training ------------------------------------------------------------------------------------
    def wrap(self, denoiser: nn.Module, parameters: list[nn.Parameter],
             optimizer: torch.optim.Optimizer) -> EngineCall:
        settings = deepspeed_config(self.config, parallel.world_size())
        self.trainable = list(parameters)
        self.engine, self.optimizer, _, _ = self.deepspeed.initialize(
            model=denoiser, optimizer=optimizer, model_parameters=parameters, config=settings)
        return EngineCall(self.engine)

    def accumulating(self, module: Any, sync: bool) -> contextlib.AbstractContextManager:
        """Gradients are reduced over the ranks only on the last micro-batch (`sync`) of a step."""
        self.engine.set_gradient_accumulation_boundary(sync)
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        # The loss is already divided by the step's micro-batches (the trainer's scaling, as without DeepSpeed).
        self.engine.backward(loss, scale_wrt_gas=False)

    def clip_gradients(self, parameters: list[nn.Parameter], max_norm: float | None) -> float | None:
        """The global gradient norm before clipping, over every rank's shard. DeepSpeed clips inside its step
        (`gradient_clipping`, derived from training.max_grad_norm)."""
        optimizer = self.optimizer
        # The ZeRO optimizers' own norm over the reduced gradient shards (what their step clips with); DeepSpeed has
        # no public call for it before the step.
        if self.zero_stage == 3:
            from deepspeed.runtime.utils import combine_grad_norm_groups

            norm = combine_grad_norm_groups(optimizer._get_norm_groups())
        else:
            norm = optimizer.scaled_global_norm()
        # DeepSpeed marks a non-finite norm as -1.
        value = float(norm)
        return value if value >= 0 else float("inf")

    def optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        self.engine.step()

    def zero_grad(self, optimizer: torch.optim.Optimizer, applied: bool = True) -> None:
        """After a step: DeepSpeed's step cleared the gradients. After a skipped (non-finite) one, its step is
        still taken: it sees the non-finite norm and discards the gradients without an update."""
        if not applied:
            self.engine.step()

    # ----- weights ---------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def gathered(self, module: nn.Module | None = None, everything: bool = False) -> Iterator[None]:
        """Every rank enters: under ZeRO-3 the trained weights (`everything`: all the model's) are gathered on each
        rank for the block, so that rank 0 can read or save them; under ZeRO 1 and 2 every rank holds them already.
        Checkpoints and validation need only the trained ones (a LoRA adapter: little memory); the final
        diffusers files of a full fine-tune need all."""
        if self.zero_stage != 3 or self.engine is None:
            yield
            return
        parameters = list(self.engine.module.parameters()) if everything else self.trainable
        with self.deepspeed.zero.GatheredParameters(parameters, modifier_rank=None):
            yield

    @contextlib.contextmanager
    def sampling(self, part: AlgorithmPart, fresh: Callable[[], AlgorithmPart]) -> Iterator[AlgorithmPart]:
        """Rank 0, inside `gathered()`: the part validation samples with. ZeRO-3's module gathers its weights for
        each layer's forward in a collective of all ranks, so one rank cannot run it alone: a `fresh` part sets up
        a plain copy loaded from the model folder (a second model in rank 0's memory for the time of the samples)
        as for training, given the trained weights; the trained part is left as it is. ZeRO 1 and 2: the trained
        part itself."""
        if self.zero_stage != 3:
            yield part
            return
        # A CPU copy: the gathered weights may hold the whole model on the GPU already.
        weights = {name: tensor.detach().to("cpu", copy=True) for name, tensor in part.state_dict().items()}
        copy = fresh()
        copy.configure(copy.spec.load_denoiser(self.device), resuming=True)
        copy.load_state_dict(weights)
        del weights
        yield copy

    # ----- checkpoints -----------------------------------------------------------------------------------
    def checkpointer(self) -> DeepSpeedCheckpointer:
        return DeepSpeedCheckpointer(self)


def remove_staging(root: Path) -> None:
    """The staging folders (`.zero-<step>`) under `root`: only a save in progress has one, so any found before a
    save are what a killed save left (each as large as the run's shards)."""
    for folder in root.glob(".zero-*"):
        shutil.rmtree(folder)


class DeepSpeedCheckpointer(Checkpointer):
    """DeepSpeed's own shards of the weights and optimizer state (`zero/`), every rank writing its own, beside the
    gathered trained weights and their average (as one process writes them, for `vidtune export`)."""

    strategy: DeepSpeedStrategy

    def save(self, root: Path, record: Record, parts: TrainedParts) -> Path:
        # Every rank writes its shards and takes part in gathering the trained weights; rank 0 writes the folder.
        staging = root / f".zero-{record.step:08d}"
        try:
            self.write_engine_state(staging)
            weights = self.gathered_weights(parts.get_weights)
            # The optimizer state is in the shards.
            return parallel.on_main(lambda: self.write_files(root, record, weights, {}, parts.ema_weights(), staging))
        finally:
            # Moved into the checkpoint when it was written; after a failure (a full disk), not left taking space.
            if parallel.is_main():
                shutil.rmtree(staging, ignore_errors=True)

    def restore(self, saved: SavedState, parts: TrainedParts, device: torch.device) -> Weights | None:
        """Every rank reads its shards of the weights and optimizer state into the engine (the trained weights of
        `weights.safetensors` are not read: the shards hold them)."""
        self.read_engine_state(saved.folder, int(saved.state.get("world_size", 1)))
        return saved.ema_weights

    def gathered_weights(self, get_weights: Callable[[], Weights]) -> Weights | None:
        """The trained weights (`get_weights`, the algorithm's accessor) gathered, as CPU copies on rank 0 (None on
        the others). Every rank must call it."""
        with self.strategy.gathered():
            if not parallel.is_main():
                return None
            return {name: tensor.detach().to("cpu", copy=True) for name, tensor in get_weights().items()}

    def write_engine_state(self, staging: Path) -> None:
        """Every rank writes its ZeRO shards (weights and optimizer state) into the folder `staging`, for rank 0 to
        move into the checkpoint (`checkpoint.save(..., shards=)`)."""
        if parallel.is_main():
            remove_staging(staging.parent)  # what a run killed while saving left, whichever step it saved
            staging.parent.mkdir(parents=True, exist_ok=True)
        parallel.barrier()
        # LoRA: the frozen base is the model folder's, no need to copy it into every checkpoint.
        self.strategy.engine.save_checkpoint(str(staging), tag=ZERO_TAG, save_latest=False,
                                             exclude_frozen_parameters=True)
        parallel.barrier()

    def read_engine_state(self, folder: Path, saved_world: int) -> None:
        """The weights and optimizer state of the checkpoint `folder`: every rank reads its own shards, or, when the
        checkpoint was written by another number of processes, cuts them from its universal form."""
        check_resumable(folder)
        shards, engine = folder / ZERO_SHARDS, self.strategy.engine
        if saved_world == parallel.world_size():
            loaded, _ = engine.load_checkpoint(str(shards), tag=ZERO_TAG, load_module_strict=False,
                                               load_optimizer_states=True, load_lr_scheduler_states=False)
        else:
            output_dir = Path(self.strategy.config.output_dir)
            loaded = load_resharded(engine, shards / ZERO_TAG, checkpoints_root(output_dir))
        if loaded is None:
            raise TrainingError(f"DeepSpeed could not load the checkpoint {shards}. What to do: check that the "
                                "folder is complete, or resume from an earlier checkpoint.")
