"""A month of Trinity in the run store and the app (issue #38): what a long run costs to keep and
to open, at 10k / 100k / 1M steps, side by side with the code before the long-run store.

    python bench/scale/month_run.py --steps 10000 --steps 100000 [--baseline] [--out FILE.json]
    python bench/scale/month_run.py --steps 2000 --layers 4 --experts 8 --ranks 16 --runs 20   (seconds)

For each size it builds (once; reused while the shape matches) Trinity's shape, 58 MoE layers x
256 experts, 2,048 ranks' vectors every 20 steps, an incident every 25,000 steps, in the
long-run layout as RunStore leaves it under the `[store]` defaults (bench/scale/month_store.py's
fast build: the writer's functions and the real StoreMaintainer, old segments tiled; the build's
wall and CPU seconds are recorded), then measures, each in
a fresh process with the run's files evicted from the page cache (posix_fadvise DONTNEED):
- store bytes and files per table;
- the app's pages' data paths: Runs (discovery + every run's summary, with `--runs` runs: the
  run and symlinks to it), Run health (bench/scale/app_load.py's page_data_path: every loader, figure
  and the figure JSON), Compare (two runs' steady-state perf and loss overlay);
- `moeguard replay`'s peak RSS and time;
- RunStore.add_step p50 / p99 / p99.9 at the shape, and the CPU of the other threads per step;
and fits a growth law t = a * steps^b across the sizes (b ~ 0: flat; b ~ 1: linear).
`--baseline` also builds the store today's layout leaves (bench/scale/big_run.py: one part per 50 steps
per table, every row raw) and opens it with the code of `--baseline-rev` (a git worktree in
/tmp), at sizes up to `--baseline-max`. `--same-store-rev REV` also opens each new-layout store with
REV's code (a git worktree): a reader change before and after on the very same files.

Writes docs/BENCHMARKS.md › Long runs and store size › Reading a long run
(`bench/scale/month_run.py`) and › A month at 1M steps, measured (`bench/scale/month_run.py`).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

RUN_ID = "month"
PAGES = ("runs", "health", "compare")
TARGET_PAGE_S = 2.0
TARGET_REPLAY_MB = 2048

# Child code: uses only APIs that exist before and after issue #38, so the same lines time both.
CHILD = r"""
import json, logging, os, resource, sys, time, warnings
warnings.simplefilter("ignore")
logging.getLogger("streamlit").setLevel(logging.ERROR)
page, runs_dir, run = sys.argv[1], sys.argv[2], sys.argv[3]
t_imp = time.perf_counter()
from dashboards.data import compare, loaders, runs  # imports are not the page's cost: timed apart
import bench.scale.app_load, guard.replay, plotly.io
out = {"import_s": time.perf_counter() - t_imp}
t0 = time.perf_counter(); c0 = time.process_time()
if page == "runs":
    infos = runs.discover(runs_dir)
    summ = [loaders.load_summary(i.path, runs.run_signature(i.path)) for i in infos if i.readable]
    out["runs"] = len(summ); out["steps"] = summ[0]["step"]
elif page == "health":
    from bench.scale.app_load import page_data_path
    out["stages"] = page_data_path(__import__("pathlib").Path(run))
elif page == "compare":
    for p in (run, os.path.join(runs_dir, sys.argv[4])):
        sig = runs.run_signature(p)
        loaders.load_steady_perf(p, sig)
        compare.load_overlay(p, sig, "loss", "step", 1)
elif page == "replay":
    from pathlib import Path
    from guard.replay import guard_config_of, replay
    cfg, lr = guard_config_of(Path(run), None)
    out["verdicts"] = len(replay(Path(run), cfg, lr))
out["wall_s"] = time.perf_counter() - t0
out["cpu_s"] = time.process_time() - c0
# VmHWM: this process image's peak (ru_maxrss would carry the parent's peak across exec)
hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")]
out["peak_rss_mb"] = int(hwm[0].split()[1]) / 1024 if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
print(json.dumps(out, default=float))
"""


def evict(path: Path) -> int:
    """Drop a tree's files from the page cache (posix_fadvise DONTNEED); the files evicted."""
    n = 0
    for dirpath, _, files in os.walk(path, followlinks=False):
        for f in files:
            try:
                fd = os.open(os.path.join(dirpath, f), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += 1
            finally:
                os.close(fd)
    return n


def child(page: str, runs_dir: Path, run: Path, code_root: Path, other: str = "") -> dict[str, Any]:
    """One page's data path, timed in a fresh process over `code_root`'s code, files evicted."""
    evict(run)
    env = {**os.environ, "PYTHONPATH": str(code_root), "PYTHONWARNINGS": "ignore"}
    r = subprocess.run(
        [sys.executable, "-c", CHILD, page, str(runs_dir), str(run), other],
        capture_output=True,
        text=True,
        cwd=code_root,
        env=env,
    )
    if r.returncode:
        raise SystemExit(f"{page} over {run} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def store_stats(run: Path) -> dict[str, dict[str, float]]:
    """Bytes and files per table folder (rollups per table and resolution), and in all."""
    out: dict[str, dict[str, float]] = {}
    for p in run.rglob("*"):
        if p.is_file() and not p.is_symlink():
            rel = p.relative_to(run).parts
            key = "/".join(rel[:2]) if rel[0] == "rollups" else rel[0] if len(rel) > 1 else "(files)"
            s = out.setdefault(key, {"bytes": 0, "files": 0})
            s["bytes"] += p.stat().st_size
            s["files"] += 1
    out["total"] = {
        "bytes": sum(v["bytes"] for v in out.values()),
        "files": sum(v["files"] for v in out.values()),
    }
    return out


def tail_files(run: Path, steps: int) -> dict[str, dict[str, float]]:
    """Raw parts per table per 1,000 steps of the closed segments (before the last compact_lag_steps
    and the open segment) and in the live tail, as store_tiers.py --collector counts them."""
    from guard.store.layout import SEGMENT_STEPS
    from guard.store.policy import StoreConfig

    closed = (steps - StoreConfig().compact_lag_steps) // SEGMENT_STEPS * SEGMENT_STEPS
    out: dict[str, dict[str, float]] = {}
    for t in sorted(p.name for p in run.iterdir() if p.is_dir() and p.name not in ("rollups", "checkpoints")):
        names = [n for n in os.listdir(run / t) if n.startswith("part-") and n.endswith(".parquet")]
        old = [n for n in names if int(n.split("-")[1]) < closed]
        out[t] = {"per_1000_closed": len(old) / max(1, closed / 1000), "live_tail": len(names) - len(old)}
    return out


def runs_dir_with(root: Path, n: int) -> Path:
    """A run store with the run and n - 1 symlinks to it (1,000 runs of one month's size each,
    without 1,000 builds: every run is read through its own path, so nothing is shared in the
    app's caches)."""
    runs = root / "runs"
    for i in range(1, n):
        link = runs / f"{RUN_ID}-{i:04d}"
        if not link.exists():
            link.symlink_to(RUN_ID)
    for extra in sorted(runs.glob(f"{RUN_ID}-*"))[max(0, n - 1) :]:
        extra.unlink()
    return runs


def ensure(root: Path, build: str, shape: dict[str, Any]) -> Path:
    run = root / "runs" / RUN_ID
    stamp = root / "shape.json"
    if stamp.is_file() and json.loads(stamp.read_text()) == shape and (run / "meta.json").is_file():
        return run
    import shutil

    shutil.rmtree(root / "runs", ignore_errors=True)
    t, c = time.perf_counter(), time.process_time()
    print(f"building {build} store: {shape} ...", file=sys.stderr, flush=True)
    if build in ("new", "collector"):
        from bench.scale.month_store import COLLECTOR_FLUSH_EVERY, FLUSH_EVERY, write_month_run

        write_month_run(
            run,
            flush_every=COLLECTOR_FLUSH_EVERY if build == "collector" else FLUSH_EVERY,
            steps=shape["steps"],
            layers=shape["layers"],
            experts=shape["experts"],
            ranks=shape["ranks"],
            incident_every=shape["incident_every"],
            recent=shape["recent"],
            radius=shape["radius"],
        )
    else:
        from bench.scale.big_run import write_big_run

        write_big_run(
            run, steps=shape["steps"], layers=shape["layers"], experts=shape["experts"], part_steps=50
        )
        meta = json.loads((run / "meta.json").read_text())
        meta["config"]["guard"] = {}
        (run / "meta.json").write_text(json.dumps(meta))
    stamp.write_text(json.dumps(shape))
    built = {"wall_s": time.perf_counter() - t, "cpu_s": time.process_time() - c, "load": os.getloadavg()}
    (root / "build.json").write_text(json.dumps(built))
    print(f"  built in {built['wall_s']:.1f} s ({built['cpu_s']:.1f} s CPU)", file=sys.stderr, flush=True)
    return run


def add_step_latency(steps: int, layers: int, experts: int, dirpath: Path) -> dict[str, float]:
    """RunStore.add_step at the shape: per-call wall times over `steps` steps (flush_every 50),
    and the CPU the process spent outside the training thread, per step."""
    import numpy as np

    from guard.core.report import StepReport
    from guard.store.runstore import RunStore

    rng = np.random.default_rng(0)
    store = RunStore(dirpath, flush_every=50)
    store.write_meta({"run_id": dirpath.name, "status": "running"})
    load = rng.poisson(2048, size=(layers, experts)).astype(np.int64)
    moe = np.arange(layers, dtype=np.int32)
    times = []
    c_proc, c_main = time.process_time(), time.thread_time()
    for s in range(steps):
        rep = StepReport(
            step=s, time=1.7e9 + s, loss=2.0, grad_norm=1.0, lr=3e-4, tokens=1 << 22, step_time_s=2.0,
            data_wait_s=0.01, tokens_per_s=2e6, mfu=0.4, mem_peak_bytes=7 << 33,
            layer_ids_L=moe, layer_grad_norm_L=np.ones(layers), moe_layer_ids_M=moe,
            router_entropy_M=np.full(layers, 5.0), load_entropy_M=np.full(layers, 0.99),
            maxvio_M=np.full(layers, 0.2), dead_experts_M=np.zeros(layers, dtype=np.int32),
            bias_norm_M=np.full(layers, 0.01), load_ME=load, bias_ME=np.zeros((layers, experts)),
        )  # fmt: skip
        t = time.perf_counter_ns()
        store.add_step(rep)
        times.append((time.perf_counter_ns() - t) / 1e6)
    main_cpu = time.thread_time() - c_main
    store.close("finished")
    other_cpu = time.process_time() - c_proc - main_cpu
    ts = sorted(times)

    def q(p: float) -> float:
        return ts[min(len(ts) - 1, int(p * len(ts)))]

    return {"p50_ms": q(0.5), "p99_ms": q(0.99), "p999_ms": q(0.999), "max_ms": ts[-1],
            "writer_cpu_ms_per_step": 1000 * other_cpu / steps, "steps": steps}  # fmt: skip


def measure(
    run: Path,
    runs_dir: Path,
    code_root: Path,
    repeat: int,
    replay: bool = True,
    pages: tuple[str, ...] = (*PAGES, "replay"),
) -> dict[str, Any]:
    skipped = {"wall_s": math.nan, "cpu_s": math.nan, "peak_rss_mb": math.nan, "skipped": True}
    out: dict[str, Any] = {p: dict(skipped) for p in (*PAGES, "replay")}
    for page in [p for p in pages if replay or p != "replay"]:
        other = f"{RUN_ID}-0001" if page == "compare" else ""
        reps = [
            child(page, runs_dir, run, code_root, other) for _ in range(1 if page == "replay" else repeat)
        ]
        best = sorted(reps, key=lambda r: r["wall_s"])[len(reps) // 2]
        out[page] = best
        print(
            f"  {run.parent.parent.name} {page}: {json.dumps(best, default=float)}",
            file=sys.stderr,
            flush=True,
        )
    return out


def growth(xs: list[int], ys: list[float]) -> dict[str, float] | None:
    """Least-squares fit of y = a * x^b in log-log space (None with under two sizes)."""
    pts = [(math.log(x), math.log(y)) for x, y in zip(xs, ys, strict=True) if y > 0]
    if len(pts) < 2:
        return None
    mx = sum(p[0] for p in pts) / len(pts)
    my = sum(p[1] for p in pts) / len(pts)
    sxx = sum((p[0] - mx) ** 2 for p in pts)
    b = sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx if sxx else 0.0
    return {"b": b, "a": math.exp(my - b * mx)}


def baseline_tree(rev: str) -> Path:
    """A worktree of `rev` in /tmp (made once): today's code, opened by the same child lines."""
    wt = Path(tempfile.gettempdir()) / f"moeguard-{rev}"
    if not (wt / "guard").is_dir():
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(wt), rev], check=True,
                       capture_output=True)  # fmt: skip
    return wt


def markdown(res: dict[str, Any]) -> str:
    sizes = res["sizes"]
    lines = [
        f"Command: `{res['command']}` ({res['date']}, commit {res['commit']}; {res['machine']}; "
        "shared box: wall times are noisy, ratios in one run are the figure to read)",
        "",
        "Each page: wall s / CPU s (all threads) of its data path, cold: a fresh process, the run's files "
        "evicted from the page cache; imports not counted.",
        "",
        "| steps | store MB | files | Runs | Run health | Compare | replay peak RSS (MB) | replay wall / CPU (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for label in ("new", "baseline"):
        for n in sizes:
            r = res["results"].get(f"{label}-{n}")
            if not r:
                continue
            for m, who in (
                (r["measured"], label),
                (r.get("measured_rev"), f"same store, {res.get('rev')}'s code"),
            ):
                if m is None:
                    continue
                lines.append(
                    f"| {n:,} ({who}) | {r['store']['total']['bytes'] / 1e6:,.1f} | {r['store']['total']['files']:,} | "
                    + " | ".join(f"{m[p]['wall_s']:.2f} / {m[p]['cpu_s']:.2f}" for p in PAGES)
                    + f" | {m['replay']['peak_rss_mb']:,.0f} | {m['replay']['wall_s']:.1f} / {m['replay'].get('cpu_s', math.nan):.1f} |"
                )
    for n in sizes:
        r = res["results"].get(f"collector-{n}")
        if r:
            per = max(v["per_1000_closed"] for v in r["files"].values())
            lines.append(
                f"| {n:,} (the collector's copy, one checkpoint a step) | {r['store']['total']['bytes'] / 1e6:,.1f} | "
                f"{r['store']['total']['files']:,} (<= {per:.2f} a raw table per 1,000 closed steps) | | | | | |"
            )
    if res.get("growth"):
        lines += ["", "Growth law CPU = a * steps^b (new layout): " + "; ".join(
            f"{k} b = {v['b']:.2f}" for k, v in res["growth"].items() if v)]  # fmt: skip
    if res.get("add_step"):
        a = res["add_step"]
        lines += ["", f"add_step at the shape: p50 {a['p50_ms']:.3f} ms, p99 {a['p99_ms']:.3f} ms, p99.9 "
                  f"{a['p999_ms']:.3f} ms, max {a['max_ms']:.1f} ms over {a['steps']:,} steps; other threads' "
                  f"CPU {a['writer_cpu_ms_per_step']:.1f} ms per step"]  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, action="append", help="a run length to build and open (repeatable)")
    p.add_argument("--layers", type=int, default=58)
    p.add_argument("--experts", type=int, default=256)
    p.add_argument("--ranks", type=int, default=2048)
    p.add_argument(
        "--runs", type=int, default=1000, help="runs on the Runs page (the run and symlinks to it)"
    )
    p.add_argument("--incident-every", type=int, default=25_000)
    p.add_argument("--recent", type=int, default=10_000, help="steps kept at full fidelity at the end")
    p.add_argument("--radius", type=int, default=25, help="steps kept at full fidelity around an incident")
    p.add_argument("--repeat", type=int, default=3, help="cold opens per page (median)")
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()) / "moeguard-bench" / "month_run")
    p.add_argument(
        "--baseline", action="store_true", help="also open today's layout with --baseline-rev's code"
    )
    p.add_argument("--baseline-rev", default="ea1e43a")
    p.add_argument("--baseline-max", type=int, default=10_000, help="largest size built in today's layout")
    p.add_argument(
        "--baseline-replay-max",
        type=int,
        default=2000,
        help="largest size today's replay runs at (it holds the whole experts table: ~1.3 GB per 1,000 steps)",
    )
    p.add_argument(
        "--same-store-rev",
        help="also open each new-layout store with this git revision's code (before/after on one store)",
    )
    p.add_argument(
        "--pages",
        default=",".join((*PAGES, "replay")),
        help="what to measure, comma-separated (default: every page and replay)",
    )
    p.add_argument(
        "--collector-copy",
        action="store_true",
        help="also build the collector's copy (one checkpoint a step through the same StoreMaintainer) "
        "at each size and record its size and files (no page timings)",
    )
    p.add_argument("--add-step", type=int, default=2000, help="steps of the add_step timing (0: skip)")
    p.add_argument("--out", type=Path, help="write the results as JSON here")
    args = p.parse_args(argv)
    sizes = sorted(set(args.steps or [10_000]))
    pages = tuple(x for x in args.pages.split(",") if x)
    if not set(pages) <= {*PAGES, "replay"}:
        p.error(f"--pages {args.pages}: each one of {', '.join((*PAGES, 'replay'))}")
    for n in sizes:
        if n < 1000 or n % 1000:
            p.error(f"--steps {n}: must be a multiple of 1,000 (one segment), at least 1,000")
    if args.runs < 2:
        p.error(f"--runs {args.runs}: at least 2 (Compare opens two)")
    shape = {"layers": args.layers, "experts": args.experts, "ranks": args.ranks,
             "incident_every": args.incident_every, "recent": args.recent, "radius": args.radius}  # fmt: skip
    res: dict[str, Any] = {
        "command": "python bench/scale/month_run.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commit": subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip(),  # fmt: skip
        "machine": f"{platform.machine()}, {os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}",
        "sizes": sizes,
        "rev": args.same_store_rev,
        "results": {},
    }
    for n in sizes:
        builds = [("new", ROOT)]
        if args.baseline and n <= args.baseline_max:
            builds.append(("baseline", baseline_tree(args.baseline_rev)))
        for label, code in builds:
            root = args.dir / f"{label}-{n}"
            run = ensure(root, label, {**shape, "steps": n})
            runs = runs_dir_with(root, args.runs)
            build = root / "build.json"
            res["results"][f"{label}-{n}"] = {
                "build": json.loads(build.read_text()) if build.is_file() else None,
                "store": store_stats(run),
                "measured": measure(
                    run,
                    runs,
                    code,
                    args.repeat,
                    label == "new" or n <= args.baseline_replay_max,
                    pages,
                ),
            }
            if label == "new" and args.same_store_rev:  # the same files, the other revision's code
                res["results"][f"{label}-{n}"]["measured_rev"] = measure(
                    run, runs, baseline_tree(args.same_store_rev), args.repeat, True, pages
                )
            print(
                json.dumps({label: n, **res["results"][f"{label}-{n}"]["measured"]}, default=float),
                file=sys.stderr,
            )
        if args.collector_copy:
            root = args.dir / f"collector-{n}"
            run = ensure(root, "collector", {**shape, "steps": n, "flush_every": 1})
            build = root / "build.json"
            res["results"][f"collector-{n}"] = {
                "build": json.loads(build.read_text()) if build.is_file() else None,
                "store": store_stats(run),
                "files": tail_files(run, n),
            }
            print(
                json.dumps({"collector": n, **res["results"][f"collector-{n}"]}, default=float),
                file=sys.stderr,
            )
    if len(sizes) > 1:
        ms = [res["results"][f"new-{n}"]["measured"] for n in sizes]
        res["growth"] = {k: growth(sizes, [m[k]["cpu_s"] for m in ms]) for k in pages}
        if "replay" in pages:
            res["growth"]["replay_rss"] = growth(sizes, [m["replay"]["peak_rss_mb"] for m in ms])
    if args.add_step:
        with tempfile.TemporaryDirectory() as td:
            res["add_step"] = add_step_latency(args.add_step, args.layers, args.experts, Path(td) / "r")
    md = markdown(res)
    print(md)
    if args.out:
        args.out.write_text(json.dumps(res, indent=1, default=float))
    biggest = res["results"][f"new-{sizes[-1]}"]["measured"]
    ok = all(biggest[p]["wall_s"] < TARGET_PAGE_S for p in PAGES if p in pages) and (
        "replay" not in pages or biggest["replay"]["peak_rss_mb"] < TARGET_REPLAY_MB
    )
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
