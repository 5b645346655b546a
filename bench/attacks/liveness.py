"""A rank that hangs while its heartbeats go on (issue #13 item 10): the collector must call it
stuck, by name, within its learned deadline, and let go when it moves again.

Writes docs/BENCHMARKS.md: no section of its own; part of Collector › Collector and pager under
attack (issues #13 and #32, `bench/attacks/collector_attacks.py`).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from bench.attacks.kit import G1, CollectorProc, Ledger, Row, batch
from guard.core.heartbeat import PHASE_TRAIN
from guard.wire.batch import heartbeat

BEAT_S = 0.25  # seconds between beats (and between steps while the ranks advance)


def _ranks(c: CollectorProc) -> dict[str, dict[str, Any]]:
    """The run's ranks as GET /v1/runs lists them (guard/wire/runs.py)."""
    [run] = [r for r in c.get("/v1/runs").json()["runs"] if r["run"] == "hang"]
    return run["ranks"]


def _stuck(c: CollectorProc) -> dict[str, bool]:
    return {rank: bool(v.get("stuck")) for rank, v in _ranks(c).items()}


def hung_rank(work: Path) -> Row:
    """Ranks 0 and 1 step every 0.25 s; then rank 1 stops advancing but keeps beating (a hung
    collective) while rank 0 goes on; then rank 1 moves again. Deadline: max(1 s, 2 x longest step)."""
    ledger = Ledger()
    flags = ("--progress-floor", "1", "--progress-safety", "2", "--progress-first-deadline", "3")
    c = CollectorProc(work, *flags).start()
    seqs = {0: 0, 1: 0}

    def beat(rank: int, step: int, report: bool) -> Any:
        seqs[rank] += 1
        b = batch("hang", G1 | seqs[rank], [step] if report else [], rank=rank)
        b["heartbeat"] = heartbeat(time.time(), step, PHASE_TRAIN)
        return ledger.post(c, b)

    try:
        step = 0
        for step in range(8):  # both advance: the train phase's duration is learned
            beat(0, step, True)
            beat(1, step, True)
            time.sleep(BEAT_S)
        hung_at, t0, seen, deadline = step, time.monotonic(), None, float("nan")
        while time.monotonic() - t0 < 6 and seen is None:
            step += 1
            beat(0, step, True)
            beat(1, hung_at, False)  # alive, not advancing
            ranks = _ranks(c)
            if ranks.get("1", {}).get("stuck"):
                seen, deadline = time.monotonic() - t0, ranks["1"]["progress_deadline_s"]
            time.sleep(BEAT_S)
        named = _stuck(c)
        cleared = None
        while time.monotonic() - t0 < 20 and cleared is None:  # rank 1 moves again, with rank 0
            step += 1
            beat(0, step, True)
            beat(1, step, True)
            if not _stuck(c).get("1"):
                cleared = True
            time.sleep(BEAT_S)
        up = c.alive()
    finally:
        c.stop()
    lost, twice = ledger.check(c.runs)
    ok = seen is not None and named == {"0": False, "1": True} and bool(cleared)
    return Row(
        attack="hung_rank",
        item="10",
        what="rank 1 stops advancing while its heartbeats go on (rank 0 steps on), then moves again",
        answer=(
            f"rank 1 stuck after {seen:.1f} s (learned deadline {deadline:.1f} s), ranks stuck: "
            f"{[r for r, s in named.items() if s]}; {'clears' if cleared else 'does NOT clear'} when it moves"
            if seen is not None
            else f"never called stuck within 6 s ({named})"
        ),
        up=up,
        lost=lost,
        twice=twice,
        held=ok,
    )
