"""The declared dependencies are what the code imports, plus the few it needs without importing them."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Declared but not imported by vidtune/, each for the reason pyproject.toml gives.
NOT_IMPORTED = {"accelerate", "sentencepiece", "protobuf"}


def normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> set[str]:
    """The dependencies, and the extras of optional features (each imported only when its feature is chosen)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    features = [spec for extra, specs in project["optional-dependencies"].items() if extra != "test" for spec in specs]
    return {normalise(re.match(r"[A-Za-z0-9_.\-]+", spec).group()) for spec in [*project["dependencies"], *features]}


def imported_modules() -> set[str]:
    """Top-level names of every absolute import under vidtune/, at any depth (lazy imports included)."""
    names = set()
    for path in (ROOT / "vidtune").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
    return {name for name in names if name not in sys.stdlib_module_names and name not in ("__future__", "vidtune")}


def distributions_of(modules: set[str]) -> dict[str, set[str]]:
    """module -> the installed distributions that provide it (PIL -> pillow, yaml -> pyyaml); an optional package that
    is not installed here (wandb where the environment lacks it) is taken to be its module's namesake."""
    provided = importlib.metadata.packages_distributions()
    return {module: {normalise(dist) for dist in provided.get(module, [module])} for module in modules}


def test_every_imported_package_is_declared():
    found = distributions_of(imported_modules())
    missing = {module: dists for module, dists in found.items() if not dists & declared()}
    assert not missing, f"imported by vidtune/ but not in pyproject.toml dependencies: {missing}"


def test_every_declared_package_is_imported_or_explained():
    used = set().union(*distributions_of(imported_modules()).values())
    unused = declared() - used - NOT_IMPORTED
    assert not unused, f"declared in pyproject.toml but never imported by vidtune/: {sorted(unused)}"
    assert declared() >= NOT_IMPORTED


def test_diffusers_loads_models_in_place_with_accelerate():
    # Why accelerate is declared: without it diffusers' from_pretrained falls back to building the whole model
    # with random weights before loading the checkpoint (low_cpu_mem_usage=False).
    from diffusers.models.modeling_utils import _LOW_CPU_MEM_USAGE_DEFAULT
    from diffusers.utils import is_accelerate_available

    assert is_accelerate_available() and _LOW_CPU_MEM_USAGE_DEFAULT


def test_a_tokenizer_shipped_as_spiece_model_only_loads(tmp_path):
    # Why sentencepiece and protobuf are declared: transformers converts spiece.model with both.
    pytest.importorskip("google.protobuf", reason="protobuf, a declared dependency, is not installed")
    import sentencepiece
    from transformers import AutoTokenizer

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(["a red circle moving left", "a blue square spinning slowly"] * 50))
    folder = tmp_path / "tokenizer"
    folder.mkdir()
    sentencepiece.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(folder / "spiece"), vocab_size=30,
                                             minloglevel=2)
    (folder / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "T5Tokenizer", "extra_ids": 0}))
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ids = tokenizer("a red circle").input_ids
    assert ids[-1] == tokenizer.eos_token_id and len(ids) > 2
    assert tokenizer.decode(ids, skip_special_tokens=True) == "a red circle"
