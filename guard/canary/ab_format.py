"""ab.json, the A/B canary's report: where it goes, its shape, and its reader; defined once.

The writer (guard/canary/ab.py, ab_report.py) builds these TypedDicts; the readers (the app's
Canaries page, dashboards/data/canary_ab.py; bench/canary/canary_power.py) read through `read_report` /
`parse_report`, which checks every key declared here (type and presence) and names the first bad
one. A key added here is a key the writer must write and every reader may rely on; a report
without `format` (written before this module) is read as format 1, which has the same keys.

Where the reports are: `moeguard canary --ab` writes REPORT_DIR/ab.json under its `--runs` folder
unless `--report-dir` says otherwise; `moeguard app --runs DIR` looks there (and takes
`--ab-reports PATH` for elsewhere, as `--history FILE` names the history gate's file).
"""

import json
import types
from pathlib import Path
from typing import Any, NotRequired, TypedDict, Union, get_args, get_origin, get_type_hints, is_typeddict

AB_JSON, AB_MD = "ab.json", "ab.md"
REPORT_DIR = "canary-report"  # `moeguard canary`'s default --report-dir, under --runs
# The canary's worker runs go here, under --runs: a run store of their own, kept apart from the
# user's runs (`moeguard app --runs RUNS/canary-runs` opens them).
WORKER_RUNS_DIR = "canary-runs"
KIND = "ab"
FORMAT = 1

# The per-pair ratios B/A, one per speed metric; SPEED is the gated one.
SPEED, TPS_RAW, MFU_R, TPS_WALL = "speed", "tokens_per_s", "mfu", "tokens_per_s_wall"
RATIO_LABELS = {
    SPEED: "tokens/s (gated; CPU: per CPU-second, normalised by the reference matmul)",
    TPS_RAW: "tokens/s (CPU: per CPU-second, not normalised)",
    MFU_R: "MFU",
    TPS_WALL: "tokens/s, wall clock",
}
Ratios = TypedDict(
    "Ratios", {SPEED: float | None, TPS_RAW: float | None, MFU_R: float | None, TPS_WALL: float | None}
)


class Pair(TypedDict):
    """One A worker and the B worker next to it."""

    pair: int  # 1-based
    order: str  # "AB" | "BA": which ran first
    a_run: str | None
    b_run: str | None
    ratio: Ratios
    load: float  # 1-minute load average when the pair ended


class Statistic(TypedDict):
    """The paired verdict: median of the per-pair SPEED ratios and its sign-test interval."""

    median: float | None
    ci: list[float | None]  # [lo, hi]
    coverage: float
    n_pairs: int
    fail_below: float  # 1 - ab_fail_pct / 100
    delta_pct: float | None
    b_faster_pairs: int
    verdict: str  # pass | warn | fail
    state: str  # the verdict in words
    undecided: bool
    metric: NotRequired[str]
    label: NotRequired[str]
    method: NotRequired[str]


class EnvRow(TypedDict):
    """One environment key (torch, python, backend used, ...) on each side."""

    key: str
    a: str
    b: str
    differs: bool


class OpChange(TypedDict):
    """One op's time per step in the profiler window, median over each side's workers."""

    op: str
    a_ms: float | None  # None: the op did not run on A
    b_ms: float | None
    delta_ms: float
    delta_pct: float | None


class ProfileDiff(TypedDict):
    workers_profiled: dict[str, int]  # side -> workers with a profiler trace
    host: list[OpChange]  # self time per step, largest |B - A| first
    device: list[OpChange]  # device kernels, total time per step


class SideSummary(TypedDict):
    spec: str  # as given: py:PATH or set:K=V,...
    python: str | None  # None: the parent's interpreter
    overrides: dict[str, Any]
    slow_pct: float
    workers: int
    run_ids: list[str | None]
    speed_median: float | None
    mfu_median: float | None
    tokens_per_s_median: float | None
    ref_cpu_ms_median: float | None
    step_cpu_ms_median: float | None
    mem_peak_bytes_median: float | None
    final_loss_median: float | None


class Report(TypedDict):
    format: NotRequired[int]
    kind: str  # KIND
    time: NotRequired[str]  # UTC, guard.canary.keys.H_TIME_FORMAT, when the canary ended
    verdict: str
    exit_code: int
    state: str
    statistic: Statistic
    other_ratios: dict[str, Any]  # the other Ratios keys' median and interval
    config: str
    config_label: str
    timing: str | None  # cpu | wall
    order: str  # abba | random
    sequence: str  # the sides in the order they ran, e.g. "ABBAAB"
    gates: dict[str, Any]  # the canary.ab_* settings
    sides: dict[str, SideSummary]  # "A", "B"
    pairs: list[Pair]
    workers: list[dict[str, Any]]
    env_diff: list[EnvRow]
    profile_diff: ProfileDiff
    elapsed_s: float


class ReportError(ValueError):
    """Not an A/B canary report; the message names the file and the first bad key."""


def parse_report(obj: Any, where: str = "ab.json") -> Report:
    """`obj` (ab.json's content) checked against Report; raises ReportError naming the bad key."""
    if not isinstance(obj, dict) or obj.get("kind") != KIND:
        raise ReportError(f'{where}: not an A/B canary report (no "kind": {KIND!r})')
    if not isinstance(obj.get("format", FORMAT), int) or obj.get("format", FORMAT) > FORMAT:
        raise ReportError(f"{where}: format {obj.get('format')!r} is newer than this reader's ({FORMAT})")
    _check(obj, Report, where)
    return obj  # type: ignore[return-value]


def read_report(path: Path) -> Report:
    """parse_report of a file; an unreadable or non-JSON file is a ReportError naming it."""
    try:
        obj = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ReportError(f"{path}: cannot read it as JSON ({e})") from None
    return parse_report(obj, str(path))


def _check(v: Any, tp: Any, where: str) -> None:
    """Does v fit the annotation tp (TypedDict, list[X], dict[str, X], X | None, int, float, ...)?"""
    if tp is Any:
        return
    origin, args = get_origin(tp), get_args(tp)
    if origin in (Union, types.UnionType):
        if v is None and type(None) in args:
            return
        inner = [a for a in args if a is not type(None)]
        if len(inner) == 1:
            return _check(v, inner[0], where)
        if not any(_fits(v, a, where) for a in inner):
            raise ReportError(f"{where}: {v!r} is none of {tp}")
        return
    if is_typeddict(tp):
        if not isinstance(v, dict):
            raise ReportError(f"{where}: expected an object, got {type(v).__name__}")
        for key, hint in get_type_hints(tp).items():
            if key in v:
                _check(v[key], hint, f"{where}.{key}")
            elif key in tp.__required_keys__:
                raise ReportError(f"{where}: key {key!r} is missing")
        return
    if origin is list:
        if not isinstance(v, list):
            raise ReportError(f"{where}: expected a list, got {type(v).__name__}")
        for i, x in enumerate(v):
            _check(x, args[0], f"{where}[{i}]")
        return
    if origin is dict:
        if not isinstance(v, dict):
            raise ReportError(f"{where}: expected an object, got {type(v).__name__}")
        for k, x in v.items():
            _check(x, args[1], f"{where}.{k}")
        return
    ok = (
        isinstance(v, int | float) and not isinstance(v, bool)
        if tp is float
        else isinstance(v, int) and not isinstance(v, bool)
        if tp is int
        else isinstance(v, tp)
    )
    if not ok:
        raise ReportError(f"{where}: expected {tp.__name__}, got {v!r}")


def _fits(v: Any, tp: Any, where: str) -> bool:
    try:
        _check(v, tp, where)
    except ReportError:
        return False
    return True
