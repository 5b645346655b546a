"""Per-step grad-norm and loss traces for detector benchmarks: recorded runs or a generator.

A trace is one series of one run, in step order. Recorded traces come from moeguard run
stores (`runs/<id>/steps/*.parquet`); when none is given, `synthetic_traces` makes realistic
clean ones. Faults are injected into copies, so every detector sees the same clean series and
the same faults.

What the generator models, and why (each piece is something a detector must NOT flag):
  grad norm  decays from ~2 to ~0.3 over the run; a large init transient over the first tens
             of steps; a hump around the end of LR warm-up; slow drift (an Ornstein-Uhlenbeck
             walk in log space); AR(1) log-normal step noise with sigma 0.05..0.15 per run.
  loss       a power law from ln(vocab) ~ 10.8 towards an irreducible 1.8..2.6, with a small
             hump at the end of warm-up and AR(1) log-normal noise with sigma 0.008..0.025.
  both       a few smooth benign bumps (data-mixture shifts): +10..35 % on the grad norm and
             +2..6 % on the loss, 15..80 steps wide, at the same steps in both series.

Writes docs/BENCHMARKS.md: no section of its own; the traces of Detection's detector sections.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

GRAD_NORM = "grad_norm"
LOSS = "loss"
SERIES = (GRAD_NORM, LOSS)
# Steps whose guard action says the value was already judged bad are not clean baseline.
_FLAGGED_ACTIONS = ("skip", "rollback", "halt")


@dataclass(frozen=True, slots=True)
class Trace:
    name: str  # "synthetic-3" or the run directory
    series: str  # GRAD_NORM | LOSS
    values: np.ndarray  # float64, step order


# ---------------------------------------------------------------------------------------
# Generator
# ---------------------------------------------------------------------------------------
def _ar1(n: int, rho: float, sigma: float, rng: np.random.Generator) -> np.ndarray:
    """AR(1) noise with marginal standard deviation `sigma` (real step noise is correlated)."""
    eps = rng.normal(0.0, sigma * math.sqrt(1.0 - rho * rho), n)
    out = np.empty(n)
    prev = rng.normal(0.0, sigma)
    for i in range(n):
        prev = rho * prev + eps[i]
        out[i] = prev
    return out


def _ou(n: int, theta: float, sigma: float, rng: np.random.Generator) -> np.ndarray:
    """Mean-reverting slow drift (log scale)."""
    out = np.empty(n)
    x = 0.0
    steps = rng.normal(0.0, sigma, n)
    for i in range(n):
        x += -theta * x + steps[i]
        out[i] = x
    return out


def _bump(t: np.ndarray, centre: float, width: float) -> np.ndarray:
    return np.exp(-0.5 * ((t - centre) / width) ** 2)


def synthetic_run(n_steps: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """One clean run: (grad_norm, loss), both length n_steps and positive."""
    t = np.arange(n_steps, dtype=np.float64)
    warmup = float(rng.integers(100, 400))

    # grad norm: decay ~2 -> ~0.3, init transient, warm-up hump, drift, AR(1) log-normal noise
    g_start, g_end = rng.uniform(1.5, 2.5), rng.uniform(0.25, 0.4)
    tau = rng.uniform(0.2, 0.4) * n_steps
    grad = g_end + (g_start - g_end) * np.exp(-t / tau)
    grad *= 1.0 + rng.uniform(1.0, 4.0) * np.exp(-t / rng.uniform(10.0, 40.0))
    grad *= 1.0 + rng.uniform(0.2, 0.6) * _bump(t, warmup, warmup / 3.0)
    log_grad = np.log(grad) + _ou(n_steps, 1.0 / 500.0, 0.005, rng)
    log_grad += _ar1(n_steps, rng.uniform(0.2, 0.6), rng.uniform(0.05, 0.15), rng)

    # loss: power law from ln(50k) towards an irreducible level, small warm-up hump, noise
    l_inf = rng.uniform(1.8, 2.6)
    loss = l_inf + (10.8 - l_inf) * (1.0 + t / rng.uniform(20.0, 80.0)) ** (-rng.uniform(0.4, 0.8))
    loss *= 1.0 + rng.uniform(0.0, 0.08) * _bump(t, warmup, warmup / 4.0)
    log_loss = np.log(loss) + _ar1(n_steps, rng.uniform(0.0, 0.3), rng.uniform(0.008, 0.025), rng)

    # benign bumps shared by both series (a data-mixture shift moves both)
    for _ in range(rng.poisson(max(1.0, n_steps / 1500.0))):
        centre, width = rng.uniform(warmup, n_steps), rng.uniform(15.0, 80.0)
        shape = _bump(t, centre, width)
        log_grad += np.log1p(rng.uniform(0.10, 0.35) * shape)
        log_loss += np.log1p(rng.uniform(0.02, 0.06) * shape)
    return np.exp(log_grad), np.exp(log_loss)


def synthetic_traces(n_runs: int, n_steps: int, seed: int = 0) -> list[Trace]:
    """`n_runs` clean runs, each giving a grad-norm and a loss trace."""
    out = []
    for i in range(n_runs):
        grad, loss = synthetic_run(n_steps, np.random.default_rng([seed, i]))
        out.append(Trace(f"synthetic-{i}", GRAD_NORM, grad))
        out.append(Trace(f"synthetic-{i}", LOSS, loss))
    return out


# ---------------------------------------------------------------------------------------
# Recorded runs
# ---------------------------------------------------------------------------------------
def load_run_traces(run_dirs: Iterable[str | Path], min_steps: int = 300) -> tuple[list[Trace], list[str]]:
    """grad_norm and loss traces from moeguard run stores, plus notes on what was left out.

    Rows are taken in the order the steps happened (by time); rows the guard already skipped
    or rolled back are dropped (they are the faults, not the baseline) and so are non-finite
    values. A series shorter than `min_steps` after that is left out (no room to inject).
    """
    import polars as pl  # only the recorded-trace path needs it

    traces: list[Trace] = []
    notes: list[str] = []
    for run in run_dirs:
        run = Path(run)
        df = pl.scan_parquet(str(run / "steps" / "*.parquet")).collect().sort(["time", "step"])
        if "action" in df.columns:
            flagged = df.filter(pl.col("action").is_in(_FLAGGED_ACTIONS)).height
            if flagged:
                notes.append(f"{run}: dropped {flagged} steps the guard had flagged")
            df = df.filter(~pl.col("action").is_in(_FLAGGED_ACTIONS))
        for series in SERIES:
            vals = df[series].cast(pl.Float64).to_numpy()
            finite = np.isfinite(vals) & (vals > 0)
            if (~finite).any():
                notes.append(f"{run}: dropped {int((~finite).sum())} non-finite/non-positive {series}")
            vals = vals[finite]
            if vals.size < min_steps:
                notes.append(f"{run}: {series} has {vals.size} steps (< {min_steps}), left out")
                continue
            traces.append(Trace(str(run), series, vals.astype(np.float64)))
    return traces, notes


def recorded_traces(runs: Sequence[str]) -> list[Trace]:
    """Grad norm and loss of recorded run stores, named after the run folder (family-seed)."""
    traces, notes = load_run_traces(runs)
    for n in notes:
        print(f"recorded: {n}", file=sys.stderr)
    if not traces:
        raise SystemExit(f"no usable grad_norm or loss trace in the run stores {', '.join(runs)}")
    return [Trace(t.name.rstrip("/").rsplit("/", 1)[-1], t.series, t.values) for t in traces]


def recorded_families(runs: Sequence[str]) -> list[str]:
    """The families of recorded runs (the folder name less its last -part, e.g. mixtral-0)."""
    return sorted({r.rstrip("/").rsplit("/", 1)[-1].rsplit("-", 1)[0] for r in runs})


# ---------------------------------------------------------------------------------------
# Fault injection
# ---------------------------------------------------------------------------------------
def fault_positions(n_steps: int, k: int, rng: np.random.Generator, start: int, min_gap: int) -> np.ndarray:
    """`k` sorted random steps in [start, n_steps) at least `min_gap` apart (fewer if it cannot fit)."""
    free = n_steps - start - (k - 1) * (min_gap - 1)
    if k <= 0 or free < k:
        k = max(0, (n_steps - start + min_gap - 1) // min_gap)
        free = n_steps - start - (k - 1) * (min_gap - 1)
    if k == 0:
        return np.zeros(0, dtype=np.int64)
    # choose k of `free` slots, then spread them by the gap: uniform over valid placements
    slots = np.sort(rng.choice(free, size=k, replace=False))
    return start + slots + np.arange(k) * (min_gap - 1)


def burst_faults(
    n_steps: int,
    k: int,
    rng: np.random.Generator,
    start: int,
    primary: Sequence[float],
    aftershock: Sequence[float],
) -> tuple[np.ndarray, list[float]]:
    """`k` incidents: a large spike, then 1..3 smaller ones 10..100 steps later (spikes cluster).

    Instabilities come in bursts (PaLM saw repeated spikes around the same steps); this is the
    case where a detector whose window keeps the first spike goes blind to the next ones.
    Faults are at least 5 steps apart, so a detection can never be credited to two of them.
    """
    heads = fault_positions(n_steps - 110, k, rng, start, min_gap=120)
    pos: list[int] = []
    sizes: list[float] = []
    for h in heads:
        pos.append(int(h))
        sizes.append(float(rng.choice(primary)))
        m = int(rng.integers(1, 4))
        offsets = 10 + fault_positions(91, m, rng, 0, min_gap=5)
        pos.extend(int(h + o) for o in offsets)
        sizes.extend(float(v) for v in rng.choice(aftershock, size=len(offsets)))
    return np.asarray(pos, dtype=np.int64), sizes


def inject(values: np.ndarray, positions: np.ndarray, sizes: Iterable[float]) -> np.ndarray:
    """A copy with values[p] *= size (size NaN: the value becomes NaN)."""
    out = values.copy()
    for p, s in zip(positions, sizes, strict=True):
        out[p] = float("nan") if math.isnan(s) else out[p] * s
    return out
