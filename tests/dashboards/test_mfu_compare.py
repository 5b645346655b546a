"""Issue #17 in the app: MFU a user can trust (the peak and its source beside every MFU, no MFU
above 100% plotted without an artefact marker), the Compare page answering "is B faster than
A", the Runs page's columns, and the Canaries page judging an entry against the baseline
before it. Pages run in streamlit's AppTest over run stores written by the real writer."""

from __future__ import annotations

import json
import re
import statistics
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import pytest

from dashboards.data import canaries, compare, mfu_peak
from dashboards.figures.compare import compare_overlay
from dashboards.figures.mfu_marks import MFU_ARTEFACT, MFU_META
from guard.canary import history
from guard.core import schema
from tests.dashboards import synth_store as synth
from tests.dashboards.app_helpers import _decode, chart_titled, charts, messages, traces
from tests.dashboards.synth_run import ENV_A, SynthRun, write_run

SELF_PEAK = "self-peak-cpu"  # an older CPU run that timed its own peak: MFU ~180%
PINNED = "pinned-cpu"
FAST = "fast-kernel"  # ENV_A with 10% higher throughput than GUARDED

CPU_ENV = {
    **ENV_A,
    "device": "cpu:x86_64:2threads",
    "peak_flops": 1.6e10,
    "world_size": 1,
    "peak_flops_source": "measured: cpu matmul probe fp32 2 threads",
}
PINNED_ENV = {
    **CPU_ENV,
    "peak_flops": 2.139e11,
    "peak_flops_source": "pinned: cpu-authenticamd-amd-epyc-f26-m2-2c "
    "fp32 in configs/cpu_peaks.toml, measured 2026-11-23 (best of 20 ...)",
}


@pytest.fixture(scope="module")
def mfu_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("mfu-runs")
    write_run(root, SynthRun(run_id=synth.GUARDED, seed=1))
    write_run(root, SynthRun(run_id=SELF_PEAK, steps=300, faults=[], env=CPU_ENV, mfu=1.8, seed=2))
    write_run(root, SynthRun(run_id=PINNED, steps=300, faults=[], env=PINNED_ENV, mfu=0.08, seed=3))
    write_run(
        root,
        SynthRun(run_id=FAST, faults=[], env={**ENV_A, "expert_kernel": "bmm"}, mfu=0.42 * 1.10, seed=4),
    )
    trace = root / FAST / schema.PROFILE_DIR / "host_1.123.pt.trace.json"
    trace.parent.mkdir()
    trace.write_text(json.dumps({"traceEvents": [{"name": "aten::mm", "ph": "X", "ts": 0, "dur": 5}]}))
    return root


# ---- the one rule: no MFU above 100% on any chart without the artefact marker -------------------
def _mfu_axes(fig: dict[str, Any]) -> set[str]:
    """y-axis ids ("y", "y2", ...) whose title says MFU."""
    out = set()
    for k, v in fig["layout"].items():
        if k.startswith("yaxis") and "MFU" in str((v.get("title") or {}).get("text", "")):
            out.add("y" + k[len("yaxis") :])
    return out


def unmarked_mfu_points(fig: dict[str, Any]) -> tuple[int, list[tuple[Any, float]]]:
    """(points above 100% drawn on an MFU axis or by an MFU trace, those without a marker)."""
    axes = _mfu_axes(fig)
    marked: dict[str, set[tuple[str, float]]] = {}
    for t in fig["data"]:
        if t.get("name") == MFU_ARTEFACT:
            pts = {(str(x), round(float(y), 6)) for x, y in zip(t["x"], t["y"], strict=True)}
            marked.setdefault(t.get("yaxis", "y"), set()).update(pts)
    over, missing = 0, []
    for t in fig["data"]:
        ax = t.get("yaxis", "y")
        if t.get("name") == MFU_ARTEFACT or not (ax in axes or t.get("meta") == MFU_META):
            continue
        ys = t.get("y") or []
        xs = t.get("x") or [t.get("name")] * len(ys)  # a violin's points sit at its category
        for x, y in zip(xs, ys, strict=True):
            if y is not None and y > 100:
                over += 1
                if (str(x), round(float(y), 6)) not in marked.get(ax, set()):
                    missing.append((x, y))
    if over:  # and the limit itself is drawn
        assert any(s.get("y0") == 100 and s.get("y1") == 100 for s in fig["layout"].get("shapes", [])), (
            "no 100% line"
        )
    return over, missing


def test_no_plotted_mfu_above_100_percent_without_a_marker(mfu_store: Path, open_page) -> None:
    seen_over = 0
    views = [("health", run, None) for run in (synth.GUARDED, SELF_PEAK, PINNED, FAST)]
    views += [("compare", None, ("MFU", x)) for x in ("steps", "tokens", "wall time")]
    for page, run, overlay in views:
        at = open_page(page, mfu_store, run=run)
        if overlay:
            at.multiselect(key="runs").set_value([synth.GUARDED, SELF_PEAK, PINNED, FAST]).run()
            at.selectbox(key="metric").set_value(overlay[0]).run()
            at.segmented_control(key="x_axis").set_value(overlay[1]).run()
            at.select_slider(key="smooth").set_value(10).run()
        assert not at.exception, [e.value for e in at.exception]
        for fig in charts(at):
            over, missing = unmarked_mfu_points(fig)
            seen_over += over
            assert not missing, (
                f"{page} {run or overlay}: {fig['layout']['title']['text']}: MFU > 100% unmarked {missing[:3]}"
            )
    assert seen_over > 500, "the self-measured-peak run's MFU above 100% was checked, on every view"


def test_the_checker_catches_an_unmarked_point() -> None:
    fig = _decode(
        json.loads(
            compare_overlay(
                {"r": pl.DataFrame({"step": [0, 1], "x": [0.0, 1.0], "y": [0.5, 1.5]})},
                metric="mfu",
                x_axis="step",
            ).to_json()
        )
    )
    assert unmarked_mfu_points(fig) == (1, [])
    fig["data"] = [t for t in fig["data"] if t.get("name") != MFU_ARTEFACT]
    assert unmarked_mfu_points(fig) == (1, [(1.0, 150.0)])


def test_health_shows_the_peak_and_its_source_beside_mfu(mfu_store: Path, open_page) -> None:
    at = open_page("health", mfu_store, run=SELF_PEAK)
    assert not at.exception
    mfu = next(m for m in at.metric if m.label.startswith("MFU"))
    assert mfu.label == "MFU (artefact)" and float(mfu.value.rstrip("%")) > 100
    assert "measured: cpu matmul probe" in mfu.help
    cap = " ".join(c.value for c in at.caption)
    assert "self-measured by the run, not comparable" in cap and "measurement artefact" in cap
    perf = chart_titled(at, "Throughput, efficiency and memory")
    # the panel's title: the peak's size and kind; what kind of peak it is, in the MFU line's hover
    assert "MFU (%) of peak 16 GFLOP/s, self-measured" in _panel_titles(perf)
    assert "of peak 16 GFLOP/s, self-measured by the run, not comparable" in _mfu_hover(perf)
    # the metrics read tokens/s before MFU: tokens/s needs no peak
    labels = [m.label for m in at.metric]
    assert labels.index("tokens/s") < labels.index("MFU (artefact)")

    at = open_page("health", mfu_store, run=PINNED)
    cap = " ".join(c.value for c in at.caption)
    assert (
        "214 GFLOP/s, pinned (cpu-authenticamd-amd-epyc-f26-m2-2c fp32)" in cap
        and "configs/cpu_peaks.toml" in cap
    )
    # a pinned CPU peak's key (class, dtype) made the title outgrow its half-width panel, cut at the
    # left edge: the title says the peak and that it is pinned, the hover and caption say which
    perf = chart_titled(at, "Throughput, efficiency and memory")
    assert "MFU (%) of peak 214 GFLOP/s, pinned" in _panel_titles(perf)
    assert max(len(t) for t in _panel_titles(perf)) <= 40
    assert "of peak 214 GFLOP/s, pinned (cpu-authenticamd-amd-epyc-f26-m2-2c fp32)" in _mfu_hover(perf)
    at = open_page("health", mfu_store, run=synth.GUARDED)
    assert "989 TFLOP/s, datasheet (H100 SXM bf16 dense)" in " ".join(c.value for c in at.caption)


def _panel_titles(fig: dict) -> list[str]:
    return [a["text"] for a in fig["layout"]["annotations"]]


def _mfu_hover(fig: dict) -> str:
    return next(t["hovertemplate"] for t in fig["data"] if t.get("name") == "MFU")


def test_a_run_with_no_peak_reads_tokens_per_s(tmp_path: Path, open_page) -> None:
    env = {
        **CPU_ENV,
        "peak_flops": None,
        "peak_flops_source": "no pinned fp32 peak for CPU class cpu-x-2c in "
        "configs/cpu_peaks.toml: MFU not computed, tokens/s is the measure",
    }
    run = write_run(tmp_path, SynthRun(run_id="no-peak", steps=100, faults=[], env=env, peak_known=False))
    at = open_page("health", tmp_path, run=run.name)
    assert not at.exception
    assert next(m for m in at.metric if m.label == "MFU").value == "—"
    assert next(m for m in at.metric if m.label == "tokens/s").value != "—"
    perf = chart_titled(at, "Throughput, efficiency and memory")
    assert "MFU" not in {t["name"] for t in perf["data"]}
    assert any("no peak" in a["text"] for a in perf["layout"]["annotations"])


# ---- Runs page ------------------------------------------------------------------------------
def test_runs_table_has_peak_and_config_columns_and_no_empty_note(mfu_store: Path, open_page) -> None:
    at = open_page("runs", mfu_store)
    assert not at.exception
    df = at.dataframe[0].value
    cols = list(df.columns)
    for c in ("tokens/s", "MFU %", "MFU peak", "expert kernel"):
        assert c in cols, c
    # the same torch, attention and compile in every run: said once above the table, no column each
    every = next(c.value for c in at.caption if c.value.startswith("Every run: "))
    for c, v in (("torch", ENV_A["torch"]), ("attention", "flash"), ("compile", "default")):
        assert c not in cols and f"{c} **{v}**" in every, (c, every)
    assert "expert kernel" not in every, "kernels differ: a column"
    assert "note" not in cols, "every run is complete: no empty note column taking width"
    assert cols.index("tokens/s") < cols.index("MFU %") < cols.index("guard actions") < cols.index("MFU peak")
    assert "artefact" not in df.set_index("run").loc[PINNED]["MFU peak"]
    row = df.set_index("run").loc[SELF_PEAK]
    assert row["MFU %"] > 100 and row["MFU peak"] == "artefact · 16 GFLOP/s self"
    assert cols.index("expert kernel") < cols.index("tokens/s"), (
        "config before the wide columns: on screen at 1,600 px"
    )
    assert df.set_index("run").loc[PINNED]["MFU peak"] == "214 GFLOP/s pinned"
    assert df.set_index("run").loc[synth.GUARDED]["MFU peak"] == "989 TFLOP/s table"


# ---- Compare page ---------------------------------------------------------------------------
def test_compare_says_how_much_faster_b_is(mfu_store: Path, open_page) -> None:
    at = open_page("compare", mfu_store)
    at.multiselect(key="runs").set_value([synth.GUARDED, FAST]).run()
    at.selectbox(key="run_a").set_value(synth.GUARDED).run()
    at.selectbox(key="run_b").set_value(FAST).run()
    assert not at.exception
    text = " ".join(m.value for m in at.markdown)
    m = re.search(
        r"B \(fast-kernel\)\*\*: tokens/s \*\*([\d.]+)% higher\*\* than \*\*A \(guarded-faults\)", text
    )
    assert m, (text, messages(at), [type(e).__name__ for e in at.main])
    assert 8.0 < float(m.group(1)) < 12.0, "tokens/s is 10% higher by construction"
    assert "90% interval +" in text
    assert any("expert_kernel grouped_mm → bmm" in c.value for c in at.caption)
    at.selectbox(key="run_a").set_value(FAST).run()
    at.selectbox(key="run_b").set_value(synth.GUARDED).run()
    assert "% lower** than **A (fast-kernel)" in " ".join(m.value for m in at.markdown)
    # config columns and the profiler trace, per run
    table = at.dataframe[0].value.set_index("run")
    for c in ("torch", "attention", "expert kernel", "compile", "MFU peak", "tokens/s p50"):
        assert c in table.columns, c
    assert table.loc[FAST, "profiler trace"] == "host_1.123.pt.trace.json"
    assert not isinstance(table.loc[synth.GUARDED, "profiler trace"], str)  # none: an empty cell
    buttons = at.get("download_button")
    assert len(buttons) == 1 and "fast-kernel: trace" in buttons[0].proto.label


def test_compare_overlay_any_metric_on_steps_tokens_or_wall_time(mfu_store: Path, open_page) -> None:
    at = open_page("compare", mfu_store)
    at.multiselect(key="runs").set_value([synth.GUARDED, FAST]).run()
    at.selectbox(key="metric").set_value("loss").run()
    at.select_slider(key="smooth").set_value(1).run()
    fig = chart_titled(at, "Loss (nats/token) by step, runs overlaid")
    assert max(traces(fig, FAST)[0]["x"]) == 599
    at.segmented_control(key="x_axis").set_value("tokens").run()
    fig = chart_titled(at, "Loss (nats/token) by tokens consumed")
    assert max(traces(fig, FAST)[0]["x"]) == 600 * 65536
    at.segmented_control(key="x_axis").set_value("wall time").run()
    fig = chart_titled(at, "Loss (nats/token) by wall time since the first step (min)")
    assert max(traces(fig, FAST)[0]["x"]) == pytest.approx(599 * 0.8 / 60)
    raw = np.nanstd(np.diff(np.asarray(traces(fig, FAST)[0]["y"], dtype=float)))
    at.select_slider(key="smooth").set_value(25).run()
    fig = chart_titled(
        at, "Loss (nats/token) by wall time since the first step (min), runs overlaid, rolling median"
    )
    assert np.nanstd(np.diff(np.asarray(traces(fig, FAST)[0]["y"], dtype=float))) < raw / 2
    assert not at.exception

    # the unit follows the longest run: 8 min here; seconds under 2 min, hours past 2 h
    assert compare.wall_unit(599 * 0.8 / 60) == ("min", 1.0)
    assert compare.wall_unit(80 * 0.02 / 60) == ("s", 60.0) and compare.wall_unit(600)[0] == "h"
    short = compare_overlay(
        {"r": pl.DataFrame({"step": [0, 1], "x": [0.0, 0.025], "y": [1.0, 2.0]})},
        metric="loss",
        x_axis="wall",
    )
    assert short.layout.xaxis.title.text == "wall time since the first step (s)"
    assert list(short.data[0].x) == pytest.approx([0.0, 1.5])


def test_speedup_interval_and_no_clear_difference() -> None:
    rng = np.random.default_rng(0)
    a = 1000 * (1 + 0.03 * rng.standard_normal(400))
    b = 1000 * (1 + 0.03 * rng.standard_normal(400))
    r = compare.speedup(a, b)
    assert r is not None and r["lo"] < 0 < r["hi"]
    assert compare.speedup_sentence("A", "B", r).startswith("No clear difference")
    r = compare.speedup(a, a * 1.055)
    assert r is not None and r["pct"] == pytest.approx(5.5) and 0 < r["lo"] < 5.5 < r["hi"]
    said = compare.speedup_sentence("A", "B", r)
    assert "**B**: tokens/s **5.5% higher** than **A**" in said
    assert "not in that interval" in said and "moeguard canary --ab" in said  # no claim past what it knows
    assert compare.speedup(a[:5], b) is None


# ---- Canaries page --------------------------------------------------------------------------
def _entry(n: int, mfu: float, *, baseline: bool, prof: dict[str, float] | None = None) -> dict[str, Any]:
    return {
        "time": 1_760_000_000 + 3600 * n,
        "git_sha": f"{n:07x}",
        "torch": "2.13.0",
        "fingerprint": "fp",
        "config": "canary.toml",
        "mfu_p50": mfu,
        "tokens_per_s_p50": 1e4 * mfu,
        "verdict": "pass",
        "baseline": baseline,
        "profile_top": prof,
    }


BASE_PROF = {"aten::bmm": 12.9, "aten::mm": 8.4, "aten::mul": 3.7, "aten::silu": 1.9, "aten::flash_attn": 0.6}


def test_judged_entry_is_not_in_its_own_baseline(tmp_path: Path, mfu_store: Path, open_page) -> None:
    hist = tmp_path / "h.jsonl"
    rows = [_entry(0, 0.40, baseline=True), _entry(1, 0.38, baseline=True), _entry(2, 0.30, baseline=True)]
    hist.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    df, _ = canaries.parse_canary_history(hist.read_text())
    gate = canaries.canary_gate(df, warn_pct=5, fail_pct=10)
    assert gate["baseline"] == pytest.approx(0.39) and gate["n_baseline"] == 2  # not median(0.40, 0.38, 0.30)
    assert canaries.canary_deltas(df).to_list()[0] is None  # the first entry has nothing before it
    assert canaries.canary_deltas(df)[2] == pytest.approx(100 * (0.30 / 0.39 - 1))
    at = open_page("canaries", mfu_store, history=hist)
    assert not at.exception
    latest = next(m for m in at.metric if m.label == "latest MFU p50")
    assert latest.delta == "-23.1% vs baseline"


def test_the_page_and_the_gate_pick_the_same_baseline() -> None:
    """One baseline rule (guard.canary.history): baseline entries only, with the judged entry's
    fingerprint AND config hash, the last history_window of them, recorded before it."""
    rows = [{**_entry(i, 0.40 + 0.001 * i, baseline=True), "config_hash": "a"} for i in range(12)]
    rows.insert(9, {**_entry(90, 0.10, baseline=True), "config_hash": "b"})  # another config: never in
    rows.insert(10, {**_entry(91, 0.90, baseline=False), "config_hash": "a"})  # a trend entry: never in
    rows.append({**_entry(50, 0.30, baseline=False), "config_hash": "a"})  # the judged entry
    text = "\n".join(json.dumps(r) for r in rows) + "\n"
    entries, _ = history.parse_history(text)
    want = history.select_baseline(entries[:-1], "fp", "a", canaries.CANARY_WINDOW)
    assert len(want) == canaries.CANARY_WINDOW and all(
        e["config_hash"] == "a" and e["baseline"] for e in want
    )
    df, _ = canaries.parse_canary_history(text)
    got = canaries.canary_baseline_rows(df, int(df["n"][-1]))
    assert got["git_sha"].to_list() == [e["git_sha"] for e in want]
    base = statistics.median(e["mfu_p50"] for e in want)
    assert canaries.canary_gate(df, warn_pct=2, fail_pct=3)["baseline"] == pytest.approx(base)
    assert canaries.canary_deltas(df)[-1] == pytest.approx(100 * (0.30 / base - 1))


def test_uniform_slowdown_blames_no_single_kernel() -> None:
    rng = np.random.default_rng(1)
    slow = {op: ms * 1.3 * (1 + 0.02 * rng.standard_normal()) for op, ms in BASE_PROF.items()}
    k = canaries.kernel_deltas(slow, [BASE_PROF, BASE_PROF])
    assert (k["raw change %"] > 24).all(), "every op is slower in raw time"
    assert (k["vs overall %"].abs() < 6).all() and (k["share change (pts)"].abs() < 1).all(), k
    silu = dict(BASE_PROF, **{"aten::silu": 1.9 * 4})  # one op really regressed
    k = canaries.kernel_deltas(silu, [BASE_PROF])
    assert k["op"][0] == "aten::silu" and k["vs overall %"][0] > 150


def test_canaries_page_top_kernels_table(tmp_path: Path, mfu_store: Path, open_page) -> None:
    hist = tmp_path / "h.jsonl"
    slow = {op: ms * 1.3 for op, ms in BASE_PROF.items()}
    rows = [_entry(i, 0.40, baseline=True, prof=BASE_PROF) for i in range(3)] + [
        _entry(3, 0.31, baseline=False, prof=slow)
    ]
    hist.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    at = open_page("canaries", mfu_store, history=hist)
    assert not at.exception, messages(at)
    kern = at.dataframe[-1].value
    assert set(kern["op"]) == set(BASE_PROF)
    assert kern["raw change %"].min() > 29 and kern["vs overall %"].abs().max() < 0.01
    assert any("+30.0% overall" in c.value for c in at.caption)


def test_a_cpu_history_names_its_measure_cpu_efficiency(tmp_path: Path, mfu_store: Path, open_page) -> None:
    """On a CPU class the canary gates a CPU efficiency (against a reference matmul), as the CLI and
    canary.md call it; the Canaries page names it so too, never "MFU"."""
    hist = tmp_path / "h.jsonl"
    cpu = "AMD EPYC (AuthenticAMD/25/1/1) x2cpu 24GiB|cpu:x86_64:1threads|ws1|fp32 | cfg 3c3aa24e00"
    rows = [{**_entry(i, 0.40, baseline=True), "fingerprint": cpu} for i in range(3)]
    hist.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    at = open_page("canaries", mfu_store, history=hist)
    assert not at.exception
    labels = [m.label for m in at.metric]
    assert "latest CPU efficiency p50" in labels and not any("MFU" in label for label in labels)


def test_the_mfu_caption_says_what_is_divided_by_what(tmp_path: Path, open_page) -> None:
    """Issue #40: a Trainer run's MFU (22.7%) next to a `moeguard train` run's (~5%) on the same
    pinned peak; both right (a 9x bigger model per token), and the caption says what was counted."""
    peak = mfu_peak.run_peak(PINNED_ENV)
    text = mfu_peak.formula(1781760.0, 1, peak)
    assert "MFU = 1.78 MFLOP/token (analytic" in text and "x 1 rank)" in text
    assert (
        "214 GFLOP/s, pinned" in text
        and "between runs of different models it does not compare the loops" in text
    )
    assert "not recorded" in mfu_peak.formula(None, 2, peak) and "x 2 ranks" in mfu_peak.formula(
        None, 2, peak
    )
    run = write_run(tmp_path, SynthRun(run_id="counted", steps=60, faults=[], env=PINNED_ENV, mfu=0.2))
    meta = json.loads((run / "meta.json").read_text())
    (run / "meta.json").write_text(json.dumps({**meta, "flops_per_token": 1781760.0}))
    at = open_page("health", tmp_path, run=run.name)
    assert not at.exception
    assert any(c.value.startswith("MFU = 1.78 MFLOP/token (analytic") for c in at.caption)
