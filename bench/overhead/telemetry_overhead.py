"""Step time with full telemetry + guard vs telemetry off, same process, interleaved.

Two Trainers on the same config and seed; blocks of --block steps alternate between them
(A B A B ...) so machine-load drift hits both equally. Overhead = median paired block ratio - 1.

    python bench/overhead/telemetry_overhead.py --steps 200 --block 10 --write-docs

Writes docs/BENCHMARKS.md › Overhead › Telemetry overhead (issue 2).
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

import numpy as np

from trainer.cli import DEFAULT_CONFIG
from trainer.config import load_config
from trainer.loop import Trainer


def make(telemetry: bool, config: Path, run_dir: Path, overrides: dict) -> Trainer:
    cfg = load_config(
        config,
        {
            "telemetry.enabled": telemetry,
            "telemetry.profile": False,
            "train.checkpoint_every": 0,
            **overrides,
        },
    )
    return Trainer(cfg, run_dir, progress=False)


def block(t: Trainer, n: int) -> list[float]:
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        t.train_step()
        t.step += 1
        if t.telemetry:
            t.guard.after_step(t.step, {"opt_step": t.opt_step})
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    ap.add_argument("--steps", type=int, default=200, help="measured steps per variant")
    ap.add_argument("--block", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is steadiest on a busy box)")
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    ov = {"train.steps": args.steps + args.warmup + 10, "train.threads": args.threads}
    on, off = make(True, args.config, tmp / "on", ov), make(False, args.config, tmp / "off", ov)
    block(on, args.warmup)
    block(off, args.warmup)
    t_on: list[float] = []
    t_off: list[float] = []
    ratios = []
    for i in range(args.steps // args.block):
        first, second = (on, off) if i % 2 == 0 else (off, on)  # alternate who goes first
        a, b = block(first, args.block), block(second, args.block)
        x_on, x_off = (a, b) if first is on else (b, a)
        t_on += x_on
        t_off += x_off
        ratios.append(statistics.median(x_on) / statistics.median(x_off))
        print(
            f"block {i}: on {statistics.median(x_on) * 1e3:.1f} ms  off {statistics.median(x_off) * 1e3:.1f} ms",
            flush=True,
        )
    on.store.close()
    overhead = statistics.median(ratios) - 1
    lo, hi = np.percentile(np.array(ratios) - 1, [25, 75])
    from bench.common.docs import machine_line, write_section

    body = f"""## Telemetry overhead (issue 2)

`python bench/overhead/telemetry_overhead.py --steps {args.steps} --block {args.block} --threads {args.threads} --write-docs` ({machine_line()})

Tiny config (`configs/tiny.toml`), CPU. "on" = probe (per-layer grad norms, router stats, one host copy),
detectors, policy, snapshot ring and run-store writes; "off" = the plain loop (`telemetry.enabled = false`:
`clip_grad_norm_`, `optimizer.step()`, one `loss.item()`). Blocks of {args.block} steps alternate A B A B.

| variant | median step time | steps |
|---|---|---|
| telemetry + guard on | {statistics.median(t_on) * 1e3:.1f} ms | {len(t_on)} |
| telemetry off | {statistics.median(t_off) * 1e3:.1f} ms | {len(t_off)} |

**Overhead: {overhead:+.2%}** (median of {len(ratios)} paired block ratios; interquartile range {lo:+.2%} .. {hi:+.2%}).
Target: at most 3% on CPU. No GPU was lent to this session, so the GPU target (1%) is not measured here.
"""
    print(body)
    if args.write_docs:
        write_section("telemetry_overhead", body)


if __name__ == "__main__":
    main()
