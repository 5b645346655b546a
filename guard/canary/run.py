"""One history-gated canary: measure, compare with the baseline, confirm, report, record.

    moeguard canary --config configs/canary.toml --history H.jsonl            # the gate
    moeguard canary --config configs/canary.toml --history H.jsonl --record   # add a baseline

No baseline for the fingerprint: pass with a notice (CI on another machine class must not fail for
that). A regression must repeat before it fails (gate.decide). `--inject slow:PCT` burns PCT% of
each step's own compute inside the step (the worker does it), so the run store's step times show it.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path
from typing import Any

from guard.canary.config import EXIT_FAIL, EXIT_PASS, EXIT_USAGE, TIMING_CPU, CanaryConfig, Setup, parse_slow
from guard.canary.gate import (
    FAIL,
    HostFit,
    Judgement,
    compare,
    fit_host,
    needs_confirmation,
    with_host_adjusted,
    young_fail_line,
)
from guard.canary.history import append_history, finite, history_entry, read_history, select_baseline
from guard.canary.measure import Measurement, describe, measure, progress
from guard.canary.report import build_report, host_fit_report, print_summary, write_reports
from guard.canary.stats import pool_summaries, process_pairs
from guard.core.tomlconf import ConfigError


def run_canary(args: argparse.Namespace, setup: Setup) -> int:
    slow = parse_slow(args.inject)
    if slow and (args.record or args.append):
        raise ConfigError("--inject slows the run on purpose; it cannot be --record'ed or --append'ed")
    history_path = Path(args.history)
    entries, problems = read_history(history_path)
    for p in problems:
        progress(f"warning: {history_path}: {p} (skipped)")
    name = f"canary[slow:{slow:g}]" if slow else "canary"
    config_hash = setup.config_hash()

    progress(f"measuring {setup.label()} (config hash {config_hash}) ...")
    first = measure(setup, Path(args.runs), name=name, slow_pct=slow)
    if first.result.get("status") == "unavailable":
        print(f"moeguard canary: the config cannot run here: {first.result.get('reason')}", file=sys.stderr)
        return EXIT_USAGE
    if not first.ok:
        return report_error(first)
    progress(describe(first))
    timing = first.result["timing"]
    fingerprint = f"{first.result['hardware']} | cfg {config_hash}"
    baseline = select_baseline(entries, fingerprint, config_hash, setup.canary.history_window)
    fit = fit_host([p for e in baseline for p in process_pairs(e)]) if timing == TIMING_CPU else HostFit()
    baseline = [with_host_adjusted(e, fit) for e in baseline]
    first.summary = with_host_adjusted(first.summary, fit)
    line = young_fail_line(baseline, timing, setup.canary)
    gates = (
        dataclasses.replace(setup.canary, mfu_fail_pct=line["fail_pct"]) if line["widened"] else setup.canary
    )

    judged = Judgement(
        runs=[first],
        comparisons=[compare(first.summary, baseline, gates, timing)] if baseline else [[]],
        summary=first.summary,
    )
    if gates.confirm and needs_confirmation(judged.comparisons[0]):
        progress("the first run regressed; re-running once to confirm ...")
        second = measure(setup, Path(args.runs), name=name, slow_pct=slow, attempt=2)
        judged.runs.append(second)
        if not second.ok:
            return report_error(second)
        second.summary = with_host_adjusted(second.summary, fit)
        progress(describe(second))
        judged.comparisons.append(compare(second.summary, baseline, gates, timing))
        judged.summary = pool_summaries([first.summary, second.summary])
        judged.pooled = compare(judged.summary, baseline, gates, timing)
    judged.decide()

    report = build_report(
        setup=setup,
        args=args,
        judged=judged,
        baseline=baseline,
        notice=notice(args, fingerprint, baseline, line, judged),
        fingerprint=fingerprint,
        config_hash=config_hash,
        slow=slow,
        problems=problems,
    )
    report["host_fit"] = finite(host_fit_report(fit, judged.runs))
    report["mfu_gate"] = finite(line)
    if args.record or args.append:
        report["recorded"] = record(args, setup, judged, fingerprint, config_hash, gates)
    write_reports(report, Path(args.report_dir))
    print_summary(report)
    if report.get("recorded"):
        print(recorded_line(report["recorded"], baseline, judged))
    if args.record and not report["recorded"]["baseline"]:
        print(
            "moeguard canary: the run failed, so it was appended as a non-baseline entry; to accept a new "
            "level on purpose (an intended change), re-run with --record --accept",
            file=sys.stderr,
        )
    return EXIT_FAIL if judged.verdict == FAIL else EXIT_PASS


def notice(
    args: argparse.Namespace,
    fingerprint: str,
    baseline: list[dict[str, Any]],
    line: dict[str, Any],
    judged: Judgement,
) -> str:
    """The line a reader must not miss: no baseline, a widened MFU line, a regression that did not repeat."""
    parts = []
    if not baseline and not args.record:  # a --record with no baseline records the first one: no hint
        parts.append(
            f"no baseline for {fingerprint}; record one with --record "
            f"(moeguard canary --config {args.config} --history {args.history} --record)"
        )
    if line["widened"]:
        parts.append("young baseline: " + line["reason"])
    if judged.pooled and judged.verdict != FAIL and any(r["level"] == FAIL for r in judged.comparisons[0]):
        parts.append("the first run failed but the regression did not repeat in the re-run: not failing")
    return "; ".join(parts)


def record(
    args: argparse.Namespace,
    setup: Setup,
    judged: Judgement,
    fingerprint: str,
    config_hash: str,
    gates: CanaryConfig,
) -> dict[str, Any]:
    """Append the canary to the history: a baseline entry with --record (unless it failed and was not
    --accept'ed), else a trend entry. Returns where it went and as what."""
    as_baseline = bool(args.record and (judged.verdict != FAIL or args.accept))
    entry = history_entry(
        judged.runs[-1], judged.summary, setup, fingerprint, config_hash, judged.verdict, as_baseline
    )
    entry["fail_pct_applied"] = gates.mfu_fail_pct  # the widened line on a young CPU baseline
    append_history(Path(args.history), entry)
    return {"path": str(args.history), "baseline": as_baseline}


def recorded_line(rec: dict[str, Any], baseline: list[dict[str, Any]], judged: Judgement) -> str:
    """What --record / --append wrote, and against what this run was (or was not) compared."""
    what = "a baseline entry" if rec["baseline"] else "a trend entry (not a baseline)"
    against = (
        f"it was compared with {len(baseline)} baseline entr{'y' if len(baseline) == 1 else 'ies'} first"
        if baseline
        else "nothing was compared (there was no baseline yet); later canaries on this machine and "
        "config compare against it"
    )
    return (
        f"canary recorded: appended this run ({len(judged.runs)} measurement(s)) to {rec['path']} as "
        f"{what}; {against}"
    )


def report_error(m: Measurement) -> int:
    print(f"moeguard canary: measurement failed: {m.result.get('reason')}", file=sys.stderr)
    for line in m.result.get("stderr_tail", []):
        print(f"  {line}", file=sys.stderr)
    return EXIT_FAIL
