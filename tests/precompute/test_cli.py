"""`vidtune precompute` and `vidtune cache info` as a user runs them."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import yaml

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


def vidtune(*args: str) -> subprocess.CompletedProcess:
    result = subprocess.run([sys.executable, "-m", "vidtune", *args], capture_output=True, text=True, env=ENV,
                            timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.slow
def test_precompute_twice_then_cache_info(config_for, tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config_for(precompute={"enabled": False}).to_dict()))

    first = vidtune("precompute", str(path), "logging.progress=true")
    assert first.stdout.splitlines()[-1] == "conditions: 4 computed, 0 reused; latents: 4 computed, 0 reused"
    # One progress bar per stage, with items/s (and ETA while running), on stderr.
    assert "latents: 100%" in first.stderr and "clip/s" in first.stderr
    assert "conditions: 100%" in first.stderr and "caption/s" in first.stderr
    second = vidtune("precompute", str(path))
    assert second.stdout.splitlines()[-1] == "conditions: 0 computed, 4 reused; latents: 0 computed, 4 reused"

    info = vidtune("cache", "info", str(path), "data.height=48", "--verify").stdout
    assert f"Cache: {tmp_path / 'cache'}" in info
    assert "conditions: 4 entries" in info and "latents: 4 entries" in info
    assert "This config would reuse 4 entries and compute 4 (conditions: 4 of 4 cached; latents: 0 of 4 cached)" in info
