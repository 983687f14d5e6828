"""`training.compile`: torch.compile per transformer block (regional compilation).

Compiling each repeated block instead of the whole denoiser keeps the compile time to one block's graph (seconds
to a few minutes), reused by every block of the same class: with torch's default of inlining nn.Module calls, the
parameters are graph inputs, so one compiled graph serves all of them (two in fact: the first block's input
carries no gradient). It is done after the adapter is added and the base weights are stored (int8, fp8), so LoRA
layers and quantized weights are traced with the block. fp8 storage inside the blocks is an upcast within each
linear layer's forward (vidtune/memory/float8.py) rather than diffusers' hooks, whose in-place casts a compiled
backward cannot follow. Gradient checkpointing keeps working: diffusers calls the (compiled) block inside
torch.utils.checkpoint.

Parallel runs: the blocks are compiled before DDP wraps the denoiser or FSDP2 shards it (torchtitan's order).
DDP only sees the compiled blocks as modules of the one it wraps, so its gradient hooks stay outside the graphs
(no DDPOptimizer graph splitting, which only applies when the DDP module itself is compiled). `fully_shard`
puts its all-gather / reshard hooks around each compiled block; FSDP2 marks them `torch._dynamo.disable`, so they
run eagerly and a block's graph sees its gathered, unsharded weights.

Shapes: each bucket shape is compiled on its first batch (static shapes give the fastest kernels and a run has a
handful of buckets); a block sees only the number of latent tokens, so bucket shapes of equal token count share
one compilation. The recompile limit is raised to allow them all. Compiling once with symbolic shapes
(`dynamic`, kept for bench/speed.py --buckets) gave slower steps on the CPU and no clear saving in compile time
(docs/benchmarks.md), so runs compile per shape. The time spent compiling is measured from torch's own compile
metrics, reported apart from the step time, and logged with the bucket shapes of the step it happened in.

Validation samples run eagerly (`eager`): sampling shapes (guidance doubles the batch, other sizes) would each
cost a compilation for a few denoising steps.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator

import torch
import torch.fx.experimental._config
from torch import nn

from vidtune.errors import ConfigError

logger = logging.getLogger(__name__)

# The graphs a block may need per bucket shape: training the first block (its input carries no gradient), training
# the others, and a no-grad forward (a distillation teacher).
GRAPHS_PER_SHAPE = 3


def repeated_blocks(denoiser: nn.Module) -> list[nn.Module]:
    """The denoiser's transformer blocks: the classes diffusers names in `_repeated_blocks`, else the children of
    its largest ModuleList (CogVideoX and Mochi declare none)."""
    names = set(getattr(denoiser, "_repeated_blocks", None) or ())
    if names:
        blocks = [module for module in denoiser.modules() if type(module).__name__ in names]
        if blocks:
            return blocks
    lists = [module for module in denoiser.modules() if isinstance(module, nn.ModuleList) and len(module) > 0]
    if not lists:
        return []
    largest = max(lists, key=lambda blocks: sum(p.numel() for p in blocks.parameters()))
    return list(largest)


def compile_blocks(denoiser: nn.Module, num_shapes: int, dynamic: bool = False) -> int:
    """Compile each transformer block in place, once per bucket shape (`dynamic`: once with symbolic shapes for
    all of them); returns how many blocks were compiled."""
    blocks = repeated_blocks(denoiser)
    if not blocks:
        raise ConfigError(
            f"training.compile: no transformer blocks found in {type(denoiser).__name__} to compile.\n"
            "What to do: set training.compile=false for this model."
        )
    # One graph per bucket shape (and grad mode): allow them all without hitting torch's recompile limit.
    needed = max(8, GRAPHS_PER_SHAPE * num_shapes)
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, needed)
    config.accumulated_recompile_limit = max(config.accumulated_recompile_limit, needed * 8)
    if dynamic:
        # Duck sizing would tie every two sizes that happen to be equal at the first shape (the token count and
        # a channel count, say) and compile again when a bucket parts them.
        torch.fx.experimental._config.use_duck_shape = False
    for block in blocks:
        block.compile(dynamic=dynamic)
    plural = "" if num_shapes == 1 else "s"
    how = (f"once with dynamic shapes for the {num_shapes} bucket shape{plural}" if dynamic
           else f"at most once per bucket shape ({num_shapes} shape{plural}), each when its first batch comes")
    logger.info("training.compile: %d %s blocks compiled with torch.compile, %s.", len(blocks),
                type(blocks[0]).__name__, how)
    return len(blocks)


def compile_note(seconds: float, step: int, shapes: Iterable[tuple[int, int, int]]) -> str:
    """The line announcing a step that compiled: how long it took and the bucket shapes of its micro-batches."""
    described = ", ".join(dict.fromkeys(f"{frames}x{height}x{width}" for frames, height, width in shapes))
    return (f"training.compile: {seconds:.1f} s compiling during step {step}, for bucket shape {described} "
            "(frames x height x width; not counted in its seconds_per_step).")


def compile_seconds() -> float:
    """Seconds spent compiling in this process so far (forward and backward graphs), from torch's own metrics."""
    from torch._dynamo.utils import compilation_time_metrics

    # Dynamo's frame compilations (forward graphs, with inductor inside); backward graphs compile lazily on
    # the first backward, outside any frame.
    frames = sum(compilation_time_metrics.get("_compile.compile_inner", ()))
    backward = sum(compilation_time_metrics.get("compile_fx.<locals>.bw_compiler", ()))
    return frames + backward


@contextlib.contextmanager
def eager() -> Iterator[None]:
    """Run compiled modules eagerly inside (validation samples)."""
    with torch.compiler.set_stance("force_eager"):
        yield
