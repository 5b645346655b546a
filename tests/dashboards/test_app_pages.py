"""Every page of the app under streamlit's AppTest, over the synthetic run store.

What the user must see is asserted on what the browser would receive: the plotly figure JSON
(marks per guard action, with the evidence in the hover text), the dataframes, the messages.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import polars as pl
import pytest
from app_helpers import chart_titled, charts, messages, traces

from dashboards import ui
from guard.core import schema
from guard.store.reader import read_table
from tests.dashboards import synth_store as synth
from tests.dashboards.synth_run import SynthRun, write_run

HEALTH_TITLE = "Loss and grad norm with guard verdicts and actions"


def no_exception(at) -> None:
    assert not at.exception, [e.value for e in at.exception]


def statuses(df) -> dict[str, str]:
    """run -> status, from the runs table's status pills (a one-item list per row)."""
    out = {}
    for run, pills in zip(df["run"], df["status"], strict=True):
        assert len(pills) == 1, (run, pills)
        out[run] = pills[0]
    return out


def test_runs_page_says_how_each_run_ended(store: Path, open_page) -> None:
    """preempted / interrupted / finished_nonfinite have their own pill colour and words, a count
    each, and the trainer's status_note in the note column; a NaN-ended run is never green."""
    at = open_page("runs", store)
    no_exception(at)
    df = at.dataframe[0].value
    cell = dict(zip(df["run"], df["note"], strict=True))
    # the note cell is clipped to fit the table at 1,600 px; its full text is under the table
    endings = next(m.value for m in at.markdown if m.value.startswith("- :"))
    lines = {ln.split("`")[1]: ln for ln in endings.splitlines()}
    note = {run: lines[run].split("`: ", 1)[1] if run in lines else c for run, c in cell.items()}
    for run, c in cell.items():
        assert len(c) <= ui.NOTE_CELL_CHARS, (run, c)
        assert note[run].startswith(c.removesuffix("…")), (run, c, note[run])
    assert cell[synth.PREEMPTED].endswith("…") and "SIGTERM" in cell[synth.PREEMPTED]
    assert "SIGTERM" in note[synth.PREEMPTED] and "--resume" in note[synth.PREEMPTED]
    assert "Ctrl-C" in note[synth.INTERRUPTED]
    assert "non-finite from step 260" in note[synth.NONFINITE] and "not usable" in note[synth.NONFINITE]
    assert "halted at step 250" in note[synth.HALTED] and "RuntimeError" in note[synth.CRASHED]
    assert note[synth.GUARDED] == "" and "meta.json only" in note[synth.META_ONLY]
    opts = json.loads(at.dataframe[0].proto.columns)["status"]["type_config"]["options"]
    colors = {o["value"]: o["color"] for o in opts}
    assert colors[schema.STATUS_FINISHED] == "green"
    assert colors[schema.STATUS_FINISHED_NONFINITE] == "red"
    assert colors[schema.STATUS_PREEMPTED] != colors[schema.STATUS_INTERRUPTED]
    assert {o["value"]: o["label"] for o in opts}[schema.STATUS_FINISHED_NONFINITE] == "finished, non-finite"
    # one badge per status above the table, with its count, in the same colours
    badges = " ".join(m.value for m in at.markdown if "-badge[" in m.value)
    assert ":red-badge[:material/dangerous: 1 finished, non-finite]" in badges
    assert ":violet-badge[:material/pause_circle: 1 preempted]" in badges
    assert ":orange-badge[:material/cancel: 1 interrupted]" in badges
    n_finished = sum(1 for v in statuses(df).values() if v == schema.STATUS_FINISHED)
    assert f":green-badge[:material/check_circle: {n_finished} finished]" in badges
    # and under the table, on screen, one line per run that did not end cleanly, in its words,
    # and one per run whose note did not fit its cell
    assert set(lines) == {
        synth.PREEMPTED,
        synth.INTERRUPTED,
        synth.NONFINITE,
        synth.HALTED,
        synth.CRASHED,
        synth.STALE,
        *(run for run, c in cell.items() if c.endswith("…")),
    }
    assert (
        lines[synth.NONFINITE].startswith("- :red-badge[")
        and "non-finite from step 260" in lines[synth.NONFINITE]
    )
    assert "SIGTERM" in lines[synth.PREEMPTED] and "nothing was written for a while" in lines[synth.STALE]


# ---- runs -----------------------------------------------------------------------------
def test_runs_page_lists_every_run_with_status(store: Path, open_page) -> None:
    at = open_page("runs", store)
    no_exception(at)
    df = at.dataframe[0].value
    assert set(df["run"]) == {
        synth.GUARDED,
        synth.UNGUARDED,
        synth.HALTED,
        synth.CRASHED,
        synth.LIVE,
        synth.STALE,
        synth.META_ONLY,
        synth.NO_LAYERS,
        synth.OLD_SCHEMA,
        synth.NEW_SCHEMA,
        synth.PREEMPTED,
        synth.INTERRUPTED,
        synth.NONFINITE,
    }
    status = statuses(df)
    assert status[synth.GUARDED] == schema.STATUS_FINISHED
    assert status[synth.HALTED] == schema.STATUS_HALTED
    assert status[synth.CRASHED] == schema.STATUS_CRASHED
    assert status[synth.LIVE] == schema.STATUS_RUNNING
    assert status[synth.STALE] == schema.STATUS_STALE
    assert status[synth.PREEMPTED] == schema.STATUS_PREEMPTED
    assert status[synth.INTERRUPTED] == schema.STATUS_INTERRUPTED
    assert status[synth.NONFINITE] == schema.STATUS_FINISHED_NONFINITE
    row = df[df["run"] == synth.GUARDED].iloc[0]
    assert row["steps"] == 600 and row["guard actions"] == 8 and row["verdicts"] == 7
    assert 35 < row["MFU %"] < 50 and row["tokens/s"] > 0
    assert (row["torch"], row["attention"], row["expert kernel"]) == ("2.9.1+cu128", "flash", "grouped_mm")
    unguarded = df[df["run"] == synth.UNGUARDED].iloc[0]
    assert unguarded["guard actions"] == 0 and unguarded["verdicts"] == 7
    msgs = " ".join(messages(at))
    assert "newer moeguard" in msgs and "older run-store schema" in msgs and "no steps on disk yet" in msgs
    assert "open alerts" not in df.columns  # no --collector given


def test_runs_table_name_links_to_health_and_labels_are_short(store: Path, open_page) -> None:
    """Issue #17: the Runs table fits 1,600 px (the browser check is in test_screenshots.py): the
    run's name is its health page's link (no separate "open" column), labels are short, the
    status column is as wide as its longest pill, not a fixed 150 px."""
    at = open_page("runs", store)
    no_exception(at)
    el = at.dataframe[0]
    df, cols, order = el.value, json.loads(el.proto.columns), list(el.proto.column_order)
    assert order[0] == "health" and "run" not in order, order
    link = cols["health"]
    assert link["label"] == "run" and link["pinned"] and link["type_config"]["type"] == "link"
    shown = [re.fullmatch(link["type_config"]["display_text"], url).group(1) for url in df["health"]]
    assert shown == list(df["run"])
    assert link["width"] >= 6 * max(len(r) for r in df["run"]), "no run id clipped"
    labels = {c: cols[c].get("label") for c in ("attention", "expert kernel", "guard actions", "last update")}
    assert labels == {
        "attention": "attn",
        "expert kernel": "kernel",
        "guard actions": "actions",
        "last update": "updated",
    }
    assert cols["status"]["width"] == ui.pill_width(["finished, non-finite"]) < 150


def test_runs_page_stale_threshold_is_a_sidebar_setting(store: Path, open_page) -> None:
    at = open_page("runs", store)
    at.sidebar.number_input(key="stale_after_s").set_value(100_000).run()
    no_exception(at)
    df = at.dataframe[0].value
    assert statuses(df)[synth.STALE] == schema.STATUS_RUNNING


# ---- run health -----------------------------------------------------------------------
@pytest.mark.parametrize(
    ("run", "level", "color", "words"),
    [
        (synth.NONFINITE, "error", "red", ["finished, non-finite", "not usable", "non-finite from step 260"]),
        (synth.PREEMPTED, "info", "violet", ["preempted", "SIGTERM", "step-000000212", "--resume"]),
        (synth.INTERRUPTED, "warning", "orange", ["interrupted", "Ctrl-C", "none yet"]),
        (synth.HALTED, "error", "red", ["halted", "halted at step 250", "3 non-finite steps in a row"]),
        (synth.CRASHED, "error", "red", ["crashed", "RuntimeError: injected crash at step 150"]),
    ],
)
def test_health_says_how_the_run_ended(
    store: Path, open_page, run: str, level: str, color: str, words: list[str]
) -> None:
    at = open_page("health", store, run=run)
    no_exception(at)
    said = [e.value for e in getattr(at, level)]
    assert any(all(w in m for w in words) for m in said), said
    badges = [m.value for m in at.markdown if "-badge[" in m.value]
    assert badges and badges[0].startswith(f":{color}-badge["), badges
    if run == synth.NONFINITE:  # never green, never a success
        assert not at.success and not any(":green-badge[" in b for b in badges)
        assert at.metric[1].value == "non-finite"  # the loss headline
        # the NaN steps have no point on the lines: a tick pinned to the top of each panel says
        # where they are, so the run does not look as if it stopped at step 260
        nf = traces(chart_titled(at, HEALTH_TITLE), "non-finite step")
        assert len(nf) == 2 and all(set(t["x"]) == set(range(260, 400)) for t in nf)


def test_health_of_a_finished_run_says_nothing_extra(store: Path, open_page) -> None:
    at = open_page("health", store, run=synth.GUARDED)
    no_exception(at)
    assert not at.error and not at.warning
    assert [m.value for m in at.markdown if "-badge[" in m.value][0].startswith(":green-badge[")


def test_health_marks_every_guard_action_with_its_evidence(store: Path, open_page) -> None:
    at = open_page("health", store, run=synth.GUARDED)
    no_exception(at)
    assert at.selectbox(key="run").value == synth.GUARDED
    fig = chart_titled(at, HEALTH_TITLE)
    expected = {
        schema.ACT_SKIP: {100, 240, 420},
        schema.ACT_ROLLBACK: {180},
        schema.ACT_BIAS_CORRECT: {300, 360},
        schema.ACT_LR_COOLDOWN: {425},
    }
    symbols = set()
    for action, steps in expected.items():
        tr = traces(fig, f"action: {action}")
        assert len(tr) == 2, f"{action}: a mark on the loss and on the grad-norm panel"
        for t in tr:
            assert set(t["x"]) == steps, action
            assert all(y is not None for y in t["y"]), f"{action}: every mark has a position"
        symbols.add(tr[0]["marker"]["symbol"])
        hover = " ".join(tr[0]["hovertext"])
        assert action.upper() in hover
    assert len(symbols) == len(expected), "each action has its own marker"
    skip_hover = " ".join(traces(fig, "action: skip")[0]["hovertext"])
    assert (
        "grad_norm_spike" in skip_hover
        and "z: 61.2" in skip_hover
        and "value 84 vs threshold 9.1" in skip_hover
    )
    assert "nonfinite" in skip_hover and "non-finite at this step" in skip_hover
    rollback_hover = traces(fig, "action: rollback")[0]["hovertext"][0]
    assert "rollback_to: 150" in rollback_hover and "skip_window: [150, 180]" in rollback_hover
    # every verdict is on the timeline, in its detector's lane
    verdicts = traces(fig, "event: verdict")[0]
    lanes = dict(zip(verdicts["x"], verdicts["y"], strict=True))
    assert lanes[100] == schema.DET_GRAD_SPIKE and lanes[180] == schema.DET_LOSS_SPIKE
    assert lanes[240] == schema.DET_NONFINITE and lanes[300] == schema.DET_MAXVIO
    assert lanes[360] == schema.DET_DEAD_EXPERTS
    assert any("layer: 2" in h for h in verdicts["hovertext"])
    # the events table shows them too, evidence included
    ev = at.dataframe[0].value
    assert {schema.ACT_SKIP, schema.ACT_ROLLBACK, schema.ACT_BIAS_CORRECT, schema.ACT_LR_COOLDOWN} <= set(
        ev["action"]
    )
    assert {
        schema.DET_GRAD_SPIKE,
        schema.DET_LOSS_SPIKE,
        schema.DET_NONFINITE,
        schema.DET_MAXVIO,
        schema.DET_DEAD_EXPERTS,
    } <= set(ev["detector"])
    assert ev["evidence"].str.contains("rollback_to=150").any()
    assert ev["evidence"].str.contains("dead=\\[0, 3, 6\\]").any()


def test_health_shows_every_section(store: Path, open_page) -> None:
    at = open_page("health", store, run=synth.GUARDED)
    no_exception(at)
    titles = [str(f["layout"]["title"]["text"]) for f in charts(at)]
    for prefix in (
        HEALTH_TITLE,
        "Per-layer grad norm",
        "MaxVio per layer",
        "Dead experts per layer",
        "Router entropy per layer",
        "Layer 1: load share per expert over time",
        "Current load share",
        "Throughput, efficiency and memory",
    ):
        assert any(t.startswith(prefix) for t in titles), (prefix, titles)
    dead = chart_titled(at, "Dead experts per layer")["data"][0]
    layer_row = dead["y"].index(1)
    assert max(v for v in dead["z"][layer_row] if v is not None) == 3, "the 3 dead experts of layer 1"
    gn = chart_titled(at, "Per-layer grad norm")
    bad = traces(gn, "non-finite grad norm")[0]
    # where the NaN at step 240 came from: the column of steps 240..241 (600 steps, 2 a column), drawn
    # at its centre (issue #40: a column covers its steps on the page's one step axis)
    assert list(zip(bad["customdata"], bad["y"], strict=True)) == [(240, 2)], bad
    assert bad["x"] == [240.5] and "steps %{customdata}..+1" in bad["hovertemplate"]
    perf = chart_titled(at, "Throughput, efficiency and memory")
    assert {t["name"] for t in perf["data"]} == {"MFU", "tokens/s", "step time", "data wait", "peak memory"}
    for f in charts(at):  # every chart is labelled
        lay = f["layout"]
        axes = [k for k in lay if k.startswith(("xaxis", "yaxis"))]
        assert any(lay[a].get("title", {}).get("text") for a in axes), lay["title"]["text"]
    # other layer in the expert selector re-renders without error
    at.selectbox(key="expert_layer").set_value(2).run()
    no_exception(at)
    assert chart_titled(at, "Layer 2: load share per expert over time")


def test_health_unguarded_run_has_verdicts_but_no_actions(store: Path, open_page) -> None:
    at = open_page("health", store, run=synth.UNGUARDED)
    no_exception(at)
    fig = chart_titled(at, HEALTH_TITLE)
    assert not [t for t in fig["data"] if str(t.get("name", "")).startswith("action: ")]
    assert len(traces(fig, "event: verdict")[0]["x"]) == 7


def test_health_halted_run_says_so(store: Path, open_page) -> None:
    at = open_page("health", store, run=synth.HALTED)
    no_exception(at)
    errors = [e.value for e in at.error]
    assert len(errors) == 1 and "halted at step 250" in errors[0], "said once, with the trainer's note"
    fig = chart_titled(at, HEALTH_TITLE)
    assert traces(fig, "action: halt")[0]["x"] == [250]
    assert traces(fig, "event: halt")


@pytest.mark.parametrize(
    ("run", "level", "text"),
    [
        (synth.META_ONLY, "info", "no steps on disk yet"),
        (synth.NEW_SCHEMA, "warning", "newer moeguard"),
        (synth.OLD_SCHEMA, "info", "older run-store schema"),
        (synth.NO_LAYERS, "info", "no `layers` table"),
    ],
)
def test_health_partial_runs_explain_themselves(
    store: Path, open_page, run: str, level: str, text: str
) -> None:
    at = open_page("health", store, run=run)
    no_exception(at)
    assert any(text in e.value for e in getattr(at, level)), messages(at)
    if run in (synth.META_ONLY, synth.NEW_SCHEMA):
        assert not charts(at)
    else:
        assert chart_titled(at, HEALTH_TITLE)


def test_health_old_schema_reads_what_exists(store: Path, open_page) -> None:
    at = open_page("health", store, run=synth.OLD_SCHEMA)
    no_exception(at)
    assert any("mfu, mem_peak_bytes" in c.value for c in at.caption)
    perf = chart_titled(at, "Throughput, efficiency and memory")
    assert "MFU" not in {t["name"] for t in perf["data"]}
    assert traces(chart_titled(at, HEALTH_TITLE), "action: skip")


# ---- compare --------------------------------------------------------------------------
@pytest.mark.parametrize("group", ["torch", "attention backend", "expert kernel", "compile mode", "run"])
def test_compare_groups_by_environment(store: Path, open_page, group: str) -> None:
    at = open_page("compare", store)
    at.multiselect(key="runs").set_value([synth.GUARDED, synth.UNGUARDED, synth.STALE]).run()
    at.segmented_control(key="group_by").set_value(group).run()
    no_exception(at)
    curves = chart_titled(at, "Throughput (tokens/s) by step, runs overlaid")
    assert {t["name"] for t in curves["data"]} == {synth.GUARDED, synth.UNGUARDED, synth.STALE}
    dist = chart_titled(at, "Steady-state MFU and throughput by")
    groups = {t["name"] for t in dist["data"]}
    expected = {
        "torch": {"2.9.1+cu128", "2.10.0+cu128"},
        "attention backend": {"flash", "math"},
        "expert kernel": {"grouped_mm", "for_loop"},
        "compile mode": {"default", "none", "max-autotune"},
        "run": {synth.GUARDED, synth.UNGUARDED, synth.STALE},
    }[group]
    assert groups == expected
    assert all(t["type"] == "violin" for t in dist["data"])
    # each violin scaled on its own: linked by name (plotly's default), the tokens/s ones were
    # drawn at the MFU ones' density scale, as hairlines
    assert len({t["scalegroup"] for t in dist["data"]}) == len(dist["data"])
    diff = at.dataframe[-1].value
    keys = set(diff["key"])
    assert {
        "env.torch",
        "env.attention_backend",
        "env.expert_kernel",
        "env.compile",
        "config.guard.enabled",
    } <= keys
    assert "env.device" not in keys and "env.dtype" not in keys, "only keys that differ"


def test_compare_with_nothing_readable(tmp_path: Path, open_page) -> None:
    root = tmp_path / "runs"
    root.mkdir()
    write_run(root, SynthRun(run_id="only", steps=30, faults=[]))
    synth.set_meta(root / "only", schema_version=99)
    at = open_page("compare", root)
    no_exception(at)
    assert any("No run has readable steps" in m for m in messages(at))


# ---- canaries -------------------------------------------------------------------------
def test_canaries_chart_has_gate_band_and_failures(store: Path, history: Path, open_page) -> None:
    at = open_page("canaries", store, history=history)
    no_exception(at)
    fig = chart_titled(at, "Canary MFU history")
    fails = traces(fig, "canary: fail")[0]
    assert len(fails["x"]) == 4 and fails["marker"]["symbol"] == "x"
    assert len(traces(fig, "canary: warn")[0]["x"]) == 1
    base = traces(fig, "baseline median")[0]["y"][0]
    warn = traces(fig, "warn threshold")[0]["y"][0]
    fail = traces(fig, "fail threshold")[0]["y"][0]
    assert warn == pytest.approx(base * 0.95) and fail == pytest.approx(base * 0.90)
    assert any(s["type"] == "rect" for s in fig["layout"]["shapes"]), "the band"
    assert any("torch 2.10.0+cu128" in a.get("text", "") for a in fig["layout"]["annotations"])
    assert any("line 9: not JSON" in w.value for w in at.warning)
    assert len(at.dataframe[0].value) == 30


def test_canaries_without_history(store: Path, tmp_path: Path, open_page) -> None:
    at = open_page("canaries", store)
    no_exception(at)
    assert any("No canary history given" in i.value for i in at.info)
    at = open_page("canaries", store, history=tmp_path / "missing.jsonl")
    no_exception(at)
    assert any("does not exist yet" in w.value for w in at.warning)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    at = open_page("canaries", store, history=empty)
    no_exception(at)
    assert any("no canary entries" in i.value for i in at.info)


# ---- empty / missing run folders ------------------------------------------------------
@pytest.mark.parametrize("page", ["runs", "health", "compare"])
def test_empty_runs_folder_is_explained(tmp_path: Path, open_page, page: str) -> None:
    (tmp_path / "runs").mkdir()
    (tmp_path / "runs" / "junk").mkdir()
    at = open_page(page, tmp_path / "runs")
    no_exception(at)
    assert any("No runs in" in i.value and "junk" in i.value for i in at.info), messages(at)


@pytest.mark.parametrize("page", ["runs", "health", "compare"])
def test_missing_runs_folder_is_explained(tmp_path: Path, open_page, page: str) -> None:
    at = open_page(page, tmp_path / "nope")
    no_exception(at)
    assert any("does not exist" in w.value for w in at.warning)


def test_unreadable_meta_json(tmp_path: Path, open_page) -> None:
    root = tmp_path / "runs"
    write_run(root, SynthRun(run_id="torn", steps=30, faults=[]))
    (root / "torn" / "meta.json").write_text("{ half a json")
    at = open_page("health", root, run="torn")
    no_exception(at)
    assert any("could not be parsed" in w.value for w in at.warning)
    at = open_page("runs", root)
    no_exception(at)


# ---- real trainer runs (the seam: point MOEGUARD_REAL_RUNS at a run store) ------------------
@pytest.mark.skipif(
    not os.environ.get("MOEGUARD_REAL_RUNS"), reason="set MOEGUARD_REAL_RUNS to a trainer run store"
)
@pytest.mark.parametrize("page", ["runs", "health", "compare"])
def test_pages_on_real_trainer_runs(open_page, page: str) -> None:
    root = Path(os.environ["MOEGUARD_REAL_RUNS"])
    runs = sorted(p.name for p in root.iterdir() if (p / "meta.json").is_file())
    assert runs, f"no runs under {root}"
    for run in runs if page == "health" else [None]:
        at = open_page(page, root, run=run)
        no_exception(at)
        if page == "health" and charts(at):
            assert chart_titled(at, HEALTH_TITLE)


# ---- a real trainer run, end to end ---------------------------------------------------------
@pytest.mark.slow
@pytest.mark.integration
def test_trainer_drill_shows_up_on_the_health_page(tmp_path: Path, open_page) -> None:
    """`moeguard train` with an injected grad spike -> run store -> the skip is marked, with its
    evidence, on the health page. The trainer's own files, no synthetic writer involved."""
    pytest.importorskip("trainer.cli")
    import torch

    from guard.cli import main

    root = Path(__file__).resolve().parents[2]
    runs = tmp_path / "runs"
    # the CLI's own entry point in this process (its exit code is what a subprocess would return;
    # the interpreter's and torch's start-up are not what this test is about); the tiny config's
    # guard (its fixed 20x early spike cap flags the 50x spike at 40; with no grad clip of the run's
    # own to bound it, the default skips it) on a model shrunk to the micro config's widths: the
    # page reads the run store, whatever the model's size
    threads = torch.get_num_threads()
    try:
        code = main(
            ["train", "--config", str(root / "configs" / "tiny.toml"), "--steps", "45",
             "--run-dir", str(runs / "drill"), "--no-progress", "--inject", "gradspike@40:50",
             "--set", "data.batch_size=2", "--set", "data.seq_len=32", "--set", "model.d_model=32",
             "--set", "model.d_expert=32", "--set", "model.n_layers=2", "--set", "model.max_seq_len=32",
             "--set", "train.threads=1", "--set", "optim.grad_clip=0"]
        )  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    assert code == 0, f"moeguard train: exit {code}"
    at = open_page("health", runs, run="drill")
    no_exception(at)
    fig = chart_titled(at, HEALTH_TITLE)
    skip = traces(fig, "action: skip")
    assert skip and 40 in skip[0]["x"], "the injected spike was skipped and is marked"
    assert "grad_norm_spike" in " ".join(skip[0]["hovertext"])
    ev = at.dataframe[0].value
    assert ((ev["step"] == 40) & (ev["action"] == schema.ACT_SKIP)).any()
    runs_page = open_page("runs", runs)
    no_exception(runs_page)
    row = runs_page.dataframe[0].value.iloc[0]
    # the listing counts the run store's actions: the injected skip, and whatever natural spike this
    # interpreter's stdlib corpus gave the tiny model (none on the corpus the drill was first run on)
    acted = read_table(runs / "drill", "steps").filter(pl.col("action") != schema.ACT_APPLY)
    assert 40 in acted["step"].to_list()
    assert (
        list(row["status"]) == [schema.STATUS_FINISHED]
        and row["steps"] == 45
        and row["guard actions"] == acted.height
    ), (row.to_dict(), acted.select("step", "action").rows())
