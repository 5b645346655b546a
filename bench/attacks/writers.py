"""Attacks on who writes a run (issue #13 item 4): a second trainer on the same run id, one
started in the same second, a batch of an older generation, and seq = 2**63 - 1.

seq = generation << 32 | counter, generation = the exporter's start second (guard/wire/batch.py).

Writes docs/BENCHMARKS.md: no section of its own; part of Collector › Collector and pager under
attack (issues #13 and #32, `bench/attacks/collector_attacks.py`).
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx

from bench.attacks.kit import G1, G2, CollectorProc, Ledger, Row, batch
from guard.collector.config import STATE_DIR, SUPERSEDED_DIR
from guard.core import schema
from guard.store.reader import read_table


def _conflict(r: httpx.Response) -> bool:
    return r.status_code == 409 and "generation conflict" in r.json()["error"]


def second_writer(work: Path) -> Row:
    """Trainer A stores 50 steps; trainer B, started later with the same run id, writes from
    step 0; A goes on. Before the fix A's batches were answered "duplicate" and lost."""
    a_bodies = [
        batch("two", G1 | (i + 1), range(10 * i, 10 * i + 10), loss=1.0, writer="trainerA") for i in range(5)
    ]
    ledger, c = Ledger(), CollectorProc(work, "--checkpoint-interval", "0.2").start()
    try:
        a = [ledger.post(c, b) for b in a_bodies]
        b = ledger.post(c, batch("two", G2 | 1, range(10), loss=2.0, writer="trainerB"))
        a_late = ledger.post(c, batch("two", G1 | 6, range(50, 60), loss=1.0, writer="trainerA"))
        a_retry = c.ingest(a_bodies[-1])
        b_next = ledger.post(c, batch("two", G2 | 2, range(10, 20), loss=2.0, writer="trainerB"))
        up = c.alive()
    finally:
        c.stop()
    lost, twice = ledger.check(c.runs)
    kept = c.runs / "two" / STATE_DIR / SUPERSEDED_DIR
    moved = sum(read_table(d, schema.TABLE_STEPS).height for d in kept.iterdir()) if kept.is_dir() else 0
    ok = (
        all(r.status_code == 200 for r in [*a, b, b_next])
        and _conflict(a_late)
        and a_retry.status_code == 200
        and a_retry.json()["duplicate"] is True
    )
    return Row(
        attack="second_writer",
        item="4",
        what="a second trainer on the same run id (newer generation, from step 0) while the first goes on",
        answer=(
            f"newer writer {b.status_code}, the {moved} rows it re-runs moved to .collector/superseded/; "
            f"older writer {a_late.status_code}"
            f"{' generation conflict' if _conflict(a_late) else ''}; its retry of a stored batch "
            f"{a_retry.status_code} duplicate={a_retry.json().get('duplicate')}"
        ),
        up=up,
        lost=lost,
        twice=twice,
        held=ok,
    )


def same_second_writer(work: Path) -> Row:
    """Two trainers started within the same second: one generation, two writer ids."""
    ledger, c = Ledger(), CollectorProc(work).start()
    try:
        a = ledger.post(c, batch("same", G1 | 1, range(10), writer="wA"))
        b = [ledger.post(c, batch("same", G1 | n, range(10, 20), writer="wB")) for n in (5, 1)]
        a_next = ledger.post(c, batch("same", G1 | 2, range(10, 20), writer="wA"))
        up = c.alive()
    finally:
        c.stop()
    lost, twice = ledger.check(c.runs)
    return Row(
        attack="same_second_writer",
        item="4",
        what="a second trainer started in the same second (same generation, other writer id)",
        answer=f"second writer {'/'.join(str(r.status_code) for r in b)} (a later and an equal seq); first {a_next.status_code}",
        up=up,
        lost=lost,
        twice=twice,
        held=a.status_code == 200 and all(_conflict(r) for r in b) and a_next.status_code == 200,
    )


def older_generation(work: Path) -> Row:
    """A batch from a generation older than the one writing the run, never stored before."""
    ledger, c = Ledger(), CollectorProc(work).start()
    try:
        cur = ledger.post(c, batch("old", G2 | 1, range(10)))
        old = ledger.post(c, batch("old", G1 | 7, range(10, 20)))
        cur_next = ledger.post(c, batch("old", G2 | 2, range(10, 20)))
        up = c.alive()
    finally:
        c.stop()
    lost, twice = ledger.check(c.runs)
    return Row(
        attack="older_generation",
        item="4",
        what="a batch of an older writer generation than the run's current one",
        answer=f"{old.status_code}{' generation conflict' if _conflict(old) else ''}; the current writer {cur_next.status_code}",
        up=up,
        lost=lost,
        twice=twice,
        held=cur.status_code == 200 and _conflict(old) and cur_next.status_code == 200,
    )


def seq_max(work: Path) -> Row:
    """seq = 2**63 - 1 (and 2**63, -1, a generation 2 h ahead): before the fix 2**63 - 1 owned
    the run for good and every real batch after it was refused."""
    ledger, c = Ledger(), CollectorProc(work).start()
    now = int(time.time())
    try:
        bad = [ledger.post(c, batch("sq", s, [0])) for s in (2**63 - 1, 2**63, -1, (now + 7200) << 32)]
        real = [ledger.post(c, batch("sq", now << 32 | n, [n])) for n in (1, 2)]
        up = c.alive()
    finally:
        c.stop()
    lost, twice = ledger.check(c.runs)
    refused = [r.status_code == 400 and "'seq'" in r.json()["error"] for r in bad]
    return Row(
        attack="seq_max",
        item="4",
        what="seq = 2**63-1, 2**63, -1 and a generation 2 h ahead, then real batches",
        answer=f"400 naming 'seq' for {sum(refused)}/{len(bad)}; real batches after them {'/'.join(str(r.status_code) for r in real)}",
        up=up,
        lost=lost,
        twice=twice,
        held=all(refused) and all(r.status_code == 200 for r in real),
    )
