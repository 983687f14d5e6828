"""A pytest plugin (`-p module_check`, with bench/gpu on PYTHONPATH): at the end of the session, fail if a module
of vidtune/ was never imported by the tests that ran (bench/gpu/rehearse.sh runs the minimum-version subset so)."""

from __future__ import annotations

import sys
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
    if missing:
        print(f"\nmodule_check: these modules of vidtune/ were not imported by the tests that ran: {missing}",
              flush=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
    else:
        print(f"\nmodule_check: the tests imported all {len(vidtune_modules())} modules of vidtune/", flush=True)
