"""What the precursor signals add to the guard's per-step cost: GuardedStep with
`[guard.precursor] enabled = false` (A) against the default, precursors on (B), interleaved in one
process (A B / B A block pairs, as bench/overhead/integration_overhead.py does, whose model builder, batches
and block timer this reuses). Both variants run the whole guard; the difference is the update
sampler's hooks around optimizer.step(), the extra numbers in the probe's one host copy and the
host-side bincounts (and, with --adam-v, the pass over Adam's second moments).

    python bench/overhead/precursor_overhead.py --families mixtral --blocks 6

Writes docs/BENCHMARKS.md › Detection › Precursor signals: lead time on an LR ramp, and their cost
(issue #16) (its cost table).
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

import numpy as np
import torch

from bench.overhead.integration_overhead import CLIP, LR, bootstrap_median, byte_batches, run_block
from guard.api import GuardedStep
from guard.core.config import GuardConfig, PrecursorConfig
from guard.integrations.tiny import build
from guard.integrations.transformers import attach
from trainer.data import stdlib_corpus


class Variant:
    def __init__(
        self, family: str, seed: int, corpus: np.ndarray, run_dir: Path, pre: PrecursorConfig
    ) -> None:
        self.data = byte_batches(corpus, batch=4, seq=64, seed=seed)
        self.model = build(family, seed=seed)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR)
        self.guarded = GuardedStep(
            self.model,
            self.opt,
            attach=attach(self.model),
            run_dir=run_dir,
            max_lr=LR,
            grad_clip=CLIP,
            config=GuardConfig(precursor=pre),
        )

    def step(self, x: torch.Tensor) -> None:
        loss = self.model(input_ids=x, labels=x).loss
        loss.backward()
        self.guarded.step(loss, tokens=x.numel())


def measure(family: str, args: argparse.Namespace, corpus: np.ndarray, tmp: Path) -> dict[str, Any]:
    on = PrecursorConfig(adam_v_ratio=args.adam_v)
    a = Variant(family, args.seed, corpus, tmp / f"{family}-a", PrecursorConfig(enabled=False))
    b = Variant(family, args.seed, corpus, tmp / f"{family}-b", on)
    run_block(a, args.warmup)  # type: ignore[arg-type]
    run_block(b, args.warmup)  # type: ignore[arg-type]
    wall, cpu, t_a, t_b = [], [], [], []
    for i in range(args.blocks):
        first, second = (a, b) if i % 2 == 0 else (b, a)
        r1, r2 = run_block(first, args.steps_per_block), run_block(second, args.steps_per_block)  # type: ignore[arg-type]
        (xa, ca), (xb, cb) = (r1, r2) if first is a else (r2, r1)
        t_a += xa
        t_b += xb
        wall.append(sum(xb) / sum(xa) - 1)
        cpu.append(cb / ca - 1)
    a.guarded.close()
    b.guarded.close()
    lo, hi = bootstrap_median(np.array(wall), seed=args.seed)
    sampler = b.guarded.probe.precursors.updates  # type: ignore[union-attr]
    n = sum(p.numel() for p in b.model.parameters())
    return {
        "family": family,
        "median_step_ms_off": 1e3 * statistics.median(t_a),
        "median_step_ms_on": 1e3 * statistics.median(t_b),
        "added_wall": float(np.median(wall)),
        "added_wall_ci95": [lo, hi],
        "added_cpu": float(np.median(cpu)),
        "sampled_weights": sampler.n_sampled,
        "weights": n,
    }


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default="mixtral")
    ap.add_argument("--blocks", type=int, default=6)
    ap.add_argument("--steps-per-block", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--adam-v", action="store_true", help="also measure the Adam second-moment ratio")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    corpus = stdlib_corpus(2_000_000)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for fam in args.families.split(","):
            r = measure(fam, args, corpus, Path(tmp))
            lo, hi = r["added_wall_ci95"]
            print(
                f"{fam}: median step {r['median_step_ms_off']:.2f} ms -> {r['median_step_ms_on']:.2f} ms; "
                f"added wall {r['added_wall']:+.2%} (95% CI {lo:+.2%} .. {hi:+.2%}), CPU {r['added_cpu']:+.2%}; "
                f"sample {r['sampled_weights']:,} of {r['weights']:,} weights"
            )
    print(f"({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
