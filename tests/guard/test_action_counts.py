"""One count of guard actions (issue #17 item 2): guard/core/actions.py's definition, and a real
faulty training run streamed to a real collector on loopback, whose CLI summary, meta.json,
run store, app data layer and /metrics all give the same counts."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator

import pytest

from guard.core import actions, schema
from guard.core.events import Event
from guard.store.reader import count_actions, read_meta
from tests.conftest import MICRO, REPO
from tests.helpers_collector import CollectorProc
from tests.helpers_http import http_json, wait_until

TOKEN = "counts-token"
RUN = "faulty"


def test_the_definition_counts_each_thing_once() -> None:
    rollback_step = [
        Event(step=41, kind=schema.EV_VERDICT, detector=schema.DET_NONFINITE, action=schema.ACT_ROLLBACK),
        Event(step=41, kind=schema.EV_ACTION, action=schema.ACT_ROLLBACK),
        Event(step=41, kind=schema.EV_ACTION, action=schema.ACT_LR_COOLDOWN),
    ]
    collapse_step = [
        Event(step=45, kind=schema.EV_VERDICT, detector=schema.DET_MAXVIO, action=schema.ACT_BIAS_CORRECT),
        Event(step=45, kind=schema.EV_ACTION, action=schema.ACT_BIAS_CORRECT),
    ]
    counts = actions.zero()
    actions.tally(counts, schema.ACT_SKIP, [Event(step=25, kind=schema.EV_VERDICT, action=schema.ACT_SKIP)])
    actions.tally(counts, schema.ACT_ROLLBACK, rollback_step)
    actions.tally(counts, schema.ACT_APPLY, collapse_step)  # the correction rides an applied step
    actions.tally(
        counts, schema.ACT_APPLY, [Event(step=95, kind=schema.EV_RECOVERED, action=schema.ACT_BIAS_CORRECT)]
    )
    # a rollback with no snapshot before the incident falls back to a skip: the step row says skip
    actions.tally(counts, schema.ACT_SKIP, [Event(step=5, kind=schema.EV_ACTION, action=schema.ACT_ROLLBACK)])
    actions.tally(
        counts, schema.ACT_HALT, [e.row() for e in (Event(step=62, kind=schema.EV_HALT, action="halt"),)]
    )
    actions.tally(counts, schema.ACT_NONE, [Event(step=70, kind=schema.EV_VERDICT, action=schema.ACT_NONE)])
    assert counts == {"skip": 2, "rollback": 1, "halt": 1, "bias_correct": 1, "clip": 0, "lr_cooldown": 1}
    assert actions.total(counts) == 6
    assert actions.summary_text(counts) == "skip 2, rollback 1, halt 1, bias_correct 1, lr_cooldown 1"
    assert actions.summary_text(actions.zero()) == "none"
    steps = [
        schema.ACT_APPLY,
        schema.ACT_SKIP,
        schema.ACT_ROLLBACK,
        schema.ACT_APPLY,
        schema.ACT_SKIP,
        schema.ACT_HALT,
        schema.ACT_NONE,
    ]
    evs = [e.row() for e in rollback_step + collapse_step]
    assert actions.count(steps, evs) == counts


@pytest.fixture(scope="module")
def faulty_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    """`moeguard train` on the micro model with every kind of guard action, streaming to a
    collector on loopback: a grad spike (skip), three NaN steps in a row (two skips, then a
    rollback with an LR cool-down), a forced collapse (bias correction), and three more NaN
    steps (the second rollback halts, halt_after_rollbacks = 1)."""
    tmp = tmp_path_factory.mktemp("counts")
    env = {**os.environ, schema.ENV_TOKEN: TOKEN}
    env.pop(schema.ENV_COLLECTOR, None)
    collector = CollectorProc(tmp / "collector-runs", token=TOKEN, stderr=tmp / "collector.log").start()
    url = collector.url
    try:
        faults = [
            "gradspike@25:1000",
            "collapse@30:1",
            "nan@40",
            "nan@41",
            "nan@42",
            "nan@60",
            "nan@61",
            "nan@62",
        ]
        run_dir = tmp / "train" / RUN
        p = subprocess.run(
            [
                sys.executable,
                "-m",
                "guard",
                "train",
                "--config",
                str(MICRO),
                "--run-dir",
                str(run_dir),
                "--steps",
                "80",
                "--no-progress",
                "--collector",
                url,
                "--set",
                "train.threads=1",
                "--set",
                "guard.policy.snapshot_every=5",
                "--set",
                "guard.policy.halt_after_rollbacks=1",
                *[a for f in faults for a in ("--inject", f)],
            ],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert p.returncode == 3, p.stderr[-3000:]  # halted

        def ended() -> bool:
            _, body = http_json(f"{url}/v1/runs")
            return any(r["run"] == RUN and r["status"] == schema.STATUS_HALTED for r in body["runs"])

        wait_until(ended, timeout=30, what=f"run {RUN} halted at the collector")
        yield {
            "url": url,
            "run_dir": run_dir,
            "stdout": p.stdout,
            "stderr": p.stderr,
            "collector_run_dir": tmp / "collector-runs" / RUN,
            "metrics": collector.metrics(),
        }
    finally:
        collector.stop()


def _cli_counts(stdout: str) -> dict[str, int]:
    """The CLI summary line: 'run faulty: 63 steps, ...; guard actions: skip 4, rollback 1, ...; goodput ...'."""
    m = re.search(r"guard actions: ([^;]*);", stdout)
    assert m, stdout
    out = actions.zero()
    if m.group(1).strip() != "none":
        for part in m.group(1).split(","):
            name, n = part.split()
            out[name] = int(n)
    return out


@pytest.mark.integration
@pytest.mark.slow
def test_run_store_app_and_metrics_count_the_same(faulty_run: dict) -> None:
    from dashboards.data import loaders, runs

    store = count_actions(faulty_run["run_dir"])
    # every action but clip (PolicyConfig.clip_spikes, off by default: its spikes are skipped)
    drilled = [a for a in actions.GUARD_ACTIONS if a != schema.ACT_CLIP]
    assert all(store[a] > 0 for a in drilled), f"the drill must exercise every action: {store}"
    # The collector answers "halted" when the halt event is ingested; its run-store writer flushes the
    # rows a moment later, so its copy is compared once it has caught up (or the wait times out).
    collector_store = wait_until(
        lambda: (c := count_actions(faulty_run["collector_run_dir"])) == store and c,
        timeout=30,
        what="the collector's run store to hold every action",
    )
    path = str(faulty_run["run_dir"])
    app = loaders.load_summary(path, runs.run_signature(path))
    m = faulty_run["metrics"]
    prom = {
        a: int(m[("moeguard_guard_actions_total", (("action", a), ("run", RUN)))])
        for a in actions.GUARD_ACTIONS
    }
    assert collector_store == store, "the collector's copy of the run"
    assert app["action_counts"] == store and app["actions"] == actions.total(store), "the app's data layer"
    assert prom == store, "moeguard_guard_actions_total, skips included"


@pytest.mark.integration
@pytest.mark.slow
def test_cli_summary_and_meta_count_the_same(faulty_run: dict) -> None:
    store = count_actions(faulty_run["run_dir"])
    assert _cli_counts(faulty_run["stdout"]) == store, faulty_run["stdout"]
    meta = read_meta(faulty_run["run_dir"]) or {}
    assert meta.get("guard_actions") == store, json.dumps(meta.get("counts"))
