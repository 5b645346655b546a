"""Self-calibrating spike thresholds: a false-alarm budget turned into a threshold from the run's
own noise, by fitting the tail of its standardized residuals (extreme-value theory).

A hand-set z (or a multiple of the median) is right for one noise shape only: grad norms from small
batches are heavy-tailed and fire on z = 6 every few hundred steps, while smooth large-batch
runs hide a 2x spike under a 20x cap. What carries from run to run is the false-alarm rate the
operator accepts, e.g. one per 100k steps. Given that budget p, the threshold is the (1 - p)
quantile of the residual distribution, estimated from the run's accepted history:

  peaks over threshold  u = the `u_quantile` (0.9) empirical quantile of the standardized
                        residuals in memory; the excesses s - u above it follow, for any
                        distribution in an extreme-value domain of attraction, a generalized
                        Pareto distribution GPD(xi, sigma) (Pickands-Balkema-de Haan);
  fit                   probability-weighted moments (Hosking & Wallis 1987): closed form, no
                        iterations, stable on the few hundred excesses a run has early on;
                        xi clamped to [0, xi_max]: a negative fit (a bounded tail) would be an
                        extrapolation we cannot afford to believe; then raised by
                        half a standard error (PWM under-estimates heavy tails, see fit_tail);
  quantile              s_p = u + sigma / xi * ((p * n / n_u) ** -xi - 1), the exponential
                        limit u + sigma * ln(n_u / (p * n)) when xi = 0.

This is SPOT (Siffer et al., KDD 2017) with PWM instead of Grimshaw's MLE and the run's median/MAD
residuals instead of raw values. Pure numpy; no torch, no I/O.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class TailFit:
    """A generalized Pareto fit of the excesses over `u`; `threshold(p)` is the (1 - p) quantile."""

    u: float  # the peaks-over-threshold level
    xi: float  # shape (0: exponential tail; 1/3 for Student-t(3))
    sigma: float  # scale
    n: int  # samples the fit saw
    n_u: int  # of which above u

    def threshold(self, p: float) -> float:
        """The value exceeded with probability p per sample under the fit."""
        r = p * self.n / max(self.n_u, 1)
        if r >= 1.0:  # the budget is looser than u itself: u is the answer
            return self.u
        if self.xi < 1e-6:
            return self.u - self.sigma * math.log(r)
        return self.u + self.sigma / self.xi * (r ** (-self.xi) - 1.0)


def fit_tail(
    samples: np.ndarray, *, u_quantile: float = 0.9, xi_margin: float = 0.5, xi_max: float = 0.6
) -> TailFit | None:
    """Fit the upper tail of `samples` (finite floats); None when fewer than 10 excesses.

    The shape used is the estimate plus `xi_margin` standard errors ((1 + xi) / sqrt(n_u)): PWM
    under-estimates heavy tails from a few hundred excesses (Student-t(3), true xi = 1/3, fits at
    ~0.25). Measured on 30 draws of n samples at budget 1e-5, mean real false-alarm rate:
      margin 0    t3 5.2e-5 (n 4,096), 1.3e-4 (n 1,024); t5 4.8e-5
      margin 0.5  t3 3.3e-5 (n 4,096), 6.3e-5 (n 1,024); t5 2.8e-5; normal, exponential < 4e-6
      margin 1    t3 2.1e-5 (n 4,096); t5 1.6e-5; but a threshold of 6.8 sigma on a normal tail
                  (true 1e-5 quantile 4.3) and ~14 sigma after 1,400 samples: half the x2 spikes
                  of a quiet run missed for thousands of steps.
    0.5 it is: on heavy tails the real rate is ~3x the budget (set the budget 3x lower where
    that matters), on light ones below it."""
    n = samples.size
    k = int(n * (1.0 - u_quantile))
    if k < 10:
        return None
    # The (1 - u_quantile) top fraction: the k largest values, u the largest value below them.
    part = np.partition(samples, n - k - 1)
    u = float(part[n - k - 1])
    excess = np.sort(part[n - k :] - u)
    # PWM estimators with the plotting position (i - 0.35) / k (Hosking & Wallis 1987, eq. 8-9).
    b0 = float(excess.mean())
    if b0 <= 0.0:
        return TailFit(u=u, xi=0.0, sigma=0.0, n=n, n_u=k)
    pos = (np.arange(1, k + 1) - 0.35) / k
    a1 = float(((1.0 - pos) * excess).mean())  # E[X (1 - F(X))]
    denom = b0 - 2.0 * a1
    # Hosking's shape k = b0 / (b0 - 2 a1) - 2 and scale 2 b0 a1 / (b0 - 2 a1); xi = -k.
    # denom <= 0 means an infinite-mean estimate: the heaviest tail we accept.
    xi_raw = 2.0 - b0 / denom if denom > 0.0 else xi_max
    xi = min(max(xi_raw, 0.0), xi_max)
    if xi == xi_raw and denom > 0.0:
        sigma = 2.0 * b0 * a1 / denom
    else:
        sigma = b0 * (1.0 - xi)  # clamped: keep the mean excess, sigma / (1 - xi), of the sample
    xi = min(xi + xi_margin * (1.0 + xi) / math.sqrt(k), xi_max)
    return TailFit(u=u, xi=xi, sigma=max(sigma, 1e-12), n=n, n_u=k)
