"""One studio server for the studio's tests: a root holding a tiny model's config and two real clips, served by
uvicorn on a free local port in a thread, as `vidtune studio` serves it."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml

pytest.importorskip("fastapi", reason="the studio extra (pip install 'vidtune[studio]') is not installed")
httpx = pytest.importorskip("httpx", reason="httpx (in the test extra) is not installed")
uvicorn = pytest.importorskip("uvicorn", reason="the studio extra (pip install 'vidtune[studio]') is not installed")

from vidtune.data.synthetic import render_shapes_dataset  # noqa: E402
from vidtune.models.tiny import TINY_SHAPES  # noqa: E402
from vidtune.studio.app import create_app  # noqa: E402
from vidtune.studio.security import CSRF_HEADER  # noqa: E402


@dataclass
class Studio:
    url: str
    root: Path
    secret: str
    model: Path

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.url, timeout=120)

    def post(self, path: str, body: dict) -> httpx.Response:
        with self.client() as client:
            return client.post(path, json=body, headers={CSRF_HEADER: self.secret})

    def get(self, url: str, **params) -> httpx.Response:
        with self.client() as client:
            return client.get(url, params=params)

    def write_config(self, name: str, **sections) -> str:
        """A tiny run's config under the root (relative paths, as a user writes them); returns its name."""
        frames, height, width = TINY_SHAPES["ltx-video"]
        config = {
            "model": {"name": "ltx-video", "pretrained": str(self.model)},
            "data": {"root": "clips", "frames": frames, "height": height, "width": width, "num_workers": 0},
            "training": {"steps": 4, "batch_size": 1, "learning_rate": 1e-3, "seed": 0, "precision": "fp32",
                         "device": "cpu"},
            "checkpoint": {"every": 0, "keep": 2},
            "validation": {"enabled": False, "num_inference_steps": 2, "prompts": ["a red circle"]},
            "logging": {"progress": False, "log_every": 1},
            "output_dir": f"runs/{Path(name).stem}",
        }
        for section, values in sections.items():
            config[section] = {**config.get(section, {}), **values}
        (self.root / name).write_text(yaml.safe_dump(config, sort_keys=False))
        return name

    def wait_for(self, what: str, check, timeout: float = 180.0):
        """Poll `check()` until it returns something true; fails naming `what` after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            value = check()
            if value:
                return value
            time.sleep(0.1)  # a local server: each poll is a few milliseconds
        raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")

    def job(self, number: int) -> dict:
        return self.get(f"/api/jobs/{number}").json()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def serve_studio(root: Path, model: Path) -> Iterator[Studio]:
    """`vidtune studio --root root`, served by uvicorn on a free local port in a thread while the block runs."""
    app = create_app(root)
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the studio server did not start"
        time.sleep(0.05)
    try:
        yield Studio(f"http://127.0.0.1:{port}", root, app.state.access.csrf, model)
    finally:
        server.should_exit = True
        thread.join(timeout=120)


@pytest.fixture(scope="session")
def studio(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir) -> Iterator[Studio]:
    root = tmp_path_factory.mktemp("studio-root")
    render_shapes_dataset(root / "clips", num_clips=2, num_frames=17, height=48, width=48, fps=24, seed=0)
    with serve_studio(root, tiny_model_dir("ltx-video")) as served:
        yield served
