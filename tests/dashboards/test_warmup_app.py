"""Warm-up spans on the Run health page (issue #31, item 2): the loss/grad-norm chart and the
routing heatmaps shade the span before each detector arms, labelled with the setting."""

from __future__ import annotations

from pathlib import Path

from app_helpers import chart_titled, charts

from tests.dashboards import synth_store as synth
from tests.dashboards.synth_run import SynthRun, write_run

HEALTH_TITLE = "Loss and grad norm with guard verdicts and actions"


def test_health_page_shades_warmups_with_their_settings(tmp_path: Path, open_page) -> None:
    run = write_run(tmp_path, SynthRun(run_id="r", steps=400, seed=1))
    synth.set_meta(run, config={"guard": {"collapse": {"warmup": 120}}})
    at = open_page("health", tmp_path, run="r")
    assert not at.exception, [e.value for e in at.exception]
    fig = chart_titled(at, HEALTH_TITLE)
    rects = {(s["x0"], s["x1"]) for s in fig["layout"].get("shapes", []) if s.get("type") == "rect"}
    # steps 0..119 not judged by the collapse detector (recorded), 0..31 by the spike detectors (default)
    assert (-0.5, 119.5) in rects and (-0.5, 31.5) in rects, rects
    labels = [s.get("name") for s in fig["layout"].get("shapes", []) if s.get("showlegend")]
    assert "collapse warm-up: to step 120" in labels, labels  # in the legend; the caption names the setting
    maxvio = next(f for f in charts(at) if "MaxVio" in str(f["layout"].get("title", {}).get("text", "")))
    assert any(s.get("x1") == 119.5 for s in maxvio["layout"].get("shapes", [])), maxvio["layout"].get(
        "shapes"
    )
    assert any("collapse.warmup" in c.value for c in at.caption)
