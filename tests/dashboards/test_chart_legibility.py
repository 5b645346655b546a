"""What the issue #17 screenshots showed a reader could not tell, asserted on the figures the app
sends to the browser (AppTest) over real `moeguard train` runs of the micro model: the
precursor chart's NaN steps, the max-logit layers under the "all layers" line, and two runs
with the same loss drawn one over the other."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from app_helpers import chart_titled, traces

from dashboards.figures.nonfinite_marks import NONFINITE_STEP
from tests.dashboards.test_screenshots import _train

pytestmark = [pytest.mark.integration, pytest.mark.slow]

HEALTH_TITLE = "Loss and grad norm with guard verdicts and actions"
PRECURSOR_TITLE = "Precursors: signals that move before a loss spike"
NAN_AT = 50  # the unguarded run's injected NaN: from here to its last step (79) nothing is finite


@pytest.fixture(scope="module")
def real_runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    _train(root / "nan-unguarded", "--no-guard", "--inject", f"nan@{NAN_AT}")
    for kernel in ("bmm", "loop"):  # one seed, two kernels that compute the same thing
        _train(root / f"kernel-{kernel}", "--set", f"model.experts_kernel={kernel}")
    return root


def _panel_values(fig: dict, yaxis: str) -> list[float]:
    """Every finite y the lines of one panel draw."""
    return [
        y
        for t in fig["data"]
        if t.get("yaxis", "y") == yaxis and t.get("mode") == "lines"
        for y in (t.get("y") or [])
        if isinstance(y, int | float) and y == y and abs(y) != float("inf")
    ]


def test_precursor_chart_marks_the_nonfinite_steps_like_the_health_chart(real_runs: Path, open_page) -> None:
    """The update ratio, group grad norms and max logits have no value once the run went NaN:
    every panel marks those steps with the health chart's own tick (one definition), pinned to
    the panel's top, instead of its lines just ending at step 50."""
    at = open_page("health", real_runs, run="nan-unguarded")
    assert not at.exception, [e.value for e in at.exception]
    fig = chart_titled(at, PRECURSOR_TITLE)
    panels = sorted(k.replace("yaxis", "y") for k in fig["layout"] if k.startswith("yaxis"))
    ticks = traces(fig, NONFINITE_STEP)
    assert sorted(t.get("yaxis", "y") for t in ticks) == panels, "one row of ticks on every panel"
    health = traces(chart_titled(at, HEALTH_TITLE), NONFINITE_STEP)
    nan_steps = set(range(NAN_AT, 80))
    assert health and set().union(*(set(t["x"]) for t in health)) == nan_steps
    for t in ticks:
        assert set(t["x"]) == nan_steps, t.get("yaxis")
        assert t["marker"] == health[0]["marker"] and t["mode"] == "markers"
        assert set(t["y"]) == {max(_panel_values(fig, t.get("yaxis", "y")))}, "pinned to the panel's top"
    assert [t["showlegend"] for t in ticks].count(True) == 1, "one legend entry"


def test_max_logit_panel_shows_the_layer_that_holds_the_max(real_runs: Path, open_page) -> None:
    """The max over layers is always one layer's value. Drawn as a dark line over the layers it
    hid that layer; now it is a wide translucent band behind opaque layer lines, so the layer
    that holds the max shows in its own colour inside it, and the band's hover names it."""
    at = open_page("health", real_runs, run="nan-unguarded")
    assert not at.exception, [e.value for e in at.exception]
    fig = chart_titled(at, PRECURSOR_TITLE)
    names = [t.get("name") for t in fig["data"]]
    (band,) = traces(fig, "max logit (all layers)")
    layers = [t for t in fig["data"] if re.fullmatch(r"layer \d+ max logit", t.get("name") or "")]
    assert len(layers) == 2, names  # the micro model's two layers
    for t in layers:
        assert names.index(band["name"]) < names.index(t["name"]), "the band is drawn behind the layers"
        assert t.get("opacity", 1) == 1 and t["line"]["width"] < band["line"]["width"]
    alpha = float(re.fullmatch(r"rgba\(.*,\s*([\d.]+)\)", band["line"]["color"]).group(1))
    assert alpha <= 0.5, "a layer's colour shows through the band"
    held = 0
    for step, top, who in zip(band["x"], band["y"], band["customdata"], strict=True):
        on_top = [
            t["name"].split()[1] for t in layers if dict(zip(t["x"], t["y"], strict=True)).get(step) == top
        ]
        assert on_top, f"step {step}: no layer line lies on the band"
        assert who == ("layer " if len(on_top) == 1 else "layers ") + ", ".join(on_top), (step, who, on_top)
        held += 1
    assert held >= 5, "sampled every 10th step up to the NaN"


def test_runs_with_the_same_loss_stay_apart_on_the_overlay(real_runs: Path, open_page) -> None:
    """bmm and loop kernels with one seed have the same loss at every step: drawn alike, the
    second line covered the first and one run seemed missing. Each run has its own dash pattern
    (the legend draws it), and the run underneath is wider, so it shows around and between the
    dashes of the one on top."""
    at = open_page("compare", real_runs)
    at.multiselect(key="runs").set_value(["kernel-bmm", "kernel-loop"]).run()
    at.selectbox(key="metric").set_value("loss").run()
    assert not at.exception, [e.value for e in at.exception]
    fig = chart_titled(at, "Loss (nats/token) by")
    lines = [t for t in fig["data"] if t.get("mode") == "lines"]
    assert [t["name"] for t in lines] == ["kernel-bmm", "kernel-loop"]
    under, over = lines
    assert under["x"] == over["x"]
    same = [abs(a - b) < 1e-3 for a, b in zip(under["y"], over["y"], strict=True) if a is not None]
    assert len(same) > 40 and all(same), "the case itself: one line over the other"
    assert under["line"].get("dash", "solid") != over["line"].get("dash", "solid")
    assert under["line"]["width"] > over["line"]["width"]
    assert all(t.get("showlegend", True) for t in lines), "each run has its legend entry, in its own style"
