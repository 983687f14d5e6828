"""Which strategy a run uses: `parallel.strategy` (and, with `auto`, the number of processes) -> a `Strategy`
(vidtune/parallel/strategy.py); with `parallel.context` under torchrun, the same strategy with each sample's tokens
split over a data group (vidtune/parallel/context.py)."""

from __future__ import annotations

import torch

from vidtune import parallel
from vidtune.config import Config
from vidtune.parallel import context
from vidtune.parallel.ddp import DataParallelStrategy
from vidtune.parallel.deepspeed import DeepSpeedStrategy
from vidtune.parallel.fsdp import FullyShardedStrategy
from vidtune.parallel.strategy import Strategy


def choose_strategy(config: Config, device: torch.device) -> Strategy:
    """The strategy `parallel.strategy` names for this process (see vidtune/parallel/strategy.py)."""
    name = config.parallel.strategy
    if parallel.context_degree(config.parallel.context.degree) > 1:  # one process: nothing to split over
        return _checked(context.ContextFullySharded(config, device) if name == "fsdp"
                        else context.ContextDataParallel(config, device))
    if name == "fsdp":
        strategy: Strategy = FullyShardedStrategy(config, device)
    elif name == "ddp" or (name == "auto" and parallel.world_size() > 1):
        strategy = DataParallelStrategy(config, device)
    elif name == "deepspeed":
        strategy = DeepSpeedStrategy(config, device)
    else:
        strategy = Strategy(config, device)
    return _checked(strategy)


def _checked(strategy: Strategy) -> Strategy:
    strategy.check()
    return strategy
