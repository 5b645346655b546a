"""The incident book on disk: a snapshot plus an append-only journal beside it, so every change
is durable before the call that made it returns, at a cost that does not grow with the book.

    path          {"version": 2, "generation": g, "incidents": {...}}, replaced atomically
    path.journal  {"generation": g}, then one line per batch of changes since snapshot g:
                  {"ops": [["put", key, incident] | ["del", key]
                           | ["sent", key, sink, status or null, error or null], ...]}

A batch is one append and one fdatasync. The journal is folded into a new snapshot (generation
g+1, then a fresh journal) at start, when the book has been idle a moment, and when it outgrows
COMPACT_FACTOR x the snapshot, so compaction costs O(1) per change amortised and a restart
replays little. A restart, even after a kill -9, rebuilds exactly what was acknowledged.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("moeguard.pager")

STATE_VERSION = 2  # 1: one JSON file rewritten on every change (still read)
# The state journal is folded into its snapshot when it outgrows COMPACT_FACTOR x the snapshot
# (and COMPACT_MIN_BYTES), or after COMPACT_IDLE_S without a change, spending at most
# 1/COMPACT_DUTY of the time compacting.
COMPACT_FACTOR = 4
COMPACT_MIN_BYTES = 1 << 20
COMPACT_IDLE_S = 1.0
COMPACT_DUTY = 20

Incidents = dict[str, dict[str, Any]]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    """`path` holds `data` or what it held before, even across a kill -9 or a power cut."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(path.parent)


def journal_path(state: Path) -> Path:
    return state.with_name(state.name + ".journal")


def apply_op(incidents: Incidents, op: list[Any]) -> None:
    """One journal operation; the live book makes its changes through here too, so a replay
    rebuilds exactly what was acknowledged."""
    kind, key = op[0], op[1]
    if kind == "put":
        incidents[key] = op[2]
    elif kind == "del":
        incidents.pop(key, None)
    elif kind == "sent":
        inc = incidents.get(key)
        if inc is None:
            return
        sink, status, error = op[2], op[3], op[4]
        if status is not None:
            inc["sent"][sink] = status
            inc["errors"].pop(sink, None)
        else:
            inc["errors"][sink] = error
    else:
        raise ValueError(f"unknown journal operation {kind!r}")


def read_state(state: Path) -> tuple[int, Incidents]:
    """(generation, incidents) as acknowledged: the snapshot, then its journal's batches.

    A torn last line (a kill -9 inside the append) was never acknowledged and is skipped. A
    journal of an older generation is left over from a compaction cut short: the snapshot
    already holds it. Raises ValueError on anything else that does not add up."""
    generation, incidents = 0, {}
    if state.exists():
        data = json.loads(state.read_bytes())
        version = data.get("version") if isinstance(data, dict) else None
        if version not in (1, STATE_VERSION):
            raise ValueError(f"state file {state} has version {version!r}, expected {STATE_VERSION}")
        generation, incidents = data.get("generation", 0), data.get("incidents")
        if not isinstance(generation, int) or not isinstance(incidents, dict):
            raise ValueError(f"state file {state} has no generation number or no incidents object")
    journal = journal_path(state)
    if not journal.exists():
        return generation, incidents
    lines = journal.read_bytes().split(b"\n")  # complete lines end with "\n": the last item is b""
    header = json.loads(lines[0])  # written whole (atomically) by the compaction that made it
    journal_generation = header.get("generation") if isinstance(header, dict) else None
    if not isinstance(journal_generation, int):
        raise ValueError(f"journal {journal} has no generation in its first line")
    if journal_generation < generation:
        return generation, incidents
    if journal_generation != generation:
        raise ValueError(
            f"journal {journal} is generation {journal_generation} but {state} is generation "
            f"{generation}: was the state file replaced by hand?"
        )
    for n, line in enumerate(lines[1:-1], start=2):
        try:
            for op in json.loads(line)["ops"]:
                apply_op(incidents, op)
        except (ValueError, LookupError, TypeError, AttributeError) as e:
            raise ValueError(f"journal {journal} line {n} is damaged: {e!r}") from None
    if lines[-1]:
        log.warning(
            "state journal %s: ignored a torn last line (%d bytes, never acknowledged)",
            journal,
            len(lines[-1]),
        )
    return generation, incidents


class StateFile:
    """The snapshot and journal of one book. Not thread-safe: the book calls it under its lock
    and hands it the live incidents, which only the book changes (through apply_op)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._generation = 0
        self._journal: Any = None  # binary append handle
        self._journal_bytes = self._snapshot_bytes = 0
        self._dirty = False  # the journal has batches the snapshot lacks
        self._changed_at = self._compacted_at = time.monotonic()
        self._compact_s = 0.0

    def load(self) -> Incidents:
        """The book as acknowledged; then compact() it so the old journal can go. Raises
        OSError or ValueError (see read_state)."""
        self._generation, incidents = read_state(self.path)
        return incidents

    def append(self, ops: list[list[Any]], incidents: Incidents) -> None:
        """Append one batch and fdatasync it; compact when the journal has grown too long."""
        if not ops:
            return
        if self._journal is None:  # a compaction failed half-way: a whole snapshot holds this batch too
            self.compact(incidents)
            return
        line = json.dumps({"ops": ops}, separators=(",", ":"), default=str).encode() + b"\n"
        try:
            self._journal.write(line)
            self._journal.flush()
            os.fdatasync(self._journal.fileno())
        except OSError:
            # Cut a partial line off: batches appended after it would read as damage.
            with contextlib.suppress(OSError):
                self._journal.truncate(self._journal_bytes)
            raise
        self._journal_bytes += len(line)
        self._dirty, self._changed_at = True, time.monotonic()
        if self._journal_bytes > max(COMPACT_MIN_BYTES, COMPACT_FACTOR * self._snapshot_bytes):
            try:
                self.compact(incidents)
            except OSError as e:  # this batch is durable in the journal already
                log.error("state %s: compaction failed, will retry: %s", self.path, e)

    def compact_if_idle(self, incidents: Incidents, idle_s: float = COMPACT_IDLE_S) -> bool:
        """Fold the journal into the snapshot once nothing changed for `idle_s`, at most
        1/COMPACT_DUTY of the time, so `path` alone is the current book for whoever reads it."""
        now = time.monotonic()
        if (
            not self._dirty
            or now - self._changed_at < idle_s
            or now - self._compacted_at < COMPACT_DUTY * self._compact_s
        ):
            return False
        self.compact(incidents)
        return True

    def checkpoint(self, incidents: Incidents) -> None:
        """Fold the journal into the snapshot now (a clean stop leaves one current file)."""
        if self._dirty:
            self.compact(incidents)

    def compact(self, incidents: Incidents) -> None:
        """Snapshot g+1, then a fresh journal for g+1. A crash between the two leaves journal g
        beside snapshot g+1, which the next start ignores (the snapshot holds all of it)."""
        t0 = time.monotonic()
        generation = self._generation + 1
        data = json.dumps(
            {"version": STATE_VERSION, "generation": generation, "incidents": incidents},
            sort_keys=True,
            default=str,
        ).encode()
        _write_atomic(self.path, data)
        # From here journal g no longer counts: nothing may be appended to it.
        self._generation, self._snapshot_bytes = generation, len(data)
        if self._journal is not None:
            self._journal.close()
            self._journal = None
        header = json.dumps({"generation": generation}).encode() + b"\n"
        _write_atomic(journal_path(self.path), header)
        self._journal = open(journal_path(self.path), "ab")  # noqa: SIM115 (kept open for appends)
        self._journal_bytes = len(header)
        self._dirty = False
        self._compacted_at = time.monotonic()
        self._compact_s = self._compacted_at - t0
