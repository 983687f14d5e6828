"""A ComfyUI workflow in ComfyUI's API format, and its check against the node definitions ComfyUI declares.

The API format is what ComfyUI's `/prompt` endpoint runs and what its frontend opens from a file (Workflow >
Open, or dropped onto the canvas): one object per node, keyed by an id, with its `class_type` and its `inputs`,
each either a value or a link `[node id, output index]`.

`comfyui_nodes.json` (beside this module) lists, for every node type vidtune writes, the inputs and outputs its
definition in ComfyUI's source declares: the release and commit read, the file of each node and the date, written
by `tools/comfyui_node_table.py`. `problems` checks a graph against it before it is written: an unknown node type,
an input the node does not declare, a required input left out, a value of the wrong kind, a choice outside the
node's fixed list, or a link from an output of another type would each make ComfyUI refuse or misread the
workflow.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

NODE_TABLE = Path(__file__).with_name("comfyui_nodes.json")


@dataclass(frozen=True)
class Link:
    """Output `index` of node `node`, as an input of another node."""

    node: str
    index: int = 0


@dataclass
class Node:
    class_type: str
    inputs: dict[str, Any]
    title: str


@dataclass
class Graph:
    """A workflow being built: `add` returns the new node's outputs (`Link`s), the first one or all `outputs`."""

    nodes: dict[str, Node] = field(default_factory=dict)

    def add(self, class_type: str, title: str | None = None, **inputs: Any) -> Link:
        """Add a node; its first output."""
        node_id = str(len(self.nodes) + 1)
        self.nodes[node_id] = Node(class_type, {k: v for k, v in inputs.items() if v is not None},
                                   title or class_type)
        return Link(node_id, 0)

    def outputs(self, link: Link, count: int) -> list[Link]:
        """The first `count` outputs of the node `link` comes from."""
        return [Link(link.node, index) for index in range(count)]

    def api(self) -> dict[str, Any]:
        """The workflow in ComfyUI's API format."""
        def value(item: Any) -> Any:
            return [item.node, item.index] if isinstance(item, Link) else item

        return {node_id: {"class_type": node.class_type, "inputs": {k: value(v) for k, v in node.inputs.items()},
                          "_meta": {"title": node.title}}
                for node_id, node in self.nodes.items()}


@cache
def node_table() -> dict[str, Any]:
    """The node definitions read from ComfyUI's source (`comfyui_nodes.json`)."""
    return json.loads(NODE_TABLE.read_text())


def _declared(definition: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {**definition.get("required", {}), **definition.get("optional", {})}


def problems(api: dict[str, Any], table: dict[str, Any] | None = None) -> list[str]:
    """Everything in the API-format workflow `api` that ComfyUI's node definitions (`table`, default
    `node_table()`) do not allow, one line each; empty when ComfyUI can run it."""
    nodes = (table or node_table())["nodes"]
    found: list[str] = []
    for node_id, node in api.items():
        kind = node["class_type"]
        definition = nodes.get(kind)
        if definition is None:
            found.append(f"node {node_id}: ComfyUI has no node type {kind}")
            continue
        declared = _declared(definition)
        for name in definition.get("required", {}):
            if name not in node["inputs"]:
                found.append(f"node {node_id} ({kind}): the required input {name} is missing")
        for name, given in node["inputs"].items():
            spec = declared.get(name)
            if spec is None:
                found.append(f"node {node_id} ({kind}): {kind} has no input {name}")
                continue
            if isinstance(given, list) and len(given) == 2 and isinstance(given[0], str):
                found.extend(_link_problem(api, nodes, node_id, kind, name, spec, given))
                continue
            wrong = _value_problem(spec.get("type", ""), given)
            if wrong:
                found.append(f"node {node_id} ({kind}): {name}={given!r} {wrong}")
                continue
            options = spec.get("options")
            if isinstance(options, list) and given not in options:
                found.append(f"node {node_id} ({kind}): {name}={given!r} is not one of {options}")
    return found


# The widget types whose value is written in the workflow, and the Python values ComfyUI accepts for each.
_VALUES: dict[str, tuple[type, ...]] = {"INT": (int,), "FLOAT": (int, float), "BOOLEAN": (bool,), "STRING": (str,),
                                        "COMBO": (str,)}


def _value_problem(kind: str, given: Any) -> str:
    """Why `given` cannot be the value of an input of type `kind`; '' when it can."""
    accepted = _VALUES.get(kind)
    if accepted is None:
        return f"is a value, but the input takes a {kind} from another node"
    if isinstance(given, bool) and bool not in accepted:
        return f"is a boolean, but the input takes {kind}"
    if not isinstance(given, accepted):
        return f"is a {type(given).__name__}, but the input takes {kind}"
    return ""


def _link_problem(api: dict[str, Any], nodes: dict[str, Any], node_id: str, kind: str, name: str,
                  spec: dict[str, Any], link: list[Any]) -> list[str]:
    source_id, index = link
    source = api.get(source_id)
    if source is None:
        return [f"node {node_id} ({kind}): {name} links to node {source_id}, which the workflow lacks"]
    outputs = nodes.get(source["class_type"], {}).get("outputs", [])
    if index >= len(outputs):
        return [f"node {node_id} ({kind}): {name} links to output {index} of {source['class_type']}, which has "
                f"{len(outputs)}"]
    wanted, given = spec.get("type"), outputs[index]
    if wanted not in (given, "*") and given != "*":
        return [f"node {node_id} ({kind}): {name} takes {wanted}, but output {index} of {source['class_type']} is "
                f"{given}"]
    return []
