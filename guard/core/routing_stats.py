"""Load-balance statistics of expert load histograms, defined once: the probe computes them every
step (guard/runtime/probe.py) and the collapse detector on a window's pooled loads
(guard/core/detectors/collapse.py)."""

from __future__ import annotations

import math

import numpy as np


def maxvio_and_entropy(loads_ME: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per row of a [M, E] load histogram: MaxVio ((max - mean) / mean) and the load entropy
    normalised by log(E) (1: perfectly even). Loads are finite counts and every divisor is clamped
    positive, so an empty row reads MaxVio 0 and entropy 0, with no warning."""
    e = loads_ME.shape[1]
    rows = loads_ME.sum(axis=1)
    mean = np.maximum(rows / e, 1e-9)  # loads.mean(axis=1), bit for bit
    maxvio = (loads_ME.max(axis=1) - mean) / mean
    share = loads_ME / np.maximum(rows, 1e-9)[:, None]
    entropy = -(share * np.log(np.maximum(share, 1e-12))).sum(axis=1) / math.log(e)
    return maxvio, entropy
