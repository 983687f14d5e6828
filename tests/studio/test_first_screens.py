"""The studio's first screens as a newcomer meets them: an empty root, a root with clips and configs, the crop a
clip card shows (each page of a fresh studio, served in-process)."""

from __future__ import annotations

import io
import os
import time
from pathlib import Path

import pytest
from PIL import Image

pytest.importorskip("fastapi", reason="the studio extra (pip install 'vidtune[studio]') is not installed")
from fastapi.testclient import TestClient

from vidtune.data.synthetic import render_shapes_dataset
from vidtune.studio.app import create_app


def _client(root: Path) -> TestClient:
    return TestClient(create_app(root), base_url="http://127.0.0.1")


def test_a_first_visit_to_an_empty_root_says_what_to_do_not_what_is_wrong(tmp_path):
    with _client(tmp_path) as client:
        settings = client.get("/settings").text
        assert 'id="new-config"' in settings and "studio.yaml is a new config" in settings
        assert 'data-new="1"' in settings  # not judged (in red) before anything is filled in
        clips = client.get("/clips").text
        assert f"No clips under {tmp_path} yet" in clips
        home = client.get("/").text
        assert "Nothing queued." in home and "Get started" in home and f"No clips under {tmp_path} yet" in home


def test_the_clips_page_lists_the_folders_and_configs_and_offers_a_config_per_folder(tmp_path):
    render_shapes_dataset(tmp_path / "beach", num_clips=1, num_frames=9, height=32, width=32, fps=24, seed=0)
    (tmp_path / "older.yaml").write_text("model:\n  name: wan\n")
    (tmp_path / "newer.yaml").write_text("model:\n  name: ltx-video\n")
    long_ago = time.time() - 3600
    os.utime(tmp_path / "older.yaml", (long_ago, long_ago))
    with _client(tmp_path) as client:
        clips = client.get("/clips").text
        assert 'href="/clips?data=beach"' in clips and 'href="/clips?data=newer.yaml"' in clips
        offer = 'href="/settings?file=beach.yaml&amp;data_root=beach"'
        assert offer in clips and "new config from this folder" in clips
        assert offer in client.get("/").text  # the first screen offers the same while there is no run
        new = client.get("/settings", params={"file": "beach.yaml", "data_root": "beach"}).text
        assert 'name="data.root" value="beach"' in new and 'id="new-config"' in new
        # Settings and Start open on the config written last, not the first by name.
        assert 'data-file="newer.yaml"' in client.get("/settings").text
        assert '<option value="newer.yaml" selected>' in client.get("/").text


def test_a_clip_card_shows_the_crop_that_trains(tmp_path):
    render_shapes_dataset(tmp_path / "clips", num_clips=1, num_frames=9, height=48, width=48, fps=24, seed=0)
    clip = sorted((tmp_path / "clips").rglob("*.mp4"))[0].relative_to(tmp_path).as_posix()
    (tmp_path / "wide.yaml").write_text("model:\n  name: ltx-video\n  pretrained: not-downloaded-yet\n"
                                        "data:\n  root: clips\n  frames: 9\n  height: 32\n  width: 64\n")
    with _client(tmp_path) as client:
        whole = Image.open(io.BytesIO(client.get("/api/frame", params={"path": clip}).content))
        cropped = Image.open(io.BytesIO(client.get("/api/frame", params={
            "path": clip, "height": 32, "width": 64, "resize": "crop"}).content))
        page = client.get("/clips", params={"data": "wide.yaml"}).text
    assert whole.size == (48, 48) and cropped.size == (64, 32)  # the bucket's shape, as training crops it
    assert "&amp;height=32&amp;width=64&amp;resize=crop" in page and "as it trains" in page
