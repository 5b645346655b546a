"""Canary power: false alarms on clean runs and detection of injected slowdowns, on this machine.

    python -m bench.canary.canary_power                                  # the full bench (about an hour)
    python -m bench.canary.canary_power --baselines 3 --clean 3 --trials 1 --slowdowns 5   # a quick look
    python -m bench.canary.canary_power --write-docs                     # also update docs/BENCHMARKS.md
                                                                  # (its canary-power part)
    python -m bench.canary.canary_power --ab --clean 20 --trials 10 --slowdowns 3,5,10   # the A/B canary

1. Record a baseline from `--baselines` clean canary runs (`moeguard canary --record`) into a
   fresh history.
2. Then, interleaved so that machine-load drift hits every arm alike (clean, 2%, 3%, 5%, 10%,
   clean, 2%, ...): `--clean` clean canary runs and `--trials` runs per injected slowdown
   (`--inject slow:PCT`), each the full gate (a failing run is re-run once and fails only if the
   re-run fails too).
A clean run that fails is a false alarm (a warn is counted but is exit 0); an injected run
that fails is a detection. The smallest slowdown detected in every trial is the canary's power.

`--ab`: the same arms for the A/B canary (`moeguard canary --ab set: set:`, guard/canary/ab.py),
no history: `--clean` A = B canaries (false alarms) and `--trials` canaries per slowdown with B
slowed (`--inject slow:PCT` slows B), interleaved. Its table (printed, kept in OUT/ab_power.json)
is appended to docs/BENCHMARKS.md by hand; `--rejudge OUT --ab` re-analyses a kept bench.
Each canary run is a real training run in a worker process, so this bench is slow and, on a
shared machine, noisy: the load average at every run is recorded and reported.

Writes docs/BENCHMARKS.md › Canaries › Canary power (`moeguard canary`) and, with `--ab`, › A/B
canary (`moeguard canary --ab`, issue #15).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from guard.canary import config, gate, keys, stats


def _run_canary(argv: list[str]) -> dict[str, Any]:
    """One `moeguard canary` (in-process parent, worker subprocesses); returns its JSON report."""
    from guard.cli import main

    out = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(out):
        code = main(["canary", *argv])
    rep_dir = Path(argv[argv.index("--report-dir") + 1])
    rep = json.loads((rep_dir / "canary.json").read_text())
    rep["_exit"] = code
    rep["_elapsed_s"] = time.perf_counter() - t0
    return rep


def _first_delta(rep: dict[str, Any], run: int = 0) -> float | None:
    runs = rep.get("runs", [])
    if run >= len(runs):
        return None
    row = next((r for r in runs[run]["comparison"] if r["metric"] in keys.MFU_METRICS), None)  # the gated MFU
    return row["delta"] if row else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", type=Path, default=config.DEFAULT_CONFIG)
    p.add_argument("--baselines", type=int, default=5, help="clean runs recorded as the baseline (M)")
    p.add_argument("--clean", type=int, default=10, help="clean runs judged against it (N)")
    p.add_argument("--slowdowns", default="2,3,5,10", help="injected slowdowns in percent")
    p.add_argument("--trials", type=int, default=5, help="runs per injected slowdown")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config overrides")
    p.add_argument("--out", type=Path, default=None, help="keep histories, runs and reports here")
    p.add_argument(
        "--write-docs", action="store_true", help="update the canary section of docs/BENCHMARKS.md"
    )
    p.add_argument(
        "--history-from",
        type=Path,
        default=None,
        metavar="FILE",
        help="start from a copy of this history (e.g. one recorded over hours) instead of an empty one; "
        "use with --baselines 0 to judge live against it alone",
    )
    p.add_argument(
        "--rejudge",
        type=Path,
        default=None,
        metavar="OUT",
        help="run nothing: re-analyse the reports a previous bench kept under OUT (its --out)",
    )
    p.add_argument(
        "--ab",
        action="store_true",
        help="the A/B canary (set: vs set:, B slowed in the slowdown arms) instead of the history gate",
    )
    args = p.parse_args(argv)
    if args.ab:
        from bench.canary.ab_power import ab_main

        return ab_main(args)
    if args.rejudge:
        return rejudge(args)
    slowdowns = [float(s) for s in args.slowdowns.split(",") if s.strip()]
    out = args.out or Path(tempfile.mkdtemp(prefix="canary-power-"))
    out.mkdir(parents=True, exist_ok=True)
    history = out / "history.jsonl"
    history.unlink(missing_ok=True)
    if args.history_from:
        if not args.history_from.is_file():
            raise SystemExit(f"--history-from {args.history_from}: no such file")
        history.write_text(args.history_from.read_text())  # a copy: the bench never writes to the original
    # The live gate judges against the baselines just recorded, whatever their span (the bench
    # measures the gate itself; `spanning` then judges the same runs against a spanning history).
    common = [
        "--config",
        str(args.config),
        "--history",
        str(history),
        "--runs",
        str(out / "runs"),
        "--set",
        "canary.baseline_min_span_h=0",
    ]
    for s in args.set:
        common += ["--set", s]
    t_start = time.time()
    loads: list[float] = []

    def one(tag: str, extra: list[str]) -> dict[str, Any]:
        loads.append(os.getloadavg()[0])
        rep = _run_canary([*common, "--report-dir", str(out / "reports" / tag), *extra])
        loads.append(os.getloadavg()[0])
        d1, d2 = _first_delta(rep, 0), _first_delta(rep, 1)
        print(
            f"{tag:>14}: {rep['verdict']:4}  MFU delta {'—' if d1 is None else f'{d1:+.2f}%'}"
            f"{'' if d2 is None else f' / re-run {d2:+.2f}%'}  load {loads[-2]:.1f}  "
            f"{rep['_elapsed_s']:.0f} s",
            flush=True,
        )
        return rep

    baseline_reps = [one(f"baseline-{i + 1}", ["--record"]) for i in range(args.baselines)]
    arms: dict[str, list[dict[str, Any]]] = {"clean": [], **{f"{s:g}%": [] for s in slowdowns}}
    rounds = max(args.clean, args.trials)
    for r in range(rounds):
        if r < args.clean:
            arms["clean"].append(one(f"clean-{r + 1}", []))
        if r < args.trials:
            for s in slowdowns:
                arms[f"{s:g}%"].append(one(f"slow{s:g}-{r + 1}", ["--inject", f"slow:{s:g}"]))
    elapsed = time.time() - t_start
    finish(arms, slowdowns, baseline_reps, loads, elapsed, args, out)
    return 0


def finish(
    arms: dict[str, list[dict[str, Any]]],
    slowdowns: list[float],
    baseline_reps: list[dict[str, Any]],
    loads: list[float],
    elapsed: float,
    args: argparse.Namespace,
    out: Path,
) -> None:
    result = summarize(arms, slowdowns, baseline_reps, loads, elapsed, args)
    (out / "canary_power.json").write_text(json.dumps(result, indent=2) + "\n")
    body = render(result)
    print("\n" + body)
    print(f"\nkept under {out}")
    if args.write_docs:
        from bench.common.docs import machine_line, write_section

        # Its own markers, nested inside the hand-written canary section (which explains the design).
        write_section("canary-power", body + f"\n\nMachine: {machine_line()}.\n")


def rejudge(args: argparse.Namespace) -> int:
    """Re-analyse a kept bench (OUT/reports/<tag>/canary.json, tags as `one` names them)."""
    out = args.rejudge
    reports = sorted((out / "reports").glob("*/canary.json"), key=lambda f: f.stat().st_mtime)
    if not reports:
        raise SystemExit(f"--rejudge {out}: no reports/*/canary.json there (not a bench's --out?)")
    baseline_reps: list[dict[str, Any]] = []
    arms: dict[str, list[dict[str, Any]]] = {"clean": []}
    slowdowns: list[float] = []
    for f in reports:
        tag, rep = f.parent.name, json.loads(f.read_text())
        kind = tag.rsplit("-", 1)[0]
        if kind == "baseline":
            baseline_reps.append(rep)
        elif kind == "clean":
            arms["clean"].append(rep)
        elif kind.startswith("slow"):
            pct = float(kind[4:])
            if pct not in slowdowns:
                slowdowns.append(pct)
            arms.setdefault(f"{pct:g}%", []).append(rep)
    old = json.loads((out / "canary_power.json").read_text()) if (out / "canary_power.json").is_file() else {}
    loads = [
        float(r["runs"][0]["loadavg"][0])
        for r in [*baseline_reps, *(x for v in arms.values() for x in v)]
        if r["runs"][0].get("loadavg")
    ]
    cmd = shlex.split(old.get("command") or "")  # "python -m bench.canary.canary_power ARGS..."
    if not args.history_from and "--history-from" in cmd[:-1]:
        args.history_from = Path(cmd[cmd.index("--history-from") + 1])
    if cmd:
        sys.argv = [sys.argv[0], *cmd[3:]]  # so the report shows the bench's own command line
    finish(arms, sorted(slowdowns), baseline_reps, loads, float(old.get("elapsed_s") or 0), args, out)
    return 0


def _entry_pairs(rep: dict[str, Any]) -> list[tuple[float, float]]:
    """(MFU, ref ms) of every worker process of a report's runs: what its history entry would hold."""
    return [p for run in rep["runs"] for p in stats.process_pairs(run["summary"])]


def spanning(
    arms: dict[str, list[dict[str, Any]]],
    baseline_reps: list[dict[str, Any]],
    lines: list[tuple[float, float]],
) -> dict[str, Any]:
    """Judge every measurement against a history that spans the whole bench, not one quiet window.

    The live gate's baseline is the `--baselines` runs recorded back to back at the start: one host
    state. A history kept over days holds the host's other states too. Leave-one-out over the
    bench's clean measurements stands in for that: each measurement is judged against a baseline
    and a host fit (`guard.canary.gate.fit_host`) made of every OTHER clean measurement (baseline runs
    and clean arm, re-runs included; a clean measurement never sees itself), with the gate's
    own rule (a re-run only where the live gate re-ran; a run past warn with no re-run is counted
    as unjudged). Injected runs never enter a baseline.
    """
    pool = [*baseline_reps, *arms.get("clean", [])]
    results: dict[str, list[dict[str, Any]]] = {}
    for arm, reps in arms.items():
        for rep in reps:
            others = [p for p in pool if p is not rep]
            fit = gate.fit_host([pr for o in others for pr in _entry_pairs(o)])
            base = statistics.median(gate.adjusted_median(_entry_pairs(o), fit) for o in others)
            deltas = [
                100 * (gate.adjusted_median(stats.process_pairs(run["summary"]), fit) / base - 1)
                for run in rep["runs"]
            ]
            results.setdefault(arm, []).append({"deltas": deltas, "slope": fit.slope, "r": fit.r})
    table = []
    for warn, fail in lines:
        row: dict[str, Any] = {"warn": warn, "fail": fail}
        for arm, res in results.items():
            fails = unjudged = 0
            for x in res:
                d = x["deltas"]
                if d[0] > -warn:
                    continue
                if len(d) < 2:
                    unjudged += 1
                    continue
                fails += _confirmed_fail(d[0], d[1], (d[0] + d[1]) / 2, warn, fail)
            row[arm] = f"{fails}/{len(res)}" + (f" ({unjudged} unjudged)" if unjudged else "")
        table.append(row)
    slopes = [x["slope"] for res in results.values() for x in res]
    first = {arm: [x["deltas"][0] for x in res] for arm, res in results.items()}
    return {
        "table": table,
        "slope_range": [min(slopes), max(slopes)] if slopes else None,
        "first_deltas": first,
    }


def summarize(
    arms: dict[str, list[dict[str, Any]]],
    slowdowns: list[float],
    baseline_reps: list[dict[str, Any]],
    loads: list[float],
    elapsed: float,
    args: argparse.Namespace,
) -> dict[str, Any]:
    rows = []
    for arm, reps in arms.items():
        deltas = [d for rep in reps if (d := _first_delta(rep)) is not None]
        rows.append(
            {
                "arm": arm,
                "runs": len(reps),
                "fail": sum(r["verdict"] == gate.FAIL for r in reps),
                "warn": sum(r["verdict"] == gate.WARN for r in reps),
                "pass": sum(r["verdict"] == gate.PASS for r in reps),
                "reruns": sum(len(r["runs"]) > 1 for r in reps),
                "delta_median": statistics.median(deltas) if deltas else None,
                "delta_min": min(deltas, default=None),
                "delta_max": max(deltas, default=None),
            }
        )
    caught = [
        s
        for s in slowdowns
        if (row := next(r for r in rows if r["arm"] == f"{s:g}%"))["runs"] and row["fail"] == row["runs"]
    ]
    every = min((s for s in caught if all(c in caught for c in slowdowns if c >= s)), default=None)
    base_mfu = [r["runs"][0]["summary"][keys.MFU] for r in baseline_reps]
    any_rep = next(iter([*baseline_reps, *(r for reps in arms.values() for r in reps)]), {})
    gates = any_rep.get("gates", {})
    judged = next((r for r in arms.get("clean", []) if r.get("baseline", {}).get("n")), {})
    cmd = "python -m bench.canary.canary_power " + " ".join(
        shlex.quote(a) for a in sys.argv[1:] if a != "--write-docs"
    )
    per_run = [
        {
            "arm": arm,
            "verdict": r["verdict"],
            "delta_run1": _first_delta(r, 0),
            "delta_run2": _first_delta(r, 1),
            "delta_pooled": next(
                (p["delta"] for p in r.get("pooled", []) if p["metric"] in keys.MFU_METRICS), None
            ),
            "load": r["runs"][0].get("loadavg"),
        }
        for arm, reps in arms.items()
        for r in reps
    ]
    return {
        "command": cmd.strip(),
        "rows": rows,
        "per_run": per_run,
        "smallest_caught_every_time_pct": every,
        "false_alarms": next(r["fail"] for r in rows if r["arm"] == "clean"),
        "clean_runs": next(r["runs"] for r in rows if r["arm"] == "clean"),
        "baseline_mfu": base_mfu,
        "baseline_spread_pct": 100 * (max(base_mfu) - min(base_mfu)) / statistics.median(base_mfu)
        if base_mfu
        else None,
        "gates": {k: gates.get(k) for k in ("mfu_warn_pct", "mfu_fail_pct", "confirm", "warmup_steps")},
        "load": {"min": min(loads), "median": statistics.median(loads), "max": max(loads)} if loads else {},
        "elapsed_s": elapsed,
        "timing": any_rep.get("timing"),
        "history_from": str(getattr(args, "history_from", None) or "") or None,
        "baseline_n": judged.get("baseline", {}).get("n"),
        "baseline_span_h": (judged.get("mfu_gate") or {}).get("baseline_span_h"),
        "sweep": sweep(per_run, float(gates.get("mfu_warn_pct") or 0)),
        "spanning": spanning(
            arms,
            baseline_reps,
            [
                (w, f)
                for w in (2.0, 2.5, 3.0, 4.0)
                for f in (3.0, 4.0, 5.0, 6.0)
                if f >= w and (w, f) != (4.0, 3.0)
            ],
        ),
    }


def _confirmed_fail(d1: float, d2: float, pooled: float, warn: float, fail: float) -> bool:
    """The gate's rule (`guard.canary.gate.decide`) on MFU deltas in percent: the first run past the
    warn line (so it was re-run), the mean of both past the fail line, the re-run alone past warn."""
    return d1 <= -warn and pooled <= -fail and d2 <= -warn


def sweep(per_run: list[dict[str, Any]], as_run_warn: float) -> list[dict[str, Any]]:
    """Re-judge the recorded MFU deltas under other (warn, fail) lines, warn >= the as-run warn line
    (runs above the as-run line were never re-run). Only MFU: the other gates never fired here."""
    out = []
    for warn in sorted({as_run_warn, *(w for w in (1.5, 2.0, 2.5, 3.0, 4.0) if w >= as_run_warn)}):
        for fail in (2.5, 3.0, 3.5, 4.0, 5.0, 6.0, 7.0):
            if fail < warn or fail > warn + 3:
                continue
            counts: dict[str, list[int]] = {}
            for r in per_run:
                d1, d2, dp = r["delta_run1"], r["delta_run2"], r["delta_pooled"]
                failed = (
                    d1 is not None
                    and d2 is not None
                    and dp is not None
                    and _confirmed_fail(d1, d2, dp, warn, fail)
                )
                c = counts.setdefault(r["arm"], [0, 0])
                c[0] += failed
                c[1] += 1
            out.append({"warn": warn, "fail": fail, **{arm: f"{c[0]}/{c[1]}" for arm, c in counts.items()}})
    return out


def render(res: dict[str, Any]) -> str:
    g, load = res["gates"], res["load"]
    if res["baseline_mfu"]:
        base = (
            f"Baseline: {len(res['baseline_mfu'])} clean runs recorded (`--record`) back to back at the start (one "
            "sitting; the live gate runs with `canary.baseline_min_span_h = 0` so it judges against them), plain MFU "
            f"p50 spread {res['baseline_spread_pct']:.2f}% (max - min over median)."
        )
    else:
        span = res.get("baseline_span_h")
        base = (
            f"Baseline: the history `{res.get('history_from')}`, recorded earlier ({res.get('baseline_n')} "
            f"baseline entries spanning {0 if span is None else span:.1f} h); no baseline recorded in the bench."
        )
    lines = [
        "## Canary power (`moeguard canary`)",
        "",
        f"Command: `{res['command']}`",
        "",
        base + f" Gate: MFU warn at -{g['mfu_warn_pct']:g}%, "
        f"fail at -{g['mfu_fail_pct']:g}% of the baseline median; a run past a line is re-run once and fails only "
        f"if the mean of both runs is past the fail line and the re-run past the warn line (confirm = {g['confirm']}). "
        f"Timing: {res['timing']} (CPU: the gated MFU is host-adjusted, `guard.canary.gate.HostFit`). "
        "Arms interleaved (clean, 2%, 3%, 5%, 10%, clean, ...); deltas below are the gated MFU's.",
        "",
        "| arm | runs | fail | warn | pass | re-runs | first-run MFU delta: median [min, max] |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        rng = (
            "—"
            if r["delta_median"] is None
            else f"{r['delta_median']:+.2f}% [{r['delta_min']:+.2f}, {r['delta_max']:+.2f}]"
        )
        label = "clean (false alarms = fail)" if r["arm"] == "clean" else f"slow {r['arm']} (detected = fail)"
        lines.append(
            f"| {label} | {r['runs']} | {r['fail']} | {r['warn']} | {r['pass']} | {r['reruns']} | {rng} |"
        )
    if res.get("sweep"):
        arms = [k for k in res["sweep"][0] if k not in ("warn", "fail")]
        lines += [
            "",
            "The same recorded runs re-judged under other MFU lines (fails / runs; clean = false alarms):",
            "",
            "| warn | fail | " + " | ".join(arms) + " |",
            "|---|---|" + "---|" * len(arms),
        ]
        for row in res["sweep"]:
            lines.append(
                f"| -{row['warn']:g}% | -{row['fail']:g}% | " + " | ".join(row[a] for a in arms) + " |"
            )
    span = res.get("spanning")
    if span and span["table"]:
        arms = [k for k in span["table"][0] if k not in ("warn", "fail")]
        lo, hi = span["slope_range"]
        lines += [
            "",
            "The same runs judged against a history that spans the bench (leave-one-out: each run's baseline "
            "and host fit are every other clean measurement; `spanning` in bench/canary/canary_power.py; fitted "
            f"slopes {lo:+.2f} to {hi:+.2f}; fails / runs):",
            "",
            "| warn | fail | " + " | ".join(arms) + " |",
            "|---|---|" + "---|" * len(arms),
        ]
        for row in span["table"]:
            lines.append(
                f"| -{row['warn']:g}% | -{row['fail']:g}% | " + " | ".join(row[a] for a in arms) + " |"
            )
        own = next(
            (r for r in span["table"] if r["warn"] == g["mfu_warn_pct"] and r["fail"] == g["mfu_fail_pct"]),
            None,
        )
        if own:
            lines += [
                "",
                f"**Against the spanning history, with the config's lines (-{g['mfu_warn_pct']:g}% / "
                f"-{g['mfu_fail_pct']:g}%): "
                + ", ".join(f"{a} {own[a]}" for a in arms)
                + "** (clean = false alarms).",
            ]
        lines += [
            "",
            "First-run MFU deltas there: "
            + "; ".join(
                f"{arm} {statistics.median(d):+.2f}% [{min(d):+.2f}, {max(d):+.2f}]"
                for arm, d in span["first_deltas"].items()
                if d
            )
            + ".",
        ]
    every = res["smallest_caught_every_time_pct"]
    lines += [
        "",
        f"Live gate ({'baseline from one sitting' if res['baseline_mfu'] else 'against the earlier history'}): false alarms {res['false_alarms']} of {res['clean_runs']} clean runs; "
        f"smallest slowdown caught every time: {'none' if every is None else f'{every:g}%'}.",
        f"Load average (1 min) over the bench: min {load.get('min', 0):.1f}, median {load.get('median', 0):.1f}, "
        f"max {load.get('max', 0):.1f} on {os.cpu_count()} cores; {res['elapsed_s'] / 60:.0f} min in all.",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    raise SystemExit(main())
