"""The cheapest change of settings that makes a plan fit a memory budget.

Each saver has an estimated step-time factor (the order of their costs as the field knows it; not measured here,
see docs/benchmarks.md). The stages are independent: the precompute stage's savers (8-bit / 4-bit text encoders,
VAE tiling) are chosen for it alone, and training from the cache (`precompute.enabled=true`) takes the encoders off
the training device. For training, every combination of the savers is planned (the traced steps are re-used, so
each costs only the accounting) and the cheapest that fits wins; block swap, the slowest, comes last, with the
fewest blocks that fit.

A suggestion leaves headroom on the card (`usable_gib`): its planned peak is at most 90 % of the card, or the card
less the planner's largest measured error, whichever is smaller. The plan does not model the allocator's rounding,
fragmentation or the CUDA context, and a plan that fills the card to the last megabyte fails on the first
fragmented step.

A suggestion must fit the host as well (`host_gib`): what the savers keep in host memory (activation offload's
pinned copies, swapped blocks, the CPU-offload optimizer's state, loading a quantized base) stays within it, less
`HOST_RESERVE_GIB` for the system, Python and the CUDA libraries. Activation offload without gradient
checkpointing moves every saved activation of the step to the host and back (hundreds of GiB for a large clip);
with checkpointing only the blocks' inputs move, so offload is ranked cheap beside checkpointing and dear alone,
and checkpointing comes first whenever memory is the limit.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from vidtune.algorithms import traits_of
from vidtune.config import Config, apply_overrides, build_config
from vidtune.memory.context import context_choices
from vidtune.memory.plan import (
    GIB,
    MemoryPlan,
    plan_memory,
    planned_device,
    resolve_architecture,
    traced_step,
    transformer_blocks,
)
from vidtune.models.registry import get_spec_class

# Estimated step time relative to the plain run (1.0): used only to rank the changes.
# Activation offload copies every saved activation to the host and back each step: without checkpointing that is
# tens of GiB a step, so it ranks after everything but block swap.
COST = {
    "training.gradient_checkpointing=true": 1.25,
    "memory.base_weights=fp8": 1.05,
    "memory.base_weights=int8": 1.1,
    "memory.base_weights=nf4": 1.15,
    "optimizer.name=adamw8bit": 1.01,
    "optimizer.cpu_offload=true": 1.15,
    "memory.activation_offload=true": 1.6,
}
# Activation offload beside gradient checkpointing: only each block's input is copied, overlapped with compute.
OFFLOAD_WITH_CHECKPOINTING = 1.1
# The share of a card a plan may fill, and the planner's largest under-estimate of a measured peak (the tiny rows of
# docs/benchmarks.md, "Memory planner: planned vs measured": ratios 0.976-1.008).
HEADROOM_SHARE = 0.9
PLANNER_ERROR = 0.024
# Host memory the planner does not count: the system, the Python process, torch's and CUDA's libraries.
HOST_RESERVE_GIB = 4.0
SWAP_COST_PER_BLOCK_SHARE = 0.5  # block swap: + this x the share of blocks swapped


@dataclass(frozen=True)
class Suggestion:
    overrides: list[str]  # `key=value` settings, empty when the config fits as it is
    plan: MemoryPlan
    cost: float  # estimated step time relative to the config as it is


def with_overrides(config: Config, overrides: list[str]) -> Config:
    """`config` with `section.key=value` settings applied (validated like the command line's)."""
    return build_config(apply_overrides(config.to_dict(), overrides))


def host_budget(host_gib: float | None) -> float:
    """The bytes of host memory the savers may take on a host of `host_gib` (no limit when None)."""
    return math.inf if host_gib is None else max(host_gib - HOST_RESERVE_GIB, 0.0) * GIB


def usable_gib(card_gib: float) -> float:
    """How much of a card of `card_gib` a plan may fill: 90 % of it, or the card less the planner's measured error,
    whichever is smaller."""
    return min(HEADROOM_SHARE * card_gib, card_gib * (1 - PLANNER_ERROR))


def fits(plan: MemoryPlan, budget_gib: float, host_gib: float | None = None) -> bool:
    """The plan fits a card of `budget_gib` with its headroom (`usable_gib`) and a host of `host_gib` (see
    `host_budget`)."""
    return plan.peak <= usable_gib(budget_gib) * GIB and plan.host_peak <= host_budget(host_gib)


def suggest(config: Config, budget_gib: float, world_size: int = 1,
            host_gib: float | None = None) -> Suggestion | None:
    """The cheapest overrides whose plan fits a card of `budget_gib` with its headroom (`usable_gib`) and `host_gib` of
    host memory (None: the host is not checked); None when nothing vidtune offers does."""
    budget = usable_gib(budget_gib) * GIB
    plan = plan_memory(config, world_size)
    if fits(plan, budget_gib, host_gib):
        return Suggestion([], plan, 1.0)
    precompute = _precompute_overrides(config, budget, world_size)
    if precompute is None:
        return None
    best: Suggestion | None = None
    for changes in _training_changes(config):
        overrides = [*precompute, *changes]
        cost = _cost(changes, config)
        if best is not None and cost >= best.cost:
            continue
        candidate = with_overrides(config, overrides)
        plan = plan_memory(candidate, world_size)
        if fits(plan, budget_gib, host_gib):
            best = Suggestion(overrides, plan, cost)
            continue
        if plan.host_peak > host_budget(host_gib):
            continue  # block swap only adds to the host's share
        swap = _fewest_blocks(candidate, budget, world_size)
        if swap is not None and swap[1].host_peak <= host_budget(host_gib):
            blocks, swapped, share = swap
            cost *= 1 + SWAP_COST_PER_BLOCK_SHARE * share
            if best is None or cost < best.cost:
                best = Suggestion([*overrides, f"memory.blocks_to_swap={blocks}"], swapped, cost)
    return best or _split_over_gpus(config, budget_gib, world_size, host_gib)


def _split_over_gpus(config: Config, budget_gib: float, world_size: int, host_gib: float | None) -> Suggestion | None:
    """When nothing else fits one GPU's share: the smallest context degree (`parallel.context`) of the GPUs with
    which the clip fits, with the savers it then still needs."""
    if world_size < 2 or config.parallel.context.degree > 1:
        return None
    if isinstance(get_spec_class(config.model.name).context_parallel_plan(), str):
        return None  # a family whose tokens cannot be split
    resolved, _ = resolve_architecture(config)
    denoiser = traced_step(resolved, planned_device(resolved)).denoiser
    heads = int(getattr(denoiser, "config", {}).get("num_attention_heads") or 1)
    for split in context_choices(config, world_size, heads):
        found = suggest(with_overrides(config, split), budget_gib, world_size, host_gib)
        if found is not None:
            return Suggestion([*split, *found.overrides], found.plan, found.cost)
    return None


def _cost(changes: list[str], config: Config) -> float:
    checkpointing = config.training.gradient_checkpointing or "training.gradient_checkpointing=true" in changes
    cost = 1.0
    for change in changes:
        if change == "memory.activation_offload=true" and checkpointing:
            cost *= OFFLOAD_WITH_CHECKPOINTING
        else:
            cost *= COST.get(change, 1.0)
    return cost


def _precompute_overrides(config: Config, budget: float, world_size: int) -> list[str] | None:
    """Train from the cache (when the encoders do not fit beside the denoiser), then the cheapest text encoder and
    VAE settings with which each precompute stage fits alone."""
    overrides = [] if config.precompute.enabled else ["precompute.enabled=true"]
    choices = [[""], ["memory.vae_tiling=true"]] if not config.memory.vae_tiling else [[""]]
    text = ["", "memory.text_encoder_weights=fp8", "memory.text_encoder_weights=int8",
            "memory.text_encoder_weights=nf4"] if config.memory.text_encoder_weights == "auto" else [""]
    for tiling, weights in itertools.product(choices, text):
        changes = [change for change in (*tiling, weights) if change]
        plan = plan_memory(with_overrides(config, [*overrides, *changes]), world_size)
        if all(stage <= budget for stage in plan.precompute.values()):
            return [*overrides, *changes]
    return None


def _adapter_only(config: Config) -> bool:
    """Whether only an adapter trains, so the frozen base may be stored smaller or swapped (a control algorithm's
    widened input layer trains fully beside its adapter: left to the user's settings; an in-context LoRA has none)."""
    traits = traits_of(config)
    return traits.trains_adapter and (not traits.control or traits.in_context)


def _training_changes(config: Config) -> list[list[str]]:
    """Every combination of the training-stage savers that applies to `config`, cheapest first."""
    options: list[list[str]] = []
    if not config.training.gradient_checkpointing:
        options.append(["", "training.gradient_checkpointing=true"])
    if _adapter_only(config) and config.memory.base_weights == "auto" and not config.lora.use_dora:
        float8 = get_spec_class(config.model.name).float8_refusal is None  # a family that cannot is not offered it
        options.append(["", *(["memory.base_weights=fp8"] if float8 else []), "memory.base_weights=int8",
                        "memory.base_weights=nf4"])
    if config.optimizer.name == "adamw":
        options.append(["", "optimizer.name=adamw8bit"])
    if not config.optimizer.cpu_offload:
        options.append(["", "optimizer.cpu_offload=true"])
    if not config.memory.activation_offload:
        options.append(["", "memory.activation_offload=true"])
    combos = [[change for change in combo if change] for combo in itertools.product(*options)]
    return sorted(combos, key=lambda changes: (_cost(changes, config), len(changes)))


def _fewest_blocks(config: Config, budget: float, world_size: int) -> tuple[int, MemoryPlan, float] | None:
    """The fewest `memory.blocks_to_swap` with which `config` fits (bisection: weights fall as blocks leave)."""
    if not _adapter_only(config) or config.memory.blocks_to_swap:
        return None
    resolved, _ = resolve_architecture(config)
    device = planned_device(resolved)
    total = len(transformer_blocks(traced_step(resolved, device).denoiser))
    if total == 0:  # no block lists block swap knows (Wan 2.2 A14B's two experts)
        return None
    plan = plan_memory(with_overrides(config, [f"memory.blocks_to_swap={total}"]), world_size)
    if plan.peak > budget:
        return None
    low, high, fitting = 1, total, plan
    while low < high:
        middle = (low + high) // 2
        candidate = plan_memory(with_overrides(config, [f"memory.blocks_to_swap={middle}"]), world_size)
        if candidate.peak <= budget:
            high, fitting = middle, candidate
        else:
            low = middle + 1
    if high != total:
        fitting = plan_memory(with_overrides(config, [f"memory.blocks_to_swap={high}"]), world_size)
    return high, fitting, high / total
