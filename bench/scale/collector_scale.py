"""The collector at 10k runs and one 50k-layer report, on loopback (issue #13 item 7).

    python bench/scale/collector_scale.py [--runs 10000] [--seed-runs 40] [--active 200] [--layers 16]
                                    [--experts 16] [--big-layers 50000] [--seconds 20] [--repo DIR]

`--repo DIR` runs the collector from another checkout (e.g. a `git archive` of an older commit),
so the same load measures before and after. Steps, all on loopback, one collector process
(`python -m guard collector`, its defaults):
  1. `--seed-runs` runs are written through the collector (3 batches of rank-0 reports with meta,
     a rank-1 heartbeat, one halted run), the collector is stopped (checkpointed), and their
     folders are cloned on disk up to `--runs` (meta.json's run_id rewritten): a run store of
     finished checkpoints, as a collector that has served for months leaves it.
  2. Restart over it: seconds until /healthz answers (listening), until the start-up scan is done
     (healthz pending_load = 0; the same moment for a collector that loads before listening),
     and RSS then (and RSS of an empty collector, for the difference).
  3. `--active` runs stream rank-0 batches (one report of `--layers` layers each) from 4 client
     threads, closed loop; their first batches (a load from disk) are timed apart. Then
     `--seconds` without scrapes and `--seconds` with a scraper thread rendering /metrics in a
     loop: ingest p50/p99/max in both, /metrics render time, size and series count.
  4. One report of `--big-layers` layers (every layer MoE): its answer and time, and, when it
     is accepted, the next scrape and the ingest latency while that scrape renders.
  5. RSS at the end. Prints one JSON line of every figure (and a Markdown table).

Writes docs/BENCHMARKS.md › Scale › Collector at 10k runs (issue #13 item 7,
`bench/scale/collector_scale.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from guard.core.report import StepReport  # noqa: E402

TOKEN = "bench-token"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
GEN = int(time.time()) << 32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def report(step: int, layers: int, experts: int, rng: np.random.Generator) -> dict[str, Any]:
    ids = np.arange(layers, dtype=np.int32)
    return StepReport(
        step=step,
        time=time.time(),
        loss=2.0 + 0.01 * rng.random(),
        grad_norm=1.0 + 0.01 * rng.random(),
        lr=3e-4,
        tokens=1 << 16,
        step_time_s=1.0,
        data_wait_s=0.01,
        tokens_per_s=6.5e4,
        mfu=0.4,
        mem_peak_bytes=1 << 30,
        layer_ids_L=ids,
        layer_grad_norm_L=0.1 + 0.01 * rng.random(layers),
        moe_layer_ids_M=ids,
        router_entropy_M=np.full(layers, 2.0),
        load_entropy_M=np.full(layers, 0.95),
        maxvio_M=np.full(layers, 0.2),
        dead_experts_M=np.zeros(layers, np.int32),
        bias_norm_M=np.zeros(layers),
        load_ME=rng.integers(90, 110, (layers, experts)),
        bias_ME=np.zeros((layers, experts)),
    ).to_json()


class Proc:
    def __init__(self, repo: Path, runs: Path) -> None:
        self.repo, self.runs, self.port = repo, runs, free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.p: subprocess.Popen | None = None

    def start(self, timeout: float) -> dict[str, float]:
        env = dict(os.environ, MOEGUARD_TOKEN=TOKEN, PYTHONPATH=str(self.repo))
        t0 = time.monotonic()
        self.p = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "guard",
                "collector",
                "--port",
                str(self.port),
                "--runs",
                str(self.runs),
                "--log-level",
                "warning",
            ],
            env=env,
            cwd=self.repo,
        )
        listening = None
        while time.monotonic() - t0 < timeout:
            if self.p.poll() is not None:
                raise SystemExit(f"collector exited with {self.p.returncode}")
            try:
                h = httpx.get(f"{self.url}/healthz", timeout=2)
                if listening is None:
                    listening = time.monotonic() - t0
                if h.json().get("pending_load", 0) == 0:
                    return {"listening_s": listening, "scanned_s": time.monotonic() - t0}
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
        return {
            "listening_s": listening if listening is not None else float("inf"),
            "scanned_s": float("inf"),
        }

    def stop(self) -> None:
        if self.p is not None and self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(timeout=120)
            except subprocess.TimeoutExpired:
                self.p.kill()
                self.p.wait()


def post(c: httpx.Client, url: str, payload: dict[str, Any]) -> tuple[int, float, str]:
    body = json.dumps(payload).encode()
    t = time.perf_counter()
    r = c.post(f"{url}/v1/ingest", content=body, headers=AUTH, timeout=120)
    return r.status_code, time.perf_counter() - t, r.text[:300]


def seed(proc: Proc, n: int, layers: int, experts: int) -> None:
    rng = np.random.default_rng(0)
    with httpx.Client() as c:
        for i in range(n):
            run = f"seed-{i:03d}"
            meta = {"torch": "2.13.0", "device_name": "cpu", "attention": "sdpa", "n_experts": experts}
            for b in range(3):
                evs = [{"step": 29, "kind": "halt", "action": "halt"}] if i == 0 and b == 2 else []
                reps = [report(10 * b + k, layers, experts, rng) for k in range(10)]
                st, _, txt = post(
                    c,
                    proc.url,
                    {
                        "run": run,
                        "rank": 0,
                        "seq": GEN | (b + 1),
                        "reports": reps,
                        "events": evs,
                        "meta": meta if b == 0 else None,
                    },
                )
                assert st == 200, txt
            st, _, txt = post(
                c,
                proc.url,
                {"run": run, "rank": 1, "seq": GEN | 1, "heartbeat": {"time": time.time(), "step": 29}},
            )
            assert st == 200, txt


def clone(runs: Path, seeds: int, total: int) -> None:
    """Copy the seeded run folders up to `total` runs (meta.json's run_id rewritten)."""
    tpl = sorted(p for p in runs.iterdir() if p.is_dir())[:seeds]
    for i in range(total - seeds):
        src = tpl[i % len(tpl)]
        dst = runs / f"run-{i:05d}"
        shutil.copytree(src, dst)
        meta = json.loads((dst / "meta.json").read_text())
        meta["run_id"] = dst.name
        (dst / "meta.json").write_text(json.dumps(meta))


def pct(xs: list[float], q: float) -> float:
    return float(np.percentile(np.asarray(xs) * 1e3, q)) if xs else float("nan")


def stream(
    url: str, runs: list[str], seconds: float, layers: int, experts: int, seq0: int, clients: int = 4
) -> tuple[list[float], list[str]]:
    """Closed-loop ingest from `clients` threads, each over its share of `runs`; latencies (s)."""
    lat: list[float] = []
    errors: list[str] = []
    stop = time.monotonic() + seconds

    def client(k: int) -> None:
        rng = np.random.default_rng(k)
        mine = runs[k::clients]
        step = {r: 1000 + seq0 * 10 for r in mine}
        seq = seq0
        with httpx.Client() as c:
            while time.monotonic() < stop:
                for run in mine:
                    if time.monotonic() >= stop:
                        break
                    seq += 1
                    st, dt, txt = post(
                        c,
                        url,
                        {
                            "run": run,
                            "rank": 0,
                            "seq": GEN | seq,
                            "reports": [report(step[run], layers, experts, rng)],
                            "heartbeat": {"time": time.time(), "step": step[run]},
                        },
                    )
                    step[run] += 1
                    lat.append(dt)
                    if st != 200:
                        errors.append(f"{st} {txt}")

    ts = [threading.Thread(target=client, args=(k,)) for k in range(clients)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return lat, errors


def scrape(url: str) -> tuple[float, int, int]:
    t = time.perf_counter()
    r = httpx.get(f"{url}/metrics", timeout=600)
    dt = time.perf_counter() - t
    series = r.content.count(b"\n") - r.content.count(b"\n#") - r.content.startswith(b"#")
    return dt, len(r.content), series


def scrape_loop(url: str) -> None:
    """--scrape-loop URL: scrape until SIGTERM, one JSON line [seconds, bytes, series] each."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        print(json.dumps(scrape(url)), flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=10_000)
    ap.add_argument("--seed-runs", type=int, default=40)
    ap.add_argument("--active", type=int, default=200, help="runs streaming during the latency phases")
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--big-layers", type=int, default=50_000)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--restart-timeout", type=float, default=600.0)
    ap.add_argument("--repo", type=Path, default=REPO, help="checkout whose collector runs")
    ap.add_argument("--label", default="this checkout")
    ap.add_argument("--scrape-loop", metavar="URL", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.scrape_loop:
        scrape_loop(args.scrape_loop)

    tmp = Path(tempfile.mkdtemp(prefix="moeguard-scale-"))
    runs = tmp / "runs"
    out: dict[str, Any] = {
        "label": args.label,
        "runs": args.runs,
        "active": args.active,
        "layers": args.layers,
        "big_layers": args.big_layers,
    }
    proc = Proc(args.repo.resolve(), runs)
    try:
        proc.start(60)
        assert proc.p is not None
        out["rss_empty_mb"] = rss_mb(proc.p.pid)
        t = time.monotonic()
        seed(proc, args.seed_runs, args.layers, args.experts)
        proc.stop()
        clone(runs, args.seed_runs, args.runs)
        out["populate_s"] = time.monotonic() - t

        out.update(proc.start(args.restart_timeout))  # 2. restart over `--runs` runs
        if out["scanned_s"] == float("inf"):
            print(json.dumps(out), flush=True)
            raise SystemExit(f"not loaded within {args.restart_timeout} s")
        out["rss_loaded_mb"] = rss_mb(proc.p.pid)
        out["scrape_idle_s"], out["metrics_bytes_idle"], out["series_idle"] = scrape(proc.url)

        names = sorted(p.name for p in runs.iterdir() if p.is_dir())  # 3. streaming runs
        active = random.Random(0).sample(names, min(args.active, len(names)))
        errors: list[str] = []
        with httpx.Client() as c:  # first touch: each run loads from disk
            rng = np.random.default_rng(1)
            first = []
            for run in active:
                st, dt, txt = post(
                    c,
                    proc.url,
                    {
                        "run": run,
                        "rank": 0,
                        "seq": GEN | 100,
                        "reports": [report(999, args.layers, args.experts, rng)],
                    },
                )
                first.append(dt)
                if st != 200:
                    errors.append(f"{st} {txt}")
        out["first_touch_p50_ms"], out["first_touch_p99_ms"] = pct(first, 50), pct(first, 99)
        lat, e1 = stream(proc.url, active, args.seconds, args.layers, args.experts, 1000)
        out["ingest_quiet_n"], out["ingest_quiet_p50_ms"], out["ingest_quiet_p99_ms"] = (
            len(lat),
            pct(lat, 50),
            pct(lat, 99),
        )
        # the scraper is another process: its reading and parsing 10+ MB must not take this
        # process's GIL from the client threads whose latency is measured
        scraper = subprocess.Popen(
            [sys.executable, __file__, "--scrape-loop", proc.url], stdout=subprocess.PIPE, text=True
        )
        time.sleep(0.5)
        lat, e2 = stream(proc.url, active, args.seconds, args.layers, args.experts, 100_000)
        scraper.send_signal(signal.SIGTERM)
        scrapes = [tuple(json.loads(ln)) for ln in scraper.communicate()[0].splitlines() if ln.strip()]
        errors += e1 + e2
        out["ingest_scrape_n"], out["ingest_scrape_p50_ms"] = len(lat), pct(lat, 50)
        out["ingest_scrape_p99_ms"], out["ingest_scrape_max_ms"] = pct(lat, 99), pct(lat, 100)
        out["scrapes"] = len(scrapes)
        out["render_p50_s"] = float(np.median([s[0] for s in scrapes])) if scrapes else float("nan")
        out["render_max_s"] = max((s[0] for s in scrapes), default=float("nan"))
        out["metrics_bytes"], out["series"] = (scrapes[-1][1], scrapes[-1][2]) if scrapes else (0, 0)
        out["rss_active_mb"] = rss_mb(proc.p.pid)

        with httpx.Client() as c:  # 4. one report of --big-layers layers
            rep = report(0, args.big_layers, 8, np.random.default_rng(2))
            st, dt, txt = post(c, proc.url, {"run": "big", "rank": 0, "seq": GEN | 1, "reports": [rep]})
        out["big_status"], out["big_answer_s"], out["big_answer"] = st, dt, txt[:200]
        if st == 200:
            res: dict[str, Any] = {}
            th = threading.Thread(
                target=lambda: res.update(zip(("t", "b", "n"), scrape(proc.url), strict=True))
            )
            th.start()
            time.sleep(0.2)
            with httpx.Client() as c:
                rng = np.random.default_rng(3)
                st2, dt2, _ = post(
                    c,
                    proc.url,
                    {
                        "run": active[0],
                        "rank": 0,
                        "seq": GEN | 300_000,
                        "reports": [report(5000, args.layers, args.experts, rng)],
                    },
                )
            th.join()
            out["big_render_s"], out["big_series"], out["ingest_during_big_render_s"] = (
                res["t"],
                res["n"],
                dt2,
            )
        out["rss_end_mb"] = rss_mb(proc.p.pid)
        out["errors"] = errors[:5]
        out["n_errors"] = len(errors)
    finally:
        proc.stop()
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps(out), flush=True)
    print(table(out))
    return 0


def table(o: dict[str, Any]) -> str:
    rows = [
        ("restart: listening", f"{o['listening_s']:.2f} s"),
        ("restart: start-up scan done", f"{o['scanned_s']:.2f} s"),
        (
            "RSS empty / after restart / streaming / end",
            f"{o['rss_empty_mb']:.0f} / {o['rss_loaded_mb']:.0f} / "
            f"{o['rss_active_mb']:.0f} / {o['rss_end_mb']:.0f} MB",
        ),
        (
            "/metrics after restart",
            f"{o['scrape_idle_s']:.2f} s, {o['metrics_bytes_idle'] / 1e6:.1f} MB, {o['series_idle']} series",
        ),
        (
            "first batch of a run (load from disk) p50 / p99",
            f"{o['first_touch_p50_ms']:.0f} / {o['first_touch_p99_ms']:.0f} ms",
        ),
        (
            "ingest, no scrape: p50 / p99",
            f"{o['ingest_quiet_p50_ms']:.1f} / {o['ingest_quiet_p99_ms']:.1f} ms",
        ),
        (
            "ingest, /metrics in a loop: p50 / p99 / max",
            f"{o['ingest_scrape_p50_ms']:.1f} / "
            f"{o['ingest_scrape_p99_ms']:.1f} / {o['ingest_scrape_max_ms']:.0f} ms",
        ),
        (
            "/metrics render while streaming: p50 / max",
            f"{o['render_p50_s']:.2f} / {o['render_max_s']:.2f} s, "
            f"{o['metrics_bytes'] / 1e6:.1f} MB, {o['series']} series",
        ),
        (f"one {o.get('big_layers', '50k')}-layer report", f"{o['big_status']} in {o['big_answer_s']:.2f} s"),
    ]
    if "big_render_s" in o:
        rows.append(
            (
                "  then /metrics; an ingest during it",
                f"{o['big_render_s']:.1f} s, {o['big_series']} series; "
                f"{o['ingest_during_big_render_s']:.1f} s",
            )
        )
    return "\n".join(f"| {k} | {v} |" for k, v in rows)


if __name__ == "__main__":
    sys.exit(main())
