"""The GPU run's tooling (bench/gpu/): minimum pins, carries that fit, results written as they come, and a test
subset for the minimum versions that imports every module."""

from __future__ import annotations

import ast
import importlib.util
import json
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "bench" / "gpu"


def load(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_gpu_{name}", GPU / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up by name
    sys.path.insert(0, str(GPU))
    try:
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(GPU))
    return module


def test_minimums_pin_every_declared_lower_bound_and_split_by_the_image(tmp_path, capsys):
    minimums = load("minimums")
    bounds = minimums.lower_bounds()
    # The versions of the GPU machine's image are the declared minimums of what it has.
    assert bounds["torch"] == "2.11" and bounds["transformers"] == "5.17" and bounds["huggingface-hub"] == "1.33"
    image = tmp_path / "image.txt"
    image.write_text("# comment\ntorch\nTransformers\n")
    minimums.main(["--only-in", str(image)])
    assert capsys.readouterr().out.splitlines() == ["torch==2.11", "transformers==5.17"]
    minimums.main(["--not-in", str(image)])
    lines = capsys.readouterr().out.splitlines()
    assert "diffusers==0.42" in lines and not any(line.startswith(("torch==", "transformers==")) for line in lines)


def test_minimums_refuses_a_requirement_without_a_plain_lower_bound(tmp_path, monkeypatch):
    minimums = load("minimums")
    (tmp_path / "pyproject.toml").write_text('[project]\ndependencies = ["torch>=2.11", "numpy<3"]\n'
                                             "[project.optional-dependencies]\n")
    monkeypatch.setattr(minimums, "ROOT", tmp_path)
    with pytest.raises(SystemExit, match="numpy<3"):
        minimums.lower_bounds()


def fake_wheel(folder: Path, name: str, version: str, requires: list[str], payload: dict[str, int]) -> Path:
    path = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as wheel:
        info = f"{name}-{version}.dist-info"
        metadata = f"Name: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
        wheel.writestr(f"{info}/METADATA", metadata)
        files = {f"{name}/{file}": size for file, size in payload.items()}
        for file, size in files.items():
            wheel.writestr(file, bytes(size))  # stored, not compressed: the size is what it weighs
        wheel.writestr(f"{info}/RECORD", "".join(f"{file},,\n" for file in [*files, f"{info}/METADATA"]))
    return path


def test_bitsandbytes_keeps_only_the_machines_cuda_library(tmp_path):
    carries = load("carries")
    wheel = fake_wheel(tmp_path, "bitsandbytes", "0.50.0", ["torch"],
                       {"libbitsandbytes_cpu.so": 10, "libbitsandbytes_cuda130.so": 10,
                        "libbitsandbytes_cuda128.so": 10, "libbitsandbytes_rocm70.so": 10, "__init__.py": 1})
    out = tmp_path / "slim"
    out.mkdir()
    slim = carries.slim_bitsandbytes(wheel, "130", out)
    with zipfile.ZipFile(slim) as result:
        names = result.namelist()
        record = result.read("bitsandbytes-0.50.0.dist-info/RECORD").decode()
    assert "bitsandbytes/libbitsandbytes_cuda130.so" in names and "bitsandbytes/libbitsandbytes_cpu.so" in names
    assert not any("cuda128" in name or "rocm" in name for name in names)
    assert "cuda128" not in record and "cuda130" in record
    with pytest.raises(SystemExit, match="no library for CUDA 126"):
        carries.slim_bitsandbytes(wheel, "126", out)


def test_carries_fit_the_limit_and_every_call_has_what_vidtune_imports(tmp_path, monkeypatch, capsys):
    carries = load("carries")
    wheels = tmp_path / "cp312" / "all"
    wheels.mkdir(parents=True)
    mib = 1024**2
    fake_wheel(wheels, "diffusers", "0.42.0", ["importlib_metadata"], {"a.bin": 20 * mib})
    fake_wheel(wheels, "importlib_metadata", "10.2.0", [], {"a.py": 10})
    fake_wheel(wheels, "torchao", "0.18.0", [], {"a.bin": 20 * mib})
    fake_wheel(wheels, "deepspeed", "0.19.8", ["hjson", "torch"], {"a.bin": 20 * mib})
    fake_wheel(wheels, "hjson", "3.1.0", [], {"a.py": 10})
    monkeypatch.setattr(carries, "tree_bytes", lambda: 5 * mib)
    monkeypatch.setattr(carries, "lower_bounds", lambda extras=None: {"diffusers": "0.42", "torch": "2.11"})
    monkeypatch.setattr(carries, "ROOT", tmp_path)
    carries.main([str(wheels), "--limit-mib", "50"])
    out = capsys.readouterr().out
    first = sorted(path.name for path in (tmp_path / "cp312" / "call1").iterdir())
    second = sorted(path.name for path in (tmp_path / "cp312" / "call2").iterdir())
    # 5 + 20 (core) + 20 fits once: each extra feature gets its own call, the core wheels travel with both.
    assert first == ["diffusers-0.42.0-py3-none-any.whl", "importlib_metadata-10.2.0-py3-none-any.whl",
                     "torchao-0.18.0-py3-none-any.whl"]
    assert second == ["deepspeed-0.19.8-py3-none-any.whl", "diffusers-0.42.0-py3-none-any.whl",
                      "hjson-3.1.0-py3-none-any.whl", "importlib_metadata-10.2.0-py3-none-any.whl"]
    assert 'carry: ["cp312/call1"]' in out and "run.sh --wheels cp312/call2 --only tests" in out
    with pytest.raises(SystemExit, match="exceed 20 MiB"):
        carries.main([str(wheels), "--limit-mib", "20"])


def test_results_are_written_after_every_row(tmp_path):
    run = load("run")
    results = run.Results(tmp_path, "CPU (rehearsal)", 60)
    results.add("lora", "tiny wan", "measured", seconds_per_step=0.5, peak_bytes=2 * 1024**3,
                planned_bytes=3 * 1024**3)
    document = json.loads((tmp_path / "gpu_results.json").read_text())
    assert [row["name"] for row in document["rows"]] == ["tiny wan"]
    results.add("options", "nf4", "needs CUDA")
    table = (tmp_path / "gpu_results.md").read_text()
    assert "| tiny wan | measured | 0.500 |  | 2,048.0 |  | 3,072.0 | 1.500 |" in table
    assert "| nf4 | needs CUDA |" in table
    assert len(json.loads((tmp_path / "gpu_results.json").read_text())["rows"]) == 2


def test_a_row_that_cannot_run_here_says_why_and_a_failure_is_recorded(tmp_path, monkeypatch):
    run = load("run")
    results = run.Results(tmp_path, "CPU (rehearsal)", 60)
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    assert run.attempt(results, "options", "nf4", 1, lambda: {}, needs_cuda=True) is None
    assert run.attempt(results, "options", "x", 1, lambda: {}, package="no-such-package-here") is None
    assert run.attempt(results, "options", "slow", 1e9, lambda: {}) is None

    def broken() -> dict:
        raise RuntimeError("out of memory")

    assert run.attempt(results, "options", "broken", 1, broken) is None
    assert run.attempt(results, "options", "fine", 1, lambda: {"seconds_per_step": 1.0}) == {"seconds_per_step": 1.0}
    # A measurement's own `seconds` does not clash with the row's wall time.
    assert run.attempt(results, "options", "own seconds", 1, lambda: {"seconds": -1.0})["seconds"] == -1.0
    statuses = [(row["name"], row["status"]) for row in results.rows]
    assert statuses == [("nf4", "needs CUDA"), ("x", "not installed: no-such-package-here"),
                        ("slow", "not reached (time)"), ("broken", "failed"), ("fine", "measured"),
                        ("own seconds", "measured")]
    assert "RuntimeError: out of memory" in results.rows[3]["error"]


def _module_of(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """Dotted names of the project's modules (vidtune, tests) `path` imports anywhere, relative ones resolved."""
    package = _module_of(path).split(".")
    if path.name != "__init__.py":
        package = package[:-1]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join([*package[: len(package) - node.level + 1], *([base] if base else [])])
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("vidtune."):
            # Imported by name: the registries' "module:Class" strings; a family's tiny model is the spec
            # module's namesake under vidtune.models.tiny (vidtune/models/registry.py).
            module = node.value.split(":")[0]
            found.add(module)
            if module.startswith("vidtune.models.") and ":" in node.value:
                found.add("vidtune.models.tiny." + module.rsplit(".", 1)[-1])
    return {name for name in found if name.split(".")[0] in ("vidtune", "tests")}


def test_the_minimum_version_tests_import_every_module():
    modules = {_module_of(path): path for folder in ("vidtune", "tests") for path in (ROOT / folder).rglob("*.py")}
    listed = [line.strip() for line in (GPU / "minimum_tests.txt").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    start = set()
    for entry in listed:
        path = ROOT / entry
        assert path.exists(), f"bench/gpu/minimum_tests.txt: {entry} does not exist"
        files = sorted(path.rglob("*.py")) if path.is_dir() else [path]
        # Each test file's conftest.py files run too.
        conftests = [parent / "conftest.py" for parent in path.parents if (parent / "conftest.py").is_file()]
        start.update(_module_of(file) for file in [*files, *conftests])
    seen, todo = set(), list(start)
    while todo:
        name = todo.pop()
        if name in seen or name not in modules:
            continue
        seen.add(name)
        parts = name.split(".")
        todo.extend(".".join(parts[:i]) for i in range(1, len(parts)))  # importing a.b.c runs a and a.b
        todo.extend(_imports(modules[name]))
    # vidtune/__main__.py only runs under `python -m vidtune` (two lines calling vidtune.cli.main).
    missing = sorted(name for name in modules if name.startswith("vidtune") and name not in seen
                     and name != "vidtune.__main__")
    assert not missing, f"no test in bench/gpu/minimum_tests.txt imports {missing}"


def test_pytest_lines_become_rows():
    run = load("run")
    line = "tests/training/test_compile.py::test_compiled_on_cuda[int8] SKIPPED [ 66%]"
    assert run.OUTCOME.match(line)["test"] == "tests/training/test_compile.py::test_compiled_on_cuda[int8]"
    assert run.OUTCOME.match("tests/a.py::test_b[x y] PASSED").group("outcome") == "PASSED"
    summary = run.SUMMARY.match("FAILED tests/a.py::test_b - AssertionError: 3 != 4")
    assert summary["test"] == "tests/a.py::test_b" and summary["message"] == "AssertionError: 3 != 4"
    assert run.OUTCOME.match("tests/a.py::test_b") is None


def test_a_lora_step_row_runs_on_the_cpu(tmp_path):
    """The `lora` section's measurement (bench/gpu/steps.py) end to end on a tiny model: its batch source is a
    complete one and the steps are logged and timed."""
    from vidtune.models.tiny import write_tiny_model

    steps = load("steps")
    result = steps.run_steps("ltx-video", write_tiny_model("ltx-video", tmp_path / "tiny"), (9, 32, 32), [], "cpu",
                             steps=steps.WARMUP + 2)
    assert result.steps == steps.WARMUP + 2
    assert result.seconds_per_step > 0
    assert result.planned_bytes is not None and result.planned_bytes > 0
