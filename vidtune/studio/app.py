"""The studio's pages and actions, as a FastAPI app over one root folder.

Pages are rendered on the server (Jinja2); `static/studio.js` makes them live (caption edits, the form's validation,
the run page's refresh) with plain `fetch` calls to the JSON actions below. Every action that changes something is a
POST with the page's CSRF secret in a header; every path is confined to the root (`security.Root`); every process is
one of vidtune's own commands (`jobs.Command`).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import jinja2
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles

from vidtune import outputs
from vidtune.errors import VidtuneError
from vidtune.studio import charts, clips, form, runs
from vidtune.studio.jobs import STUDIO_FOLDER, Command, JobQueue
from vidtune.studio.security import CSRF_HEADER, TOKEN_COOKIE, Access, OutsideRoot, Root, is_loopback

HERE = Path(__file__).parent
SERVED_SUFFIXES = {".mp4", ".webm", ".png", ".jpg", ".jpeg", ".webp", ".gif"}
CONFIG_SUFFIXES = (".yaml", ".yml")
EXPORT_FORMATS = ("diffusers", "comfyui")
MAX_PROMPT = 4000


class BadRequest(VidtuneError):
    """A request the studio refuses, with the reason for the person using it."""


def create_app(root: str | Path, token: str | None = None, host: str = "127.0.0.1",
               environment: dict[str, str] | None = None) -> FastAPI:
    """The studio over `root`; `token`: required on every request (needed when `host` is not this machine only)."""
    if not is_loopback(host) and not token:
        raise VidtuneError(f"--host {host} lets other machines reach the studio: it needs --token.")
    place = Root(root)
    access = Access(token)
    queue = JobQueue(place.folder, environment)
    pages = jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"), autoescape=True,
                               undefined=jinja2.StrictUndefined)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        queue.close()  # runs still going get SIGINT: each saves its checkpoint

    app = FastAPI(title="vidtune studio", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.root, app.state.queue, app.state.access = place, queue, access
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Response:
        if not access.token_ok(_given_token(request)):
            return JSONResponse({"error": "This studio needs its access token: open the address it printed (with "
                                 "?token=...)."}, status_code=401)
        if is_loopback(host) and not is_loopback(urlsplit(f"//{request.headers.get('host', '')}").hostname or ""):
            return JSONResponse({"error": "Unexpected Host header: the studio answers only to this machine's "
                                 "addresses."}, status_code=403)
        if request.method not in ("GET", "HEAD", "OPTIONS"):
            origin = request.headers.get("origin")
            if origin is not None and urlsplit(origin).netloc != request.headers.get("host"):
                return JSONResponse({"error": "Cross-site request refused."}, status_code=403)
            if not access.csrf_ok(request.headers.get(CSRF_HEADER)):
                return JSONResponse({"error": "Missing or wrong studio secret: reload the page and try again."},
                                    status_code=403)
        response = await call_next(request)
        given = request.query_params.get("token")
        if access.token is not None and given is not None and access.token_ok(given):
            response.set_cookie(TOKEN_COOKIE, given, httponly=True, samesite="strict")
        response.headers.setdefault("X-Frame-Options", "DENY")
        response.headers.setdefault("Content-Security-Policy", "default-src 'self'; img-src 'self' data:; "
                                    "media-src 'self'; style-src 'self'; script-src 'self'")
        return response

    @app.exception_handler(OutsideRoot)
    async def outside(request: Request, error: OutsideRoot) -> JSONResponse:
        return JSONResponse({"error": str(error)}, status_code=403)

    @app.exception_handler(VidtuneError)
    async def refused(request: Request, error: VidtuneError) -> JSONResponse:
        return JSONResponse({"error": str(error)}, status_code=400)

    def page(name: str, request: Request, **values: Any) -> HTMLResponse:
        template = pages.get_template(name)
        return HTMLResponse(template.render(csrf=access.csrf, root=str(place.folder), page=name.split(".")[0],
                                            **values))

    # ----- runs ----------------------------------------------------------------------------------------------
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
            state = (latest.state if latest else "finished" if view.finished else
                     "not running from the studio")
            rows.append({"path": place.relative(folder), "state": state, "last_step": view.last_step,
                         "total_steps": view.total_steps, "loss": view.losses[-1] if view.losses else None,
                         "samples": len(view.samples), "checkpoints": len(view.checkpoints)})
        return rows

    def configs() -> list[str]:
        found = []
        for suffix in CONFIG_SUFFIXES:
            for path in place.folder.rglob(f"*{suffix}"):
                relative = path.relative_to(place.folder)
                if not any(part.startswith(".") for part in relative.parts) and not runs.is_run_folder(path.parent) \
                        and outputs.CHECKPOINTS not in relative.parts:
                    found.append(relative.as_posix())
        return sorted(found)

    @app.get("/", response_class=HTMLResponse)
    def home(request: Request) -> HTMLResponse:
        return page("runs.html", request, runs=run_rows(), jobs=[job.to_json() for job in queue.jobs],
                    configs=configs())

    @app.get("/api/runs")
    def api_runs() -> dict[str, Any]:
        return {"runs": run_rows(), "jobs": [job.to_json() for job in queue.jobs], "configs": configs()}

    @app.get("/run", response_class=HTMLResponse)
    def run_page(request: Request, path: str) -> HTMLResponse:
        folder = run_folder(path)
        return page("run.html", request, path=place.relative(folder), panel=run_panel(folder))

    @app.get("/run/panel", response_class=HTMLResponse)
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
            view=view, path=relative, pictures=pictures, jobs=jobs, active=active.to_json() if active else None,
            seconds=None if math.isnan(latest) else latest,
            samples=[{"step": s.step, "prompt": s.prompt, "url": "/files/" + place.relative(s.video)}
                     for s in view.samples])

    @app.get("/api/run")
    def api_run(path: str) -> dict[str, Any]:
        folder = run_folder(path)
        active = queue.active_for(folder)
        return {**runs.read_run(folder).summary(), "path": place.relative(folder),
                "job": active.to_json() if active else None,
                "jobs": [job.to_json() for job in queue.for_run(folder)]}

    @app.get("/api/jobs/{number}")
    def api_job(number: int) -> dict[str, Any]:
        job = queue.get(number)
        return {**job.to_json(), "tail": job.tail()}

    @app.post("/api/train")
    async def api_train(request: Request) -> dict[str, Any]:
        body = await _body(request)
        config_path = place.path(_text(body, "config"))
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

    @app.post("/api/resume")
    async def api_resume(request: Request) -> dict[str, Any]:
        folder = run_folder(_text(await _body(request), "run"))
        if queue.active_for(folder):
            raise BadRequest(f"{place.relative(folder)} is already queued or running.")
        if runs.latest_checkpoint(folder) is None:
            raise BadRequest(f"{place.relative(folder)} has no checkpoint to resume from.")
        job = queue.add(Command("train", (str(folder / outputs.RESOLVED_CONFIG), "checkpoint.resume=latest"),
                                f"resume {place.relative(folder)}", folder))
        return job.to_json()

    @app.post("/api/stop")
    async def api_stop(request: Request) -> dict[str, Any]:
        body = await _body(request)
        if "job" in body:
            if not isinstance(body["job"], int):
                raise BadRequest("job: a job number.")
            return queue.stop(body["job"]).to_json()
        folder = run_folder(_text(body, "run"))
        active = queue.active_for(folder)
        if active is None:
            raise BadRequest(f"{place.relative(folder)} is not running from the studio (a run started on the command "
                             "line stops with Ctrl-C there).")
        return queue.stop(active.number).to_json()

    @app.post("/api/sample")
    async def api_sample(request: Request) -> dict[str, Any]:
        body = await _body(request)
        folder = run_folder(_text(body, "run"))
        prompt = " ".join(_text(body, "prompt").split())
        if not prompt or len(prompt) > MAX_PROMPT:
            raise BadRequest(f"prompt: write what to generate (1 to {MAX_PROMPT} characters).")
        job = queue.add(Command("sample", (str(folder), f"--prompt={prompt}"), f"sample {place.relative(folder)}",
                                folder))
        return job.to_json()

    @app.post("/api/export")
    async def api_export(request: Request) -> dict[str, Any]:
        body = await _body(request)
        folder = run_folder(_text(body, "run"))
        kind = _text(body, "format")
        if kind not in EXPORT_FORMATS:
            raise BadRequest(f"format: {kind!r} is not one of {', '.join(EXPORT_FORMATS)}.")
        target = folder / "exports" / kind
        job = queue.add(Command("export", (str(folder), f"--output={target}", f"--format={kind}", "--overwrite"),
                                f"export {place.relative(folder)} ({kind})", folder))
        return job.to_json() | {"output": place.relative(target.parent) + "/" + kind}

    # ----- clips ---------------------------------------------------------------------------------------------
    def data_path(text: str) -> Path:
        path = place.path(text)
        if not path.exists():
            raise BadRequest(f"{text}: not found under the studio's folder.")
        return path

    @app.get("/clips", response_class=HTMLResponse)
    def clips_page(request: Request, data: str | None = None) -> HTMLResponse:
        view = clips.view_clips(data_path(data), data) if data else None
        return page("clips.html", request, data=data or "", view=view,
                    cards=view.to_json(lambda p: _maybe_relative(place, p))["cards"] if view else [],
                    configs=configs())

    @app.get("/api/clips")
    def api_clips(data: str) -> dict[str, Any]:
        return clips.view_clips(data_path(data), data).to_json(lambda p: _maybe_relative(place, p))

    @app.post("/api/caption")
    async def api_caption(request: Request) -> dict[str, Any]:
        body = await _body(request)
        path = data_path(_text(body, "data"))
        source, slot = body.get("source"), body.get("slot")
        if not isinstance(source, int) or not isinstance(slot, int):
            raise BadRequest("source and slot: numbers (from the clips page).")
        written = clips.write_caption(path, source, slot, _text(body, "caption"), _text(body, "previous"),
                                      place.contains)
        files = clips.caption_files(path)[source]
        return {"written": files.target(written), "caption": next(s.caption for s in files.slots
                                                                  if s.index == slot)}

    @app.post("/api/caption-missing")
    async def api_caption_missing(request: Request) -> dict[str, Any]:
        path = data_path(_text(await _body(request), "data"))
        outside = clips.caption_files_outside(path, place.contains)
        if outside:
            raise OutsideRoot(f"{place.relative(path)} keeps captions outside the studio's folder ({outside[0]}"
                              f"{' and more' if len(outside) > 1 else ''}); the studio writes only under --root.")
        return queue.add(Command("caption", (str(path),), f"caption {place.relative(path)}")).to_json()

    @app.get("/api/frame")
    def api_frame(path: str, at: str = "first") -> Response:
        if at not in ("first", "middle", "last"):
            raise BadRequest("at: first, middle or last.")
        return Response(clips.frame_png(_media(place, path), at), media_type="image/png")

    @app.get("/api/window")
    def api_window(data: str, source: int, slot: int) -> FileResponse:
        media, bucket, data_config = clips.window_of(data_path(data), source, slot)
        _media(place, str(media))
        video = clips.window_video(media, bucket, data_config, place.folder / STUDIO_FOLDER / "windows")
        return FileResponse(video, media_type="video/mp4")

    # ----- settings ------------------------------------------------------------------------------------------
    def config_file(text: str) -> Path:
        path = place.path(text)
        if path.suffix.lower() not in CONFIG_SUFFIXES:
            raise BadRequest(f"{text}: a config the studio writes is a .yaml file.")
        return path

    @app.get("/settings", response_class=HTMLResponse)
    def settings_page(request: Request, file: str = "studio.yaml") -> HTMLResponse:
        path = config_file(file)
        values = form.read_values(path)
        return page("settings.html", request, file=file, sections=form.form_sections(), values=values,
                    family=form.family_defaults(values.get("model.name", "")), configs=configs())

    @app.get("/api/form")
    def api_form(file: str = "studio.yaml", family: str | None = None) -> dict[str, Any]:
        values = form.read_values(config_file(file))
        return {"sections": [{"name": s.name, "fields": [f.__dict__ for f in s.fields]} for s in
                             form.form_sections()], "values": values,
                "family_defaults": form.family_defaults(family or values.get("model.name", ""))}

    @app.post("/api/validate")
    async def api_validate(request: Request) -> dict[str, Any]:
        body = await _body(request)
        path = config_file(_text(body, "file"))
        config, message, problems = form.validate(_values(body), path)
        return {"ok": config is not None, "message": message, "problems": problems,
                "family_defaults": form.family_defaults(_values(body).get("model.name", ""))}

    @app.post("/api/save")
    async def api_save(request: Request) -> dict[str, Any]:
        body = await _body(request)
        path = config_file(_text(body, "file"))
        form.save(_values(body), path)
        return {"saved": place.relative(path)}

    @app.post("/api/plan")
    async def api_plan(request: Request) -> dict[str, Any]:
        body = await _body(request)
        path = config_file(_text(body, "file"))
        gib = body.get("gpu_memory")
        if not isinstance(gib, int | float) or not 0 < gib < 10_000:
            raise BadRequest("gpu_memory: the GPU's memory in GiB, e.g. 24.")
        config, message, _ = form.validate(_values(body), path)
        if config is None:
            raise BadRequest(message)
        from vidtune.studio.planner import plan_answer

        return plan_answer(config, float(gib))

    # ----- files ---------------------------------------------------------------------------------------------
    @app.get("/files/{path:path}")
    def files(path: str) -> FileResponse:
        return FileResponse(_media(place, path))

    @app.get("/favicon.ico")
    def favicon() -> RedirectResponse:
        return RedirectResponse("/static/favicon.svg")

    return app


def _media(place: Root, text: str) -> Path:
    path = place.path(text)
    if path.suffix.lower() not in SERVED_SUFFIXES or not path.is_file():
        raise BadRequest(f"{text}: not a picture or video under the studio's folder.")
    return path


def _maybe_relative(place: Root, path: Path) -> str:
    return place.relative(path) if place.contains(path) else str(path)


def _given_token(request: Request) -> str | None:
    header = request.headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        return header[7:].strip()
    return request.query_params.get("token") or request.cookies.get(TOKEN_COOKIE)


async def _body(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        raise BadRequest("The request body must be a JSON object.") from None
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    return body


def _text(body: dict[str, Any], key: str) -> str:
    value = body.get(key)
    if not isinstance(value, str):
        raise BadRequest(f"{key}: text expected.")
    return value


def _values(body: dict[str, Any]) -> dict[str, str]:
    values = body.get("values")
    if not isinstance(values, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in values.items()):
        raise BadRequest("values: an object of section.key -> text.")
    return values
