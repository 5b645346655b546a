"""What the max-attention-logit precursor costs per step on a config (default configs/tiny.toml).

Two measurements, CPU time (process_time: on a shared box wall time mostly measures the others):
  piece   LogitWatch.observe on q, k of the config's shape, once per layer (what one sampled step
          adds to the forward), over the first sequence and over the whole micro-batch;
  step    whole guarded steps, interleaved blocks of Trainers that differ only in
          guard.precursor.max_logit_every / max_logit_seqs (0 = off; 1 = every step, the worst
          case; the default 10 costs a tenth of the every-step figure).

    python bench/overhead/max_logit_overhead.py --steps 120 --block 10

Writes docs/BENCHMARKS.md › Detection › Precursor signals: lead time on an LR ramp, and their cost
(issue #16) (the max-logit cost).
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

import torch

from guard.runtime.attention_logits import LogitWatch
from trainer.cli import DEFAULT_CONFIG
from trainer.config import load_config
from trainer.loop import Trainer

VARIANTS = {"off": (0, 1), "every step, 1 seq": (1, 1), "every step, all seqs": (1, 0)}


def piece_ms(config: Path, seqs: int, reps: int) -> float:
    """CPU ms of one sampled step's observe() calls (all layers) on random q, k of the config's shape."""
    cfg = load_config(config, {})
    m, d = cfg.model, cfg.data
    q = torch.randn(d.batch_size, m.n_heads, d.seq_len, m.d_model // m.n_heads)
    k = torch.randn_like(q)
    w = LogitWatch()
    w.n_seqs = seqs
    best = float("inf")
    for _ in range(3):
        t0 = time.process_time()
        for _ in range(reps):
            for _ in range(m.n_layers):
                w.observe(q, k)
        best = min(best, (time.process_time() - t0) / reps * 1e3)
    return best


def make(config: Path, run_dir: Path, every: int, seqs: int, threads: int) -> Trainer:
    cfg = load_config(
        config,
        {
            "telemetry.profile": False,
            "train.checkpoint_every": 0,
            "train.threads": threads,
            "train.steps": 100_000,
            "guard.precursor.max_logit_every": every,
            "guard.precursor.max_logit_seqs": seqs,
        },
    )
    return Trainer(cfg, run_dir, progress=False)


def block(t: Trainer, n: int) -> list[float]:
    """CPU seconds of n guarded steps."""
    out = []
    for _ in range(n):
        c0 = time.process_time()
        t.train_step()
        t.step += 1
        t.guard.after_step(t.step, {"opt_step": t.opt_step})
        out.append(time.process_time() - c0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    ap.add_argument("--steps", type=int, default=120, help="measured steps per variant")
    ap.add_argument("--block", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--reps", type=int, default=50, help="repetitions of the piece timing")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for seqs in (1, 0):
        label = "first sequence" if seqs else "whole micro-batch"
        print(
            f"piece: observe() on every layer, {label}: {piece_ms(args.config, seqs, args.reps):.3f} ms CPU"
        )
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {
            name: make(args.config, Path(tmp) / f"v{i}", every, seqs, args.threads)
            for i, (name, (every, seqs)) in enumerate(VARIANTS.items())
        }
        for t in trainers.values():
            block(t, args.warmup)
        times: dict[str, list[float]] = {name: [] for name in trainers}
        for _ in range(max(1, args.steps // args.block)):
            for name, t in trainers.items():
                times[name] += block(t, args.block)
    base = statistics.median(times["off"])
    for name, ts in times.items():
        med = statistics.median(ts)
        print(f"step: {name:22s} median {med * 1e3:8.2f} ms CPU  ({(med / base - 1) * 100:+.2f}% vs off)")


if __name__ == "__main__":
    main()
