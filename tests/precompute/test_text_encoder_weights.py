"""memory.text_encoder_weights: the text encoders stored in float8, int8 or NF4 wherever captions are encoded.
Their embeddings stay close to the plain ones, a quantized encoder gives its own cache entries (the VAE's stay),
and validation and `vidtune sample` load the encoders the same way."""

from __future__ import annotations

import math

import pytest
import torch

from vidtune.precompute import precompute
from vidtune.precompute.encode import build_spec
from vidtune.sampling import load_pipeline
from vidtune.trainers import build_trainer

# Largest difference of a caption embedding from the plain encoder's, relative to the embedding's largest value,
# for the tiny random-weight T5 of LTX-Video and Llama + CLIP of HunyuanVideo on the CPU (32-wide layers, so
# quantization noise is large next to real models). Measured, LTX / HunyuanVideo: fp8 0.049 / 0.234 (CLIP's pooled
# output), int8 0.015 / 0.022, nf4 0.31 / 0.34. Quantizing T5's `wo` (which T5 casts its input to) gave 2.8.
TOLERANCE = {"fp8": 0.35, "int8": 0.05, "nf4": 0.5}


def _linear_storage(module: torch.nn.Module) -> set[str]:
    return {type(m.weight).__name__ if type(m.weight) is not torch.nn.Parameter else str(m.weight.dtype)
            for m in module.modules() if isinstance(m, torch.nn.Linear)}


@pytest.mark.parametrize("family", ["ltx-video", "hunyuan-video"])
@pytest.mark.parametrize("option", ["fp8", "int8", "nf4"])
def test_quantized_text_encoders_give_embeddings_close_to_the_plain_ones(make_config, family, option):
    captions = ["a red circle moving right", "a blue square"]
    plain_spec = build_spec(make_config(family))
    spec = build_spec(make_config(family, memory={"text_encoder_weights": option}))
    plain = plain_spec.prepare_conditions(plain_spec.load_text(torch.device("cpu")), captions)
    text = spec.load_text(torch.device("cpu"))
    encoders = [m for name, m in text.modules.items() if name.startswith("text_encoder")]
    expected = {"fp8": "torch.float8_e4m3fn", "int8": "Int8Tensor", "nf4": "Params4bit"}[option]
    assert encoders and all(expected in _linear_storage(encoder) for encoder in encoders)
    quantized = spec.prepare_conditions(text, captions)
    assert quantized.keys() == plain.keys()
    compared = [key for key, value in plain.items() if value.is_floating_point()]
    assert compared
    errors = {key: float((quantized[key] - plain[key]).abs().max() / plain[key].abs().max()) for key in compared}
    assert max(errors.values()) < TOLERANCE[option], errors
    assert any(not torch.equal(quantized[key], plain[key]) for key in compared)


def test_a_quantized_encoder_gets_its_own_cache_entries_and_leaves_the_latents(config_for):
    first = precompute(config_for())
    assert first.conditions_computed > 0
    again = precompute(config_for(memory={"text_encoder_weights": "int8"}))
    assert (again.conditions_computed, again.conditions_reused) == (first.conditions_computed, 0)
    assert (again.latents_computed, again.latents_reused) == (0, first.latents_computed)
    plain = precompute(config_for())  # the plain entries' keys did not change
    assert (plain.conditions_computed, plain.latents_computed) == (0, 0)


def test_training_validation_and_sample_use_the_quantized_encoders(make_config, tmp_path):
    config = make_config(memory={"text_encoder_weights": "int8"}, training={"steps": 2},
                         validation={"enabled": True, "num_inference_steps": 2}, output_dir=str(tmp_path / "run"))
    trainer = build_trainer(config)
    result = trainer.run()
    assert all(math.isfinite(loss) for loss in result.losses) and result.sample_paths
    assert "Int8Tensor" in _linear_storage(trainer.context.text["text_encoder"])
    run = load_pipeline(tmp_path / "run", device="cpu")
    assert "Int8Tensor" in _linear_storage(run.pipeline.text_encoder)
