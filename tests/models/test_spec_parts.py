"""The ModelSpec parts: one module per job, composed into `ModelSpec`, and `sample`, the one way a spec samples."""

from __future__ import annotations

import ast
import inspect
import re

import pytest
import torch

from vidtune.config import ModelConfig
from vidtune.errors import ModelError
from vidtune.models.ltx_video import LTXVideoSpec
from vidtune.models.registry import available_models, get_spec_class
from vidtune.models.spec import (
    DenoiserHooks,
    Denoising,
    Encoding,
    Formats,
    GeneratedSample,
    Loading,
    ModelSpec,
    Sampling,
    SpecBase,
)

CPU = torch.device("cpu")
PARTS = {"loading": Loading, "encoding": Encoding, "denoising": Denoising, "sampling": Sampling, "formats": Formats,
         "hooks": DenoiserHooks}
# The parts a part extends, as docs/architecture.md states: no other part reads another.
EXTENDS = {Loading: SpecBase, Encoding: SpecBase, Denoising: Loading, Sampling: Encoding, Formats: SpecBase,
           DenoiserHooks: SpecBase}


def test_model_spec_is_the_six_parts_and_each_part_extends_only_what_it_reads():
    assert all(issubclass(ModelSpec, part) for part in PARTS.values())
    for part, base in EXTENDS.items():
        assert part.__bases__ == (base,), part
    # Each method a family may override is defined by exactly one part (or the shared base).
    owners: dict[str, list[str]] = {}
    for part in (SpecBase, *PARTS.values()):
        for name, value in vars(part).items():
            if callable(value) or isinstance(value, property) or hasattr(value, "__set_name__"):
                owners.setdefault(name, []).append(part.__name__)
    shared = {name: parts for name, parts in owners.items() if len(parts) > 1 and not name.startswith("__")}
    assert not shared, shared
    assert not vars(ModelSpec).keys() - {"__module__", "__doc__", "__qualname__", "__abstractmethods__", "_abc_impl",
                                         "__firstlineno__", "__static_attributes__"}


def test_the_parts_import_no_part_they_do_not_extend():
    """A part module imports the shared base and only the part(s) it extends (or their plain data types)."""
    allowed = {"loading": {"base"}, "encoding": {"base", "loading"}, "denoising": {"base", "loading"},
               "sampling": {"base", "encoding", "loading"}, "formats": {"base"}, "hooks": {"base"}}
    for name, part in PARTS.items():
        tree = ast.parse(inspect.getsource(inspect.getmodule(part)))
        imported = {node.module.rpartition(".")[2] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)
                    and node.module and node.module.startswith("vidtune.models.spec.")}
        assert imported <= allowed[name], (name, imported - allowed[name])


def test_the_five_old_entry_points_are_gone():
    for old in ("run_pipeline", "generate", "generate_sample", "generate_latents"):
        assert not hasattr(ModelSpec, old), old
    assert inspect.signature(ModelSpec.sample).parameters["output"].default == "video"


@pytest.fixture(scope="module")
def sampled(tiny_model_dir):
    spec = LTXVideoSpec(ModelConfig(name="ltx-video", pretrained=str(tiny_model_dir("ltx-video"))), frame_rate=24.0)
    pipeline = spec.pipeline(spec.load_text_components(CPU), spec.load_vae(CPU), spec.load_denoiser(CPU))
    pipeline.set_progress_bar_config(disable=True)
    return spec, pipeline


def test_sample_gives_the_video_or_the_final_latents_of_one_denoising(sampled):
    """output="video": frames in [-1, 1]; output="latents": the latents the step callback saw after the last step,
    in the training layout. The same seed gives the same denoising either way."""
    spec, pipeline = sampled
    frames, height, width = 9, 32, 32
    seen = {}

    def keep(_pipeline, _step, _timestep, tensors):
        seen["latents"] = tensors["latents"]
        return tensors

    arguments = {"frames": frames, "height": height, "width": width, "num_inference_steps": 2}
    with torch.no_grad():
        video = spec.sample(pipeline, "a red circle", generator=torch.Generator().manual_seed(0), callback=keep,
                            **arguments)
        latents = spec.sample(pipeline, "a red circle", generator=torch.Generator().manual_seed(0),
                              output="latents", **arguments)
    assert video.frames is not None and video.latents is None and video.audio is None
    assert video.frames.shape == (frames, 3, height, width)
    assert float(video.frames.min()) >= -1.0 and float(video.frames.max()) <= 1.0
    assert latents.frames is None and latents.latents is not None
    assert latents.latents.shape == (1, 8, 3, 8, 8)
    torch.testing.assert_close(latents.latents, spec.latents_from_pipeline(seen["latents"], frames, height, width))


def test_sample_refuses_an_output_it_does_not_know(sampled):
    spec, pipeline = sampled
    with pytest.raises(ValueError, match="output is one of video, latents"):
        spec.sample(pipeline, "a", frames=9, height=32, width=32, num_inference_steps=1,
                    generator=torch.Generator().manual_seed(0), output="pt")  # type: ignore[arg-type]


@pytest.mark.parametrize("name", [name for name in available_models() if get_spec_class(name).image_to_video])
def test_every_image_to_video_family_refuses_to_sample_without_its_reference(name, tmp_path):
    """One message for every family (the sampling part's), naming the family and what to do."""
    spec = get_spec_class(name)(ModelConfig(name=name, pretrained=str(tmp_path)))
    with pytest.raises(ModelError, match=rf"^{re.escape(name)} samples from a clip's first frame .*\nWhat to do: give"):
        spec.pipeline_inputs(None)


def test_a_generated_sample_holds_frames_or_latents():
    with pytest.raises(ValueError, match="holds its frames"):
        GeneratedSample()
    assert GeneratedSample(latents=torch.zeros(1, 4, 3, 8, 8)).frames is None
