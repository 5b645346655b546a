"""Robust window statistics the detectors share: a preallocated ring buffer and an O(n) median.

Window statistics: fixed numpy ring buffers plus `np.partition` (introselect, O(window))
for medians and the MAD. A sorted list kept with `bisect` would make the median O(log n),
but the MAD needs every |x - median| anyway, so an update would still be O(n), and paid in
Python; partition is one C call per statistic (an update costs ~15 us at window 256, see
tests/guard/test_detectors.py::test_spike_update_is_fast).
"""

from __future__ import annotations

import math

import numpy as np

# MAD x 1.4826 estimates the standard deviation of a normal distribution.
MAD_TO_SIGMA = 1.4826
NAN = float("nan")


class RingBuffer:
    """The last `capacity` floats, in one preallocated array (no per-step allocation)."""

    __slots__ = ("_buf", "_head", "_n")

    def __init__(self, capacity: int) -> None:
        self._buf = np.empty(capacity, dtype=np.float64)
        self._head = 0  # next write position
        self._n = 0

    def __len__(self) -> int:
        return self._n

    @property
    def capacity(self) -> int:
        return self._buf.size

    def push(self, x: float) -> None:
        self._buf[self._head] = x
        self._head = (self._head + 1) % self._buf.size
        self._n = min(self._n + 1, self._buf.size)

    def values(self) -> np.ndarray:
        """The stored values in no particular order (a view; fine for order statistics)."""
        # Until the buffer wraps, writes fill 0..n-1 in order; after that it is all full.
        return self._buf[: self._n]

    def ordered(self) -> list[float]:
        """Oldest first, for state_dict."""
        if self._n < self._buf.size:
            return self._buf[: self._n].tolist()
        return np.concatenate([self._buf[self._head :], self._buf[: self._head]]).tolist()

    def clear(self) -> None:
        self._head = 0
        self._n = 0

    def load(self, values: list[float]) -> None:
        """Replace the contents (oldest first); keeps the newest `capacity` if there are more."""
        self.clear()
        for v in values[-self._buf.size :]:
            self.push(float(v))


def median_of(a: np.ndarray) -> float:
    """Median by introselect: O(n), cheaper than np.median's extra bookkeeping."""
    n = a.size
    if n == 0:
        return NAN
    k = n // 2
    if n % 2:
        return float(np.partition(a, k)[k])
    p = np.partition(a, (k - 1, k))
    return 0.5 * float(p[k - 1] + p[k])


def median_rows(a: np.ndarray) -> np.ndarray:
    """Median of each row of a 2-D array, by one introselect over the rows: the same numbers as
    np.median(a, axis=1) (0.5 * (a + b) is exact, like its mean of the middle pair) without its
    NaN checks and bookkeeping, which cost more than the selection on short windows."""
    n = a.shape[1]
    k = n // 2
    if n % 2:
        return np.partition(a, k, axis=1)[:, k]
    p = np.partition(a, (k - 1, k), axis=1)
    return 0.5 * (p[:, k - 1] + p[:, k])


def median_small(xs: list[float]) -> float:
    """Median of a short list by sorting it: the same number as np.median (0.5 * (a + b) is exact,
    like its mean of the middle pair), without numpy's per-call overhead (~15 us) on a few values."""
    s = sorted(xs)
    n = len(s)
    if n == 0:
        return NAN
    k = n // 2
    return float(s[k]) if n % 2 else 0.5 * (float(s[k - 1]) + float(s[k]))


def is_finite(x: float) -> bool:
    try:
        return math.isfinite(x)
    except TypeError:
        return False
