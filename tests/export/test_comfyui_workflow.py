"""The ComfyUI workflow beside a run's ComfyUI LoRA: every node type and input exists in ComfyUI's node definitions
(the dated table read from ComfyUI's source), and the workflow samples what validation samples."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from datetime import date
from pathlib import Path

import pytest
from diffusers import HunyuanVideoTransformer3DModel

from tests.helpers.wan22 import two_expert_config
from vidtune.algorithms.build import build_spec
from vidtune.export.comfyui_graph import Graph, node_table, problems
from vidtune.export.comfyui_sigmas import ComfyUISchedule
from vidtune.export.comfyui_workflow import WorkflowInputs, build_workflow, workflow_file
from vidtune.export.workflow_file import (
    control_video_file,
    follows_control_video,
    start_image_file,
    write_run_workflow,
)
from vidtune.models.registry import available_models, get_spec_class
from vidtune.models.tiny.wan22 import write_tiny_wan22
from vidtune.outputs import comfyui_lora_weights
from vidtune.sampling import comfyui_schedule
from vidtune.trainers import build_trainer

WORKFLOW_FAMILIES = [name for name in available_models()
                     if get_spec_class(name).comfyui_workflow is not get_spec_class("cogvideox").comfyui_workflow
                     and name not in ("skyreels-v2", "skyreels-v2-i2v", "skyreels-v2-df", "wan-animate")]


def _inputs(spec, loras: tuple[str | None, ...], schedule: ComfyUISchedule) -> WorkflowInputs:
    return WorkflowInputs(prompt="a red circle on a blue floor", frames=17, height=32, width=64, steps=6,
                          guidance=4.5, seed=11, frame_rate=24.0, schedule=schedule, loras=loras,
                          start_image="run_start_image.png" if spec.samples_from_image else "",
                          control_video="run_control_video.mp4" if follows_control_video(spec) else "", name="run")


def _nodes(api: dict, kind: str) -> list[dict]:
    return [node for node in api.values() if node["class_type"] == kind]


# ----- the table ----------------------------------------------------------------------------------------------
def test_the_node_table_is_dated_and_says_where_each_node_was_read():
    table = node_table()
    assert date.fromisoformat(table["read"]) <= date.today()
    assert re.fullmatch(r"ComfyUI \d+\.\d+\.\d+", table["source"])
    assert re.fullmatch(r"[0-9a-f]{40}", table["commit"])
    for kind, definition in table["nodes"].items():
        assert definition["file"].endswith(".py"), kind
        assert isinstance(definition.get("outputs"), list), kind


def test_the_check_finds_what_comfyui_would_refuse():
    graph = Graph()
    model = graph.add("UNETLoader", unet_name="m.safetensors", weight_dtype="default")
    clip = graph.add("CLIPLoader", clip_name="t.safetensors", type="wan")
    graph.add("ModelSamplingSD3", model=clip, shift=8.0)  # a CLIP where a MODEL goes
    graph.add("ModelSamplingSD3", model=model, shift="8")  # text where a number goes
    graph.add("CLIPTextEncode", text="a cat", clip="t.safetensors")  # a value where a link goes
    graph.add("KSamplerSelect", sampler_name="no_such_sampler")
    graph.add("LoraLoaderModelOnly", model=model, lora_name="x.safetensors", strength=1.0)  # strength_model
    graph.add("NoSuchNode")
    found = "\n".join(problems(graph.api()))
    assert "model takes MODEL, but output 0 of CLIPLoader is CLIP" in found
    assert "shift='8' is a str, but the input takes FLOAT" in found
    assert "clip='t.safetensors' is a value, but the input takes a CLIP from another node" in found
    assert "sampler_name='no_such_sampler' is not one of" in found
    assert "LoraLoaderModelOnly has no input strength" in found
    assert "the required input strength_model is missing" in found
    assert "ComfyUI has no node type NoSuchNode" in found
    ok = Graph()
    ok.add("UNETLoader", unet_name="m.safetensors", weight_dtype="default")
    assert problems(ok.api()) == []


# ----- every family's workflow ----------------------------------------------------------------------------------
@pytest.mark.parametrize("family", WORKFLOW_FAMILIES)
def test_every_familys_workflow_uses_only_what_comfyui_declares_and_samples_the_validation(make_config, family):
    config = make_config(family)
    spec = build_spec(config)
    layout = spec.comfyui_workflow()
    schedule = comfyui_schedule(config, spec)
    loras = tuple(comfyui_lora_weights("run", second) for second in (False, True))[:len(layout.files.diffusion_models)
                                                                                    or 1]
    api = build_workflow(layout, _inputs(spec, loras, schedule), family)
    assert problems(api) == []
    assert sorted(node["inputs"]["lora_name"] for node in _nodes(api, "LoraLoaderModelOnly")) == sorted(loras)
    assert all(node["inputs"]["strength_model"] == 1.0 for node in _nodes(api, "LoraLoaderModelOnly"))
    prompts = sorted(node["inputs"]["text"] for node in _nodes(api, "CLIPTextEncode"))
    assert prompts == ["", "a red circle on a blue floor"]
    sizes = [node["inputs"] for node in api.values() if "length" in node["inputs"]]
    assert sizes and all((s["length"], s["height"], s["width"]) == (17, 32, 64) for s in sizes)
    assert [node["inputs"]["noise_seed"] for node in _nodes(api, "RandomNoise")] == [11]
    assert {node["inputs"]["sampler_name"] for node in _nodes(api, "KSamplerSelect")} == {"euler"}
    steps = [node["inputs"]["steps"] for node in (*_nodes(api, "BasicScheduler"), *_nodes(api, "LTXVScheduler"))]
    assert steps == [6]
    if schedule.scheduler != "ltxv":
        assert _nodes(api, "BasicScheduler")[0]["inputs"]["scheduler"] == schedule.scheduler
        assert {node["inputs"]["shift"] for node in _nodes(api, "ModelSamplingSD3")} == {schedule.shift}
    guiders = _nodes(api, "CFGGuider")
    assert all(node["inputs"]["cfg"] == 4.5 for node in guiders)
    assert len(guiders) + len(_nodes(api, "BasicGuider")) == len(layout.files.diffusion_models or (1,))
    assert [node["inputs"]["fps"] for node in _nodes(api, "CreateVideo")] == [24.0]
    assert len(_nodes(api, "SaveVideo")) == 1
    if spec.samples_from_image:
        assert [node["inputs"]["image"] for node in _nodes(api, "LoadImage")] == ["run_start_image.png"]
    else:
        assert not _nodes(api, "LoadImage")


@pytest.fixture(scope="module")
def two_expert_model(tmp_path_factory) -> Path:
    return write_tiny_wan22(tmp_path_factory.mktemp("wan22") / "model", two_experts=True, boundary_ratio=0.5)


def test_two_experts_split_the_sigmas_where_the_pipeline_switches_expert(make_config, two_expert_model):
    spec = build_spec(two_expert_config(make_config)(two_expert_model))
    layout = spec.comfyui_workflow()
    schedule = ComfyUISchedule("simple", 3.0)
    api = build_workflow(layout, _inputs(spec, ("a.safetensors", "b.safetensors"), schedule), spec.name)
    sigmas = schedule.sigmas(6)
    split = _nodes(api, "SplitSigmas")[0]["inputs"]["step"]
    boundary = spec.boundary_ratio
    assert all(sigma >= boundary for sigma in sigmas[:split]) and all(sigma < boundary for sigma in sigmas[split:-1])
    high, low = _nodes(api, "UNETLoader")
    assert "high_noise" in high["inputs"]["unet_name"] and "low_noise" in low["inputs"]["unet_name"]
    assert len(_nodes(api, "SamplerCustomAdvanced")) == 2 and len(_nodes(api, "DisableNoise")) == 1


def test_an_expert_without_a_lora_gets_no_lora_loader(make_config, two_expert_model):
    spec = build_spec(two_expert_config(make_config)(two_expert_model))
    api = build_workflow(spec.comfyui_workflow(), _inputs(spec, (None, "low.safetensors"), ComfyUISchedule(
        "simple", 3.0)), spec.name)
    assert [node["inputs"]["lora_name"] for node in _nodes(api, "LoraLoaderModelOnly")] == ["low.safetensors"]


def test_hunyuan_video_tells_its_embedded_guidance_and_guides_only_above_one(make_config):
    config = make_config("hunyuan-video", model={"guidance_scale": 6.0})
    spec = build_spec(config)
    inputs = _inputs(spec, ("run_comfyui.safetensors",), ComfyUISchedule("simple", 7.0))
    api = build_workflow(spec.comfyui_workflow(), inputs, spec.name)
    assert spec.load_config(HunyuanVideoTransformer3DModel, "transformer")["guidance_embeds"]
    assert {node["inputs"]["guidance"] for node in _nodes(api, "FluxGuidance")} == {6.0}
    assert len(_nodes(api, "CFGGuider")) == 1
    unguided = build_workflow(spec.comfyui_workflow(), WorkflowInputs(**{**inputs.__dict__, "guidance": 1.0}),
                              spec.name)
    assert len(_nodes(unguided, "BasicGuider")) == 1 and not _nodes(unguided, "CFGGuider")


def test_kandinsky5_image_to_video_ends_as_its_pipeline_does(make_config):
    spec = build_spec(make_config("kandinsky-5-i2v"))
    api = build_workflow(spec.comfyui_workflow(), _inputs(spec, ("run_comfyui.safetensors",), ComfyUISchedule(
        "simple", 10.0)), spec.name)
    made = next(node_id for node_id, node in api.items() if node["class_type"] == "Kandinsky5ImageToVideo")
    replace, = _nodes(api, "ReplaceVideoLatentFrames")
    assert replace["inputs"]["source"] == [made, 3] and replace["inputs"]["index"] == 0
    normalize, = _nodes(api, "NormalizeVideoLatentStart")
    assert (normalize["inputs"]["start_frame_count"], normalize["inputs"]["reference_frame_count"]) == (4, 5)
    decode, = _nodes(api, "VAEDecode")
    assert api[decode["inputs"]["samples"][0]]["class_type"] == "NormalizeVideoLatentStart"


@pytest.mark.parametrize("family", ["ltx-2", "ltx-2-i2v"])
def test_ltx2_samples_video_and_sound_together_and_muxes_the_sound(make_config, family):
    spec = build_spec(make_config(family))
    layout = spec.comfyui_workflow()
    api = build_workflow(layout, _inputs(spec, ("run_comfyui.safetensors",), ComfyUISchedule("ltxv", 1.0)),
                         spec.name)
    ids = {node["class_type"]: node_id for node_id, node in api.items()}
    concat = _nodes(api, "LTXVConcatAVLatent")[0]["inputs"]
    assert concat["audio_latent"] == [ids["LTXVEmptyLatentAudio"], 0]
    video_source = ids["LTXVImgToVideoInplace" if spec.samples_from_image else "EmptyLTXVLatentVideo"]
    assert concat["video_latent"] == [video_source, 0]
    assert _nodes(api, "LTXVScheduler")[0]["inputs"]["latent"] == [ids["LTXVConcatAVLatent"], 0]
    audio = _nodes(api, "LTXVEmptyLatentAudio")[0]["inputs"]
    assert (audio["frames_number"], audio["frame_rate"]) == (17, 24)
    separate = ids["LTXVSeparateAVLatent"]
    assert _nodes(api, "VAEDecode")[0]["inputs"]["samples"] == [separate, 0]
    assert _nodes(api, "LTXVAudioVAEDecode")[0]["inputs"]["samples"] == [separate, 1]
    assert _nodes(api, "CreateVideo")[0]["inputs"]["audio"] == [ids["LTXVAudioVAEDecode"], 0]
    checkpoint = _nodes(api, "CheckpointLoaderSimple")[0]["inputs"]["ckpt_name"]
    assert {node["inputs"]["ckpt_name"] for node in (*_nodes(api, "LTXAVTextEncoderLoader"),
                                                     *_nodes(api, "LTXVAudioVAELoader"))} == {checkpoint}


# ----- written by a run and by `vidtune export` ---------------------------------------------------------------
def _trained_workflow(config) -> tuple[Path, str, dict]:
    """Train `config` one step; its run folder, the run's name and the workflow it wrote."""
    build_trainer(config).run()
    run = Path(config.output_dir)
    name = run.resolve().name
    return run, name, json.loads((run / workflow_file(name)).read_text())


def test_a_lora_run_writes_its_workflow_beside_its_comfyui_lora(make_config):
    _, name, api = _trained_workflow(make_config("wan", training={"steps": 1}, validation={
        "enabled": False, "prompts": ["a blue square turning"]}))
    assert problems(api) == []
    assert [node["inputs"]["lora_name"] for node in _nodes(api, "LoraLoaderModelOnly")] == [comfyui_lora_weights(name)]
    assert "a blue square turning" in [node["inputs"]["text"] for node in _nodes(api, "CLIPTextEncode")]


def test_an_image_to_video_run_writes_the_start_image_its_workflow_loads(make_config):
    from PIL import Image

    config = make_config("wan-i2v", training={"steps": 1}, validation={"enabled": False})
    run, name, api = _trained_workflow(config)
    assert [node["inputs"]["image"] for node in _nodes(api, "LoadImage")] == [start_image_file(name)]
    with Image.open(run / start_image_file(name)) as image:
        assert image.size == (config.data.width, config.data.height)


def test_a_wan_vace_run_writes_the_control_video_its_workflow_follows(make_config):
    from vidtune.data.video import ClipWindow, read_clip

    config = make_config("wan-vace", training={"steps": 1}, validation={"enabled": False})
    run, name, api = _trained_workflow(config)
    loaded = _nodes(api, "LoadVideo")[0]["inputs"]["file"]
    assert loaded == control_video_file(name)
    frames, height, width = config.data.frames, config.data.height, config.data.width
    written = read_clip(run / loaded, ClipWindow(frames, height, width))
    assert written.shape == (frames, 3, height, width)
    vace = next(node_id for node_id, node in api.items() if node["class_type"] == "WanVaceToVideo")
    assert _nodes(api, "TrimVideoLatent")[0]["inputs"]["trim_amount"] == [vace, 3]


def test_vidtune_export_comfyui_writes_the_workflow_too(make_config, tmp_path):
    config = make_config("ltx-video", training={"steps": 1}, validation={"enabled": False})
    build_trainer(config).run()
    out = tmp_path / "exported"
    subprocess.run([sys.executable, "-m", "vidtune", "export", str(config.output_dir), "--output", str(out),
                    "--format", "comfyui"], check=True, capture_output=True, text=True,
                   env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(sys.path)})
    name = Path(config.output_dir).resolve().name
    api = json.loads((out / workflow_file(name)).read_text())
    assert problems(api) == [] and _nodes(api, "LTXVScheduler")


def test_a_family_without_a_workflow_says_so_and_writes_none(make_config, tmp_path, capsys):
    config = make_config("skyreels-v2")
    spec = build_spec(config)
    (tmp_path / comfyui_lora_weights("run")).write_bytes(b"")
    assert write_run_workflow(spec, config, tmp_path, "run") is None
    assert "No ComfyUI workflow for skyreels-v2 yet" in capsys.readouterr().out
    assert not (tmp_path / workflow_file("run")).exists()


def test_without_a_comfyui_lora_there_is_no_workflow_and_nothing_to_say(make_config, tmp_path, capsys):
    config = make_config("cogvideox")  # ComfyUI has no CogVideoX model: the run already said there is no file
    assert write_run_workflow(build_spec(config), config, tmp_path, "run") is None
    assert capsys.readouterr().out == "" and not list(tmp_path.iterdir())
