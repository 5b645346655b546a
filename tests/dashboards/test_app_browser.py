"""Real browser: `moeguard app` serves the synthetic store on loopback, Chromium (playwright)
loads each page, waits for the charts, and saves full-page screenshots.

Screenshots land in the test's tmp_path and are copied to test-output/ at the repository root
(gitignored) so a person can look at them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from guard.core import schema
from guard.core.report import StepReport
from guard.store.runstore import RunStore
from tests.dashboards.synth_run import SynthRun, write_run
from tests.dashboards.synth_store import CRASHED, GUARDED, NONFINITE, PREEMPTED, STALE, UNGUARDED

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve(runs: Path, history: Path, log: Path) -> Iterator[str]:
    """`python -m guard app` on a free loopback port; yields the base URL once healthy."""
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "guard",
        "app",
        "--runs",
        str(runs),
        "--port",
        str(port),
        "--host",
        "127.0.0.1",
        "--history",
        str(history),
    ]
    with open(log, "wb") as out:
        # own process group: the launcher's streamlit child is stopped with it
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:
                if proc.poll() is not None:
                    raise AssertionError(f"app exited with {proc.returncode}: {log.read_text()[-2000:]}")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(base + "/_stcore/health", timeout=1).text.strip() == "ok":
                        break
                if time.monotonic() > deadline:
                    raise AssertionError(f"app not healthy after 60 s: {log.read_text()[-2000:]}")
                time.sleep(0.3)
            yield base
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()


def _screenshot(page, url: str, out: Path, *, min_charts: int, selector: str | None = None) -> dict:
    """Load `url`, wait until `min_charts` plotly charts (and `selector`, if given) have drawn and
    the script has finished, screenshot the whole page."""
    page.goto(url, wait_until="networkidle")
    if selector:  # a page with no chart to wait for (Runs: its table) was shot before it drew
        page.wait_for_selector(selector, timeout=120_000)
    page.wait_for_function(
        f"document.querySelectorAll('.js-plotly-plot .main-svg').length >= {min_charts}", timeout=60_000
    )
    # the script has finished (no "running" icon)
    page.wait_for_function(
        "!document.querySelector('[data-testid=stStatusWidgetRunningIcon], "
        "[data-testid=stStatusWidgetRunningManIcon]')",
        timeout=120_000,
    )
    # let the last charts finish their layout transitions: the script has finished and every chart
    # has drawn by now, what is left is a frame or two of relayout (the text read below is final)
    page.wait_for_timeout(500)
    # Streamlit scrolls inside its own container: grow the viewport to the content so the
    # full-page screenshot really holds the whole page
    height = page.evaluate(
        "Math.max(...[...document.querySelectorAll('[data-testid=stMain], section.main, body')]"
        ".map(e => e.scrollHeight))"
    )
    page.set_viewport_size({"width": 1600, "height": int(height) + 40})
    page.wait_for_timeout(500)  # the charts' relayout to the new viewport
    page.screenshot(path=str(out), full_page=True)
    return {
        "exceptions": page.locator("[data-testid=stException]").count(),
        "charts": page.locator(".js-plotly-plot").count(),
        "text": page.inner_text("body"),
        "table_overflow_px": _table_overflow(page),
    }


def _table_overflow(page) -> list[int]:
    """Per table on the page, how many pixels its columns reach past its visible width (0: every
    column on screen, no horizontal scroll)."""
    return page.evaluate(
        "[...document.querySelectorAll('[data-testid=stDataFrame] .dvn-scroller')]"
        ".map(s => s.scrollWidth - s.clientWidth)"
    )


def _chromium(p):
    return p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    """One Chromium for the module's tests (each opens pages of its own)."""
    playwright = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} not installed")
    with playwright.sync_playwright() as p:
        b = _chromium(p)
        yield b
        b.close()


@pytest.fixture(scope="module")
def app(store: Path, history: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """`moeguard app` over the synthetic store, started once for the tests that read it."""
    with serve(store, history, tmp_path_factory.mktemp("app") / "app.log") as base:
        yield base


def test_pages_render_in_chromium(app: str, browser: Any, tmp_path: Path) -> None:
    keep = ROOT / "test-output" / "app"
    keep.mkdir(parents=True, exist_ok=True)
    results = {}
    base = app
    page = browser.new_page(viewport={"width": 1600, "height": 1000})
    for name, path, min_charts in (
        ("health", f"/health?run={GUARDED}", 10),
        ("health-nonfinite", f"/health?run={NONFINITE}", 8),
        ("health-preempted", f"/health?run={PREEMPTED}", 8),
        ("runs", "/", 0),  # the default page lives at /
        ("compare", f"/compare?runs={GUARDED}&runs={UNGUARDED}&runs={STALE}&runs={CRASHED}", 2),
        ("canaries", "/canaries", 1),
    ):
        page.set_viewport_size({"width": 1600, "height": 1000})
        shot = tmp_path / f"{name}.png"
        results[name] = _screenshot(page, base + path, shot, min_charts=min_charts)
        shutil.copy(shot, keep / shot.name)
    page.close()
    for name, r in results.items():
        assert r["exceptions"] == 0, f"{name}: Streamlit shows an exception"
        assert "Page not found" not in r["text"], name
        assert "Traceback" not in r["text"], name
    health = results["health"]
    assert health["charts"] >= 10
    for text in (
        "Run health",
        "Loss and grad norm with guard verdicts and actions",
        "Guard events",
        "Expert load",
        "Throughput and memory",
    ):
        assert text in health["text"], text
    assert "finished" in results["runs"]["text"] and "stale" in results["runs"]["text"]
    for status in ("preempted", "interrupted", "finished, non-finite"):  # the counts above the table
        assert status in results["runs"]["text"], status
    nonfinite = results["health-nonfinite"]["text"]
    assert "finished, non-finite" in nonfinite and "the weights are not usable" in nonfinite
    assert "non-finite from step 260" in nonfinite
    assert "SIGTERM" in results["health-preempted"]["text"]
    assert "Canary MFU history" in results["canaries"]["text"]


def test_live_mode_follows_a_running_run(browser: Any, tmp_path: Path, monkeypatch) -> None:
    """With Live on, a part the trainer flushes shows up without touching the page."""
    runs = tmp_path / "runs"
    run = write_run(runs, SynthRun(run_id="live", steps=100, faults=[], status=schema.STATUS_RUNNING))
    monkeypatch.setenv("MOEGUARD_APP_LIVE_S", "2")
    with serve(runs, tmp_path / "none.jsonl", tmp_path / "app.log") as base:  # its own: Live's env
        page = browser.new_page(viewport={"width": 1400, "height": 900})
        page.goto(base + "/health?run=live", wait_until="networkidle")
        first_metric = "document.querySelector('[data-testid=stMetricValue]')"
        page.wait_for_function(f"{first_metric} && {first_metric}.innerText.trim() === '100'", timeout=60_000)
        page.get_by_text("Live (rerun every").click()
        # the trainer flushes 50 more steps, through the real writer (the metric counts steps: 100 -> 150)
        store = RunStore(run, flush_every=50)
        for s in range(100, 150):
            store.add_step(StepReport(step=s, time=1e9 + s, loss=2.5, grad_norm=1.0, lr=1e-4, tokens=65536))
        store.close()
        page.wait_for_function(f"{first_metric}.innerText.trim() === '150'", timeout=30_000)
        assert page.locator("[data-testid=stException]").count() == 0
        page.close()


def test_runs_page_opens_at_its_own_url(app: str, browser: Any) -> None:
    """Issue #17 item 7: a typed or bookmarked `/runs` opens the Runs page (it said "Page not
    found" while Runs was the default page, served at `/` only); `/` lands on `/runs`."""
    base = app
    page = browser.new_page(viewport={"width": 1600, "height": 1000})
    for path in ("/runs", "/"):
        page.goto(base + path, wait_until="networkidle")
        page.wait_for_selector("[data-testid=stDataFrame]", timeout=60_000)
        text = page.inner_text("body")
        assert "Page not found" not in text and "Runs" in text, path
        assert page.url.rstrip("/").endswith("/runs"), page.url
    page.get_by_role("link", name="Compare").first.click()
    page.wait_for_url("**/compare**", timeout=30_000)
    page.close()
