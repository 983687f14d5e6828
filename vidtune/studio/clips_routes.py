"""The clips page and its actions: clip cards, caption edits, frames, the training window, captioning the missing
ones with `vidtune caption`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, HTMLResponse, Response

from vidtune.studio import clips
from vidtune.studio.jobs import STUDIO_FOLDER, Command
from vidtune.studio.security import OutsideRoot
from vidtune.studio.web import BadRequest, Studio, media_path, read_body, shown_path, text_of


def clips_routes(studio: Studio) -> APIRouter:
    place, queue = studio.place, studio.queue
    page, configs = studio.page, studio.configs
    router = APIRouter()

    def data_path(text: str) -> Path:
        path = place.path(text)
        if not path.exists():
            raise BadRequest(f"{text}: not found under the studio's folder.")
        return path

    @router.get("/clips", response_class=HTMLResponse)
    def clips_page(request: Request, data: str | None = None) -> HTMLResponse:
        view = clips.view_clips(data_path(data), data) if data else None
        return page("clips.html", request, data=data or "", view=view,
                    cards=view.to_json(lambda p: shown_path(place, p))["cards"] if view else [],
                    configs=configs(), places=[] if view else clips.data_places(place.folder),
                    resize=view.data_config.resize if view else "crop")

    @router.get("/api/clips")
    def api_clips(data: str) -> dict[str, Any]:
        return clips.view_clips(data_path(data), data).to_json(lambda p: shown_path(place, p))

    @router.post("/api/caption")
    async def api_caption(request: Request) -> dict[str, Any]:
        body = await read_body(request)
        path = data_path(text_of(body, "data"))
        source, slot = body.get("source"), body.get("slot")
        if not isinstance(source, int) or not isinstance(slot, int):
            raise BadRequest("source and slot: numbers (from the clips page).")
        written = clips.write_caption(path, source, slot, text_of(body, "caption"), text_of(body, "previous"),
                                      place.contains)
        files = clips.caption_files(path)[source]
        return {"written": files.target(written), "caption": next(s.caption for s in files.slots
                                                                  if s.index == slot)}

    @router.post("/api/caption-missing")
    async def api_caption_missing(request: Request) -> dict[str, Any]:
        path = data_path(text_of(await read_body(request), "data"))
        outside = clips.caption_files_outside(path, place.contains)
        if outside:
            raise OutsideRoot(f"{place.relative(path)} keeps captions outside the studio's folder ({outside[0]}"
                              f"{' and more' if len(outside) > 1 else ''}); the studio writes only under --root.")
        return queue.add(Command("caption", (str(path),), f"caption {place.relative(path)}")).to_json()

    @router.get("/api/frame")
    def api_frame(path: str, at: str = "first", height: int | None = None, width: int | None = None,
                  resize: str = "crop") -> Response:
        if at not in ("first", "middle", "last"):
            raise BadRequest("at: first, middle or last.")
        if resize not in ("crop", "fit", "stretch"):
            raise BadRequest("resize: crop, fit or stretch (data.resize).")
        size = (height, width) if height and width else None
        return Response(clips.frame_png(media_path(place, path), at, size, resize), media_type="image/png")

    @router.get("/api/window")
    def api_window(data: str, source: int, slot: int) -> FileResponse:
        media, bucket, data_config = clips.window_of(data_path(data), source, slot)
        media_path(place, str(media))
        video = clips.window_video(media, bucket, data_config, place.folder / STUDIO_FOLDER / "windows")
        return FileResponse(video, media_type="video/mp4")


    return router
