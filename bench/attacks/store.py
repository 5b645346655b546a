"""Attacks on what the collector keeps on disk: a clean control run, damaged run folders at
start-up (issue #13 item 1), part numbers past 999,999 (item 2), an I/O error inside an ingest
and inside a checkpoint (items 3 and 9), and replays of acknowledged batches across a kill -9.

Writes docs/BENCHMARKS.md: no section of its own; part of Collector › Collector and pager under
attack (issues #13 and #32, `bench/attacks/collector_attacks.py`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import polars as pl

from bench.attacks.kit import (
    G1,
    CollectorProc,
    Down,
    Ledger,
    Row,
    batch,
    halt,
    limit_file_size,
    state_json,
    wait_until,
)
from guard.collector.config import COMMANDS_FILE, STATE_DIR, STATE_FILE
from guard.core import schema
from guard.store.layout import atomic_write_bytes, parse_part_name, part_files, part_name


def _checkpoint_event(step: int) -> dict[str, object]:
    return {"step": step, "kind": schema.EV_CHECKPOINT, "detail": {"path": f"ckpt-{step}"}}


def clean(work: Path) -> Row:
    """Control: five ordinary batches (50 steps, 5 events, a meta)."""
    ledger, c = Ledger(), CollectorProc(work).start()
    try:
        answers = [
            ledger.post(
                c, batch("clean", G1 | (i + 1), range(10 * i, 10 * i + 10), [_checkpoint_event(10 * i)])
            )
            for i in range(5)
        ]
        up = c.alive()
    finally:
        c.stop()
    lost, twice = ledger.check(c.runs)
    ok = all(r.status_code == 200 and r.json()["duplicate"] is False for r in answers)
    return Row(
        attack="clean",
        item="control",
        what="a clean ingest: 5 batches, 50 steps, 5 events",
        answer="200 stored, x5" if ok else f"answers {[r.status_code for r in answers]}",
        up=up,
        lost=lost,
        twice=twice,
        held=ok,
    )


# ---------------------------------------------------------------------------------------
# item 1: one damaged run folder must not keep the collector from starting
# ---------------------------------------------------------------------------------------
# --only name -> (the damage, words of the quarantine reason; None: the run still serves)
DAMAGE: dict[str, tuple[str, str | None]] = {
    "garbage_state": ("garbage in state.json", STATE_FILE),
    "empty_state": ("state.json = {}", STATE_FILE),
    "garbage_commands": ("garbage in commands.json", COMMANDS_FILE),
    "stray_wal": ("a stray .collector/wal-abc.log", None),
    "part_named_folder": ("a folder named like a part file", "named like a part file"),
    "table_is_file": ("a file in place of the layers table folder", "layers is not a folder"),
    "meta_list": ("meta.json a JSON list", schema.META_FILE),
}


def _damage(run_dir: Path, kind: str) -> None:
    st = run_dir / STATE_DIR
    if kind == "garbage_state":
        (st / STATE_FILE).write_bytes(b"\x00\x01 not json {")
    elif kind == "empty_state":
        (st / STATE_FILE).write_text("{}")
    elif kind == "garbage_commands":
        (st / COMMANDS_FILE).write_text("[{oops")
    elif kind == "stray_wal":
        (st / "wal-abc.log").write_bytes(b"someone else's file")
    elif kind == "part_named_folder":
        (run_dir / schema.TABLE_STEPS / part_name(99, 42)).mkdir()
    elif kind == "table_is_file":
        layers = run_dir / schema.TABLE_LAYERS
        for p in layers.iterdir():
            p.unlink()
        layers.rmdir()
        layers.write_text("not a folder")
    elif kind == "meta_list":
        (run_dir / schema.META_FILE).write_text("[1, 2, 3]")
    else:
        raise ValueError(kind)


def _short(reason: str, width: int = 60) -> str:
    """A quarantine reason without its exception detail, cut at a word."""
    reason = reason.split(" (")[0]
    return reason if len(reason) <= width else reason[:width].rsplit(" ", 1)[0] + "…"


def startup_damage(kind: str) -> Callable[[Path], Row]:
    """The attack for one kind of damage: two runs stored, one damaged while the collector is
    down, then a restart: it must come up, quarantine (or tolerate) that run and serve the other."""
    what, why = DAMAGE[kind]

    def attack(work: Path) -> Row:
        ledger, c = Ledger(), CollectorProc(work, "--checkpoint-interval", "0.2")
        row = Row(attack=kind, item="1", what=f"restart over a run folder with {what}", answer="")
        c.start()
        try:
            for run in ("good", "victim"):
                ledger.post(c, batch(run, G1 | 1, range(10), meta={"owner": run}))
        finally:
            c.stop()
        _damage(c.runs / "victim", kind)
        try:
            c.start()
        except Down as e:
            row.answer = f"did not start: {e}"
            row.lost, row.twice = ledger.check(c.runs)
            return row
        try:
            victim = ledger.post(c, batch("victim", G1 | 2, range(10, 15)))
            good = ledger.post(c, batch("good", G1 | 2, range(10, 15)))
            listing = {r["run"]: r for r in c.get("/v1/runs").json()["runs"]}
            row.up = c.alive()
        finally:
            c.stop()
        row.lost, row.twice = ledger.check(c.runs)
        reason = listing.get("victim", {}).get("quarantined")
        if why is None:
            row.held = victim.status_code == 200 and good.status_code == 200 and reason is None
            row.answer = (
                f"came up; that run {victim.status_code}, the other {good.status_code} (file ignored)"
            )
        else:
            row.held = (
                victim.status_code == 503 and reason is not None and why in reason and good.status_code == 200
            )
            shown = f"quarantined: {_short(reason)}" if reason else victim.text[:60]
            row.answer = f"came up; that run {victim.status_code} ({shown}), the other {good.status_code}"
        return row

    attack.__doc__ = f"Restart over a run folder with {what}."
    return attack


# ---------------------------------------------------------------------------------------
# item 2: part numbers past 999,999
# ---------------------------------------------------------------------------------------
def parts_past_999999(work: Path) -> Row:
    """The collector's part counter set to 999,998 (a run streaming for days), then batches
    checkpointed across 1,000,000, a restart, and more: every reader must see every row."""
    ledger, c = Ledger(), CollectorProc(work, "--checkpoint-interval", "0.2")
    run_dir = c.runs / "long"
    c.start()
    try:
        ledger.post(c, batch("long", G1 | 1, range(5)))
        wait_until(lambda: state_json(run_dir).get("next_part_seq", 0) > 0, 30, "the first checkpoint")
    finally:
        c.stop()
    st = state_json(run_dir)
    st["next_part_seq"] = 999_998
    atomic_write_bytes(run_dir / STATE_DIR / STATE_FILE, json.dumps(st, sort_keys=True).encode())
    answers = []
    for restart in range(2):
        c.start()
        try:
            for i in range(2):
                n = 2 * restart + i
                answers.append(ledger.post(c, batch("long", G1 | (n + 2), range(5 + 5 * n, 10 + 5 * n))))
                before = state_json(run_dir)["next_part_seq"]
                wait_until(lambda b=before: state_json(run_dir)["next_part_seq"] > b, 30, "a checkpoint")
            up = c.alive()
        finally:
            c.stop()
    lost, twice = ledger.check(c.runs)
    seqs = [parse_part_name(p.name).seq for p in part_files(run_dir, schema.TABLE_STEPS)]  # type: ignore[union-attr]
    glob = sorted(
        pl.scan_parquet(str(run_dir / schema.TABLE_STEPS / "*.parquet")).collect()["step"].to_list()
    )
    readers_agree = glob == sorted(ledger.steps["long"])
    ok = all(r.status_code == 200 for r in answers) and max(seqs) >= 1_000_000 and readers_agree
    return Row(
        attack="parts_past_999999",
        item="2",
        what="part numbers from 999,998 past 1,000,000, across a restart",
        answer=(
            f"200 x{len(answers)}; steps parts numbered up to {max(seqs):,}; the README glob "
            f"{'reads the same rows as' if readers_agree else 'DISAGREES with'} read_table"
        ),
        up=up,
        lost=lost,
        twice=twice,
        held=ok,
    )


# ---------------------------------------------------------------------------------------
# items 3 and 9: I/O errors, then retries
# ---------------------------------------------------------------------------------------
def io_error_mid_ingest(work: Path) -> Row:
    """8 steps, a halt and a meta in one batch while the collector cannot write (its file-size
    limit set to 1 byte for that one request), then the exporter's retries, then a kill -9."""
    ledger, c = Ledger(), CollectorProc(work, "--checkpoint-interval", "3600").start()
    try:
        ledger.post(c, batch("io", G1 | 1, [0]))  # the run and its log segment exist
        eight = batch("io", G1 | 2, range(1, 9), [halt(8)], meta={"owner": "team-a"})
        limit_file_size(c.pid, 1)
        try:
            first = ledger.post(c, eight)
        finally:
            limit_file_size(c.pid, None)
        retry, again = ledger.post(c, eight), ledger.post(c, eight)
        up = c.alive()
        c.kill()  # nothing checkpointed: the log alone must give one copy of everything
        c.start()
        up = up and c.alive()
    finally:
        c.stop()
    lost, twice = ledger.check(c.runs)
    err = first.json().get("error", "") if first.status_code != 200 else ""
    # 507: EFBIG is a file the disk will not grow, answered as a full disk (issue #32): retryable
    ok = first.status_code == 507 and retry.json().get("duplicate") is False and again.json().get("duplicate")
    return Row(
        attack="io_error_mid_ingest",
        item="3",
        what="an I/O error (EFBIG) during one ingest, then the retry and a retry of that, then kill -9",
        answer=(
            f"{first.status_code} '{err.split(': ')[1] if ': ' in err else first.text[:40]}'; retry "
            f"{retry.status_code} stored; again {again.status_code} duplicate={again.json().get('duplicate')}"
        ),
        up=up,
        lost=lost,
        twice=twice,
        held=bool(ok) and twice == 0,
    )


def io_error_at_checkpoint(work: Path) -> Row:
    """The collector cannot write while it checkpoints (file-size limit 1 byte until a checkpoint
    has failed, then lifted): once the fault is gone, does the run take batches again?"""
    ledger, c = Ledger(), CollectorProc(work, "--checkpoint-interval", "0.3").start()
    failed = False
    try:
        for n in range(3):  # a checkpoint may slip in between the 200 and the limit: try again
            ledger.post(c, batch("ck", G1 | (n + 1), range(5 * n, 5 * n + 5)))
            limit_file_size(c.pid, 1)
            try:
                wait_until(lambda: "checkpoint failed" in c.log_text(), 5, "a failed checkpoint")
                failed = True
            except TimeoutError:
                pass
            finally:
                limit_file_size(c.pid, None)
            if failed:
                break
        time.sleep(1.0)  # the fault is gone: a few checkpoint intervals to get over it
        nxt = batch("ck", G1 | 10, range(20, 25))
        after = ledger.post(c, nxt)
        up = c.alive()
    finally:
        c.stop()
    c.start()
    try:
        restarted = ledger.post(c, nxt)
        up = up and c.alive()
    finally:
        c.stop()
    lost, twice = ledger.check(c.runs)
    if not failed:
        answer = "no checkpoint failed under the fault (nothing injected)"
    elif after.status_code == 200:
        answer = f"checkpoint failed; with the fault gone the run takes batches again ({after.status_code})"
    else:
        answer = (
            f"checkpoint failed; with the fault gone the run still answers {after.status_code} "
            f"'storage failed' until a restart; after it {restarted.status_code}"
        )
    return Row(
        attack="io_error_at_checkpoint",
        item="9",
        what="a transient I/O error (EFBIG) during a checkpoint, then the next batch",
        answer=answer,
        up=up,
        lost=lost,
        twice=twice,
        held=failed and after.status_code == 200,
    )


def idempotent_replay(work: Path) -> Row:
    """Every acknowledged batch sent again, in and out of order, then again after a kill -9 and
    a restart (the exporter's retries after a lost answer)."""
    bodies = [
        batch("rp", G1 | (i + 1), range(10 * i, 10 * i + 10), [_checkpoint_event(10 * i)]) for i in range(5)
    ]
    ledger, c = Ledger(), CollectorProc(work, "--checkpoint-interval", "3600").start()
    try:
        first = [ledger.post(c, b) for b in bodies]
        repeats = [c.ingest(b) for b in [*reversed(bodies), *bodies]]
        c.kill()
        c.start()
        after = [c.ingest(b) for b in bodies]
        new = ledger.post(c, batch("rp", G1 | 6, range(50, 60)))
        up = c.alive()
    finally:
        c.stop()
    lost, twice = ledger.check(c.runs)
    dups = [r.status_code == 200 and r.json()["duplicate"] is True for r in [*repeats, *after]]
    stored = [r.status_code == 200 and r.json()["duplicate"] is False for r in [*first, new]]
    return Row(
        attack="idempotent_replay",
        item="held",
        what="5 acknowledged batches sent again 10 times out of order, and 5 more after kill -9 + restart",
        answer=f"200 duplicate for {sum(dups)}/{len(dups)} repeats; new batches stored {sum(stored)}/{len(stored)}",
        up=up,
        lost=lost,
        twice=twice,
        held=all(dups) and all(stored) and twice == 0,
    )
