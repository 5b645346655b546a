"""One job of R ranks through the real collector at a fixed step rate (issue #30).

    python bench/scale/rank_scale.py --ranks 16384 --step-s 1 --seconds 60 --json OUT.json
        [--stall-rank K --stall-s 60 --stall-at 20] [--layers 60 --moe-layers 58 --experts 256]
        [--collector-core 0 --client-core 1] [--progress-floor 20]

The collector (`python -m guard collector`, its defaults but `--progress-floor`) runs pinned to
one core (`taskset`); this process, pinned to the other, plays the job on one asyncio loop, each
rank's messages built by the exporter's own code (guard/runtime/export_batch.py BatchAssembler,
encode_items; guard/wire/batch.py) and timed by the exporter's own rules (guard/runtime/service.py
make_exporter, guard/core/heartbeat.py, guard/runtime/export_sender.py):

  rank 0      one batch a step: its full StepReport (60 layers, 58 MoE x 256 experts by default),
              its heartbeat carrying `world` = R (its step proves the others'), and at the end of
              every straggler window (guard/api.py STRAGGLER_EVERY steps) every rank's timing as
              the `ranks` vectors (R x 4 values), as GuardedStep sends them.
  ranks > 0   no per-step report: a heartbeat-only batch every beat_interval_s(R, 5 s) (16,384
              ranks: 64 s), the first ones spread over one interval; a connection kept while
              used within KEEPALIVE_S (60 s), else opened anew (httpx's pool does the same).
  a stall     (--stall-rank K): from --stall-at for --stall-s seconds no rank advances (the job
              is synchronous); every other rank waits in a collective (its beats say `waiting`
              from 0.5 s on, as HeartbeatPump marks them); rank K does not wait and beats early
              once (STALL_BEAT_S + its spread), then on its interval; rank 0 sends no report, and
              beats when quiet for its interval.

Measured (the JSON): rank 0's report acknowledgements (ack_p50_ms, ack_p99_ms), requests offered
and acknowledged per second, backlog_trend (slope of rank 0's acknowledgement delay behind its
schedule, s/s: > 0 means the collector falls behind), lost_steps and duplicate_steps (rank 0's
acknowledged steps against the collector's run store, read after a clean stop),
false_heartbeat_lost and false_stuck (ranks the collector ever called lost, or named stuck other
than K, from /metrics scraped every 2 s), the stalled rank's detection time, metrics_render_s
(GET /metrics, p50 and max), collector_cpu (CPU seconds per second over the measured window) and
its peak RSS.

Writes docs/BENCHMARKS.md › Scale › One job at 256 .. 16,384 ranks through one collector (issue #30,
`bench/scale/rank_scale.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from bench.scale.collector_ingest import cpu_seconds, free_port, make_report  # noqa: E402
from guard.api import STRAGGLER_EVERY  # noqa: E402
from guard.collector.gc_policy import FreezeSurvivors  # noqa: E402
from guard.core import schema  # noqa: E402
from guard.core.heartbeat import beat_interval_s, first_beat_delay_s  # noqa: E402
from guard.runtime.export_batch import BatchAssembler, encode_items  # noqa: E402
from guard.runtime.export_commands import CommandInbox  # noqa: E402
from guard.runtime.export_link import KEEPALIVE_S  # noqa: E402
from guard.runtime.service import HEARTBEAT_S, STALL_BEAT_S  # noqa: E402
from guard.store.reader import read_table  # noqa: E402

TOKEN = "bench-token"
RUN = "rank-scale"
WAIT_MARK_S = 0.5  # HeartbeatPump's interval: a rank in a collective this long beats `waiting`
SCRAPE_S = 2.0
_METRIC = re.compile(r"^(moeguard_[a-z_]+)\{([^}]*)\} (\S+)$")


def percentile(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


@dataclass
class Rank:
    """One simulated rank: its batch assembler (the exporter's code), its connection."""

    rank: int
    asm: BatchAssembler
    conn: tuple[asyncio.StreamReader, asyncio.StreamWriter] | None = None
    used_at: float = 0.0
    busy: bool = False


@dataclass
class Tally:
    offered: int = 0
    acked: int = 0
    failed: int = 0
    errors: list[str] = field(default_factory=list)
    ack_ms: list[float] = field(default_factory=list)  # rank 0's reports
    lag: list[tuple[float, float]] = field(default_factory=list)  # (scheduled, ack delay behind it)
    acked_steps: list[int] = field(default_factory=list)


class Job:
    def __init__(self, args: argparse.Namespace, port: int) -> None:
        self.a, self.port = args, port
        self.world = args.ranks
        self.every = beat_interval_s(self.world, HEARTBEAT_S)
        inbox = CommandInbox()
        self.ranks = [
            Rank(r, BatchAssembler(RUN, r, int(time.time()), True, inbox)) for r in range(self.world)
        ]
        for rk in self.ranks:
            rk.asm.every = self.every
        self.ranks[0].asm.world = self.world
        self.tally = Tally()
        self.measure_from = 0.0
        self.step = 0
        self.stall_from = self.stall_to = float("inf")
        rng = np.random.default_rng(0)
        self.report = make_report(0, args.layers, args.experts, rng)
        moe = np.arange(args.moe_layers, dtype=np.int32)
        self.report.moe_layer_ids_M = moe
        for name in ("router_entropy_M", "load_entropy_M", "maxvio_M", "bias_norm_M"):
            setattr(self.report, name, getattr(self.report, name)[: args.moe_layers])
        self.report.dead_experts_M = np.zeros(args.moe_layers, np.int32)
        self.report.load_ME = self.report.load_ME[: args.moe_layers]
        self.report.bias_ME = self.report.bias_ME[: args.moe_layers]
        self.report.validate()
        self.values_per_report = self.report.n_values()

    # ---- HTTP/1.1 on one keep-alive connection per rank, as the exporter's pool ----------
    async def post(self, rk: Rank, body: bytes) -> int:
        now = time.monotonic()
        if rk.conn is not None and now - rk.used_at > KEEPALIVE_S:
            rk.conn[1].close()
            rk.conn = None
        if rk.conn is None:
            rk.conn = await asyncio.open_connection("127.0.0.1", self.port)
        reader, writer = rk.conn
        # the exporter of a rank > 0 that beats less often than KEEPALIVE_S closes after each answer
        close = rk.rank > 0 and self.every >= KEEPALIVE_S
        head = (
            f"POST /v1/ingest HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
            f"authorization: Bearer {TOKEN}\r\ncontent-length: {len(body)}\r\n"
            + ("connection: close\r\n" if close else "")
            + "\r\n"
        ).encode()
        writer.write(head + body)
        await writer.drain()
        status = int((await reader.readline()).split()[1])
        length = 0
        while (line := await reader.readline()) not in (b"\r\n", b""):
            k, _, v = line.decode("latin-1").partition(":")
            if k.strip().lower() == "content-length":
                length = int(v)
            elif k.strip().lower() == "connection" and v.strip().lower() == "close":
                rk.conn = None
        if length:
            await reader.readexactly(length)
        rk.used_at = time.monotonic()
        if close and rk.conn is not None:
            rk.conn[1].close()
            rk.conn = None
        return status

    async def send(self, rk: Rank, body: bytes, counted: bool) -> int:
        if counted:
            self.tally.offered += 1
        try:
            status = await self.post(rk, body)
        except (OSError, asyncio.IncompleteReadError, IndexError, ValueError) as e:
            if rk.conn is not None:
                rk.conn[1].close()
            rk.conn = None
            status = 0
            if len(self.tally.errors) < 20:
                self.tally.errors.append(f"rank {rk.rank}: {type(e).__name__}: {e}")
        if counted:
            if status == 200:
                self.tally.acked += 1
            else:
                self.tally.failed += 1
                if status and len(self.tally.errors) < 20:
                    self.tally.errors.append(f"rank {rk.rank}: HTTP {status}")
        return status

    # ---- what each rank sends ---------------------------------------------------------------
    def stalled(self, t: float) -> bool:
        return self.stall_from <= t < self.stall_to

    def beat_body(self, rk: Rank, t: float) -> bytes:
        waiting = self.stalled(t) and rk.rank != self.a.stall_rank and t - self.stall_from >= WAIT_MARK_S
        rk.asm.set_waiting(waiting)
        rk.asm.note_step(max(self.step - 1, 0))
        with rk.asm.lock:
            return rk.asm.body([], rk.asm.next_seq())

    def report_body(self, step: int) -> bytes:
        asm = self.ranks[0].asm
        rep = self.report
        rep.step, rep.time = step, time.time()
        if (step + 1) % STRAGGLER_EVERY == 0:  # a straggler window ended: every rank's timing
            w = self.world
            asm.set_ranks(
                {
                    "step": step,
                    "step_time_s": [self.a.step_s] * w,
                    "data_wait_s": [0.01] * w,
                    "tokens": [4096] * w,
                    "straggler_score": [1.0] * w,
                }
            )
        enc = encode_items([(rep, [])])
        with asm.lock:
            asm.take_news()
            return asm.body(enc, asm.next_seq())

    async def rank0(self, t0: float, end: float) -> None:
        rk, k = self.ranks[0], 0
        last_sent = t0
        while True:
            due = t0 + k * self.a.step_s
            if due >= end:
                return
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            now = time.monotonic()
            if self.stalled(now):  # no step completes; quiet for its interval: a beat
                if now - last_sent >= self.every:
                    rk.busy = True
                    await self.send(rk, self.beat_body(rk, now), counted=True)
                    rk.busy, last_sent = False, time.monotonic()
                k += 1
                continue
            body = self.report_body(self.step)
            step = self.step
            self.step += 1
            sent = time.monotonic()
            status = await self.send(rk, body, counted=True)
            acked = time.monotonic()
            last_sent = acked
            if status == 200:
                self.tally.acked_steps.append(step)
            if sent >= self.measure_from:
                self.tally.ack_ms.append(1e3 * (acked - sent))
                self.tally.lag.append((due - t0, acked - due))
            k += 1

    async def others(self, t0: float, end: float) -> None:
        """Ranks > 0: a heap of (next beat, rank); one early beat for the stalled rank."""
        heap = [(t0 + first_beat_delay_s(r, self.world, self.every), r) for r in range(1, self.world)]
        heapq.heapify(heap)
        k = self.a.stall_rank
        if k is not None and 0 < k < self.world:
            early = self.stall_from + STALL_BEAT_S + first_beat_delay_s(k, self.world, 2.0)
            heapq.heappush(heap, (early, -k))  # -k: the early one, not rescheduled
        tasks: set[asyncio.Task] = set()
        while heap:
            due, r = heap[0]
            if due >= end:
                break
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            now = time.monotonic()
            while heap and heap[0][0] <= now:
                _, r = heapq.heappop(heap)
                rk = self.ranks[abs(r)]
                if r > 0:
                    heapq.heappush(heap, (now + self.every, r))
                if rk.busy:
                    continue  # its previous beat still in flight: the exporter's one thread waits
                rk.busy = True
                task = asyncio.ensure_future(self._beat(rk, now))
                tasks.add(task)
                task.add_done_callback(tasks.discard)
        if tasks:
            await asyncio.gather(*tasks)

    async def _beat(self, rk: Rank, now: float) -> None:
        try:
            await self.send(rk, self.beat_body(rk, now), counted=True)
        finally:
            rk.busy = False

    async def final(self) -> None:
        """Every rank ends on purpose (a final batch each), so nothing pages afterwards."""
        sem = asyncio.Semaphore(256)

        async def one(rk: Rank) -> None:
            async with sem:
                with rk.asm.lock:
                    body = rk.asm.body([], rk.asm.next_seq(), final=True)
                await self.send(rk, body, counted=False)
                if rk.conn is not None:
                    rk.conn[1].close()
                    rk.conn = None

        await asyncio.gather(*(one(rk) for rk in self.ranks))


# ---- the collector's side: /metrics scrapes -----------------------------------------------------
def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    out = []
    for line in text.splitlines():
        m = _METRIC.match(line)
        if m:
            labels = dict(kv.split("=", 1) for kv in m.group(2).split(",") if "=" in kv)
            out.append((m.group(1), {k: v.strip('"') for k, v in labels.items()}, float(m.group(3))))
    return out


async def scraper(port: int, end: float, job: Job, out: dict[str, Any]) -> None:
    lost_ranks: set[str] = set()
    stuck_named: set[str] = set()
    render: list[float] = []
    detected_at = None
    series: list[int] = []
    while time.monotonic() < end:
        await asyncio.sleep(SCRAPE_S)
        t0 = time.monotonic()
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /metrics HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            await writer.drain()
            raw = await reader.read()
            writer.close()
        except OSError:
            continue
        render.append(time.monotonic() - t0)
        text = raw.split(b"\r\n\r\n", 1)[-1].decode(errors="replace")
        samples = [s for s in parse_metrics(text) if s[1].get("run") == RUN]
        series.append(len(samples))
        for name, labels, v in samples:
            if name == schema.M_HEARTBEAT_LOST and v == 1.0:
                lost_ranks.add(labels["rank"])
            elif name == schema.M_RANK_STUCK and v == 1.0:
                stuck_named.add(labels["rank"])
                if labels["rank"] == str(job.a.stall_rank) and detected_at is None:
                    detected_at = time.monotonic() - job.stall_from
    out.update(
        metrics_render_s={"p50": percentile(render, 50), "max": max(render, default=float("nan"))},
        metrics_series={"p50": percentile(series, 50), "max": max(series, default=0)},
        heartbeat_lost_ranks=sorted(lost_ranks, key=int)[:20],
        false_heartbeat_lost=len(lost_ranks),
        stuck_named=sorted(stuck_named, key=int)[:20],
        false_stuck=len(stuck_named - {str(job.a.stall_rank)}),
        stall_detected_after_s=detected_at,
    )


def start_collector(args: argparse.Namespace, runs: Path, port: int) -> subprocess.Popen:
    env = dict(os.environ, MOEGUARD_TOKEN=TOKEN)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    cmd = [
        "taskset", "-c", str(args.collector_core), sys.executable, "-m", "guard", "collector",
        "--port", str(port), "--runs", str(runs), "--log-level", "warning",
        "--progress-floor", str(args.progress_floor),
    ]  # fmt: skip
    log = open(runs.parent / "collector.log", "w")  # noqa: SIM115 (the process holds it)
    return subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)


async def wait_up(port: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while True:
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /healthz HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n")
            await writer.drain()
            if b" 200 " in await reader.readline():
                writer.close()
                return
        except OSError:
            pass
        if time.monotonic() > deadline or proc.poll() is not None:
            raise SystemExit("the collector did not start")
        await asyncio.sleep(0.2)


async def drive(args: argparse.Namespace, port: int, proc: subprocess.Popen) -> dict[str, Any]:
    await wait_up(port, proc)
    job = Job(args, port)
    t0 = time.monotonic() + 0.5
    end = t0 + args.warmup + args.seconds
    job.measure_from = t0 + args.warmup
    if args.stall_rank is not None:
        job.stall_from = t0 + args.stall_at
        job.stall_to = job.stall_from + args.stall_s
    out: dict[str, Any] = {}
    cpu0 = cpu_at = None

    async def cpu_mark() -> None:
        nonlocal cpu0, cpu_at
        await asyncio.sleep(max(0.0, job.measure_from - time.monotonic()))
        cpu0, cpu_at = cpu_seconds(proc.pid), time.monotonic()

    await asyncio.gather(job.rank0(t0, end), job.others(t0, end), scraper(port, end, job, out), cpu_mark())
    cpu1, cpu_end = cpu_seconds(proc.pid), time.monotonic()
    out["collector_cpu"] = (cpu1 - cpu0) / (cpu_end - cpu_at) if cpu0 is not None else float("nan")
    measured = cpu_end - job.measure_from
    await job.final()
    lag = job.tally.lag
    trend = (
        float(np.polyfit([x for x, _ in lag], [y for _, y in lag], 1)[0]) if len(lag) > 2 else float("nan")
    )
    out.update(
        ranks=args.ranks,
        step_s=args.step_s,
        seconds=args.seconds,
        beat_every_s=job.every,
        values_per_report=job.values_per_report,
        ack_p50_ms=percentile(job.tally.ack_ms, 50),
        ack_p99_ms=percentile(job.tally.ack_ms, 99),
        offered_rps=job.tally.offered / (end - t0),
        acked_rps=job.tally.acked / (end - t0),
        failed_requests=job.tally.failed,
        errors=job.tally.errors,
        backlog_trend=trend,
        max_lag_s=max((y for _, y in lag), default=float("nan")),
        measured_s=measured,
        acked_steps=job.tally.acked_steps,
    )
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2048)
    ap.add_argument("--step-s", type=float, default=1.0)
    ap.add_argument("--seconds", type=float, default=60.0, help="measured seconds (after --warmup)")
    ap.add_argument("--warmup", type=float, default=5.0)
    ap.add_argument("--layers", type=int, default=60)
    ap.add_argument("--moe-layers", type=int, default=58)
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--stall-rank", type=int, default=None, help="this rank stalls (the job waits for it)")
    ap.add_argument("--stall-s", type=float, default=60.0)
    ap.add_argument("--stall-at", type=float, default=20.0, help="seconds after the start")
    ap.add_argument("--progress-floor", type=float, default=20.0, help="the collector's --progress-floor")
    ap.add_argument("--collector-core", type=int, default=0)
    ap.add_argument("--client-core", type=int, default=1)
    ap.add_argument("--json", default=None, help="write the figures here")
    args = ap.parse_args()
    if args.ranks < 2 or (args.stall_rank is not None and not 0 < args.stall_rank < args.ranks):
        ap.error(f"--ranks {args.ranks} / --stall-rank {args.stall_rank}: need ranks >= 2 and 0 < K < ranks")

    tmp = Path(tempfile.mkdtemp(prefix="moeguard-rank-scale-"))
    port = free_port()
    proc = start_collector(args, tmp / "runs", port)
    os.sched_setaffinity(0, {args.client_core})
    # This one process holds every rank's connection (a real rank holds one): its own full
    # collections (200 ms at 8,192 ranks) would read as the collector's ack latency.
    FreezeSurvivors().install()
    try:
        out = asyncio.run(drive(args, port, proc))
        rss = _peak_rss_mb(proc.pid)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    stored = read_table(tmp / "runs" / RUN, schema.TABLE_STEPS)["step"].to_list()
    log_lines = (tmp / "collector.log").read_text(errors="replace").splitlines()
    out["collector_log_lines"] = len(log_lines)
    out["collector_log_tail"] = log_lines[-5:]
    acked = set(out.pop("acked_steps"))
    out.update(
        lost_steps=len(acked - set(stored)),
        duplicate_steps=len(stored) - len(set(stored)),
        collector_peak_rss_mb=rss,
        loadavg=os.getloadavg()[0],
    )
    shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(out, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0


def _peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


if __name__ == "__main__":
    raise SystemExit(main())
