"""CPU time of a command the canary runs but did not write, sampled from outside (Linux /proc).

On a CPU host the A/B canary on the user's own training (guard/canary/own.py) cannot time CPU
inside the command as moeguard's own canary worker does; wall clock there says as much about the
neighbours as about the code. So while the command runs, the canary samples the CPU time of its
whole process tree (the command, and torchrun's workers when it starts them) every `every`
seconds against the wall clock; afterwards `cpu_between(t0, t1)` is the tree's CPU seconds inside
the run store's steady window (interpolated between samples). Tokens per CPU-second of that window
is the speed: what the training costs, not how long it waited for a core.

Per process: utime + stime + cutime + cstime of /proc/PID/stat (a child that exits moves its time
into its parent's cutime/cstime when reaped, so summing the live tree counts it once). Without
/proc (not Linux) `available` is False and the canary uses wall clock.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

PROC = Path("/proc")


def _ticks(pid: int) -> int:
    """utime + stime + cutime + cstime of one process, in clock ticks (0 when it is gone)."""
    try:
        raw = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return 0
    fields = raw[raw.rindex(")") + 2 :].split()  # after "pid (comm) ": state is fields[0]
    return sum(int(fields[i]) for i in (11, 12, 13, 14))


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        tasks = list((PROC / str(pid) / "task").iterdir())
    except OSError:
        return out
    for task in tasks:
        try:
            out += [int(c) for c in (task / "children").read_text().split()]
        except (OSError, ValueError):
            continue
    return out


def tree_cpu_s(pid: int) -> float:
    """CPU seconds of `pid` and every live descendant (plus what reaped ones left behind)."""
    seen, todo, ticks = set(), [pid], 0
    while todo:
        p = todo.pop()
        if p in seen:
            continue
        seen.add(p)
        ticks += _ticks(p)
        todo += _children(p)
    return ticks / os.sysconf("SC_CLK_TCK")


class CpuSampler:
    """(wall time, tree CPU seconds) samples of one running process tree."""

    available = PROC.is_dir() and (PROC / "self" / "stat").is_file()

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.samples: list[tuple[float, float]] = []

    def sample(self) -> None:
        self.samples.append((time.time(), tree_cpu_s(self.pid)))

    def cpu_between(self, t0: float, t1: float) -> float | None:
        """CPU seconds of the tree between wall times t0 and t1 (linear between samples); None
        when the samples do not span the window."""
        s = self.samples
        if len(s) < 2 or t0 < s[0][0] or t1 > s[-1][0] or t1 <= t0:
            return None
        return _interp(s, t1) - _interp(s, t0)


def _interp(s: list[tuple[float, float]], t: float) -> float:
    for (ta, ca), (tb, cb) in zip(s, s[1:], strict=False):
        if ta <= t <= tb:
            return ca if tb == ta else ca + (cb - ca) * (t - ta) / (tb - ta)
    return s[-1][1]
