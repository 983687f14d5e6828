"""The queue: one vidtune process at a time, in order; a queued job cancelled never starts."""

from __future__ import annotations

import time

from vidtune.studio.jobs import Command, JobQueue


def test_jobs_run_one_at_a_time_in_order_and_a_queued_one_can_be_cancelled(tmp_path):
    queue = JobQueue(tmp_path)
    try:
        # `vidtune export` of a folder that is not there: a real vidtune process that fails at once (exit 2).
        jobs = [queue.add(Command("export", (str(tmp_path / f"missing-{n}"), "--output=out"), f"job {n}"))
                for n in range(3)]
        cancelled = queue.stop(jobs[1].number)
        assert cancelled.state == "cancelled"
        deadline = time.monotonic() + 120
        while any(job.state in ("queued", "running") for job in jobs) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert [job.state for job in jobs] == ["failed", "cancelled", "failed"]
        assert jobs[0].exit_code == 2 and jobs[1].started is None
        assert jobs[2].started >= jobs[0].ended  # the second waited for the first
        assert "does not exist" in jobs[0].tail() and jobs[0].log.parent == tmp_path / ".vidtune-studio" / "logs"
    finally:
        queue.close()


def test_captioning_the_missing_ones_queues_vidtune_caption(tmp_path):
    import asyncio

    import httpx

    from vidtune.studio.app import create_app
    from vidtune.studio.security import CSRF_HEADER

    (tmp_path / "clips").mkdir()
    app = create_app(tmp_path)
    queue = app.state.queue
    queue.add(Command("export", (str(tmp_path / "missing"), "--output=out"), "holds the queue"))

    async def ask():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1") as client:
            headers = {CSRF_HEADER: app.state.access.csrf}
            return (await client.post("/api/caption-missing", json={"data": "clips"}, headers=headers),
                    await client.post("/api/caption-missing", json={"data": "../elsewhere"}, headers=headers))

    try:
        queued, outside = asyncio.run(ask())
        assert queued.status_code == 200 and outside.status_code == 403
        job = queue.get(queued.json()["id"])
        assert job.command.argv()[3:] == ["caption", str((tmp_path / "clips").resolve())]
        assert queue.stop(job.number).state in ("cancelled", "stopping")  # not run here: it needs a captioning model
    finally:
        queue.close()
