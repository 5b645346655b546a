"""The history canary's report: canary.json (everything) and canary.md (for a person), and the
one-line summary on stdout."""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from guard.canary.config import EXIT_FAIL, EXIT_PASS, TIMING_CPU, CanaryConfig, Setup
from guard.canary.gate import FAIL, HOST_FIT_MIN_POINTS, PASS, WARN, HostFit, Judgement, worst
from guard.canary.history import finite, json_default
from guard.canary.keys import (
    CPU_EFFICIENCY,
    DATA_WAIT,
    ENV_KEYS,
    H_SHA,
    H_TIME,
    H_TORCH,
    LOSS,
    MEM,
    MFU,
    MFU_ADJ,
    MFU_DEFINITION,
    MFU_METRICS,
    REF,
    TPS,
)
from guard.canary.measure import Measurement
from guard.canary.profile import profile_deltas


def env_differences(env: dict[str, Any], baseline: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Keys whose value now differs from any baseline entry's (torch, CUDA, kernels, ...)."""
    out = []
    for k in ENV_KEYS:
        seen: dict[str, int] = {}
        for e in baseline:
            v = str((e.get("env") or {}).get(k, e.get(k, "?")))
            seen[v] = seen.get(v, 0) + 1
        now = str(env.get(k, "?"))
        if seen and (len(seen) > 1 or now not in seen):
            out.append({"key": k, "current": now, "baseline": seen})
    return out


def host_fit_report(fit: HostFit, runs: list[Measurement]) -> dict[str, Any]:
    """The fit and how far each run's host was from the baseline's (reference ms, median)."""
    ref0 = math.exp(fit.log_ref0) if fit.n else None
    return {
        **dataclasses.asdict(fit),
        "ref0_ms": ref0,
        "run_ref_ms": [(m.summary or {}).get(REF) for m in runs],
        "ref_range_ms": [math.exp(fit.lo), math.exp(fit.hi)] if fit.n else None,
    }


def build_report(
    *,
    setup: Setup,
    args: argparse.Namespace,
    judged: Judgement,
    baseline: list[dict[str, Any]],
    notice: str,
    fingerprint: str,
    config_hash: str,
    slow: float,
    problems: list[str],
) -> dict[str, Any]:
    """canary.json: the verdict and why, both runs' numbers, the environment and profile vs the baseline."""
    decisive, comparisons = judged.runs[-1], judged.comparisons
    env = decisive.result.get("env", {})
    prof = (decisive.summary or {}).get("profile", {})
    failing = [d["metric"] for d in judged.decision if d["final"] == FAIL]
    warned = [d["metric"] for d in judged.decision if d["final"] == WARN]
    return finite(
        {
            "verdict": judged.verdict,
            "exit_code": EXIT_FAIL if judged.verdict == FAIL else EXIT_PASS,
            "regressed_metrics": failing,
            "warned_metrics": warned,
            "decision": judged.decision,
            "pooled": judged.pooled,
            "notice": notice,
            "config": str(setup.path),
            "config_label": setup.label(),
            "config_hash": config_hash,
            "fingerprint": fingerprint,
            "hardware": decisive.result.get("hardware"),
            "timing": decisive.result.get("timing"),
            "inject_slow_pct": slow,
            "history": str(args.history),
            "history_problems": problems,
            "gates": {f.name: getattr(setup.canary, f.name) for f in dataclasses.fields(CanaryConfig)},
            "baseline": {
                "n": len(baseline),
                "entries": [
                    {k: e.get(k) for k in (H_TIME, H_SHA, H_TORCH, MFU, MFU_ADJ, TPS, "run_id")}
                    for e in baseline
                ],
            },
            "runs": [
                {
                    "attempt": m.attempt,
                    "run_id": m.result.get("run_id"),
                    "run_dir": m.result.get("run_dir"),
                    "loadavg": m.result.get("loadavg"),
                    "wall_s": m.result.get("wall_s"),
                    "summary": {k: v for k, v in (m.summary or {}).items() if k != "profile"},
                    "comparison": comparisons[i] if i < len(comparisons) else [],
                    "verdict": worst([r["level"] for r in comparisons[i]]) if i < len(comparisons) else PASS,
                }
                for i, m in enumerate(judged.runs)
            ],
            "env": env,
            "env_differences": env_differences(env, baseline),
            "profile": prof,
            "profile_vs_baseline": profile_deltas(prof, baseline) if baseline else [],
        }
    )


def _fmt_value(metric: str, v: Any) -> str:
    if v is None:
        return "—"
    if metric == MFU or metric.startswith("mfu"):
        return f"{100 * v:.3f}%"
    if metric == MEM:
        return f"{v / 2**20:,.0f} MiB"
    if metric == DATA_WAIT:
        return f"{100 * v:.2f}%"
    if metric == LOSS:
        return f"{v:.4f}"
    return f"{v:,.0f}"


def _fmt_delta(row: dict[str, Any]) -> str:
    if row["delta"] is None:
        return "—"
    return f"{row['delta']:+.2f}{' pp' if row['unit'] == 'pp' else '%'}"


def peak_text(run_or_rep: dict[str, Any], *, detail: bool = True) -> str:
    """' of peak 107 GFLOP/s (pinned ..., x 1/2 cores ...)': what an MFU figure divides by."""
    env = run_or_rep.get("env") or {}
    peak = env.get("peak_flops")
    if not isinstance(peak, int | float) or not peak > 0:
        return " (no peak for this device: tokens/s is the measure)"
    for unit, n in (("PFLOP/s", 1e15), ("TFLOP/s", 1e12), ("GFLOP/s", 1e9), ("FLOP/s", 1.0)):
        if peak >= n:
            where = f" ({env.get('peak_flops_source', 'source not recorded')})" if detail else ""
            return f" of peak {peak / n:.3g} {unit}{where}"
    return ""


def render_markdown(rep: dict[str, Any]) -> str:
    icon = {PASS: "PASS", WARN: "WARN", FAIL: "FAIL"}[rep["verdict"]]
    out = [f"# Canary: {icon}", ""]
    if rep["notice"]:
        out += [f"> {rep['notice']}", ""]
    out += _header_markdown(rep)
    if rep["pooled"]:
        out += _decision_markdown(rep)
    for run in rep["runs"]:
        out += _run_markdown({**run, "timing": rep["timing"], "env": rep.get("env")})
    out += _env_markdown(rep)
    out += _profile_markdown(rep)
    return "\n".join(out) + "\n"


def _header_markdown(rep: dict[str, Any]) -> list[str]:
    timing = (
        f"thread CPU time; gated on {CPU_EFFICIENCY}: training FLOPs per CPU-second over a numpy reference "
        "matmul's, timed right after every step (not MFU, which is below each run)"
        if rep["timing"] == TIMING_CPU
        else "wall clock"
    )
    out = [
        f"- config: `{rep['config_label']}` (hash `{rep['config_hash']}`)",
        f"- fingerprint: `{rep['fingerprint']}`",
        f"- timing: {rep['timing']} ({timing})",
        f"- baseline: median of {rep['baseline']['n']} baseline entries of `{rep['history']}`",
    ]
    out += _host_fit_markdown(rep.get("host_fit"))
    gate = rep.get("mfu_gate") or {}
    if gate.get("reason"):
        out.append(f"- MFU gate: {gate['reason']}")
    if rep["inject_slow_pct"]:
        out.append(f"- injected slowdown: {rep['inject_slow_pct']:g}% of each step's compute")
    if rep["regressed_metrics"]:
        out.append(f"- regressed (fail): {', '.join(rep['regressed_metrics'])}")
    if rep["warned_metrics"]:
        out.append(f"- warned: {', '.join(rep['warned_metrics'])}")
    return out


def _decision_markdown(rep: dict[str, Any]) -> list[str]:
    out = [
        "",
        "## Decision: both runs",
        "",
        "The first run regressed, so the canary re-ran once. A metric fails only if the mean of both runs "
        "is past its fail line and the re-run alone is past its warn line.",
        "",
        "| metric | run 1 | run 2 | mean of both | delta (mean) | final |",
        "|---|---|---|---|---|---|",
    ]
    by = {r["metric"]: r for r in rep["pooled"]}
    for d in rep["decision"]:
        p = by.get(d["metric"], {})
        out.append(
            f"| {d['label']} | {d['first']} | {d['second']} | {_fmt_value(d['metric'], p.get('current'))} | "
            f"{_fmt_delta(p) if p else '—'} | **{d['final']}** |"
        )
    return out


def _run_markdown(run: dict[str, Any]) -> list[str]:
    s = run["summary"]
    load = run.get("loadavg") or [None, None]
    out = [
        "",
        f"## Run {run['attempt']}: `{run['run_id']}` — {run['verdict']}",
        "",
        f"{s.get('window_steps')} steady-state steps of {s.get('steps')}; wall {run.get('wall_s') or 0:.0f} s; "
        f"load average {load[0] or 0:.1f} -> {load[1] or 0:.1f}; step-time IQR {s.get('step_iqr_pct') or 0:.1f}%; "
        f"first step (incl. compile) {s.get('first_step_s') or 0:.2f} s",
        "",
    ]
    per_process = [v for v in s.get("process_mfu") or [] if isinstance(v, int | float)]
    if len(per_process) > 1:
        out += [
            f"{CPU_EFFICIENCY if run.get('timing') == TIMING_CPU else 'MFU'} p50 of each of its "
            f"{len(per_process)} worker processes (the measurement is their "
            f"median): " + ", ".join(f"{100 * v:.3f}%" for v in per_process),
            "",
        ]
    if run["comparison"]:
        out += [
            "| metric | current | baseline | delta | warn / fail | level |",
            "|---|---|---|---|---|---|",
        ]
        for r in run["comparison"]:
            unit = " pp" if r["unit"] == "pp" else "%"
            out.append(
                f"| {r['label']} | {_fmt_value(r['metric'], r['current'])} | "
                f"{_fmt_value(r['metric'], r['baseline'])} | {_fmt_delta(r)} | "
                f"{r['warn']:g}{unit} / {r['fail']:g}{unit} | {r['level']} |"
            )
    else:
        out += ["| metric | value |", "|---|---|"]
        for k in (MFU, TPS, MEM, DATA_WAIT, LOSS):
            out.append(f"| {k} | {_fmt_value(k, s.get(k))} |")
    out.append(
        f"\nWall clock (not gated on CPU): MFU p50 {_fmt_value('mfu', s.get('mfu_wall_p50'))}{peak_text(run)}, "
        f"tokens/s p50 {_fmt_value('tps', s.get('tokens_per_s_wall_p50'))}; "
        f"step p50 {s.get('step_cpu_ms_p50') or 0:.1f} ms CPU / {s.get('step_wall_ms_p50') or 0:.1f} ms wall."
    )
    return out


def _env_markdown(rep: dict[str, Any]) -> list[str]:
    out = ["", "## Environment vs baseline", ""]
    if rep["env_differences"]:
        out += ["| key | now | baseline entries |", "|---|---|---|"]
        for d in rep["env_differences"]:
            seen = ", ".join(f"{k} ×{n}" for k, n in d["baseline"].items())
            out.append(f"| {d['key']} | {d['current']} | {seen} |")
    elif rep["baseline"]["n"]:
        out.append("No differences in " + ", ".join(ENV_KEYS) + ".")
    else:
        out.append("No baseline entries to compare with.")
    env = rep.get("env") or {}
    out.append(
        f"\nNow: torch {env.get('torch')}, CUDA {env.get('cuda')}, device {env.get('device')}, attention "
        f"{env.get('attention_backend')}, experts {env.get('expert_kernel')}, compile {env.get('compile')}, "
        f"git {env.get('git_sha')}."
    )
    return out


def _host_fit_markdown(fit: dict[str, Any] | None) -> list[str]:
    if not fit:
        return []
    if not fit.get("n"):
        return [
            "- host adjustment: none (fewer than "
            f"{HOST_FIT_MIN_POINTS} baseline processes with reference times): MFU is plain-normalised"
        ]
    runs = ", ".join(f"{v:.2f}" for v in fit.get("run_ref_ms") or [] if isinstance(v, int | float))
    lo, hi = fit["ref_range_ms"]
    return [
        f"- host adjustment: over {fit['n']} baseline processes log MFU = {fit['slope']:+.2f} x log(reference ms) "
        f"+ c (r = {fit['r'] if fit['r'] is not None else float('nan'):.2f}); each process's MFU is moved along "
        f"it to the baseline's median reference {fit['ref0_ms']:.2f} ms (seen {lo:.2f}-{hi:.2f} ms, clipped to "
        f"that range). This run: reference {runs} ms"
    ]


def _profile_markdown(rep: dict[str, Any]) -> list[str]:
    prof = rep.get("profile") or {}
    out = ["", "## Profile (torch.profiler window of the decisive run)", ""]
    if not prof.get("file"):
        return out + [prof.get("note", "no trace")]
    out.append(
        f"`{prof['file']}`: {prof['profiled_steps']} profiled step(s); times are per step, wall clock "
        'inside the trace (self = excluding child ops). "vs baseline" compares self time with the '
        "median of the baseline entries' profiles: a few profiled steps on a shared CPU, so read only "
        "large changes (tens of percent) or ops that appear or vanish."
    )
    deltas = {d["op"]: d for d in rep.get("profile_vs_baseline", [])}
    for title, key in (("Top ops by total time", "top_total"), ("Top ops by self time", "top_self")):
        out += [
            "",
            f"**{title}**",
            "",
            "| op | calls | total ms | self ms | self vs baseline |",
            "|---|---|---|---|---|",
        ]
        for r in prof.get(key, []):
            d = deltas.get(r["op"], {}).get("delta_pct")
            out.append(
                f"| `{r['op']}` | {r['calls']} | {r['total_ms']:.3f} | {r['self_ms']:.3f} | "
                f"{'—' if d is None else f'{d:+.0f}%'} |"
            )
    if prof.get("device_top"):
        out += ["", "**Top device kernels**", "", "| kernel | calls | total ms |", "|---|---|---|"]
        for r in prof["device_top"]:
            out.append(f"| `{r['op'][:90]}` | {r['calls']} | {r['total_ms']:.3f} |")
    return out


def write_json_and_markdown(
    rep: dict[str, Any], report_dir: Path, stem: str, render: Callable[[dict[str, Any]], str]
) -> tuple[Path, Path]:
    """STEM.json (the report, non-finite numbers as null) and STEM.md (`render` of it) in report_dir;
    the report learns both paths."""
    report_dir.mkdir(parents=True, exist_ok=True)
    md, js = report_dir / f"{stem}.md", report_dir / f"{stem}.json"
    rep["report_md"], rep["report_json"] = str(md), str(js)
    js.write_text(json.dumps(rep, indent=2, default=json_default) + "\n")
    md.write_text(render(rep))
    return md, js


def write_reports(rep: dict[str, Any], report_dir: Path) -> tuple[Path, Path]:
    return write_json_and_markdown(rep, report_dir, "canary", render_markdown)


def print_summary(rep: dict[str, Any]) -> None:
    rows = rep["pooled"] or rep["runs"][0]["comparison"]
    final = {d["metric"]: d["final"] for d in rep["decision"]}
    for r in rows:
        if final.get(r["metric"], PASS) != PASS:
            unit = " pp" if r["unit"] == "pp" else "%"
            what = "mean of both runs" if rep["pooled"] else "current"
            print(
                f"canary {final[r['metric']].upper()}: {r['metric']} {_fmt_value(r['metric'], r['current'])} ({what}) vs "
                f"baseline {_fmt_value(r['metric'], r['baseline'])} ({_fmt_delta(r)}; warn {r['warn']:g}{unit}, "
                f"fail {r['fail']:g}{unit})"
            )
    if rep["notice"]:
        print(f"canary notice: {rep['notice']}")
    tail = ""
    mfu = next((r for r in rows if r["metric"] in MFU_METRICS), None)
    if mfu is not None and mfu["delta"] is not None:
        tail = f" ({_fmt_delta(mfu)} vs the median of {mfu['n_baseline']} baseline entries)"
    now = mfu["current"] if mfu else rep["runs"][-1]["summary"].get(MFU)
    if not rows:  # no baseline: a PASS that compared nothing must say so
        tail = " (nothing compared: no baseline for this machine and config)"
    last = rep["runs"][-1]["summary"]
    if rep.get("timing") == TIMING_CPU:  # the gated number is not MFU: named apart, MFU beside it
        head = f"{CPU_EFFICIENCY} p50 {_fmt_value(MFU, now)} (gated; vs the reference matmul){tail}; "
        head += f"MFU p50 {_fmt_value(MFU, last.get('mfu_wall_p50'))}{peak_text(rep, detail=False)}"
    else:
        head = f"MFU p50 {_fmt_value(MFU, now)}{peak_text(rep, detail=False)}{tail}"
    print(
        f"canary {rep['verdict'].upper()}: {head}; {len(rep['runs'])} run(s); report: {rep.get('report_md', '')}"
    )
    print(f"canary: {MFU_DEFINITION}")
