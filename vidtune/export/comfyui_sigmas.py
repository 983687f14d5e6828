"""The noise levels (sigmas) ComfyUI samples a flow-matching video model through, computed as ComfyUI computes them.

A ComfyUI workflow's sampler walks the sigmas its scheduler node returns: `BasicScheduler` (or `KSampler`'s
`scheduler` input) picks them from the model's table of 1000 noise levels, and `LTXVScheduler` computes its own.
vidtune writes such a workflow beside each ComfyUI LoRA and, with `validation.sampler: comfyui`, samples its
validation videos through the same sigmas, so the sheets a run shows are what the workflow gives.

What each function follows (ComfyUI's source; see docs/comfyui.md for the commits read):
- `flow_table`: `comfy/model_sampling.py`, `ModelSamplingDiscreteFlow.set_parameters`: the sigmas of the
  timesteps 1..1000, each `time_snr_shift(shift, t / 1000)`; `ModelSamplingSD3` (comfy_extras/
  nodes_model_advanced.py) sets that `shift`.
- `simple`, `normal`, `sgm_uniform`, `beta`, `linear_quadratic`: `comfy/samplers.py`, the functions behind the
  scheduler names of `KSampler.SCHEDULERS`.
- `ltxv`: comfy_extras/nodes_lt.py, `LTXVScheduler`: a shift that grows with the latent's token count, then the
  schedule stretched so its last non-zero sigma is `terminal`.

ComfyUI computes in float32 (torch's default dtype); so does this module, so the numbers agree to the last bit
where the operations are the same. Every schedule ends with 0 (the clean sample).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch

TIMESTEPS = 1000  # ModelSamplingDiscreteFlow's table size (and the `multiplier` of its timesteps)

Scheduler = Literal["simple", "normal", "sgm_uniform", "beta", "linear_quadratic", "ltxv"]
SCHEDULERS: tuple[Scheduler, ...] = ("simple", "normal", "sgm_uniform", "beta", "linear_quadratic", "ltxv")


def time_snr_shift(shift: float, t: torch.Tensor) -> torch.Tensor:
    """ComfyUI's shift of a flow model's noise level: `shift * t / (1 + (shift - 1) * t)` (t itself for shift 1)."""
    if shift == 1.0:
        return t
    return shift * t / (1 + (shift - 1) * t)


def flow_table(shift: float) -> torch.Tensor:
    """The model's 1000 noise levels, lowest first: `time_snr_shift(shift, k / 1000)` for k = 1..1000 (float32)."""
    return time_snr_shift(shift, torch.arange(1, TIMESTEPS + 1, 1) / TIMESTEPS)


def simple(table: torch.Tensor, steps: int) -> torch.Tensor:
    """`simple_scheduler`: every (1000 / steps)-th level from the top, then 0."""
    stride = len(table) / steps
    picked = [float(table[-(1 + int(x * stride))]) for x in range(steps)]
    return torch.tensor([*picked, 0.0], dtype=torch.float32)


def normal(shift: float, steps: int, sgm: bool = False) -> torch.Tensor:
    """`normal_scheduler` (`sgm_uniform` with `sgm`): timesteps evenly spaced from the highest level's to the lowest
    level's, each turned into its level, then 0. A flow model's timestep is its level times 1000 (the shift is not
    undone), so every level is shifted twice: `time_snr_shift(shift, t)` of t evenly spaced from 1 to the lowest
    level."""
    table = flow_table(shift)
    start, end = float(table[-1]) * TIMESTEPS, float(table[0]) * TIMESTEPS
    append_zero = True
    if sgm:
        timesteps = torch.linspace(start, end, steps + 1)[:-1]
    else:
        if math.isclose(float(time_snr_shift(shift, torch.tensor(end / TIMESTEPS))), 0, abs_tol=0.00001):
            steps += 1
            append_zero = False
        timesteps = torch.linspace(start, end, steps)
    levels = [float(time_snr_shift(shift, timestep / TIMESTEPS)) for timestep in timesteps]
    return torch.tensor([*levels, 0.0] if append_zero else levels, dtype=torch.float32)


def beta(table: torch.Tensor, steps: int, alpha: float = 0.6, beta_: float = 0.6) -> torch.Tensor:
    """`beta_scheduler`: the levels at the Beta(alpha, beta) quantiles of 1 - i / steps (rounded to a table index),
    each level once, then 0."""
    last = len(table) - 1
    quantiles = [1 - i / steps for i in range(steps)]
    picked: list[float] = []
    previous = -1.0
    for q in quantiles:
        index = float(round(beta_quantile(q, alpha, beta_) * last))  # numpy.rint: halves to even, as round does
        if index != previous:
            picked.append(float(table[int(index)]))
        previous = index
    return torch.tensor([*picked, 0.0], dtype=torch.float32)


def linear_quadratic(table: torch.Tensor, steps: int, threshold_noise: float = 0.025,
                     linear_steps: int | None = None) -> torch.Tensor:
    """`linear_quadratic_schedule` (Genmo's Mochi schedule): a linear start to `threshold_noise`, then a quadratic
    ramp, flipped to run from the highest level to 0 and scaled by it."""
    if steps == 1:
        schedule = [1.0, 0.0]
    else:
        linear = steps // 2 if linear_steps is None else linear_steps
        start = [i * threshold_noise / linear for i in range(linear)]
        difference = linear - threshold_noise * steps
        quadratic = steps - linear
        quadratic_coef = difference / (linear * quadratic ** 2)
        linear_coef = threshold_noise / linear - 2 * difference / (quadratic ** 2)
        constant = quadratic_coef * (linear ** 2)
        ramp = [quadratic_coef * (i ** 2) + linear_coef * i + constant for i in range(linear, steps)]
        schedule = [1.0 - x for x in [*start, *ramp, 1.0]]
    return torch.tensor(schedule, dtype=torch.float32) * table[-1]


def ltxv(steps: int, tokens: int | None, max_shift: float = 2.05, base_shift: float = 0.95, stretch: bool = True,
         terminal: float = 0.1) -> torch.Tensor:
    """`LTXVScheduler`: `steps + 1` levels evenly spaced from 1 to 0, each shifted by `exp(s) / (exp(s) + 1/t - 1)`
    with s growing linearly with the latent's token count (base_shift at 1024 tokens, max_shift at 4096; 4096
    without a latent), then (with `stretch`) rescaled so that the last non-zero level is `terminal`."""
    count = 4096 if tokens is None else tokens
    sigmas = torch.linspace(1.0, 0.0, steps + 1)
    slope = (max_shift - base_shift) / (4096 - 1024)
    shift = count * slope + (base_shift - slope * 1024)
    sigmas = torch.where(sigmas != 0, math.exp(shift) / (math.exp(shift) + (1 / sigmas - 1) ** 1), 0)
    if stretch:
        nonzero = sigmas != 0
        one_minus = 1.0 - sigmas[nonzero]
        scale = one_minus[-1] / (1.0 - terminal)
        sigmas[nonzero] = 1.0 - (one_minus / scale)
    return sigmas


def ltxv_tokens(frames: int, height: int, width: int, spatial: int = 32, temporal: int = 8) -> int:
    """The token count LTXVScheduler reads off a latent of EmptyLTXVLatentVideo / LTXVImgToVideo: latent frames x
    height x width, (frames - 1) // temporal + 1 by height // spatial by width // spatial."""
    return ((frames - 1) // temporal + 1) * (height // spatial) * (width // spatial)


@dataclass(frozen=True)
class ComfyUISchedule:
    """How a workflow's sampler gets its sigmas: a scheduler of `KSampler.SCHEDULERS` over the model's table shifted
    by `shift` (ModelSamplingSD3), or `ltxv` (LTXVScheduler, whose shift comes from the latent's size)."""

    scheduler: Scheduler
    shift: float = 1.0

    def describe(self) -> str:
        """'simple, shift 5' (the scheduler and what it depends on)."""
        if self.scheduler == "ltxv":
            return "LTXVScheduler"
        return self.scheduler if self.scheduler == "linear_quadratic" else f"{self.scheduler}, shift {self.shift:g}"

    def sigmas(self, steps: int, tokens: int | None = None) -> torch.Tensor:
        """The `steps + 1` sigmas (fewer for `beta` when two quantiles share a level), highest first, ending in 0.
        `tokens`: the latent's frames x height x width (`ltxv` only)."""
        if steps < 1:
            raise ValueError(f"steps must be at least 1, not {steps}")
        if self.scheduler == "ltxv":
            return ltxv(steps, tokens)
        table = flow_table(self.shift)
        if self.scheduler == "simple":
            return simple(table, steps)
        if self.scheduler in ("normal", "sgm_uniform"):
            return normal(self.shift, steps, sgm=self.scheduler == "sgm_uniform")
        if self.scheduler == "beta":
            return beta(table, steps)
        return linear_quadratic(table, steps)


# ----- the Beta distribution's quantile (for `beta`; scipy.stats.beta.ppf in ComfyUI) ---------------------------
def _continued_fraction(x: float, a: float, b: float) -> float:
    """The continued fraction of the regularized incomplete beta function (Lentz's method), converging for
    x < (a + 1) / (a + b + 2)."""
    tiny, eps = 1e-300, 1e-16
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    result = d
    for m in range(1, 400):
        for numerator in (m * (b - m) * x / ((a + 2 * m - 1) * (a + 2 * m)),
                          -(a + m) * (a + b + m) * x / ((a + 2 * m) * (a + 2 * m + 1))):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            result *= c * d
        if abs(c * d - 1.0) < eps:
            break
    return result


def beta_cdf(x: float, a: float, b: float) -> float:
    """The regularized incomplete beta function I_x(a, b): the Beta(a, b) distribution's CDF at x."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1) / (a + b + 2):
        return math.exp(log_front) * _continued_fraction(x, a, b) / a
    return 1.0 - math.exp(log_front) * _continued_fraction(1.0 - x, b, a) / b


def beta_quantile(q: float, a: float, b: float) -> float:
    """The x with I_x(a, b) = q, by bisection to float64's precision."""
    if q <= 0.0:
        return 0.0
    if q >= 1.0:
        return 1.0
    if a == b and q == 0.5:  # the median of a symmetric Beta, exactly (rounding 499.5 must see 0.5, not 0.4999...)
        return 0.5
    low, high = 0.0, 1.0
    for _ in range(200):
        middle = (low + high) / 2
        if middle in (low, high):
            break
        if beta_cdf(middle, a, b) < q:
            low = middle
        else:
            high = middle
    return (low + high) / 2
