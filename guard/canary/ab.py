"""`moeguard canary --ab A B`: two environments measured side by side on one host, judged paired.

    moeguard canary --ab set: set:model.experts_kernel=loop                  # the config vs one change
    moeguard canary --ab py:/opt/torch-old/bin/python py:.venv/bin/python     # two venvs (a torch upgrade)
    moeguard canary --ab set: set: --inject slow:5                           # prove it: B 5% slower

An environment is `py:PATH` (another Python interpreter, e.g. a venv's bin/python: it runs its own
moeguard if it has one installed, else this checkout's, with its own torch) or `set:KEY=VALUE[,...]`
(this interpreter, the config with those overrides, as `--set` takes them; `set:` alone = the
config unchanged). A `py:` interpreter with its own moeguard runs its own worker: this one's
(`python -m trainer.canary_worker`) or, for an install from before guard/canary/ was a package,
`python -m guard.canary --worker`; the spec and result it exchanges are the same.

Why paired. The history gate compares today's run with runs recorded hours or days ago, and a
shared host drifts in between (+-5% MFU on the 2-vCPU CI VM within an hour). Here A and B run as
alternating worker processes on the same host in the same minutes, in ABBA order (A B, B A, A B,
...; or a seeded random order per pair): a drift that is slow next to two worker processes hits both
sides of every pair alike, and each ABBA block cancels a linear trend. Each worker is the history
canary's (guard/canary/measure.py: fresh process, steady window, on CPU thread CPU time and the paired numpy
reference); a pair is one A worker and the B worker next to it.

Statistic. Per pair r = speed_B / speed_A, where speed is the steady window's tokens/s: on CPU per
CPU-second and normalised by the same process's reference matmul (MFU / FLOPs-per-token), on a GPU
wall clock. The estimate is the median of the r; its interval is the distribution-free sign-test
interval [r_(k), r_(n+1-k)], k the largest whose coverage 1 - 2 P(Bin(n, 1/2) < k) is at least
canary.ab_confidence. Verdict (line = 1 - canary.ab_fail_pct / 100):
  fail  the interval lies wholly below the line: B is slower than A by more than ab_fail_pct;
  warn  the median is below the line but the interval reaches it (after ab_max_pairs pairs), or the
        interval lies wholly below 1 (B slower, by less than the line);
  pass  otherwise (the report says when B is faster).
A median below the line whose interval still reaches it is undecided: one more ABBA block (two
pairs) is measured, up to canary.ab_max_pairs, as the history gate re-runs a regression once.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from guard.canary.ab_format import MFU_R, SPEED, TPS_RAW, TPS_WALL, Pair, Ratios
from guard.canary.ab_parts import ENV_DIFF_KEYS as ENV_DIFF_KEYS
from guard.canary.ab_parts import Paired, Side, paired_statistic
from guard.canary.ab_parts import sign_test_interval as sign_test_interval
from guard.canary.ab_report import build_report, print_summary, write_reports
from guard.canary.config import (
    EXIT_FAIL,
    EXIT_PASS,
    EXIT_USAGE,
    REPO,
    TIMING_CPU,
    Setup,
    parse_slow,
)
from guard.canary.gate import FAIL
from guard.canary.keys import LOSS, MEM, MFU, REF, TPS
from guard.canary.measure import new_run_dir, progress, spawn_measurement, stamp, worker_spec
from guard.canary.stats import profiled_steps, summarize
from guard.core.tomlconf import ConfigError

SYNTAX = (
    "py:PATH (another Python interpreter, e.g. /opt/venv/bin/python) or set:KEY=VALUE[,KEY=VALUE...] "
    "(this interpreter with config overrides; set: alone = the config unchanged)"
)


# ---------------------------------------------------------------------------------------------
# Environments.


def parse_side(spec: str, name: str, parse_overrides: Callable[[list[str]], dict[str, Any]]) -> Side:
    """`py:PATH` or `set:K=V[,K=V...]` -> Side; a ConfigError names the bad value and the syntax.
    parse_overrides: the parser `--set` uses (TrainerSide.parse_overrides)."""
    kind, sep, rest = spec.partition(":")
    where = f"--ab {name} = {spec!r}"
    if not sep or kind not in ("py", "set"):
        raise ConfigError(f"{where}: expected {SYNTAX}")
    if kind == "py":
        if not rest.strip():
            raise ConfigError(
                f"{where}: py: needs the path of a Python interpreter, e.g. py:/opt/venv/bin/python"
            )
        path = Path(rest).expanduser()
        if not path.is_file() or not os.access(path, os.X_OK):
            raise ConfigError(f"{where}: {rest!r} is not an executable file (expected {SYNTAX})")
        # abspath, not resolve(): a venv's bin/python is a symlink, and the resolved target is the
        # base interpreter without the venv's packages.
        return Side(name=name, spec=spec, python=os.path.abspath(path))
    items = [x.strip() for x in rest.split(",") if x.strip()]
    for item in items:
        if "=" not in item or not item.partition("=")[0].strip():
            raise ConfigError(f"{where}: {item!r} is not KEY=VALUE (expected {SYNTAX})")
    overrides = parse_overrides(items)
    for key in overrides:
        if key.startswith("canary."):
            raise ConfigError(
                f"{where}: {key} is a measurement setting and must be the same on both sides; "
                "give it once with --set"
            )
    return Side(name=name, spec=spec, overrides=overrides, probe={"moeguard": f"this checkout ({REPO})"})


_PROBE = r"""
import json, os, platform, sys
d = {"python": platform.python_version(), "python_executable": sys.executable, "missing": []}
for mod in ("torch", "numpy"):
    try:
        d[mod] = __import__(mod).__version__
    except Exception as e:
        d["missing"].append(f"{mod} ({type(e).__name__}: {e})")
try:
    import guard as g
    d["moeguard"] = os.path.dirname(os.path.dirname(os.path.abspath(g.__file__)))
except Exception:
    d["moeguard"] = None
# guard/ and trainer/ of one install sit side by side; a file check, not an import, so another
# install's import hooks (an editable one) cannot answer for this one
new = bool(d["moeguard"]) and os.path.isfile(os.path.join(d["moeguard"], "trainer", "canary_worker.py"))
d["worker"] = ["-m", "trainer.canary_worker"] if new else ["-m", "guard.canary", "--worker"]
print(json.dumps(d))
"""


def probe_interpreter(side: Side, neutral_dir: Path) -> None:
    """Ask a `py:` interpreter for its versions and whether it has moeguard; set how its workers
    start. Run from a directory with no `guard/` in it, so the checkout does not shadow an install."""
    where = f"--ab {side.name} = {side.spec!r}"
    assert side.python is not None
    try:
        out = subprocess.run(
            [side.python, "-c", _PROBE], capture_output=True, text=True, timeout=300, cwd=neutral_dir
        )
    except (OSError, subprocess.SubprocessError) as e:
        raise ConfigError(f"{where}: cannot run it: {e}") from None
    try:
        side.probe = json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        tail = " | ".join((out.stderr or out.stdout).strip().splitlines()[-3:])
        raise ConfigError(
            f"{where}: not a working Python interpreter (exit {out.returncode}: {tail})"
        ) from None
    if side.probe.get("missing"):
        raise ConfigError(f"{where}: the interpreter cannot import " + ", ".join(side.probe["missing"]))
    side.cwd = str(neutral_dir)
    if side.probe.get("moeguard") == str(REPO):  # e.g. this venv (an editable install)
        side.probe["moeguard"] = f"this checkout ({REPO})"
    elif side.probe.get("moeguard"):
        side.probe["moeguard"] = f"its own install ({side.probe['moeguard']})"
        side.worker = tuple(side.probe["worker"])
    else:  # this checkout's moeguard with that interpreter's torch
        side.extra_env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p
        )
        side.probe["moeguard"] = f"this checkout ({REPO}), on PYTHONPATH"


def parse_inject(specs: list[str]) -> tuple[float, float]:
    """`--inject slow:PCT` slows B; `a:slow:PCT` / `b:slow:PCT` name the side. -> (slow A, slow B)."""
    slow = {"a": 0.0, "b": 0.0}
    for spec in specs:
        side, sep, rest = spec.partition(":")
        if sep and side.lower() in slow:
            slow[side.lower()] = parse_slow([rest])
        else:
            slow["b"] = parse_slow([spec])
    return slow["a"], slow["b"]


# ---------------------------------------------------------------------------------------------
# Order and statistics.


def pair_orders(n: int, order: str, rng: random.Random, start: int = 0) -> list[str]:
    """'AB' or 'BA' for pairs start..start+n-1: ABBA alternates; random flips a seeded coin."""
    if order == "abba":
        return ["AB" if i % 2 == 0 else "BA" for i in range(start, start + n)]
    return ["AB" if rng.random() < 0.5 else "BA" for _ in range(n)]


# ---------------------------------------------------------------------------------------------
# Measuring.


def measure_side(setup: Setup, side: Side, runs: Path, pair: int, started: str) -> dict[str, Any]:
    """One worker process of one side: the history canary's worker and summary, per-worker metrics."""
    cfg = setup.train_config(side.overrides)
    run_dir = new_run_dir(runs, f"canary-ab-{started}-p{pair + 1:02d}{side.name}")
    spec = worker_spec(
        setup,
        run_dir,
        name=f"canary-ab[{side.name}]",
        variant=side.overrides,
        variant_label=f"ab {side.name}: {side.spec}",
        slow_pct=side.slow_pct,
        attempt=pair + 1,
    )
    result = spawn_measurement(
        spec,
        setup.canary.timeout_s,
        cfg.train.threads,
        setup.canary.stable_layout,
        worker=side.worker or setup.trainer.worker,
        python=side.python,
        extra_env=side.extra_env,
        cwd=side.cwd,
    )
    if result.get("status") != "ok":
        return result
    s = summarize(result, setup.canary.warmup_steps, profiled_steps(cfg))
    cpu = result["timing"] == TIMING_CPU
    tps = s[TPS]
    result["metrics"] = {
        SPEED: tps * s[REF] / 1e3 if cpu else tps,  # CPU: tokens per CPU-second x reference seconds
        TPS_RAW: tps,
        MFU_R: s[MFU],
        TPS_WALL: s["tokens_per_s_wall_p50"],
        "ref_cpu_ms": s[REF],
        "step_cpu_ms": s["step_cpu_ms_p50"],
        "step_wall_ms": s["step_wall_ms_p50"],
        "mem_peak_bytes": s[MEM],
        "final_loss": s[LOSS],
        "window_steps": s["window_steps"],
    }
    return result


def _worker_row(side: Side, pair: int, r: dict[str, Any]) -> dict[str, Any]:
    return {
        "side": side.name,
        "pair": pair + 1,
        "run_id": r.get("run_id"),
        "run_dir": r.get("run_dir"),
        "wall_s": r.get("wall_s"),
        "loadavg": r.get("loadavg"),
        "timing": r.get("timing"),
        "flops_per_token": r.get("flops_per_token"),
        **r["metrics"],
    }


def pair_ratios(a: dict[str, Any], b: dict[str, Any]) -> Ratios:
    """B/A per metric (MFU only where both sides do the same FLOPs per token: else it is no speed)."""
    out: dict[str, float | None] = {}
    for k in (SPEED, TPS_RAW, MFU_R, TPS_WALL):
        va, vb = a.get(k), b.get(k)
        ok = isinstance(va, int | float) and isinstance(vb, int | float) and va > 0 and math.isfinite(vb)
        out[k] = vb / va if ok else None
    if a.get("flops_per_token") != b.get("flops_per_token"):
        out[MFU_R] = None
    return out  # type: ignore[return-value]


class WorkerFailed(Exception):
    """A worker of one side could not measure: `code` is the canary's exit code for it (usage when
    the environment cannot run here, `unavailable`), `reason` what the worker said."""

    def __init__(self, code: int, reason: str, *, side: str, detail: str, unavailable: bool = False) -> None:
        super().__init__(reason)
        self.code, self.reason, self.side, self.unavailable = code, reason, side, unavailable
        self.detail = detail  # the worker's own words, without which side and spec


def prepare_sides(args: argparse.Namespace, setup: Setup, runs: Path) -> list[Side]:
    """A and B from the command line, their injected slowdowns, each config validated and each `py:`
    interpreter probed now (from `runs`, created here): a bad key fails named, not after minutes
    of measuring."""
    sides = [
        parse_side(spec, name, setup.trainer.parse_overrides)
        for spec, name in zip(args.ab, "AB", strict=True)
    ]
    sides[0].slow_pct, sides[1].slow_pct = parse_inject(args.inject)
    for side in sides:
        try:
            setup.train_config(side.overrides)
        except ConfigError as e:
            raise ConfigError(f"--ab {side.name} = {side.spec!r}: {e}") from None
    runs.mkdir(parents=True, exist_ok=True)
    for side in sides:
        if side.python is not None:
            probe_interpreter(side, runs)
    return sides


# One worker of one side: (side, pair index, run-name stamp) -> its result, as measure_side's.
MeasureFn = Callable[[Side, int, str], dict[str, Any]]


def measure_pair(
    setup: Setup,
    sides: list[Side],
    runs: Path,
    i: int,
    order: str,
    started: str,
    measure: MeasureFn | None = None,
) -> dict[str, dict[str, Any]]:
    """Pair i: one worker of each side, in `order` ('AB' or 'BA'); side name -> its worker row.
    `measure`: how one worker runs (default: measure_side, the canary config's trainer; the
    user's own training: guard/canary/own.py). Raises WorkerFailed when a worker cannot run or fails."""
    got: dict[str, dict[str, Any]] = {}
    for name in order:
        side = sides["AB".index(name)]
        r = measure(side, i, started) if measure else measure_side(setup, side, runs, i, started)
        if r.get("status") == "unavailable":
            raise WorkerFailed(
                EXIT_USAGE,
                f"--ab {name} = {side.spec!r} cannot run here: {r.get('reason')}",
                side=name,
                detail=str(r.get("reason")),
                unavailable=True,
            )
        if r.get("status") != "ok":
            tail = "".join(f"\n  {line}" for line in r.get("stderr_tail", []))
            raise WorkerFailed(
                EXIT_FAIL,
                f"--ab {name} ({side.spec}) measurement failed: {r.get('reason')}{tail}",
                side=name,
                detail=str(r.get("reason")),
            )
        got[name] = _worker_row(side, i, r)
        got[name]["env"] = {
            **side.probe,
            **r.get("env", {}),
            **{k: r[k] for k in ("python_executable", "numpy") if r.get(k)},
        }
    return got


def measure_ab(
    setup: Setup, sides: list[Side], runs: Path, tag: str = "", measure: MeasureFn | None = None
) -> Paired:
    """Pairs of workers of A and B in ABBA (or seeded random) order, canary.ab_pairs of them, two
    more while the verdict is undecided, up to canary.ab_max_pairs; the paired statistic.
    tag: a word for the run names (the matrix's cell); measure: see measure_pair. Raises WorkerFailed."""
    c = setup.canary
    t0 = time.perf_counter()
    rng = random.Random(c.ab_seed)
    started = f"{tag}-{stamp()}" if tag else stamp()
    rows: list[dict[str, Any]] = []
    pairs: list[Pair] = []
    orders = pair_orders(c.ab_pairs, c.ab_order, rng)
    while True:
        for i in range(len(pairs), len(orders)):
            got = measure_pair(setup, sides, runs, i, orders[i], started, measure)
            rows += [got[name] for name in orders[i]]  # in the order they ran
            ratios = pair_ratios(got["A"], got["B"])
            pairs.append(
                Pair(
                    pair=i + 1,
                    order=orders[i],
                    a_run=got["A"]["run_id"],
                    b_run=got["B"]["run_id"],
                    ratio=ratios,
                    load=os.getloadavg()[0],
                )
            )
            progress(
                f"  pair {i + 1}/{len(orders)} ({orders[i]}): B/A {ratios[SPEED]:.4f} "
                f"(A {got['A'][SPEED]:,.1f}, B {got['B'][SPEED]:,.1f}), load {pairs[-1]['load']:.1f}, "
                f"{time.perf_counter() - t0:.0f} s"
            )
        stat = paired_statistic([p["ratio"][SPEED] for p in pairs], c)  # type: ignore[misc]
        if not stat["undecided"] or len(orders) >= c.ab_max_pairs:
            return Paired(rows=rows, pairs=pairs, stat=stat, elapsed_s=time.perf_counter() - t0)
        more = min(2, c.ab_max_pairs - len(orders))
        progress(
            f"  undecided (median {stat['median']:.4f}, interval up to {stat['ci'][1]:.4f}): "
            f"{more} more pair(s) ..."
        )
        orders += pair_orders(more, c.ab_order, rng, start=len(orders))


def run_ab(args: argparse.Namespace, setup: Setup) -> int:
    c = setup.canary
    sides = prepare_sides(args, setup, Path(args.runs).resolve())
    progress(
        f"A/B: A = {sides[0].spec}, B = {sides[1].spec}; {c.ab_pairs} pairs ({c.ab_order} order)"
        f"{'' if c.ab_max_pairs == c.ab_pairs else f', up to {c.ab_max_pairs} if undecided'} ..."
    )
    try:
        got = measure_ab(setup, sides, Path(args.runs).resolve())
    except WorkerFailed as e:
        print(f"moeguard canary: {e.reason}", file=sys.stderr)
        return e.code
    rep = build_report(setup=setup, sides=sides, paired=got)
    write_reports(rep, Path(args.report_dir))
    print_summary(rep)
    return EXIT_FAIL if rep["verdict"] == FAIL else EXIT_PASS
