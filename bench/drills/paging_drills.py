"""kill -9 drills under real torchrun: every dead rank pages HeartbeatLost by name, once (issue #37).

    nice -n 10 python bench/drills/paging_drills.py --kills 10 --out /tmp/drills          # the full 60
    python bench/drills/paging_drills.py --frameworks torchtitan --kills 3 --concurrency 3 --out /tmp/d

Each drill launches a 2-rank job under `torchrun --standalone` (gloo, CPU) that streams to a real
collector, scraped by a real Prometheus running alerts/moeguard.rules.yml (HeartbeatLost's `for`
shortened 60x: 1m -> 1s, scrapes and evaluations every second), which alerts a real Alertmanager
running alerts/alertmanager.yml (group_wait 1 s) whose receivers post to a recording sink standing
in for PagerDuty, Slack and the webhook. Once the collector has the drill's kill step, one rank
gets SIGKILL; in a race drill the survivor gets SIGTERM 0.2 s later, as torchrun's agent sends it
on a loaded host (the agent sends its own as well). Half the drills checkpoint every few steps
(a checkpoint lies before the kill), half never do.

The frameworks: `torchtitan` (torchrun -m guard.integrations.torchtitan, bench/common/torchtitan_registry
tiny_moe), `transformers` (the Trainer with MoEGuardCallback: bench/common/hf_trainer_job.py) and
`moeguard` (`moeguard train`, tests/data/micro.toml).

What is judged, per drill: a HeartbeatLost page (a PagerDuty incident) for the run, exactly one,
naming the dead rank and no other; its latency from the kill to the page, against the timeout
the collector learned for that rank (read just before the kill) plus ALERT_PATH_S (a scrape, an
evaluation, `for`, Alertmanager's group_wait, on a loaded box); no other page for the run (a
false page); and the run's status: peer_lost at the collector and in the job's own meta.json
(rank 0 writes it; when rank 0 is the dead one, the survivor does: guard/runtime/record.py).
Prints one line per drill and a
JSON summary (pages, kill-to-page latency p50/max, false pages); --json writes it.

Uses tests/helpers_alerting.py for the Prometheus/Alertmanager set-up (the one definition of how
the production rules and config are made fast), so run it from a checkout.

Writes docs/BENCHMARKS.md › Paging drills › The full drill (`bench/drills/paging_drills.py`, 60
kills + 3 controls).
"""

from __future__ import annotations

import sys
from pathlib import Path as _P

sys.path.insert(0, str(_P(__file__).resolve().parents[2]))  # `python bench/<group>/x.py` from a checkout

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from bench.common.torchtitan_launch import torchrun_command
from guard.core import schema
from guard.store.reader import read_meta
from tests.helpers_alerting import (
    COLLECTOR_TOKEN,
    HOOK,
    PD,
    RULES,
    fast_rules,
    pagerduty_story,
    start_alertmanager,
    start_collector,
    start_prometheus,
)
from tests.helpers_http import RecordingSink, wait_http

REPO = Path(__file__).resolve().parents[2]
FRAMEWORKS = ("torchtitan", "transformers", "moeguard")
MICRO = REPO / "tests" / "data" / "micro.toml"
BEAT_S = 0.5  # each rank's own beats ($MOEGUARD_HEARTBEAT_S)
HEARTBEAT_FLOOR_S = 4.0  # the collector's floor: no rank is lost sooner
# kill-to-page beyond the learned timeout: scrape 1 s + evaluation 1 s + `for` 1 s + group_wait 1 s,
# with room for a loaded box (one CI drill took 17 s at load average 30)
ALERT_PATH_S = 20.0
# Prometheus re-sends a firing alert every RESEND_S and Alertmanager holds it for 4x that: with
# 1 s, a re-send held up more than 4 s on a loaded box resolved HeartbeatLost and the next one
# paged again (20-40 incidents per dead rank in one 60-drill run); a new alert still goes at once.
RESEND_S = 5.0
RACE_DELAY_S = 0.2  # the survivor's SIGTERM after the kill, as torchrun's agent on a loaded host
MARKER = "MOEGUARD_DRILL_JOB"
RACES = ("first", "after", "")
PREEMPT = -1  # a control drill: the scheduler stops the whole job; nothing may page


@dataclass(frozen=True, slots=True)
class Drill:
    framework: str
    rank: int  # the rank killed -9 (PREEMPT: none; SIGTERM to torchrun's agent, the whole job)
    step: int  # killed once the collector has this step
    # "after": the survivor gets SIGTERM RACE_DELAY_S after the kill (torchrun's agent on a loaded
    # host); "first": just before it, so the survivor handles the SIGTERM before any collective of
    # its notices the dead peer (the losing side of the race, every time); "": no SIGTERM of ours
    race: str
    checkpoint: int  # a checkpoint every this many steps (0: none)

    @property
    def run(self) -> str:
        return (
            f"{self.framework[:2]}-{f'r{self.rank}' if self.rank != PREEMPT else 'preempt'}-s{self.step}"
            f"{f'-{self.race}' if self.race else ''}{f'-ck{self.checkpoint}' if self.checkpoint else ''}"
        )


@dataclass(slots=True)
class Result:
    drill: Drill
    timeout_s: float = float("nan")  # the collector's learned timeout for the dead rank at the kill
    killed_at: float | None = None  # time.monotonic() of the kill (a control's SIGTERM)
    latency_s: float | None = None  # kill -> the first page naming it
    named: list[str] = field(default_factory=list)  # ranks HeartbeatLost named for the run
    incidents: int = 0  # HeartbeatLost incidents PagerDuty opened for the run
    false_pages: list[str] = field(default_factory=list)  # other pages for the run
    collector_status: str = ""
    job_status: str = ""
    job_note: str = ""  # meta.json's status_note: why the job says it ended
    error: str = ""

    @property
    def ok(self) -> bool:
        return not self.problems()

    def problems(self) -> list[str]:
        d, out = self.drill, []
        if self.error:
            out.append(self.error)
        if d.rank == PREEMPT:  # the whole job stopped on purpose: no page, preempted everywhere
            if self.named or self.incidents or self.false_pages:
                out.append(f"a preempted job paged: ranks {self.named}, {self.false_pages}")
            if (self.collector_status, self.job_status) != (schema.STATUS_PREEMPTED,) * 2:
                out.append(f"statuses {self.collector_status!r} / {self.job_status!r}, not preempted")
            return out
        if self.latency_s is None:
            out.append("no page")
        elif self.latency_s > self.timeout_s + ALERT_PATH_S:
            out.append(
                f"paged {self.latency_s:.1f} s after the kill > {self.timeout_s:.1f} + {ALERT_PATH_S:g} s"
            )
        if self.named != [str(d.rank)]:
            out.append(f"HeartbeatLost named ranks {self.named}, not [{d.rank}]")
        if self.incidents != 1:
            out.append(f"{self.incidents} HeartbeatLost incidents, not 1")
        if self.false_pages:
            out.append(f"false pages {self.false_pages}")
        if self.collector_status != schema.STATUS_PEER_LOST:
            out.append(f"collector status {self.collector_status!r}")
        if self.job_status != schema.STATUS_PEER_LOST:
            out.append(f"job status {self.job_status!r}")
        elif not says_rank_gone(self.job_note, d.rank):
            out.append(f"the job's note does not say rank {d.rank} is gone: {self.job_note[:160]!r}")
        return out


def says_rank_gone(note: str, rank: int) -> bool:
    """The survivor's note says why the job ended: the dead rank by name (no goodbye when SIGTERM
    came; rank 0 gone, written for it by rank 1), or a collective that lost its peer (the only
    rank it can mean in a 2-rank job)."""
    return any(
        s in note for s in (f"rank {rank} said no goodbye", f"rank {rank} is gone", "a peer rank is gone")
    )


def plan(frameworks: list[str], kills: int) -> list[Drill]:
    """`kills` drills per rank per framework, each at its own step; the race (first, after, none)
    and checkpointing (every 3 steps, none) vary so that 3 kills of a rank cover every race and
    both checkpoint settings. Plus one control per framework: the whole job preempted."""
    out = []
    for fw in frameworks:
        out.append(Drill(fw, PREEMPT, step=8, race="", checkpoint=0))
        for i in range(kills):
            for rank in (0, 1):
                race = RACES[i % len(RACES)]
                out.append(
                    Drill(fw, rank, step=6 + 2 * i + rank, race=race, checkpoint=3 if (i + rank) % 2 else 0)
                )
    return out


def interleave(drills: list[Drill]) -> list[Drill]:
    """`drills` round-robin across frameworks, controls first: run a few at a time, one
    framework's start-ups (torchtitan's the heaviest) overlap another's idle waits for a page, and
    the controls' fixed wait for a page that must not come overlaps everything else."""
    by_fw: dict[str, list[Drill]] = {}
    for d in sorted(drills, key=lambda d: d.rank != PREEMPT):
        by_fw.setdefault(d.framework, []).append(d)
    queues, out = list(by_fw.values()), []
    while any(queues):
        out += [q.pop(0) for q in queues if q]
    return out


# ---------------------------------------------------------------------------------------
# The stack: collector -> Prometheus -> Alertmanager -> the recording sink
# ---------------------------------------------------------------------------------------
@dataclass
class Stack:
    tmp: Path
    sink: RecordingSink
    collector_url: str
    # one client for every drill's polls (thread-safe): a bare httpx.get builds a client and its
    # TLS context each call, ~20 ms of CPU, and 4 drills polling 5 times a second cost half a core
    http: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=10))

    def run_info(self, run: str) -> dict[str, Any] | None:
        r = self.http.get(f"{self.collector_url}/v1/runs", headers=_auth())
        return next((x for x in r.json().get("runs", []) if x.get("run") == run), None)

    def timeout_of(self, run: str, rank: int) -> float:
        text = self.http.get(f"{self.collector_url}/metrics").text
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name == schema.M_HEARTBEAT_TIMEOUT and s.labels == {"run": run, "rank": str(rank)}:
                    return float(s.value)
        return float("nan")

    def hook_alerts(self, run: str) -> list[tuple[float, dict[str, Any]]]:
        """(arrival, alert) of every firing alert the webhook got for `run`."""
        out = []
        for rec in list(self.sink.requests):
            if rec.path != HOOK:
                continue
            for a in (rec.json or {}).get("alerts", []):
                if a.get("labels", {}).get("run") == run and a.get("status") == "firing":
                    out.append((rec.time, a))
        return out

    def pages(self, run: str) -> list[tuple[str, str]]:
        """PagerDuty incidents opened for `run`: (alertname, dedup key)."""
        recs = [r for r in self.sink.requests if r.path == PD and r.status < 300]
        mine = [r for r in recs if (r.json.get("payload") or {}).get("group") == run]
        by_key = {r.json["dedup_key"]: r.json["payload"].get("class", "") for r in mine}
        return [(by_key[k], k) for what, k in pagerduty_story(mine) if what == "page"]


def _auth() -> dict[str, str]:
    return {"Authorization": f"Bearer {COLLECTOR_TOKEN}"}


@contextlib.contextmanager
def stack(tmp: Path) -> Iterator[Stack]:
    tmp.mkdir(parents=True, exist_ok=True)
    with RecordingSink(default_status=200) as sink:
        procs = []
        try:
            col = start_collector(
                tmp, [], "--heartbeat-floor", str(HEARTBEAT_FLOOR_S), "--log-level", "warning"
            )
            procs.append(col)
            am = start_alertmanager(tmp, int(sink.url.rsplit(":", 1)[1]))
            procs.append(am)
            rules = fast_rules(RULES.read_text(), speedup=60, alerts={"HeartbeatLost"})
            prom = start_prometheus(tmp, [col.hostport], am.port, rules, resend_delay_s=RESEND_S)
            procs.append(prom)
            wait_http(f"{prom.url}/-/ready", timeout=60)
            st = Stack(tmp, sink, col.url)
            with st.http:
                yield st
        finally:
            for p in reversed(procs):
                p.stop()


# ---------------------------------------------------------------------------------------
# One drill
# ---------------------------------------------------------------------------------------
def command(d: Drill, st: Stack) -> list[str]:
    out = st.tmp / "jobs" / d.run
    run_dir = st.tmp / "runs" / d.run
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
    steps = "100000"
    if d.framework == "torchtitan":
        ck = str(d.checkpoint or 100000)
        return torchrun_command(
            2, "tiny_moe", "--dump_folder", str(out), "--run-dir", str(run_dir), "--collector",
            st.collector_url, "--training.steps", steps, "--checkpoint.interval", ck,
        )  # fmt: skip
    if d.framework == "transformers":
        return [
            *torchrun, str(REPO / "bench" / "common" / "hf_trainer_job.py"), "--steps", steps, "--out", str(out),
            "--run-dir", str(run_dir), "--save-steps", str(d.checkpoint), "--warmup", "1",
        ]  # fmt: skip
    return [
        *torchrun, "-m", "guard", "train", "--config", str(MICRO), "--run-dir", str(run_dir),
        "--no-progress", "--steps", steps, "--set", f"train.checkpoint_every={d.checkpoint}",
        "--set", "train.threads=1",
    ]  # fmt: skip


def job_pids(marker: str) -> dict[int | None, int]:
    """The processes of the job launched with `marker`: rank -> pid (None: torchrun's agent)."""
    out: dict[int | None, int] = {}
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"{MARKER}={marker}".encode() not in env:
            continue
        rank = next((int(e[5:]) for e in env if e.startswith(b"RANK=")), None)
        out[rank] = pid
    return out


def kill_all(marker: str) -> None:
    for pid in job_pids(marker).values():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def drill(st: Stack, d: Drill, start_timeout_s: float = 600.0) -> Result:
    """Launch, kill at the drill's step and wait for the job to end. The page is waited for by
    `await_page` (run_drills calls it once the job's slot is free for the next drill: the kill's
    time and the page's arrival are both stamped where they happen, so the wait measures nothing)."""
    res = Result(d)
    marker = f"{st.tmp}:{d.run}"
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        schema.ENV_TOKEN: COLLECTOR_TOKEN,
        schema.ENV_COLLECTOR: st.collector_url,
        "MOEGUARD_HEARTBEAT_S": str(BEAT_S),
        MARKER: marker,
    }
    log = st.tmp / "jobs" / f"{d.run}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "ab") as f:
        job = subprocess.Popen(
            command(d, st), cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            info = st.run_info(d.run)
            if info and int(info.get("last_step") or -1) >= d.step:
                break
            if job.poll() is not None or time.monotonic() > deadline:
                res.error = f"the job never reached step {d.step} (exit {job.poll()}); see {log}"
                return res
            time.sleep(0.2)
        pids = job_pids(marker)
        res.timeout_s = st.timeout_of(d.run, d.rank)
        res.killed_at = time.monotonic()
        if d.rank == PREEMPT:
            os.kill(pids[None], signal.SIGTERM)  # as a scheduler stops the job: torchrun forwards it
            try:
                job.wait(timeout=120)
            except subprocess.TimeoutExpired:
                res.error = "the preempted job did not end within 120 s"
            return res
        if d.race == "first":
            os.kill(pids[1 - d.rank], signal.SIGTERM)
        os.kill(pids[d.rank], signal.SIGKILL)
        if d.race == "after":
            time.sleep(RACE_DELAY_S)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pids[1 - d.rank], signal.SIGTERM)
        try:
            job.wait(timeout=120)
        except subprocess.TimeoutExpired:
            res.error = "the job did not end within 120 s of the kill"
    finally:
        kill_all(marker)
        with contextlib.suppress(subprocess.TimeoutExpired):
            job.wait(timeout=30)
    return res


def await_page(st: Stack, res: Result) -> Result:
    """A kill drill: wait for the page (a little past its bound: a late page is measured too) and
    time it from the kill. A control: wait as long as a kill drill would for a page that must not
    come (judge looks for it)."""
    d, killed_at = res.drill, res.killed_at
    if killed_at is None:  # the job never got to its kill step: res.error says so
        return res
    if d.rank == PREEMPT:
        time.sleep(max(0.0, killed_at + HEARTBEAT_FLOOR_S + ALERT_PATH_S - time.monotonic()))
        return res
    wait_until = killed_at + (res.timeout_s if res.timeout_s == res.timeout_s else 60) + ALERT_PATH_S
    while time.monotonic() < wait_until + 5:
        if st.hook_alerts(d.run):
            break
        time.sleep(0.25)
    got = st.hook_alerts(d.run)
    lost = [(t, a) for t, a in got if a["labels"].get("alertname") == "HeartbeatLost"]
    if lost:
        res.latency_s = min(t for t, _ in lost) - killed_at
    res.named = sorted({a["labels"].get("rank", "") for _, a in lost})
    return res


def judge(st: Stack, results: list[Result]) -> None:
    """Pages and statuses once every drill is done (a late second page would show up here)."""
    for r in results:
        run = r.drill.run
        pages = st.pages(run)
        r.incidents = sum(1 for name, _ in pages if name == "HeartbeatLost")
        r.false_pages = [name for name, _ in pages if name != "HeartbeatLost"]
        r.named = sorted(
            {
                a["labels"].get("rank", "")
                for _, a in st.hook_alerts(run)
                if a["labels"]["alertname"] == "HeartbeatLost"
            }
        )
        r.false_pages += [f"HeartbeatLost rank {k}" for k in r.named if k != str(r.drill.rank)]
        r.collector_status = (read_meta(st.tmp / "collector-runs" / run) or {}).get("status", "")
        job_meta = read_meta(st.tmp / "runs" / run) or {}
        r.job_status, r.job_note = job_meta.get("status", ""), job_meta.get("status_note") or ""


def run_drills(st: Stack, drills: list[Drill], concurrency: int, settle_s: float = 5.0) -> list[Result]:
    """`concurrency` jobs at a time; a job's slot goes to the next drill as soon as it has ended,
    and its page (or a control's silence) is awaited off the slots, so no slot sits idle waiting."""
    lock = threading.Lock()

    def paged(r: Result) -> Result:
        await_page(st, r)
        with lock:
            lat = f"{r.latency_s:.1f}" if r.latency_s is not None else "-"
            print(f"{r.drill.run}: timeout {r.timeout_s:.1f} s, page after {lat} s {r.error}", flush=True)
        return r

    with ThreadPoolExecutor(max_workers=len(drills) or 1) as waits:
        with ThreadPoolExecutor(max_workers=concurrency) as pool:
            jobs = [pool.submit(drill, st, d) for d in drills]
            pages = [waits.submit(paged, j.result()) for j in jobs]
        results = [p.result() for p in pages]
    time.sleep(settle_s)  # a second page would come a group interval later
    judge(st, results)
    return results


def summary(results: list[Result], unrelated_pages: int = 0) -> dict[str, Any]:
    kills = [r for r in results if r.drill.rank != PREEMPT]
    controls = [r for r in results if r.drill.rank == PREEMPT]
    lat = sorted(r.latency_s for r in kills if r.latency_s is not None)
    timeouts = [r.timeout_s for r in kills if r.timeout_s == r.timeout_s]
    return {
        "kills": len(kills),
        "paged_by_name_once": sum(1 for r in kills if r.incidents == 1 and r.named == [str(r.drill.rank)]),
        "within_deadline": sum(
            1 for r in kills if r.latency_s is not None and r.latency_s <= r.timeout_s + ALERT_PATH_S
        ),
        "kill_to_page_s": {
            "p50": round(statistics.median(lat), 1) if lat else None,
            "max": round(max(lat), 1) if lat else None,
        },
        "learned_timeout_s": {
            "min": round(min(timeouts), 1) if timeouts else None,
            "max": round(max(timeouts), 1) if timeouts else None,
        },
        "false_pages": sum(len(r.false_pages) + (r.incidents if r in controls else 0) for r in results)
        + unrelated_pages,
        "status_ok": sum(1 for r in kills if not [p for p in r.problems() if "status" in p]),
        "preempted_controls_quiet": f"{sum(1 for r in controls if r.ok)}/{len(controls)}",
        "failed": [f"{r.drill.run}: {'; '.join(r.problems())}" for r in results if not r.ok],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--frameworks", default=",".join(FRAMEWORKS), help="comma-separated, of %(default)s")
    ap.add_argument(
        "--kills", type=int, default=10, help="kills per rank per framework (default %(default)s)"
    )
    ap.add_argument("--concurrency", type=int, default=2, help="drills at once (default %(default)s)")
    ap.add_argument("--out", type=Path, required=True, help="a fresh folder for the stack, runs and logs")
    ap.add_argument("--json", type=Path, default=None, help="write the summary and every drill here")
    a = ap.parse_args(argv)
    fws = [f for f in a.frameworks.split(",") if f]
    if bad := [f for f in fws if f not in FRAMEWORKS]:
        ap.error(f"--frameworks: {bad} not among {FRAMEWORKS}")
    if a.kills < 1 or a.concurrency < 1:
        ap.error(f"--kills and --concurrency must be >= 1, got {a.kills} and {a.concurrency}")
    drills = plan(fws, a.kills)
    t0 = time.monotonic()
    with stack(a.out) as st:
        results = run_drills(st, drills, a.concurrency)
        runs = {d.run for d in drills}
        unrelated = sum(
            1
            for r in st.sink.requests
            if r.path == PD
            and r.json.get("event_action") == "trigger"
            and r.json["payload"].get("group") not in runs
        )
    s = summary(results, unrelated)
    s["wall_s"] = round(time.monotonic() - t0)
    print(json.dumps(s, indent=1))
    if a.json is not None:
        a.json.write_text(
            json.dumps({"summary": s, "drills": [asdict(r) for r in results]}, indent=1, default=str)
        )
    return 0 if not s["failed"] else 1


if __name__ == "__main__":
    sys.exit(main())
