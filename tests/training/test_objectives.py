import math

import pytest
import torch

from vidtune.errors import SchedulerError
from vidtune.objectives import (
    DDPM,
    FlowMatching,
    bell_loss_weights,
    objective_from_scheduler,
    per_clip_levels,
    sample_logit_normal_sigmas,
    sample_uniform_sigmas,
    shift_sigmas,
)


def _pair(seed=0, shape=(3, 4, 2, 5, 5)):
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=generator), torch.randn(shape, generator=generator)


def test_flow_matching_noisy_and_target_are_consistent():
    x0, noise = _pair()
    objective = FlowMatching()
    sigmas = torch.tensor([0.1, 0.5, 0.9])
    noisy = objective.noisy(x0, noise, sigmas)
    target = objective.target(x0, noise, sigmas)
    s = sigmas.view(-1, 1, 1, 1, 1)
    # One Euler step of the ODE with the exact velocity lands on the data (sigma -> 0) and the noise (sigma -> 1).
    torch.testing.assert_close(noisy - s * target, x0)
    torch.testing.assert_close(noisy + (1 - s) * target, noise)


def test_flow_matching_endpoints():
    x0, noise = _pair()
    objective = FlowMatching()
    torch.testing.assert_close(objective.noisy(x0, noise, torch.zeros(3)), x0)
    torch.testing.assert_close(objective.noisy(x0, noise, torch.ones(3)), noise)


def test_timesteps_follow_the_scheduler_convention():
    sigmas = torch.tensor([0.25, 0.75])
    torch.testing.assert_close(FlowMatching().timesteps(sigmas), torch.tensor([250.0, 750.0]))
    torch.testing.assert_close(FlowMatching(invert_timesteps=True).timesteps(sigmas), torch.tensor([750.0, 250.0]))


def test_uniform_sigmas_distribution():
    sigmas = sample_uniform_sigmas(200_000, torch.Generator().manual_seed(0))
    assert sigmas.min() >= 0 and sigmas.max() < 1
    assert abs(sigmas.mean().item() - 0.5) < 0.005
    assert abs(sigmas.var().item() - 1 / 12) < 0.002


def test_logit_normal_sigmas_distribution():
    mean, std = 0.3, 0.8
    sigmas = sample_logit_normal_sigmas(200_000, mean, std, torch.Generator().manual_seed(0))
    logits = torch.log(sigmas / (1 - sigmas))
    assert abs(logits.mean().item() - mean) < 0.01
    assert abs(logits.std().item() - std) < 0.01
    # Median of a logit-normal is sigmoid(mean).
    assert abs(sigmas.median().item() - 1 / (1 + math.exp(-mean))) < 0.005


def test_shift_moves_sigmas_towards_noise_and_keeps_endpoints():
    sigmas = torch.linspace(0, 1, 11)
    shifted = shift_sigmas(sigmas, 3.0)
    assert shifted[0] == 0 and shifted[-1] == 1
    assert torch.all(shifted[1:-1] > sigmas[1:-1])
    assert shifted[5].item() == pytest.approx(3 * 0.5 / (1 + 2 * 0.5))
    torch.testing.assert_close(shift_sigmas(sigmas, 1.0), sigmas)


def test_objective_sampling_is_seeded():
    objective = FlowMatching(shift=2.0)
    a = objective.sample_noise_levels(8, torch.Generator().manual_seed(3))
    b = objective.sample_noise_levels(8, torch.Generator().manual_seed(3))
    torch.testing.assert_close(a, b)


def test_ddpm_v_prediction_recovers_data_and_noise():
    alphas = torch.linspace(0.999, 0.01, 1000)
    objective = DDPM(alphas_cumprod=alphas, prediction_type="v_prediction")
    x0, noise = _pair()
    levels = torch.tensor([0.0, 500.0, 999.0])
    noisy = objective.noisy(x0, noise, levels)
    v = objective.target(x0, noise, levels)
    a = alphas[levels.long()].view(-1, 1, 1, 1, 1)
    torch.testing.assert_close(a.sqrt() * noisy - (1 - a).sqrt() * v, x0, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close((1 - a).sqrt() * noisy + a.sqrt() * v, noise, rtol=1e-4, atol=1e-5)
    assert objective.timesteps(levels).dtype == torch.long


def test_ddpm_levels_are_integer_timesteps_in_range():
    objective = DDPM(alphas_cumprod=torch.linspace(0.99, 0.01, 50), prediction_type="epsilon")
    levels = objective.sample_noise_levels(10_000, torch.Generator().manual_seed(0))
    assert levels.min() == 0 and levels.max() == 49
    assert torch.equal(levels, levels.round())
    x0, noise = _pair()
    assert torch.equal(objective.target(x0, noise, levels[:3]), noise)


def test_snr_weighting():
    alphas = torch.tensor([0.9, 0.5, 0.1])
    weights = DDPM(alphas_cumprod=alphas, snr_weighting=True).loss_weights(torch.tensor([0.0, 1.0, 2.0]))
    torch.testing.assert_close(weights, 1 / (1 - alphas))
    assert torch.equal(DDPM(alphas_cumprod=alphas).loss_weights(torch.tensor([1.0])), torch.ones(1))


def test_objective_is_chosen_from_the_scheduler():
    from diffusers import DDIMScheduler, FlowMatchEulerDiscreteScheduler

    flow = objective_from_scheduler(FlowMatchEulerDiscreteScheduler(), sampling="uniform", shift=2.0)
    assert isinstance(flow, FlowMatching) and flow.shift == 2.0 and not flow.invert_timesteps
    inverted = objective_from_scheduler(FlowMatchEulerDiscreteScheduler(invert_sigmas=True))
    assert inverted.invert_timesteps
    ddim = DDIMScheduler(prediction_type="v_prediction")
    ddpm = objective_from_scheduler(ddim)
    assert isinstance(ddpm, DDPM) and ddpm.prediction_type == "v_prediction"
    torch.testing.assert_close(ddpm.alphas_cumprod, ddim.alphas_cumprod)


# ----- per-frame noise levels (diffusion forcing) ------------------------------------------------------------------
def test_shared_frame_noise_draws_exactly_the_per_clip_levels():
    """The default keeps every family's draws as they were (resume and seeds reproduce), frames given or not."""
    objective = FlowMatching(shift=3.0)
    plain = objective.sample_noise_levels(4, torch.Generator().manual_seed(5), 256)
    given_frames = objective.sample_noise_levels(4, torch.Generator().manual_seed(5), 256, frames=7)
    assert plain.shape == (4,) and torch.equal(plain, given_frames)


@pytest.mark.parametrize("mode", ["independent", "non_decreasing"])
def test_per_frame_noise_draws_a_level_per_latent_frame(mode):
    objective = FlowMatching(shift=3.0, frame_noise=mode)
    levels = objective.sample_noise_levels(512, torch.Generator().manual_seed(0), frames=6)
    assert levels.shape == (512, 6) and levels.min() > 0 and levels.max() < 1
    steps = levels[:, 1:] - levels[:, :-1]
    if mode == "non_decreasing":
        assert (steps >= 0).all()  # later frames are never less noisy
    else:
        assert (steps < 0).float().mean() > 0.4  # drawn apart: about half the neighbours decrease
    # Each frame's level follows the clip distribution (shift 3 logit-normal: median sigmoid(0) shifted).
    assert abs(levels.flatten().median().item() - 0.75) < 0.03
    assert objective.sample_noise_levels(2, torch.Generator().manual_seed(0)).shape == (2,)  # no frames: per clip


def test_per_frame_levels_noise_each_frame_with_its_own_level():
    objective = FlowMatching(frame_noise="independent")
    x0, noise = _pair()  # [3, 4, 2, 5, 5]: two latent frames
    levels = torch.tensor([[0.1, 0.9], [0.5, 0.5], [1.0, 0.0]])
    noisy = objective.noisy(x0, noise, levels)
    for clip in range(3):
        for frame in range(2):
            sigma, clean, pure = levels[clip, frame], x0[clip, :, frame], noise[clip, :, frame]
            torch.testing.assert_close(noisy[clip, :, frame], (1 - sigma) * clean + sigma * pure)
    torch.testing.assert_close(objective.timesteps(levels), levels * 1000)
    assert objective.loss_weights(levels).shape == (3,)
    bell = FlowMatching(frame_noise="independent", weighting="bell")
    torch.testing.assert_close(bell.loss_weights(levels), bell_loss_weights(levels, 1.0).mean(dim=1))
    torch.testing.assert_close(per_clip_levels(levels), torch.tensor([0.5, 0.5, 0.5]))


def test_a_ddpm_scheduler_refuses_per_frame_noise():
    from diffusers import DDPMScheduler

    with pytest.raises(SchedulerError, match="frame_noise=non_decreasing"):
        objective_from_scheduler(DDPMScheduler(), frame_noise="non_decreasing")
