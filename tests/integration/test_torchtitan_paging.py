"""End to end: a guarded two-rank torchtitan job pages a human through the production path.

    torchrun -m guard.integrations.torchtitan --collector URL   (2 ranks, gloo, CPU)
        -> moeguard collector (/metrics) -> Prometheus (alerts/moeguard.rules.yml, 1 s scrapes)
        -> Alertmanager (alerts/alertmanager.yml, 1 s group timers) -> a recording webhook sink

Every piece is the real binary or CLI on loopback. Only the `for:` of the alerts under test is
shortened (60x), as in tests/integration/test_e2e_paging.py. Each rank beats every second
($MOEGUARD_HEARTBEAT_S) so the collector's floors can be small and the drills quick.

1. An operator's halt (the collector's command API) stops the job after a full checkpoint:
   RunHalted notifies once; the same command again resumes from it and RunHalted resolves.
2. Rank 1 hangs inside a step for 40 s while its process lives (its peer waits in the next
   collective): RunStuck names rank 1 within the learned deadline; no HeartbeatLost. This job starts
   with the stack (its run names no other test's), so its hang overlaps drill 1.

kill -9 of a rank is tests/integration/test_paging_drills.py's: under torchtitan's launcher it
kills each rank 3 times (torchrun's SIGTERM before, after and not at all), and asserts one page
naming the dead rank, peer_lost in both stores and the survivor's note naming why.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest

pytest.importorskip("torchtitan", reason="torchtitan (and triton) not installed")

from bench.common.torchtitan_launch import torchrun_command  # noqa: E402
from guard.core import schema  # noqa: E402
from guard.store.reader import read_meta  # noqa: E402
from tests.conftest import REPO  # noqa: E402
from tests.helpers_alerting import (  # noqa: E402
    ALERTMANAGER,
    PROMETHEUS,
    RULES,
    Proc,
    fast_rules,
    start_alertmanager,
    start_prometheus,
)
from tests.helpers_collector import CollectorProc  # noqa: E402
from tests.helpers_http import RecordingSink, wait_http, wait_until  # noqa: E402
from tests.integration.test_torchtitan_ranks import kill_job  # noqa: E402

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(PROMETHEUS is None or ALERTMANAGER is None, reason="needs prometheus + alertmanager"),
]

TOKEN = "tt-e2e-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
UNDER_TEST = {"RunHalted", "HeartbeatLost", "RunStuck"}  # HeartbeatLost: must not fire for a hang
HEARTBEAT_FLOOR_S = 8.0  # well above the ranks' 1 s beats and a loaded box's hiccups
PROGRESS_FLOOR_S = 4.0
# the hang at step 30 (its deadline learned from the steps before it); the 9 steps after it show
# the rank moving again, which resolves RunStuck (each step ~0.2 CPU-s: no more than that)
STUCK, STUCK_ARGS = "tt-stuck", ("--training.steps", "40", "--checkpoint.interval", "1000")


@dataclass
class Stack:
    tmp: Path
    sink: RecordingSink
    collector: CollectorProc
    jobs: list[subprocess.Popen]
    markers: list[str]
    stuck: subprocess.Popen | None = None  # drill 3's job, launched with the stack
    # one client for the polls (a bare httpx.get builds a client and a TLS context each call)
    http: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=10))

    def launch(self, run: str, *args: str, faults: str = "") -> subprocess.Popen:
        marker = f"{self.tmp}:{run}"
        self.markers.append(marker)
        env = {
            **os.environ,
            "PYTHONPATH": str(REPO),
            "OMP_NUM_THREADS": "1",
            schema.ENV_TOKEN: TOKEN,
            "MOEGUARD_HEARTBEAT_S": "1",
            "MOEGUARD_TT_FAULTS": faults,
            "MOEGUARD_TEST_JOB": marker,  # how kill_job finds this job's processes
        }
        out = ["--dump_folder", str(self.tmp / run / "out"), "--run-dir", str(self.tmp / "runs" / run)]
        cmd = torchrun_command(2, "tiny_moe", *out, "--collector", self.collector.url, *args)
        log = open(self.tmp / f"{run}.log", "ab")
        p = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        self.jobs.append(p)
        return p

    def run_info(self, run: str) -> dict[str, Any] | None:
        r = self.http.get(f"{self.collector.url}/v1/runs", headers=AUTH)
        return next((x for x in r.json().get("runs", []) if x.get("run") == run), None)

    def notifications(self, alert: str, run: str, status: str) -> list[dict[str, Any]]:
        """Alertmanager's webhook alerts for `alert` of `run` in state `status`, in arrival order."""
        out = []
        for rec in list(self.sink.requests):
            for a in (rec.json or {}).get("alerts", []):
                lab = a.get("labels", {})
                if lab.get("alertname") == alert and lab.get("run") == run and a.get("status") == status:
                    out.append(a)
        return out


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    tmp = tmp_path_factory.mktemp("tt-e2e")
    procs: list[Proc] = []
    jobs: list[subprocess.Popen] = []
    markers: list[str] = []
    with RecordingSink(default_status=200) as sink:
        collector = CollectorProc(
            tmp / "collector-runs",
            "--heartbeat-floor",
            str(HEARTBEAT_FLOOR_S),
            "--progress-floor",
            str(PROGRESS_FLOOR_S),
            "--checkpoint-interval",
            "0.5",
            token=TOKEN,
            stderr=tmp / "collector.log",
        ).start()
        try:
            am = start_alertmanager(
                tmp, int(sink.url.rsplit(":", 1)[1])
            )  # its webhook receiver posts to the sink
            procs.append(am)
            rules = fast_rules(RULES.read_text(), speedup=60, alerts=UNDER_TEST)
            prom = start_prometheus(tmp, [f"127.0.0.1:{collector.port}"], am.port, rules)
            procs.append(prom)
            wait_http(f"{am.url}/-/ready", timeout=60)
            wait_http(f"{prom.url}/-/ready", timeout=60)
            s = Stack(tmp, sink, collector, jobs, markers)
            s.stuck = s.launch(STUCK, *STUCK_ARGS, faults="hang@30:40/r1")
            with s.http:
                yield s
        finally:
            for marker in markers:
                kill_job(marker)
            for j in jobs:
                j.wait(30)
            for p in reversed(procs):
                p.stop()
            collector.stop()
            out = REPO / "test-output" / "torchtitan_paging"
            out.mkdir(parents=True, exist_ok=True)
            (out / "sink.json").write_text(json.dumps([r.json for r in sink.requests], indent=1, default=str))


def streaming(s: Stack, run: str, step: int) -> bool:
    info = s.run_info(run)
    return bool(info) and int(info.get("last_step") or -1) >= step


@pytest.mark.timeout(600)
def test_an_operators_halt_pages_once_and_the_relaunch_resolves_it(stack: Stack) -> None:
    s, run = stack, "tt-halt"
    # the halt lands ~3 steps after step 10 (0.2 s steps): 50 leaves it room on a loaded box
    job = s.launch(run, "--training.steps", "50", "--checkpoint.interval", "1000")
    wait_until(lambda: streaming(s, run, 10) or job.poll() is not None, timeout=300, interval=0.5)
    assert job.poll() is None, (s.tmp / f"{run}.log").read_text()[-3000:]
    r = httpx.post(
        f"{s.collector.url}/v1/runs/{run}/commands",
        json={"action": "halt", "reason": "e2e drill"},
        headers=AUTH,
        timeout=10,
    )
    assert r.status_code == 200, r.text
    assert job.wait(timeout=300) != 0  # a halted job does not read as a success to its scheduler
    meta = read_meta(s.tmp / "runs" / run)
    assert meta["status"] == schema.STATUS_HALTED and "operator" in meta["status_note"]
    halted_at = meta["final_step"]
    wait_until(lambda: s.notifications("RunHalted", run, "firing"), timeout=120, interval=0.5)
    again = s.launch(run, "--training.steps", "50", "--checkpoint.interval", "1000")
    assert again.wait(timeout=400) == 0, (s.tmp / f"{run}.log").read_text()[-3000:]
    wait_until(lambda: s.notifications("RunHalted", run, "resolved"), timeout=120, interval=0.5)
    assert len(s.notifications("RunHalted", run, "firing")) == 1
    meta = read_meta(s.tmp / "runs" / run)
    assert meta["status"] == schema.STATUS_FINISHED and meta["restarts"] == 1 and halted_at < 50


@pytest.mark.timeout(600)
def test_a_rank_hung_inside_a_step_pages_run_stuck_naming_it(stack: Stack) -> None:
    s, run, job = stack, STUCK, stack.stuck
    assert job is not None
    # Rank 0 waits for rank 1 inside FSDP's collectives, which GuardedStep cannot see (only its
    # own are marked `waiting`): both stall, both are named, rank 0 possibly a beat first.
    named = lambda: {a["labels"]["rank"] for a in s.notifications("RunStuck", run, "firing")}  # noqa: E731
    wait_until(lambda: "1" in named(), timeout=300, interval=0.5)
    assert job.wait(timeout=300) == 0  # the step completes after the hang and the run ends
    assert not s.notifications("HeartbeatLost", run, "firing")
    wait_until(lambda: s.notifications("RunStuck", run, "resolved"), timeout=120, interval=0.5)
