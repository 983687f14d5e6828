"""Memory savers that move tensors between the training device and host memory while a step runs.

`memory.blocks_to_swap: N` (`BlockSwap`): the frozen weights of the denoiser's last N transformer blocks live in
(pinned) host memory. Each is copied to the training device just before the block runs forward, and again just
before its backward (the backward pass, and the recomputation of gradient checkpointing, need the weights once
more); the copy of the next block in the pass's direction is started on a side stream while the current block
computes. At most two swapped blocks are on the device at a time (the one computing and the one arriving); the
others point back at their host copies, so their device memory is free.

Only frozen parameters move. Trainable ones (LoRA matrices, DoRA magnitudes) stay on the device all the time: the
optimizer's state and the gradients sit beside them, the gradient clipping and the optimizer step see one device,
and they are small. That is why block swap is for adapter algorithms; full fine-tuning trains the blocks' weights
themselves and is refused.

Autograd keeps what a layer saved for its backward (for a linear layer: a view of its weight) until that backward
runs, so without gradient checkpointing the device copies of all blocks would stay alive until the backward pass
anyway. Block swap therefore needs `training.gradient_checkpointing` (or `memory.activation_offload`, which moves
those saved tensors to host memory as well).

`memory.activation_offload` (`activation_offload`): the tensors autograd saves during the denoiser's forward go to
pinned host memory and come back for the backward (`torch.autograd.graph.save_on_cpu`).

Both act on CUDA only; elsewhere a one-line notice says they are off (`apply_block_swap` /
`activation_offload`). The swap itself is written for any pair of devices, so its hooks run (and are tested) on
the CPU as well.

`loading_device`: a quantized base for a GPU is loaded and quantized in host memory, then moved, so loading
never needs the unquantized model's size on the GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from vidtune.errors import ConfigError

if TYPE_CHECKING:
    from vidtune.algorithms import AlgorithmTraits

# How many swapped blocks may be on the compute device at once: the one computing and the one being prefetched.
RESIDENT_BLOCKS = 2


def notice(message: str) -> None:
    print(message, flush=True)


def swappable_blocks(denoiser: nn.Module, block_lists: Sequence[str]) -> list[nn.Module]:
    """The denoiser's transformer blocks in forward order: the `nn.ModuleList`s the spec names, one after another."""
    blocks: list[nn.Module] = []
    for name in block_lists:
        found = getattr(denoiser, name, None)
        if not isinstance(found, nn.ModuleList):
            raise ConfigError(
                f"memory.blocks_to_swap: the denoiser ({type(denoiser).__name__}) has no block list '{name}'.\n"
                "What to do: set memory.blocks_to_swap=0; this model's layout is not one block swap knows."
            )
        blocks.extend(found)
    return blocks


def is_plain(tensor: torch.Tensor) -> bool:
    """A tensor of torch's own kind (not a quantized subclass), which can be pinned and copied in place."""
    return type(tensor) in (torch.Tensor, nn.Parameter)


@dataclass
class SwappedBlock:
    """One block's frozen parameters: their host copies, and whether the device copies are in place."""

    index: int  # position in forward order among all blocks
    module: nn.Module
    # (owner module, parameter name, host copy)
    stored: list[tuple[nn.Module, str, torch.Tensor]] = field(default_factory=list)
    resident: bool = False
    ready: torch.cuda.Event | None = None  # recorded on the copy stream when a prefetch has been issued

    @property
    def plain(self) -> bool:
        """Only plain tensors: pinned, copied on the side stream. Quantized subclasses (int8, nf4) are copied on the
        compute stream instead, where the memory they arrive in needs no hand-over between streams."""
        return all(is_plain(host) for _, _, host in self.stored)


class BlockSwap:
    """Keeps the frozen weights of `swapped` blocks on `storage` and brings each to `compute` when it runs.

    `blocks` are all blocks in forward order (hooks on the unswapped ones start the prefetch of the next swapped
    block); `swapped` are the indices of the blocks whose weights move. On CUDA the copies run on a side stream and
    the compute stream waits for them only when the block is about to run.
    """

    def __init__(self, blocks: Sequence[nn.Module], swapped: Sequence[int], storage: torch.device,
                 compute: torch.device, resident_blocks: int = RESIDENT_BLOCKS) -> None:
        self.blocks = list(blocks)
        self.storage, self.compute = storage, compute
        self.resident_blocks = resident_blocks  # 1: no prefetch (each block arrives when it is needed)
        self.stream = torch.cuda.Stream(compute) if compute.type == "cuda" else None
        self.swapped = {index: SwappedBlock(index, self.blocks[index]) for index in sorted(swapped)}
        self.order: list[int] = []  # resident swapped blocks, oldest first
        self.handles: list[torch.utils.hooks.RemovableHandle] = []
        self.loads = 0  # copies to the compute device so far (for tests and logs)
        for block in self.swapped.values():
            self._store(block)
        for index, module in enumerate(self.blocks):
            self.handles.append(module.register_forward_pre_hook(self._before_forward(index)))
            self.handles.append(module.register_forward_hook(self._after_forward(index)))

    # ----- storage -----------------------------------------------------------------------------------------
    def _store(self, block: SwappedBlock) -> None:
        pin = self.compute.type == "cuda"
        for owner in block.module.modules():
            for name, parameter in owner.named_parameters(recurse=False):
                if parameter.requires_grad:
                    continue  # trained: stays on the compute device with its gradient and optimizer state
                host = _copy(parameter, self.storage)
                if pin and is_plain(host):
                    host = host.pin_memory()
                block.stored.append((owner, name, host))
                _set_parameter(owner, name, host)

    def _copy_in(self, block: SwappedBlock, keep: int | None = None) -> None:
        """Start copying a block's weights to the compute device (on the side stream under CUDA), making room by
        sending the oldest resident blocks back, never block `keep` (the one about to compute)."""
        if block.resident:
            return
        evictable = [index for index in self.order if index != keep]
        while len(self.order) >= self.resident_blocks:
            if not evictable:
                return  # no room for a prefetch: the block is brought by its own hook
            self.release(self.swapped[evictable.pop(0)])
        stream = self.stream if block.plain else None
        context = torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()
        with context:
            for owner, name, host in block.stored:
                _set_parameter(owner, name, _copy(host, self.compute, non_blocking=stream is not None))
            if stream is not None:
                block.ready = torch.cuda.Event()
                block.ready.record(stream)
        block.resident = True
        self.order.append(block.index)
        self.loads += 1

    def _wait_for(self, block: SwappedBlock) -> None:
        """Before the block computes: its copy has landed, and the memory it arrived in is not reused while the
        compute stream still reads it."""
        if block.ready is None:
            return
        current = torch.cuda.current_stream(self.compute)
        current.wait_event(block.ready)
        for owner, name, _ in block.stored:
            getattr(owner, name).record_stream(current)
        block.ready = None

    def release(self, block: SwappedBlock) -> None:
        if not block.resident:
            return
        for owner, name, host in block.stored:
            _set_parameter(owner, name, host)
        block.resident, block.ready = False, None
        if block.index in self.order:
            self.order.remove(block.index)

    def release_all(self) -> None:
        for block in self.swapped.values():
            self.release(block)

    def remove(self) -> None:
        """Take the hooks off; every swapped block's weights back on the compute device for good."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        for block in self.swapped.values():
            self.release(block)
            for owner, name, host in block.stored:
                _set_parameter(owner, name, host.to(self.compute))

    # ----- hooks -------------------------------------------------------------------------------------------
    def _next_swapped(self, index: int, step: int) -> SwappedBlock | None:
        position = index + step
        while 0 <= position < len(self.blocks):
            if position in self.swapped:
                return self.swapped[position]
            position += step
        return None

    def _bring(self, index: int, direction: int) -> None:
        """Block `index` is about to run: have its weights in place, and start the next one's copy."""
        block = self.swapped.get(index)
        if block is not None:
            self._copy_in(block)
            self._wait_for(block)
        following = self._next_swapped(index, direction)
        if following is not None:
            self._copy_in(following, keep=index)

    def _before_forward(self, index: int):
        def hook(module: nn.Module, args: tuple) -> None:
            # During the backward pass this is gradient checkpointing's recomputation: the backward hook of the
            # block's output already brought the block and started the previous one's copy.
            in_backward = torch._C._current_graph_task_id() != -1
            self._bring(index, -1 if in_backward else 1)
        return hook

    def _after_forward(self, index: int):
        def hook(module: nn.Module, args: tuple, output: object) -> None:
            if not torch.is_grad_enabled() or torch._C._current_graph_task_id() != -1:
                return
            # The gradient of the block's output arrives just before the block's own backward: bring it back then.
            for tensor in _tensors(output):
                if tensor.requires_grad:
                    tensor.register_hook(self._before_backward(index))
        return hook

    def _before_backward(self, index: int):
        def hook(grad: torch.Tensor) -> None:
            self._bring(index, -1)
        return hook


def _tensors(output: object) -> Iterator[torch.Tensor]:
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, (tuple, list)):
        for item in output:
            yield from _tensors(item)
    elif isinstance(output, dict):
        for item in output.values():
            yield from _tensors(item)


def _copy(tensor: torch.Tensor, device: torch.device, non_blocking: bool = False) -> torch.Tensor:
    """A copy of `tensor` on `device`, a separate one also when it is there already (the CPU tests): quantized
    subclasses' `to(copy=True)` may share their data."""
    if tensor.device == device:
        return tensor.detach().clone()
    return tensor.to(device, non_blocking=non_blocking)


def _set_parameter(owner: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Point a frozen parameter at `tensor`. A new Parameter object each time: quantized subclasses (torchao's
    int8 tensors) cannot take another's data in place; bitsandbytes' Params4bit are Parameters already and keep
    their quantization state. The optimizer never holds frozen parameters, so their identity does not matter."""
    if isinstance(tensor, nn.Parameter):
        owner._parameters[name] = tensor
    else:
        owner._parameters[name] = nn.Parameter(tensor, requires_grad=False)


def check_swapped_weights_frozen(blocks_to_swap: int, traits: AlgorithmTraits) -> None:
    """Block swap serves adapter training only: an algorithm that trains the base weights needs their gradients
    and optimizer state beside them."""
    if not blocks_to_swap or traits.trains_adapter:
        return
    what = "distillation.student=full" if traits.chooses_student else f"training.algorithm={traits.name}"
    raise ConfigError(
        f"memory.blocks_to_swap={blocks_to_swap} works with adapter algorithms only: {what} trains the "
        "blocks' own weights, whose gradients and optimizer state must stay beside them.\n"
        "What to do: set memory.blocks_to_swap=0, or train an adapter (training.algorithm=lora)."
    )


def check_block_swap(blocks_to_swap: int, traits: AlgorithmTraits, gradient_checkpointing: bool,
                     activation_offload: bool, parallel_strategy: str = "auto", compiled: bool = False) -> None:
    """Before any long work: block swap with what it cannot serve (`traits`: the training algorithm's)."""
    if blocks_to_swap == 0:
        return
    if compiled:
        # A compiled block runs its hooks inside the graph: the swap's copies and stream waits around each
        # block's forward are not something that graph may capture.
        raise ConfigError(
            f"memory.blocks_to_swap={blocks_to_swap} cannot be combined with training.compile=true: the swap moves "
            "each block's weights between host and GPU memory around its forward, outside what a compiled block "
            "may do.\nWhat to do: set training.compile=false to swap blocks, or memory.blocks_to_swap=0 to compile."
        )
    if parallel_strategy in ("fsdp", "deepspeed"):
        raise ConfigError(
            f"memory.blocks_to_swap={blocks_to_swap} cannot be combined with parallel.strategy={parallel_strategy}, "
            "which places the weights itself.\nWhat to do: set memory.blocks_to_swap=0 (sharding already divides "
            "the weights over the GPUs), or use parallel.strategy=ddp."
        )
    check_swapped_weights_frozen(blocks_to_swap, traits)
    if not (gradient_checkpointing or activation_offload):
        raise ConfigError(
            f"memory.blocks_to_swap={blocks_to_swap} needs training.gradient_checkpointing=true: without it the "
            "backward pass keeps every block's weights on the GPU until it runs, and swapping saves nothing.\n"
            "What to do: set training.gradient_checkpointing=true (or memory.activation_offload=true)."
        )


# The denoiser config's key that counts the blocks of each block list.
BLOCK_COUNT_KEYS = {"transformer_blocks": "num_layers", "single_transformer_blocks": "num_single_layers",
                    "blocks": "num_layers", "text_transformer_blocks": "num_text_blocks",
                    "visual_transformer_blocks": "num_visual_blocks"}


def check_block_count(blocks_to_swap: int, block_lists: Sequence[str], denoiser_config: dict) -> None:
    """Before loading: N no larger than the denoiser's blocks, counted from its config.json."""
    counts = [denoiser_config.get(BLOCK_COUNT_KEYS.get(name, "")) for name in block_lists]
    if blocks_to_swap == 0 or not all(isinstance(count, int) for count in counts):
        return  # an unknown layout: `apply_block_swap` counts the loaded blocks
    _check_count(blocks_to_swap, sum(counts))


def _check_count(blocks_to_swap: int, blocks: int) -> None:
    if blocks_to_swap > blocks:
        raise ConfigError(
            f"memory.blocks_to_swap={blocks_to_swap}, but the denoiser has {blocks} transformer blocks.\n"
            f"What to do: set memory.blocks_to_swap to at most {blocks}."
        )


def apply_block_swap(denoiser: nn.Module, block_lists: Sequence[str], blocks_to_swap: int,
                     device: torch.device) -> BlockSwap | None:
    """`memory.blocks_to_swap`: the last N blocks swapped between pinned host memory and `device` (CUDA); a notice
    and nothing else on other devices, or when N is 0."""
    if blocks_to_swap == 0:
        return None
    blocks = swappable_blocks(denoiser, block_lists)
    _check_count(blocks_to_swap, len(blocks))
    if device.type != "cuda":
        notice(f"memory.blocks_to_swap={blocks_to_swap}: block swap works on CUDA only; off on {device.type}.")
        return None
    swap = BlockSwap(blocks, range(len(blocks) - blocks_to_swap, len(blocks)), torch.device("cpu"), device)
    notice(f"Block swap: {blocks_to_swap} of {len(blocks)} transformer blocks live in host memory.")
    return swap


def loading_device(base_weights: str, device: torch.device) -> torch.device:
    """Where the denoiser is loaded and set up before training moves it to `device`.

    Quantized base weights (`memory.base_weights` int8 / fp8 / nf4) for a GPU are loaded in the training dtype into
    host memory, quantized there (nf4: as each layer moves to the GPU) and only then moved to the GPU, so the GPU
    never holds the unquantized model, only the quantized one: a 13B model quantized to int8 fits a 16 GB card that
    its 26 GB of bf16 weights would not. Host memory holds the unquantized model for a moment instead."""
    if base_weights != "auto" and device.type == "cuda":
        return torch.device("cpu")
    return device


def activation_offload(enabled: bool, device: torch.device) -> contextlib.AbstractContextManager:
    """`memory.activation_offload`: the context the denoiser's forward runs in. Saved tensors go to pinned host
    memory on CUDA; elsewhere nothing changes (the notice is given once, by `check_activation_offload`)."""
    if enabled and device.type == "cuda":
        return torch.autograd.graph.save_on_cpu(pin_memory=True)
    return contextlib.nullcontext()


def check_activation_offload(enabled: bool, device: torch.device) -> None:
    if enabled and device.type != "cuda":
        notice(f"memory.activation_offload: works on CUDA only; off on {device.type}.")
