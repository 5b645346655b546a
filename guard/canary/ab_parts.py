"""The A/B canary's pieces that both the measuring (ab.py) and its report (ab_report.py) use: an
environment (Side), what was measured (Paired), the paired statistic and its sign-test interval
(the rule: ab.py's docstring), and the environment keys the report compares. Their own module so
that ab.py imports ab_report.py and not the other way round; ab.py re-exports every name.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from typing import Any

from guard.canary.ab_format import Pair
from guard.canary.config import CanaryConfig
from guard.canary.gate import FAIL, PASS, WARN

ENV_DIFF_KEYS = (
    "torch",
    "cuda",
    "python",
    "python_executable",
    "numpy",
    "moeguard",
    "device",
    "attention_backend",
    "expert_kernel",
    "compile",
    "dtype",
    "peak_flops_source",
    "world_size",
    "git_sha",
    "overrides",
)


@dataclass(kw_only=True, slots=True)
class Side:
    """One environment of the A/B: which interpreter runs the worker and with what config."""

    name: str  # "A" | "B"
    spec: str  # as given on the command line
    python: str | None = None  # None: this interpreter
    overrides: dict[str, Any] = field(default_factory=dict)
    slow_pct: float = 0.0
    probe: dict[str, Any] = field(default_factory=dict)  # py: what the interpreter says about itself
    extra_env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    worker: tuple[str, ...] | None = None  # py: with its own moeguard: its worker; None: this one's


def sign_test_interval(xs: list[float], confidence: float) -> tuple[float, float, float]:
    """(lo, hi, coverage): the distribution-free interval [x_(k), x_(n+1-k)] for the median, k the
    largest with coverage 1 - 2 P(Bin(n, 1/2) <= k - 1) >= confidence (k = 1 when none reaches it:
    the full range, with the coverage it has)."""
    xs = sorted(xs)
    n = len(xs)
    if n == 0:
        return float("nan"), float("nan"), 0.0

    def coverage(k: int) -> float:
        return 1 - 2 * sum(math.comb(n, i) for i in range(k)) / 2**n

    k = 1
    while k + 1 <= (n + 1) // 2 and coverage(k + 1) >= confidence:
        k += 1
    return xs[k - 1], xs[n - k], coverage(k)


def paired_statistic(ratios: list[float], c: CanaryConfig) -> dict[str, Any]:
    """Median B/A ratio, its sign-test interval and the verdict (see the module docstring)."""
    lo, hi, cov = sign_test_interval(ratios, c.ab_confidence)
    med = statistics.median(ratios) if ratios else float("nan")
    line = 1 - c.ab_fail_pct / 100
    if hi < line:
        verdict, state = (
            FAIL,
            f"B is slower than A by more than {c.ab_fail_pct:g}%: the whole interval is below {line:.3f}",
        )
    elif med < line:
        verdict, state = (
            WARN,
            (
                f"undecided: the median is below {line:.3f} but the interval reaches it "
                f"(B may be slower by more than {c.ab_fail_pct:g}%)"
            ),
        )
    elif hi < 1:
        verdict, state = WARN, f"B is slower than A, by less than the {c.ab_fail_pct:g}% line"
    elif lo > 1:
        verdict, state = PASS, "B is faster than A (the whole interval is above 1)"
    else:
        verdict, state = PASS, f"no slowdown beyond {c.ab_fail_pct:g}% (the interval reaches 1)"
    return {
        "median": med,
        "ci": [lo, hi],
        "coverage": cov,
        "n_pairs": len(ratios),
        "fail_below": line,
        "delta_pct": 100 * (med - 1),
        "b_faster_pairs": sum(r > 1 for r in ratios),
        "verdict": verdict,
        "state": state,
        "undecided": med < line <= hi,
    }


@dataclass(kw_only=True, slots=True)
class Paired:
    """What measure_ab measured: every worker row (in the order they ran), the pairs, the verdict."""

    rows: list[dict[str, Any]]
    pairs: list[Pair]
    stat: dict[str, Any]
    elapsed_s: float
