"""Where a run's rows, events and meta.json go, for every loop (moeguard's trainer and GuardedStep):
the run store on rank 0 and the exporter on every rank (both write from background threads and
never block a step), and the end-of-run summary the user reads.

A non-zero rank has no run store and, in a multi-rank job, sends no per-step report (issue #30:
the collector's per-step work must not grow with the rank count): its timing reaches rank 0
inside the job (guard/runtime/ranks.py: the straggler window's gather) and leaves in rank 0's
batch as per-rank vectors; its exporter only beats, carrying its last step and phase.

Only when rank 0 died does another rank write meta.json: a survivor ending `peer_lost` that finds
rank 0 gone (guard/runtime/goodbye.py rank0_gone) and sees the run's folder (a shared
filesystem) records `peer_lost` there, naming rank 0, in the words its goodbye gives the
collector; a status rank 0 already wrote is left as it is.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from guard.core import actions, schema
from guard.core.events import Event
from guard.core.heartbeat import PHASE_CHECKPOINT, PHASE_TRAIN
from guard.core.report import StepReport
from guard.runtime import host
from guard.runtime.goodbye import default_store, rank0_gone, say_ending
from guard.store.layout import atomic_write_json
from guard.store.reader import read_meta, scan_table
from guard.store.runstore import RunStore
from guard.store.writer import truncate_after
from guard.wire.batch import goodbye


class RunRecord:
    def __init__(self, run_dir: Path, store: RunStore | None, exporter: Any, *, rank: int) -> None:
        self.run_dir = run_dir
        self.store = store  # rank 0 only
        self.exporter = exporter  # any rank, or None
        self.rank = rank
        # rank 0's host utilisation beside its steps, sampled off the training thread (host.py),
        # to the run store and, like evaluations, to the collector (its copy has them too)
        self.host = host.start(self._host_row) if store is not None else None

    def _host_row(self, row: dict[str, Any]) -> None:
        """A host sample (the sampler's thread): to the run store and the exporter."""
        if self.store is not None:
            self.store.add_host_row(row)
        if self.exporter is not None:
            self.exporter.add_side(schema.TABLE_HOST, row)

    def evals(self, step: int, time_s: float, metrics: dict[str, float]) -> None:
        """Evaluation metrics measured after `step` (rank 0): to the run store's `evals` table and
        the exporter (guard/wire/batch.py `evals`), one row per metric."""
        if self.store is None or not metrics:
            return
        self.store.add_evals(step, time_s, metrics)
        if self.exporter is not None:
            for name, value in metrics.items():
                self.exporter.add_side(
                    schema.TABLE_EVALS, {"step": step, "time": time_s, "name": name, "value": value}
                )

    def started(self, meta: dict[str, Any], *, restarted: bool) -> None:
        """A new run: meta.json says running (a torchrun restart before the first checkpoint starts clean)."""
        if self.store is None:
            return
        if restarted:
            truncate_after(self.run_dir, -1)
        self.store.write_meta(meta)

    def resumed(
        self,
        step: int,
        checkpoint: Path,
        env: dict[str, Any],
        fresh_meta: Callable[[], dict[str, Any]],
        **detail: Any,
    ) -> None:
        """Rows after the checkpoint's step are dropped (they will be written again), meta.json counts
        the restart, and a resume event says from where (`fresh_meta()`: when meta.json is missing)."""
        if self.store is None:
            return
        dropped = truncate_after(self.run_dir, step - 1)
        meta = read_meta(self.run_dir) or fresh_meta()
        restarts = int(meta.get("restarts", 0)) + 1
        self.store.write_meta({**meta, "status": schema.STATUS_RUNNING, "restarts": restarts, "env": env})
        self.store.add_event(
            Event(
                step=step,
                kind=schema.EV_RESUME,
                detail={
                    "checkpoint": checkpoint.name,
                    "rows_dropped": dropped,
                    "restarts": restarts,
                    **detail,
                },
            )
        )

    def announce(self, fresh_meta: Callable[[], dict[str, Any]]) -> None:
        """The exporter learns the run's meta (rank 0; `fresh_meta()` when meta.json is missing)."""
        if self.exporter is not None and self.rank == 0:
            self.exporter.set_meta(read_meta(self.run_dir) or fresh_meta())

    def step(self, rep: StepReport, events: list[Event], ranks: dict[str, Any] | None = None) -> None:
        """One step: rank 0's report (and `ranks`, every rank's window timing, when a straggler
        window ended) to the store and the exporter; another rank's exporter learns its step."""
        if self.store is not None:
            self.store.add_step(rep)
            if self.host is not None:
                self.host.note_step(rep.step)
            for ev in events:
                self.store.add_event(ev)
        if self.exporter is None:
            return
        if self.rank == 0:
            if ranks is not None:
                self.exporter.set_ranks(ranks)
            self.exporter.submit(rep, events)
            return
        self.exporter.note_step(rep.step)

    # ---- around a checkpoint ------------------------------------------------------------------
    def checkpoint_starts(self) -> None:
        if self.exporter is not None:
            self.exporter.set_phase(PHASE_CHECKPOINT)  # a long save must not look like a hang
        if self.store is not None:  # every row before the checkpoint is on disk before it exists
            self.store.flush(wait=True)

    def checkpoint_saved(self, step: int, path: Path, goodput: Callable[[], dict[str, float]]) -> None:
        if self.exporter is not None:
            self.exporter.set_phase(PHASE_TRAIN)
        if self.store is not None:
            self.store.add_event(Event(step=step, kind=schema.EV_CHECKPOINT, detail={"path": path.name}))
            if self.exporter is not None:
                self.exporter.set_meta({**(read_meta(self.run_dir) or {}), "goodput": goodput()})

    # ---- the end ------------------------------------------------------------------------------
    def finish(self, status: str, note: str, **fields: Any) -> None:
        """meta.json gets how the run ended and its final figures; the exporter sends its last batch."""
        if self.store is not None:
            # a survivor that sees this leaves meta.json to rank 0 (_for_lost_rank0)
            say_ending(self.rank, default_store())
            fields["restarts"] = (read_meta(self.run_dir) or {}).get("restarts", 0)
            if self.host is not None:
                self.host.close()  # its last sample goes into the store's final flush
                self.host = None
            try:
                self.store.close(status=status, status_note=note, **fields)
            except RuntimeError as e:
                # polars answers Ctrl-C with a KeyboardInterrupt in whichever thread runs its query,
                # so the run store's writer can lose the chunk it was writing. Say so, and still
                # record how the run ended (the writer reported its error once and carries on).
                if not isinstance(e.__cause__, KeyboardInterrupt):
                    raise
                note += "; Ctrl-C also interrupted the run store's writer: one chunk of rows may be missing"
                self.store.close(status=status, status_note=note.lstrip("; "), **fields)
            if self.exporter is not None:
                self.exporter.set_meta(read_meta(self.run_dir) or {})
        elif self.rank != 0 and status == schema.STATUS_PEER_LOST:
            note = self._for_lost_rank0(note)
        if self.exporter is not None:
            # A crash sends no final batch, so its silence pages; any other ending says goodbye
            # with why (a rank killed -9 says none, and is paged lost whatever its peers say).
            bye = status != schema.STATUS_CRASHED
            self.exporter.close(timeout=30, final=bye, goodbye=goodbye(status, note) if bye else None)

    def _for_lost_rank0(self, note: str) -> str:
        """A survivor's peer_lost: when rank 0 is the rank that is gone, the note names it and the
        job's meta.json (where this rank sees it) says peer_lost, as the collector's will."""
        meta = read_meta(self.run_dir)
        visible = meta is not None and meta.get("run_id") == self.run_dir.name
        store = default_store()
        if store is None or (not visible and self.exporter is None):
            return note
        if not rank0_gone(store, recorded=lambda: visible and _ended(self.run_dir)):
            return note
        note = f"rank 0 is gone (no goodbye, no ending of its own: killed, or its host lost); {note}"[:500]
        if visible:
            record_for_rank0(self.run_dir, self.rank, schema.STATUS_PEER_LOST, note)
        return note


def _ended(run_dir: Path) -> bool:
    return (read_meta(run_dir) or {}).get("status") in schema.ENDED_STATUSES


def record_for_rank0(run_dir: Path, rank: int, status: str, note: str) -> bool:
    """Rank `rank` writes how the run ended into meta.json for a dead rank 0 (write-rename, so a
    reader sees the old document or the new one); False when meta.json is missing or already says
    the run ended (rank 0's own word stands). The note reads as the collector's copy does."""
    meta = read_meta(run_dir)
    if meta is None or meta.get("status") in schema.ENDED_STATUSES:
        return False
    meta.update(
        status=status,
        status_note=f"rank {rank}: {note}",
        status_by_rank=rank,
        updated_at=time.time(),
    )
    atomic_write_json(run_dir / schema.META_FILE, meta)
    return True


def verdict_summary(run_dir: Any) -> str:
    """'warnings: 5 verdicts the guard recorded without acting (throughput_drop 5); ...' from the
    run's events table, or "" when every verdict led to an action (or there were none)."""
    import polars as pl

    ev = (
        scan_table(run_dir, schema.TABLE_EVENTS)
        .filter((pl.col("kind") == schema.EV_VERDICT) & (pl.col("action") == schema.ACT_NONE))
        .group_by("detector")
        .len()
        .sort("len", descending=True)
        .collect()
    )
    if not ev.height:
        return ""
    n = int(ev["len"].sum())
    by = ", ".join(f"{d} {k}" for d, k in ev.iter_rows())
    return (
        f"warnings: {n} verdict(s) the guard recorded without acting ({by}); "
        "the events table in the app and `moeguard replay` show each one"
    )


def summary_lines(
    run_dir: Path,
    *,
    steps: int,
    counts: Mapping[str, int],
    guard_actions: Mapping[str, int],
    goodput: float | None,
) -> list[str]:
    """The end-of-run summary, the same for `moeguard train` and every integration."""
    gp = f"; goodput {goodput:.1%} (productive step time / wall time)" if goodput is not None else ""
    out = [
        f"run {run_dir.name}: {steps} steps, {sum(counts.get(a, 0) for a in schema.APPLYING_ACTIONS)} updates applied; "
        f"guard actions: {actions.summary_text(guard_actions)}{gp}"
    ]
    meta = read_meta(run_dir) or {}
    if meta.get("status") not in (None, schema.STATUS_FINISHED):
        out.append(
            f"status {meta.get('status')}" + (f": {meta['status_note']}" if meta.get("status_note") else "")
        )
    if warned := verdict_summary(run_dir):
        out.append(warned)
    out.append(f"run store: {run_dir}  (open it with: moeguard app --runs {run_dir.parent})")
    return out
