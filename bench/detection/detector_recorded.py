"""Detection on recorded real-model runs at matched false-alarm rates, every knob set on recorded runs.

    python bench/detection/detector_recorded.py --calib /tmp/clean1k/*-[01] --test /tmp/clean1k/*-[23] \\
        --target 1e-4 --target 1e-3 [--write-docs]

Two disjoint sets of recorded run stores (folders named family-seed, e.g. from
`bench/drills/real_models.py --observe --keep DIR`). Each detector's sensitivity knob (ours: the budget;
OLMo-core sigma_factor, ZClip z_thresh, Lightning rtol, Megatron factor: bench/detection/detector_heldout.py)
is set on the clean traces of the --calib runs alone, to the most sensitive grid value with at
most --target false alarms per clean step (grad norm and loss pooled, steps from 300 on), then
scored on the --test runs with injected spikes; then the same with the two sets swapped, so every
figure has a second look (the spread shown is the two directions). No synthetic trace sets
anything here (bench/detection/detector_heldout.py --recorded scores recorded runs at knobs set on
synthetic traces instead).

Scoring as in detector_heldout: single-step multiplicative spikes every 250 steps after step 300,
one size per copy, detected when the spike's step or one of the next 3 is flagged; a 1,000-step
run holds 3 such faults, so --copies position sets are scored per trace and size.

Where ours misses: every grad-norm fault of the test runs, caught or not by ours and by the best
peer, by size, by family and by when it came; and which of ours' rules judged it (budget: the
fitted tail's threshold; rel_max: the ceiling, when the fitted threshold sits above rel_max x the
level), with the median threshold as a multiple of the level.

Writes docs/BENCHMARKS.md › Detection › Detection on recorded real-model traces, every knob set on
recorded runs.
"""

from __future__ import annotations

import sys
from pathlib import Path as _P

sys.path.insert(0, str(_P(__file__).resolve().parents[2]))  # `python bench/<group>/x.py` from a checkout

import argparse
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from bench.detection import detector_heldout as dh
from bench.detection.traces import GRAD_NORM, LOSS, Trace, inject
from guard.core.config import SpikeConfig
from guard.core.detectors.spike import SpikeDetector

DEFAULT_COPIES = 4
GUARD_BUDGET = 1e-5  # GuardConfig's grad_spike / loss_spike budget
LATE_STEP = 600  # faults from here on meet a tail fit of 300+ more residuals than the first ones


class OursFixedZ:
    """The guard's fixed-z spike rule (guard/core/detectors/spike.py: a robust z of the log
    residual, no tail fit) with the budget rule's other bench settings: a candidate (--fixed-z),
    not what the guard ships."""

    def __init__(self, z: float) -> None:
        self.det = SpikeDetector(SpikeConfig(z=z, rel_min=1.2, rel_max=20.0, tail_warmup=200))

    def step(self, x: float) -> bool:
        return self.det.update(float(x)).fired


FIXED_Z = dh.Knob(
    "ours (fixed z, candidate)", "z", tuple(np.round(np.arange(3.0, 60.01, 0.5), 2)), OursFixedZ
)
ALL_KNOBS = (*dh.KNOBS, FIXED_Z)


@dataclass
class Direction:
    """One calibrate-then-score pass: knobs set on `calib_runs`, scored on `test_runs`."""

    calib_runs: list[str]
    test_runs: list[str]
    settings: dict[str, float]
    calib_fa: dict[str, float]
    results: dict[str, dict]  # detector -> tallies (dh.evaluate)
    default_fa: dict[str, float]  # peer -> FA/1k on the clean test runs at its published default


def run_name(path: str) -> str:
    return Path(path.rstrip("/")).name


def check_split(calib: Sequence[str], test: Sequence[str]) -> None:
    """Both sets given, and no run (by folder name) in both: a run that sets a knob is never scored."""
    if not calib or not test:
        raise SystemExit("--calib and --test: both need at least one recorded run")
    shared = sorted({run_name(r) for r in calib} & {run_name(r) for r in test})
    if shared:
        raise SystemExit(f"--calib and --test share runs {', '.join(shared)}: the sets must be disjoint")


def default_setting(knob: dh.Knob) -> float:
    """The published default (ours: the guard's shipped budget)."""
    own = {FIXED_Z.name: SpikeConfig().z}
    if knob.name in own:
        return own[knob.name]
    return GUARD_BUDGET if knob.name.startswith("ours") else dh.default_of(knob)


def clean_fa_per_1k(knob: dh.Knob, value: float, traces: Sequence[Trace]) -> float:
    return 1000.0 * dh.fa_rate(knob, value, traces)


def one_direction(
    calib_runs: Sequence[str], test_runs: Sequence[str], target: float, knobs: Sequence[dh.Knob], copies: int
) -> Direction:
    """Every knob set on the calibration runs' clean traces, then scored on the test runs."""
    calib, test = dh.recorded_traces(calib_runs), dh.recorded_traces(test_runs)
    d = Direction(list(calib_runs), list(test_runs), {}, {}, {}, {})
    for knob in knobs:
        d.settings[knob.name], d.calib_fa[knob.name] = dh.calibrate(knob, calib, target)
        d.results[knob.name] = dh.evaluate(knob, d.settings[knob.name], test, copies)
        d.default_fa[knob.name] = clean_fa_per_1k(knob, default_setting(knob), test)
        print(
            f"  {knob.name}: {knob.knob} = {d.settings[knob.name]:.3g} "
            f"(calibration FA {d.calib_fa[knob.name]:.2e}/step)",
            file=sys.stderr,
            flush=True,
        )
    return d


# ---------------------------------------------------------------------------------------
# Pooling the two directions
# ---------------------------------------------------------------------------------------
def merged(tallies: Sequence[dh.Tally]) -> dh.Tally:
    out = dh.Tally()
    for t in tallies:
        out.faults += t.faults
        out.hits += t.hits
        out.false_pos += t.false_pos
        out.clean_flags += t.clean_flags
        out.clean_steps += t.clean_steps
    return out


def looks(
    dirs: Sequence[Direction], name: str, series: str, size: float, families: Sequence[str]
) -> tuple[dh.Tally, list[dh.Tally]]:
    """(both directions pooled, each direction alone) for one detector, series and size."""
    each = [dh.pooled(d.results[name], series, size, families) for d in dirs]
    return merged(each), each


def cell(pooled: float, each: Sequence[float], digits: int = 3) -> str:
    """The pooled figure with the two directions' figures as its spread."""
    f = dh._f
    if len(each) < 2:
        return f(pooled, digits)
    return f"{f(pooled, digits)} ({f(min(each), digits)}..{f(max(each), digits)})"


def families_of(dirs: Sequence[Direction]) -> list[str]:
    return dh.recorded_families([r for d in dirs for r in d.test_runs])


# ---------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------
def settings_table(dirs: Sequence[Direction]) -> list[str]:
    heads = [f"set on {seeds_label(d.calib_runs)} (calibration FA/1k)" for d in dirs]
    rows = [
        "| detector | knob | " + " | ".join(heads) + " | default (its FA/1k on the test runs) |",
        "|" + "---|" * (len(dirs) + 3),
    ]
    for knob in (k for k in ALL_KNOBS if k.name in dirs[0].settings):
        cells = [f"{d.settings[knob.name]:.3g} ({1000 * d.calib_fa[knob.name]:.2f})" for d in dirs]
        fa = [d.default_fa[knob.name] for d in dirs]
        default = f"{default_setting(knob):g} ({min(fa):.2f}..{max(fa):.2f})"
        rows.append(f"| {knob.name} | {knob.knob} | " + " | ".join(cells) + f" | {default} |")
    return rows


def seeds_label(runs: Sequence[str]) -> str:
    seeds = sorted({run_name(r).rsplit("-", 1)[-1] for r in runs}, key=lambda s: (len(s), s))
    return f"seed{'s' if len(seeds) > 1 else ''} {','.join(seeds)}"


def size_table(dirs: Sequence[Direction], series: str, measure: str) -> list[str]:
    """F1 or recall per spike size, both directions pooled, with the two directions' spread."""
    fams = families_of(dirs)
    rows = [
        "| detector | FA/1k clean test | " + " | ".join(f"x{s:g}" for s in dh.SIZES) + " |",
        "|" + "---|" * (len(dh.SIZES) + 2),
    ]
    for name in dirs[0].results:
        fa, fa_each = looks(dirs, name, series, 0.0, fams)
        cells = [cell(fa.fa_per_1k, [t.fa_per_1k for t in fa_each], 2)]
        for s in dh.SIZES:
            pooled, each = looks(dirs, name, series, s, fams)
            cells.append(cell(getattr(pooled, measure), [getattr(t, measure) for t in each]))
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return rows


def family_table(dirs: Sequence[Direction], series: str = GRAD_NORM) -> list[str]:
    """Per family: recall at x3 / x5 / FA per 1k clean steps, both directions pooled."""
    fams = families_of(dirs)
    rows = ["| detector | " + " | ".join(fams) + " |", "|" + "---|" * (len(fams) + 1)]
    for name in dirs[0].results:
        cells = []
        for fam in fams:
            r3, r5, fa = (looks(dirs, name, series, s, (fam,))[0] for s in (3.0, 5.0, 0.0))
            cells.append(f"{dh._f(r3.recall, 2)} / {dh._f(r5.recall, 2)} / {dh._f(fa.fa_per_1k, 2)}")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return rows


def not_ahead(dirs: Sequence[Direction]) -> list[str]:
    """Every (series, size) where a peer's pooled F1 beats ours, or its test FA/1k is lower."""
    ours = next((n for n in dirs[0].results if n.startswith("ours")), None)
    if ours is None:
        return ["- (ours not run)"]
    fams, lines = families_of(dirs), []
    for series in (GRAD_NORM, LOSS):
        fa_ours = looks(dirs, ours, series, 0.0, fams)[0].fa_per_1k
        for name in (n for n in dirs[0].results if n != ours):
            fa = looks(dirs, name, series, 0.0, fams)[0].fa_per_1k
            if fa < fa_ours:
                lines.append(f"- {series}: {name} has fewer false alarms ({fa:.2f} vs {fa_ours:.2f} per 1k)")
            behind = [
                f"x{s:g} {b:.3f} > {a:.3f}"
                for s in dh.SIZES
                if (b := looks(dirs, name, series, s, fams)[0].f1)
                > (a := looks(dirs, ours, series, s, fams)[0].f1)
            ]
            if behind:
                lines.append(f"- {series}: {name} F1 ahead of ours at " + ", ".join(behind))
    return lines or [
        "- nowhere: ours has the highest F1 at every size and no more false alarms than any peer"
    ]


# ---------------------------------------------------------------------------------------
# Where ours misses: fault by fault, ours against the best peer
# ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FaultRecord:
    family: str
    step: int
    size: float
    ours_hit: bool
    peer_hit: bool
    rule: str  # ours' rule at the fault step (budget, rel_max, tail_warmup, ...)
    threshold_x: float  # ours' threshold at the fault step as a multiple of its level


def ours_verdicts(budget: float, values: np.ndarray) -> tuple[np.ndarray, list]:
    det = dh.Ours(budget).det
    verdicts = [det.update(float(x)) for x in values]
    return np.array([v.fired for v in verdicts]), verdicts


def fault_records(d: Direction, peer: str, copies: int, series: str = GRAD_NORM) -> list[FaultRecord]:
    """One record per injected fault of `series` in the test runs (ours at its calibrated budget)."""
    ours = next(k for k in dh.KNOBS if k.name.startswith("ours"))
    peer_knob = next(k for k in dh.KNOBS if k.name == peer)
    out = []
    for t in (t for t in dh.recorded_traces(d.test_runs) if t.series == series):
        for copy in range(copies):
            pos = dh.fault_steps(t, copy)
            for size in dh.SIZES:
                values = inject(t.values, pos, [size] * len(pos))
                flags, verdicts = ours_verdicts(d.settings[ours.name], values)
                peer_flags = dh.run_detector(peer_knob.make(d.settings[peer]), values)
                for p in pos:
                    window = slice(p, p + dh.TOLERANCE + 1)
                    v = verdicts[p]
                    median = v.evidence.get("median", math.nan)
                    out.append(
                        FaultRecord(
                            t.name.rsplit("-", 1)[0],
                            int(p),
                            size,
                            bool(flags[window].any()),
                            bool(peer_flags[window].any()),
                            str(v.evidence.get("rule", "-")),
                            v.threshold / median if median > 0 else math.nan,
                        )
                    )
    return out


def best_peer(dirs: Sequence[Direction]) -> str:
    """The peer with the highest grad-norm F1 summed over the sizes (both directions pooled)."""
    fams = families_of(dirs)
    peers = [n for n in dirs[0].results if not n.startswith("ours")]
    return max(peers, key=lambda n: sum(looks(dirs, n, GRAD_NORM, s, fams)[0].f1 for s in dh.SIZES))


def recall_pair(records: Sequence[FaultRecord]) -> str:
    """Ours' and the peer's recall over these faults."""
    if not records:
        return "- / -"
    ours, peer = np.mean([r.ours_hit for r in records]), np.mean([r.peer_hit for r in records])
    return f"{ours:.2f} / {peer:.2f}"


def miss_table(records: Sequence[FaultRecord], peer: str) -> list[str]:
    """Per size: faults, who caught them, and ours' threshold where it missed."""
    rows = [
        f"| size | faults | both | ours only | {peer} only | neither | ours' rule at its misses "
        "| ours' threshold at its misses (x level, median) | recall at steps 300-599: ours / peer "
        "| recall at steps 600+: ours / peer |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for size in dh.SIZES:
        rs = [r for r in records if r.size == size]
        missed = [r for r in rs if not r.ours_hit]
        rules = sorted({r.rule for r in missed})
        rule_txt = ", ".join(f"{rule} {sum(r.rule == rule for r in missed)}" for rule in rules) or "-"
        thr = np.median([r.threshold_x for r in missed]) if missed else math.nan
        early = [r for r in rs if r.step < LATE_STEP]
        late = [r for r in rs if r.step >= LATE_STEP]
        rows.append(
            f"| x{size:g} | {len(rs)} | {sum(r.ours_hit and r.peer_hit for r in rs)} "
            f"| {sum(r.ours_hit and not r.peer_hit for r in rs)} | {sum(r.peer_hit and not r.ours_hit for r in rs)} "
            f"| {sum(not (r.ours_hit or r.peer_hit) for r in rs)} | {rule_txt} | {dh._f(thr, 2)} "
            f"| {recall_pair(early)} | {recall_pair(late)} |"
        )
    return rows


# ---------------------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------------------
def target_section(
    target: float, dirs: Sequence[Direction], records: Sequence[FaultRecord], peer: str
) -> list[str]:
    out = [f"### Target {target:g} false alarms per clean step", "", *settings_table(dirs)]
    for series in (GRAD_NORM, LOSS):
        out += [
            "",
            f"F1 per spike size, {series} (both directions pooled; the two directions in brackets):",
            "",
        ]
        out += size_table(dirs, series, "f1")
    out += ["", f"Recall per spike size, {GRAD_NORM}:", "", *size_table(dirs, GRAD_NORM, "recall")]
    out += ["", "Per family, grad norm: recall at x3 / recall at x5 / FA per 1k clean steps:", ""]
    out += family_table(dirs)
    if records:
        out += ["", f"Grad-norm faults, ours against the best peer ({peer}), both directions:", ""]
        out += miss_table(records, peer)
    out += ["", "Where ours is not ahead (both directions pooled):", "", *not_ahead(dirs)]
    return out


def command_line(argv: Sequence[str], runs: set[str]) -> str:
    """The command as run, each run folder by its name (no machine paths in the docs)."""
    from bench.common.docs import shown_command

    return shown_command(
        "bench/detection/detector_recorded.py", [f"RUNS/{run_name(a)}" if a in runs else a for a in argv]
    )


def report(args: argparse.Namespace, by_target: dict, seconds: float) -> str:
    from bench.common.docs import machine_line

    cmd = command_line(args.argv, {*args.calib, *args.test})
    calib, test = sorted(map(run_name, args.calib)), sorted(map(run_name, args.test))
    out = [
        "## Detection on recorded real-model traces, every knob set on recorded runs",
        "",
        f"`{cmd.strip()}` ({machine_line()}; {seconds / 60:.1f} min)",
        "",
        f"Set A: {', '.join(calib)}. Set B: {', '.join(test)}. Each detector's knob is set on the clean "
        "traces of one set alone (grad norm and loss pooled, steps from 300 on) to the most sensitive grid "
        "value with at most the target false alarms per clean step, then scored on the other set; then the "
        "sets swap. No synthetic trace sets anything. Single-step spikes every 250 steps after step 300 "
        f"({args.copies} position sets per run and size), detected within 3 steps.",
    ]
    for target, (dirs, records, peer) in by_target.items():
        out += ["", *target_section(target, dirs, records, peer)]
    return "\n".join(out) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calib", nargs="+", required=True, metavar="RUN", help="recorded runs of set A")
    ap.add_argument("--test", nargs="+", required=True, metavar="RUN", help="recorded runs of set B")
    ap.add_argument("--target", type=float, action="append", help="false alarms per clean step (repeatable)")
    ap.add_argument("--copies", type=int, default=DEFAULT_COPIES, help="fault position sets per run and size")
    ap.add_argument("--fixed-z", action="store_true", help="also score ours' fixed-z rule (a candidate)")
    ap.add_argument("--one-way", action="store_true", help="calibrate on A and score on B only (no swap)")
    dh.add_shared_options(ap)
    args = ap.parse_args(argv)
    dh.apply_shared_options(ap, args)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    check_split(args.calib, args.test)
    targets = args.target or [1e-4]
    for t in targets:
        if not 0 < t < 0.1:
            ap.error(f"--target {t}: must be in (0, 0.1)")
    if args.copies < 1:
        ap.error(f"--copies {args.copies}: must be at least 1")
    knobs = [k for k in dh.KNOBS if not args.detectors or k.name in args.detectors.split(",")]
    knobs += [FIXED_Z] if args.fixed_z else []
    if not knobs:
        ap.error(f"--detectors {args.detectors!r}: none of {', '.join(k.name for k in dh.KNOBS)}")
    t0 = time.time()
    ways = [(args.calib, args.test)] + ([] if args.one_way else [(args.test, args.calib)])
    by_target = {}
    for target in targets:
        dirs = []
        for calib, test in ways:
            print(f"target {target:g}: calibrating on {seeds_label(calib)}", file=sys.stderr, flush=True)
            dirs.append(one_direction(calib, test, target, knobs, args.copies))
        peer, records = "", []
        if knobs[0].name.startswith("ours") and any(not k.name.startswith("ours") for k in knobs):
            peer = best_peer(dirs)
            records = [r for d in dirs for r in fault_records(d, peer, args.copies)]
        by_target[target] = (dirs, records, peer)
    text = report(args, by_target, time.time() - t0)
    print(text)
    if args.write_docs:
        from bench.common.docs import write_section

        write_section("detector_recorded_matched", text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
