"""The noise levels ComfyUI samples through, per scheduler, against numbers worked out from ComfyUI's formulas.

The expected values follow ComfyUI's source (Comfy-Org/ComfyUI): `comfy/model_sampling.py`
(ModelSamplingDiscreteFlow: the table `time_snr_shift(shift, k / 1000)`, k = 1..1000), `comfy/samplers.py`
(`simple_scheduler`, `normal_scheduler`, `beta_scheduler`, `linear_quadratic_schedule`) and
`comfy_extras/nodes_lt.py` (`LTXVScheduler`); each was worked out by hand or in float32, independently of
vidtune's code (docs/comfyui.md lists the commits read).
"""

from __future__ import annotations

import pytest
import torch

from vidtune.export.comfyui_sigmas import (
    ComfyUISchedule,
    beta_cdf,
    beta_quantile,
    flow_table,
    ltxv_tokens,
    time_snr_shift,
)
from vidtune.schedulers import sampling_sigmas


def _rounded(sigmas: torch.Tensor) -> list[float]:
    return [round(float(sigma), 4) for sigma in sigmas]


def test_the_flow_table_is_the_shifted_levels_of_the_thousand_timesteps():
    table = flow_table(8.0)
    assert table.shape == (1000,) and table.dtype == torch.float32
    assert float(table[-1]) == 1.0
    # t = 0.5: 8 * 0.5 / (1 + 7 * 0.5) = 4 / 4.5
    assert float(table[499]) == pytest.approx(4 / 4.5, abs=1e-7)
    assert float(table[0]) == pytest.approx(8 * 0.001 / (1 + 7 * 0.001), abs=1e-7)
    torch.testing.assert_close(flow_table(1.0), torch.arange(1, 1001) / 1000)


@pytest.mark.parametrize(("scheduler", "shift", "steps", "expected"), [
    # simple: levels 999, 749, 499, 249 of the table: t = 1, .75, .5, .25 -> 8t / (1 + 7t)
    ("simple", 8.0, 4, [1.0, 0.96, 0.8889, 0.7273, 0.0]),
    # simple with a step count that does not divide 1000: t rounded down to the 1/1000 grid (1, .667, .334)
    ("simple", 8.0, 3, [1.0, 0.9413, 0.8005, 0.0]),
    ("simple", 1.0, 4, [1.0, 0.75, 0.5, 0.25, 0.0]),
    # normal: timesteps evenly from 1000 to 1000 * shift(0.001), each shifted again
    ("normal", 8.0, 4, [1.0, 0.9418, 0.8038, 0.0602, 0.0]),
    ("sgm_uniform", 8.0, 4, [1.0, 0.9604, 0.8904, 0.7335, 0.0]),
    # beta(0.6, 0.6): table indices rint(ppf(1 - k / 4) * 999) = 999, 823, 500, 176
    ("beta", 8.0, 4, [1.0, 0.974, 0.8893, 0.6324, 0.0]),
    ("beta", 8.0, 10, [1.0, 0.9948, 0.9828, 0.9632, 0.9338, 0.8893, 0.8201, 0.7108, 0.531, 0.2549, 0.0]),
    # Genmo's linear-quadratic schedule (threshold 0.025, half the steps linear); the shift plays no part
    ("linear_quadratic", 8.0, 4, [1.0, 0.9875, 0.975, 0.725, 0.0]),
    ("linear_quadratic", 1.0, 5, [1.0, 0.9875, 0.975, 0.8583, 0.5333, 0.0]),
])
def test_each_scheduler_gives_comfyuis_sigmas(scheduler, shift, steps, expected):
    assert _rounded(ComfyUISchedule(scheduler, shift).sigmas(steps)) == expected


def test_ltxv_scheduler_shifts_with_the_latent_size_and_stretches_to_the_terminal():
    # No latent: 4096 tokens, mu = 2.05; the stretch puts the last non-zero level at terminal 0.1.
    assert _rounded(ComfyUISchedule("ltxv").sigmas(4)) == [1.0, 0.8671, 0.6316, 0.1, 0.0]
    assert _rounded(ComfyUISchedule("ltxv").sigmas(8)) == [1.0, 0.9657, 0.9219, 0.8639, 0.7834, 0.6646, 0.471,
                                                            0.1, 0.0]
    # A 13 x 16 x 24 latent (97 x 512 x 768 frames x pixels): mu = 2.370833.
    assert ltxv_tokens(97, 512, 768) == 13 * 16 * 24
    assert _rounded(ComfyUISchedule("ltxv").sigmas(4, ltxv_tokens(97, 512, 768))) == [1.0, 0.8758, 0.6487, 0.1,
                                                                                        0.0]


def test_simple_with_a_step_count_dividing_1000_is_a_distilled_students_sigmas():
    """The K-step Euler sigmas a step-distilled student learnt are ComfyUI's `simple` ones at that shift."""
    for steps, shift in ((4, 1.0), (8, 3.0), (20, 5.0)):
        torch.testing.assert_close(ComfyUISchedule("simple", shift).sigmas(steps), sampling_sigmas(steps, shift))


def test_the_beta_quantile_inverts_the_beta_cdf():
    # Beta(1, 1) is uniform; Beta(2, 1)'s CDF is x^2; a symmetric Beta's median is 1/2.
    assert beta_cdf(0.3, 1.0, 1.0) == pytest.approx(0.3, abs=1e-12)
    assert beta_cdf(0.3, 2.0, 1.0) == pytest.approx(0.09, abs=1e-12)
    assert beta_quantile(0.5, 0.6, 0.6) == 0.5
    for q in (0.01, 0.25, 0.75, 0.99):
        assert beta_cdf(beta_quantile(q, 0.6, 0.6), 0.6, 0.6) == pytest.approx(q, abs=1e-12)


def test_time_snr_shift_is_the_identity_at_shift_one_and_keeps_the_ends():
    t = torch.tensor([0.0, 0.25, 1.0])
    assert time_snr_shift(1.0, t) is t
    assert time_snr_shift(5.0, t).tolist() == [0.0, pytest.approx(5 * 0.25 / 2.0), 1.0]


def test_a_schedule_of_no_steps_is_refused():
    with pytest.raises(ValueError, match="steps must be at least 1"):
        ComfyUISchedule("simple", 3.0).sigmas(0)
