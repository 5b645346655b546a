"""A run's meta.json in the collector: the document as it is, or is about to be, on disk, and the
status this collector last set in it (status.py's rules decide which).

meta.json is derived state: changed in memory under the run's lock while a batch is applied,
written after that batch is logged, and if that write fails, again before the next checkpoint
lets go of the log (RunState in run.py does both).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from guard.collector.status import goodbye_status, minimal_meta, next_status
from guard.collector.storage import write_meta
from guard.core import schema
from guard.store.reader import read_meta
from guard.wire.batch import Batch


class RunMeta:
    def __init__(self, run: str, run_dir: Path) -> None:
        self.run, self.dir = run, run_dir
        self.doc: dict[str, Any] | None = None  # meta.json as it is (or is about to be) on disk
        self.status: str | None = None  # the run's status in it, as this collector last set it
        self.dirty = False  # `doc` differs from the file

    def load(self) -> None:
        """From the file (a JSON object or None: check_run_layout refused anything else)."""
        self.doc = read_meta(self.dir)
        self.status = (self.doc or {}).get("status")

    def merge(self, sent: dict[str, Any]) -> dict[str, Any]:
        """The meta a trainer sent, over what the run has; returns the new document."""
        meta = {
            **(self.doc or {}),
            **sent,
            "schema_version": schema.SCHEMA_VERSION,
            "updated_at": time.time(),
        }
        meta.setdefault("run_id", self.run)
        sent_status = meta.get("status")
        if self.status == schema.STATUS_PEER_LOST != sent_status and sent_status in schema.ENDED_STATUSES:
            # a peer said a rank died: rank 0's own later "preempted" does not make it a clean stop
            meta["status"], meta["status_note"] = self.status, (self.doc or {}).get("status_note", "")
        self._set(meta)
        self.status = meta.get("status", self.status)
        return meta

    def ensure(self) -> None:
        """A run that sends reports but never sent meta still gets one, running."""
        if self.doc is None:
            self._set(minimal_meta(self.run))
            self.status = schema.STATUS_RUNNING

    def advance(self, b: Batch, *, halted: bool, was_halted: bool, resumed: bool) -> str | None:
        """The status after batch `b` (status.py's rules); the document changes only when the
        status does."""
        status = next_status(self.status, b, halted=halted, was_halted=was_halted, resumed=resumed)
        if status != self.status and status is not None:
            doc = {**(self.doc or minimal_meta(self.run)), "status": status, "updated_at": time.time()}
            if status == goodbye_status(b):  # the goodbye says why, in the rank's words
                note = (b.goodbye or {}).get("note", "")
                doc["status_note"] = note if b.rank == 0 else f"rank {b.rank}: {note}"
            self._set(doc)
            self.status = status
        return status

    def _set(self, meta: dict[str, Any]) -> None:
        self.doc, self.dirty = meta, True

    def write(self) -> None:
        """Write meta.json from memory. Caller holds the run's lock."""
        if self.doc is not None:
            write_meta(self.dir, self.doc)
        self.dirty = False
