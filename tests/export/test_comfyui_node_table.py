"""tools/comfyui_node_table.py reads both ways ComfyUI defines a node, and the option lists it computes, from
source alone; a node it cannot read is an error, not a gap in the table."""

from __future__ import annotations

import importlib.util
import json
import sys
import textwrap
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[2] / "tools" / "comfyui_node_table.py"
spec = importlib.util.spec_from_file_location("comfyui_node_table", TOOL)
node_table_tool = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = node_table_tool  # dataclasses look their module up
spec.loader.exec_module(node_table_tool)

FILES = {
    "comfy/samplers.py": """
        KSAMPLER_NAMES = ["euler", "heun"]
        SAMPLER_NAMES = KSAMPLER_NAMES + ["ddim"]
        SCHEDULER_HANDLERS = {"simple": 1, "beta": 2}
        SCHEDULER_NAMES = list(SCHEDULER_HANDLERS)
        class KSampler:
            SCHEDULERS = SCHEDULER_NAMES
    """,
    "comfy_api/latest/_io.py": """
        @comfytype(io_type="INT")
        class Int: pass
        @comfytype(io_type="COMBO")
        class Combo: pass
        @comfytype(io_type="LATENT")
        class Latent: pass
        @comfytype(io_type="MODEL")
        class Model: pass
        @comfytype(io_type="SIGMAS")
        class Sigmas: pass
    """,
    "comfy_api/latest/_util/video_types.py": """
        class VideoCodec(str, Enum):
            AUTO = "auto"
            H264 = "h264"
    """,
    "comfy/comfy_types/node_typing.py": """
        class IO(StrEnum):
            STRING = "STRING"
            CLIP = "CLIP"
    """,
    "nodes.py": """
        class Loader:
            @classmethod
            def INPUT_TYPES(s):
                return {"required": {"name": (folder_paths.get_filename_list("loras"), ),
                                     "text": (IO.STRING, {"default": "hi"}),
                                     "scheduler": (comfy.samplers.KSampler.SCHEDULERS, )},
                        "optional": {"device": (["default", "cpu"], )},
                        "hidden": {"prompt": "PROMPT"}}
            RETURN_TYPES = ("MODEL", IO.CLIP)
        NODE_CLASS_MAPPINGS = {"Loader": Loader}
    """,
    "comfy_extras/nodes_x.py": """
        class Sched(io.ComfyNode):
            @classmethod
            def define_schema(cls):
                return io.Schema(node_id="Sched", inputs=[
                    io.Model.Input("model"),
                    io.Int.Input(id="steps", default=20),
                    io.Combo.Input("sampler", options=comfy.samplers.SAMPLER_NAMES),
                    io.Combo.Input("codec", options=Types.VideoCodec.as_input(), default="auto"),
                    io.Latent.Input("latent", optional=True),
                ], outputs=[io.Sigmas.Output(), io.Latent.Output()])
        class Renamed(Sched):
            @classmethod
            def define_schema(cls):
                schema = super().define_schema()
                schema.node_id = "Renamed"
                return schema
    """,
}


@pytest.fixture
def source(tmp_path: Path):
    for name, text in FILES.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(textwrap.dedent(text))
    return tmp_path


def test_both_node_forms_and_their_computed_options_are_read(source):
    parsed = node_table_tool.Source.read(source, ("nodes.py", "comfy_extras/nodes_x.py"))
    nodes = node_table_tool.read_nodes(parsed, ("Loader", "Sched", "Renamed"))
    assert nodes["Loader"] == {
        "file": "nodes.py",
        "required": {"name": {"type": "COMBO", "folder": "loras"}, "text": {"type": "STRING", "default": "hi"},
                     "scheduler": {"type": "COMBO", "options": ["simple", "beta"]}},
        "optional": {"device": {"type": "COMBO", "options": ["default", "cpu"]}},
        "outputs": ["MODEL", "CLIP"]}
    assert nodes["Sched"]["required"] == {
        "model": {"type": "MODEL"}, "steps": {"type": "INT", "default": 20},
        "sampler": {"type": "COMBO", "options": ["euler", "heun", "ddim"]},
        "codec": {"type": "COMBO", "default": "auto", "options": ["auto", "h264"]}}
    assert nodes["Sched"]["optional"] == {"latent": {"type": "LATENT"}}
    assert nodes["Sched"]["outputs"] == ["SIGMAS", "LATENT"]
    assert nodes["Renamed"] == {**nodes["Sched"], "file": "comfy_extras/nodes_x.py"}


def test_a_node_that_cannot_be_found_or_read_is_an_error(source, capsys):
    parsed = node_table_tool.Source.read(source, ("nodes.py",))
    with pytest.raises(node_table_tool.SourceError, match=r"not defined in nodes\.py: Missing"):
        node_table_tool.read_nodes(parsed, ("Loader", "Missing"))
    odd = source / "comfy_extras" / "nodes_x.py"
    odd.write_text(odd.read_text().replace("io.Int.Input", "io.Unknown.Input"))
    parsed = node_table_tool.Source.read(source, ("comfy_extras/nodes_x.py",))
    with pytest.raises(node_table_tool.SourceError, match=r"unknown socket class io\.Unknown"):
        node_table_tool.read_nodes(parsed, ("Sched",))


def test_the_command_writes_a_dated_table_and_refuses_a_short_commit(source, tmp_path, monkeypatch):
    monkeypatch.setattr(node_table_tool, "SOURCES", ("nodes.py",))
    monkeypatch.setattr(node_table_tool, "NODES", ("Loader",))
    output = tmp_path / "table.json"
    assert node_table_tool.main([str(source), "--commit", "a" * 40, "--version", "0.8.0", "--read", "2026-12-07",
                                 "--output", str(output)]) == 0
    table = json.loads(output.read_text())
    assert (table["read"], table["source"], table["commit"]) == ("2026-12-07", "ComfyUI 0.8.0", "a" * 40)
    assert list(table["nodes"]) == ["Loader"]
    with pytest.raises(SystemExit):
        node_table_tool.main([str(source), "--commit", "abc", "--version", "0.8.0", "--output", str(output)])
