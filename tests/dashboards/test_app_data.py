"""The app's data module and launcher, without Streamlit's runner: downsampling keeps spikes,
marks merge a verdict with its action, schema drift reads as nulls, the canary reader takes
the canary's JSONL, and `moeguard app` builds the right command."""

from __future__ import annotations

import argparse
import json
import math
import os
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import numpy as np
import polars as pl
import pytest

from dashboards import launch
from dashboards.data import (
    canaries,
    compare,
    config,
    guard_events,
    heatmaps,
    loaders,
    open_alerts,
    runs,
    shaping,
)
from dashboards.data import status as run_status
from guard.cli import main as cli_main
from guard.core import schema
from guard.store import reader
from tests.dashboards import synth_store as synth
from tests.dashboards.synth_run import SynthRun, write_run


def test_downsample_keeps_spikes_nans_and_event_steps() -> None:
    n = 100_000
    y = np.sin(np.arange(n) / 500.0)
    y[31_337] = 50.0  # one-step spike
    y[77_001] = float("nan")
    y[5] = -9.0
    df = pl.DataFrame({"step": np.arange(n), "loss": y})
    out = shaping.downsample(df, "loss", max_points=2000, keep_steps=[12_345, 99_999])
    assert out.height <= 2000 + 3
    steps = set(out["step"].to_list())
    assert {31_337, 77_001, 5, 12_345, 99_999, 0} <= steps
    assert out["step"].is_sorted()
    small = df.head(500)
    assert shaping.downsample(small, "loss", max_points=2000).height == 500


def test_action_marks_merge_verdict_and_action_and_pin_nonfinite() -> None:
    steps = pl.DataFrame(
        {"step": [1, 2, 3], "loss": [3.0, float("nan"), 2.0], "grad_norm": [1.0, float("nan"), 9.0]}
    )
    ev = pl.DataFrame(
        {
            "step": [2, 2, 3, 3, 3],
            "time": [0.0] * 5,
            "kind": ["verdict", "action", "verdict", "action", "inject"],
            "detector": ["nonfinite", "nonfinite", "maxvio", "maxvio", ""],
            "value": [math.nan, math.nan, 3.0, 3.0, math.nan],
            "threshold": [math.nan, math.nan, 1.5, 1.5, math.nan],
            "action": ["skip", "skip", "bias_correct", "bias_correct", "none"],
            "detail": [json.dumps({"where": "loss"}), "{}", json.dumps({"layer": 4}), "{}", "{}"],
        }
    )
    marks = guard_events.action_marks(ev, steps)
    assert marks.select("step", "action").rows() == [(2, "skip"), (3, "bias_correct")]
    skip = marks.row(0, named=True)
    assert skip["nonfinite"] and skip["y_loss"] == 3.0 and skip["y_grad_norm"] == 9.0  # pinned to finite max
    assert "where: loss" in skip["hover"] and "value non-finite" in skip["hover"]
    bias = marks.row(1, named=True)
    assert "layer: 4" in bias["hover"] and "value 3 vs threshold 1.5" in bias["hover"]
    lanes = guard_events.timeline_rows(ev)["lane"].to_list()
    assert lanes == ["nonfinite", "action", "maxvio", "action", "inject"]
    assert guard_events.action_marks(ev.head(0), steps).height == 0


def test_a_rollback_that_skipped_is_marked_as_the_skip_it_was() -> None:
    """The trainer's rollback with no snapshot before the incident falls back to a skip: its step
    row says skip and the counts say skip (guard/core/actions.py), so the mark says skip too."""
    steps = pl.DataFrame(
        {"step": [69, 70], "loss": [3.0, 3.1], "grad_norm": [1.0, 1.1], "action": ["apply", "skip"]}
    )
    fallback = {"fallback": "no snapshot before the incident; skipped instead"}
    ev = pl.DataFrame(
        {
            "step": [70, 70, 70],
            "time": [0.0] * 3,
            "kind": ["action", "action", "action"],
            "detector": ["", "", "maxvio"],
            "value": [math.nan] * 3,
            "threshold": [math.nan] * 3,
            "action": ["rollback", "lr_cooldown", "bias_correct"],
            "detail": [json.dumps(fallback), "{}", "{}"],
        }
    )
    marks = guard_events.action_marks(ev, steps)
    assert sorted(marks["action"].to_list()) == ["bias_correct", "lr_cooldown", "skip"]
    skip = marks.filter(pl.col("action") == "skip").row(0, named=True)
    assert "SKIP" in skip["hover"] and "skipped instead" in skip["hover"]
    # a verdict whose step applied its update, or that came while a correction was under way,
    # is evidence (the timeline's), not an action: no mark, as no count
    late = pl.DataFrame(
        {
            "step": [69, 70],
            "time": [0.0] * 2,
            "kind": ["verdict", "verdict"],
            "detector": ["grad_norm_spike", "maxvio"],
            "value": [9.0, 3.0],
            "threshold": [5.0, 1.5],
            "action": ["skip", "bias_correct"],
            "detail": ["{}", "{}"],
        }
    )
    assert guard_events.action_marks(late, steps).height == 0


def test_scan_fills_columns_an_older_writer_lacked(store: Path) -> None:
    run = store / synth.OLD_SCHEMA
    assert reader.missing_columns(run, schema.TABLE_STEPS) == ["mfu", "mem_peak_bytes"]
    df = reader.scan_table(run, schema.TABLE_STEPS).collect()
    assert df.columns == list(schema.STEPS_COLUMNS) and df["mfu"].null_count() == df.height
    assert reader.scan_table(store / synth.META_ONLY, schema.TABLE_STEPS).collect().height == 0


def test_run_info_status_and_compat(store: Path) -> None:
    infos = {i.run_id: i for i in runs.discover(store)}
    assert "not-a-run" not in infos and runs.stray_folders(store) == ["not-a-run"]
    assert infos[synth.STALE].status == schema.STATUS_STALE
    assert runs.run_info(store / synth.STALE, stale_after_s=10**6).status == schema.STATUS_RUNNING
    assert infos[synth.LIVE].status == schema.STATUS_RUNNING
    assert infos[synth.NEW_SCHEMA].compat == runs.COMPAT_NEWER and not infos[synth.NEW_SCHEMA].readable
    assert infos[synth.OLD_SCHEMA].compat == runs.COMPAT_OLDER and infos[synth.OLD_SCHEMA].readable
    assert not infos[synth.META_ONLY].has_steps and "meta.json only" in infos[synth.META_ONLY].note
    assert infos[synth.NO_LAYERS].note == "no layers/experts table"
    assert infos[synth.GUARDED].problem() is None


def test_every_status_has_its_own_look_and_only_finished_is_green() -> None:
    looks = {s: run_status.style(s) for s in schema.RUN_STATUSES}
    assert len({lk.label for lk in looks.values()}) == len(looks), "each status in its own words"
    assert [s for s, lk in looks.items() if lk.color == "green"] == [schema.STATUS_FINISHED]
    nonfinite = looks[schema.STATUS_FINISHED_NONFINITE]
    assert nonfinite.color == "red" and nonfinite.level == "error" and "non-finite" in nonfinite.label
    assert "not usable" in nonfinite.meaning
    assert (
        looks[schema.STATUS_PREEMPTED].level == "info"
        and "--resume" in looks[schema.STATUS_PREEMPTED].meaning
    )
    assert looks[schema.STATUS_INTERRUPTED].level == "warning"
    assert {looks[s].level for s in (schema.STATUS_RUNNING, schema.STATUS_FINISHED)} == {"none"}
    unknown = run_status.style("paused")  # a newer writer's status: shown as it is, in grey
    assert (unknown.label, unknown.color) == ("paused", "gray")


def test_run_info_carries_the_trainers_status_note(store: Path) -> None:
    infos = {i.run_id: i for i in runs.discover(store)}
    pre, intr, nan = infos[synth.PREEMPTED], infos[synth.INTERRUPTED], infos[synth.NONFINITE]
    assert (pre.status, intr.status, nan.status) == (
        schema.STATUS_PREEMPTED,
        schema.STATUS_INTERRUPTED,
        schema.STATUS_FINISHED_NONFINITE,
    )
    assert "SIGTERM" in pre.status_note and "step-000000212" in pre.status_note
    assert "Ctrl-C" in intr.status_note and "none yet" in intr.status_note
    assert "non-finite from step 260" in nan.status_note
    assert infos[synth.GUARDED].status_note == "" and run_status.status_note({"status_note": 3}) == ""
    # the run store agrees with its status: the preempted run stopped at its checkpoint's step,
    # the non-finite one ran to its last step with NaN losses from step 260 on
    assert loaders.load_summary(pre.path, runs.run_signature(pre.path))["step"] == 212
    steps = reader.read_table(nan.path, schema.TABLE_STEPS)
    assert steps["step"].max() == 399 and steps.filter(pl.col("step") >= 260)["loss"].is_nan().all()


def test_signature_moves_when_a_part_lands(tmp_path: Path) -> None:
    run = write_run(tmp_path, SynthRun(run_id="r", steps=60, faults=[]))
    before = runs.run_signature(run)
    time.sleep(0.01)
    src = sorted((run / "steps").glob("part-*.parquet"))[-1]
    (run / "steps" / "part-0000000060-000099.parquet").write_bytes(src.read_bytes())
    assert runs.run_signature(run) != before


def _land_in_the_same_tick(run: Path, table: str) -> None:
    """A part renamed into `table` within the mtime tick of the folder's last change: the folder
    keeps its mtime (a kernel tick is a few ms; os.utime puts it back, as the tick would)."""
    d = run / table
    tick = os.stat(d).st_mtime_ns
    src = sorted(d.glob("part-*.parquet"))[-1]
    (d / "part-0000000060-000099.parquet").write_bytes(src.read_bytes())
    os.utime(d, ns=(tick, tick))


def test_a_part_landing_in_the_listings_tick_is_seen_once_the_folder_settles(tmp_path: Path) -> None:
    """The Live-mode miss (a run's last flush never shown): the app's cached listing and its
    loaders' key, taken within a second of the folder's change, are not reused."""
    run = write_run(tmp_path, SynthRun(run_id="r", steps=60, faults=[]))
    d = run / schema.TABLE_STEPS
    os.utime(d, ns=(time.time_ns(),) * 2)  # written just now, as a live run's folder
    first = reader.cached_part_files(run, schema.TABLE_STEPS)
    sig = runs.run_signature(run)
    assert sig[-1] == 1  # not settled: this key is its own
    _land_in_the_same_tick(run, schema.TABLE_STEPS)
    assert len(reader.cached_part_files(run, schema.TABLE_STEPS)) == len(first) + 1
    # once the folder is a second old, the listing and the key are reused as before
    old = time.time_ns() - 2 * reader.RACY_NS
    os.utime(d, ns=(old, old))
    os.utime(run / schema.META_FILE, ns=(old, old))
    for t in schema.TABLES:
        if (run / t).is_dir():
            os.utime(run / t, ns=(old, old))
    listed = reader.cached_part_files(run, schema.TABLE_STEPS)
    settled_sig = runs.run_signature(run)
    assert settled_sig[-1] == 0 and settled_sig[:-1] == runs.last_writes(run) and settled_sig != sig
    (d / "part-0000000060-000099.parquet").unlink()
    os.utime(d, ns=(old, old))  # a change hidden in the settled tick: the listing is reused
    assert reader.cached_part_files(run, schema.TABLE_STEPS) == listed


def test_summary_and_heatmaps_on_the_guarded_run(store: Path) -> None:
    path = str(store / synth.GUARDED)
    sig = runs.run_signature(path)
    s = loaders.load_summary(path, sig)
    # guard/core/actions.py: 4 skipped steps + 1 rolled back (step rows) + 2 bias corrections + 1 LR cool-down (events)
    assert s["action_counts"] == {
        "skip": 4,
        "rollback": 1,
        "halt": 0,
        "bias_correct": 2,
        "clip": 0,
        "lr_cooldown": 1,
    }
    assert s["step"] == 599 and s["actions"] == 8 and s["verdicts"] == 7 and s["halts"] == 0
    heats = heatmaps.load_layer_heatmaps(path, sig, 0, 599, 100)
    mv = heats["maxvio"]
    assert mv["z"].shape == (4, 100)
    assert np.isnan(mv["z"][0]).all(), "dense layer 0 has no routing stats"
    col = np.searchsorted(mv["x"], 300, side="right") - 1
    assert mv["z"][mv["y"].index(2), col] > 3, "the collapse at step 300 on layer 2 survives bucketing"
    share = heatmaps.load_expert_share_over_time(path, sig, 2, 0, 599, 60)
    assert np.allclose(np.nansum(share["z"], axis=0), 1.0)
    now = heatmaps.load_expert_share_now(path, sig, 100)
    assert (now["from"], now["to"]) == (500, 599) and np.allclose(np.nansum(now["z"], axis=1), 1.0)


def test_expert_heatmap_samples_past_the_row_budget(store: Path) -> None:
    path = str(store / synth.GUARDED)
    sig = runs.run_signature(path)
    full = heatmaps.load_expert_share_over_time(path, sig, 2, 0, 599, 60)
    sampled = heatmaps.load_expert_share_over_time(path, sig, 2, 0, 599, 60, row_budget=5000)
    assert full["note"] == "" and sampled["note"].startswith("sampled")


def test_steady_state_and_env_differences() -> None:
    steps = pl.DataFrame(
        {"step": range(200), "action": ["apply"] * 150 + ["skip"] + ["apply"] * 49, "mfu": [0.4] * 200}
    )
    ss = shaping.steady_state(steps)
    assert ss["step"].min() == 20 and 150 not in ss["step"].to_list() and ss.height == 179
    diff = compare.env_differences(
        {
            "a": {"env": {"torch": "1", "dev": "h"}},
            "b": {"env": {"torch": "2", "dev": "h"}},
            "c": {"env": {"torch": "1"}},
        }
    )
    assert diff.to_dicts() == [
        {"key": "env.dev", "a": "h", "b": "h", "c": "—"},
        {"key": "env.torch", "a": "1", "b": "2", "c": "1"},
    ]


def test_canary_reader_accepts_the_canary_format() -> None:
    lines = [
        {
            "time": 1_760_000_000,
            "git_sha": "abc",
            "torch": "2.9",
            "fingerprint": "fp",
            "config": "c.toml",
            "mfu_p50": 0.41,
            "tokens_per_s_p50": 1e6,
            "verdict": "pass",
            "baseline": True,
        },
        {
            "time": "2025-11-01T10:00:00Z",
            "git_sha": "def",
            "torch": "2.10",
            "fingerprint": "fp",
            "config": {"model": "x"},
            "mfu_p50": 0.36,
            "tokens_per_s_p50": 9e5,
            "verdict": "FAIL",
            "baseline": False,
            "warn_pct": 4,
            "fail_pct": 8,
        },
    ]
    text = "\n".join(json.dumps(x) for x in lines) + '\n[1,2]\n{"mfu_p50": "fast"}\nnope\n'
    df, problems = canaries.parse_canary_history(text)
    assert df.height == 2 and len(problems) == 3
    assert df["verdict"].to_list() == ["pass", "fail"]
    assert df["config"][1] == '{"model": "x"}' and df["fail_pct"][1] == 8
    assert df["time"][0].year == 2025 and df["time"][1].tzinfo is not None
    gate = canaries.canary_gate(df, warn_pct=5, fail_pct=10)
    assert gate["baseline"] == 0.41 and gate["fail_lo"] == pytest.approx(0.369)
    empty, probs = canaries.parse_canary_history("")
    assert empty.height == 0 and probs == []


def test_app_config_from_argv_then_env(monkeypatch) -> None:
    monkeypatch.setenv(config.ENV_RUNS, "/env/runs")
    monkeypatch.delenv(config.ENV_HISTORY, raising=False)
    monkeypatch.delenv(config.ENV_AB_REPORTS, raising=False)
    cfg = config.app_config(["--runs", "/cli/runs", "--history", "h.jsonl", "--collector", "http://am:9093"])
    assert cfg == config.AppConfig(
        runs_dir=Path("/cli/runs"),
        history=Path("h.jsonl"),
        collector="http://am:9093",
        ab_reports=Path("/cli/runs/canary-report"),  # where `moeguard canary --ab --runs /cli/runs` writes
    )
    assert config.app_config(["--runxfail"]).runs_dir == Path("/env/runs")


# ---- open alerts ------------------------------------------------------------------------
@pytest.fixture
def alertmanager() -> Iterator[str]:
    class H(BaseHTTPRequestHandler):
        def log_message(self, *a) -> None:
            pass

        def do_GET(self) -> None:  # noqa: N802
            if self.path.startswith("/api/v2/alerts"):
                body = json.dumps(
                    [
                        {
                            "labels": {"alertname": "GradNormSpike", "run": synth.GUARDED},
                            "status": {"state": "active"},
                        },
                        {
                            "labels": {"alertname": "MFUDrop", "run": synth.GUARDED},
                            "status": {"state": "active"},
                        },
                        {"labels": {"alertname": "Watchdog"}, "status": {"state": "active"}},
                    ]
                ).encode()
                self.send_response(200)
            else:
                body = b"{}"
                self.send_response(404)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


def test_open_alerts_from_alertmanager(alertmanager: str, store: Path, open_page, monkeypatch) -> None:
    alerts, err = open_alerts.fetch_open_alerts(alertmanager)
    assert err is None and alerts == {synth.GUARDED: 2}
    monkeypatch.setenv(config.ENV_COLLECTOR, alertmanager)
    at = open_page("runs", store)
    assert not at.exception
    df = at.dataframe[0].value
    assert df[df["run"] == synth.GUARDED]["open alerts"].iloc[0] == 2
    monkeypatch.setenv(config.ENV_COLLECTOR, "http://127.0.0.1:9")
    at = open_page("runs", store)
    assert not at.exception and any("Open alerts unavailable" in w.value for w in at.warning)


# ---- launcher ---------------------------------------------------------------------------
def test_app_command_refuses_a_missing_folder(tmp_path: Path, capsys) -> None:
    assert cli_main(["app", "--runs", str(tmp_path / "nope")]) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and "--runs DIR" in err
    f = tmp_path / "file"
    f.write_text("x")
    assert cli_main(["app", "--runs", str(f)]) == 2
    assert "is not a folder" in capsys.readouterr().err


def test_app_command_runs_streamlit_headless(tmp_path: Path, monkeypatch) -> None:
    seen = {}

    def fake_serve(cmd):
        seen["cmd"] = cmd
        return 0

    monkeypatch.setattr(
        launch, "serve", fake_serve
    )  # the child's lifetime: tests/dashboards/test_app_lifetime.py
    hist = tmp_path / "h.jsonl"
    assert (
        cli_main(
            [
                "app",
                "--runs",
                str(tmp_path),
                "--port",
                "8600",
                "--host",
                "0.0.0.0",
                "--history",
                str(hist),
                "--collector",
                "http://c:8080",
            ]
        )
        == 0
    )
    cmd = seen["cmd"]
    assert cmd[1:4] == ["-m", "streamlit", "run"] and cmd[4].endswith("dashboards/app.py")
    i = cmd.index("--")
    opts = cmd[5:i]
    assert opts[opts.index("--server.headless") + 1] == "true"
    assert opts[opts.index("--server.port") + 1] == "8600"
    assert opts[opts.index("--server.address") + 1] == "0.0.0.0"
    assert cmd[i + 1 :] == [
        "--runs",
        str(tmp_path.resolve()),
        "--history",
        str(hist.resolve()),
        "--collector",
        "http://c:8080",
    ]
    # what the app parses out of that command line is what was asked for
    cfg = config.app_config(cmd[i + 1 :])
    assert cfg.runs_dir == tmp_path.resolve() and cfg.history == hist.resolve()


def test_launch_rejects_bad_port(tmp_path: Path, capsys) -> None:
    args = argparse.Namespace(runs=str(tmp_path), port=70000, host="127.0.0.1", history=None, collector=None)
    assert launch.run(args) == 2


@pytest.mark.integration
def test_collector_view_lists_a_live_collectors_runs(tmp_path: Path) -> None:
    """The app reads /v1/runs through guard/wire/runs.py, the type the collector writes: a run
    posted to a real collector shows up (it used to read keys the collector never sent)."""
    from tests.helpers_collector import CollectorProc, batch, make_report

    c = CollectorProc(tmp_path / "runs").start()
    try:
        assert c.post(batch("live-1", 0, 1, [make_report(s) for s in range(3)])).status_code == 200
        [run] = open_alerts.fetch_collector_runs(c.url)
        assert (run.run, run.status, run.last_step, run.hot) == ("live-1", schema.STATUS_RUNNING, 2, True)
        assert run.ranks[0].last_step == 2 and not run.ranks[0].lost and run.open_alerts() == []
        halt = {"step": 3, "kind": schema.EV_HALT, "action": schema.ACT_HALT}
        assert c.post(batch("live-1", 0, 2, [make_report(3)], [halt])).status_code == 200
        [run] = open_alerts.fetch_collector_runs(c.url)
        assert run.status == schema.STATUS_HALTED and run.open_alerts() == ["RunHalted"]
        # the runs page's "open alerts" column: no Alertmanager there, so from /v1/runs
        open_alerts.fetch_open_alerts.clear()
        assert open_alerts.fetch_open_alerts(c.url) == ({"live-1": 1}, None)
    finally:
        c.stop()


def test_a_run_without_a_peak_has_no_mfu_artefacts(tmp_path: Path) -> None:
    """MFU is NaN where no peak is known (a CPU class with no pinned peak): not 'above 100%'."""
    from dashboards.data import loaders
    from guard.store.writer import write_parts

    run = tmp_path / "no-peak"
    steps = pl.DataFrame(
        {
            "step": list(range(10)),
            "loss": [1.0] * 10,
            "mfu": [float("nan")] * 9 + [2.0],
            "tokens_per_s": [5.0] * 10,
        }
    )
    write_parts(run, {schema.TABLE_STEPS: steps}, 0)
    summ = loaders.load_summary.__wrapped__(str(run), (0,))
    assert summ["mfu_over"] == 1  # the one real > 100% value, not the nine NaNs
