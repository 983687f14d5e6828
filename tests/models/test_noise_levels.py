"""Each family's default training noise levels against the formula of the trainer they come from (docs/models.md):
Lightricks' token-count-shifted logit-normal (LTX-Video; LTX-2 stretched, with uniform draws, and its audio drawn
apart with the audio's token count), HunyuanVideo 1.5's logit-normal at shift 3, Mochi's uniform sigmas; and
DiffSynth-Studio's Wan recipe reachable by settings.

The references are written here from the trainers' formulas (cumulative distribution functions), independently of
vidtune's samplers: the empirical CDF of the drawn sigmas must match them at a few noise levels.
"""

from __future__ import annotations

import math
from statistics import NormalDist

import pytest
import torch

from vidtune.data.buckets import visit_generator
from vidtune.models.ltx_2 import AUDIO_LATENTS, AUDIO_PRESENT, AUDIO_SIGMAS
from vidtune.models.registry import get_spec_class
from vidtune.objectives import shift_sigmas

DRAWS = 40_000
LEVELS = (0.1, 0.3, 0.5, 0.7, 0.8, 0.9, 0.95)
TOLERANCE = 0.012  # about 5 standard errors of an empirical CDF of DRAWS samples
NORMAL = NormalDist()


def _spec_and_objective(make_config, family: str, **training):
    config = make_config(family, training=training)
    spec = get_spec_class(family)(config.model, frame_rate=config.frame_rate)
    return spec, spec.objective(config.training)


def _logit(p: float) -> float:
    return math.log(p / (1 - p))


def _sigmoid(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def lightricks_mean(tokens: int) -> float:
    """LTX-Video-Trainer / ltx-trainer `_get_shift_for_sequence_length`: linear through (1024, 0.95), (4096, 2.05)."""
    slope = (2.05 - 0.95) / (4096 - 1024)
    return slope * tokens + 0.95 - slope * 1024


def ltx_video_cdf(sigma: float, tokens: int) -> float:
    """P(sigmoid(N(mu, 1)) <= sigma)."""
    return NORMAL.cdf(_logit(sigma) - lightricks_mean(tokens))


def ltx_2_cdf(sigma: float, tokens: int) -> float:
    """ltx-trainer's stretched sampler: raw = (sigmoid(N(mu, 1)) - p_lo) / (p_hi - p_lo) between the 0.5th and 99.9th
    percentiles, reflected at eps = 1e-3, clamped to [0, 1]; 10 % of the draws uniform on [eps, 1)."""
    mu, eps = lightricks_mean(tokens), 1e-3
    low, high = _sigmoid(mu - 2.5758), _sigmoid(mu + 3.0902)

    def raw_cdf(r: float) -> float:  # P(raw <= r)
        p = low + r * (high - low)
        return 0.0 if p <= 0 else 1.0 if p >= 1 else NORMAL.cdf(_logit(p) - mu)

    stretched = raw_cdf(sigma) - raw_cdf(2 * eps - sigma)  # {2 eps - s <= raw <= s} for s >= eps
    uniform = (sigma - eps) / (1 - eps)
    return 0.9 * stretched + 0.1 * uniform


def _check_cdf(sigmas: torch.Tensor, cdf, tolerance: float = TOLERANCE) -> None:
    for level in LEVELS:
        empirical = float((sigmas <= level).double().mean())
        assert empirical == pytest.approx(cdf(level), abs=tolerance), level


def _draw(objective, tokens: int | None = None, seed: int = 0) -> torch.Tensor:
    return objective.sample_noise_levels(DRAWS, torch.Generator().manual_seed(seed), tokens)


@pytest.mark.parametrize("tokens", [2688, 384])  # 49 x 512 x 768 (7 x 16 x 24 latents), and 9 x 256 x 384 (3 x 8 x 16)
def test_ltx_video_draws_lightricks_token_shifted_logit_normal(make_config, tokens):
    spec, objective = _spec_and_objective(make_config, "ltx-video")
    sigmas = _draw(objective, tokens)
    _check_cdf(sigmas, lambda s: ltx_video_cdf(s, tokens))
    if tokens == 2688:  # Lightricks' recipe at 49x512x768: median ~0.82, against sigmoid(N(0, 1))'s 0.5
        assert float(sigmas.median()) == pytest.approx(_sigmoid(lightricks_mean(2688)), abs=0.01)
        assert float(sigmas.median()) > 0.8
    # The trainer asks the spec for the token count of a clip's latents [C, F, H, W] (LTX: one token a latent).
    assert spec.token_count((128, 7, 16, 24)) == 2688


def test_ltx_2_video_and_audio_draw_their_own_stretched_sigmas(make_config):
    """At 121 x 512 x 768 (16 x 16 x 24 = 6144 video tokens, 5 s of audio: 126 audio tokens), the video's sigma and
    the audio's are drawn from each clip's generator with their own token counts, independently."""
    spec, objective = _spec_and_objective(make_config, "ltx-2")
    video_tokens, audio_tokens = spec.token_count((128, 16, 16, 24)), 126
    assert video_tokens == 6144
    clips = 10_000  # one generator a clip, as the trainer draws them: fewer draws, a wider tolerance
    generators = [visit_generator(0, position) for position in range(clips)]
    video = torch.cat([objective.sample_noise_levels(1, g, video_tokens) for g in generators])
    latents = {AUDIO_LATENTS: torch.zeros(clips, audio_tokens, 2), AUDIO_PRESENT: torch.ones(clips, 1)}
    conditions, levels = spec.stream_noise(objective, latents, generators)
    audio = conditions[AUDIO_SIGMAS]
    torch.testing.assert_close(levels[AUDIO_SIGMAS], audio)
    _check_cdf(video, lambda s: ltx_2_cdf(s, video_tokens), tolerance=0.022)
    _check_cdf(audio, lambda s: ltx_2_cdf(s, audio_tokens), tolerance=0.022)
    # Where the unshifted logit-normal had P(sigma > 0.9) = 0.014, the video trains near pure noise far more.
    assert float((video > 0.9).double().mean()) > 0.3
    assert float(audio.median()) < 0.7 < float(video.median())
    correlation = torch.corrcoef(torch.stack([video, audio]))[0, 1]
    assert abs(float(correlation)) < 0.05


def test_hunyuan_video_15_draws_logit_normal_at_shift_3(make_config):
    _, objective = _spec_and_objective(make_config, "hunyuan-video-1.5")

    def shifted_cdf(sigma: float) -> float:  # sigma = shift(sigmoid(N(0, 1)), 3): undo the shift, then the sigmoid
        unshifted = sigma / (3 - 2 * sigma)
        return NORMAL.cdf(_logit(unshifted))

    _check_cdf(_draw(objective), shifted_cdf)


def test_mochi_draws_uniform_sigmas(make_config):
    _, objective = _spec_and_objective(make_config, "mochi")
    _check_cdf(_draw(objective), lambda s: s)


def test_wan_keeps_musubis_default_and_reaches_diffsynths_recipe(make_config):
    _, default = _spec_and_objective(make_config, "wan")
    _check_cdf(_draw(default), lambda s: NORMAL.cdf(_logit(s / (3 - 2 * s))))  # logit-normal, shift 3
    assert torch.equal(default.loss_weights(torch.tensor([0.1, 0.9])), torch.ones(2))

    _, diffsynth = _spec_and_objective(make_config, "wan", sigma_sampling="uniform", sigma_shift=5.0,
                                       loss_weighting="bell")
    _check_cdf(_draw(diffsynth), lambda s: s / (5 - 4 * s))  # uniform, shifted by 5
    # DiffSynth-Studio's weight over its training grid (1000 sigmas linear from 1, shifted by 5): a bell around
    # sigma 0.5 less its smallest value on the grid (at sigma 1), scaled to a mean of 1 on the grid.
    grid = shift_sigmas(torch.linspace(1, 0, 1001, dtype=torch.float64)[:-1], 5.0).float()
    weights = diffsynth.loss_weights(grid)
    assert float(weights.mean()) == pytest.approx(1.0, abs=1e-4)
    assert float(weights[0]) == pytest.approx(0.0, abs=1e-6)  # sigma 1
    bell = torch.exp(-2 * (grid.double() - 0.5) ** 2) - math.exp(-0.5)
    torch.testing.assert_close(weights.double() / weights.max(), bell / bell.max(), atol=1e-5, rtol=1e-4)
