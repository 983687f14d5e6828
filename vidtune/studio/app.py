"""The studio as a FastAPI app over one root folder: the guard every request passes (token, host, CSRF secret,
origin), the errors as JSON, the static files, and the pages and actions of `runs_routes.py`, `clips_routes.py`
and `settings_routes.py`.

Pages are rendered on the server (Jinja2); `static/studio.js` makes them live (caption edits, the form's validation,
the run page's refresh) with plain `fetch` calls to the JSON actions. Every action that changes something is a POST
with the page's CSRF secret in a header; every path is confined to the root (`security.Root`); every process is one
of vidtune's own commands (`jobs.Command`).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles

from vidtune.errors import VidtuneError
from vidtune.studio.clips_routes import clips_routes
from vidtune.studio.jobs import JobQueue
from vidtune.studio.runs_routes import runs_routes
from vidtune.studio.security import CSRF_HEADER, TOKEN_COOKIE, Access, OutsideRoot, Root, is_loopback
from vidtune.studio.settings_routes import settings_routes
from vidtune.studio.web import HERE, Studio, media_path, templates


def create_app(root: str | Path, token: str | None = None, host: str = "127.0.0.1",
               environment: dict[str, str] | None = None) -> FastAPI:
    """The studio over `root`; `token`: required on every request (needed when `host` is not this machine only)."""
    if not is_loopback(host) and not token:
        raise VidtuneError(f"--host {host} lets other machines reach the studio: it needs --token.")
    place = Root(root)
    access = Access(token)
    queue = JobQueue(place.folder, environment)
    studio = Studio(place, queue, access, templates())

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        yield
        queue.close()  # runs still going get SIGINT: each saves its checkpoint

    app = FastAPI(title="vidtune studio", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.root, app.state.queue, app.state.access = place, queue, access
    app.mount("/static", StaticFiles(directory=HERE / "static"), name="static")

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Response:
        if not access.token_ok(given_token(request)):
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

    for routes in (runs_routes, clips_routes, settings_routes):
        app.include_router(routes(studio))

    @app.get("/files/{path:path}")
    def files(path: str) -> FileResponse:
        return FileResponse(media_path(place, path))

    @app.get("/favicon.ico")
    def favicon() -> RedirectResponse:
        return RedirectResponse("/static/favicon.svg")

    return app


def given_token(request: Request) -> str | None:
    """The token a request carries: an Authorization bearer header, a ?token= link, or the cookie a link set."""
    header = request.headers.get("authorization", "")
    if header.lower().startswith("bearer "):
        return header[7:].strip()
    return request.query_params.get("token") or request.cookies.get(TOKEN_COOKIE)
