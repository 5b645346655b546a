"""What a long run costs in the run store at Trinity Large's shape (issue #38): bytes a step per
table and tier (raw, rollups at 10/100/1,000 steps), files per 1,000 steps, the writer thread's
CPU a step, and how long `RunStore.add_step` holds the training thread (p50/p99/p99.9).

    python bench/scale/store_tiers.py --segments 2 --json OUT.json          # sizes (bulk, writer's own functions)
    python bench/scale/store_tiers.py --add-step 1100 --json OUT.json        # add_step timing, real RunStore

Sizes: whole segments of plausible values (loads drift around a persistent skew with a few %
noise, selection biases move by +-1e-3 a step, 2,048 ranks' timings every 20 steps) written as
RunStore leaves them (50-step parts, guard/store/writer.py) and kept by the store's own upkeep
(guard/store/maintain.py: compaction, rollups), then measured on disk. The month projection
applies the [store] policy (guard/store/policy.py) to the per-step figures.

Writes docs/BENCHMARKS.md › Long runs and store size › Store size and the training step at Trinity
shape (`bench/scale/store_tiers.py`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from guard.core import schema  # noqa: E402
from guard.core.report import StepReport  # noqa: E402
from guard.store.layout import (  # noqa: E402
    ROLLUP_RESOLUTIONS,
    SEGMENT_STEPS,
    part_files,
    rollup_part_files,
)
from guard.store.maintain import StoreMaintainer  # noqa: E402
from guard.store.policy import StoreConfig  # noqa: E402
from guard.store.runstore import RunStore  # noqa: E402
from guard.store.writer import table_frame, write_parts  # noqa: E402

LAYERS, EXPERTS, RANKS, RANK_EVERY, TOKENS, TOP_K, GROUPS = 58, 256, 2048, 20, 16 * 1024 * 1024, 4, 2


class Trinity:
    """Plausible per-step values at Trinity Large's shape (58 MoE layers x 256 experts)."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)
        skew = self.rng.lognormal(0.0, 0.25, size=(LAYERS, EXPERTS))
        self.share = skew / skew.sum(axis=1, keepdims=True)
        self.bias = np.zeros((LAYERS, EXPERTS))

    def step(self, s: int) -> dict[str, Any]:
        r = self.rng
        mean = TOKENS * TOP_K * self.share
        load = np.maximum(0, np.rint(mean * np.exp(0.03 * r.standard_normal((LAYERS, EXPERTS))))).astype(
            np.int64
        )
        self.bias += 1e-3 * np.sign(mean.mean(axis=1, keepdims=True) - load)
        return {"load": load, "bias": self.bias.copy()}

    def report(self, s: int) -> StepReport:
        v = self.step(s)
        r = self.rng
        lid = np.arange(LAYERS, dtype=np.int32)
        return StepReport(
            step=s,
            time=1.76e9 + 3.0 * s,
            loss=2.0 + 1.0 / math.sqrt(s + 1),
            grad_norm=float(r.lognormal(0, 0.1)),
            lr=3e-4,
            tokens=TOKENS,
            step_time_s=3.0,
            data_wait_s=0.01,
            tokens_per_s=TOKENS / 3.0,
            mfu=0.4,
            mem_peak_bytes=70 << 30,
            layer_ids_L=lid,
            layer_grad_norm_L=r.lognormal(-2, 0.1, LAYERS),
            moe_layer_ids_M=lid,
            router_entropy_M=5.2 + 0.01 * r.standard_normal(LAYERS),
            load_entropy_M=0.98 + 0.001 * r.standard_normal(LAYERS),
            maxvio_M=0.3 + 0.02 * r.standard_normal(LAYERS),
            dead_experts_M=np.zeros(LAYERS, np.int32),
            bias_norm_M=np.linalg.norm(v["bias"], axis=1),
            load_ME=v["load"],
            bias_ME=v["bias"],
            group_grad_norm_G=r.lognormal(0, 0.1, GROUPS),
            group_update_ratio_G=r.lognormal(-7, 0.1, GROUPS),
        )

    def rank_cols(self, s: int) -> dict[str, list]:
        r = self.rng
        t = 3.0 + 0.02 * r.standard_normal(RANKS)
        return {
            "step": [s] * RANKS,
            "rank": list(range(RANKS)),
            "step_time_s": t.tolist(),
            "data_wait_s": np.abs(0.01 * r.standard_normal(RANKS)).tolist(),
            "straggler_score": (t.min() / t).tolist(),
            "tokens": [TOKENS // RANKS] * RANKS,
        }


def _bytes(paths: list[Path]) -> int:
    return sum(p.stat().st_size for p in paths)


def sizes(segments: int, out: Path) -> dict[str, Any]:
    """Write `segments` whole segments through the writer's functions and the store's upkeep."""
    from guard.core.rows import expert_columns, group_columns, layer_columns, steps_columns

    run = out / "trinity"
    shutil.rmtree(run, ignore_errors=True)
    maint = StoreMaintainer(run, StoreConfig(raw_window_steps=0))  # keep raw: measure every tier
    gen = Trinity()
    seq = 0
    upkeep_cpu = 0.0
    n = segments * SEGMENT_STEPS + StoreConfig().compact_lag_steps + 50  # the last segment closes
    for s0 in range(0, n, 50):
        reps = [gen.report(s) for s in range(s0, min(n, s0 + 50))]
        frames = {
            schema.TABLE_STEPS: table_frame(schema.TABLE_STEPS, steps_columns(reps)),
            schema.TABLE_LAYERS: table_frame(schema.TABLE_LAYERS, layer_columns(reps)),
            schema.TABLE_EXPERTS: table_frame(schema.TABLE_EXPERTS, expert_columns(reps)),
            schema.TABLE_GROUPS: table_frame(schema.TABLE_GROUPS, group_columns(reps)),
        }
        ranks = [gen.rank_cols(r.step) for r in reps if r.step % RANK_EVERY == 0]
        if ranks:
            frames[schema.TABLE_RANKS] = table_frame(
                schema.TABLE_RANKS, {c: sum((x[c] for x in ranks), []) for c in schema.RANKS_COLUMNS}
            )
        seq = write_parts(run, frames, seq)
        t = time.process_time()
        maint.wrote(frames)
        upkeep_cpu += time.process_time() - t
    closed = segments * SEGMENT_STEPS
    res: dict[str, Any] = {
        "segments": segments,
        "upkeep_cpu_s_per_step": upkeep_cpu / n,
        "bytes_per_step": {},
    }
    for t in schema.TABLES:
        parts = [p for p in part_files(run, t) if int(p.name.split("-")[1]) < closed]
        res["bytes_per_step"][f"{t}/raw"] = _bytes(parts) / closed
    for t in schema.ROLLUP_TABLES:
        for r in ROLLUP_RESOLUTIONS:
            parts = [p for p in rollup_part_files(run, t, r) if int(p.name.split("-")[1]) < closed]
            res["bytes_per_step"][f"{t}/r{r}"] = _bytes(parts) / closed
    res["expert_rows_per_step"] = LAYERS * EXPERTS
    res["bytes_per_expert_row"] = {
        "raw": res["bytes_per_step"]["experts/raw"] / (LAYERS * EXPERTS),
        **{
            f"r{r}": res["bytes_per_step"][f"experts/r{r}"] * r / (LAYERS * EXPERTS)
            for r in ROLLUP_RESOLUTIONS
        },
    }
    files = {
        t: len([p for p in part_files(run, t) if int(p.name.split("-")[1]) < closed]) for t in schema.TABLES
    }
    res["files_per_1000_steps"] = {t: n_ / segments for t, n_ in files.items()}
    res["rollup_files_per_1000_steps"] = {  # per closed segment (retired blocks merge further)
        f"{t}-r{r}": len([p for p in rollup_part_files(run, t, r) if int(p.name.split("-")[1]) < closed])
        / segments
        for t in schema.ROLLUP_TABLES
        for r in ROLLUP_RESOLUTIONS
    }
    res["month"] = month(res["bytes_per_step"], StoreConfig())
    shutil.rmtree(run, ignore_errors=True)
    return res


def month(bps: dict[str, float], p: StoreConfig, steps: int = 1_000_000) -> dict[str, Any]:
    """Bytes on disk at `steps` under policy `p`, from per-step figures (incident budget spent)."""

    def kept(window: int) -> int:
        return steps if window == 0 else min(steps, window)

    raw_thinned = sum(bps[f"{t}/raw"] for t in schema.THINNED_TABLES)
    raw_whole = bps["steps/raw"] + bps["events/raw"]
    parts = {
        "steps+events (whole)": raw_whole * steps,
        "raw window": raw_thinned * kept(p.raw_window_steps),
        "incident windows (budget spent)": raw_thinned * p.incident_budget_steps,
    }
    for r, w in p.windows().items():
        parts[f"rollups r{r}"] = sum(bps[f"{t}/r{r}"] for t in schema.ROLLUP_TABLES) * kept(w)
    return {
        "steps": steps,
        "GB": {k: v / 1e9 for k, v in parts.items()},
        "total_GB": sum(parts.values()) / 1e9,
    }


def add_step_timing(n: int, out: Path, pace_s: float) -> dict[str, Any]:
    """Real RunStore, Trinity-shape reports: add_step wall time per call and the writer's CPU.
    One step every `pace_s` (a real Trinity step is ~3 s; faster than the writer can keep up with
    fills its bounded queue, and then the step waits by design, rather than memory growing)."""
    run = out / "addstep"
    shutil.rmtree(run, ignore_errors=True)
    gen = Trinity(1)
    reps = [gen.report(s) for s in range(min(n, 200))]  # built ahead: time the store, not numpy
    store = RunStore(run, flush_every=50)
    # the store's CPU: the whole process's (writer thread and polars' pool) less this thread's
    cpu0, main0 = time.process_time(), time.thread_time()
    lat = np.empty(n)
    t_start = time.perf_counter()
    next_at = time.perf_counter()
    for s in range(n):
        next_at += pace_s
        time.sleep(max(0.0, next_at - time.perf_counter()))
        src = reps[s % len(reps)]
        rep = StepReport(**{f: getattr(src, f) for f in StepReport.__slots__})  # type: ignore[attr-defined]
        rep.step = s
        t = time.perf_counter()
        store.add_step(rep)
        lat[s] = time.perf_counter() - t
    wall = time.perf_counter() - t_start
    store.flush(wait=True)
    cpu = (time.process_time() - cpu0) - (time.thread_time() - main0)
    store.close()
    q = np.quantile(lat, [0.5, 0.99, 0.999])
    res = {
        "steps": n,
        "pace_ms": pace_s * 1e3,
        "add_step_ms": {"p50": q[0] * 1e3, "p99": q[1] * 1e3, "p99.9": q[2] * 1e3, "max": lat.max() * 1e3},
        "store_cpu_ms_per_step": cpu / n * 1e3,  # off the training thread
        "feed_wall_s": wall,
        "segments_closed": n // SEGMENT_STEPS,
    }
    shutil.rmtree(run, ignore_errors=True)
    return res


def collector_files(n: int, out: Path) -> dict[str, Any]:
    """The collector's copy through its real ingest path (in process): one batch of 3 steps and one
    checkpoint after it, as a 1 s checkpoint at a 3 s step leaves; files per table per 1,000 steps
    (closed segments) and in the live tail. Small shape: file counts do not depend on it."""
    from guard.collector.config import CollectorConfig
    from guard.collector.service import Collector

    runs = out / "collector"
    shutil.rmtree(runs, ignore_errors=True)
    c = Collector(CollectorConfig(runs_dir=runs, token=None, checkpoint_interval_s=3600.0, guard=None))
    c.start()
    gen = np.random.default_rng(0)
    try:
        for seq, s0 in enumerate(range(0, n, 3)):
            reps = []
            for s in range(s0, min(n, s0 + 3)):
                r = StepReport(step=s, time=1.76e9 + 3 * s, loss=2.0, grad_norm=1.0, lr=3e-4, tokens=4096)
                r.layer_ids_L = r.moe_layer_ids_M = np.arange(4, dtype=np.int32)
                r.layer_grad_norm_L = gen.random(4)
                for f in ("router_entropy_M", "load_entropy_M", "maxvio_M", "bias_norm_M"):
                    setattr(r, f, gen.random(4))
                r.dead_experts_M = np.zeros(4, np.int32)
                r.load_ME, r.bias_ME = gen.integers(0, 100, (4, 8)), gen.random((4, 8))
                reps.append(r)
            body = json.dumps({"run": "r", "rank": 0, "seq": seq, "reports": [r.to_json() for r in reps]})
            status, ans = c.ingest(body.encode())
            assert status == 200, ans
            c.with_run("r", lambda st: st.checkpoint())
    finally:
        c.close()
    run = runs / "r"
    closed = (n - StoreConfig().compact_lag_steps) // SEGMENT_STEPS * SEGMENT_STEPS
    res: dict[str, Any] = {"steps": n, "checkpoints": (n + 2) // 3, "closed_steps": closed}
    for t in schema.TABLES:
        names = [p.name for p in part_files(run, t)]
        old = [x for x in names if int(x.split("-")[1]) < closed]
        res[t] = {
            "files_per_1000_steps_closed": len(old) / max(1, closed / 1000),
            "live_tail_files": len(names) - len(old),
        }
    shutil.rmtree(runs, ignore_errors=True)
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--segments", type=int, default=0, help="whole 1,000-step segments to size (0: skip)")
    ap.add_argument("--add-step", type=int, default=0, help="steps through a real RunStore to time (0: skip)")
    ap.add_argument("--pace-ms", type=float, default=20.0, help="one step every this many ms (--add-step)")
    ap.add_argument("--collector", type=int, default=0, help="steps through the collector's ingest (0: skip)")
    ap.add_argument("--dir", default=None, help="scratch folder (default: a temp folder)")
    ap.add_argument("--json", default=None, help="write the figures here")
    a = ap.parse_args(argv)
    if a.segments < 0 or a.add_step < 0 or a.pace_ms < 0 or a.collector < 0:
        print("store_tiers: --segments, --add-step and --pace-ms must be >= 0", file=sys.stderr)
        return 2
    out = Path(a.dir or tempfile.mkdtemp(prefix="store-tiers-"))
    out.mkdir(parents=True, exist_ok=True)
    res: dict[str, Any] = {"cpus": os.cpu_count(), "loadavg": os.getloadavg()}
    if a.segments:
        res["sizes"] = sizes(a.segments, out)
    if a.collector:
        res["collector_files"] = collector_files(a.collector, out)
    if a.add_step:
        res["add_step"] = add_step_timing(a.add_step, out, a.pace_ms / 1e3)
    text = json.dumps(res, indent=2)
    print(text)
    if a.json:
        Path(a.json).write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
