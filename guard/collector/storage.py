"""The collector's files in a run folder, through guard/store: its state.json (the checkpoint
commit), commands.json, the Parquet parts a checkpoint writes (guard/store/writer.py, the run
store's own format), the rows a resumed trainer supersedes, and what a restart reads back.

Layout checks come first: a run whose files this collector cannot load safely is RunDamaged
(quarantined by the service), never half-loaded or written over.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import polars as pl

from guard.collector.book import HealthBook
from guard.collector.config import COMMANDS_FILE, LIVENESS_FILE, STATE_DIR, STATE_FILE
from guard.collector.errors import RunDamaged
from guard.collector.wal import WAL_RE
from guard.core import schema
from guard.core.heartbeat import PHASES
from guard.core.report import StepReport
from guard.store.layout import atomic_write_bytes, fsync_dir, parse_part_name, part_files
from guard.store.reader import count_actions, read_meta, scan_table
from guard.store.writer import event_frame, report_frames, table_frame, truncate_after, write_parts
from guard.wire.batch import generation_of

Side = dict[
    str, list[dict[str, Any]]
]  # rank 0's evals and host rows by table (guard/wire/batch.py SIDE_TABLES)

log = logging.getLogger("moeguard.collector")
COUNTERS_KEY = "counters"  # state.json: the run's counters as of the checkpoint (RunHealth.counter_state)


def row_frames(
    reports: list[StepReport], events: list[dict[str, Any]], side: Side | None = None
) -> dict[str, pl.DataFrame]:
    """The table frames of rank-0 reports, event rows and side rows (evals, host)."""
    frames = report_frames(reports)
    if events:
        frames[schema.TABLE_EVENTS] = event_frame(events)
    for t, rows in (side or {}).items():
        if rows:
            frames[t] = table_frame(t, {c: [r[c] for r in rows] for c in schema.TABLE_COLUMNS[t]})
    return frames


def write_rows(
    run_dir: Path, reports: list[StepReport], events: list[dict[str, Any]], seq: int, side: Side | None = None
) -> int:
    """Rank-0 reports, event rows and side rows as parts of the run store (first part number
    `seq`); returns the next free part number."""
    return write_parts(run_dir, row_frames(reports, events, side), seq)


def with_liveness(st: dict[str, Any], state_dir: Path) -> dict[str, Any]:
    """state.json with liveness.json's ranks and learned deadlines in it (a state.json written
    before liveness had its own file keeps them inline; liveness.json, when present, is newer)."""
    live = load_json(state_dir / LIVENESS_FILE, None)
    if isinstance(live, dict) and "ranks" in live:
        return {**st, "ranks": live["ranks"], "liveness": live.get("liveness", {})}
    return st


def commit_liveness(state_dir: Path, doc: dict[str, Any]) -> None:
    """Replace liveness.json (whole or not at all)."""
    atomic_write_bytes(state_dir / LIVENESS_FILE, json.dumps(doc, sort_keys=True).encode())


def commit_state(state_dir: Path, st: dict[str, Any]) -> None:
    """Replace state.json: the checkpoint's commit point."""
    atomic_write_bytes(state_dir / STATE_FILE, json.dumps(st, sort_keys=True).encode())
    fsync_dir(state_dir)


def write_meta(run_dir: Path, meta: dict[str, Any]) -> None:
    atomic_write_bytes(
        run_dir / schema.META_FILE, json.dumps(meta, indent=2, sort_keys=True, default=str).encode()
    )


def remove_uncommitted_parts(run: str, run_dir: Path, next_part: int) -> None:
    """Parts written by a checkpoint that never committed (numbered from `next_part` on)."""
    for t in schema.TABLES:
        for p in part_files(run_dir, t):
            pn = parse_part_name(p.name)
            if pn is not None and pn.seq >= next_part:
                log.warning("run %s: removing uncommitted part %s", run, p.name)
                p.unlink()


def supersede(
    run_dir: Path,
    dest: Path,
    first: int,
    pending: tuple[list[StepReport], list[dict[str, Any]], Side],
    seq: int,
) -> int:
    """Move every row after step `first - 1` (stored in parts, and the still `pending` reports,
    events and side rows) out of the live tables into `dest`, a store of the same layout. Nothing is deleted.
    Idempotent (redone after a failure or in replay). Returns the rows moved."""
    moved = truncate_after(run_dir, first - 1, archive_dir=dest)
    reports = [r for r in pending[0] if r.step >= first]
    events = [e for e in pending[1] if e["step"] >= first]
    side = {t: [r for r in rows if r["step"] >= first] for t, rows in pending[2].items()}
    frames = row_frames(reports, events, side)
    write_parts(dest, frames, seq)
    return moved + sum(df.height for df in frames.values())


def initial_state(run_dir: Path, next_part: int, last_step: int) -> dict[str, Any]:
    """The state committed the first time the collector takes a run (over what is already there)."""
    return {
        "segment_done": 0,
        "next_part_seq": next_part,
        "hwm": {},
        "acks": {},
        "last_step": last_step,
        "ranks": {},
    }


def load_json(p: Path, default: Any) -> Any:
    """A JSON file of the collector's own, `default` when absent; RunDamaged when it is not a file
    or does not parse.
    An OS error that says nothing of the content (EMFILE, ENOSPC, EIO, ...) is raised as it is:
    the run is retried, not quarantined (errors.py, transient_errno)."""
    try:
        return json.loads(p.read_bytes())
    except FileNotFoundError:
        return default
    except (IsADirectoryError, NotADirectoryError, ValueError) as e:  # JSON and UTF-8 errors are ValueErrors
        raise RunDamaged(f"{p.parent.name}/{p.name}: unreadable ({type(e).__name__}: {str(e)[:120]})") from e


@dataclass(slots=True)
class StoredState:
    """state.json, checked (see `parse_state`)."""

    segment_done: int
    next_part: int
    hwm: dict[int, int]
    acks: dict[int, int]
    retired: dict[int, dict[int, int]]
    writers: dict[int, str]
    last_step: int
    report_gen: int
    trainer_detectors: bool
    ranks: list[tuple[int, float, float | None, int, str]]  # rank, last seen, last sent, step, phase


def parse_state(st: Any) -> StoredState:
    """state.json as the collector wrote it; RunDamaged naming the problem otherwise."""
    try:
        hwm = {_nonneg(int(k)): _nonneg(v) for k, v in st["hwm"].items()}
        return StoredState(
            segment_done=_nonneg(st["segment_done"]),
            next_part=_nonneg(st["next_part_seq"]),
            hwm=hwm,
            acks={_nonneg(int(k)): int(v) for k, v in st["acks"].items()},
            retired={
                _nonneg(int(r)): {_nonneg(int(g)): _nonneg(v) for g, v in gens.items()}
                for r, gens in st.get("retired", {}).items()
            },
            writers={_nonneg(int(r)): str(w) for r, w in st.get("writers", {}).items()},
            last_step=int(st["last_step"]),
            report_gen=int(st.get("report_gen", generation_of(hwm[0]) if 0 in hwm else -1)),
            trainer_detectors=bool(st.get("trainer_detectors", False)),
            ranks=[
                (
                    int(r),
                    float(seen),
                    sent if sent is None else float(sent),
                    int(step),
                    PHASES[PHASES.index(phase)],
                )
                for r, (seen, sent, step, phase) in st.get("ranks", {}).items()
            ],
        )
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise RunDamaged(
            f"{STATE_DIR}/{STATE_FILE}: not a state this collector wrote ({type(e).__name__}: {e})"
        ) from e


@dataclass(slots=True)
class ColdRun:
    """What the start-up scan reads of a run without loading it (meta.json and state.json)."""

    meta: dict[str, Any] | None
    beats: dict[int, list[Any]]  # rank -> [last seen, last sent, step, phase]
    last_step: int
    liveness: dict[str, Any] = field(default_factory=dict)  # learned deadlines (HealthBook.liveness_state)
    counters: dict[str, Any] = field(default_factory=dict)  # RunHealth.counter_state ({}: not kept yet)


def scan_run(run_dir: Path) -> ColdRun | None:
    """Read a run for the start-up scan: None when it must be loaded in full now (log records
    not yet checkpointed, no state yet, or a state without counters); RunDamaged for what
    loading would quarantine. The same checks as a full load, minus the Parquet scans and the
    log replay."""
    check_run_layout(run_dir)
    state_dir = run_dir / STATE_DIR
    st = load_json(state_dir / STATE_FILE, None)
    if st is None:
        return None
    st = with_liveness(st, state_dir)
    p = parse_state(st)
    if COUNTERS_KEY not in st:
        return None  # its counters are counted from the run store once (RunJournal.load)
    load_commands(state_dir / COMMANDS_FILE)
    with os.scandir(state_dir) as it:
        for e in it:
            m = WAL_RE.match(e.name)
            if m is not None and int(m.group(1)) > p.segment_done and e.stat().st_size > 0:
                return None  # batches to replay
    beats = {rank: [seen, sent, step, phase] for rank, seen, sent, step, phase in p.ranks}
    liveness, counters = st.get("liveness"), st.get(COUNTERS_KEY)
    return ColdRun(
        meta=read_meta(run_dir),
        beats=beats,
        last_step=p.last_step,
        liveness=liveness if isinstance(liveness, dict) else {},
        counters=counters if isinstance(counters, dict) else {},
    )


def stored_counters(run_dir: Path) -> dict[str, Any]:
    """The counters of a run whose state.json has none (a folder taken over, or a state written
    before they were kept), from what its run store holds: guard actions (the one definition,
    reader.count_actions) and verdicts by detector. The others count from 0 again."""
    verdicts = (
        scan_table(run_dir, schema.TABLE_EVENTS)
        .filter(pl.col("kind") == schema.EV_VERDICT)
        .group_by(pl.col("detector").fill_null("").replace("", "unknown"))
        .len()
        .collect()
    )
    return {"actions": count_actions(run_dir), "verdicts": {str(d): int(n) for d, n in verdicts.iter_rows()}}


def _nonneg(v: Any) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 0:
        raise ValueError(f"expected an integer >= 0, got {str(v)[:40]!r}")
    return v


def load_commands(p: Path) -> list[dict[str, Any]]:
    cmds = load_json(p, [])
    if not isinstance(cmds, list) or not all(
        isinstance(c, dict) and isinstance(c.get("id"), int) for c in cmds
    ):
        raise RunDamaged(f"{STATE_DIR}/{COMMANDS_FILE}: expected a list of commands with integer ids")
    return cmds


def check_run_layout(run_dir: Path) -> None:
    """Raise RunDamaged for what would make the collector fail or write over someone's data:
    a table or state path that is not a folder, a non-file named like a part, a meta.json that
    is not a JSON object. Missing pieces are fine (they are created)."""
    if run_dir.exists() and not run_dir.is_dir():
        raise RunDamaged(f"{run_dir.name} is not a folder")
    for name in (*schema.TABLES, STATE_DIR):
        p = run_dir / name
        if p.exists() and not p.is_dir():
            raise RunDamaged(f"{name} is not a folder")
    for t in schema.TABLES:
        d = run_dir / t
        if d.is_dir():
            with os.scandir(d) as it:
                for e in it:
                    if parse_part_name(e.name) is not None and not e.is_file():
                        raise RunDamaged(f"{t}/{e.name} is named like a part file but is not a regular file")
    meta = load_json(run_dir / schema.META_FILE, None)
    if meta is not None and not isinstance(meta, dict):
        raise RunDamaged(f"{schema.META_FILE}: expected a JSON object, found {type(meta).__name__}")


def restore_health(book: HealthBook, run: str, run_dir: Path, meta: dict[str, Any]) -> None:
    """Baselines and halted flag survive a collector restart (read back from the run store).
    Halted: meta.json says so, or a halt event at or after the last resume event (run stores
    written before the collector kept meta's status)."""
    book.set_halted(run, meta.get("status") == schema.STATUS_HALTED)
    try:
        # health.is_halt, as a column expression
        halt = (pl.col("kind") == schema.EV_HALT) | (
            (pl.col("kind") == schema.EV_ACTION) & (pl.col("action") == schema.ACT_HALT)
        )
        last_halt, last_resume = (
            scan_table(run_dir, schema.TABLE_EVENTS)
            .select(
                pl.col("step").filter(halt).max().alias("halt"),
                pl.col("step").filter(pl.col("kind") == schema.EV_RESUME).max().alias("resume"),
            )
            .collect()
            .row(0)
        )
        book.set_halted(
            run,
            meta.get("status") == schema.STATUS_HALTED
            or (last_halt is not None and (last_resume is None or last_halt >= last_resume)),
        )
        b = book.baseline
        steps = scan_table(run_dir, schema.TABLE_STEPS)
        last = steps.select(pl.col("step").max()).collect().item()
        if last is not None and last > b.end:
            w = (
                steps.filter(pl.col("step").is_between(b.start, b.end))
                .select(
                    pl.col("mfu").filter(pl.col("mfu").is_not_nan()).median(),
                    pl.col("tokens_per_s").filter(pl.col("tokens_per_s").is_not_nan()).median(),
                )
                .collect()
            )
            mfu, tps = w.row(0)
            if mfu is not None or tps is not None:
                book.set_baselines(run, mfu, tps)
    except Exception:
        log.exception("run %s: could not restore its health from the run store", run)
