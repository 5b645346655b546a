"""The guard judged whole on recorded real-model runs, against OLMo-core, at matched false-alarm rates.

    python bench/detection/guard_whole.py --calib RUNS/mixtral-0 ... --test RUNS/mixtral-2 ... \\
        --target 1e-4 --target 1e-3 [--write-docs]

bench/detection/detector_recorded.py scores each series alone (ours: the total grad norm's rule,
or the loss's). Here the guard runs as it does in training (issue #39 item 3): each recorded run's
steps go through its DetectorSuite's step rules (total grad norm with its local ceiling and the
all-layers rule, each layer's grad norm, the loss), one step at a time. At every step from 300 on
the suite first peeks at what-if copies of the step, changing nothing, then takes the clean step as
a live run would:
  grad xF   a whole-model gradient spike: the total and every layer's grad norm x F, the loss
            unchanged (what `moeguard train --inject gradspike@STEP:F` shows the detectors);
  loss xF   the loss x F, the grad norms unchanged (a bad batch that only the loss shows).
A copy is caught when any spike rule fires on it (any step verdict is a skip: guard/core/policy.py);
a clean step that any of them fires on is a false alarm. The peers are their installed packages,
each judging the same copies as it runs, from step 0 on (its own warm-up): OLMo-core's
SkipStepOptimizer (ai2-olmo-core: one window on the grad norm and one on the loss, a step skipped
when either is out), ZClip (zclip, on the grad norm: a clip counts as a flag) and Lightning's
SpikeDetection (lightning, on the loss).

Knobs, each set on the clean steps (from 300 on) of the --calib runs alone to the most sensitive
grid value with at most --target false alarms per clean step, then scored on the --test runs; then
the sets swap (--one-way: no swap). Ours: one budget for every spike rule (the guard ships 1e-5 for
each), on a grid of 10^-0.05 steps; OLMo-core: sigma_factor in steps of 0.5; ZClip: z_thresh in
steps of 0.5; Lightning: rtol in steps of 0.1. Every step of a test
run from 300 on is a fault site (about 700 a run and size), so recall is measured on many more
faults than detector_recorded's 3 a run; a what-if does not enter any judge's history.

Writes docs/BENCHMARKS.md › Detection › The guard judged whole on recorded real-model traces.
"""

from __future__ import annotations

import sys
from pathlib import Path as _P

sys.path.insert(0, str(_P(__file__).resolve().parents[2]))  # `python bench/<group>/x.py` from a checkout

import argparse
import copy
import dataclasses
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from guard.core import schema
from guard.core.config import GuardConfig
from guard.core.detectors.registry import REGISTRY, STAGE_STEP
from guard.core.detectors.suite import DetectorSuite

FAULT_START = 300
GRAD_SIZES = (2.0, 3.0, 5.0, 10.0)
LOSS_SIZES = (1.5, 2.0, 3.0)
WHAT_IFS = tuple(("grad", s) for s in GRAD_SIZES) + tuple(("loss", s) for s in LOSS_SIZES)
OURS_GRID = tuple(10.0**e for e in np.arange(-2.0, -8.0001, -0.05))
OLMO_GRID = tuple(np.round(np.arange(2.0, 40.01, 0.5), 2))
ZCLIP_GRID = tuple(np.round(np.arange(1.5, 40.01, 0.5), 2))
LIGHTNING_GRID = tuple(np.round(np.arange(0.1, 20.01, 0.1), 2))
SPIKE_RULES = (schema.DET_GRAD_SPIKE, schema.DET_LAYER_GRAD_SPIKE, schema.DET_LOSS_SPIKE)


def what_if(rep: Any, kind: str, size: float) -> Any:
    """A copy of the step's report with a whole-model gradient spike or a loss spike of `size`."""
    r = copy.copy(rep)
    if kind == "grad":
        r.grad_norm = rep.grad_norm * size
        r.layer_grad_norm_L = np.asarray(rep.layer_grad_norm_L, dtype=np.float64) * size
    else:
        r.loss = rep.loss * size
    return r


# ---------------------------------------------------------------------------------------
# The two judges: step(report) -> flagged; peek(report) -> would it flag, changing nothing
# ---------------------------------------------------------------------------------------
def guard_config(budget: float) -> GuardConfig:
    """The guard's defaults with every spike rule's budget set to `budget`."""
    cfg = GuardConfig()
    for name in ("grad_spike", "loss_spike", "layer_grad_spike"):
        setattr(cfg, name, dataclasses.replace(getattr(cfg, name), budget=budget))
    return cfg


class GuardJudge:
    """The guard's step rules (spikes and non-finite) as the engine runs them."""

    def __init__(self, budget: float) -> None:
        step_rules = {k: r for k, r in REGISTRY.items() if r.stage == STAGE_STEP}
        self.suite = DetectorSuite(guard_config(budget), registry=step_rules)

    def peek(self, rep: Any) -> bool:
        return any(v.detector in SPIKE_RULES for v in self.suite.peek_step(rep))

    def step(self, rep: Any) -> bool:
        return any(v.detector in SPIKE_RULES for v in self.suite.update(rep))


class OlmoJudge:
    """OLMo-core's SkipStepOptimizer itself (ai2-olmo-core): its latest_loss and latest_grad_norm
    set each step as its TransformerTrainModule sets them, a skip when get_step_factor() is 0 (a
    128-step window on each series, the step skipped when either is out; skipped values stay in)."""

    def __init__(self, sigma: float) -> None:
        import torch
        from olmo_core.optim.skip_step_optimizer import SkipStepOptimizer

        self.torch = torch
        self.opt = SkipStepOptimizer([torch.zeros(1, requires_grad=True)], {}, sigma_factor=sigma)

    def step(self, rep: Any) -> bool:
        self.opt.latest_loss = self.torch.tensor(float(rep.loss))
        self.opt.latest_grad_norm = self.torch.tensor(float(rep.grad_norm))
        return float(self.opt.get_step_factor()) == 0.0

    def peek(self, rep: Any) -> bool:
        saved = list(self.opt._losses), list(self.opt._grad_norms)
        try:
            return self.step(rep)
        finally:
            self.opt._losses, self.opt._grad_norms = saved


class PeerJudge:
    """A one-series peer's installed package (detector_heldout.RealPeer): ZClip on the grad norm
    (a flag is a clip: it never skips), Lightning's SpikeDetection on the loss."""

    def __init__(self, name: str, series: str, value: float) -> None:
        from bench.detection.detector_heldout import RealPeer

        self.series, self.peer = series, RealPeer(name, value)

    def peek(self, rep: Any) -> bool:
        return self.peer.peek(float(getattr(rep, self.series)))

    def step(self, rep: Any) -> bool:
        return self.peer.flag(float(getattr(rep, self.series)))


@dataclass(frozen=True)
class Judge:
    name: str
    knob: str
    grid: tuple[float, ...]
    make: Callable[[float], Any]


JUDGES = (
    Judge("ours (the guard, every rule)", "budget", OURS_GRID, GuardJudge),
    Judge("OLMo-core (grad norm + loss)", "sigma_factor", OLMO_GRID, OlmoJudge),
    Judge("ZClip (grad norm)", "z_thresh", ZCLIP_GRID, lambda v: PeerJudge("ZClip", "grad_norm", v)),
    Judge("Lightning (loss)", "rtol", LIGHTNING_GRID, lambda v: PeerJudge("Lightning", "loss", v)),
)


# ---------------------------------------------------------------------------------------
# Runs, false alarms and what-ifs
# ---------------------------------------------------------------------------------------
def load_reports(runs: Sequence[str]) -> dict[str, list[Any]]:
    """Each run's finite step reports, in step order, by run folder name."""
    from guard.store.reader import read_reports

    return {Path(r.rstrip("/")).name: [rep for rep in read_reports(r) if rep.finite] for r in runs}


@dataclass
class Score:
    clean_flags: int = 0
    clean_steps: int = 0
    faults: dict[tuple[str, float], int] = field(default_factory=dict)
    caught: dict[tuple[str, float], int] = field(default_factory=dict)

    def add(self, other: Score) -> None:
        self.clean_flags += other.clean_flags
        self.clean_steps += other.clean_steps
        for k, n in other.faults.items():
            self.faults[k] = self.faults.get(k, 0) + n
            self.caught[k] = self.caught.get(k, 0) + other.caught.get(k, 0)

    @property
    def fa_rate(self) -> float:
        return self.clean_flags / self.clean_steps if self.clean_steps else float("nan")

    def recall(self, key: tuple[str, float]) -> float:
        n = self.faults.get(key, 0)
        return self.caught.get(key, 0) / n if n else float("nan")


def replay(judge: Any, reps: Sequence[Any], what_ifs: Sequence[tuple[str, float]] = ()) -> Score:
    """One pass over a run: what-ifs peeked at each step from FAULT_START on, then the clean step."""
    s = Score()
    for rep in reps:
        late = rep.step >= FAULT_START
        if late:
            for kind, size in what_ifs:
                key = (kind, size)
                s.faults[key] = s.faults.get(key, 0) + 1
                s.caught[key] = s.caught.get(key, 0) + judge.peek(what_if(rep, kind, size))
        flagged = judge.step(rep)
        if late:
            s.clean_steps += 1
            s.clean_flags += flagged
    return s


def fa_rate(j: Judge, value: float, runs: dict[str, list[Any]]) -> float:
    total = Score()
    for reps in runs.values():
        total.add(replay(j.make(value), reps))
    return total.fa_rate


def calibrate(j: Judge, runs: dict[str, list[Any]], target: float) -> tuple[float, float]:
    """(setting, its FA rate on `runs`): bisection over the grid (most to least sensitive)."""
    lo, hi = 0, len(j.grid) - 1
    if fa_rate(j, j.grid[hi], runs) > target:
        return j.grid[hi], fa_rate(j, j.grid[hi], runs)
    while lo < hi:
        mid = (lo + hi) // 2
        if fa_rate(j, j.grid[mid], runs) <= target:
            hi = mid
        else:
            lo = mid + 1
    return j.grid[lo], fa_rate(j, j.grid[lo], runs)


@dataclass
class Direction:
    calib: list[str]
    test: list[str]
    settings: dict[str, tuple[float, float]]  # judge -> (setting, calibration FA rate)
    scores: dict[str, Score]  # judge -> pooled over the test runs
    per_run: dict[str, dict[str, Score]]  # judge -> run -> score


def one_direction(
    calib: dict[str, list[Any]], test: dict[str, list[Any]], target: float, judges: Sequence[Judge]
) -> Direction:
    d = Direction(sorted(calib), sorted(test), {}, {}, {})
    for j in judges:
        d.settings[j.name] = calibrate(j, calib, target)
        d.per_run[j.name] = {
            name: replay(j.make(d.settings[j.name][0]), reps, WHAT_IFS) for name, reps in test.items()
        }
        d.scores[j.name] = Score()
        for s in d.per_run[j.name].values():
            d.scores[j.name].add(s)
        print(
            f"  {j.name}: {j.knob} = {d.settings[j.name][0]:.3g} (calibration FA "
            f"{d.settings[j.name][1]:.2e}/step; test FA {d.scores[j.name].fa_rate:.2e}/step)",
            file=sys.stderr,
            flush=True,
        )
    return d


# ---------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------
def family(run: str) -> str:
    return run.rsplit("-", 1)[0]


def recall_table(dirs: Sequence[Direction]) -> list[str]:
    heads = [f"{k} x{s:g}" for k, s in WHAT_IFS]
    rows = [
        "| rule | set on | knob | FA/1k clean test | " + " | ".join(heads) + " |",
        "|" + "---|" * (len(heads) + 4),
    ]
    for name in dirs[0].scores:
        for d in dirs:
            sc = d.scores[name]
            cells = [f"{sc.recall(k):.3f}" for k in WHAT_IFS]
            seeds = ",".join(sorted({r.rsplit("-", 1)[-1] for r in d.calib}))
            rows.append(
                f"| {name} | seeds {seeds} | {d.settings[name][0]:.3g} | {1000 * sc.fa_rate:.2f} | "
                + " | ".join(cells)
                + " |"
            )
        both = Score()
        for d in dirs:
            both.add(d.scores[name])
        if len(dirs) > 1:
            cells = [f"**{both.recall(k):.3f}**" for k in WHAT_IFS]
            rows.append(f"| {name} | both | | {1000 * both.fa_rate:.2f} | " + " | ".join(cells) + " |")
    return rows


def family_table(dirs: Sequence[Direction]) -> list[str]:
    """Per family, both directions pooled: recall at grad x3 / x5 / FA per 1k clean steps."""
    fams = sorted({family(r) for d in dirs for r in d.test})
    rows = ["| rule | " + " | ".join(fams) + " |", "|" + "---|" * (len(fams) + 1)]
    for name in dirs[0].scores:
        cells = []
        for fam in fams:
            sc = Score()
            for d in dirs:
                for run, s in d.per_run[name].items():
                    if family(run) == fam:
                        sc.add(s)
            cells.append(
                f"{sc.recall(('grad', 3.0)):.2f} / {sc.recall(('grad', 5.0)):.2f} / {1000 * sc.fa_rate:.2f}"
            )
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return rows


def report(args: argparse.Namespace, by_target: dict[float, list[Direction]], seconds: float) -> str:
    from bench.common.docs import machine_line, shown_command

    runs = {*args.calib, *args.test}
    cmd = shown_command(
        "bench/detection/guard_whole.py",
        [f"RUNS/{Path(a.rstrip('/')).name}" if a in runs else a for a in args.argv],
    )
    out = [
        "## The guard judged whole on recorded real-model traces",
        "",
        f"`{cmd.strip()}` ({machine_line()}; {seconds / 60:.1f} min)",
        "",
        "Every step rule of the guard (total grad norm with its local ceiling and the all-layers rule, each "
        "layer's grad norm, the loss) against the peers' installed code (OLMo-core's SkipStepOptimizer on the "
        "grad norm and the loss, ZClip on the grad norm, Lightning's SpikeDetection on the loss), each knob set on the "
        "clean steps of one set of runs to the target and scored on the other set (then the swap). At every "
        "test step from 300 on, what-if copies: grad xF (total and every layer's grad norm x F) and loss xF; "
        "recall is the share caught at that step (bench/detection/guard_whole.py).",
    ]
    for target, dirs in by_target.items():
        out += ["", f"### Target {target:g} false alarms per clean step", "", *recall_table(dirs)]
        out += ["", "Per family, both directions: recall at grad x3 / grad x5 / FA per 1k clean steps:", ""]
        out += family_table(dirs)
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calib", nargs="+", required=True, metavar="RUN", help="recorded runs of set A")
    ap.add_argument("--test", nargs="+", required=True, metavar="RUN", help="recorded runs of set B")
    ap.add_argument("--target", type=float, action="append", help="false alarms per clean step (repeatable)")
    ap.add_argument("--one-way", action="store_true", help="calibrate on A and score on B only (no swap)")
    ap.add_argument("--write-docs", action="store_true", help="write the section of docs/BENCHMARKS.md")
    args = ap.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    shared = {Path(r.rstrip("/")).name for r in args.calib} & {Path(r.rstrip("/")).name for r in args.test}
    if shared:
        ap.error(f"--calib and --test share runs {', '.join(sorted(shared))}: the sets must be disjoint")
    targets = args.target or [1e-4]
    if not all(0 < t < 0.1 for t in targets):
        ap.error("--target: must be in (0, 0.1)")
    t0 = time.time()
    a, b = load_reports(args.calib), load_reports(args.test)
    ways = [(a, b)] + ([] if args.one_way else [(b, a)])
    by_target = {}
    for target in targets:
        by_target[target] = []
        for calib, test in ways:
            print(
                f"target {target:g}: calibrating on {', '.join(sorted(calib))}", file=sys.stderr, flush=True
            )
            by_target[target].append(one_direction(calib, test, target, JUDGES))
    text = report(args, by_target, time.time() - t0)
    print(text)
    if args.write_docs:
        from bench.common.docs import write_section

        write_section("guard_whole_recorded", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
