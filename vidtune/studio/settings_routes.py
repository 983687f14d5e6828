"""The settings page and its actions: the form generated from the config schema, its validation, saving it as
YAML, and the memory planner's answer."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import HTMLResponse

from vidtune.studio import form
from vidtune.studio.web import CONFIG_SUFFIXES, BadRequest, Studio, read_body, text_of, values_of


def settings_routes(studio: Studio) -> APIRouter:
    place = studio.place
    page, configs = studio.page, studio.configs
    router = APIRouter()

    def config_file(text: str) -> Path:
        path = place.path(text)
        if path.suffix.lower() not in CONFIG_SUFFIXES:
            raise BadRequest(f"{text}: a config the studio writes is a .yaml file.")
        return path

    @router.get("/settings", response_class=HTMLResponse)
    def settings_page(request: Request, file: str | None = None, data_root: str | None = None) -> HTMLResponse:
        """A config's form: `file`, else the config written last under the root, else a new studio.yaml; a new
        file starts empty (with `data_root`, from the clips page: that folder), and is not judged before it is
        filled in."""
        if file is None:
            file = studio.newest_config() or "studio.yaml"
        path = config_file(file)
        new = not path.is_file()
        values = form.read_values(path)
        if new and data_root:
            values = {**values, "data.root": data_root}
        return page("settings.html", request, file=file, sections=form.form_sections(), values=values,
                    family=form.family_defaults(values.get("model.name", "")), configs=configs(), new=new)

    @router.get("/api/form")
    def api_form(file: str = "studio.yaml", family: str | None = None) -> dict[str, Any]:
        values = form.read_values(config_file(file))
        return {"sections": [{"name": s.name, "fields": [f.__dict__ for f in s.fields]} for s in
                             form.form_sections()], "values": values,
                "family_defaults": form.family_defaults(family or values.get("model.name", ""))}

    @router.post("/api/validate")
    async def api_validate(request: Request) -> dict[str, Any]:
        body = await read_body(request)
        path = config_file(text_of(body, "file"))
        config, message, problems = form.validate(values_of(body), path)
        return {"ok": config is not None, "message": message, "problems": problems,
                "family_defaults": form.family_defaults(values_of(body).get("model.name", ""))}

    @router.post("/api/save")
    async def api_save(request: Request) -> dict[str, Any]:
        body = await read_body(request)
        path = config_file(text_of(body, "file"))
        form.save(values_of(body), path)
        return {"saved": place.relative(path)}

    @router.post("/api/plan")
    async def api_plan(request: Request) -> dict[str, Any]:
        body = await read_body(request)
        path = config_file(text_of(body, "file"))
        gib = body.get("gpu_memory")
        if not isinstance(gib, int | float) or not 0 < gib < 10_000:
            raise BadRequest("gpu_memory: the GPU's memory in GiB, e.g. 24.")
        config, message, _ = form.validate(values_of(body), path)
        if config is None:
            raise BadRequest(message)
        from vidtune.studio.planner import plan_answer

        return plan_answer(config, float(gib))


    return router
