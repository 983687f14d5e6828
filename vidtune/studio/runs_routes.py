"""The runs pages and actions: every run folder under the root, a run's curves, samples, checkpoints and jobs;
start, stop, resume, sample and export, each one of vidtune's own commands in the queue."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, HTMLResponse, PlainTextResponse

from vidtune import outputs
from vidtune.studio import charts, clips, runs
from vidtune.studio.jobs import Command
from vidtune.studio.web import CONFIG_SUFFIXES, EXPORT_FORMATS, MAX_PROMPT, BadRequest, Studio, read_body, text_of


def runs_routes(studio: Studio) -> APIRouter:
    place, queue, pages = studio.place, studio.queue, studio.pages
    page, configs = studio.page, studio.configs
    router = APIRouter()

    def run_folder(text: str) -> Path:
        folder = place.path(text)
        if not runs.is_run_folder(folder):
            raise BadRequest(f"{text}: not a run folder (no {outputs.RESOLVED_CONFIG} beside {outputs.METRICS} or "
                             f"{outputs.CHECKPOINTS}/).")
        return folder

    def run_rows() -> list[dict[str, Any]]:
        rows = []
        for folder in runs.find_runs(place.folder):
            view = runs.read_run(folder)
            latest = queue.latest_for(folder)
            state = latest.state if latest else runs.terminal_state(view)
            rows.append({"path": place.relative(folder), "state": state, "last_step": view.last_step,
                         "total_steps": view.total_steps, "loss": view.losses[-1] if view.losses else None,
                         "samples": len(view.samples), "checkpoints": len(view.checkpoints)})
        return rows

    @router.get("/", response_class=HTMLResponse)
    def home(request: Request) -> HTMLResponse:
        names = configs()
        newest = studio.newest_config(names)  # the one just made on the settings page, not the first by name
        rows = run_rows()
        jobs = [job.to_json() | {"run_path": place.relative(job.command.run) if job.command.run else None}
                for job in queue.jobs]
        return page("runs.html", request, runs=rows, jobs=jobs,
                    configs=names, newest=newest, places=[] if rows else clips.data_places(place.folder))

    @router.get("/jobs/{number}/log", response_class=PlainTextResponse)
    def job_log(number: int) -> PlainTextResponse:
        """A job's whole log, as the command wrote it."""
        log = queue.get(number).log
        return PlainTextResponse(log.read_text(errors="replace") if log.is_file() else "(nothing written yet)")

    @router.get("/api/runs")
    def api_runs() -> dict[str, Any]:
        return {"runs": run_rows(), "jobs": [job.to_json() for job in queue.jobs], "configs": configs()}

    @router.get("/run", response_class=HTMLResponse)
    def run_page(request: Request, path: str) -> HTMLResponse:
        folder = place.path(path)
        if not runs.is_run_folder(folder):  # a job that failed before its run began, or a wrong link: say which
            job = queue.latest_for(folder)
            response = page("no_run.html", request, path=path, job=job.to_json() if job else None)
            response.status_code = 200 if job else 404
            return response
        active = queue.active_for(folder)
        return page("run.html", request, path=place.relative(folder), panel=run_panel(folder),
                    stoppable=active is not None)

    @router.get("/run/panel", response_class=HTMLResponse)
    def run_panel_part(path: str) -> HTMLResponse:
        return HTMLResponse(run_panel(run_folder(path)))

    def run_panel(folder: Path) -> str:
        view = runs.read_run(folder)
        active = queue.latest_for(folder)
        relative = place.relative(folder)
        noise = view.noise_levels
        pictures = {
            "loss": charts.line_chart("loss", view.steps, {"loss": view.losses}, "chart-loss"),
            "held_out": charts.line_chart("held-out score", view.eval_steps, {"held-out": view.eval_losses},
                                          "chart-eval") if view.eval_steps else "",
            "noise": charts.line_chart("loss by noise level", [n[0] for n in noise], {"mean loss": [n[1] for n in
                                       noise]}, "chart-noise", bars=True) if noise else "",
            "lr": charts.line_chart("learning rate", view.steps, {"lr": view.learning_rates}, "chart-lr"),
            "speed": charts.line_chart("seconds per step", view.steps, {"s/step": view.seconds_per_step},
                                       "chart-speed"),
        }
        jobs = [job.to_json() | {"tail": job.tail(1500)} for job in queue.for_run(folder)]
        latest = view.seconds_per_step[-1] if view.seconds_per_step else math.nan
        return pages.get_template("run_panel.html").render(
            view=view, path=relative, terminal=runs.terminal_state(view), pictures=pictures, jobs=jobs,
            active=active.to_json() if active else None,
            seconds=None if math.isnan(latest) else latest,
            samples=[{"step": s.step, "prompt": s.prompt, "url": "/files/" + place.relative(s.video)}
                     for s in view.samples],
            comfyui=[{"name": path.name, "url": "/download/" + place.relative(path)}
                     for path in runs.comfyui_files(folder)])

    @router.get("/download/{path:path}")
    def download(path: str) -> FileResponse:
        """A run's file for ComfyUI (LoRA, workflow, start image), as a download under its own name."""
        file = place.path(path)
        if runs.comfyui_run(file) is None:
            raise BadRequest(f"{path}: not a ComfyUI file of a run under the studio's folder.")
        return FileResponse(file, filename=file.name)

    @router.get("/api/run")
    def api_run(path: str) -> dict[str, Any]:
        folder = run_folder(path)
        active = queue.active_for(folder)
        return {**runs.read_run(folder).summary(), "path": place.relative(folder),
                "job": active.to_json() if active else None,
                "jobs": [job.to_json() for job in queue.for_run(folder)]}

    @router.get("/api/jobs/{number}")
    def api_job(number: int) -> dict[str, Any]:
        job = queue.get(number)
        return {**job.to_json(), "tail": job.tail()}

    @router.post("/api/train")
    async def api_train(request: Request) -> dict[str, Any]:
        body = await read_body(request)
        config_path = place.path(text_of(body, "config"))
        if config_path.suffix.lower() not in (*CONFIG_SUFFIXES, ".toml", ".json") or not config_path.is_file():
            raise BadRequest(f"{body['config']}: not a config file (.yaml, .yml, .toml or .json) under the root.")
        from vidtune.config import load_config

        config = load_config(config_path)  # the command line's messages, before anything is queued
        output = Path(config.output_dir)
        if not place.contains(output):
            raise BadRequest(f"{body['config']}: output_dir {output} is outside the studio's folder; the studio "
                             "writes only under --root.\nWhat to do: set output_dir to a folder under it.")
        if queue.active_for(output.resolve()):
            raise BadRequest(f"{place.relative(output)} is already queued or running.")
        job = queue.add(Command("train", (str(config_path),), f"train {place.relative(config_path)}",
                                output.resolve()))
        return job.to_json() | {"run_path": place.relative(output) if output.exists() else
                                output.resolve().relative_to(place.folder).as_posix()}

    @router.post("/api/resume")
    async def api_resume(request: Request) -> dict[str, Any]:
        folder = run_folder(text_of(await read_body(request), "run"))
        if queue.active_for(folder):
            raise BadRequest(f"{place.relative(folder)} is already queued or running.")
        if runs.latest_checkpoint(folder) is None:
            raise BadRequest(f"{place.relative(folder)} has no checkpoint to resume from.")
        job = queue.add(Command("train", (str(folder / outputs.RESOLVED_CONFIG), "checkpoint.resume=latest"),
                                f"resume {place.relative(folder)}", folder))
        return job.to_json()

    @router.post("/api/stop")
    async def api_stop(request: Request) -> dict[str, Any]:
        body = await read_body(request)
        if "job" in body:
            if not isinstance(body["job"], int):
                raise BadRequest("job: a job number.")
            return queue.stop(body["job"]).to_json()
        folder = run_folder(text_of(body, "run"))
        active = queue.active_for(folder)
        if active is None:
            raise BadRequest(f"{place.relative(folder)} is not running from the studio (a run started on the command "
                             "line stops with Ctrl-C there).")
        return queue.stop(active.number).to_json()

    @router.post("/api/sample")
    async def api_sample(request: Request) -> dict[str, Any]:
        body = await read_body(request)
        folder = run_folder(text_of(body, "run"))
        prompt = " ".join(text_of(body, "prompt").split())
        if not prompt or len(prompt) > MAX_PROMPT:
            raise BadRequest(f"prompt: write what to generate (1 to {MAX_PROMPT} characters).")
        job = queue.add(Command("sample", (str(folder), f"--prompt={prompt}"), f"sample {place.relative(folder)}",
                                folder))
        return job.to_json()

    @router.post("/api/export")
    async def api_export(request: Request) -> dict[str, Any]:
        body = await read_body(request)
        folder = run_folder(text_of(body, "run"))
        kind = text_of(body, "format")
        if kind not in EXPORT_FORMATS:
            raise BadRequest(f"format: {kind!r} is not one of {', '.join(EXPORT_FORMATS)}.")
        target = folder / runs.EXPORTS / kind
        job = queue.add(Command("export", (str(folder), f"--output={target}", f"--format={kind}", "--overwrite"),
                                f"export {place.relative(folder)} ({kind})", folder))
        return job.to_json() | {"output": place.relative(target.parent) + "/" + kind}


    return router
