"""CPU by test, every process a test started included: where the suite's CPU goes.

pytest's --durations ranks tests by wall time, which misleads on a CPU-bound 2-core box: a test
that waits on alert timers ranks high and costs little, one that launches 21 torchrun jobs ranks
by its slowest wait, not by the ~490 CPU-s its 130 processes burn. This adds up, per test, the
CPU of its xdist worker while it ran (getrusage) and of every process started under that worker
while it ran (Linux BSD process accounting, whatever the process's depth: torchrun's ranks,
servers, browsers), then ranks tests and modules by it.

Two halves, run by scripts/ci-cpu-profile (root, Debian package `acct`):
- a pytest plugin (`-p ci_cpu_profile` with scripts/ on the path): each test's start, wall time,
  the worker's own CPU over it and the worker's pid, one JSON line per test in
  $MOEGUARD_CPU_PROFILE_OUT/<worker>.jsonl;
- `python scripts/ci_cpu_profile.py OUT [--top N]`: reads OUT/pacct (acct v3 records) and those
  lines, and prints the ranking.
A process is charged to the test that ran on its worker when it started (its parent chain, matched
by pid and lifetime, leads to the worker). What no worker started (a process reparented before
its parent's record could name it) is listed apart.
"""

from __future__ import annotations

import argparse
import bisect
import collections
import json
import os
import resource
import struct
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

OUT_ENV = "MOEGUARD_CPU_PROFILE_OUT"

# ---- the pytest plugin ---------------------------------------------------------------------------

try:
    import pytest
except ImportError:  # the report half runs without pytest
    pytest = None  # type: ignore[assignment]


def _self_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


if pytest is not None:

    @pytest.hookimpl(hookwrapper=True)
    def pytest_runtest_protocol(item: Any, nextitem: Any) -> Iterator[None]:
        out = os.environ.get(OUT_ENV)
        c0, t0 = _self_cpu(), time.time()
        yield
        if not out:
            return
        rec = {
            "id": item.nodeid,
            "t0": t0,
            "wall": time.time() - t0,
            "self": _self_cpu() - c0,
            "pid": os.getpid(),
        }
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        with open(Path(out, f"{worker}.jsonl"), "a") as f:
            f.write(json.dumps(rec) + "\n")


# ---- the report ----------------------------------------------------------------------------------

# struct acct_v3 (linux/acct.h): flag, version, tty, exitcode, uid, gid, pid, ppid, btime (s),
# etime (float, ticks), then comp_t utime, stime, mem, io, rw, minflt, majflt, swaps, comm[16]
ACCT_V3 = struct.Struct("<BBHIIIIIIfHHHHHHHH16s")
AHZ = 100  # acct's ticks a second


def _comp(v: int) -> int:
    """comp_t: a 13-bit mantissa and a 3-bit base-8 exponent."""
    return (v & 0x1FFF) << (3 * (v >> 13))


def read_pacct(path: Path) -> list[dict[str, Any]]:
    data = path.read_bytes()
    out = []
    for off in range(0, len(data) - ACCT_V3.size + 1, ACCT_V3.size):
        f = ACCT_V3.unpack_from(data, off)
        if f[1] != 3:
            raise SystemExit(f"{path}: record {off // ACCT_V3.size} is acct v{f[1]}, not v3")
        out.append(
            {
                "pid": f[6],
                "ppid": f[7],
                "start": float(f[8]),
                "end": f[8] + f[9] / AHZ,
                "cpu": (_comp(f[10]) + _comp(f[11])) / AHZ,
                "comm": f[18].split(b"\0")[0].decode(errors="replace"),
            }
        )
    return out


def read_tests(out: Path) -> dict[int, list[dict[str, Any]]]:
    """worker pid -> its tests in start order."""
    by_pid: dict[int, list[dict[str, Any]]] = collections.defaultdict(list)
    for p in sorted(out.glob("*.jsonl")):
        for line in p.read_text().splitlines():
            rec = json.loads(line)
            by_pid[rec["pid"]].append(rec)
    for tests in by_pid.values():
        tests.sort(key=lambda t: t["t0"])
    return by_pid


def charge(
    procs: list[dict[str, Any]], tests: dict[int, list[dict[str, Any]]]
) -> tuple[dict[str, float], dict[str, int], dict[str, float]]:
    """(CPU by test id, processes by test id, CPU of what no worker started, by command name)."""
    by_pid: dict[int, list[dict[str, Any]]] = collections.defaultdict(list)
    for p in procs:
        by_pid[p["pid"]].append(p)

    def parent(p: dict[str, Any]) -> dict[str, Any] | None:
        # pids are reused: the parent is the record of that pid alive when p started (acct's
        # btime is whole seconds: a second of slack either side)
        alive = [
            q
            for q in by_pid.get(p["ppid"], ())
            if q is not p and q["start"] - 1 <= p["start"] <= q["end"] + 1
        ]
        return min(alive, key=lambda q: q["end"] - q["start"]) if alive else None

    starts = {pid: [t["t0"] for t in ts] for pid, ts in tests.items()}
    cpu: dict[str, float] = collections.defaultdict(float)
    count: dict[str, int] = collections.defaultdict(int)
    orphans: dict[str, float] = collections.defaultdict(float)
    for t in (t for ts in tests.values() for t in ts):
        cpu[t["id"]] += t["self"]
    for p in procs:
        if p["pid"] in tests:  # a worker itself: its CPU is in the tests' own figures
            continue
        q, hops = p, 0
        while q is not None and q["ppid"] not in tests and hops < 64:
            q, hops = parent(q), hops + 1
        if q is None or q["ppid"] not in tests:
            orphans[p["comm"]] += p["cpu"]
            continue
        worker = q["ppid"]
        i = bisect.bisect_right(starts[worker], p["start"] + 0.5) - 1  # btime rounds down
        test = tests[worker][i]["id"] if i >= 0 else "(worker start-up)"
        cpu[test] += p["cpu"]
        count[test] += 1
    return cpu, count, orphans


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path, help="the folder with pacct and the plugin's <worker>.jsonl")
    ap.add_argument("--top", type=int, default=25, help="tests and modules to list (default: 25)")
    args = ap.parse_args(argv)
    if not (args.out / "pacct").is_file():
        ap.error(f"{args.out / 'pacct'}: no process accounting file (scripts/ci-cpu-profile writes it)")
    procs, tests = read_pacct(args.out / "pacct"), read_tests(args.out)
    if not tests:
        ap.error(f"{args.out}: no <worker>.jsonl (was the plugin loaded: -p ci_cpu_profile?)")
    cpu, count, orphans = charge(procs, tests)
    total = sum(p["cpu"] for p in procs)  # the workers' own records hold their tests' `self` CPU
    in_tests = sum(t["self"] for ts in tests.values() for t in ts)
    workers = sum(p["cpu"] for p in procs if p["pid"] in tests)
    mods: dict[str, float] = collections.defaultdict(float)
    for k, v in cpu.items():
        mods[k.split("::")[0]] += v
    print(
        f"CPU: {total:,.0f} s in all, {len(procs)} processes; charged to tests {sum(cpu.values()):,.0f} s; "
        f"the workers outside their tests (start-up, collection) {workers - in_tests:,.0f} s"
    )
    print(f"\nmodules, top {args.top} by CPU (s)")
    for m, v in sorted(mods.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"{v:8.1f}  {m}")
    print(f"\ntests, top {args.top} by CPU (s, processes started)")
    for k, v in sorted(cpu.items(), key=lambda kv: -kv[1])[: args.top]:
        print(f"{v:8.1f} {count.get(k, 0):4d}  {k}")
    if orphans:
        top = ", ".join(f"{c} {v:.0f}" for c, v in sorted(orphans.items(), key=lambda kv: -kv[1])[:5])
        print(f"\nstarted by no worker (or reparented first): {sum(orphans.values()):.0f} s ({top})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
