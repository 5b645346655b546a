"""The guard's warm-up spans of a run, for the charts to shade: from the step the run started
at to the step each detector arms (guard/core/warmup.py), under the guard settings the run
recorded in meta.json. Pure: no streamlit."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from guard.core.config import GuardConfig
from guard.core.tomlconf import ConfigError, from_dict
from guard.core.warmup import warmups

# Which charts show which detectors' warm-ups.
SPIKE = ("grad_spike", "loss_spike", "layer_grad_spike")
ROUTING = ("collapse",)
TIMING = ("throughput", "stall")


@dataclass(frozen=True, slots=True)
class Span:
    x0: int  # first step of the run
    x1: int  # the step the detectors arm at
    label: str  # "collapse warm-up: arms at step 250 (collapse.warmup)"


def recorded_guard(meta: dict[str, Any]) -> GuardConfig | None:
    """The guard settings the run recorded (None when meta.json has none it can read)."""
    config = meta.get("config")
    table = config.get("guard") if isinstance(config, dict) else None
    if not isinstance(table, dict):
        return None
    try:
        return from_dict(GuardConfig, table, prefix="guard.")
    except (ConfigError, TypeError, ValueError):
        return None  # written by another version: no shading rather than a wrong one


def spans(meta: dict[str, Any], first_step: int, names: tuple[str, ...]) -> list[Span]:
    """Warm-up spans of the named detectors that this run's steps reach into, one per arming
    step (detectors that arm together share a span), earliest first."""
    cfg = recorded_guard(meta)
    if cfg is None:
        return []
    by_step: dict[int, list[str]] = {}
    for w in warmups(cfg):
        if w.name in names and w.arms_at > first_step:
            by_step.setdefault(w.arms_at, []).append(w.key)
    out = []
    for at, keys in sorted(by_step.items()):
        names_ = [k.removesuffix(".warmup") for k in keys]
        who = "spike detectors" if len(names_) > 1 and set(names_) <= set(SPIKE) else ", ".join(names_)
        out.append(Span(first_step, at, f"{who} warm-up: arms at step {at} ({', '.join(keys)})"))
    return out
