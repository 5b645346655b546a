"""When each detector arms: the first step of a fresh run at which it can give a verdict.

Every detector waits before it judges (a baseline must fill, routing is chaotic at init, the first
steps compile). A fault that lands inside that wait gets no verdict, and a drill user concludes
that "the guard ignores collapse". This module says when each one arms, from the guard settings,
so the CLI can say so before the run (`notices`) and the app can shade the spans on its charts.

Steps are 0-based steps of a fresh run whose steps are clean: a step detector counts accepted
(clean) values, so flagged steps push its arming later; the observers count every step.
Pure: the rules here mirror guard/core/detectors/ (tests/guard/test_warmup.py holds them to it).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from guard.core import schema
from guard.core.config import GuardConfig, SpikeConfig
from guard.core.detectors.timing import STALL_BASELINE


@dataclass(frozen=True, slots=True)
class Warmup:
    name: str  # the detector's settings table, e.g. "collapse"
    arms_at: int  # first step at which it may give a verdict
    key: str  # the setting that sets it, e.g. "collapse.warmup"
    verdicts: tuple[str, ...]  # the detector names (schema.DET_*) its verdicts carry
    before: str = ""  # what it still catches before it arms ("" = nothing)

    def line(self) -> str:
        """'collapse detector arms at step 250 (collapse.warmup)'."""
        return f"{self.name} detector arms at step {self.arms_at} ({self.key})"


# Which detectors would answer each injected fault (trainer/inject.py's kinds). nan, crash, hang
# and flip are the non-finite check's, the heartbeat's or the rerun's: armed from step 0.
CATCHES: dict[str, tuple[str, ...]] = {
    "gradspike": ("grad_spike", "layer_grad_spike"),
    "lrspike": ("grad_spike", "loss_spike"),
    "badbatch": ("loss_spike", "grad_spike"),
    "collapse": ("collapse",),
    "stall": ("stall",),
    "slowrank": ("throughput",),
}


def _spike(name: str, c: SpikeConfig, det: str) -> Warmup | None:
    if not c.enabled:
        return None
    before = f"only values above {c.abs_max:g}" if c.abs_max is not None else ""
    return Warmup(name, c.warmup, f"{name}.warmup", (det,), before)


def warmups(cfg: GuardConfig) -> list[Warmup]:
    """Every enabled detector's warm-up that lasts at least one step, in registry order."""
    out = [
        _spike("grad_spike", cfg.grad_spike, schema.DET_GRAD_SPIKE),
        _spike("loss_spike", cfg.loss_spike, schema.DET_LOSS_SPIKE),
        _spike("layer_grad_spike", cfg.layer_grad_spike, schema.DET_LAYER_GRAD_SPIKE),
    ]
    if cfg.collapse.enabled:
        dets = (
            schema.DET_DEAD_EXPERTS,
            schema.DET_MAXVIO,
            schema.DET_LOAD_ENTROPY,
            schema.DET_ROUTER_ENTROPY,
        )
        out.append(Warmup("collapse", cfg.collapse.warmup, "collapse.warmup", dets))
    if cfg.stall.enabled:  # ignored start-up steps, then a baseline of clean waits
        arms = cfg.stall.warmup + min(STALL_BASELINE, cfg.stall.window)
        out.append(Warmup("stall", arms, "stall.warmup", (schema.DET_STALL,)))
    if cfg.throughput.enabled:  # a baseline, then `sustain` low steps in a row
        arms = cfg.throughput.warmup + cfg.throughput.sustain - 1
        out.append(Warmup("throughput", arms, "throughput.warmup", (schema.DET_THROUGHPUT,)))
    return [w for w in out if w is not None and w.arms_at > 0]


def notices(cfg: GuardConfig, steps: int, injections: Iterable[tuple[str, int, str]] = ()) -> list[str]:
    """Lines for the user before a run: each injected fault (kind, step, as given) that falls
    before a detector that would answer it arms, and each detector that arms after the run's last
    step (steps 0..steps-1). Empty when the guard is off or nothing falls inside a warm-up."""
    if not cfg.enabled:
        return []
    by_name = {w.name: w for w in warmups(cfg)}
    out = []
    for kind, step, given in injections:
        for name in CATCHES.get(kind, ()):
            w = by_name.get(name)
            if w is not None and step < w.arms_at:
                also = f"; before that it flags {w.before}" if w.before else ""
                out.append(
                    f"--inject {given} falls inside a warm-up: the {w.line()}{also}, so a fault "
                    f"that is over by then gets no verdict from it"
                )
    late = [w for w in by_name.values() if w.arms_at >= steps]
    if late:
        out.append(
            f"this run ends at step {steps - 1}, before {len(late)} detector(s) arm, so they give it no "
            "verdict: " + ", ".join(f"{w.name} at step {w.arms_at} ({w.key})" for w in late)
        )
    return out
