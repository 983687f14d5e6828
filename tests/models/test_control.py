"""The control contract, for every registered family: the widened denoiser computes exactly what the base one does
until its new input weights train, and the control latents do reach them."""

from __future__ import annotations

import pytest
import torch

from vidtune.control import ControlInput, input_layer
from vidtune.errors import ConfigError
from vidtune.models import conditioning
from vidtune.models.registry import available_models, get_spec_class
from vidtune.models.spec import POSTERIOR_KEYS, draw_latent
from vidtune.models.tiny import TINY_SHAPES

CPU = torch.device("cpu")


def _inputs(spec, config, family):
    """(conditions, noisy latents, timesteps, control latents) of two random clips."""
    frames, height, width = TINY_SHAPES[family]
    generator = torch.Generator().manual_seed(0)
    videos = torch.rand(2, frames, 3, height, width, generator=generator) * 2 - 1
    controls = torch.rand(2, frames, 3, height, width, generator=generator) * 2 - 1
    text, vae = spec.load_text_components(CPU), spec.load_vae(CPU)
    conditions = spec.prepare_conditions(text, ["a red circle", "a blue square"])
    latents = spec.prepare_latents(vae, videos)
    control = spec.prepare_latents(vae, controls)["latents_mean"]
    objective = spec.objective(config.training)
    x0 = draw_latent(latents, generator)
    levels = objective.sample_noise_levels(2, generator, spec.token_count(x0.shape[1:]))
    noisy = objective.noisy(x0, torch.randn(x0.shape, generator=generator), levels)
    conditions = {**conditions, **{k: v for k, v in latents.items() if k not in POSTERIOR_KEYS}}
    return conditions, noisy, objective.timesteps(levels), control


@pytest.mark.parametrize("family", available_models())
def test_step_zero_equals_the_base_model(make_config, family):
    config = make_config(family)
    spec = get_spec_class(family)(config.model, frame_rate=config.frame_rate)
    if spec.control_input_layer is None:  # a family conditioned its own way (Wan Animate's pose) says so
        with pytest.raises(ConfigError, match=rf"{family} cannot take a control input: {spec.control_refusal[:20]}"):
            input_layer(spec, spec.load_denoiser(CPU))
        return
    conditions, noisy, timesteps, control = _inputs(spec, config, family)
    denoiser = spec.load_denoiser(CPU).eval()
    with torch.no_grad():
        base = spec.forward(denoiser, conditions, noisy, timesteps)
        widened = ControlInput.attach(spec, denoiser)
        assert widened.control_channels == control.shape[1]
        with widened.given(control):
            controlled = spec.forward(denoiser, conditions, noisy, timesteps)
        difference = float((controlled - base).abs().max())
        print(f"{family}: step-0 max |difference| {difference:.3g}")
        assert difference <= 1e-6
        # The control reaches the new weights: once they are not zero, the output depends on it.
        layer = widened.layer
        layer.weight[:, widened.in_features:].normal_(0, 0.1, generator=torch.Generator().manual_seed(1))
        with widened.given(control):
            changed = spec.forward(denoiser, conditions, noisy, timesteps)
        with widened.given(torch.zeros_like(control)):
            without = spec.forward(denoiser, conditions, noisy, timesteps)
    assert float((changed - base).abs().max()) > 1e-3
    assert torch.allclose(without, base, atol=1e-5)  # zero control through the new weights adds nothing


def test_a_family_without_an_input_layer_is_refused(make_config, monkeypatch):
    config = make_config("wan")
    spec_class = get_spec_class("wan")
    monkeypatch.setattr(spec_class, "control_input_layer", None)
    monkeypatch.setattr(spec_class, "control_refusal", "a reason.")
    spec = spec_class(config.model, frame_rate=config.frame_rate)
    with pytest.raises(ConfigError, match=r"wan cannot take a control input: a reason\.\nWhat to do:"):
        input_layer(spec, spec.load_denoiser(CPU))


@pytest.mark.parametrize(("family", "extra_first"), [("ltx-video-i2v", True), ("ltx-2", False)])
def test_a_drawn_keyframes_extra_tokens_take_a_zero_control(make_config, family, extra_first):
    """A last-frame mode gives its keyframe as extra tokens beside the clip's (LTX-Video puts them first, LTX-2
    last), and the batch's other samples pad to the same count: each clip token meets its own control, the extra
    tokens a zero one, and the widened denoiser still computes the base's at step 0."""
    config = make_config(family, model={"conditioning": {"last_frame": 0.5}})
    spec = get_spec_class(family)(config.model, frame_rate=config.frame_rate)
    conditions, noisy, timesteps, control = _inputs(spec, config, family)
    codes = torch.tensor([conditioning.code("last_frame"), conditioning.code("first_frame")], dtype=torch.float)
    conditions = {**conditions, conditioning.MODE: codes, conditioning.LATENTS: noisy}
    denoiser = spec.load_denoiser(CPU).eval()
    seen: list[torch.Tensor] = []
    with torch.no_grad():
        base = spec.forward(denoiser, conditions, noisy, timesteps)
        widened = ControlInput.attach(spec, denoiser)
        widened.layer.register_forward_pre_hook(lambda module, args: seen.append(args[0][..., widened.in_features:]))
        with widened.given(control):
            controlled = spec.forward(denoiser, conditions, noisy, timesteps)
    assert float((controlled - base).abs().max()) <= 1e-6
    [given] = seen
    frames, height, width = control.shape[2:]
    patch = denoiser.config.patch_size
    clip_tokens = frames * (height // patch) * (width // patch) // getattr(denoiser.config, "patch_size_t", 1)
    extra = given.shape[1] - clip_tokens
    assert extra == (height // patch) * (width // patch)  # one latent frame's tokens
    clip_rows, extra_rows = (given[:, extra:], given[:, :extra]) if extra_first else (given[:, :clip_tokens],
                                                                                         given[:, clip_tokens:])
    assert float(extra_rows.abs().max()) == 0
    packed, _ = spec.pack_control(control, denoiser, control.new_zeros(1, clip_tokens, 1))
    assert torch.equal(clip_rows, packed)
