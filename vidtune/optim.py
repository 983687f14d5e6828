"""Optimizers and learning-rate schedules by name.

Each optimizer is described once in `OPTIMIZERS`: the package (and pip extra) it needs, how to build it, and the
group settings the config controls. Those settings are applied when the optimizer is built and again after a
checkpoint's optimizer state is loaded (`group_settings`), so a resumed run follows the config, not the saved
values, while its per-parameter state (moments, factored statistics, quantized blocks, Prodigy's d) is restored
exactly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from diffusers.optimization import get_scheduler
from torch import nn

from vidtune.config import Config
from vidtune.errors import ConfigError


@dataclass(frozen=True)
class OptimizerInfo:
    load: Callable[[], type[torch.optim.Optimizer]]  # imports the optimizer's package: only when it is chosen
    settings: Callable[[Config], dict[str, Any]]  # the group settings taken from the config
    package: str | None = None  # the package `load` imports, and the pip extra installing it; None: torch
    extra: str | None = None


def _adam_settings(config: Config) -> dict[str, Any]:
    options = config.optimizer
    return {"betas": (options.beta1, options.beta2), "eps": options.eps, "weight_decay": options.weight_decay}


def _came_settings(config: Config) -> dict[str, Any]:
    # CAME's third beta (the confidence's decay) keeps the paper's 0.9999; its eps are not AdamW's eps.
    options = config.optimizer
    return {"betas": (options.beta1, options.beta2, 0.9999), "weight_decay": options.weight_decay}


def _weight_decay_only(config: Config) -> dict[str, Any]:
    return {"weight_decay": config.optimizer.weight_decay}


def _bitsandbytes(name: str) -> OptimizerInfo:
    def load() -> type[torch.optim.Optimizer]:
        import bitsandbytes.optim

        return getattr(bitsandbytes.optim, name)

    return OptimizerInfo(load, _adam_settings, "bitsandbytes", "bitsandbytes")


def _torchao(name: str) -> OptimizerInfo:
    def load() -> type[torch.optim.Optimizer]:
        import torchao.optim

        return getattr(torchao.optim, name)

    return OptimizerInfo(load, _adam_settings, "torchao", "torchao")


def _prodigy() -> type[torch.optim.Optimizer]:
    from prodigyopt import Prodigy

    return Prodigy


def _came() -> type[torch.optim.Optimizer]:
    from pytorch_optimizer import CAME

    return CAME


OPTIMIZERS: dict[str, OptimizerInfo] = {
    "adamw": OptimizerInfo(lambda: torch.optim.AdamW, _adam_settings),
    "adamw8bit": _bitsandbytes("AdamW8bit"),
    "paged_adamw8bit": _bitsandbytes("PagedAdamW8bit"),
    "adamw8bit_ao": _torchao("AdamW8bit"),
    "adamw4bit_ao": _torchao("AdamW4bit"),
    "adamw_fp8_ao": _torchao("AdamWFp8"),
    "prodigy": OptimizerInfo(_prodigy, _adam_settings, "prodigyopt", "prodigy"),
    "came": OptimizerInfo(_came, _came_settings, "pytorch-optimizer", "came"),
    # torch's own Adafactor: factored second moments, no first moment.
    "adafactor": OptimizerInfo(lambda: torch.optim.Adafactor, _weight_decay_only),
}


def _import(load: Callable[[], Any], key: str, package: str | None, extra: str | None) -> Any:
    """`load()`, a missing package reported with the pip extra that installs it."""
    try:
        return load()
    except ImportError as error:
        raise ConfigError(
            f"{key} needs the package {package}, which could not be imported: {error}\n"
            f"What to do: pip install 'vidtune[{extra}]', or choose another optimizer (e.g. optimizer.name=adamw)."
        ) from None


def optimizer_class(config: Config) -> type[torch.optim.Optimizer]:
    """The class `optimizer.name` names, its package imported (a missing one names the pip extra)."""
    name = config.optimizer.name
    info = OPTIMIZERS[name]
    return _import(info.load, f"optimizer.name={name}", info.package, info.extra)


def _cpu_offload_class() -> type[torch.optim.Optimizer]:
    from torchao.optim import CPUOffloadOptimizer

    class ClippedCPUOffloadOptimizer(CPUOffloadOptimizer):
        """torchao's hook copies each gradient to the host as backward produces it, before the loop clips it
        (`training.max_grad_norm`): the step copies the gradients again, as they are now, so it uses the clipped
        ones."""

        @torch.no_grad()
        def step(self, closure: Callable[[], Any] | None = None) -> Any:
            for p_device, copied in self.queue.items():
                copied.synchronize()  # the hook's copy is done before it is overwritten
                if p_device.grad is not None:
                    self.param_d2h_map[p_device].grad.copy_(p_device.grad)
            return super().step(closure)

    return ClippedCPUOffloadOptimizer


def check_optimizer(config: Config, device: torch.device) -> None:
    """Before any long work: the optimizer's package imports, and `optimizer.cpu_offload` has a CUDA device."""
    optimizer_class(config)
    if config.optimizer.cpu_offload:
        if device.type != "cuda":
            raise ConfigError(
                f"optimizer.cpu_offload needs a CUDA device; this run trains on {device.type}.\n"
                "What to do: set optimizer.cpu_offload=false (on the CPU the optimizer state is in host memory "
                "already), or train on a GPU."
            )
        _import(_cpu_offload_class, "optimizer.cpu_offload", "torchao", "torchao")


def group_settings(config: Config) -> dict[str, Any]:
    """The optimizer's group settings the config controls (learning rate aside): betas, eps, weight decay as
    the chosen optimizer takes them."""
    return OPTIMIZERS[config.optimizer.name].settings(config)


def build_optimizer(parameters: list[nn.Parameter], config: Config) -> torch.optim.Optimizer:
    """`optimizer.name` over `parameters`; with `optimizer.cpu_offload`, inside torchao's CPU-offload optimizer
    (its state and step on the CPU, the weights on the GPU)."""
    cls = optimizer_class(config)
    settings = {"lr": config.training.learning_rate, **group_settings(config)}
    if config.optimizer.cpu_offload:
        device = parameters[0].device if parameters else torch.device("cpu")
        check_optimizer(config, device)
        return _cpu_offload_class()(parameters, cls, **settings)
    return cls(parameters, **settings)


def build_lr_scheduler(optimizer: torch.optim.Optimizer, config: Config, completed_steps: int = 0) -> Any:
    """Warm-up then constant / linear decay / cosine decay, counted in optimizer steps.

    The rate is a pure function of the step (each schedule is a LambdaLR of it), so a resumed run builds the
    schedule at its `completed_steps` (the groups' `initial_lr` set) instead of loading a saved one."""
    name = config.optimizer.lr_scheduler
    warmup = config.optimizer.warmup_steps
    if name == "constant":
        name = "constant_with_warmup"
    return get_scheduler(
        name, optimizer, num_warmup_steps=warmup, num_training_steps=config.training.steps,
        last_epoch=completed_steps - 1,
    )
