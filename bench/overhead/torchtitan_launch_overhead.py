"""The guard's overhead inside torchtitan's own Trainer on two ranks, streaming, launch by launch.

    python bench/overhead/torchtitan_launch_overhead.py --pairs 4 --steps 40 --json OUT.json --write-docs

A = `torchrun --nproc_per_node 2 -m guard.integrations.torchtitan --no-guard ...` (torchtitan's
own Trainer, unguarded); B = the same command guarded, streaming every rank to a real collector
on loopback (`--collector`), writing the run store and checkpoint-phase beats. Both run
torchtitan's DeepSeek-V3 `debugmodel` (bench/common/torchtitan_registry.py `debugmodel_cpu`: 256 tokens a
rank a step, FSDP over the two ranks, gloo, CPU, one thread a rank). Launches alternate A B / B A;
each launch's step time is the median over its steady steps (after `--warmup`) of the interval
between consecutive steps' first loss on rank 0 ($MOEGUARD_TT_TIMING_DIR, the same probe in both),
and each pair gives B/A - 1. Overhead = median over pairs, with a 95% bootstrap interval.

Writes docs/BENCHMARKS.md › Overhead › Guard overhead inside torchtitan's Trainer, 2 ranks,
streaming (debugmodel).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))  # `python bench/<group>/x.py` from a checkout
TOKEN = "bench-token"

from bench.common.torchtitan_launch import torchrun_command  # noqa: E402


def launch(
    tmp: Path, name: str, *, guarded: bool, steps: int, collector: str | None, config: str
) -> list[float]:
    """One torchrun launch; rank 0's step intervals (s)."""
    timing = tmp / f"{name}-times"
    timing.mkdir()
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "MOEGUARD_TOKEN": TOKEN,
        "MOEGUARD_TT_TIMING_DIR": str(timing),
    }
    cmd = torchrun_command(
        2,
        config,
        "--training.steps",
        str(steps),
        "--dump_folder",
        str(tmp / name / "out"),
        "--checkpoint.interval",
        "100000",
    )
    cmd += (
        ["--run-dir", str(tmp / "runs" / name), "--collector", str(collector)] if guarded else ["--no-guard"]
    )
    with open(tmp / f"{name}.log", "wb") as log:
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        raise SystemExit(f"{name}: torchrun exited {rc}; log:\n{(tmp / f'{name}.log').read_text()[-3000:]}")
    t = [float(line.split()[1]) for line in (timing / "times-r0.txt").read_text().splitlines()]
    return list(np.diff(t))


def bootstrap_median(x: np.ndarray, n: int = 2000, seed: int = 0) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    meds = np.median(rng.choice(x, size=(n, len(x)), replace=True), axis=1)
    return float(np.quantile(meds, 0.025)), float(np.quantile(meds, 0.975))


def start_collector(tmp: Path) -> tuple[subprocess.Popen, str]:
    port_file = tmp / "collector.port"
    proc = subprocess.Popen(
        [sys.executable, "-m", "guard", "collector", "--port", "0", "--port-file", str(port_file)]
        + ["--runs", str(tmp / "collector-runs"), "--log-level", "warning"],
        cwd=REPO,
        env={**os.environ, "MOEGUARD_TOKEN": TOKEN, "PYTHONPATH": str(REPO)},
    )
    deadline = time.monotonic() + 60
    while not port_file.is_file():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit("the collector did not start")
        time.sleep(0.1)
    return proc, f"http://127.0.0.1:{int(port_file.read_text())}"


def measure(pairs: int, steps: int, warmup: int, config: str, progress: bool) -> dict[str, Any]:
    ratios, med_a, med_b = [], [], []
    with tempfile.TemporaryDirectory(prefix="moeguard-tt-launch-") as d:
        tmp = Path(d)
        collector, url = start_collector(tmp)
        try:
            for i in range(pairs):
                order = (False, True) if i % 2 == 0 else (True, False)
                got: dict[bool, float] = {}
                for guarded in order:
                    name = f"{'b' if guarded else 'a'}{i}"
                    dt = launch(tmp, name, guarded=guarded, steps=steps, collector=url, config=config)
                    got[guarded] = statistics.median(dt[warmup:])
                med_a.append(got[False])
                med_b.append(got[True])
                ratios.append(got[True] / got[False] - 1)
                if progress:
                    print(
                        f"pair {i + 1}/{pairs}: A {got[False] * 1e3:.1f} ms, B {got[True] * 1e3:.1f} ms, "
                        f"{ratios[-1]:+.2%}",
                        file=sys.stderr,
                    )
            import httpx

            auth = {"Authorization": f"Bearer {TOKEN}"}
            runs = httpx.get(f"{url}/v1/runs", headers=auth, timeout=30).json().get("runs", [])
        finally:
            collector.terminate()
            collector.wait(30)
    r = np.array(ratios)
    lo, hi = bootstrap_median(r)
    return {
        "pairs": pairs,
        "steps": steps,
        "warmup": warmup,
        "median_step_s_plain": statistics.median(med_a),
        "median_step_s_guarded": statistics.median(med_b),
        "overhead": float(np.median(r)),
        "overhead_ci95": [lo, hi],
        "pair_ratios": [float(x) for x in r],
        "runs_streamed": sum(1 for x in runs if str(x.get("run", "")).startswith("b")),
    }


def markdown(res: dict[str, Any]) -> str:
    f = res["result"]
    lo, hi = f["overhead_ci95"]
    verdict = "met" if f["overhead"] <= 0.03 else "NOT met"
    pairs = ", ".join(f"{x:+.1%}" for x in f["pair_ratios"])
    return f"""## Guard overhead inside torchtitan's Trainer, 2 ranks, streaming (debugmodel)

`{res["command"]}` ({res["machine"]}; {res["wall_s"] / 60:.1f} min)

A = `torchrun --nproc_per_node 2 -m guard.integrations.torchtitan --no-guard --module
bench.common.torchtitan_registry --config {res["config"]}` (torchtitan's own Trainer, unguarded);
B = the same guarded, streaming both ranks to a real collector on loopback. torchtitan 0.3.0
DeepSeek-V3 debugmodel, FSDP over 2 ranks on gloo, 1 thread a rank, 256 tokens a rank a step.
Each launch: {f["steps"]} steps, the first {f["warmup"]} unmeasured; its step time is the median
interval between consecutive steps on rank 0. Launches alternate A B / B A; overhead = median
over pairs of B/A - 1, 95% bootstrap interval. {f["runs_streamed"]} of {f["pairs"]} guarded runs
reached the collector.

| pairs | median step A | median step B | overhead | 95% CI | pair ratios |
|---|---|---|---|---|---|
| {f["pairs"]} | {f["median_step_s_plain"] * 1e3:.0f} ms | {f["median_step_s_guarded"] * 1e3:.0f} ms | **{f["overhead"]:+.2%}** | {lo:+.2%} .. {hi:+.2%} | {pairs} |

Target: at most 3% on CPU at this step size: **{verdict}**.
"""


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=4, help="A/B launch pairs (default 4)")
    ap.add_argument("--steps", type=int, default=40, help="steps a launch (default 40)")
    ap.add_argument("--warmup", type=int, default=10, help="unmeasured steps a launch (default 10)")
    ap.add_argument("--config", default="debugmodel_cpu", help="bench/common/torchtitan_registry.py config")
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--write-docs", action="store_true", help="write the table into docs/BENCHMARKS.md")
    ap.add_argument("--no-progress", action="store_true", help="no line per pair")
    args = ap.parse_args(argv)
    for name in ("pairs", "steps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name} {getattr(args, name)}: must be >= 1")
    if not 0 <= args.warmup < args.steps - 2:
        ap.error(f"--warmup {args.warmup}: must be in 0 .. --steps - 3")
    from bench.common.docs import machine_line, shown_command, write_section

    t0 = time.perf_counter()
    result = measure(args.pairs, args.steps, args.warmup, args.config, not args.no_progress)
    res = {
        "command": shown_command(
            "bench/overhead/torchtitan_launch_overhead.py", sys.argv[1:] if argv is None else argv
        ),
        "machine": machine_line(),
        "config": args.config,
        "wall_s": time.perf_counter() - t0,
        "result": result,
    }
    if args.json:
        args.json.write_text(json.dumps(res, indent=1))
    if args.write_docs:
        write_section("torchtitan-launch-overhead", markdown(res))
    print(markdown(res))
    return res


if __name__ == "__main__":
    main()
