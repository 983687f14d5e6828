"""FSDP2 (`parallel.strategy: fsdp`): weights, gradients and optimizer state sharded over the ranks.

torch's `fully_shard` is applied to every transformer block and then to the denoiser itself, so one block's
weights are gathered at a time. `training.precision` gives the mixed-precision policy (bf16 compute, fp32
gradient reduction), `parallel.reshard_after_forward` whether a block's gathered weights are freed after its
forward, `parallel.cpu_offload` keeps the shards in CPU memory, and `parallel.replicate_degree` > 1 makes it
HSDP: shard inside groups of world / replicate_degree ranks (a node), replicate across the groups.

Checkpoints are torch Distributed Checkpoint (DCP) folders: every rank writes its shard of the trainable weights
and optimizer state, in parallel. DCP reshards on load, so a checkpoint resumes on any number of ranks, one
process included. Gradients are averaged over ranks as DDP does, so a step of `world` ranks with `batch_size` each
is a step of one process with `batch_size * world`.

`parallel.load_on_rank0` (on by default with several ranks): rank 0 alone reads the denoiser's weights, into CPU
memory; the other ranks build it on the meta device (shapes, no data), configure it the same way (adapters, a widened
control input), are sharded alike, and then receive their shards of rank 0's weights (`fill_from_main`). A node
then holds the whole weights once, not once per GPU. A distillation teacher that is a copy of the denoiser follows
the same path (`prepare_frozen`).

`training.ema_decay`: the moving average follows the sharded weights, each rank its shard (`vidtune.ema`); the
checkpoint stores it beside the weights, and `gathered` gathers it with them. `memory.base_weights` (fp8, int8,
nf4): the quantized frozen weights are left out of the sharding (`ignored_params`): every rank holds the whole
quantized base, read from the same files by every rank (`load_on_rank0` is then off), and FSDP shards the adapters
and the full-precision rest.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Collection, Iterator
from typing import Any

import torch
from torch import nn

from vidtune import parallel
from vidtune.errors import ConfigError, ModelError
from vidtune.models.spec import ModelSpec
from vidtune.parallel.checkpointers import ShardedCheckpointer
from vidtune.parallel.strategy import Strategy

META = torch.device("meta")


def transformer_blocks(module: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a diffusers video transformer: the items of its ModuleLists whose name ends in
    `blocks` (`transformer_blocks`, HunyuanVideo's `single_transformer_blocks`, Wan's `blocks`)."""
    return [block for name, child in module.named_children()
            if isinstance(child, nn.ModuleList) and name.endswith("blocks") for block in child]


def broadcast_from_main(module: nn.Module, skip: Collection[nn.Parameter] = ()) -> None:
    """Every rank's parameters and buffers set to rank 0's: freshly initialised adapters differ per rank (each
    rank seeds its RNG apart), and FSDP, unlike DDP, does not broadcast them itself. `skip`: parameters every rank
    made alike itself (quantized base weights, which a broadcast cannot carry)."""
    import torch.distributed as dist

    skipped = {id(p) for p in skip}
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:
            if id(tensor) not in skipped:
                dist.broadcast(tensor.data, src=0)


def quantized_parameters(module: nn.Module) -> set[nn.Parameter]:
    """The frozen parameters `memory.base_weights` stores quantized: float8 storage (layerwise casting), or a
    quantized tensor class (torchao's int8, bitsandbytes' NF4). FSDP cannot shard them (its all-gather needs one
    plain dtype per block), so each rank keeps them whole."""
    float8 = {torch.float8_e4m3fn, torch.float8_e5m2}
    return {p for p in module.parameters()
            if not p.requires_grad and (p.dtype in float8 or type(p) not in (torch.Tensor, nn.Parameter))}


def shard(module: nn.Module, options: dict[str, Any], parts: Collection[nn.Module]) -> None:
    """`fully_shard` on every transformer block of each of `parts` (the denoisers inside `module`, or `module`
    itself: `ModelSpec.denoiser_parts`), then on the rest of `module`."""
    from torch.distributed.fsdp import fully_shard

    for block in [block for part in parts for block in transformer_blocks(part)]:
        fully_shard(block, **options)
    fully_shard(module, **options)


@contextlib.contextmanager
def weights_not_read(spec: ModelSpec) -> Iterator[None]:
    """While inside: `spec` builds every component it loads from its config.json on the meta device, in the dtype
    it asks for; no weight is read (the spec's own loading code runs, only `load_component` is replaced)."""

    def load_component(self: ModelSpec, cls: Any, component: str, **kwargs: Any) -> Any:
        with torch.device(META):
            model = cls.from_config(self.load_config(cls, component))
        dtype = kwargs.get("torch_dtype")
        return model.to(dtype) if dtype is not None else model

    spec.load_component = types.MethodType(load_component, spec)
    try:
        yield
    finally:
        del spec.load_component


def match_main_layout(module: nn.Module) -> dict[str, torch.Tensor] | None:
    """Before sharding a module that only rank 0 loaded: rank 0's whole state (its tensors, not copies; None on the
    other ranks), and on the other ranks every parameter and buffer in rank 0's dtype (loading may keep some layers
    in another dtype than the one asked for). A module of another layout is a ModelError."""
    tensors = dict(module.named_parameters()) | dict(module.named_buffers())
    layout = parallel.broadcast_object({name: (tuple(t.shape), t.dtype) for name, t in tensors.items()})
    mine = {name: (tuple(t.shape), t.dtype) for name, t in tensors.items()}
    differ = sorted(name for name in layout.keys() | mine.keys()
                    if name not in layout or name not in mine or layout[name][0] != mine[name][0])
    if differ:
        raise ModelError(f"rank {parallel.rank()} built the denoiser otherwise than rank 0, which loaded it (e.g. "
                         f"{', '.join(differ[:3])}).\nWhat to do: set parallel.load_on_rank0=false (every rank then "
                         "loads the weights) and report this model.")
    with torch.no_grad():
        for name, tensor in tensors.items():
            if tensor.dtype != layout[name][1]:
                tensor.data = tensor.data.to(layout[name][1])
    return module.state_dict() if parallel.is_main() else None


def fill_from_main(module: nn.Module, whole: dict[str, torch.Tensor] | None, shards_on: torch.device,
                   device: torch.device) -> None:
    """After sharding: every rank's shards of rank 0's state `whole` (None on the other ranks, whose module is on
    the meta device, its shards then made on `shards_on`), sent by rank 0 one tensor at a time; the buffers (on
    `device`) as rank 0 has them, also those outside the state dict (rotary tables)."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    if not parallel.is_main():
        module.to_empty(device=shards_on)
    set_model_state_dict(module, whole or {}, options=StateDictOptions(full_state_dict=True,
                                                                         broadcast_from_rank0=True))
    with torch.no_grad():
        for owner in module.modules():
            for name, buffer in owner._buffers.items():
                if buffer is None:
                    continue
                if buffer.device != device:  # CPU offload keeps the shards in host memory, buffers on the GPU
                    owner._buffers[name] = buffer = buffer.to(device)
                dist.broadcast(buffer, src=0)


class FullyShardedStrategy(Strategy):
    name = "fsdp"
    kept_whole: Collection[nn.Parameter] = ()  # quantized base weights: on every rank whole, never sharded
    forwards_gather_weights = True

    def check(self) -> None:
        settings, world = self.config.parallel, parallel.world_size()
        if settings.load_on_rank0 is True and self.config.memory.base_weights != "auto":
            raise ConfigError(f"parallel.load_on_rank0=true with memory.base_weights={self.config.memory.base_weights}:"
                              " every rank quantizes its own whole copy of the base, so every rank reads the weights "
                              "(a quantized tensor cannot be sent from rank 0). What to do: remove "
                              "parallel.load_on_rank0 (auto), or set memory.base_weights=auto.")
        if settings.replicate_degree > 1 and world % settings.replicate_degree:
            raise ConfigError(f"parallel.replicate_degree={settings.replicate_degree} does not divide the "
                              f"{world} processes. What to do: set it to the number of nodes (each node then holds "
                              "one whole copy, sharded over its GPUs), or 1 to shard over all processes.")

    # ----- sharding ---------------------------------------------------------------------------------------------
    def mesh(self) -> Any:
        """The ranks' layout: 1-D (shard over all), or 2-D (replicate, shard) for HSDP."""
        from torch.distributed.device_mesh import init_device_mesh

        world, replicas = parallel.world_size(), self.config.parallel.replicate_degree
        if replicas == 1:
            return init_device_mesh(self.device.type, (world,))
        return init_device_mesh(self.device.type, (replicas, world // replicas),
                                mesh_dim_names=("replicate", "shard"))

    def shard_options(self) -> dict[str, Any]:
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

        precision = self.config.training.precision
        bf16 = precision == "bf16" or (precision == "auto" and self.device.type == "cuda")
        options: dict[str, Any] = {
            "mesh": self.mesh(),
            "reshard_after_forward": self.config.parallel.reshard_after_forward,
            # bf16 weights in forward and backward; gradients averaged (and kept) in fp32.
            "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16
            else MixedPrecisionPolicy(),
        }
        if self.config.parallel.cpu_offload:
            options["offload_policy"] = CPUOffloadPolicy()
        return options

    @property
    def loads_on_rank0(self) -> bool:
        """`parallel.load_on_rank0` for this run: `auto` is on with several processes, unless the base weights are
        quantized (every rank quantizes its own whole copy: a quantized tensor cannot be sent from rank 0)."""
        setting = self.config.parallel.load_on_rank0
        quantized = self.config.memory.base_weights != "auto"
        return parallel.world_size() > 1 and (setting is True or (setting == "auto" and not quantized))

    def load_denoiser(self, spec: ModelSpec, load_on: torch.device) -> nn.Module:
        """With `load_on_rank0`: rank 0 reads the weights into CPU memory (sharding moves each rank's part to its
        device), the other ranks build the denoiser on the meta device."""
        if not self.loads_on_rank0:
            return super().load_denoiser(spec, load_on)
        self.spec = spec
        if parallel.is_main():
            return spec.load_denoiser(self.device, torch.device("cpu"))
        with weights_not_read(spec):
            return spec.load_denoiser(self.device, META)

    def prepare(self, module: nn.Module, parameters: list[nn.Parameter]) -> list[nn.Parameter]:
        """Shard `module` in place (each block, then the rest); returns the sharded trainable parameters, which
        replace the ones given (FSDP swaps every parameter for a DTensor of this rank's shard)."""
        self.module = module
        if not parallel.is_distributed():
            return parameters  # one process: nothing to shard, checkpoints are still DCP folders
        self.family.keep_weights_placed(module)  # FSDP places the shards: no weight may move under it
        names = {id(p): name for name, p in module.named_parameters()}
        trained = [names[id(p)] for p in parameters]
        self.kept_whole = quantized_parameters(module)
        self.shard_like_main(module, self.kept_whole)
        sharded = dict(module.named_parameters())
        return [sharded[name] for name in trained]

    def prepare_frozen(self, module: nn.Module) -> nn.Module:
        """The teacher of a fully trained student is sharded like the student: held whole it would cost every GPU
        the whole model again, which is what FSDP is used to avoid. Frozen shards take no optimizer state and no
        gradients; each teacher forward gathers one block at a time, as the student's do."""
        if parallel.is_distributed():
            self.shard_like_main(module)
        return module

    def shard_like_main(self, module: nn.Module, kept_whole: Collection[nn.Parameter] = ()) -> None:
        """Shard `module` with rank 0's weights on every rank: filled from rank 0 after sharding (load_on_rank0),
        or, when every rank loaded them, made equal before (fresh adapters differ per rank). `kept_whole`: the
        quantized base weights, which every rank built alike and FSDP leaves unsharded."""
        options = {**self.shard_options(), "ignored_params": set(kept_whole)}
        parts = self.family.denoiser_parts(module).values()
        if not self.loads_on_rank0:
            broadcast_from_main(module, skip=kept_whole)
            shard(module, options, parts)
            return
        whole = match_main_layout(module)
        shard(module, options, parts)
        shards_on = torch.device("cpu") if self.config.parallel.cpu_offload else self.device
        fill_from_main(module, whole, shards_on, self.device)

    def accumulating(self, module: nn.Module, sync: bool) -> contextlib.AbstractContextManager:
        return _gradient_sync(module, sync)

    # ----- checkpoints --------------------------------------------------------------------------------------------
    def checkpointer(self) -> ShardedCheckpointer:
        """Every rank writes its shard of the weights, optimizer state and average (one process too: the format
        does not depend on the number of processes)."""
        return ShardedCheckpointer(self)

    # ----- results ----------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def gathered(self, module: nn.Module, everything: bool = False) -> Iterator[None]:
        """Every block's weights gathered on every rank (one all-gather each) and held, within the block, as
        ordinary parameters of their own: rank 0 alone may then run forwards (validation samples) and save them
        (safetensors cannot write views into FSDP's all-gather buffers). Sharded again at the end."""
        from torch.distributed.fsdp import FSDPModule

        if not isinstance(module, FSDPModule):
            yield
            return
        units = [unit for unit in module.modules() if isinstance(unit, FSDPModule)]
        groups = [group for unit in units if (group := unit._get_fsdp_state()._fsdp_param_group) is not None]
        for unit in units:
            unit.unshard()
            # Rank 0 alone runs forwards within the block: none may free the weights (all ranks would have to
            # gather them again).
            unit.set_reshard_after_forward(False, recurse=False)
        # FSDP's state-dict hooks would put the shards back into the module when rank 0 reads its weights.
        for group in groups:
            _remove_state_dict_hooks(group)
        gathered = _own_parameters(module, skip=self.kept_whole)
        # fully_shard gives the module a class `FSDP<Name>`; diffusers' save_pretrained writes the class name into
        # config.json, which must stay the model's own for the saved weights to load.
        sharded_class = type(module)
        module.__class__ = next(base for base in sharded_class.__bases__ if base is not FSDPModule)
        try:
            # The weights' average gathered too, standing for the gathered weights (what `EMA.applied` swaps in).
            with self.ema.whole(dict(module.named_parameters())) if self.ema else contextlib.nullcontext():
                yield
        finally:
            module.__class__ = sharded_class
            for owner, name, parameter in gathered:
                owner._parameters[name] = parameter
            for group in groups:
                group._register_state_dict_hooks()
            for unit in units:
                unit.set_reshard_after_forward(self.config.parallel.reshard_after_forward, recurse=False)
                unit.reshard()


def _remove_state_dict_hooks(group: Any) -> None:
    for handles in (group._module_to_pre_save_state_dict_hook_handle,
                    group._module_to_pre_load_state_dict_hook_handle):
        for handle in handles.values():
            handle.remove()
        handles.clear()


def _own_parameters(module: nn.Module, skip: Collection[nn.Parameter] = ()
                    ) -> list[tuple[nn.Module, str, nn.Parameter]]:
    """Replace every parameter of `module` (but those of `skip`, which FSDP left alone) by a copy with storage of
    its own; returns what it replaced."""
    skipped = {id(p) for p in skip}
    replaced = []
    with torch.no_grad():
        for owner in module.modules():
            for name, parameter in list(owner._parameters.items()):
                if parameter is None or id(parameter) in skipped:
                    continue
                owner._parameters[name] = nn.Parameter(parameter.detach().clone(),
                                                       requires_grad=parameter.requires_grad)
                replaced.append((owner, name, parameter))
    return replaced


@contextlib.contextmanager
def _gradient_sync(module: nn.Module, sync: bool) -> Iterator[None]:
    """Micro-batches before the last of an accumulation keep their gradients unsharded and unreduced."""
    from torch.distributed.fsdp import FSDPModule

    if sync or not isinstance(module, FSDPModule):
        yield
        return
    module.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        module.set_requires_gradient_sync(True)
