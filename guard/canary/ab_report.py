"""The A/B canary's report (guard/canary/ab.py): JSON + Markdown, environment and profile diffs."""

from __future__ import annotations

import dataclasses
import statistics
import time
from pathlib import Path
from typing import Any

from guard.canary.ab_format import (
    AB_JSON,
    FORMAT,
    KIND,
    MFU_R,
    RATIO_LABELS,
    SPEED,
    EnvRow,
    OpChange,
    ProfileDiff,
    Report,
    SideSummary,
)
from guard.canary.ab_parts import ENV_DIFF_KEYS, Paired, Side, paired_statistic
from guard.canary.config import EXIT_FAIL, EXIT_PASS, Setup
from guard.canary.gate import FAIL
from guard.canary.history import finite
from guard.canary.keys import H_TIME_FORMAT
from guard.canary.profile import profile_summary
from guard.canary.report import write_json_and_markdown

TOP_CHANGED = 10


def env_diff(sides: list[Side], rows: list[dict[str, Any]]) -> list[EnvRow]:
    """Every ENV_DIFF_KEYS value of A and of B (the first worker of each), and whether they differ.
    Values seen to vary between workers of one side are listed joined by ' / '."""
    out = []
    for key in ENV_DIFF_KEYS:
        vals = {}
        for side in sides:
            seen: list[str] = []
            for r in rows:
                if r["side"] != side.name:
                    continue
                v = side.spec if key == "overrides" else (r.get("env") or {}).get(key)
                if str(v) not in seen:
                    seen.append(str(v))
            vals[side.name] = " / ".join(seen) if seen else "?"
        out.append(EnvRow(key=key, a=vals["A"], b=vals["B"], differs=vals["A"] != vals["B"]))
    return out


def profile_diff(rows: list[dict[str, Any]], top: int = TOP_CHANGED) -> ProfileDiff:
    """Per op, the median over each side's workers of its self time per step (host ops) or total
    time (device kernels) in the profiler window; the ops whose time changed most, B - A."""
    per: dict[str, dict[str, dict[str, list[float]]]] = {
        "host": {"A": {}, "B": {}},
        "device": {"A": {}, "B": {}},
    }
    profiled = {"A": 0, "B": 0}
    for r in rows:
        prof = profile_summary(Path(r["run_dir"]), top=500) if r.get("run_dir") else {}
        if not prof.get("file"):
            continue
        profiled[r["side"]] += 1
        for op in prof.get("top_self", []):
            per["host"][r["side"]].setdefault(op["op"], []).append(op["self_ms"])
        for op in prof.get("device_top", []):
            per["device"][r["side"]].setdefault(op["op"], []).append(op["total_ms"])
    out = ProfileDiff(workers_profiled=profiled, host=[], device=[])
    for kind, sides in per.items():
        changed: list[OpChange] = []
        for op in {*sides["A"], *sides["B"]}:
            a = statistics.median(sides["A"][op]) if op in sides["A"] else None
            b = statistics.median(sides["B"][op]) if op in sides["B"] else None
            delta = (b or 0.0) - (a or 0.0)
            changed.append(
                OpChange(
                    op=op,
                    a_ms=a,
                    b_ms=b,
                    delta_ms=delta,
                    delta_pct=100 * (b / a - 1) if a and b is not None else None,
                )
            )
        changed.sort(key=lambda d: -abs(d["delta_ms"]))
        out[kind] = changed[:top]  # type: ignore[literal-required]
    return out


def side_summary(side: Side, rows: list[dict[str, Any]]) -> SideSummary:
    """One side's spec and the medians over its workers."""
    mine = [r for r in rows if r["side"] == side.name]

    def med(key: str) -> float | None:
        vals = [r[key] for r in mine if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    return SideSummary(
        spec=side.spec,
        python=side.python,
        overrides=side.overrides,
        slow_pct=side.slow_pct,
        workers=len(mine),
        run_ids=[r["run_id"] for r in mine],
        speed_median=med(SPEED),
        mfu_median=med(MFU_R),
        tokens_per_s_median=med("tokens_per_s"),
        ref_cpu_ms_median=med("ref_cpu_ms"),
        step_cpu_ms_median=med("step_cpu_ms"),
        mem_peak_bytes_median=med("mem_peak_bytes"),
        final_loss_median=med("final_loss"),
    )


def build_report(*, setup: Setup, sides: list[Side], paired: Paired) -> Report:
    """ab.json's content (guard/canary/ab_format.py: Report) from what measure_ab measured."""
    rows, pairs, stat = paired.rows, paired.pairs, paired.stat
    others = {}
    for key in RATIO_LABELS:
        vals = [p["ratio"][key] for p in pairs if p["ratio"].get(key) is not None]  # type: ignore[literal-required]
        if key != SPEED and vals:
            s = paired_statistic(vals, setup.canary)
            others[key] = {k: s[k] for k in ("median", "ci", "coverage", "n_pairs", "delta_pct")}
    c = setup.canary
    rep = Report(
        format=FORMAT,
        kind=KIND,
        time=time.strftime(H_TIME_FORMAT, time.gmtime()),
        verdict=stat["verdict"],
        exit_code=EXIT_FAIL if stat["verdict"] == FAIL else EXIT_PASS,
        state=stat["state"],
        statistic={  # type: ignore[typeddict-item]
            **stat,
            "metric": SPEED,
            "label": RATIO_LABELS[SPEED],
            "method": "median of per-pair B/A "
            f"ratios, sign-test interval (>= {100 * c.ab_confidence:g}% coverage where n allows)",
        },
        other_ratios=others,
        config=str(setup.path),
        config_label=setup.label(),
        timing=rows[0]["timing"] if rows else None,
        order=c.ab_order,
        sequence="".join(p["order"] for p in pairs),
        gates={f.name: getattr(c, f.name) for f in dataclasses.fields(c) if f.name.startswith("ab_")},
        sides={side.name: side_summary(side, rows) for side in sides},
        pairs=pairs,
        workers=[{k: v for k, v in r.items() if k != "env"} for r in rows],
        env_diff=env_diff(sides, rows),
        profile_diff=profile_diff(rows),
        elapsed_s=paired.elapsed_s,
    )
    return finite(rep)


def write_reports(rep: Report, report_dir: Path) -> tuple[Path, Path]:
    return write_json_and_markdown(rep, report_dir, AB_JSON.removesuffix(".json"), render_markdown)  # type: ignore[arg-type]


def _r(v: Any) -> str:
    return "—" if v is None else f"{v:.4f}"


def mfu_not_shown(rep: dict[str, Any]) -> str:
    """Why a report has no MFU ratio, the real reason (issue #40: it said "different FLOPs per
    token" when both sides did 1,781,760 and neither had a peak): no peak on a side, else
    different FLOPs per token (pair_ratios drops MFU then), else no pair measured MFU on both."""
    no_peak = [n for n in ("A", "B") if rep["sides"][n].get("mfu_median") is None]
    if no_peak:
        return (
            f"no peak FLOP/s for {' and '.join(no_peak)}'s device, so no MFU (not computed, not guessed); "
            "tokens/s is the measure"
        )
    fpt = {n: {w.get("flops_per_token") for w in rep["workers"] if w.get("side") == n} for n in ("A", "B")}
    if fpt["A"] != fpt["B"]:
        return "A and B do different FLOPs per token, so MFU is no speed to compare"
    return "no pair measured MFU on both sides"


def render_markdown(rep: dict[str, Any]) -> str:
    st, sides = rep["statistic"], rep["sides"]
    lo, hi = st["ci"]
    out = [
        f"# A/B canary: {rep['verdict'].upper()}",
        "",
        f"> {rep['state']}",
        "",
        f"- A: `{sides['A']['spec']}`"
        + (f", injected slowdown {sides['A']['slow_pct']:g}%" if sides["A"]["slow_pct"] else ""),
        f"- B: `{sides['B']['spec']}`"
        + (f", injected slowdown {sides['B']['slow_pct']:g}%" if sides["B"]["slow_pct"] else ""),
        f"- config: `{rep['config_label']}`; timing: {rep['timing']}; order: {rep['order']} (`{rep['sequence']}`)",
        f"- statistic: {st['label']}: median B/A **{st['median']:.4f}** ({st['delta_pct']:+.2f}%) over {st['n_pairs']} "
        f"pairs, interval [{lo:.4f}, {hi:.4f}] ({100 * st['coverage']:.1f}% sign-test coverage); fails below "
        f"{st['fail_below']:.4f} (canary.ab_fail_pct = {rep['gates']['ab_fail_pct']:g}); B faster in "
        f"{st['b_faster_pairs']} of {st['n_pairs']} pairs",
        f"- {rep['elapsed_s'] / 60:.1f} min for {2 * st['n_pairs']} worker processes",
        "",
    ]
    if rep["other_ratios"]:
        out += ["| ratio B/A | median | interval |", "|---|---|---|"]
        for k, s in rep["other_ratios"].items():
            out.append(f"| {RATIO_LABELS[k]} | {_r(s['median'])} | [{_r(s['ci'][0])}, {_r(s['ci'][1])}] |")
        if MFU_R not in rep["other_ratios"]:
            out.append(f"\nMFU ratio not shown: {mfu_not_shown(rep)}.")
        out.append("")
    out += [
        "## Pairs",
        "",
        "| pair | order | A run | B run | B/A (gated) | B/A tokens/s raw | B/A MFU | load |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in rep["pairs"]:
        r = p["ratio"]
        out.append(
            f"| {p['pair']} | {p['order']} | `{p['a_run']}` | `{p['b_run']}` | {_r(r.get(SPEED))} | "
            f"{_r(r.get('tokens_per_s'))} | {_r(r.get(MFU_R))} | {p['load']:.1f} |"
        )
    out += ["", "## Environments", "", "| key | A | B | |", "|---|---|---|---|"]
    for d in rep["env_diff"]:
        out.append(f"| {d['key']} | {d['a']} | {d['b']} | {'**differs**' if d['differs'] else ''} |")
    out += ["", "| per side (median over its workers) | A | B |", "|---|---|---|"]
    for k in (
        "mfu_median",
        "tokens_per_s_median",
        "ref_cpu_ms_median",
        "step_cpu_ms_median",
        "final_loss_median",
    ):
        out.append(f"| {k.removesuffix('_median')} | {_fmt(k, sides['A'][k])} | {_fmt(k, sides['B'][k])} |")
    out += _ops_markdown(rep["profile_diff"])
    return "\n".join(out) + "\n"


def _ops_markdown(prof: dict[str, Any]) -> list[str]:
    out = ["", "## Ops that changed most (profiler window, median over each side's workers)", ""]
    for kind, title, col in (
        ("host", "Host ops, self time per step", "self ms"),
        ("device", "Device kernels, total time per step", "total ms"),
    ):
        if not prof.get(kind):
            continue
        out += [
            f"**{title}**",
            "",
            f"| op | A {col} | B {col} | B - A ms | change |",
            "|---|---|---|---|---|",
        ]
        for d in prof[kind]:
            pct = "—" if d["delta_pct"] is None else f"{d['delta_pct']:+.0f}%"
            out.append(
                f"| `{d['op'][:90]}` | {_r(d['a_ms'])} | {_r(d['b_ms'])} | {d['delta_ms']:+.4f} | {pct} |"
            )
        out.append("")
    if not prof.get("host") and not prof.get("device"):
        out.append("No profiler traces (telemetry.profile = false?).")
    else:
        out.append(
            f"Profiled workers: A {prof['workers_profiled']['A']}, B {prof['workers_profiled']['B']}; a few "
            "steps each on a shared host: read only large changes or ops that appear or vanish."
        )
    return out


def _fmt(key: str, v: Any) -> str:
    if v is None:
        return "—"
    if key.startswith("mfu"):
        return f"{100 * v:.3f}%"
    if key.startswith("tokens"):
        return f"{v:,.0f}"
    return f"{v:.3f}" if key.startswith(("ref", "step")) else f"{v:.4f}"


def print_summary(rep: dict[str, Any]) -> None:
    st = rep["statistic"]
    print(
        f"canary A/B {rep['verdict'].upper()}: B/A tokens/s median {st['median']:.4f} ({st['delta_pct']:+.2f}%), "
        f"interval [{st['ci'][0]:.4f}, {st['ci'][1]:.4f}] over {st['n_pairs']} pairs; {rep['state']}; "
        f"{rep['elapsed_s'] / 60:.1f} min; report: {rep.get('report_md', '')}"
    )
    for d in rep["env_diff"]:
        if d["differs"]:
            print(f"  {d['key']}: A {d['a']} | B {d['b']}")
