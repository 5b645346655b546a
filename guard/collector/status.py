"""A run's status as the collector keeps it in meta.json: running, halted (a halt event latched
it), running again (a resume, or a new trainer generation that trains again), finished (rank
0's final batch). Pure functions; RunState applies them."""

from __future__ import annotations

import time
from typing import Any

from guard.core import schema
from guard.core.events import Event
from guard.wire.batch import Batch

ENDED = (schema.STATUS_FINISHED, schema.STATUS_HALTED)


def next_status(status: str | None, b: Batch, *, halted: bool, was_halted: bool, resumed: bool) -> str | None:
    """The status after batch `b`: halted while the latch is set, running again once it is
    released (or a resumed trainer trains again), finished on rank 0's final batch."""
    if halted:
        status = schema.STATUS_HALTED
    elif was_halted or (resumed and status in ENDED):
        status = schema.STATUS_RUNNING
    if b.final and b.rank == 0 and not halted:
        status = schema.STATUS_FINISHED
    return status


def resume_event(b: Batch) -> list[dict[str, Any]]:
    """The resume event the collector records for a halted run that trains again, unless the
    batch carries the trainer's own."""
    if any(e["kind"] == schema.EV_RESUME for e in b.events):
        return []
    first = min(b.reports, key=lambda r: r.step)
    ev = Event(
        step=first.step,
        kind=schema.EV_RESUME,
        detail={"source": "collector", "after": schema.STATUS_HALTED, "generation": b.generation},
    )
    ev.time = first.time
    return [ev.row()]


def minimal_meta(run: str) -> dict[str, Any]:
    """meta.json for a run the collector hears of before its trainer sent any meta."""
    return {
        "run_id": run,
        "status": schema.STATUS_RUNNING,
        "source": "collector",
        "schema_version": schema.SCHEMA_VERSION,
        "updated_at": time.time(),
    }
