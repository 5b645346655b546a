"""Replay a recorded clean run under guard settings: the actions they would take on it, and how many
offline gradient spikes (total and every layer's grad norm x FACTOR at one step, the loss unchanged:
what `moeguard train --inject gradspike@STEP:FACTOR` does to the numbers the detectors see) they
catch, one spike per copy of the run.

    python bench/detection/spike_replay.py RUN_DIR --guard configs/tiny.toml --factor 4 --at 400,500,600,700,800,900

A spike counts as caught when the replay would act (skip, roll back, halt) at its step or the next.
Uses `moeguard replay --json`, the same detectors and policy as a live run.

Writes docs/BENCHMARKS.md › Detection › Spike rules on configs/tiny.toml (issue #16) (its replay
rows).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import polars as pl


def replay(run_dir: Path, guard: str) -> list[dict]:
    p = subprocess.run(
        [sys.executable, "-m", "guard", "replay", str(run_dir), "--guard", guard, "--json"],
        capture_output=True,
        text=True,
    )
    if p.returncode != 0:
        raise SystemExit(f"moeguard replay failed on {run_dir}:\n{p.stderr[-2000:]}")
    return [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]


def acting(verdicts: list[dict]) -> list[dict]:
    return [v for v in verdicts if v.get("would") not in (None, "none")]


def with_spike(run_dir: Path, step: int, factor: float, into: Path) -> Path:
    """A copy of the run with the grad norms of `step` (total and per layer) multiplied by factor."""
    copy = into / run_dir.name
    shutil.copytree(run_dir, copy)
    for table in ("steps", "layers"):
        for f in sorted((copy / table).glob("*.parquet")):
            df = pl.read_parquet(f)
            if "grad_norm" in df.columns and (df["step"] == step).any():
                scaled = pl.when(pl.col("step") == step).then(pl.col("grad_norm") * factor)
                df.with_columns(scaled.otherwise(pl.col("grad_norm")).alias("grad_norm")).write_parquet(f)
    return copy


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", type=Path, help="a recorded clean run (runs/<id>)")
    ap.add_argument("--guard", required=True, help="guard settings (a TOML with a [guard] table)")
    ap.add_argument("--factor", type=float, default=4.0, help="spike size (default 4)")
    ap.add_argument("--at", default="400,500,600,700,800,900", help="steps to spike, one copy each")
    args = ap.parse_args(argv)
    if not (args.run_dir / "steps").is_dir():
        ap.error(f"{args.run_dir}: not a run folder (no steps/ table)")
    steps = [int(s) for s in args.at.split(",") if s.strip()]
    clean = acting(replay(args.run_dir, args.guard))
    print(f"clean run: {len(clean)} actions {[(v['step'], v['detector'], v['would']) for v in clean][:10]}")
    caught = 0
    for s in steps:
        with tempfile.TemporaryDirectory() as tmp:
            hits = [
                v for v in acting(replay(with_spike(args.run_dir, s, args.factor, Path(tmp)), args.guard))
            ]
        hits = [v for v in hits if s <= v["step"] <= s + 1]
        caught += bool(hits)
        what = [(v["detector"], v.get("layer"), v["would"]) for v in hits][:2]
        print(f"x{args.factor:g} at step {s}: {'caught ' + str(what) if hits else 'missed'}")
    print(f"caught {caught}/{len(steps)} x{args.factor:g} spikes; {len(clean)} actions on the clean run")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
