"""Run health's one step axis and its linked zoom (issue #40): a box selection on any step chart,
or the sidebar's URL-bound slider, sets one step range that every step chart of the page draws;
"Reset zoom" clears it; unzoomed, every step chart has the run's range."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from app_helpers import charts
from streamlit.proto.WidgetStates_pb2 import WidgetState
from streamlit.testing.v1 import AppTest

from dashboards.data import config, step_zoom
from guard.store.runstore import RunStore
from tests.dashboards.conftest import APP
from tests.dashboards.synth_run import T0, SynthRun, write_run

RUN, STEPS, SHORT = "zoom-me", 60, "short"

# ---- the pure pieces -------------------------------------------------------------------


def test_a_box_covers_the_steps_inside_it() -> None:
    box = {"box": [{"xref": "x", "yref": "y", "x": [10.3, 25.7], "y": [0, 1]}]}
    assert step_zoom.from_selection(box, (0, 59)) == (11, 25)
    # dragged right to left, past the run's end
    assert step_zoom.from_selection({"box": [{"x": [80.0, 40.2]}]}, (0, 59)) == (41, 59)
    # narrower than a step: the step nearest its middle
    assert step_zoom.from_selection({"box": [{"x": [12.6, 12.9]}]}, (0, 59)) == (13, 13)
    # several boxes (shift-drag): their union
    two = {"box": [{"x": [5.0, 8.0]}, {"x": [30.0, 33.0]}]}
    assert step_zoom.from_selection(two, (0, 59)) == (5, 33)


def test_no_box_is_no_zoom() -> None:
    for sel in (None, {}, {"box": []}, {"box": [{"x": []}]}, {"points": [{"x": 3}], "box": []}):
        assert step_zoom.from_selection(sel, (0, 59)) is None
    assert step_zoom.from_selection({"box": [{"x": [70.0, 90.0]}]}, (0, 59)) is None  # off the run


def test_clamp_keeps_a_zoom_inside_the_run() -> None:
    assert step_zoom.clamp((10, 40), (0, 59)) == (10, 40)
    assert step_zoom.clamp([40, 10], (0, 59)) == (10, 40)
    assert step_zoom.clamp((50, 90), (0, 59)) == (50, 59)
    assert step_zoom.clamp((100, 200), (0, 59)) == (0, 59)  # another run's zoom: the whole run
    assert step_zoom.clamp("junk", (0, 59)) == (0, 59)
    assert step_zoom.clamp(None, (0, 59)) == (0, 59)


def test_clip_cuts_frames_dicts_and_step_arrays() -> None:
    df = pl.DataFrame({"step": list(range(10)), "v": [float(i) for i in range(10)]})
    assert step_zoom.clip(df, (3, 5))["step"].to_list() == [3, 4, 5]
    assert step_zoom.clip({"a": df}, (8, 20))["a"]["step"].to_list() == [8, 9]
    assert step_zoom.clip(np.array([1, 4, 9]), (2, 9)).tolist() == [4, 9]
    assert step_zoom.describe((0, 9), (0, 9)) == "all steps, 0..9"
    assert step_zoom.describe((3, 5), (0, 9)) == "steps 3..5 of 0..9"


# ---- the page --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def zoom_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("zoom")
    write_run(root, SynthRun(run_id=SHORT, steps=20, faults=[]))
    d = write_run(root, SynthRun(run_id=RUN, steps=STEPS))
    store = RunStore(d)
    for step in range(0, STEPS, 3):
        store.add_host_row(
            {
                "step": step,
                "time": T0 + step,
                "cpu_pct": 90.0,
                "rss_bytes": 2.0 * 2**30,
                "host_mem_used_bytes": 6 * 2**30,
                "host_mem_total_bytes": 16 * 2**30,
                "gpu_util_pct": None,
                "gpu_mem_used_bytes": None,
            }
        )
    store.close()
    return root


NOT_STEP_AXIS = ("Current load share", "Goodput")  # x = expert, x = % of wall time


def step_ranges(at: AppTest) -> dict[str, set[tuple[float, float]]]:
    """chart title -> the x ranges of its axes, for every step chart of the page."""
    out: dict[str, set[tuple[float, float]]] = {}
    for fig in charts(at):
        title = str(fig["layout"].get("title", {}).get("text", ""))
        if title.startswith(NOT_STEP_AXIS):
            continue
        axes = [v for k, v in fig["layout"].items() if k.startswith("xaxis")]
        out[title] = {tuple(a["range"]) for a in axes}  # a step chart has every x-axis fixed
    return out


def _assert_all(at: AppTest, lo: float, hi: float, *, n: int = 10) -> None:
    got = step_ranges(at)
    # loss/timeline, 6 layer heatmaps, expert share over time, throughput, host (no precursors here)
    assert len(got) >= n, "\n".join(got)
    assert all(r == {(lo, hi)} for r in got.values()), got


def _open(open_page, root: Path) -> AppTest:
    at = open_page("health", root, run=RUN)
    assert not at.exception, at.exception
    return at


def test_every_step_chart_has_the_runs_range_until_zoomed(zoom_store: Path, open_page) -> None:
    at = _open(open_page, zoom_store)
    _assert_all(at, -0.5, STEPS - 0.5)
    assert at.slider(key=step_zoom.KEY).value == (0, STEPS - 1)
    assert at.button(key="reset_zoom").disabled
    # bound to the URL (the browser writes ?steps=a&steps=b; at the run's range, nothing)
    assert at.slider(key=step_zoom.KEY).proto.query_param_key == step_zoom.KEY


def test_the_url_zooms_every_chart_and_reset_clears_it(
    zoom_store: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(config.ENV_RUNS, str(zoom_store))
    monkeypatch.delenv(config.ENV_HISTORY, raising=False)
    at = AppTest.from_file(str(APP), default_timeout=60).run()
    at.switch_page("page_health.py")  # a shared link: /health?run=zoom-me&steps=20&steps=35
    at.query_params["run"] = RUN
    at.query_params["steps"] = ["20", "35"]
    at.run()
    assert not at.exception, at.exception
    _assert_all(at, 19.5, 35.5)
    assert any("Zoomed to steps 20..35 of 0..59" in c.value for c in at.caption)
    # the zoomed lines hold the zoom's steps only (their y-axes fit what is shown)
    loss = next(t for t in charts(at)[0]["data"] if t.get("name") == "loss")
    assert min(loss["x"]) >= 20 and max(loss["x"]) <= 35
    assert not at.button(key="reset_zoom").disabled
    at.button(key="reset_zoom").click().run()
    _assert_all(at, -0.5, STEPS - 0.5)
    assert at.slider(key=step_zoom.KEY).value == (0, STEPS - 1)


def test_the_slider_zooms_every_chart(zoom_store: Path, open_page) -> None:
    at = _open(open_page, zoom_store)
    at.slider(key=step_zoom.KEY).set_value((5, 12)).run()
    _assert_all(at, 4.5, 12.5)


def test_a_box_selection_on_one_chart_zooms_every_chart(zoom_store: Path, open_page) -> None:
    """What the browser sends when a step is dragged across on the throughput chart (the selection
    state streamlit's frontend builds from plotly's), replayed through AppTest's runner: AppTest has
    no plotly-chart widget to set, so the state is added to the widgets' states by hand."""
    at = _open(open_page, zoom_store)
    perf = next(
        el
        for el in at.get("plotly_chart")
        if json.loads(el.proto.spec)["layout"]["title"]["text"].startswith("Through")
    )
    states = at._tree.get_widget_states()  # noqa: SLF001 (no public way to send a chart's selection)
    ws = WidgetState(id=perf.proto.id)
    ws.string_value = json.dumps(
        {
            "selection": {
                "points": [],
                "point_indices": [],
                "box": [{"xref": "x2", "yref": "y2", "x": [30.2, 44.6], "y": [0, 1]}],
                "lasso": [],
            }
        }
    )
    states.widgets.append(ws)
    at._run(states)  # noqa: SLF001
    assert not at.exception, at.exception
    _assert_all(at, 30.5, 44.5)
    assert at.slider(key=step_zoom.KEY).value == (31, 44)  # the slider (and so the URL) holds it


def test_another_runs_zoom_is_kept_inside_the_run_shown(zoom_store: Path, open_page) -> None:
    at = _open(open_page, zoom_store)
    at.slider(key=step_zoom.KEY).set_value((40, 55)).run()
    at.selectbox(key="run").set_value(SHORT).run()  # 20 steps: the zoom lies past its end
    assert not at.exception, at.exception
    _assert_all(at, -0.5, 19.5, n=9)  # no host samples, no precursors
    at.slider(key=step_zoom.KEY).set_value((15, 19)).run()
    at.selectbox(key="run").set_value(RUN).run()  # overlaps: kept
    _assert_all(at, 14.5, 19.5)
