"""Write vidtune/export/comfyui_nodes.json: the ComfyUI nodes vidtune's workflows use, read from ComfyUI's source.

    python tools/comfyui_node_table.py COMFYUI_SOURCE --commit SHA --version 0.8.0 [--read YYYY-MM-DD]

COMFYUI_SOURCE is a checkout of ComfyUI (only its .py files are read; nothing is imported, so ComfyUI's own
dependencies are not needed). Both ways ComfyUI defines a node are read: the classic class with `INPUT_TYPES` /
`RETURN_TYPES` registered in `NODE_CLASS_MAPPINGS`, and the `io.Schema(node_id=..., inputs=[...], outputs=[...])`
of `comfy_api.latest`. Option lists that ComfyUI computes (`comfy.samplers.SAMPLER_NAMES`, an enum's
`as_input()`) are evaluated from their definitions; lists of the user's files (`folder_paths.get_filename_list`)
are recorded as the folder they come from. A node in NODES that cannot be read is an error.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import json
import re
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TABLE = ROOT / "vidtune" / "export" / "comfyui_nodes.json"

# The files that define the nodes below (ComfyUI's own core nodes; no custom node packs).
SOURCES = ("nodes.py", "comfy_extras/nodes_custom_sampler.py", "comfy_extras/nodes_model_advanced.py",
           "comfy_extras/nodes_lt.py", "comfy_extras/nodes_lt_audio.py", "comfy_extras/nodes_wan.py",
           "comfy_extras/nodes_hunyuan.py", "comfy_extras/nodes_mochi.py", "comfy_extras/nodes_kandinsky5.py",
           "comfy_extras/nodes_flux.py", "comfy_extras/nodes_video.py", "comfy_extras/nodes_audio.py",
           "comfy_extras/nodes_latent.py")

NODES = (
    # loaders
    "UNETLoader", "CheckpointLoaderSimple", "CLIPLoader", "DualCLIPLoader", "VAELoader", "CLIPVisionLoader",
    "LoraLoaderModelOnly", "LoadImage", "LoadVideo", "GetVideoComponents", "LTXAVTextEncoderLoader",
    "LTXVAudioVAELoader",
    # conditioning
    "CLIPTextEncode", "CLIPVisionEncode", "FluxGuidance", "LTXVConditioning",
    # latents and image-to-video
    "EmptyLTXVLatentVideo", "LTXVImgToVideo", "LTXVImgToVideoInplace", "LTXVEmptyLatentAudio", "LTXVConcatAVLatent",
    "LTXVSeparateAVLatent", "EmptyHunyuanLatentVideo", "EmptyHunyuanVideo15Latent",
    "HunyuanVideo15ImageToVideo", "EmptyMochiLatentVideo", "WanImageToVideo", "Wan22ImageToVideoLatent",
    "WanVaceToVideo", "TrimVideoLatent",
    "Kandinsky5ImageToVideo", "ReplaceVideoLatentFrames", "NormalizeVideoLatentStart",
    # model sampling and sampling
    "ModelSamplingSD3", "KSamplerSelect", "BasicScheduler", "LTXVScheduler", "RandomNoise", "DisableNoise",
    "CFGGuider", "BasicGuider", "SplitSigmas", "SamplerCustomAdvanced",
    # output
    "VAEDecode", "LTXVAudioVAEDecode", "CreateVideo", "SaveVideo",
)


class SourceError(Exception):
    """A node definition this reader does not understand (ComfyUI changed its form): update the reader."""


@dataclass(frozen=True)
class Source:
    """ComfyUI's parsed files, with the module-level values the node definitions refer to."""

    root: Path
    trees: dict[str, ast.Module]
    io_types: dict[str, str]  # comfy_api class name (Int, Latent, ...) -> socket type (INT, LATENT, ...)
    classic_types: list[str]  # the members of comfy.comfy_types.IO, which classic nodes may name as IO.STRING
    constants: dict[str, list[str]]  # a name a definition refers to -> the option list it evaluates to

    @classmethod
    def read(cls, root: Path, files: tuple[str, ...] = SOURCES) -> Source:
        trees = {name: ast.parse((root / name).read_text(), name) for name in files}
        io_file = root / "comfy_api" / "latest" / "_io.py"
        classic = enum_members(root / "comfy" / "comfy_types" / "node_typing.py")["IO"]
        return cls(root, trees, io_types(ast.parse(io_file.read_text())), classic, constants(root))


def io_types(tree: ast.Module) -> dict[str, str]:
    """The `@comfytype(io_type="X")` decorated classes of comfy_api/latest/_io.py."""
    types = {}
    for node in tree.body:
        if not isinstance(node, ast.ClassDef):
            continue
        for decorator in node.decorator_list:
            if isinstance(decorator, ast.Call) and getattr(decorator.func, "id", None) == "comfytype":
                for keyword in decorator.keywords:
                    if keyword.arg == "io_type":
                        types[node.name] = ast.literal_eval(keyword.value)
    return types


def constants(root: Path) -> dict[str, list[str]]:
    """The option lists computed in comfy/samplers.py and the video enums of comfy_api."""
    samplers = ast.parse((root / "comfy" / "samplers.py").read_text())
    values: dict[str, Any] = {}
    for node in samplers.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value = evaluate(node.value, values)
            if value is not None:
                values[node.targets[0].id] = value
    found = {name: list(value) for name, value in values.items() if isinstance(value, list)}
    found["KSampler.SAMPLERS"] = found["SAMPLER_NAMES"]
    found["KSampler.SCHEDULERS"] = found["SCHEDULER_NAMES"]
    found.update(enum_members(root / "comfy_api" / "latest" / "_util" / "video_types.py", ".as_input"))
    return found


def enum_members(path: Path, suffix: str = "") -> dict[str, list[str]]:
    """Each class of a file with its string members' values, e.g. {"VideoCodec.as_input": ["auto", "h264"]}."""
    found = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ClassDef):
            found[f"{node.name}{suffix}"] = [item.value.value for item in node.body if isinstance(item, ast.Assign)
                                             and isinstance(item.value, ast.Constant)]
    return found


def evaluate(expression: ast.expr, values: dict[str, Any]) -> Any:
    """A module-level list, a dict's keys, or the sum of lists; None for anything else."""
    if isinstance(expression, ast.List | ast.Tuple):
        items = [item.value for item in expression.elts if isinstance(item, ast.Constant)]
        return items if len(items) == len(expression.elts) else None
    if isinstance(expression, ast.Dict):
        keys = [key.value for key in expression.keys if isinstance(key, ast.Constant)]
        return dict.fromkeys(keys) if len(keys) == len(expression.keys) else None
    if isinstance(expression, ast.Name):
        return values.get(expression.id)
    if isinstance(expression, ast.BinOp) and isinstance(expression.op, ast.Add):
        left, right = evaluate(expression.left, values), evaluate(expression.right, values)
        return left + right if isinstance(left, list) and isinstance(right, list) else None
    if (isinstance(expression, ast.Call) and getattr(expression.func, "id", None) == "list"
            and len(expression.args) == 1):
        inner = evaluate(expression.args[0], values)
        return list(inner) if isinstance(inner, dict | list) else None
    return None


def dotted(expression: ast.expr) -> str:
    """`comfy.samplers.KSampler.SAMPLERS` as text; '' for anything that is not a dotted name."""
    if isinstance(expression, ast.Name):
        return expression.id
    if isinstance(expression, ast.Attribute):
        inner = dotted(expression.value)
        return f"{inner}.{expression.attr}" if inner else ""
    return ""


def options(expression: ast.expr, source: Source, where: str, owner: ast.ClassDef | None = None) -> dict[str, Any]:
    """A combo's options: a literal list, a computed list, or the folder of the user's files it lists (directly, or
    through a method of the node's class, as VAELoader's `s.vae_list(s)`)."""
    literal = evaluate(expression, {})
    if isinstance(literal, list):
        return {"options": literal}
    if isinstance(expression, ast.Call):
        name = dotted(expression.func)
        if name.endswith("get_filename_list") and expression.args:
            return {"folder": ast.literal_eval(expression.args[0])}
        if name == "sorted":  # LoadImage: the files of ComfyUI's input folder
            return {"folder": "input"}
        method = next((item for item in (owner.body if owner else []) if isinstance(item, ast.FunctionDef)
                       and name in (f"s.{item.name}", f"cls.{item.name}")), None)
        if method is not None:
            folders = [ast.literal_eval(call.args[0]) for call in ast.walk(method) if isinstance(call, ast.Call)
                       and dotted(call.func).endswith("get_filename_list") and call.args]
            if folders:
                return {"folder": folders[0]}
        if name.endswith(".as_input"):
            key = ".".join(name.split(".")[-2:])
            if key in source.constants:
                return {"options": source.constants[key]}
    name = dotted(expression)
    for key, values in source.constants.items():
        if name == key or name.endswith(f".{key}"):
            return {"options": values}
    raise SourceError(f"{where}: cannot read the options {ast.unparse(expression)}")


def classic_node(node: ast.ClassDef, source: Source, where: str) -> dict[str, Any]:
    """A node class with INPUT_TYPES (returning a dict literal) and RETURN_TYPES."""
    method = next((item for item in node.body if isinstance(item, ast.FunctionDef) and item.name == "INPUT_TYPES"),
                  None)
    if method is None:
        raise SourceError(f"{where}: no INPUT_TYPES")
    returned = [item.value for item in ast.walk(method) if isinstance(item, ast.Return)]
    if len(returned) != 1 or not isinstance(returned[0], ast.Dict):
        raise SourceError(f"{where}: INPUT_TYPES does not return one dict literal")
    sections: dict[str, dict[str, Any]] = {"required": {}, "optional": {}}
    for key, value in zip(returned[0].keys, returned[0].values, strict=True):
        section = ast.literal_eval(key) if key is not None else None
        if section not in sections:
            continue  # "hidden": filled in by ComfyUI itself
        if not isinstance(value, ast.Dict):
            raise SourceError(f"{where}: {section} is not a dict literal")
        for name, spec in zip(value.keys, value.values, strict=True):
            sections[section][ast.literal_eval(name)] = classic_input(spec, source, f"{where} input", node)
    outputs: list[str] = []
    for item in node.body:
        if (isinstance(item, ast.Assign) and any(getattr(t, "id", None) == "RETURN_TYPES" for t in item.targets)):
            if not isinstance(item.value, ast.Tuple):
                raise SourceError(f"{where}: RETURN_TYPES is not a tuple literal")
            outputs = [classic_type(element, source, f"{where} output") for element in item.value.elts]
    return {**sections, "outputs": outputs}


def classic_input(spec: ast.expr, source: Source, where: str, owner: ast.ClassDef) -> dict[str, Any]:
    if not isinstance(spec, ast.Tuple) or not spec.elts:
        raise SourceError(f"{where}: not a tuple")
    kind, extra = spec.elts[0], spec.elts[1] if len(spec.elts) > 1 else None
    entry: dict[str, Any]
    if isinstance(kind, ast.Constant) or dotted(kind).startswith("IO."):
        entry = {"type": classic_type(kind, source, where)}
    else:
        entry = {"type": "COMBO", **options(kind, source, where, owner)}
    if isinstance(extra, ast.Dict):
        for key, value in zip(extra.keys, extra.values, strict=True):
            if isinstance(key, ast.Constant) and key.value == "default":
                entry["default"] = literal(value)
    return entry


def classic_type(kind: ast.expr, source: Source, where: str) -> str:
    """A socket type written as "LATENT" or as IO.LATENT."""
    if isinstance(kind, ast.Constant) and isinstance(kind.value, str):
        return kind.value
    name = dotted(kind)
    if name.startswith("IO.") and name[3:] in source.classic_types:
        return name[3:]
    raise SourceError(f"{where}: cannot read the type {ast.unparse(kind)}")


def schema_node(schema: ast.Call, source: Source, where: str) -> dict[str, Any]:
    """A `comfy_api` node: io.Schema(node_id=..., inputs=[io.X.Input(...)], outputs=[io.Y.Output(...)])."""
    keywords = {keyword.arg: keyword.value for keyword in schema.keywords}
    sections: dict[str, dict[str, Any]] = {"required": {}, "optional": {}}
    inputs = keywords.get("inputs", ast.List(elts=[]))
    if not isinstance(inputs, ast.List):
        raise SourceError(f"{where}: inputs is not a list literal")
    for item in inputs.elts:
        name, entry, optional = schema_socket(item, source, where)
        sections["optional" if optional else "required"][name] = entry
    outputs = keywords.get("outputs", ast.List(elts=[]))
    if not isinstance(outputs, ast.List):
        raise SourceError(f"{where}: outputs is not a list literal")
    return {**sections, "outputs": [schema_socket(item, source, where)[1]["type"] for item in outputs.elts]}


def schema_socket(item: ast.expr, source: Source, where: str) -> tuple[str, dict[str, Any], bool]:
    """One io.X.Input(...) or io.X.Output(...): its name, type, default / options and whether it is optional."""
    if not (isinstance(item, ast.Call) and isinstance(item.func, ast.Attribute)
            and item.func.attr in ("Input", "Output")):
        raise SourceError(f"{where}: cannot read {ast.unparse(item)}")
    owner = item.func.value
    if isinstance(owner, ast.Call) and dotted(owner.func).endswith("Custom"):
        kind = ast.literal_eval(owner.args[0])
    else:
        kind = source.io_types.get(dotted(owner).split(".")[-1], "")
    if not kind:
        raise SourceError(f"{where}: unknown socket class {ast.unparse(owner)}")
    keywords = {keyword.arg: keyword.value for keyword in item.keywords}
    name_node = item.args[0] if item.args else keywords.get("id")
    name = ast.literal_eval(name_node) if name_node is not None else ""
    entry: dict[str, Any] = {"type": kind}
    if "default" in keywords:
        entry["default"] = literal(keywords["default"])
    if "options" in keywords:
        entry.update(options(keywords["options"], source, f"{where} {name}"))
    optional = "optional" in keywords and ast.literal_eval(keywords["optional"]) is True
    return name, entry, optional


def literal(value: ast.expr) -> Any:
    """A default's value; a computed default (rare) is kept as its source text."""
    try:
        return ast.literal_eval(value)
    except ValueError:
        return ast.unparse(value)


def read_nodes(source: Source, wanted: tuple[str, ...] = NODES) -> dict[str, dict[str, Any]]:
    """The nodes `wanted`, by the id ComfyUI registers them under, each with the file it is defined in."""
    found: dict[str, dict[str, Any]] = {}
    for file, tree in source.trees.items():
        classes = {node.name: node for node in tree.body if isinstance(node, ast.ClassDef)}
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and dotted(node.func).endswith("Schema"):
                node_id = next((k.value for k in node.keywords if k.arg == "node_id"), None)
                if isinstance(node_id, ast.Constant) and node_id.value in wanted:
                    found[node_id.value] = {"file": file, **schema_node(node, source, f"{file} {node_id.value}")}
        for node in classes.values():  # a subclass renaming its parent's schema (EmptyHunyuanVideo15Latent)
            renamed = [item.value.value for item in ast.walk(node) if isinstance(item, ast.Assign)
                       and any(getattr(t, "attr", None) == "node_id" for t in item.targets)
                       and isinstance(item.value, ast.Constant)]
            parents = [classes[base.id] for base in node.bases if getattr(base, "id", None) in classes]
            if renamed and renamed[0] in wanted and parents:
                schemas = [item for item in ast.walk(parents[0]) if isinstance(item, ast.Call)
                           and dotted(item.func).endswith("Schema")]
                found[renamed[0]] = {"file": file, **schema_node(schemas[0], source, f"{file} {renamed[0]}")}
        for node in tree.body:
            mapping = node.value if isinstance(node, ast.Assign) else None
            if (mapping is not None and isinstance(mapping, ast.Dict)
                    and any(getattr(t, "id", None) == "NODE_CLASS_MAPPINGS" for t in node.targets)):
                for key, value in zip(mapping.keys, mapping.values, strict=True):
                    node_id, class_name = ast.literal_eval(key), getattr(value, "id", None)
                    if node_id in wanted and node_id not in found and class_name in classes:
                        found[node_id] = {"file": file,
                                          **classic_node(classes[class_name], source, f"{file} {node_id}")}
    missing = [name for name in wanted if name not in found]
    if missing:
        raise SourceError(f"not defined in {', '.join(source.trees)}: {', '.join(missing)}")
    return {name: found[name] for name in wanted}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("source", type=Path, help="a ComfyUI checkout")
    parser.add_argument("--commit", required=True, help="the checkout's commit (40 hex digits)")
    parser.add_argument("--version", required=True, help="ComfyUI's version at that commit, e.g. 0.8.0")
    parser.add_argument("--read", default=datetime.date.today().isoformat(), help="the date it was read")
    parser.add_argument("--output", type=Path, default=TABLE)
    args = parser.parse_args(argv)
    if not re.fullmatch(r"[0-9a-f]{40}", args.commit):
        parser.error("--commit must be the full 40-digit commit")
    try:
        nodes = read_nodes(Source.read(args.source, SOURCES), NODES)
    except (SourceError, OSError, SyntaxError) as error:
        print(f"comfyui_node_table: {error}", file=sys.stderr)
        return 1
    table = {"read": args.read, "source": f"ComfyUI {args.version}", "repository": "github.com/comfyanonymous/ComfyUI",
             "commit": args.commit, "written_by": "tools/comfyui_node_table.py",
             "nodes": {name: {"file": node["file"], "required": node["required"], "optional": node["optional"],
                              "outputs": node["outputs"]} for name, node in nodes.items()}}
    args.output.write_text(json.dumps(table, indent=1) + "\n")
    print(f"wrote {len(nodes)} nodes to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
