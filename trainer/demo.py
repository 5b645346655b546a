"""`moeguard demo`: a fault drill. The same seed three times, side by side:

    clean              no fault, guard on
    faulty, unguarded  the faults below, guard in observe mode (verdicts recorded, no action)
    faulty, guarded    the same faults, guard on

Default faults (tiny config, 400 steps): a 100x gradient spike, a NaN gradient, a 100x LR
spike, a batch of garbage tokens and a router pushed into collapse on the last MoE layer.
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from guard.core import schema
from guard.store.reader import count_actions, read_table
from trainer.outcome import EXIT_INTERRUPTED, EXIT_PREEMPTED

DEFAULT_FAULTS = ["gradspike@100:100", "nan@140", "lrspike@180:100", "badbatch@220", "collapse@270:3"]


def configure(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = __doc__.split("\n", 2)[2]
    p.add_argument("--config", type=Path, default=None, help="training config (default: configs/tiny.toml)")
    p.add_argument("--steps", type=int, default=400, help="steps per run (default 400)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--runs", type=Path, default=Path("runs"), help="parent folder for the three runs")
    p.add_argument(
        "--inject",
        action="append",
        default=None,
        metavar="KIND@STEP[:ARG]",
        help=f"faults to inject (repeatable; default: {' '.join(DEFAULT_FAULTS)})",
    )
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads per run (0: torch's default)")
    p.add_argument("--no-progress", action="store_true")


@dataclass(slots=True)
class DrillResult:
    name: str
    run_dir: Path
    final_loss: float
    spikes: int  # step verdicts (spike, NaN, LR) recorded
    collapse: int  # collapse conditions opened
    actions: dict[str, int]
    goodput: float
    status: str
    max_maxvio_end: float  # worst layer's mean MaxVio over the last 10% of steps


def run_one(
    name: str,
    config: Path | None,
    steps: int,
    seed: int,
    run_dir: Path,
    faults: list[str],
    guard_mode: str,
    progress: bool,
    threads: int = 0,
) -> DrillResult:
    from trainer.cli import DEFAULT_CONFIG
    from trainer.config import load_config
    from trainer.inject import parse_injection
    from trainer.loop import Trainer

    overrides = {"train.steps": steps, "train.seed": seed, "guard.mode": guard_mode}
    if threads:
        overrides["train.threads"] = threads
    cfg = load_config(config or DEFAULT_CONFIG, overrides)
    t = Trainer(cfg, run_dir, injections=[parse_injection(f) for f in faults], progress=progress)
    t.run()
    return summarize_run(name, run_dir, t.goodput()["goodput"])


def summarize_run(name: str, run_dir: Path, goodput: float) -> DrillResult:
    import polars as pl

    from guard.store.reader import read_meta

    steps = read_table(run_dir, schema.TABLE_STEPS).sort("step")
    events = read_table(run_dir, schema.TABLE_EVENTS)
    layers = read_table(run_dir, schema.TABLE_LAYERS)
    n = steps.height
    tail = steps.tail(max(1, n // 10))["loss"]
    final = float(tail.mean()) if tail.is_finite().all() else float("nan")
    verdicts = events.filter(pl.col("kind") == schema.EV_VERDICT)
    spikes = verdicts.filter(pl.col("detector").is_in(list(schema.STEP_DETECTORS))).height
    collapse = verdicts.filter(pl.col("detector").is_in(list(schema.COLLAPSE_DETECTORS))).height
    actions = count_actions(run_dir)  # the one definition (guard/core/actions.py)
    last = layers.filter(pl.col("step") >= steps["step"].max() - max(1, n // 10))
    worst = float(last.group_by("layer").agg(pl.col("maxvio").mean())["maxvio"].max() or float("nan"))
    status = (read_meta(run_dir) or {}).get("status", "?")
    return DrillResult(name, run_dir, final, spikes, collapse, actions, goodput, status, worst)


def format_table(results: list[DrillResult]) -> str:
    clean = results[0].final_loss
    rows = [
        [
            "run",
            "final loss",
            "vs clean",
            "spikes seen",
            "collapses seen",
            "skipped",
            "rolled back",
            "bias fixes",
            "worst MaxVio (end)",
            "goodput",
            "status",
        ]
    ]
    for r in results:
        delta = (r.final_loss - clean) / clean if math.isfinite(r.final_loss) else float("nan")
        rows.append(
            [
                r.name,
                f"{r.final_loss:.4f}" if math.isfinite(r.final_loss) else "diverged (NaN)",
                "-" if r is results[0] else (f"{delta:+.2%}" if math.isfinite(delta) else "diverged"),
                str(r.spikes),
                str(r.collapse),
                str(r.actions.get(schema.ACT_SKIP, 0)),
                str(r.actions.get(schema.ACT_ROLLBACK, 0)),
                str(r.actions.get(schema.ACT_BIAS_CORRECT, 0)),
                f"{r.max_maxvio_end:.2f}",
                f"{r.goodput:.1%}",
                r.status,
            ]
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def drill(
    config: Path | None,
    steps: int,
    seed: int,
    parent: Path,
    faults: list[str],
    progress: bool = True,
    threads: int = 0,
) -> list[DrillResult]:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    plan = [
        ("clean", [], "act"),
        ("faulty, unguarded", faults, "observe"),
        ("faulty, guarded", faults, "act"),
    ]
    out = []
    for name, f, mode in plan:
        run_dir = parent / f"demo-{stamp}-{name.replace(', ', '-')}"
        if progress:
            print(f"\n== {name}: {run_dir}", flush=True)
        out.append(run_one(name, config, steps, seed, run_dir, f, mode, progress, threads))
        if out[-1].status in STOPPED_BY_USER:
            break  # SIGTERM or Ctrl-C stops the demo, not just the run it landed in
    return out


def warmup_notices(config: Path | None, steps: int, faults: list[str]) -> list[str]:
    """A fault that lands inside a detector's warm-up gets no verdict: say so before the drill."""
    from guard.core.warmup import notices
    from trainer.cli import DEFAULT_CONFIG
    from trainer.config import load_config
    from trainer.inject import parse_injection

    cfg = load_config(config or DEFAULT_CONFIG, {"train.steps": steps})
    return notices(cfg.guard, steps, [(i.kind, i.step, f) for f in faults for i in [parse_injection(f)]])


# A run that ended because someone stopped it: the demo stops too, with the run's exit code.
STOPPED_BY_USER = {schema.STATUS_PREEMPTED: EXIT_PREEMPTED, schema.STATUS_INTERRUPTED: EXIT_INTERRUPTED}


def run(args: argparse.Namespace) -> int:
    faults = args.inject if args.inject is not None else DEFAULT_FAULTS
    print(f"moeguard demo: {args.steps} steps x 3 runs, seed {args.seed}, faults: {' '.join(faults)}")
    for line in warmup_notices(args.config, args.steps, faults):
        print(f"moeguard demo: note: {line}")
    results = drill(
        args.config,
        args.steps,
        args.seed,
        args.runs,
        faults,
        progress=not args.no_progress,
        threads=args.threads,
    )
    print()
    print(format_table(results))
    print(f"\nruns are in {args.runs}/; explore them with: moeguard app --runs {args.runs}")
    last = results[-1]
    if last.status in STOPPED_BY_USER:
        print(f"demo stopped: the {last.name!r} run ended {last.status}; the remaining runs were not started")
        return STOPPED_BY_USER[last.status]
    return 0


def as_dict(r: DrillResult) -> dict[str, Any]:
    return {
        "name": r.name,
        "final_loss": r.final_loss,
        "spikes": r.spikes,
        "collapse": r.collapse,
        "actions": r.actions,
        "goodput": r.goodput,
        "status": r.status,
        "run_dir": str(r.run_dir),
    }
