"""Canary power of the A/B canary (`moeguard canary --ab set: set:`, guard/canary/ab.py), the
`--ab` mode of bench/canary/canary_power.py (run it through that module's command line):

    python -m bench.canary.canary_power --ab --clean 20 --trials 10 --slowdowns 3,5,10   # the A/B canary

No history: `--clean` A = B canaries (false alarms) and `--trials` canaries per slowdown with B
slowed (`--inject slow:PCT` slows B), interleaved. Its table (printed, kept in OUT/ab_power.json)
is appended to docs/BENCHMARKS.md by hand; `--rejudge OUT --ab` re-analyses a kept bench.

Writes docs/BENCHMARKS.md › Canaries › A/B canary (`moeguard canary --ab`, issue #15).
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

from guard.canary import config, gate
from guard.canary.ab_format import AB_JSON, read_report


def _run_ab(argv: list[str]) -> dict[str, Any]:
    """One `moeguard canary --ab` (in-process parent, worker subprocesses); returns its ab.json."""
    from guard.cli import main

    out = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stdout(out):
        code = main(["canary", *argv])
    rep: dict[str, Any] = dict(read_report(Path(argv[argv.index("--report-dir") + 1]) / AB_JSON))
    rep["_exit"], rep["_elapsed_s"] = code, time.perf_counter() - t0
    return rep


def ab_main(args: argparse.Namespace) -> int:
    if args.write_docs:
        raise SystemExit("--ab --write-docs: append the printed section to docs/BENCHMARKS.md by hand")
    if args.rejudge:
        return ab_finish(_ab_reload(args.rejudge), args, args.rejudge, rejudged=True)
    slowdowns = [float(s) for s in args.slowdowns.split(",") if s.strip()]
    out = args.out or Path(tempfile.mkdtemp(prefix="canary-ab-power-"))
    out.mkdir(parents=True, exist_ok=True)
    common = [
        "--config",
        str(args.config),
        "--runs",
        str(out / "runs"),
        *(a for s in args.set for a in ("--set", s)),
    ]
    arms: dict[str, list[dict[str, Any]]] = {"A=B": [], **{f"{s:g}%": [] for s in slowdowns}}
    t_start = time.time()

    def one(arm: str, tag: str, extra: list[str]) -> None:
        rep = _run_ab(["--ab", "set:", "set:", *common, "--report-dir", str(out / "reports" / tag), *extra])
        rep["_arm"] = arm
        arms[arm].append(rep)
        st = rep["statistic"]
        print(
            f"{tag:>12}: {rep['verdict']:4}  B/A {st['median']:.4f} [{st['ci'][0]:.4f}, {st['ci'][1]:.4f}] "
            f"{st['n_pairs']} pairs  load {os.getloadavg()[0]:.1f}  {rep['_elapsed_s']:.0f} s",
            flush=True,
        )

    for r in range(max(args.clean, args.trials)):
        if r < args.clean:
            one("A=B", f"ab-clean-{r + 1}", [])
        if r < args.trials:
            for s in slowdowns:
                one(f"{s:g}%", f"ab-slow{s:g}-{r + 1}", ["--inject", f"slow:{s:g}"])
    cmd = "python -m bench.canary.canary_power " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    (out / "ab_command.txt").write_text(cmd.strip() + f"\n{time.time() - t_start:.0f}\n")
    return ab_finish(arms, args, out)


def _ab_reload(out: Path) -> dict[str, list[dict[str, Any]]]:
    """A kept bench's reports (OUT/reports/ab-<arm>-<i>/ab.json), in the order they ran."""
    arms: dict[str, list[dict[str, Any]]] = {"A=B": []}
    for f in sorted((out / "reports").glob(f"ab-*/{AB_JSON}"), key=lambda f: f.stat().st_mtime):
        kind = f.parent.name.rsplit("-", 1)[0].removeprefix("ab-")
        arm = "A=B" if kind == "clean" else f"{float(kind.removeprefix('slow')):g}%"
        rep: dict[str, Any] = dict(read_report(f))
        rep["_elapsed_s"] = rep.get("elapsed_s")
        arms.setdefault(arm, []).append(rep)
    if not any(arms.values()):
        raise SystemExit(f"--rejudge {out} --ab: no reports/ab-*/ab.json there")
    return arms


def ab_rejudge(ratios: list[float], first: int, most: int, c: Any) -> str:
    """The A/B rule (guard.canary.ab.run_ab) replayed on recorded pairs under other settings `c`: start
    with `first` pairs, add two while undecided, up to `most`; 'unjudged' when it would need more
    pairs than were measured."""
    from guard.canary.ab import paired_statistic

    if first > len(ratios):
        return "unjudged"
    n = first
    while True:
        st = paired_statistic(ratios[:n], c)
        if not st["undecided"] or n >= most:
            return st["verdict"]
        if n + 2 > len(ratios):
            return "unjudged"
        n += 2


def ab_finish(
    arms: dict[str, list[dict[str, Any]]], args: argparse.Namespace, out: Path, rejudged: bool = False
) -> int:
    import dataclasses as dc

    rows = []
    for arm, reps in arms.items():
        med = [r["statistic"]["median"] for r in reps]
        rows.append(
            {
                "arm": arm,
                "runs": len(reps),
                **{v: sum(r["verdict"] == v for r in reps) for v in ("fail", "warn", "pass")},
                "median": statistics.median(med) if med else None,
                "min": min(med, default=None),
                "max": max(med, default=None),
                "pairs_mean": statistics.fmean(r["statistic"]["n_pairs"] for r in reps) if reps else None,
                "minutes_mean": statistics.fmean(r["_elapsed_s"] / 60 for r in reps) if reps else None,
                "minutes_max": max((r["_elapsed_s"] / 60 for r in reps), default=None),
            }
        )
    clean_pairs = [p["ratio"]["speed"] for r in arms.get("A=B", []) for p in r["pairs"]]
    raw_pairs = [p["ratio"]["tokens_per_s"] for r in arms.get("A=B", []) for p in r["pairs"]]
    any_rep = next(r for reps in arms.values() for r in reps)
    g = any_rep["gates"]
    base = config.CanaryConfig(
        **{k: v for k, v in g.items() if k in {f.name for f in dc.fields(config.CanaryConfig)}}
    )
    sweep = []
    for fail_pct in (0.0, 0.5, 1.0, 2.0, 3.0):
        for first, most in (
            (g["ab_pairs"], g["ab_max_pairs"]),
            (4, g["ab_max_pairs"]),
            (g["ab_pairs"], g["ab_pairs"]),
        ):
            c = dc.replace(base, ab_fail_pct=fail_pct)
            row: dict[str, Any] = {"fail_pct": fail_pct, "first": first, "most": most}
            for arm, reps in arms.items():
                vs = [ab_rejudge([p["ratio"]["speed"] for p in r["pairs"]], first, most, c) for r in reps]
                un = vs.count("unjudged")
                row[arm] = f"{vs.count('fail')}/{len(vs)}" + (f" ({un} unjudged)" if un else "")
            sweep.append(row)
    resampled = ab_resample(arms, base)
    cmd_file = out / "ab_command.txt"
    cmd, elapsed = (cmd_file.read_text().splitlines() + ["", "0"])[:2] if cmd_file.is_file() else ("", "0")
    res = {
        "command": cmd,
        "elapsed_s": float(elapsed or 0),
        "rows": rows,
        "gates": g,
        "sweep": sweep,
        "clean_pair_sd_pct": 100 * statistics.stdev(clean_pairs) if len(clean_pairs) > 1 else None,
        "clean_pair_raw_sd_pct": 100 * statistics.stdev(raw_pairs) if len(raw_pairs) > 1 else None,
        "clean_pairs": len(clean_pairs),
        "rejudged": rejudged,
        "resampled": resampled,
    }
    (out / "ab_power.json").write_text(json.dumps(res, indent=2) + "\n")
    print("\n" + ab_render(res) + f"\n\nkept under {out}")
    return 0


RESAMPLES = 2000


def ab_resample(arms: dict[str, list[dict[str, Any]]], c: Any) -> dict[str, Any]:
    """Synthetic canaries from the recorded pairs: for each arm, RESAMPLES canaries whose pairs are
    drawn with replacement from all of that arm's recorded pair ratios, judged by the real rule
    (ab_pairs, then two more while undecided, up to ab_max_pairs). An estimate that stretches a few
    real canaries: it keeps the pairs' real spread and tails, not the drift within one canary."""
    import random

    from guard.canary.ab import paired_statistic

    rng = random.Random(0)
    out: dict[str, Any] = {}
    for arm, reps in arms.items():
        pool = [p["ratio"]["speed"] for r in reps for p in r["pairs"]]
        if len(pool) < 6:
            continue
        fails = pairs = 0
        for _ in range(RESAMPLES):
            xs = [rng.choice(pool) for _ in range(c.ab_pairs)]
            while True:
                st = paired_statistic(xs, c)
                if not st["undecided"] or len(xs) >= c.ab_max_pairs:
                    break
                xs += [rng.choice(pool) for _ in range(min(2, c.ab_max_pairs - len(xs)))]
            fails += st["verdict"] == gate.FAIL
            pairs += len(xs)
        out[arm] = {"pool": len(pool), "fail_rate": fails / RESAMPLES, "pairs_mean": pairs / RESAMPLES}
    return out


def ab_render(res: dict[str, Any]) -> str:
    g = res["gates"]
    lines = [
        f"Command: `{res['command']}`",
        "",
        f"Defaults as run: {g['ab_pairs']} pairs, up to {g['ab_max_pairs']} while undecided, {g['ab_order']} "
        f"order, fail when the {100 * g['ab_confidence']:g}% sign-test interval of the median B/A ratio lies "
        f"wholly below {1 - g['ab_fail_pct'] / 100:.3f} (ab_fail_pct = {g['ab_fail_pct']:g}).",
        "",
        "| arm | canaries | fail | warn | pass | median B/A: median [min, max] | pairs (mean) | minutes (mean, max) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        label = "A = B (false alarms = fail)" if r["arm"] == "A=B" else f"B slowed {r['arm']} (caught = fail)"
        rng = "—" if r["median"] is None else f"{r['median']:.4f} [{r['min']:.4f}, {r['max']:.4f}]"
        mins = "—" if r["minutes_mean"] is None else f"{r['minutes_mean']:.1f}, {r['minutes_max']:.1f}"
        pairs = "—" if r["pairs_mean"] is None else f"{r['pairs_mean']:.1f}"
        lines.append(
            f"| {label} | {r['runs']} | {r['fail']} | {r['warn']} | {r['pass']} | {rng} | {pairs} | {mins} |"
        )
    if res["clean_pair_sd_pct"] is not None:
        lines += [
            "",
            f"Per-pair B/A ratio in the A = B canaries ({res['clean_pairs']} pairs): sd {res['clean_pair_sd_pct']:.2f}% "
            f"normalised by each process's reference (the gated ratio), {res['clean_pair_raw_sd_pct']:.2f}% raw tokens "
            "per CPU-second.",
        ]
    arms = [k for k in res["sweep"][0] if k not in ("fail_pct", "first", "most")]
    lines += [
        "",
        "The recorded pairs re-judged under other lines and pair counts (fails / canaries; the extension "
        "replayed on the pairs measured, 'unjudged' where it would need more):",
        "",
        "| ab_fail_pct | pairs (first, max) | " + " | ".join(arms) + " |",
        "|---|---|" + "---|" * len(arms),
    ]
    for row in res["sweep"]:
        lines.append(
            f"| {row['fail_pct']:g} | {row['first']}, {row['most']} | "
            + " | ".join(row[a] for a in arms)
            + " |"
        )
    if res.get("resampled"):
        lines += [
            "",
            f"Resampled ({RESAMPLES} synthetic canaries per arm, pairs drawn with replacement from that "
            "arm's recorded pairs, judged by the same rule; an estimate, not runs):",
            "",
            "| arm | recorded pairs | fail rate | pairs (mean) |",
            "|---|---|---|---|",
        ]
        for arm, r in res["resampled"].items():
            lines.append(f"| {arm} | {r['pool']} | {100 * r['fail_rate']:.1f}% | {r['pairs_mean']:.1f} |")
    lines.append(f"\n{res['elapsed_s'] / 60:.0f} min in all on {os.cpu_count()} cores.")
    return "\n".join(lines)
