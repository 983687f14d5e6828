"""Runs from the studio: `vidtune train` processes started, stopped as Ctrl-C stops them (a checkpoint, then exit)
and resumed as the command line resumes; the run page's data read from the run folder; sample and export."""

from __future__ import annotations

import signal

from vidtune import outputs


def test_a_run_starts_stops_resumes_samples_and_exports(studio):
    name = studio.write_config("lifecycle.yaml", training={"steps": 2000},
                               validation={"enabled": True, "every": 2})
    started = studio.post("/api/train", {"config": name})
    assert started.status_code == 200, started.text
    job, run = started.json()["id"], started.json()["run_path"]
    assert run == "runs/lifecycle"

    def logged(at_least: int):
        answer = studio.get("/api/run", path=run)
        return answer.status_code == 200 and len(answer.json()["steps"]) >= at_least and answer.json()

    view = studio.wait_for("logged steps and a validation sample", lambda: (view := logged(3)) and view["samples"]
                           and view)
    assert studio.get("/api/run", path=run).json()["job"]["state"] == "running"
    assert any(row["path"] == run for row in studio.get("/api/runs").json()["runs"])
    assert "chart-loss" in studio.get("/run/panel", path=run).text and "<polyline" in studio.get(
        "/run/panel", path=run).text
    sample = view["samples"][0]
    assert studio.get(f"/files/{run}/samples/{sample['video']}").headers["content-type"] == "video/mp4"

    assert studio.post("/api/stop", {"run": run}).json()["state"] == "stopping"
    stopped = studio.wait_for("the run to stop", lambda: studio.job(job)["state"] in ("stopped", "failed")
                              and studio.job(job))
    assert stopped["state"] == "stopped" and stopped["exit_code"] in (130, -signal.SIGINT), stopped["tail"]
    after_stop = studio.get("/api/run", path=run).json()
    assert after_stop["checkpoints"], "a stop saves a checkpoint"
    last = after_stop["last_step"]
    assert after_stop["checkpoints"][-1] == f"step-{last:08d}"

    resumed = studio.post("/api/resume", {"run": run})
    assert resumed.status_code == 200, resumed.text
    assert resumed.json()["args"][-1] == "checkpoint.resume=latest"
    again = resumed.json()["id"]
    studio.wait_for("steps after the resumed checkpoint", lambda: logged(1) and logged(1)["last_step"] > last)
    assert "Resum" in studio.job(again)["tail"] or studio.job(again)["state"] == "running"
    assert studio.post("/api/stop", {"job": again}).json()["state"] == "stopping"
    studio.wait_for("the resumed run to stop", lambda: studio.job(again)["state"] == "stopped")

    # Sample with what it trained, and export it for ComfyUI, through the queue.
    sampled = studio.post("/api/sample", {"run": run, "prompt": "a blue square"}).json()
    exported = studio.post("/api/export", {"run": run, "format": "comfyui"}).json()
    studio.wait_for("sample and export", lambda: all(studio.job(n)["state"] in ("finished", "failed")
                                                      for n in (sampled["id"], exported["id"])))
    assert studio.job(sampled["id"])["state"] == "finished", studio.job(sampled["id"])["tail"]
    assert studio.job(exported["id"])["state"] == "finished", studio.job(exported["id"])["tail"]
    prompts = [item["prompt"] for item in studio.get("/api/run", path=run).json()["samples"]]
    assert "a blue square" in prompts
    written = list((studio.root / run / "exports" / "comfyui").glob("*_comfyui.safetensors"))
    assert written, studio.job(exported["id"])["tail"]

    # The run page offers the ComfyUI files for download: the LoRA and its workflow, nothing else of the run.
    panel = studio.get("/run/panel", path=run).text
    workflow = f"{run}/exports/comfyui/{written[0].name.removesuffix('_comfyui.safetensors')}_workflow.json"
    for file in (f"{run}/exports/comfyui/{written[0].name}", workflow):
        assert f'href="/download/{file}"' in panel
    downloaded = studio.get(f"/download/{workflow}")
    assert downloaded.status_code == 200 and workflow.rsplit("/")[-1] in downloaded.headers["content-disposition"]
    assert any(node["class_type"] == "LoraLoaderModelOnly" for node in downloaded.json().values())
    for refused in (f"{run}/{outputs.RESOLVED_CONFIG}", f"{run}/exports/comfyui/../../{outputs.METRICS}",
                    "../outside_workflow.json"):
        assert studio.get(f"/download/{refused}").status_code in (400, 403, 404), refused
    assert not (studio.root / run / outputs.LORA_WEIGHTS).exists()  # stopped: never finished


def test_a_run_started_from_the_command_line_appears(studio):
    folder = studio.root / "cli-runs" / "outside-the-studio"
    folder.mkdir(parents=True)
    (folder / outputs.RESOLVED_CONFIG).write_text("training:\n  steps: 10\n")
    (folder / outputs.METRICS).write_text('{"step": 1, "loss": 0.5, "lr": 0.001, "seconds_per_step": 0.2, '
                                          '"sigmas": [0.15], "sample_losses": [0.5]}\n{"step": 2, "loss": 0.4}\n'
                                          '{"step": 2, "eval_loss": 0.45}\n{"step": 3, "lo')  # cut by a kill
    rows = {row["path"]: row for row in studio.get("/api/runs").json()["runs"]}
    assert rows["cli-runs/outside-the-studio"]["state"] == "running from a terminal"  # its metrics just written
    view = studio.get("/api/run", path="cli-runs/outside-the-studio").json()
    assert (view["steps"], view["losses"], view["eval_losses"], view["total_steps"]) == ([1, 2], [0.5, 0.4], [0.45],
                                                                                         10)
    assert view["noise_levels"] == [[0.15, 0.5, 1]]
    refused = studio.post("/api/stop", {"run": "cli-runs/outside-the-studio"})
    assert refused.status_code == 400 and "Ctrl-C" in refused.json()["error"]
    assert studio.post("/api/resume", {"run": "cli-runs/outside-the-studio"}).status_code == 400  # no checkpoint


def test_a_run_stopped_in_a_terminal_says_it_can_resume(studio):
    """Ctrl-C in a terminal: the run's metrics stop changing, its newest checkpoint is there; the runs page says it
    stopped and can resume (not that it merely runs elsewhere), and its page offers no Stop."""
    import os
    import time

    from vidtune.studio.runs import TERMINAL_QUIET_S

    folder = studio.root / "cli-runs" / "stopped-with-ctrl-c"
    (folder / outputs.CHECKPOINTS / "step-00000002").mkdir(parents=True)
    (folder / outputs.RESOLVED_CONFIG).write_text("training:\n  steps: 10\n")
    (folder / outputs.METRICS).write_text('{"step": 1, "loss": 0.5, "seconds_per_step": 0.2}\n'
                                          '{"step": 2, "loss": 0.4, "seconds_per_step": 0.2}\n')
    long_ago = time.time() - 2 * TERMINAL_QUIET_S
    os.utime(folder / outputs.METRICS, (long_ago, long_ago))
    rows = {row["path"]: row for row in studio.get("/api/runs").json()["runs"]}
    assert rows["cli-runs/stopped-with-ctrl-c"]["state"] == "stopped, can resume"
    page = studio.get("/run", path="cli-runs/stopped-with-ctrl-c").text
    assert 'data-action="stop-run" data-run="cli-runs/stopped-with-ctrl-c" disabled' in page


def test_a_job_that_fails_early_shows_its_plain_message_and_log(studio):
    """A run whose data is wrong fails before it writes a run folder: the queue shows why in vidtune's words, with
    its log a click away; the run's page says the same as a page, not raw JSON."""
    (studio.root / "bad-clips").mkdir()
    (studio.root / "bad-clips" / "videos.txt").write_text("missing.mp4\n")
    (studio.root / "bad-clips" / "prompts.txt").write_text("a caption\n")
    name = studio.write_config("broken.yaml", data={"root": "bad-clips"})
    job = studio.post("/api/train", {"config": name}).json()
    done = studio.wait_for("the job to fail", lambda: studio.job(job["id"])["state"] in ("failed", "finished")
                           and studio.job(job["id"]))
    assert done["state"] == "failed"
    assert "videos.txt line 1: the clip 'missing.mp4' was not found" in done["message"]
    assert "Traceback" not in done["message"]
    home = studio.get("/").text
    assert "was not found" in home and f'href="/jobs/{job["id"]}/log"' in home
    log = studio.get(f"/jobs/{job['id']}/log")
    assert log.status_code == 200 and "missing.mp4" in log.text
    run_page = studio.get("/run", path=job["run_path"])
    assert run_page.headers["content-type"].startswith("text/html")
    assert "No run here yet" in run_page.text and "was not found" in run_page.text
