"""Issue #40: one rule per page for what every chart shares, asserted on what the app sends to
the browser (AppTest) and on the figure functions' output.

- one step axis: every chart of Run health spans the run's own steps (a 20-step run is not
  drawn in the left 8% of an axis stretched to the collapse warm-up at step 250), warm-up
  labels in the legend, not on the data;
- one colour scale for load shares: 0% (no tokens) dark blue, the uniform share white, never
  below 0, not fitted to the values;
- one "no value" rendering in every table;
- Compare: the violins carry the run-to-run caveat, no empty MFU axes, injected faults diffed;
- Canaries: the history chart names the measure it plots;
- Run health: the learning rate and goodput with badput by cause."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import polars as pl
from app_helpers import chart_titled, charts, traces

from dashboards import ui
from dashboards.canary_ab_view import ratio_words
from dashboards.figures.canaries import canary_figure
from dashboards.figures.compare import NO_MFU, compare_distributions, compare_overlay
from dashboards.figures.heatmap import SHARE_BLUE, SHARE_WHITE, heatmap, share_colors
from dashboards.figures.precursors import precursor_figure
from dashboards.figures.style import STEP_MARGIN, step_range
from dashboards.figures.warmup_marks import WARMUP_LEGEND
from guard.canary.ab_format import RATIO_LABELS, SPEED, TPS_RAW
from tests.dashboards import synth_store as synth
from tests.dashboards.synth_run import ENV_A, SynthRun, write_run

HEALTH_TITLE = "Loss and grad norm with guard verdicts and actions"
NO_PEAK_ENV = {**ENV_A, "device": "cpu:x86_64:2threads", "peak_flops": None, "peak_flops_source": "none"}


def _step_charts(at) -> list[dict]:
    """Run health's charts whose x is the step (all but the current load share and goodput)."""
    return [
        f
        for f in charts(at)
        if not str(f["layout"]["title"]["text"]).startswith(("Current load share", "Goodput"))
    ]


def test_a_short_run_fills_every_chart_on_one_step_axis(tmp_path: Path, open_page) -> None:
    """Item 2: a 20-step run (the collapse detector arms at step 250, the spike detectors at 32)
    spans every chart's x-axis; the warm-up bands are clipped to it and say the detector never
    armed, in the legend; no text sits on the plot."""
    write_run(tmp_path, SynthRun(run_id="short", steps=20, faults=[], seed=3))
    at = open_page("health", tmp_path, run="short")
    assert not at.exception, [e.value for e in at.exception]
    figs = _step_charts(at)
    assert len(figs) >= 8, [f["layout"]["title"]["text"] for f in figs]
    for f in figs:
        axes = [v for k, v in f["layout"].items() if k.startswith("xaxis")]
        assert axes and all(a.get("range") == [-0.5, 19.5] for a in axes), (
            f["layout"]["title"]["text"],
            axes,
        )
    health = chart_titled(at, HEALTH_TITLE)
    bands = [s for s in health["layout"]["shapes"] if s.get("legendgroup") == WARMUP_LEGEND]
    assert {(b["x0"], b["x1"]) for b in bands} == {(-0.5, 19.5)}, bands
    assert all(b["showlegend"] and b["name"].endswith("<br>(not armed in this run)") for b in bands), bands
    assert {b["name"].split(":")[0] for b in bands} == {"collapse warm-up", "spike detectors warm-up"}
    assert not [a for a in health["layout"].get("annotations", []) if "warm-up" in a.get("text", "")]
    assert any("not armed in this run" in c.value for c in at.caption)
    # the full-width step charts have one plot width: a step sits at the same x on each
    wide = [chart_titled(at, t)["layout"]["margin"] for t in (HEALTH_TITLE, "Throughput, efficiency")]
    assert wide[0] == wide[1] == STEP_MARGIN
    ratio = pl.DataFrame({"step": np.arange(20), "update_ratio": np.full(20, 1e-3)})
    assert precursor_figure({"update_ratio": ratio}, {}, pl.DataFrame()).layout.margin.r == STEP_MARGIN["r"]


def test_a_long_runs_bands_end_where_the_detectors_arm(tmp_path: Path, open_page) -> None:
    write_run(tmp_path, SynthRun(run_id="long", steps=300, seed=4))
    at = open_page("health", tmp_path, run="long")
    assert not at.exception, [e.value for e in at.exception]
    health = chart_titled(at, HEALTH_TITLE)
    bands = {(s["x0"], s["x1"], s["name"]) for s in health["layout"]["shapes"] if s.get("legendgroup")}
    assert (-0.5, 249.5, "collapse warm-up: to step 250") in bands, bands
    for f in _step_charts(at):
        assert f["layout"]["xaxis"]["range"] == [-0.5, 299.5], f["layout"]["title"]["text"]


def test_precursor_chart_and_bucketed_heatmaps_share_the_axis() -> None:
    """Item 2 on the figure functions: the precursor chart takes the page's range; a heatmap
    column of 10 steps is drawn over the steps it covers (x its centre, hover its first step)."""
    ratio = pl.DataFrame({"step": np.arange(20), "update_ratio": np.full(20, 1e-3)})
    fig = precursor_figure({"update_ratio": ratio}, {}, pl.DataFrame(), steps=(0, 19))
    assert fig.layout.xaxis.range == tuple(step_range(0, 19)) == (-0.5, 19.5)
    h = {"x": np.array([0, 10, 20]), "y": [1, 2], "z": np.ones((2, 3)), "width": 10}
    fig = heatmap(h, title="t", x_title="step", y_title="layer", z_title="z", steps=(0, 29))
    assert list(fig.data[0].x) == [4.5, 14.5, 24.5]  # steps 0..9 centred at 4.5: spans -0.5..9.5
    assert fig.data[0].customdata[0][1] == 10 and "customdata" in fig.data[0].hovertemplate
    assert fig.layout.xaxis.range == (-0.5, 29.5)


def test_load_share_colours_have_one_fixed_meaning(tmp_path: Path, open_page) -> None:
    """Item 3: 0% is dark blue, uniform (12.5% of 8 experts) white; never below 0; a window
    whose shares are all near uniform is near white, not stretched blue-to-red."""
    c = share_colors(np.array([[11.0, 12.0, 14.0]]), 8)
    assert c["zmin"] == 0.0 and c["zmax"] == 25.0  # twice uniform: shares 11-14% stay pale
    scale = dict((color, pos) for pos, color in c["colorscale"])
    assert scale[SHARE_BLUE] == 0.0 and scale[SHARE_WHITE] == 12.5 / 25.0
    assert share_colors(np.array([53.0, 0.0]), 8)["zmax"] == 53.0  # a collapsed expert: its share tops it
    write_run(tmp_path, SynthRun(run_id="r", steps=120, faults=[], seed=5))
    at = open_page("health", tmp_path, run="r")
    assert not at.exception, [e.value for e in at.exception]
    for prefix in ("Layer ", "Current load share"):
        hm = chart_titled(at, prefix)["data"][0]
        assert hm["zmin"] == 0 and hm["zmax"] >= 25.0, (prefix, hm["zmin"], hm["zmax"])
        z = [v for row in hm["z"] for v in row if v is not None]
        assert min(z) >= 0
        white = next(p for p, col in hm["colorscale"] if col == SHARE_WHITE)
        assert abs(white * hm["zmax"] - 12.5) < 1e-9, "white is the uniform share"


def test_tables_say_no_value_one_way(tmp_path: Path, history: Path, open_page) -> None:
    """Item 10: every table on every page renders a missing value as ui.NO_VALUE (Streamlit's
    own is the word "None"); a NaN median is a missing value too."""
    write_run(tmp_path, SynthRun(run_id="no-peak", steps=120, env=NO_PEAK_ENV, peak_known=False, seed=6))
    write_run(tmp_path, SynthRun(run_id="peak", steps=120, seed=7))
    for page in ("runs", "health", "compare", "canaries"):
        at = open_page(page, tmp_path, run="no-peak" if page == "health" else None, history=history)
        assert not at.exception, (page, [e.value for e in at.exception])
        assert at.dataframe, page
        for d in at.dataframe:
            assert d.proto.placeholder == ui.NO_VALUE, (page, list(d.value.columns))
        if page == "runs":  # the run with no peak: a missing MFU, not "None" or "NaN"
            runs = at.dataframe[0].value.set_index("run")
            assert runs["MFU %"].isna()["no-peak"] and not runs["MFU %"].isna()["peak"]


def test_show_canary_worker_runs_lists_canary_runs_folder(tmp_path: Path, open_page) -> None:
    """Item 10: the sidebar toggle shows the canaries written to canary-runs/ (it did nothing)."""
    write_run(tmp_path, SynthRun(run_id="mine", steps=60, seed=1))
    write_run(tmp_path / "canary-runs", SynthRun(run_id="mine", steps=60, seed=2))  # the same id, apart
    at = open_page("runs", tmp_path)
    assert list(at.dataframe[0].value["run"]) == ["mine"]
    assert any("1 canary worker run(s) hidden" in c.value for c in at.caption)
    at.sidebar.toggle(key="show_canary").set_value(True).run()
    assert set(at.dataframe[0].value["run"]) == {"mine", "canary-runs/mine"}


def test_compare_without_mfu_and_with_faults(tmp_path: Path, open_page) -> None:
    """Item 9: no run has a peak: one throughput panel that says why (not MFU axes from -1 to 4),
    no MFU columns of nothing; the violins carry the run-to-run caveat; the environment diff
    names the faults each run injected."""
    for i, kernel in enumerate(("bmm", "loop")):
        d = write_run(
            tmp_path,
            SynthRun(
                run_id=f"kernel-{kernel}",
                steps=120,
                env={**NO_PEAK_ENV, "expert_kernel": kernel},
                peak_known=False,
                faults=[],
                seed=8 + i,
            ),
        )
        synth.set_meta(d, injections=["gradspike@40:1000"] if kernel == "loop" else [])
    at = open_page("compare", tmp_path)
    assert not at.exception, [e.value for e in at.exception]
    dist = chart_titled(at, "Steady-state throughput by expert kernel")  # what the two runs differ in
    assert [a["text"] for a in dist["layout"]["annotations"]] == [
        f"Throughput (tokens/s), steady state; {NO_MFU}"
    ]
    assert "run-to-run noise" in dist["layout"]["title"]["subtitle"]["text"]
    assert "yaxis2" not in dist["layout"]
    assert any("which no violin shows" in c.value for c in at.caption)
    grouped = next(d.value for d in at.dataframe if "steps" in d.value.columns and "runs" in d.value.columns)
    assert not [c for c in grouped.columns if c.startswith("MFU")]
    diff = at.dataframe[-1].value
    row = diff[diff["key"] == "injected faults"]
    assert list(row["kernel-loop"]) == ["gradspike@40:1000"] and list(row["kernel-bmm"]) == ["none"]
    at.selectbox(key="metric").set_value("MFU").run()
    overlay = chart_titled(at, "MFU (%) by step")
    assert NO_MFU in [a["text"] for a in overlay["layout"]["annotations"]]


def test_compare_figures_keep_mfu_when_a_run_has_it() -> None:
    df = pl.DataFrame(
        {"group": ["a", "b"], "run": ["x", "y"], "mfu": [0.4, float("nan")], "tokens_per_s": [1.0, 2.0]}
    )
    fig = compare_distributions(df, "torch")
    assert (
        fig.layout.title.text == "Steady-state MFU and throughput by torch" and fig.layout.xaxis2 is not None
    )
    over = compare_overlay(
        {"x": pl.DataFrame({"step": [0, 1], "x": [0.0, 1.0], "y": [0.4, 0.41]})}, metric="mfu", x_axis="step"
    )
    assert not [a for a in over.layout.annotations if a.text == NO_MFU]


def test_canary_history_chart_names_what_it_plots() -> None:
    """Item 8: a CPU class's history plots CPU efficiency (no peak): title, axis, legend and hover
    say so, not "MFU"."""
    hist = pl.DataFrame(
        {
            "n": [0, 1],
            "git_sha": ["a" * 7, "b" * 7],
            "torch": ["2.9", "2.9"],
            "time": [None, None],
            "mfu_p50": [0.2, 0.21],
            "tokens_per_s_p50": [1000.0, None],
            "verdict": ["pass", "pass"],
            "baseline": [True, False],
            "config": ["c", "c"],
        }
    )
    fig = canary_figure(hist, {"baseline": None}, fingerprint="cpu:x|c", measure="CPU efficiency")
    assert fig.layout.title.text.startswith("Canary CPU efficiency history")
    assert fig.layout.yaxis.title.text == "CPU efficiency p50 (%)"
    assert not [t for t in fig.data if "MFU" in (t.name or "") or "MFU" in str(t.hovertext)]


def test_ab_view_words_the_ratios_as_ab_md_does() -> None:
    """Item 8: the app's caption uses ab.md's own labels (RATIO_LABELS): normalised by the
    reference matmul on CPU timing only."""
    cpu = ratio_words({"timing": "cpu"})  # type: ignore[typeddict-item]
    assert RATIO_LABELS[SPEED] in cpu and RATIO_LABELS[TPS_RAW] in cpu
    wall = ratio_words({"timing": "wall"})  # type: ignore[typeddict-item]
    assert "not normalised" in wall and "reference matmul, so" in wall


def test_run_health_shows_lr_and_goodput(tmp_path: Path, open_page) -> None:
    """The views a W&B user looks for: the LR as applied (the cool-down at step 425 halves it),
    on the loss chart's step axis, and goodput with its badput by cause from meta.json."""
    d = write_run(tmp_path, SynthRun(run_id="r", steps=500, seed=9))
    gp = {"goodput": 0.5, "wall_s": 400.0, "productive_s": 200.0, "data_wait_s": 20.0, "checkpoint_s": 10.0}
    gp |= {"skipped_s": 8.0, "nonfinite_s": 0.0, "rolled_back_s": 30.0, "startup_s": 60.0, "restarts_s": 0.0}
    synth.set_meta(d, goodput={**gp, "other_s": 72.0})
    at = open_page("health", tmp_path, run="r")
    assert not at.exception, [e.value for e in at.exception]
    fig = chart_titled(at, HEALTH_TITLE)
    (lr,) = traces(fig, "learning rate")
    assert lr["xaxis"] == "x3"  # under loss and grad norm, above the guard timeline: one zoom for all four
    assert {fig["layout"][f"xaxis{k}"].get("matches") for k in ("", "2", "3")} == {"x4"}
    lrs = dict(zip(lr["x"], lr["y"], strict=True))
    assert lrs[410] == 3e-4 and lrs[430] == 1.5e-4  # the cool-down's half LR, as the optimizer had it
    good = chart_titled(at, "Goodput 50.0%")
    parts = {t["name"]: t["x"][0] for t in good["data"]}
    assert parts["productive (goodput) 50.0%"] == 50.0 and parts["rolled back 7.5%"] == 7.5
    assert not [n for n in parts if n.startswith(("non-finite", "restarts"))], "a zero part takes no space"
    assert sum(parts.values()) == 100.0


def test_compare_violins_carry_the_measured_run_to_run_spread(tmp_path: Path, open_page) -> None:
    """Item 9: with a same-config repeat in the store, the violins' caveat gives its spread, the
    figure "Is B faster than A?" sets a difference against."""
    for run, seed in (("a", 1), ("a-again", 2), ("b", 3)):
        env = {**ENV_A, "expert_kernel": "loop"} if run == "b" else dict(ENV_A)
        write_run(tmp_path, SynthRun(run_id=run, steps=120, env=env, faults=[], seed=seed))
    at = open_page("compare", tmp_path)
    assert not at.exception, [e.value for e in at.exception]
    dist = chart_titled(at, "Steady-state MFU and throughput by expert kernel")
    sub = dist["layout"]["title"]["subtitle"]["text"]
    assert sub.startswith("same-config runs here vary by up to") and "noise" in sub, sub
    said = " ".join(c.value for c in at.caption)
    assert "Same-config runs in this store (a, a-again) vary by up to" in said
