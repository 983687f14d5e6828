"""The studio in a real browser (Debian's headless Chromium driven by Playwright's client): a caption edited, a
tiny run started, its loss curve and a validation sample seen, the run stopped and resumed; a screenshot of each
page, checked not to be blank."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

CHROMIUM = os.environ.get("VIDTUNE_CHROMIUM", "/usr/bin/chromium")
sync_api = pytest.importorskip("playwright.sync_api", reason="the playwright client (test extra) is not installed")
if not Path(CHROMIUM).is_file() and not shutil.which("chromium"):
    pytest.skip(f"no Chromium at {CHROMIUM} (apt-get install chromium)", allow_module_level=True)


def not_blank(path: Path) -> None:
    from PIL import Image, ImageStat

    image = Image.open(path).convert("L")
    assert image.size[0] > 600 and image.size[1] > 400, image.size
    spread = ImageStat.Stat(image).stddev[0]
    assert spread > 8, f"{path.name} looks blank (grey-level spread {spread:.1f})"
    assert len(image.getcolors(1 << 16) or []) > 20, f"{path.name} has almost no colours"


def shown_step(page) -> int:
    """The step the run page's status line shows."""
    return int(page.inner_text("#run-status").split()[1])


@pytest.fixture(scope="module")
def browser():
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM if Path(CHROMIUM).is_file()
                                             else shutil.which("chromium"), args=["--no-sandbox"])
        yield browser
        browser.close()


def test_the_studio_in_a_browser(studio, browser, tmp_path):
    name = studio.write_config("browser.yaml", training={"steps": 2000}, validation={"enabled": True, "every": 2})
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    shots = []

    def shot(title: str) -> None:
        path = tmp_path / f"{title}.png"
        page.screenshot(path=str(path), full_page=False)
        not_blank(path)
        shots.append(path)

    # Clips: edit the first caption in place; it is written to prompts.txt line 1.
    prompts = studio.root / "clips" / "prompts.txt"
    original = prompts.read_bytes()
    page.goto(f"{studio.url}/clips?data={name}")
    page.wait_for_selector(".card img")
    studio.wait_for("the frames", lambda: page.evaluate(
        "Array.from(document.querySelectorAll('.card img')).every(i => i.complete && i.naturalWidth > 0)"), 60)
    first = page.locator(".card").first
    first.locator("textarea.caption").fill("a pink circle, edited in the studio")
    first.locator('[data-action="save-caption"]').click()
    page.wait_for_selector("#message:not([hidden])")
    assert "prompts.txt line 1" in page.inner_text("#message")
    assert prompts.read_text().splitlines()[0] == "a pink circle, edited in the studio"
    shot("clips")
    prompts.write_bytes(original)

    # Settings: the schema's form, checked as it is typed.
    page.goto(f"{studio.url}/settings?file={name}")
    page.wait_for_selector("#validation.ok")
    assert "Valid" in page.inner_text("#validation")
    page.fill('[name="training.steps"]', "-1")
    page.wait_for_selector('.field.invalid[data-key="training.steps"]')
    assert "greater than 0" in page.inner_text('.field[data-key="training.steps"] .field-problem')
    assert "training.steps" in page.inner_text("#validation")
    page.evaluate("window.scrollTo(0, 0)")
    shot("settings")

    # Runs: start the tiny run, watch its loss curve and a validation sample appear.
    page.goto(studio.url + "/")
    page.select_option("#train-config", name)
    page.click("#start-run")
    page.wait_for_selector("#message:not([hidden])")
    assert "Queued" in page.inner_text("#message"), page.inner_text("#message")
    page.wait_for_selector("a[href*='runs%2Fbrowser'], a[href*='runs/browser']", timeout=120_000)
    shot("runs")
    page.goto(f"{studio.url}/run?path=runs/browser")
    page.wait_for_selector("#chart-loss polyline", timeout=180_000)
    page.wait_for_selector("#samples video", timeout=180_000)
    studio.wait_for("the sample video", lambda: page.evaluate("document.querySelector('#samples video').readyState"
                                                              " >= 1"), 60)
    shot("run")

    # Stop (a checkpoint, then exit) and resume.
    page.click('[data-action="stop-run"]')
    page.wait_for_selector("#run-status .state-stopped", timeout=180_000)
    assert any((studio.root / "runs" / "browser" / "checkpoints").iterdir())
    stopped_at = shown_step(page)
    page.click('[data-action="resume"]')
    page.wait_for_selector("#run-status .state-running", timeout=120_000)
    studio.wait_for("steps after the resumed checkpoint", lambda: shown_step(page) > stopped_at, 180)
    page.click('[data-action="stop-run"]')
    page.wait_for_selector("#run-status .state-stopped", timeout=180_000)
    assert len(shots) == 4
    keep = os.environ.get("VIDTUNE_STUDIO_SCREENSHOTS")  # where to keep them (docs/images for the README)
    if keep:
        for path in shots:
            shutil.copy(path, Path(keep) / f"studio-{path.name}")


def test_the_first_screens_a_failed_job_and_a_terminal_stopped_run_in_a_browser(browser, tiny_model_dir, tmp_path):
    """A first visit with an empty root: the clips page says what to put there, the settings page starts a new
    config without a page of errors. Then a run stopped in a terminal reads "stopped, can resume", and a job that
    fails at once shows vidtune's own message in the queue."""
    import time

    from tests.studio.conftest import serve_studio
    from vidtune import outputs
    from vidtune.studio.runs import TERMINAL_QUIET_S

    root = tmp_path / "root"
    root.mkdir()
    with serve_studio(root, tiny_model_dir("ltx-video")) as studio:
        page = browser.new_page(viewport={"width": 1280, "height": 900})
        page.goto(f"{studio.url}/clips")
        assert "No clips under" in page.inner_text("#data-places")
        page.goto(f"{studio.url}/settings")
        assert "is a new config" in page.inner_text("#new-config")
        page.wait_for_timeout(800)  # what a validation on arrival would have needed
        assert "invalid" not in (page.get_attribute("#validation", "class") or "")
        shot = tmp_path / "new-config.png"
        page.screenshot(path=str(shot))
        not_blank(shot)

        stopped = root / "terminal-run"
        (stopped / outputs.CHECKPOINTS / "step-00000004").mkdir(parents=True)
        (stopped / outputs.RESOLVED_CONFIG).write_text("training:\n  steps: 10\n")
        (stopped / outputs.METRICS).write_text('{"step": 4, "loss": 0.5}\n')
        long_ago = time.time() - 2 * TERMINAL_QUIET_S
        os.utime(stopped / outputs.METRICS, (long_ago, long_ago))
        (root / "clips").mkdir()
        (root / "clips" / "videos.txt").write_text("missing.mp4\n")
        (root / "clips" / "prompts.txt").write_text("a caption\n")
        name = studio.write_config("broken.yaml")
        page.goto(studio.url + "/")
        assert "stopped, can resume" in page.inner_text("#runs-table")
        page.select_option("#train-config", name)
        page.click("#start-run")
        page.wait_for_selector("#jobs-table .job-message", timeout=120_000)
        assert "missing.mp4" in page.inner_text("#jobs-table .job-message")
        assert page.locator("#jobs-table a", has_text="log").count() == 1
