"""model.attention_backend: resolved before the model loads, refused plainly when it cannot train here."""

from __future__ import annotations

import pytest
import torch

from vidtune.attention import resolve_attention_backend, set_attention_backend, uses_dispatcher
from vidtune.errors import ConfigError
from vidtune.trainers import build_trainer

CPU = torch.device("cpu")


def test_auto_is_native_on_the_cpu():
    assert resolve_attention_backend("auto", CPU) == "native"
    assert resolve_attention_backend("_native_math", CPU) == "_native_math"


@pytest.mark.parametrize(("name", "words"), [
    ("flashy", "not an attention backend of the installed diffusers"),
    ("sage", "no backward pass"),
    ("flash", "runs on CUDA GPUs only"),
])
def test_a_backend_that_cannot_train_here_is_refused_with_the_key(name, words):
    with pytest.raises(ConfigError, match=r"model\.attention_backend") as error:
        resolve_attention_backend(name, CPU)
    assert words in str(error.value)
    assert "What to do:" in str(error.value)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_missing_package_is_named():
    pytest.importorskip("diffusers")
    try:
        import xformers  # noqa: F401
        pytest.skip("xformers is installed")
    except ImportError:
        pass
    with pytest.raises(ConfigError, match="needs the package xformers"):
        resolve_attention_backend("xformers", torch.device("cuda"))


def test_the_chosen_backend_reaches_the_attention_layers(make_config):
    trainer = build_trainer(make_config("ltx-video", model={"attention_backend": "_native_math"},
                                        training={"steps": 1}))
    trainer.run()
    backends = {getattr(m.processor, "_attention_backend", None) for m in trainer.context.denoiser.modules()
                if hasattr(m, "processor")}
    assert uses_dispatcher(trainer.context.denoiser)
    assert backends == {"_native_math"}
    # Only this denoiser's layers: models built later in the process keep the dispatcher's default.
    from diffusers.models.attention_dispatch import _AttentionBackendRegistry

    assert _AttentionBackendRegistry.get_active_backend()[0].value == "native"


def test_a_family_without_the_dispatcher_takes_native_only(tiny_model_dir, make_config):
    trainer = build_trainer(make_config("cogvideox"))
    denoiser = trainer.spec.load_denoiser(CPU)
    assert not uses_dispatcher(denoiser)
    set_attention_backend(denoiser, "native", "cogvideox")  # what it does anyway: accepted
    with pytest.raises(ConfigError, match="cogvideox denoiser computes attention with torch"):
        set_attention_backend(denoiser, "_native_math", "cogvideox")
