"""A real A/B canary on the Canaries page, in Chromium: `moeguard canary --ab` (the shipped canary
model run short, 2 pairs, B with the loop expert kernel (the config's is bmm) and slowed 25%) writes ab.json where it writes
by default (RUNS/canary-report/), `moeguard app --runs RUNS` finds it there, and the page is saved
to test-output/screenshots/canaries-ab.png for a person to look at."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from guard.canary import ab_format
from guard.cli import main
from tests.conftest import REPO
from tests.dashboards.test_app_browser import CHROMIUM, _chromium, _screenshot, serve
from tests.guard.test_canary import SHORT, _sets

pytestmark = [pytest.mark.integration, pytest.mark.slow]
OUT = REPO / "test-output" / "screenshots"


def test_a_real_ab_canary_on_the_canaries_page(tmp_path: Path) -> None:
    playwright = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        pytest.skip(f"{CHROMIUM} not installed")
    runs = tmp_path / "runs"
    sets = [*SHORT, "canary.ab_fail_pct=10", "canary.ab_pairs=2", "canary.ab_max_pairs=2"]
    code = main(
        [
            "canary",
            "--ab",
            "set:",
            "set:model.experts_kernel=loop",
            "--inject",
            "slow:25",
            "--runs",
            str(runs),
        ]
        + _sets(sets)
    )
    written = runs / ab_format.REPORT_DIR / ab_format.AB_JSON
    rep = ab_format.read_report(written)
    assert code == rep["exit_code"] and rep["statistic"]["n_pairs"] == 2
    OUT.mkdir(parents=True, exist_ok=True)
    shot = tmp_path / "canaries-ab.png"
    with serve(runs, tmp_path / "no-history.jsonl", tmp_path / "app.log") as base:
        with playwright.sync_playwright() as p:
            browser = _chromium(p)
            page = browser.new_page(viewport={"width": 1600, "height": 1000})
            got = _screenshot(page, base + "/canaries", shot, min_charts=1)
            browser.close()
    shutil.copy(shot, OUT / shot.name)
    assert got["exceptions"] == 0 and "Traceback" not in got["text"]
    text = got["text"]
    assert "A/B canaries" in text and f"{rep['verdict'].upper()}" in text
    assert f"{rep['statistic']['median']:.4f}" in text
    assert "Environment diff" in text and "Ops that changed most" in text
    assert "expert_kernel (A bmm, B loop)" in text  # the kernel each side actually ran, from its workers
    assert "injected slowdown 25%" in text
    assert got["charts"] == 1  # the history section says no history; the A/B chart is the one chart
