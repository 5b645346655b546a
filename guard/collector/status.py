"""A run's status as the collector keeps it in meta.json: running, halted (a halt event latched
it), running again (a resume, or a new trainer generation that trains again), and on rank 0's
final batch what its goodbye says (finished, preempted, interrupted, ...: the job's own meta.json
status; finished from an exporter that says no goodbye). A goodbye of peer_lost from ANY rank
ends the run as peer_lost (a rank died; the survivor that says so may be rank 1 when rank 0 is
the dead one), and a later goodbye of rank 0 does not turn it back into a clean stop.

Liveness at the end (issue #37): only a rank's own final batch stops the collector watching it.
A run that ends (rank 0 says goodbye) keeps watching every rank that has not, so a rank killed
-9 while torchrun SIGTERMs its peers is still paged HeartbeatLost by name; only a halt stops
watching every rank (RunHalted pages it). Pure functions; RunState applies them."""

from __future__ import annotations

import time
from typing import Any

from guard.core import schema
from guard.core.events import Event
from guard.wire.batch import Batch

ENDED = schema.ENDED_STATUSES


def goodbye_status(b: Batch) -> str | None:
    """What a final batch says the rank ended as (None: not a final batch, or no goodbye)."""
    return (b.goodbye or {}).get("status") if b.final else None


def next_status(status: str | None, b: Batch, *, halted: bool, was_halted: bool, resumed: bool) -> str | None:
    """The status after batch `b`: halted while the latch is set, running again once it is
    released (or a resumed trainer trains again); on a final batch what its goodbye says (above)."""
    if halted:
        return schema.STATUS_HALTED
    if was_halted or (resumed and status in ENDED):
        status = schema.STATUS_RUNNING
    if b.final:
        bye = goodbye_status(b)
        if bye == schema.STATUS_PEER_LOST:
            status = bye
        elif b.rank == 0 and status != schema.STATUS_PEER_LOST:
            status = bye or schema.STATUS_FINISHED
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
