"""Cost of the in-memory snapshot ring (take, restore) against one training step, tiny config.

python bench/overhead/snapshot_cost.py --write-docs

Writes docs/BENCHMARKS.md › Overhead › Snapshot ring and rollback cost (issue 3).
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

from guard.runtime.snapshot import SnapshotRing
from trainer.cli import DEFAULT_CONFIG
from trainer.config import load_config
from trainer.loop import Trainer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--write-docs", action="store_true")
    args = ap.parse_args()
    cfg = load_config(
        args.config, {"telemetry.profile": False, "train.checkpoint_every": 0, "train.steps": 1000}
    )
    t = Trainer(cfg, Path(tempfile.mkdtemp()) / "r", progress=False)
    for _ in range(5):  # optimizer state exists after the first step
        t.train_step()
        t.step += 1
    ring = SnapshotRing(t.model, t.opt, size=cfg.guard.policy.ring_size)
    steps, takes, restores = [], [], []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        t.train_step()
        t.step += 1
        steps.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ring.take(t.step, {"opt_step": t.opt_step})
        takes.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        ring.restore(0)
        restores.append(time.perf_counter() - t0)
    t.store.close()
    step, take, restore = (statistics.median(x) for x in (steps, takes, restores))
    every = cfg.guard.policy.snapshot_every
    n_bytes = sum(x.numel() * x.element_size() for x in ring._slots[0].model) + sum(
        v.numel() * v.element_size() for d in ring._slots[0].opt for v in d.values() if hasattr(v, "numel")
    )
    from bench.common.docs import machine_line, write_section

    body = f"""## Snapshot ring and rollback cost (issue 3)

`python bench/overhead/snapshot_cost.py --write-docs` ({machine_line()})

Tiny config, CPU, {args.repeats} repeats, medians. A snapshot copies {n_bytes / 1e6:.1f} MB (weights, buffers,
AdamW moments) into preallocated slots with one `torch._foreach_copy_`.

| what | median | vs one step |
|---|---|---|
| one training step | {step * 1e3:.1f} ms | 1 |
| take a snapshot | {take * 1e3:.2f} ms | {take / step:.2%} |
| amortised: one snapshot every {every} steps | {take / every * 1e3:.3f} ms/step | **{take / every / step:.3%}** (target at most 2%) |
| roll back (restore a snapshot) | {restore * 1e3:.2f} ms | **{restore / step:.2%}** (target below 100%) |
"""
    print(body)
    if args.write_docs:
        write_section("snapshot_cost", body)


if __name__ == "__main__":
    main()
