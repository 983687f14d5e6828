"""Every page's data and every action of the studio, through its HTTP API on a live server."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from tests.helpers.storage import full_disk_at, leftovers
from vidtune.config import load_config
from vidtune.errors import ConfigError
from vidtune.memory.plan import GIB, plan_memory
from vidtune.memory.suggest import with_overrides


def test_pages_render(studio):
    name = studio.write_config("pages.yaml")
    for url in ("/", "/clips", f"/clips?data={name}", f"/settings?file={name}", "/settings",
                "/static/studio.js", "/static/studio.css"):
        answer = studio.get(url)
        assert answer.status_code == 200, (url, answer.text[:400])
    assert name in studio.get("/api/runs").json()["configs"]


def test_the_clips_page_shows_each_clip_with_its_facts_and_problems(studio):
    name = studio.write_config("clips.yaml")
    (studio.root / "clips" / "videos.txt").write_text(
        (studio.root / "clips" / "videos.txt").read_text() + "clips/missing.mp4\n")
    try:
        view = studio.get("/api/clips", data=name).json()
    finally:
        lines = (studio.root / "clips" / "videos.txt").read_text().splitlines()
        (studio.root / "clips" / "videos.txt").write_text("\n".join(lines[:-1]) + "\n")
    cards = view["cards"]
    assert [card["where"] for card in cards] == ["videos.txt line 1", "videos.txt line 2"]
    first = cards[0]
    assert (first["frames"], first["fps"], first["size"], first["sound"]) == (17, 24.0, [48, 48], False)
    assert first["bucket"] == [9, 32, 32] and first["target"] == "prompts.txt line 1"
    assert "tokenizer" in view["note"]  # the config names a model: `vidtune data check`'s own check
    assert any("missing.mp4" in problem for problem in view["problems"])
    frame = studio.get("/api/frame", path=first["media"], at="last")
    assert frame.status_code == 200 and frame.content.startswith(b"\x89PNG")
    window = studio.get("/api/window", data=name, source=0, slot=0)
    assert window.status_code == 200 and window.headers["content-type"] == "video/mp4" and len(window.content) > 500
    from vidtune.data.video import probe_video

    saved = studio.root / "window.mp4"
    saved.write_bytes(window.content)
    info = probe_video(saved)
    assert (info.num_frames, info.height, info.width) == (9, 32, 32)  # the bucket's frames and size


def _layouts(studio):
    """The same two clips as a pairs folder, a folder with .txt files, a CSV and a JSONL (under the root)."""
    base = studio.root / "layouts"
    shutil.rmtree(base, ignore_errors=True)
    clips = sorted((studio.root / "clips" / "clips").glob("*.mp4"))
    folder = base / "folder"
    folder.mkdir(parents=True)
    for clip in clips:
        shutil.copy(clip, folder / clip.name)
    (folder / clips[0].with_suffix(".txt").name).write_text("old folder caption\n")
    (base / "table.csv").write_bytes(("video,caption,note\r\n" + "".join(
        f"{clip},old csv caption {n},keep me\r\n" for n, clip in enumerate(clips))).encode())
    (base / "lines.jsonl").write_text("".join(json.dumps({"video": str(clip), "caption": f"old {n}", "extra": n})
                                              + "\n" for n, clip in enumerate(clips)))
    return base


@pytest.mark.parametrize("layout", ["pairs", "folder", "csv", "jsonl"])
def test_a_caption_is_edited_where_each_layout_keeps_it(studio, layout):
    base = _layouts(studio)
    data = {"pairs": "clips", "folder": "layouts/folder", "csv": "layouts/table.csv",
            "jsonl": "layouts/lines.jsonl"}[layout]
    before = {path: path.read_bytes() for path in (studio.root / "clips" / "prompts.txt",)}
    cards = studio.get("/api/clips", data=data).json()["cards"]
    card = cards[0]
    answer = studio.post("/api/caption", {"data": data, "source": card["source"], "slot": card["slot"],
                                          "caption": "  a new\ncaption  ", "previous": card["caption"]})
    assert answer.status_code == 200, answer.text
    assert answer.json()["caption"] == "a new caption"
    if layout == "pairs":
        lines = (studio.root / "clips" / "prompts.txt").read_text().splitlines()
        assert lines[0] == "a new caption" and lines[1] == before[studio.root / "clips" / "prompts.txt"].decode(
        ).splitlines()[1]
    elif layout == "folder":
        assert (base / "folder" / "clip_000.txt").read_text() == "a new caption\n"
    elif layout == "csv":
        text = (base / "table.csv").read_bytes().decode()
        assert text.splitlines()[1].endswith(",a new caption,keep me") and "old csv caption 1,keep me\r\n" in text
    else:
        rows = [json.loads(line) for line in (base / "lines.jsonl").read_text().splitlines()]
        assert rows[0] == {"video": rows[0]["video"], "caption": "a new caption", "extra": 0} and rows[1]["caption"] \
            == "old 1"
    assert studio.get("/api/clips", data=data).json()["cards"][0]["caption"] == "a new caption"
    # An edit from a page that showed an older caption is refused: the newer one on disk is kept.
    stale = studio.post("/api/caption", {"data": data, "source": card["source"], "slot": card["slot"],
                                         "caption": "stale", "previous": card["caption"]})
    assert stale.status_code == 400 and "changed on disk" in stale.json()["error"]
    if layout == "pairs":
        (studio.root / "clips" / "prompts.txt").write_bytes(before[studio.root / "clips" / "prompts.txt"])


def test_a_caption_the_disk_refuses_is_a_plain_message_and_the_file_is_unchanged(studio, monkeypatch):
    prompts = studio.root / "clips" / "prompts.txt"
    before = prompts.read_bytes()
    card = studio.get("/api/clips", data="clips").json()["cards"][0]
    disk = full_disk_at(monkeypatch, "prompts.txt")
    answer = studio.post("/api/caption", {"data": "clips", "source": card["source"], "slot": card["slot"],
                                          "caption": "a caption that does not fit", "previous": card["caption"]})
    monkeypatch.undo()
    assert disk.failed and answer.status_code == 400, answer.text
    message = answer.json()["error"]
    assert f"Could not write prompts.txt in {prompts.parent}: the disk is full" in message and "What to do:" in message
    assert prompts.read_bytes() == before and not leftovers(prompts.parent)


def test_the_form_is_the_schema_and_validates_with_the_command_lines_messages(studio):
    form = studio.get("/api/form", file="new.yaml", family="ltx-video").json()
    fields = {field["key"]: field for section in form["sections"] for field in section["fields"]}
    assert fields["training.algorithm"]["kind"] == "choice" and "lora" in fields["training.algorithm"]["choices"]
    assert fields["training.steps"]["default"] and fields["model.name"]["required"]
    assert "ltx-video" in fields["model.name"]["choices"]
    assert form["family_defaults"]["training.sigma_sampling"]  # a family's own default, shown as such
    values = {"model.name": "ltx-video", "model.pretrained": str(studio.model), "data.root": "clips",
              "training.steps": "-3", "training.algorithm": "lora"}
    answer = studio.post("/api/validate", {"file": "formed.yaml", "values": values}).json()
    assert not answer["ok"] and "training.steps" in answer["problems"]
    # The same message `vidtune train formed.yaml` prints for the file the form would save.
    same = {"model": {"name": "ltx-video", "pretrained": str(studio.model)}, "data": {"root": "clips"},
            "training": {"steps": -3, "algorithm": "lora"}}
    (studio.root / "formed.yaml").write_text("# a first line, as the studio writes\n" + yaml.safe_dump(same,
                                                                                                    sort_keys=False))
    with pytest.raises(ConfigError) as cli:
        load_config(studio.root / "formed.yaml")
    assert answer["message"].replace(str(studio.root / "formed.yaml"), "FILE") == \
        str(cli.value).replace(str(studio.root / "formed.yaml"), "FILE")
    refused = studio.post("/api/save", {"file": "formed.yaml", "values": values})
    assert refused.status_code == 400 and "training.steps" in refused.json()["error"]
    values["training.steps"] = "7"
    assert studio.post("/api/validate", {"file": "formed.yaml", "values": values}).json()["ok"]
    assert studio.post("/api/save", {"file": "formed.yaml", "values": values}).json() == {"saved": "formed.yaml"}
    config = load_config(studio.root / "formed.yaml")  # the command line runs it unchanged
    # A problem's line is the line of the file saved.
    values["training.steps"] = "0"
    line = studio.post("/api/validate", {"file": "formed.yaml", "values": values}).json()["problems"]
    saved_lines = (studio.root / "formed.yaml").read_text().splitlines()
    number = int(line["training.steps"][0].split(":")[0].removeprefix("line "))
    assert saved_lines[number - 1].strip() == "steps: 7"
    assert config.training.steps == 7 and config.data.root == str(studio.root / "clips")
    assert studio.get("/api/form", file="formed.yaml").json()["values"]["training.steps"] == "7"


def test_the_planner_answers_for_the_gpu_memory_given(studio):
    values = {"model.name": "ltx-video", "model.pretrained": str(studio.model), "data.root": "clips"}
    config = load_config(None, [f"{key}={value}" for key, value in values.items()])
    peak = plan_memory(config).peak / GIB
    roomy = studio.post("/api/plan", {"file": "plan.yaml", "values": values, "gpu_memory": peak * 2}).json()
    assert roomy["fits"] and roomy["suggested_overrides"] == [] and roomy["peak_gib"] == pytest.approx(peak, abs=1e-3)
    budget = peak * 0.8
    tight = studio.post("/api/plan", {"file": "plan.yaml", "values": values, "gpu_memory": budget}).json()
    assert not tight["fits"] and tight["suggested_overrides"], tight["verdict"]
    # The settings it suggests make the plan fit, as `vidtune plan --gpu-memory` promises.
    fitted = plan_memory(with_overrides(config, tight["suggested_overrides"]))
    assert fitted.peak / GIB <= budget and tight["suggested_peak_gib"] == pytest.approx(fitted.peak / GIB, abs=1e-3)
