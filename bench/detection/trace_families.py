"""Families of clean grad-norm / loss traces for the held-out detector evaluation.

Each family is bench/detection/traces.py's synthetic run (decay, init transient, warm-up hump, drift, AR(1)
log-normal noise, benign data-mix bumps) with one thing changed, chosen because it breaks a
detector tuned on the others:

  lognormal    the base run: light (Gaussian) tails on the log scale.
  student_t3   plus i.i.d. Student-t(3) log noise (scale 0.03..0.08): heavy tails, finite variance.
  stable       plus i.i.d. symmetric alpha-stable(1.8) log noise (scale 0.02..0.05), excursions
               capped at +-3 (x20): heavier still, infinite variance (small-batch grad norms).
  lr_schedule  cosine LR schedule with two warm restarts (each warming up over 5% of its cycle): the grad
               norm follows the LR (x0.6..x1.4)
               and each restart lifts the loss by 2..5% (trends a window must not call spikes).
  drift        a wandering level: an Ornstein-Uhlenbeck walk 4x faster and 4x wider than the base.

Writes docs/BENCHMARKS.md: no section of its own; the trace families of Detection › Detection on
held-out traces at matched false-alarm rates.
"""

from __future__ import annotations

import math

import numpy as np

from bench.detection.traces import GRAD_NORM, LOSS, Trace, synthetic_run

FAMILIES = ("lognormal", "student_t3", "stable", "lr_schedule", "drift")


def _stable(alpha: float, n: int, rng: np.random.Generator) -> np.ndarray:
    """Symmetric alpha-stable samples (Chambers-Mallows-Stuck)."""
    v = rng.uniform(-math.pi / 2, math.pi / 2, n)
    w = rng.exponential(1.0, n)
    return (
        np.sin(alpha * v)
        / np.cos(v) ** (1.0 / alpha)
        * (np.cos(v - alpha * v) / w) ** ((1.0 - alpha) / alpha)
    )


def _ou(n: int, theta: float, sigma: float, rng: np.random.Generator) -> np.ndarray:
    out = np.empty(n)
    x = 0.0
    for i, e in enumerate(rng.normal(0.0, sigma, n)):
        x += -theta * x + e
        out[i] = x
    return out


def family_run(family: str, n_steps: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """One clean (grad_norm, loss) run of `family`."""
    if family not in FAMILIES:
        raise ValueError(f"unknown trace family {family!r}; known: {', '.join(FAMILIES)}")
    grad, loss = synthetic_run(n_steps, rng)
    lg, ll = np.log(grad), np.log(loss)
    t = np.arange(n_steps, dtype=np.float64)
    if family == "student_t3":
        lg += rng.uniform(0.03, 0.08) * rng.standard_t(3, n_steps)
        ll += rng.uniform(0.005, 0.012) * rng.standard_t(3, n_steps)
    elif family == "stable":
        lg += np.clip(rng.uniform(0.02, 0.05) * _stable(1.8, n_steps, rng), -3.0, 3.0)
        ll += np.clip(rng.uniform(0.004, 0.01) * _stable(1.8, n_steps, rng), -1.0, 1.0)
    elif family == "lr_schedule":
        period = n_steps / 3.0
        phase = (t % period) / period  # three cosine cycles: two warm restarts
        lr = 0.5 * (1.0 + np.cos(math.pi * phase))
        lr *= np.minimum(1.0, phase / 0.05)  # each cycle warms up linearly over its first 5%
        lg += np.log(0.6 + 0.8 * lr)
        restart = np.exp(-((t % period) / rng.uniform(20.0, 60.0)))
        restart[: int(period)] = 0.0  # the first cycle starts cold: no restart bump
        ll += np.log1p(rng.uniform(0.02, 0.05) * restart)
    elif family == "drift":
        lg += _ou(n_steps, 1.0 / 125.0, 0.02, rng)
        ll += _ou(n_steps, 1.0 / 125.0, 0.004, rng)
    return np.exp(lg), np.exp(ll)


def family_traces(family: str, seeds: range | list[int], n_steps: int) -> list[Trace]:
    """A grad-norm and a loss trace per seed; the name says family and seed."""
    out = []
    for s in seeds:
        grad, loss = family_run(family, n_steps, np.random.default_rng([FAMILIES.index(family), s]))
        out.append(Trace(f"{family}-{s}", GRAD_NORM, grad))
        out.append(Trace(f"{family}-{s}", LOSS, loss))
    return out
