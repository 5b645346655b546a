"""What `[guard.rerun]` costs in moeguard's trainer (trainer/rerun.py): on a clean step (the copy of
the guard's state it keeps, to put it back after a clean recompute) and on a flagged step (the
recompute). Three trainers on the same config and seed, stepped in turn (the order reversed every
step, so the machine's drift is shared):

    off    guard.rerun off
    on     guard.rerun on, no fault: every step pays the state copy, none is recomputed
    flip   guard.rerun on, `--inject flip@S` every `--every` steps: each flipped step is flagged,
           recomputed (transient) and applied from the recompute, so it trains like the others

    python bench/overhead/rerun_overhead.py --config tests/data/micro.toml --steps 240

Writes docs/BENCHMARKS.md › Overhead › Rerun check cost (`[guard.rerun]`, issue #16).
"""

from __future__ import annotations

import sys
from pathlib import Path as _P

sys.path.insert(0, str(_P(__file__).resolve().parents[2]))  # `python bench/<group>/x.py` from a checkout

import argparse
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from guard.core import schema
from trainer.config import load_config
from trainer.inject import parse_injection
from trainer.loop import Trainer


def trainer(config: Path, run_dir: Path, *, rerun: bool, flips: list[int], steps: int) -> Trainer:
    cfg = load_config(
        config, {"train.steps": steps, "train.checkpoint_every": 0, "guard.rerun.enabled": rerun}
    )
    return Trainer(cfg, run_dir, injections=[parse_injection(f"flip@{s}") for s in flips], progress=False)


def timed_step(t: Trainer) -> float:
    t0 = time.perf_counter()
    t.train_step()
    dt = time.perf_counter() - t0
    t.step += 1
    t.guard.after_step(t.step, {"opt_step": t.opt_step})
    return dt


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", type=Path, default=Path("tests/data/micro.toml"))
    ap.add_argument("--steps", type=int, default=240)
    ap.add_argument("--warmup", type=int, default=40, help="steps not timed (compilation, allocator)")
    ap.add_argument("--every", type=int, default=10, help="a flip every N timed steps")
    args = ap.parse_args(argv)
    flips = list(range(args.warmup + args.every // 2, args.steps, args.every))
    with tempfile.TemporaryDirectory() as tmp:
        runs = {
            "off": trainer(args.config, Path(tmp) / "off", rerun=False, flips=[], steps=args.steps),
            "on": trainer(args.config, Path(tmp) / "on", rerun=True, flips=[], steps=args.steps),
            "flip": trainer(args.config, Path(tmp) / "flip", rerun=True, flips=flips, steps=args.steps),
        }
        times: dict[str, list[float]] = {k: [] for k in runs}
        order = list(runs)
        for s in range(args.steps):
            order.reverse()
            for k in order:
                dt = timed_step(runs[k])
                if s >= args.warmup:
                    times[k].append(dt)
        reruns = runs["flip"].state.counts  # every flipped step applied (transient), none skipped
        for t in runs.values():
            t.store.close()
    flip_ix = {s - args.warmup for s in flips}
    flagged = [x for i, x in enumerate(times["flip"]) if i in flip_ix]
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    out = {
        "config": str(args.config),
        "timed_steps": args.steps - args.warmup,
        "clean_step_ms_off": med["off"],
        "clean_step_ms_on": med["on"],
        "clean_overhead": med["on"] / med["off"] - 1,
        "flagged_step_ms": statistics.median(flagged) * 1e3,
        "flagged_vs_clean": statistics.median(flagged) * 1e3 / med["off"],
        "flagged_steps": len(flagged),
        "flip_run_actions": dict(reruns),
    }
    assert reruns.get(schema.ACT_SKIP, 0) == 0, reruns  # every flip was recomputed and applied
    for k, v in out.items():
        print(f"{k:>18}: {v:.4g}" if isinstance(v, float) else f"{k:>18}: {v}")
    return out


if __name__ == "__main__":
    main()
