"""What the layering promises, checked over vidtune/'s source: training algorithms are named only where they are
defined (`vidtune/algorithms/`) and in the config's allowed values, and a model family's several denoisers stay
inside `vidtune/models/` (generic code asks the spec's hooks)."""

from __future__ import annotations

import ast
from pathlib import Path

import vidtune
from vidtune.algorithms import ALGORITHM_NAMES

PACKAGE = Path(vidtune.__file__).parent
ALGORITHMS_HOME = PACKAGE / "algorithms"
CONFIG_VALUES = PACKAGE / "config" / "schema.py"
EXPERT_CLASSES = ("TwoExperts", "StepRouted")


def python_files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def dict_keys(tree: ast.AST) -> set[int]:
    """The ids of string constants used as dict keys (config sections such as `lora`, not algorithm names)."""
    return {id(key) for node in ast.walk(tree) if isinstance(node, ast.Dict) for key in node.keys if key is not None}


def test_algorithm_names_appear_only_where_algorithms_are_defined_and_in_the_config_values():
    found = []
    for path in python_files():
        if path.is_relative_to(ALGORITHMS_HOME) or path == CONFIG_VALUES:
            continue
        tree = ast.parse(path.read_text())
        keys = dict_keys(tree)
        found += [f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.value!r}" for node in ast.walk(tree)
                  if isinstance(node, ast.Constant) and node.value in ALGORITHM_NAMES and id(node) not in keys]
    assert not found, "compare algorithm traits (vidtune.algorithms), not names:\n" + "\n".join(found)


def test_the_expert_classes_stay_inside_the_model_families():
    found = []
    for path in python_files():
        if path.is_relative_to(PACKAGE / "models"):
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = ([alias.name for alias in node.names] if isinstance(node, ast.ImportFrom)
                     else [node.id] if isinstance(node, ast.Name) else [node.attr] if isinstance(node, ast.Attribute)
                     else [])
            found += [f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {name}" for name in names
                      if name in EXPERT_CLASSES]
    assert not found, "ask the spec's hooks (vidtune/models/spec/hooks.py) instead:\n" + "\n".join(found)
