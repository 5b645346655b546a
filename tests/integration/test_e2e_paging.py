"""End to end: real training runs page a human through the production alerting path.

    moeguard train --collector ...  ->  moeguard collector (/metrics, --alertmanager-url)
        -> Prometheus (alerts/moeguard.rules.yml, scraping every 1 s)
        -> Alertmanager (alerts/alertmanager.yml, 1 s group timers; its own PagerDuty receiver)
        -> a recording HTTP sink standing in for PagerDuty

Every piece is the real binary or CLI on loopback, with free ports and temp dirs. The rules are
the production ones; only the `for:` of the two alerts under test is shortened (60x: 1m -> 1s).
Every other rule keeps its production `for`, so it cannot fire within this test: the micro
model's routing sits at the ExpertCollapse threshold, and a page for that would be noise here.

1. A guard escalation halts a run (gradient spikes -> skips -> rollback -> halt). The collector
   posts RunHalted to Alertmanager at once (seconds, before Prometheus has even scraped it); the
   rule's RunHalted follows with the same labels, so Alertmanager holds one alert: ONE PagerDuty
   trigger. The run ends cleanly (a final batch), so no HeartbeatLost. `--resume` trains again:
   the collector clears moeguard_run_halted, RunHalted resolves: ONE resolve, same dedup_key.
2. A trainer SIGKILLed mid-stream sends no final batch: HeartbeatLost pages for its run, rank 0.
3. A step that hangs while the heartbeat goes on (`--inject hang@STEP:SECONDS`, a hung collective)
   pages RunStuck for its run, rank 0, and resolves when the step completes; no HeartbeatLost.

Waits are polls with bounded timeouts (generous: CI boxes are loaded), never fixed sleeps.
What the sink received is saved to test-output/e2e_paging/ (with the logs) for inspection.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from guard.core import schema
from tests.helpers_alerting import (
    ALERTMANAGER,
    COLLECTOR_RESOLVE_DELAY_S,
    COLLECTOR_TOKEN,
    PD,
    PROMETHEUS,
    REPO,
    ROUTING_KEY,
    RULES,
    RUNBOOKS,
    AlertingStack,
    Proc,
    alerting_stack,
    fast_rules,
    pagerduty_story,
    start_collector,
    start_prometheus,
)
from tests.helpers_http import Recorded, RecordingSink, http_json, wait_until

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(
        PROMETHEUS is None or ALERTMANAGER is None,
        reason="needs the prometheus and prometheus-alertmanager binaries (Debian packages)",
    ),
]

ARTIFACTS = REPO / "test-output" / "e2e_paging"
TOKEN = COLLECTOR_TOKEN
UNDER_TEST = {"RunHalted", "HeartbeatLost", "RunStuck"}
HEARTBEAT_FLOOR_S = 4.0  # small, so HeartbeatLost is fast; well above a loaded box's step hiccups
PROGRESS_FLOOR_S = 4.0  # the same for RunStuck's learned deadline (micro steps take ~10-50 ms)
# The micro config on one thread; the guard's collapse detector is off (the micro model's
# routing trips it, and its bias-correction rollback would halt the resumed run a second time).
TRAIN = [
    "--config",
    "tests/data/micro.toml",
    "--no-progress",
    "--set",
    "train.threads=1",
    "--set",
    "telemetry.profile=false",
    "--set",
    "guard.collapse.enabled=false",
    "--set",
    "guard.policy.snapshot_every=5",
    "--set",
    "guard.policy.halt_after_rollbacks=1",
]
# 3 spikes in 50 steps -> rollback (to the snapshot at 40), 3 more -> 2nd rollback -> halt at 59
# 500x: above the guard's early spike cap (50-100x before the 100-step tail warm-up), so each is skipped
SPIKES = [arg for s in (45, 47, 49, 55, 57, 59) for arg in ("--inject", f"gradspike@{s}:500")]
EXIT_HALTED = 3


# ---------------------------------------------------------------------------------------
# The stack
# ---------------------------------------------------------------------------------------
@dataclass
class Stack:
    tmp: Path
    sink: RecordingSink
    alerting: AlertingStack
    collector: Proc
    prom: Proc
    trainers: list[subprocess.Popen] = field(default_factory=list)
    timings: dict[str, float] = field(default_factory=dict)
    t0: float = field(default_factory=time.monotonic)

    def train(self, run: str, *args: str) -> subprocess.Popen:
        """`python -m guard train` streaming to the collector, in the background."""
        run_dir = self.tmp / "train" / run
        env = {**os.environ, schema.ENV_TOKEN: TOKEN, "PYTHONUNBUFFERED": "1"}
        with open(self.tmp / f"train-{run}-{len(self.trainers)}.log", "wb") as log:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "guard",
                    "train",
                    *TRAIN,
                    "--run-dir",
                    str(run_dir),
                    "--collector",
                    self.collector.url,
                    *args,
                ],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self.trainers.append(proc)
        return proc

    def runs(self) -> dict[str, dict[str, Any]]:
        status, body = http_json(f"{self.collector.url}/v1/runs", timeout=10)
        assert status == 200, body
        return {r["run"]: r for r in body["runs"]}

    def metrics_text(self) -> str:
        import urllib.request

        with urllib.request.urlopen(f"{self.collector.url}/metrics", timeout=10) as r:
            return r.read().decode()

    def rule_firing(self, alert: str, run: str) -> bool:
        status, body = http_json(f"{self.prom.url}/api/v1/alerts", timeout=5)
        assert status == 200, body
        return any(
            a["labels"].get("alertname") == alert and a["labels"].get("run") == run and a["state"] == "firing"
            for a in body["data"]["alerts"]
        )

    def mark(self, name: str) -> None:
        self.timings[name] = round(time.monotonic() - self.t0, 2)

    def pd(self, pred: Callable[[dict[str, Any]], bool] = lambda b: True) -> list[Recorded]:
        """PagerDuty requests the sink accepted, in arrival order."""
        return [r for r in self.sink.received(PD) if r.status < 300 and pred(r.json)]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("e2e")
    t0 = time.monotonic()
    trainers: list[subprocess.Popen] = []
    timings: dict[str, float] = {}
    with alerting_stack(tmp, n_alertmanagers=1) as st:
        try:
            collector = start_collector(
                tmp,
                st.urls,
                "--heartbeat-floor",
                str(HEARTBEAT_FLOOR_S),
                "--progress-floor",
                str(PROGRESS_FLOOR_S),
            )
            st.extra.append(collector)
            rules = fast_rules(RULES.read_text(), speedup=60, alerts=UNDER_TEST)
            prom = start_prometheus(tmp, [collector.hostport], st.ports, rules)
            st.extra.append(prom)
            s = Stack(tmp, st.sink, st, collector, prom, trainers=trainers, timings=timings, t0=t0)
            s.mark("stack_up")
            yield s
        finally:
            for t in trainers:
                if t.poll() is None:
                    t.kill()
                    t.wait(10)
            save_artifacts(tmp, st.sink, t0, timings)


def save_artifacts(tmp: Path, sink: RecordingSink, t0: float, timings: dict[str, float]) -> None:
    """test-output/e2e_paging/: every request the sink got, the timings, every process's log."""
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    received = [
        {
            "t_s": round(r.time - t0, 3),
            "method": r.method,
            "path": r.path,
            "status": r.status,
            "body": r.json if r.json is not None else r.body.decode(errors="replace"),
        }
        for r in sink.received()
    ]
    (ARTIFACTS / "received.json").write_text(json.dumps(received, indent=2, sort_keys=True))
    (ARTIFACTS / "timings.json").write_text(json.dumps(timings, indent=2))
    for log in tmp.glob("*.log"):
        if log.is_file():
            shutil.copy(log, ARTIFACTS / log.name)


def quiet(s: Stack) -> None:
    """Whatever Alertmanager was going to send has been sent: longer than its group interval
    (1 s) plus the collector's resend (1 s) and resolve delay, with room for a loaded box."""
    time.sleep(1 + 1 + COLLECTOR_RESOLVE_DELAY_S + 4)


def for_run(run: str, action: str | None = None, cls: str | None = None) -> Callable[[dict], bool]:
    def pred(b: dict[str, Any]) -> bool:
        if action and b.get("event_action") != action:
            return False
        if b.get("event_action") == "trigger" and b["payload"]["group"] != run:
            return False
        return cls is None or b.get("payload", {}).get("class") == cls

    return pred


def assert_pagerduty_trigger(body: dict[str, Any], alert: str, run: str) -> None:
    assert body["routing_key"] == ROUTING_KEY
    assert body["event_action"] == "trigger"
    assert 0 < len(body["dedup_key"]) <= 255
    p = body["payload"]
    assert p["severity"] == "critical" and p["class"] == alert and p["group"] == run
    assert p["source"] == f"moeguard/{run}"
    assert {"href": f"{RUNBOOKS}/playbooks/{alert}.md", "text": f"Playbook: {alert}"} in body["links"]
    assert (REPO / "playbooks" / f"{alert}.md").is_file()


def wait_exit(proc: subprocess.Popen, timeout: float) -> int:
    try:
        return proc.wait(timeout)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"trainer still running after {timeout}s") from None


# ---------------------------------------------------------------------------------------
# 1. halt -> one page (fast path + Alertmanager, one incident) -> resume -> one resolve
# ---------------------------------------------------------------------------------------
def guard_halt_pages_once_and_resume_resolves_it(stack: Stack) -> None:
    s, run = stack, "e2e-halt"
    trainer = s.train(run, "--steps", "80", *SPIKES)

    # The page: the collector posts RunHalted to Alertmanager, seconds after the halt
    [trig] = s.sink.wait_for(
        lambda r: r.path == PD and r.status < 300 and for_run(run, "trigger")(r.json), timeout=180
    )
    s.mark("halt_trigger")
    pd = trig.json
    assert_pagerduty_trigger(pd, "RunHalted", run)
    # what halted it, in the collector's words and the rule's alike (issue #37)
    assert (
        pd["payload"]["summary"].startswith(f"Run {run} halted at step ")
        and " by guard" in pd["payload"]["summary"]
    )
    assert (
        f"Run {run} ({schema.FRAMEWORK_MOEGUARD}) was halted"
        in pd["payload"]["custom_details"]["description"]
    )
    assert wait_exit(trainer, 120) == EXIT_HALTED
    halt_time = _halt_event_time(s.tmp / "train" / run)
    latency = time.time() - (time.monotonic() - trig.time) - halt_time
    s.timings["halt_to_page_s"] = round(latency, 2)
    assert latency < 30, f"halt paged {latency:.1f}s after it happened"

    # Prometheus' RunHalted follows with the same labels: Alertmanager holds ONE alert
    wait_until(lambda: s.rule_firing("RunHalted", run), timeout=90, interval=0.2, what="the rule to fire")
    s.mark("runhalted_rule_firing")
    time.sleep(2.0)  # Prometheus sends it every second (--rules.alert.resend-delay=1s)
    [held] = s.alerting.ams[0].alerts(alertname="RunHalted", run=run)
    assert held["labels"]["runbook_base"] == RUNBOOKS
    runs = s.runs()
    assert runs[run]["status"] == schema.STATUS_HALTED and runs[run]["ranks"] == {}  # final: not watched
    assert f'moeguard_run_halted{{run="{run}"}} 1.0' in s.metrics_text()

    # The operator resumes the run: the gauge clears, RunHalted resolves, the incident closes
    resumed = s.train(run, "--steps", "80", "--resume")
    [res] = s.sink.wait_for(
        lambda r: (
            r.path == PD
            and r.status < 300
            and r.json["event_action"] == "resolve"
            and r.json["dedup_key"] == pd["dedup_key"]
        ),
        timeout=180,
    )
    s.mark("resolve")
    assert res.json["routing_key"] == ROUTING_KEY
    assert wait_exit(resumed, 120) == 0
    wait_until(lambda: s.runs()[run]["status"] == schema.STATUS_FINISHED, timeout=30, what="finished")
    assert s.runs()[run]["ranks"] == {}
    text = s.metrics_text()
    assert f'moeguard_run_halted{{run="{run}"}} 0.0' in text
    assert f'moeguard_heartbeat_lost{{run="{run}"' not in text  # a finished run is not watched

    # Exactly one page and one resolve for this run, nothing else paged for it
    quiet(s)
    mine = s.pd(lambda b: b["dedup_key"] == pd["dedup_key"] or for_run(run, "trigger")(b))
    assert pagerduty_story(mine) == [("page", pd["dedup_key"]), ("resolve", pd["dedup_key"])]


def _halt_event_time(run_dir: Path) -> float:
    from guard.store.reader import read_table

    ev = read_table(run_dir, schema.TABLE_EVENTS)
    return float(ev.filter(ev["kind"] == schema.EV_HALT)["time"].min())


# ---------------------------------------------------------------------------------------
# 2. a trainer killed mid-stream -> HeartbeatLost for its run and rank 0
# ---------------------------------------------------------------------------------------
def killed_trainer_pages_heartbeat_lost(stack: Stack) -> None:
    s, run = stack, "e2e-kill"
    # No periodic checkpoints: a rank that says it is checkpointing gets the long quiet-phase
    # timeout (by design), and with one every 10 steps the kill at step ~20 could land in one.
    trainer = s.train(run, "--steps", "100000", "--set", "train.checkpoint_every=0")

    def streaming() -> bool:
        assert trainer.poll() is None, f"the trainer exited with {trainer.returncode}"
        return ((s.runs().get(run) or {}).get("last_step") or -1) >= 20

    wait_until(streaming, timeout=120, interval=0.2, what="the trainer to stream 20 steps")
    trainer.send_signal(signal.SIGKILL)  # no final batch, no clean shutdown: a node loss
    trainer.wait(30)
    s.mark("killed")
    killed_at = time.monotonic()

    [trig] = s.sink.wait_for(
        lambda r: (
            r.path == PD
            and r.status < 300
            and r.json["event_action"] == "trigger"
            and r.json["payload"]["group"] == run
        ),
        timeout=120,
    )
    s.mark("heartbeat_lost_trigger")
    s.timings["kill_to_page_s"] = round(trig.time - killed_at, 2)
    pd = trig.json
    assert_pagerduty_trigger(pd, "HeartbeatLost", run)
    p = pd["payload"]
    assert p["summary"] == f"Run {run} rank 0 stopped reporting"
    assert p["component"] == "rank 0" and p["custom_details"]["ranks"].split() == ["0"]
    lost = s.runs()[run]["ranks"]["0"]
    assert lost["lost"] is True and lost["timeout_s"] >= HEARTBEAT_FLOOR_S

    quiet(s)
    assert [r.json["payload"]["class"] for r in s.pd(for_run(run, "trigger"))] == ["HeartbeatLost"]


# ---------------------------------------------------------------------------------------
# 3. a step hung in a (simulated) collective, heartbeat alive -> RunStuck, resolved when it moves
# ---------------------------------------------------------------------------------------
def hung_step_pages_run_stuck_and_resolves_when_it_moves(stack: Stack) -> None:
    s, run, hang_s = stack, "e2e-hang", 20  # the page comes ~8 s into the hang (deadline 4 s + path)
    trainer = s.train(run, "--steps", "40", "--inject", f"hang@25:{hang_s}")
    [trig] = s.sink.wait_for(
        lambda r: (
            r.path == PD
            and r.status < 300
            and r.json["event_action"] == "trigger"
            and r.json["payload"]["group"] == run
        ),
        timeout=120,
    )
    s.mark("run_stuck_trigger")
    assert trainer.poll() is None, "paged after the run had moved on"
    pd = trig.json
    assert_pagerduty_trigger(pd, "RunStuck", run)
    p = pd["payload"]
    assert p["summary"] == f"Run {run} rank 0 stuck in train"
    assert p["component"] == "rank 0" and p["custom_details"]["ranks"].split() == ["0"]
    rank = s.runs()[run]["ranks"]["0"]
    assert rank["lost"] is False and rank["last_step"] == 24
    s.timings["run_stuck_deadline_s"] = round(rank["progress_deadline_s"], 2)
    s.timings["run_stuck_age_at_page_s"] = round(rank["progress_age_s"], 2)
    assert rank["progress_age_s"] < hang_s

    [res] = s.sink.wait_for(
        lambda r: (
            r.path == PD
            and r.status < 300
            and r.json["event_action"] == "resolve"
            and r.json["dedup_key"] == pd["dedup_key"]
        ),
        timeout=120,
    )
    s.mark("run_stuck_resolve")
    assert wait_exit(trainer, 120) == 0
    quiet(s)
    mine = s.pd(lambda b: b["dedup_key"] == pd["dedup_key"] or for_run(run, "trigger")(b))
    assert pagerduty_story(mine) == [("page", pd["dedup_key"]), ("resolve", pd["dedup_key"])]


# ---------------------------------------------------------------------------------------
# The three drills run at once, each on its own run (every route, inhibition and page of
# alerts/alertmanager.yml is per run): their waits (a 20 s hang, a heartbeat timeout, the quiet
# periods) overlap instead of adding up. Each test judges its own drill.
# ---------------------------------------------------------------------------------------
DRILLS: dict[str, Callable[[Stack], None]] = {
    "hang": hung_step_pages_run_stuck_and_resolves_when_it_moves,  # first: its hang is idle time
    "kill": killed_trainer_pages_heartbeat_lost,
    "halt": guard_halt_pages_once_and_resume_resolves_it,
}


@pytest.fixture(scope="module")
def drills(stack: Stack) -> Iterator[dict[str, Future[None]]]:
    with ThreadPoolExecutor(max_workers=len(DRILLS), thread_name_prefix="e2e-drill") as pool:
        yield {name: pool.submit(fn, stack) for name, fn in DRILLS.items()}
        # leaving the pool waits for every drill (each of its waits is bounded) before the stack stops


@pytest.mark.timeout(300)
def test_guard_halt_pages_once_and_resume_resolves_it(drills: dict[str, Future[None]]) -> None:
    drills["halt"].result()


@pytest.mark.timeout(300)
def test_killed_trainer_pages_heartbeat_lost(drills: dict[str, Future[None]]) -> None:
    drills["kill"].result()


@pytest.mark.timeout(300)
def test_hung_step_pages_run_stuck_and_resolves_when_it_moves(drills: dict[str, Future[None]]) -> None:
    drills["hang"].result()
