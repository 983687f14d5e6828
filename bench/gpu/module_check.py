"""A pytest plugin (`-p module_check`, with bench/gpu on PYTHONPATH): at the end of the session, every module of
vidtune/ that the tests did not import in this process (some run only in the subprocesses the tests start, such as
`vidtune quickstart`) is imported here, and the session fails if one cannot be (bench/gpu/rehearse.sh runs the
minimum-version subset so: every module at least imports on those versions)."""

from __future__ import annotations

import importlib
import sys
import traceback
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Run only as `python -m vidtune`.
NOT_IMPORTED = {"vidtune.__main__"}


def vidtune_modules() -> set[str]:
    names = set()
    for path in (ROOT / "vidtune").rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names.add(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names - NOT_IMPORTED


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    missing = sorted(vidtune_modules() - set(sys.modules))
    broken = []
    for name in missing:
        try:
            importlib.import_module(name)
        except Exception:  # reported below and fails the session
            broken.append(name)
            traceback.print_exc()
    print(f"\nmodule_check: {len(vidtune_modules()) - len(missing)} modules of vidtune/ imported by the tests in this "
          f"process; imported here: {missing or 'none'}", flush=True)
    if broken:
        print(f"module_check: these modules of vidtune/ do not import: {broken}", flush=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
