"""What issue #40's closing screenshots of Run health showed (real runs in headless Chromium), on
the figure and data functions: the smallest update ratios drawn pink, the loss chart's step axis
~90 px right of the other step charts', a zero update ratio drawn as a line off the log panel,
and a checkpoint at step 20 in the events table where the chart put it at 19."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from dashboards.data import guard_events
from dashboards.figures.health import health_timeline
from dashboards.figures.heatmap import heatmap, share_colors
from dashboards.figures.precursors import precursor_figure
from dashboards.figures.style import LANE_NAME_MAX, STEP_MARGIN
from guard.core import schema
from tests.dashboards.synth_run import SynthRun, write_run

PLACEHOLDER = re.compile(r"#0000[0-9]{2}")  # Streamlit's theme colours, swapped by its frontend


@pytest.mark.parametrize("scale", ["Viridis", "YlOrRd", "Reds", "Viridis_r", "Cividis", "Magma", "share"])
def test_no_colour_stop_is_one_streamlit_swaps(scale: str) -> None:
    """Magma starts at #000004, Streamlit's 4th category placeholder: its frontend turned the
    darkest cells and the colour bar's end light red. Every stop goes as rgb() now."""
    h = {"x": np.arange(3), "y": [0, 1], "z": np.array([[1e-3, 1e-2, 1e-1], [2e-3, 2e-2, 2e-1]])}
    kw = share_colors(h["z"] * 100, 4) if scale == "share" else {"colorscale": scale}
    fig = heatmap(h, title="t", x_title="step", y_title="layer", z_title="z", log=True, **kw)
    stops = [str(c).lower() for _, c in fig.data[0].colorscale]
    assert not [c for c in stops if PLACEHOLDER.fullmatch(c)], stops
    if scale == "Magma":
        assert stops[0] == "rgb(0,0,4)"  # the same colour, not a placeholder


def test_lane_names_do_not_push_the_loss_charts_step_axis() -> None:
    """The guard timeline's lane labels (collapse_not_recovered) widened its chart's left margin
    through plotly's automargin, so a step sat ~90 px right of where the precursor and throughput
    charts put it. The lane axis does not grow the margin; the margin holds the longest name."""
    steps = pl.DataFrame({"step": np.arange(20), "loss": np.linspace(5, 3, 20), "grad_norm": np.ones(20)})
    timeline = pl.DataFrame(
        {
            "step": [3, 5],
            "lane": [schema.DET_COLLAPSE_NOT_RECOVERED, schema.EV_CHECKPOINT],
            "kind": [schema.EV_VERDICT, schema.EV_CHECKPOINT],
            "hover": ["v", "c"],
        }
    )
    fig = health_timeline({"loss": steps, "grad_norm": steps}, pl.DataFrame(), timeline, steps=(0, 19))
    lane_axis = [
        a for k, a in fig.layout.to_plotly_json().items() if k.startswith("yaxis") and a.get("categoryarray")
    ]
    assert lane_axis and lane_axis[0]["automargin"] is False
    assert fig.layout.margin.l == STEP_MARGIN["l"]
    names = [v for k, v in vars(schema).items() if k.startswith(("DET_", "EV_")) and isinstance(v, str)]
    assert max(len(n) for n in names) <= LANE_NAME_MAX, max(names, key=len)
    assert STEP_MARGIN["l"] >= 6 * LANE_NAME_MAX + 30  # ~6 px a character at the tick font, the title


def test_every_lane_of_the_timeline_is_named() -> None:
    """A demo run's Run health (2026-11-29) drew its maxvio verdict on an unlabelled row: with seven
    lanes plotly's automatic ticks skipped one. Every lane is a tick of its own now."""
    steps = pl.DataFrame({"step": np.arange(400), "loss": np.linspace(5, 3, 400), "grad_norm": np.ones(400)})
    lanes = [
        schema.EV_ACTION,
        schema.DET_GRAD_SPIKE,
        schema.DET_LAYER_GRAD_SPIKE,
        schema.DET_LR,
        schema.DET_MAXVIO,
        schema.DET_NONFINITE,
        schema.DET_THROUGHPUT,
    ]
    timeline = pl.DataFrame(
        {"step": [100 + 20 * i for i in range(len(lanes))], "lane": lanes, "kind": [schema.EV_VERDICT] * 7}
    ).with_columns(hover=pl.col("lane"))
    fig = health_timeline({"loss": steps, "grad_norm": steps}, pl.DataFrame(), timeline, steps=(0, 399))
    (axis,) = [
        a for k, a in fig.layout.to_plotly_json().items() if k.startswith("yaxis") and a.get("categoryarray")
    ]
    assert axis["tickmode"] == "array" and list(axis["tickvals"]) == sorted(lanes) == list(axis["ticktext"])


def test_a_zero_update_ratio_is_a_gap_on_the_log_panel() -> None:
    """Step 1's update ratio is 0 after an LR-0 first warm-up step: on the log panel that drew a
    line from step 2's value down off the bottom edge."""
    ratio = pl.DataFrame({"step": np.arange(5), "update_ratio": [float("nan"), 0.0, 0.013, 0.02, 0.018]})
    fig = precursor_figure({"update_ratio": ratio}, {}, pl.DataFrame(), steps=(0, 4))
    y = next(t for t in fig.data if t.name == "update ratio").y
    assert np.isnan(y[1]) and y[2] == pytest.approx(0.013)


def test_the_events_table_puts_a_checkpoint_where_the_chart_does() -> None:
    """checkpoint-20 of a 20-step run: the chart shows it at step 19 (the last step it holds),
    the events table said 20."""
    ev = pl.DataFrame(
        {
            "step": [0, 5, 20, 12],
            "kind": [schema.EV_CHECKPOINT, schema.EV_CHECKPOINT, schema.EV_CHECKPOINT, schema.EV_VERDICT],
        }
    )
    assert ev.select(guard_events.shown_steps())["step"].to_list() == [0, 4, 19, 12]
    assert [guard_events.shown_step(k, s) for s, k in ev.iter_rows()] == [0, 4, 19, 12]


def test_a_model_without_expert_biases_gets_no_bias_chart() -> None:
    """A Mixtral Trainer run's expert-bias norm is 0 everywhere: it drew a grey block on a
    -0.5..0.5 scale (a norm is never negative). The page leaves the chart out and says why."""
    from dashboards.data import heatmaps

    assert heatmaps.all_zero({"z": [[0.0, 0.0], [float("nan"), 0.0]]})
    assert not heatmaps.all_zero({"z": [[0.0, 1e-3], [float("nan"), 0.0]]})


def test_the_load_share_caption_says_it_sums_over_steps(tmp_path: Path, open_page) -> None:
    """collapse-300: after the drill a bias correction flipped layer 1 between expert pairs
    {0,2} and {1,3} every step (MaxVio 1 at every step); the window's shares read 21-28%, near
    uniform. The caption says the load-share charts sum over steps and where the per-step view is."""
    write_run(tmp_path, SynthRun(run_id="r", steps=60, faults=[], seed=5))
    at = open_page("health", tmp_path, run="r")
    assert not at.exception, [e.value for e in at.exception]
    cap = " ".join(c.value for c in at.caption)
    assert "a layer collapsed onto different experts from step to step reads near uniform here" in cap
