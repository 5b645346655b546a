"""Detector quality: our spike detectors vs the published rules, on the same traces and faults.

    python -m bench.detection.detector_quality                       # synthetic traces
    python -m bench.detection.detector_quality --runs runs/a runs/b  # recorded moeguard runs
    python -m bench.detection.detector_quality --quick               # a few seconds (tests)
    python -m bench.detection.detector_quality --write-docs          # also update docs/BENCHMARKS.md

Each clean grad-norm or loss trace is copied once per scenario and faults are injected into
the copies at random steps (after step 128, when every detector has warmed up):
  x1.5 ... x100, NaN   one fault size per copy, one fault per 250 steps
  mixed                sizes drawn at random from all of the above, NaN included
  burst                incidents: a x5/x10/x100 spike, then 1-3 x1.5/x2/x3 spikes 10-100 steps
                       later (instabilities cluster; a window that keeps the first spike is blind
                       to the rest)
  clean                no fault: every flag is a false alarm
A fault counts as detected when the detector flags its step or one of the next 3 (the delay is
reported). Every other flag is a false alarm: flagging a clean step means skipping (or
clipping) a good update. Precision, recall and F1 count faults; FA/1k counts false alarms per
1000 clean steps. "overall" pools every injected fault of every scenario.

The baselines are re-implemented from their published code, quirks included (they are the
point of the comparison), and judge each series on its own:
  OLMo-core   SkipStepOptimizer: last 128 values, acts once 64 are held, flags x - mean > 6 std
              (torch.std_mean, unbiased). Flagged values stay in the window; a NaN in the
              window makes every comparison False, so every step is flagged until it leaves.
  OLMo-core NaN-safe  the same rule with non-finite values left out of the window statistics
              (as in the edu-llm/OLMo-core fork); flagged spikes still stay in the window.
  Lightning   SpikeDetection defaults: mode "min", running mean of the last 10 unflagged
              values, warmup 1, rtol 2.0: flags when x rose since the last unflagged value
              and |x - mean| >= 2 * mean; non-finite values are spikes (finite_only=True).
  ZClip       zscore mode, alpha 0.97, warm-up 25 (plain mean/var of the first 25), flags
              z = (x - mean) / (std + 1e-6) > 2.5; the EMA then takes the clipped value.
              A NaN is not flagged (NaN > 2.5 is False) and enters the EMA.
  Megatron    --check-for-spiky-loss: |x| >= 10 x the max of the first 100 finite values
              (frozen); plus its separate NaN/Inf check, which flags non-finite values.
  ours        moeguard's spike rule with the GuardConfig defaults (grad_spike for grad norms,
              loss_spike for losses: the false-alarm budget rule since issue #16, the fixed-z
              SpikeDetector before), and NonFiniteDetector for NaN/Inf, as the DetectorSuite
              runs them (the all-layers rule needs per-layer norms: not here).

Writes docs/BENCHMARKS.md › Detection › Detector quality (synthetic traces) and › Detector quality
on recorded traces (`--runs`).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import textwrap
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np

from bench.common.docs import shown_command
from bench.detection.rules import Lightning, Megatron, OlmoCore, Ours, ZClip, run_detector
from bench.detection.traces import (
    GRAD_NORM,
    Trace,
    burst_faults,
    fault_positions,
    inject,
    load_run_traces,
    synthetic_traces,
)
from guard.core.config import GuardConfig, SpikeConfig, load_guard_config

NAN = float("nan")
SIZES: tuple[float, ...] = (1.5, 2.0, 3.0, 5.0, 10.0, 100.0, NAN)
BURST_PRIMARY = (5.0, 10.0, 100.0)  # an incident starts with a large spike ...
BURST_AFTERSHOCK = (1.5, 2.0, 3.0)  # ... and smaller ones follow within 100 steps
DOCS_START = "<!-- detector_quality:start -->"
DOCS_END = "<!-- detector_quality:end -->"
OURS = "ours"


DetectorFactory = Callable[[str], "Ours | OlmoCore | Lightning | ZClip | Megatron"]


def detector_factories(cfg: GuardConfig) -> dict[str, DetectorFactory]:
    """name -> (series -> fresh detector)."""
    return {
        OURS: lambda s: Ours(cfg.grad_spike if s == GRAD_NORM else cfg.loss_spike),
        "OLMo-core": lambda s: OlmoCore(),
        "OLMo-core NaN-safe": lambda s: OlmoCore(nan_safe=True),
        "Lightning": lambda s: Lightning(),
        "ZClip": lambda s: ZClip(),
        "Megatron": lambda s: Megatron(),
    }


# ---------------------------------------------------------------------------------------
# Scoring
# ---------------------------------------------------------------------------------------
@dataclass(slots=True)
class Score:
    faults: int = 0
    detected: int = 0
    delay_sum: int = 0
    false_alarms: int = 0
    clean_steps: int = 0

    def add(self, other: Score) -> None:
        self.faults += other.faults
        self.detected += other.detected
        self.delay_sum += other.delay_sum
        self.false_alarms += other.false_alarms
        self.clean_steps += other.clean_steps

    @property
    def precision(self) -> float:
        flags = self.detected + self.false_alarms
        return self.detected / flags if flags else (1.0 if self.faults == 0 else 0.0)

    @property
    def recall(self) -> float:
        return self.detected / self.faults if self.faults else NAN

    @property
    def f1(self) -> float:
        p, r = self.precision, self.recall
        return 2 * p * r / (p + r) if p + r > 0 else 0.0

    @property
    def fa_per_1k(self) -> float:
        return 1000.0 * self.false_alarms / self.clean_steps if self.clean_steps else NAN

    @property
    def mean_delay(self) -> float:
        return self.delay_sum / self.detected if self.detected else NAN


def missed(flags: np.ndarray, positions: np.ndarray, tolerance: int) -> list[int]:
    """The fault positions with no flag in [p, p + tolerance]."""
    return [int(p) for p in positions if not flags[p : p + tolerance + 1].any()]


def score(flags: np.ndarray, positions: np.ndarray, tolerance: int) -> Score:
    """Match each fault to the first flag in [p, p + tolerance]; every other flag is a false alarm."""
    flagged = np.flatnonzero(flags)
    used: set[int] = set()
    s = Score(faults=len(positions), clean_steps=len(flags) - len(positions))
    for p in positions:
        lo = np.searchsorted(flagged, p)
        if lo < len(flagged) and flagged[lo] <= p + tolerance:
            s.detected += 1
            s.delay_sum += int(flagged[lo] - p)
            used.add(int(flagged[lo]))
    s.false_alarms = len(flagged) - len(used)
    return s


# ---------------------------------------------------------------------------------------
# The experiment
# ---------------------------------------------------------------------------------------
@dataclass(slots=True)
class Setup:
    seed: int = 0
    every: int = 250  # one fault per this many steps
    start: int = 128  # no fault before every detector has finished its warm-up
    min_gap: int = 30
    tolerance: int = 3


@dataclass(slots=True)
class Results:
    # scenario -> detector -> Score; scenarios: "clean", size labels, "mixed"
    scores: dict[str, dict[str, Score]] = field(default_factory=dict)
    # series (grad_norm, loss) -> scenario -> detector -> Score: where a detector's misses are
    by_series: dict[str, dict[str, dict[str, Score]]] = field(default_factory=dict)
    # series -> the rule that judged each single-size fault ours missed -> count
    ours_missed_by: dict[str, Counter[str]] = field(default_factory=dict)
    n_traces: int = 0
    n_steps: int = 0
    seconds: float = 0.0

    def overall(self) -> dict[str, Score]:
        """Every injected fault of every scenario, pooled."""
        out: dict[str, Score] = {}
        for scen, by_det in self.scores.items():
            if scen == "clean":
                continue
            for det, s in by_det.items():
                out.setdefault(det, Score()).add(s)
        return out


def size_label(size: float) -> str:
    return "NaN" if math.isnan(size) else f"x{size:g}"


def scenarios(
    trace_len: int, setup: Setup, rng: np.random.Generator
) -> list[tuple[str, np.ndarray, list[float]]]:
    """(label, positions, sizes): clean, one per fault size, mixed sizes, and bursts."""
    k = max(1, trace_len // setup.every)
    out: list[tuple[str, np.ndarray, list[float]]] = [("clean", np.zeros(0, dtype=np.int64), [])]
    for size in SIZES:
        pos = fault_positions(trace_len, k, rng, setup.start, setup.min_gap)
        out.append((size_label(size), pos, [size] * len(pos)))
    pos = fault_positions(trace_len, k, rng, setup.start, setup.min_gap)
    out.append(("mixed", pos, [SIZES[i] for i in rng.integers(0, len(SIZES), len(pos))]))
    pos, sizes = burst_faults(trace_len, max(1, k // 3), rng, setup.start, BURST_PRIMARY, BURST_AFTERSHOCK)
    out.append(("burst", pos, sizes))
    return out


def evaluate(traces: Sequence[Trace], cfg: GuardConfig | None = None, setup: Setup | None = None) -> Results:
    cfg = cfg or GuardConfig()
    setup = setup or Setup()
    factories = detector_factories(cfg)
    res = Results(n_traces=len(traces), n_steps=sum(len(t.values) for t in traces))
    t0 = time.perf_counter()
    for i, trace in enumerate(traces):
        rng = np.random.default_rng([setup.seed, i])
        for label, pos, sizes in scenarios(len(trace.values), setup, rng):
            values = inject(trace.values, pos, sizes)
            for name, make in factories.items():
                det = make(trace.series)
                flags = run_detector(det, values)
                got = score(flags, pos, setup.tolerance)
                res.scores.setdefault(label, {}).setdefault(name, Score()).add(got)
                per = res.by_series.setdefault(trace.series, {}).setdefault(label, {})
                per.setdefault(name, Score()).add(got)
                if isinstance(det, Ours) and label.startswith("x"):
                    res.ours_missed_by.setdefault(trace.series, Counter()).update(
                        str(det.rules[p]) for p in missed(flags, pos, setup.tolerance)
                    )
    res.seconds = time.perf_counter() - t0
    return res


# ---------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------
def _f(x: float, digits: int = 3) -> str:
    return "-" if math.isnan(x) else f"{x:.{digits}f}"


def score_table(by_det: dict[str, Score]) -> str:
    rows = [
        "| detector | precision | recall | F1 | FA/1k clean steps | mean delay (steps) | faults | false alarms |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, s in by_det.items():
        rows.append(
            f"| {name} | {_f(s.precision)} | {_f(s.recall)} | {_f(s.f1)} | {_f(s.fa_per_1k, 2)} "
            f"| {_f(s.mean_delay, 2)} | {s.faults} | {s.false_alarms} |"
        )
    return "\n".join(rows)


def f1_summary(res: Results) -> str:
    dets = list(next(iter(res.scores.values())))
    rows = ["| scenario | " + " | ".join(dets) + " |", "|---|" + "---:|" * len(dets)]
    for scen, by_det in res.scores.items():
        if scen == "clean":
            continue
        rows.append(f"| {scen} | " + " | ".join(_f(by_det[d].f1) for d in dets) + " |")
    overall = res.overall()
    rows.append("| **overall** | " + " | ".join(f"**{_f(overall[d].f1)}**" for d in dets) + " |")
    clean = res.scores.get("clean", {})
    rows.append("| FA/1k on clean traces | " + " | ".join(_f(clean[d].fa_per_1k, 2) for d in dets) + " |")
    return "\n".join(rows)


def series_recall_table(res: Results) -> str:
    """Recall per series and single spike size, for every detector: where each one misses."""
    sizes = [size_label(x) for x in SIZES if not math.isnan(x)]
    dets = list(next(iter(res.scores.values())))
    rows = ["| series | detector | " + " | ".join(sizes) + " |", "|---|---|" + "---:|" * len(sizes)]
    for series, by_label in res.by_series.items():
        for d in dets:
            cells = [_f(by_label[z][d].recall) if z in by_label else "-" for z in sizes]
            rows.append(f"| {series} | {d} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def misses_line(res: Results) -> str:
    """Which of ours' rules judged the single-size faults it missed, per series."""
    parts = []
    for series, rules in res.ours_missed_by.items():
        said = ", ".join(f"{r} {n}" for r, n in rules.most_common()) or "none"
        parts.append(f"{series}: {said}")
    return (
        "Ours' rule at the single-size faults it missed (the verdict at the fault step): "
        + "; ".join(parts)
        + "."
    )


METHOD = """\
What it measures: the step-skipping spike rules of moeguard and of four published systems, run
on the same clean per-step grad-norm and loss traces with the same injected faults. Every
detector judges one series at a time and sees every value once, in order, as in training.

Scenarios (faults after step 128, when every detector has warmed up, one per 250 steps):
single sizes x1.5, x2, x3, x5, x10, x100 (multiplicative spikes) and NaN; "mixed" (random sizes,
NaN included, in one trace); "burst" (a x5/x10/x100 spike followed by 1-3 x1.5/x2/x3 spikes
10-100 steps later: instabilities cluster); "clean" (no fault). A fault is detected when its
step or one of the next 3 is flagged; every other flag is a false alarm (a good update
skipped or clipped). FA/1k = false alarms per 1000 clean steps.

Baselines, re-implemented from their published code, quirks included:
- OLMo-core `SkipStepOptimizer`: last 128 values, acts once 64 are held, flags
  x - mean > 6 * std (unbiased). Flagged values stay in the window; a NaN in the window makes
  every comparison false, so every step is flagged until the NaN leaves the window.
- OLMo-core NaN-safe: the same rule with non-finite values left out of the statistics (a
  variant found in the edu-llm/OLMo-core fork); flagged spikes still stay in the window.
- Lightning `SpikeDetection` defaults: running mean of the last 10 unflagged values, flags a
  rise with |x - mean| >= 2 * mean; non-finite values are spikes.
- ZClip (z-score mode): EMA mean/variance (alpha 0.97) after 25 warm-up values, flags
  z > 2.5 (it clips, so its false alarms cost a clipped update, not a skipped one); a NaN is
  not flagged and poisons the EMA.
- Megatron-LM `--check-for-spiky-loss`: |x| >= 10 x the max of the first 100 values
  (frozen), plus its separate NaN/Inf check.
- ours: the guard config's spike rule (below) and `NonFiniteDetector`, as `DetectorSuite` runs
  them."""

OURS_BUDGET = """\
`CalibratedSpikeDetector`, the false-alarm budget rule: log scale, level = median of the last
{level_window} accepted values; the threshold is the run's own (1 - {budget:g}) residual quantile
from a tail fit over the last {tail_memory} accepted values, refitted every {refit_every}; a
value must also clear {rel_min}x the level; before {tail_warmup} accepted values {early}; after
that the fitted threshold, at most {rel_max}x the level; flagged values never enter"""

OURS_FIXED = """\
`SpikeDetector`, the fixed-z rule: log scale, level = median of the last {level_window} accepted
values, z from the median/MAD of {window} residuals against it, z > {z} and above {rel_min}x the
level; flagged values never enter"""


WHY_BUDGET = """\
Why ours can trail on small spikes: every detector here runs at its published default, not at a
matched false-alarm rate. Ours spends a budget of {budget:g} false alarms per clean step on grad
norms (the guard acts on what it flags, so the default is strict) and never flags within
{rel_min}x of the level."""

WHY_FIXED = """\
Why ours can trail on small spikes: it fires only above z = {z} on the log scale and above
{rel_min}x the level, chosen so clean traces raise no alarm."""

WHY_PEERS = """\
OLMo-core's 6 std on the raw scale sits at roughly 4.3-5.2 sigma of log-normal noise with sigma
0.05-0.15, so on these light-tailed traces it catches more x1.5-x3 spikes without a false alarm.
It keeps every spike in its window, which is what the burst and mixed scenarios show. At matched
false-alarm rates on held-out traces see "Detection on held-out traces at matched false-alarm
rates" below."""

WHY_RECORDED = """\
These are recorded runs, not light-tailed synthetic noise: the table of recall by series below
shows where ours misses, and the line under it which of its rules let each missed fault pass. A
threshold at the ceiling means the series' own clean excursions at the budget's rate lie beyond
it (small batches make grad norms heavy-tailed: docs/NOTES.md); the peers catch those sizes by
alarming on clean steps of the same runs (their FA/1k above). The live guard also judges every
layer at once (the all-layers rule), which this bench, one series at a time, does not run."""


def paragraph(text: str, width: int = 100) -> str:
    """Reflow text built from templates into the doc's line width."""
    return textwrap.fill(" ".join(text.split()), width=width, break_on_hyphens=False)


def early_rule(c: SpikeConfig) -> str:
    """What acts before the tail is fitted, in words."""
    cap = c.early_rel_max if c.early_rel_max is not None else c.rel_max
    if cap is None:
        said = "no cap"
    elif c.early_rel_floor is not None and c.tail_margin is not None:
        said = (
            f"a cap of {c.tail_margin:g} x the largest clean log excursion so far, kept within "
            f"{c.early_rel_floor:g}x..{cap:g}x the level"
        )
    else:
        said = f"a cap of {cap:g}x the level"
    return said + (f", and z > {c.early_z:g}" if c.early_z is not None else "")


def ours_rule(c: SpikeConfig) -> str:
    """Our spike rule in words, from the settings the bench ran (budget rule or fixed z)."""
    if c.budget is None:
        return OURS_FIXED.format(**asdict(c))
    return OURS_BUDGET.format(**asdict(c), early=early_rule(c))


def why_ours_trails(c: SpikeConfig, recorded: bool = False) -> str:
    """Why a peer at its default can beat ours here, for the rule the bench ran."""
    why = (WHY_BUDGET if c.budget is not None else WHY_FIXED).format(**asdict(c))
    return why + "\n" + (WHY_RECORDED if recorded else WHY_PEERS)


def spike_settings(c: SpikeConfig) -> str:
    """The settings of one spike rule that decide its flags, as key=value."""
    keys = (
        (
            "budget",
            "level_window",
            "tail_memory",
            "refit_every",
            "tail_warmup",
            "rel_min",
            "early_rel_max",
            "early_rel_floor",
            "early_z",
            "rel_max",
        )
        if c.budget is not None
        else ("window", "level_window", "warmup", "z", "rel_min", "rel_max", "mad_floor")
    )
    return " ".join(f"{k}={getattr(c, k)}" for k in keys)


def where_baselines_win(res: Results) -> list[str]:
    """Scenarios where a baseline's F1 beats ours, worded for the reader (kept honest on re-runs)."""
    lines = []
    for scen, by_det in res.scores.items():
        if scen == "clean":
            continue
        ours = by_det[OURS]
        better = [(n, s) for n, s in by_det.items() if n != OURS and s.f1 > ours.f1 + 1e-9]
        if better:
            who = ", ".join(f"{n} {s.f1:.3f} (FA/1k {s.fa_per_1k:.2f})" for n, s in better)
            lines.append(f"- {scen}: ours {ours.f1:.3f} (FA/1k {ours.fa_per_1k:.2f}) < {who}")
    return lines


def report(
    res: Results,
    source: str,
    command: str,
    cfg: GuardConfig,
    notes: Sequence[str] = (),
    recorded: bool = False,
) -> str:
    from bench.common.docs import machine_line  # imports torch: only when a report is written

    g, lo = cfg.grad_spike, cfg.loss_spike
    parts = [
        METHOD,
        "",
        paragraph(f"Ours: on grad norms {ours_rule(g)}. On the loss {ours_rule(lo)}."),
        "",
        f"Command: `{command}` ({machine_line()})",
        "",
        f"Traces: {source}; {res.n_traces} traces, {res.n_steps} steps per scenario. "
        f"Ours with these guard settings: grad_spike {spike_settings(g)}; loss_spike {spike_settings(lo)}.",
        "",
        "F1 by scenario:",
        "",
        f1_summary(res),
        "",
        "### Overall (every injected fault, all scenarios pooled)",
        "",
        score_table(res.overall()),
    ]
    losses = where_baselines_win(res)
    parts += ["", "Where a baseline scores a higher F1 than ours:", ""]
    parts += losses or ["- nowhere"]
    if losses:
        parts += ["", why_ours_trails(g, recorded)]
    parts += ["", "Recall by series, single spike sizes:", "", series_recall_table(res), "", misses_line(res)]
    if notes:
        parts += ["", "Notes on the recorded traces:", ""] + [f"- {n}" for n in notes]
    parts += ["", "<details><summary>Per-scenario tables</summary>"]
    for scen, by_det in res.scores.items():
        parts += ["", f"#### {scen}", "", score_table(by_det)]
    parts += ["", "</details>"]
    return "\n".join(parts)


def write_docs(
    path: Path, body: str, name: str = "detector_quality", title: str = "Detector quality"
) -> None:
    """Replace our section between the markers (or append it); other sections stay as they are."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    section = f"{start}\n## {title}\n\n{body}\n{end}"
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    if pattern.search(text):
        text = pattern.sub(lambda _: section, text)
    else:
        text = text.rstrip("\n") + "\n\n" + section + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


# ---------------------------------------------------------------------------------------
# main
# ---------------------------------------------------------------------------------------
def build_traces(
    runs: Sequence[str], n_runs: int, n_steps: int, seed: int
) -> tuple[list[Trace], str, list[str]]:
    if runs:
        traces, notes = load_run_traces(runs)
        if not traces:
            raise SystemExit("no usable trace in --runs: " + "; ".join(notes))
        return traces, f"recorded runs {', '.join(runs)}", notes
    src = f"synthetic (bench/detection/traces.py), {n_runs} runs x {n_steps} steps x (grad_norm, loss), seed {seed}"
    return synthetic_traces(n_runs, n_steps, seed), src, []


def run(
    quick: bool = False,
    runs: Sequence[str] = (),
    seed: int = 0,
    n_runs: int | None = None,
    n_steps: int | None = None,
    cfg: GuardConfig | None = None,
) -> tuple[Results, str, list[str]]:
    """The whole benchmark, for tests and main(): (results, trace source, notes)."""
    n_runs = n_runs or (3 if quick else 16)
    n_steps = n_steps or (1500 if quick else 5000)
    traces, source, notes = build_traces(runs, n_runs, n_steps, seed)
    return evaluate(traces, cfg, Setup(seed=seed)), source, notes


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", nargs="+", default=[], metavar="DIR", help="moeguard run directories")
    ap.add_argument("--quick", action="store_true", help="3 short synthetic runs (a few seconds)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--n-runs", type=int, default=None, help="synthetic runs (default 16, quick 3)")
    ap.add_argument(
        "--steps", type=int, default=None, help="steps per synthetic run (default 5000, quick 1500)"
    )
    ap.add_argument("--write-docs", action="store_true", help="update the section in docs/BENCHMARKS.md")
    ap.add_argument("--docs", type=Path, default=Path("docs/BENCHMARKS.md"))
    ap.add_argument(
        "--config",
        type=Path,
        default=None,
        help="take our thresholds from this TOML's [guard] table (default: GuardConfig defaults)",
    )
    ap.add_argument(
        "--section", default="detector_quality", help="docs section name (markers <!-- NAME:start/end -->)"
    )
    args = ap.parse_args(argv)
    cfg = load_guard_config(args.config) if args.config else GuardConfig()
    res, source, notes = run(args.quick, args.runs, args.seed, args.n_runs, args.steps, cfg)
    command = shown_command("-m bench.detection.detector_quality", argv or sys.argv[1:])
    body = report(res, source, command.strip(), cfg, notes, recorded=bool(args.runs))
    print(body)
    if args.write_docs:
        title = "Detector quality" + (" on recorded traces" if args.runs else "")
        write_docs(args.docs, body, args.section, title)
        print(f"\nwrote the '## {title}' section of {args.docs}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
