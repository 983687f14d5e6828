"""What the studio's pages and actions share: the studio's state (its root, queue, access and templates), the
config files under the root, and reading a request's JSON body and paths."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
from fastapi import Request
from fastapi.responses import HTMLResponse

from vidtune.errors import VidtuneError
from vidtune.studio import runs
from vidtune.studio.jobs import JobQueue
from vidtune.studio.security import Access, Root

HERE = Path(__file__).parent
SERVED_SUFFIXES = {".mp4", ".webm", ".png", ".jpg", ".jpeg", ".webp", ".gif"}
CONFIG_SUFFIXES = (".yaml", ".yml")
EXPORT_FORMATS = ("diffusers", "comfyui")
MAX_PROMPT = 4000


class BadRequest(VidtuneError):
    """A request the studio refuses, with the reason for the person using it."""


@dataclass
class Studio:
    place: Root
    queue: JobQueue
    access: Access
    pages: jinja2.Environment

    def page(self, name: str, request: Request, **values: Any) -> HTMLResponse:
        """A page of templates/, with what every page shows (the root, the CSRF secret its script sends)."""
        template = self.pages.get_template(name)
        return HTMLResponse(template.render(csrf=self.access.csrf, root=str(self.place.folder),
                                            page=name.split(".")[0], **values))

    def configs(self) -> list[str]:
        return configs_under(self.place.folder)

    def newest_config(self, names: list[str] | None = None) -> str | None:
        """The config written last under the root (of `names`, default all): what Start and Settings open on."""
        names = self.configs() if names is None else names
        return max(names, key=lambda name: (self.place.folder / name).stat().st_mtime, default=None)


def configs_under(root: Path) -> list[str]:
    """The YAML configs under `root`, relative to it (hidden folders, run folders' own copies, checkpoints and
    samples left out). The runs page asks for them every few seconds, so the walk never enters a left-out folder
    (a cache or checkpoints can hold thousands of files)."""
    found = []
    for folder, children, files in os.walk(root):
        children[:] = sorted(name for name in children if not name.startswith(".") and name not in runs.SKIPPED)
        here = Path(folder)
        if runs.is_run_folder(here):
            continue
        found.extend((here / name).relative_to(root).as_posix() for name in files
                     if name.endswith(CONFIG_SUFFIXES) and not name.startswith("."))
    return sorted(found)


def templates() -> jinja2.Environment:
    return jinja2.Environment(loader=jinja2.FileSystemLoader(HERE / "templates"), autoescape=True,
                              undefined=jinja2.StrictUndefined)


def media_path(place: Root, text: str) -> Path:
    """A picture or video under the root, named by a request."""
    path = place.path(text)
    if path.suffix.lower() not in SERVED_SUFFIXES or not path.is_file():
        raise BadRequest(f"{text}: not a picture or video under the studio's folder.")
    return path


def shown_path(place: Root, path: Path) -> str:
    """A path as a page shows it: relative to the root when under it."""
    return place.relative(path) if place.contains(path) else str(path)


async def read_body(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except ValueError:
        raise BadRequest("The request body must be a JSON object.") from None
    if not isinstance(body, dict):
        raise BadRequest("The request body must be a JSON object.")
    return body


def text_of(body: dict[str, Any], key: str) -> str:
    value = body.get(key)
    if not isinstance(value, str):
        raise BadRequest(f"{key}: text expected.")
    return value


def values_of(body: dict[str, Any]) -> dict[str, str]:
    values = body.get("values")
    if not isinstance(values, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in values.items()):
        raise BadRequest("values: an object of section.key -> text.")
    return values
