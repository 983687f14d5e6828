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
