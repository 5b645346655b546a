"""The A/B canary on the user's own training (`moeguard canary --ab --script`): false alarms on
A = A and detection of an injected slowdown, on this machine, with real canaries.

    python bench/canary/canary_own_power.py --clean 3 --trials 3 --out OUT.json --write-docs

Each canary is `moeguard canary --ab set: set: --script "python bench/common/hf_trainer_job.py --steps S
--out {run_dir}/out"` (the real transformers Trainer with MoEGuardCallback on tiny Mixtral, its run
store from $MOEGUARD_RUN_DIR) at the canary's defaults (6 pairs, up to 12 while undecided, a 1%
line) unless --set says otherwise; `--trials` of them with `--inject slow:PCT` (B slowed),
interleaved with the `--clean` ones (clean, slowed, clean, ...) so the host's drift hits both
arms. A clean canary that fails is a false alarm; a slowed one that fails is a detection. Every
per-pair B/A ratio is kept: their spread on the clean arm is the per-pair noise the sign test works
against. Each canary is 12-24 fresh Trainer processes: minutes each on a shared 2-core host.

Writes docs/BENCHMARKS.md › Canaries › A/B canary on your own training (`moeguard canary --ab
--script`, issue #27) and, with `--torchtitan`, › A/B canary on torchtitan's own Trainer (`moeguard
canary --ab --torchtitan`, issue #27); with `--neighbour` (a bursty process on the other CPUs), the
same titles with ", beside a neighbour".
"""

from __future__ import annotations

import sys
from pathlib import Path as _P

sys.path.insert(0, str(_P(__file__).resolve().parents[2]))  # `python bench/<group>/x.py` from a checkout

import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = _P(__file__).resolve().parents[2]


def one(
    tmp: Path, i: int, *, steps: int, slow: float, sets: list[str], torchtitan: str | None
) -> dict[str, Any]:
    """One real canary; its verdict, ratios, elapsed time and load."""
    from guard.cli import main

    if torchtitan is None:
        job = (
            f"python {REPO / 'bench' / 'common' / 'hf_trainer_job.py'} --steps {steps} --out {{run_dir}}/out"
        )
        target = ["--script", job]
    else:
        target = ["--torchtitan", torchtitan, "--steps", str(steps)]
    argv = [
        "canary",
        "--ab",
        "set:",
        "set:",
        *target,
        "--runs",
        str(tmp / f"c{i}"),
        "--report-dir",
        str(tmp / f"r{i}"),
    ]
    argv += [x for s in sets for x in ("--set", s)]
    if slow:
        argv += ["--inject", f"slow:{slow:g}"]
    t0 = time.perf_counter()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(argv)
    rep = json.loads((tmp / f"r{i}" / "ab.json").read_text())
    return {
        "arm": f"slow {slow:g}%" if slow else "clean",
        "exit": code,
        "verdict": rep["verdict"],
        "median": rep["statistic"]["median"],
        "ci": rep["statistic"]["ci"],
        "pairs": [p["ratio"]["speed"] for p in rep["pairs"]],
        # the same pairs before the yardstick: tokens per CPU-second alone (guard/canary/own.py)
        "raw_pairs": [p["ratio"]["tokens_per_s"] for p in rep["pairs"]],
        "wall_ratio": (rep["other_ratios"].get("tokens_per_s_wall") or {}).get("median"),
        "timing": rep["timing"],
        "elapsed_s": time.perf_counter() - t0,
        "load": os.getloadavg()[0],
    }


BURST_S, REST_S = 2.5, 1.7  # --neighbour's rhythm: on and off out of phase with the ~3-5 s worker runs
NEIGHBOUR = f"""
import os, time, numpy as np
a = np.random.default_rng(0).random((700, 700), dtype=np.float32)
while True:
    t = time.monotonic()
    while time.monotonic() - t < {BURST_S}:
        a = a @ a
        a /= np.abs(a).max()
    time.sleep({REST_S})
"""


@contextlib.contextmanager
def neighbour(on: bool) -> Iterator[None]:
    """With `on`: this process (and every canary it starts) on the first CPU, a bursty numpy
    neighbour on the rest, one BLAS thread; stopped on the way out."""
    if not on:
        yield
        return
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise SystemExit("--neighbour needs 2 CPUs or more")
    os.sched_setaffinity(0, {cpus[0]})
    env = {**os.environ, "OMP_NUM_THREADS": "1", "OPENBLAS_NUM_THREADS": "1"}
    p = subprocess.Popen(
        [sys.executable, "-c", NEIGHBOUR], env=env, preexec_fn=lambda: os.sched_setaffinity(0, set(cpus[1:]))
    )
    try:
        yield
    finally:
        p.kill()
        p.wait()
        os.sched_setaffinity(0, set(cpus))


def markdown(res: dict[str, Any]) -> str:
    rows = []
    for c in res["canaries"]:
        lo, hi = c["ci"]
        rows.append(
            f"| {c['arm']} | {c['verdict']} | {c['median']:.4f} | [{lo:.4f}, {hi:.4f}] | {len(c['pairs'])} | "
            f"{c['wall_ratio']:.3f} | {c['elapsed_s'] / 60:.1f} min | {c['load']:.1f} |"
            if c["wall_ratio"] is not None
            else f"| {c['arm']} | {c['verdict']} | {c['median']:.4f} | [{lo:.4f}, {hi:.4f}] | {len(c['pairs'])} | — | "
            f"{c['elapsed_s'] / 60:.1f} min | {c['load']:.1f} |"
        )
    s = res["summary"]
    tt = res["config"].get("torchtitan")
    neighbour_line = (
        f"\nBeside a neighbour (`--neighbour`): the canaries pinned to one CPU, bursts of numpy matmuls"
        f"\non the other ({BURST_S:g} s on, {REST_S:g} s off), as beside a test in scripts/test's pinned phase."
        if res["config"].get("neighbour")
        else ""
    )
    if tt is None:
        title = "A/B canary on your own training (`moeguard canary --ab --script`, issue #27)"
        what = f"""`moeguard canary --ab set: set: --script "python bench/common/hf_trainer_job.py --steps {res["config"]["steps"]}
--out {{run_dir}}/out"`: the real transformers Trainer with `MoEGuardCallback` on tiny Mixtral (256 tokens a
step, 1 torch thread) in a fresh process per worker"""
    else:
        title = "A/B canary on torchtitan's own Trainer (`moeguard canary --ab --torchtitan`, issue #27)"
        what = f"""`moeguard canary --ab set: set: --torchtitan "{tt}" --steps {res["config"]["steps"]}`:
torchtitan 0.3.0's own Trainer under `torchrun` (one rank, gloo, CPU) through moeguard's launcher
(`python -m guard.integrations.torchtitan`), a fresh torchrun per worker"""
    if res["config"].get("neighbour"):
        title = title.replace(" (`moeguard", ", beside a neighbour (`moeguard", 1)
    return f"""## {title}

`{res["command"]}` ({res["machine"]}; {res["date"]}; {res["wall_s"] / 60:.1f} min)

Each canary: {what}, its steady state (steps from canary.warmup_steps =
{res["config"]["warmup"]}) read back from the run store it wrote; on this CPU host the speed is tokens per
CPU-second of the command's process tree, sampled from /proc (timing: {s["timing"]}); canary settings:
{", ".join(res["config"]["sets"]) or "the defaults (6 pairs, up to 12 while undecided)"}, fail below 0.99 (canary.ab_fail_pct = 1).
Clean = A = A; slowed = `--inject slow:{res["config"]["slow"]:g}`
(B's guard burns {res["config"]["slow"]:g}% more CPU a step, inside the step). Arms interleaved.{neighbour_line}
Verdicts (guard/canary/ab.py): fail = the sign-test interval of the median B/A wholly under the
line (exit 1, the only verdict that fails CI); warn = the median under the line with the interval
reaching it, or the interval wholly under 1 but not under the line (exit 0, said in the report).

| arm | verdict | median B/A | interval | pairs | wall-clock B/A | time | load |
|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}

**False alarms: {s["false_alarms"]} of {s["clean"]} A = A canaries; {s["slow"]:g}% slowdown caught (fail) in
{s["caught"]} of {s["trials"]}.** Per-pair B/A on the clean arm: median {s["clean_pair_median"]:.4f}, sd
{s["clean_pair_sd"]:.4f} over {s["clean_pairs"]} pairs (the noise the sign test works against; the same pairs
without the yardstick GuardedStep times beside each step, tokens per CPU-second alone: sd
{s.get("clean_raw_pair_sd", float("nan")):.4f}); on the slowed
arm median {s["slow_pair_median"]:.4f}. {s["clean"]} A = A canaries bound the false-alarm rate only
coarsely (0 of 10 is consistent with a rate up to ~26% at 95%); the rule's own bound when every pair must
fall below the line, n pairs: at most 2^-n when the per-pair ratios are symmetric about 1, 6.3% at 4
pairs, 1.6% at 6.
"""


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clean", type=int, default=3, help="A = A canaries")
    ap.add_argument("--trials", type=int, default=3, help="canaries with B slowed")
    ap.add_argument("--slow", type=float, default=10.0, help="B's injected slowdown, percent")
    ap.add_argument("--steps", type=int, default=60, help="Trainer steps per worker run")
    ap.add_argument("--warmup", type=int, default=20, help="canary.warmup_steps")
    ap.add_argument("--set", action="append", default=[], help="more canary settings, e.g. canary.ab_pairs=4")
    ap.add_argument(
        "--torchtitan",
        default=None,
        metavar="ARGS",
        help="canary torchtitan's Trainer on this job instead of the Trainer script, e.g. "
        '"--module bench.common.torchtitan_registry --config debugmodel_cpu"',
    )
    ap.add_argument(
        "--neighbour",
        action="store_true",
        help="pin the canaries to the first CPU and run bursts of numpy matmuls on the others "
        f"({BURST_S:g} s on, {REST_S:g} s off), as a test beside them in scripts/test's pinned phase",
    )
    ap.add_argument("--out", type=Path)
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args(argv)
    from bench.common.docs import machine_line, shown_command, write_section

    sets = [f"canary.warmup_steps={args.warmup}", *args.set]
    todo: list[str] = []  # clean, slowed, clean, ...: the host's drift hits both arms
    for k in range(max(args.clean, args.trials)):
        todo += (["clean"] if k < args.clean else []) + (["slow"] if k < args.trials else [])
    t0 = time.perf_counter()
    canaries = []
    with neighbour(args.neighbour), tempfile.TemporaryDirectory(prefix="moeguard-own-canary-") as tmp:
        for i, arm in enumerate(todo):
            c = one(
                Path(tmp),
                i,
                steps=args.steps,
                slow=args.slow if arm == "slow" else 0.0,
                sets=sets,
                torchtitan=args.torchtitan,
            )
            canaries.append(c)
            print(
                f"{i + 1}/{len(todo)} {c['arm']}: {c['verdict']} median {c['median']:.4f} {c['ci']} "
                f"{c['elapsed_s']:.0f} s load {c['load']:.1f}",
                file=sys.stderr,
                flush=True,
            )
    clean = [c for c in canaries if c["arm"] == "clean"]
    slow = [c for c in canaries if c["arm"] != "clean"]
    cp = [r for c in clean for r in c["pairs"]]
    cp_raw = [r for c in clean for r in c["raw_pairs"]]
    sp = [r for c in slow for r in c["pairs"]]
    res = {
        "command": shown_command("bench/canary/canary_own_power.py", sys.argv[1:] if argv is None else argv),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": machine_line(),
        "config": {
            "steps": args.steps,
            "warmup": args.warmup,
            "slow": args.slow,
            "sets": args.set,
            "torchtitan": args.torchtitan,
            "neighbour": args.neighbour,
        },
        "wall_s": time.perf_counter() - t0,
        "canaries": canaries,
        "summary": {
            "clean": len(clean),
            "false_alarms": sum(c["verdict"] == "fail" for c in clean),
            "trials": len(slow),
            "caught": sum(c["verdict"] == "fail" for c in slow),
            "slow": args.slow,
            "clean_pairs": len(cp),
            "clean_pair_median": statistics.median(cp) if cp else float("nan"),
            "clean_pair_sd": statistics.stdev(cp) if len(cp) > 1 else float("nan"),
            "clean_raw_pair_sd": statistics.stdev(cp_raw) if len(cp_raw) > 1 else float("nan"),
            "slow_pair_median": statistics.median(sp) if sp else float("nan"),
            "timing": ", ".join(sorted({c["timing"] for c in canaries})),
        },
    }
    print(json.dumps(res["summary"], indent=1))
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=1))
    if args.write_docs:
        name = "canary_own_power" + ("" if args.torchtitan is None else "_torchtitan")
        write_section(name + ("_neighbour" if args.neighbour else ""), markdown(res))
    return res


if __name__ == "__main__":
    main()
