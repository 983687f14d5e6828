"""The studio's safety: paths stay under --root (`..`, absolute paths, symbolic links), state-changing requests need
the page's secret and the studio's own origin, a token guards a studio reachable from other machines, and only
vidtune's own commands run."""

from __future__ import annotations

import os

import httpx
import pytest

from vidtune.errors import VidtuneError
from vidtune.studio.app import create_app
from vidtune.studio.jobs import Command
from vidtune.studio.security import CSRF_HEADER, OutsideRoot, Root


@pytest.fixture
def outside(tmp_path):
    secret = tmp_path / "outside" / "secret.png"
    secret.parent.mkdir()
    secret.write_bytes(b"\x89PNG not for the studio")
    return secret


def test_root_refuses_dot_dot_absolute_paths_and_links_out(tmp_path, outside):
    root = tmp_path / "root"
    (root / "inside").mkdir(parents=True)
    (root / "inside" / "ok.png").write_bytes(b"x")
    (root / "link").symlink_to(outside.parent, target_is_directory=True)
    place = Root(root)
    assert place.path("inside/ok.png") == (root / "inside" / "ok.png").resolve()
    assert place.path(str(root / "inside" / "ok.png")) == (root / "inside" / "ok.png").resolve()
    for text in ("../outside/secret.png", "inside/../../outside/secret.png", str(outside), "link/secret.png",
                 "/etc/passwd", "inside/\x00.png"):
        with pytest.raises(OutsideRoot):
            place.path(text)


def test_the_server_refuses_paths_outside_its_root(studio, outside):
    (studio.root / "escape").symlink_to(outside.parent, target_is_directory=True)
    try:
        for path in ("../outside/secret.png", str(outside), "escape/secret.png"):
            answer = studio.get("/api/frame", path=path)
            assert answer.status_code == 403, path
            assert "outside the studio's folder" in answer.json()["error"]
        escaped = studio.get("/files/escape/secret.png")
        assert escaped.status_code == 403
        assert studio.get(f"/files/{os.path.relpath(outside, studio.root)}").status_code in (403, 404)
        answer = studio.post("/api/caption", {"data": "escape", "source": 0, "slot": 0, "caption": "x",
                                              "previous": ""})
        assert answer.status_code == 403
        assert studio.post("/api/save", {"file": "../evil.yaml", "values": {}}).status_code == 403
        assert not (studio.root.parent / "evil.yaml").exists()
    finally:
        (studio.root / "escape").unlink()


def test_state_changing_requests_need_the_secret_and_the_own_origin(studio):
    body = {"file": "csrf.yaml", "values": {"training.steps": "3"}}
    with studio.client() as client:
        missing = client.post("/api/validate", json=body)
        wrong = client.post("/api/validate", json=body, headers={CSRF_HEADER: "guessed"})
        cross = client.post("/api/validate", json=body, headers={CSRF_HEADER: studio.secret,
                                                                  "Origin": "http://evil.example"})
        own = client.post("/api/validate", json=body, headers={CSRF_HEADER: studio.secret, "Origin": studio.url})
    assert (missing.status_code, wrong.status_code, cross.status_code) == (403, 403, 403)
    assert own.status_code == 200
    # A page of another site cannot read the secret: it is only in the studio's own pages.
    assert studio.secret in studio.get("/").text


def test_a_foreign_host_header_is_refused(studio):
    with studio.client() as client:
        assert client.get("/", headers={"Host": "attacker.example"}).status_code == 403
        assert client.get("/").status_code == 200


def test_a_studio_for_other_machines_needs_its_token(tmp_path):
    with pytest.raises(VidtuneError, match="--token"):
        create_app(tmp_path, host="0.0.0.0")
    app = create_app(tmp_path, token="s3cret", host="0.0.0.0")
    transport = httpx.ASGITransport(app=app)

    async def requests():
        async with httpx.AsyncClient(transport=transport, base_url="http://192.0.2.1:8765") as client:
            refused = await client.get("/")
            header = await client.get("/", headers={"Authorization": "Bearer s3cret"})
            wrong = await client.get("/?token=nope")
            linked = await client.get("/?token=s3cret")
            cookie = await client.get("/api/runs")  # the link's cookie carries the token from then on
            return refused, header, wrong, linked, cookie

    import asyncio

    refused, header, wrong, linked, cookie = asyncio.run(requests())
    assert (refused.status_code, wrong.status_code) == (401, 401)
    assert (header.status_code, linked.status_code, cookie.status_code) == (200, 200, 200)
    app.state.queue.close()


def test_the_command_prints_a_generated_token_for_other_machines(monkeypatch, tmp_path, capsys):
    import uvicorn

    seen = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **options: seen.update(app=app, **options))
    from vidtune.cli import main

    assert main(["studio", "--root", str(tmp_path), "--host", "0.0.0.0", "--port", "9999"]) == 0
    printed = capsys.readouterr().out
    token = seen["app"].state.access.token
    assert token and f"?token={token}" in printed and seen["host"] == "0.0.0.0" and seen["port"] == 9999
    seen["app"].state.queue.close()
    assert main(["studio", "--root", str(tmp_path)]) == 0
    assert seen["app"].state.access.token is None and seen["host"] == "127.0.0.1"
    assert "http://127.0.0.1:8765/" in capsys.readouterr().out
    seen["app"].state.queue.close()


def test_only_vidtunes_own_commands_run():
    with pytest.raises(VidtuneError, match="not a command the studio runs"):
        Command("rm", ("-rf", "/"), "no")
    with pytest.raises(VidtuneError, match="NUL"):
        Command("train", ("a\x00b",), "no")
    assert Command("export", ("run",), "ok").argv()[1:4] == ["-m", "vidtune", "export"]


def test_actions_validate_their_arguments(studio):
    assert studio.post("/api/export", {"run": "clips", "format": "diffusers"}).status_code == 400
    assert studio.post("/api/train", {"config": "clips/videos.txt"}).status_code == 400
    assert studio.post("/api/plan", {"file": "x.yaml", "values": {}, "gpu_memory": "lots"}).status_code == 400
    assert studio.post("/api/stop", {"job": "all"}).status_code == 400


def test_captions_of_data_outside_the_root_are_not_written(studio, tmp_path):
    from vidtune.data.synthetic import render_shapes_dataset

    elsewhere = render_shapes_dataset(tmp_path / "elsewhere", num_clips=1, num_frames=9, height=32, width=32, fps=24,
                                      seed=1)
    before = (elsewhere / "prompts.txt").read_bytes()
    (studio.root / "points-out.yaml").write_text(f"data:\n  root: {elsewhere}\n")
    card = studio.get("/api/clips", data="points-out.yaml").json()["cards"][0]
    edit = studio.post("/api/caption", {"data": "points-out.yaml", "source": 0, "slot": 0, "caption": "no",
                                        "previous": card["caption"]})
    assert edit.status_code == 403 and "outside the studio's folder" in edit.json()["error"]
    assert studio.post("/api/caption-missing", {"data": "points-out.yaml"}).status_code == 403
    assert (elsewhere / "prompts.txt").read_bytes() == before
