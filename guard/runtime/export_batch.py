"""Building the exporter's batches: sequence numbers, the envelope (guard/wire/batch.py) and
size-capped chunks. The costly part, serialising reports, runs outside any lock.

`BatchAssembler.lock` is the exporter's ordering lock: whoever assigns a seq and then either
sends or spools the batch holds it across both, so once anything is spooled, everything newer
is spooled behind it (see guard/runtime/exporter.py, "Sequence numbers").
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

from guard.core.heartbeat import PHASE_TRAIN, PHASES
from guard.core.report import StepReport
from guard.runtime.export_commands import CommandInbox
from guard.wire.batch import (
    MAX_SIDE_ROWS,
    SIDE_TABLES,
    Batch,
    encode_batch,
    encode_report,
    heartbeat,
    make_seq,
)

Item = tuple[StepReport, list[dict[str, Any]]]  # one submitted step: its report and event rows
Encoded = tuple[bytes, list[dict[str, Any]], int]  # report JSON, its events, its step
ENVELOPE_BYTES = 64 << 10  # room kept in a body for everything but the reports
EVENT_BYTES = 200  # an event row's size, as counted against a body's cap


def encode_items(items: list[Item]) -> list[Encoded]:
    """Serialise reports outside any lock (the costly part of building a batch)."""
    return [(encode_report(r), evs, r.step) for r, evs in items]


def chunks(enc: list[Encoded], max_body_bytes: int) -> list[list[Encoded]]:
    """Split so that no body exceeds max_body_bytes (ENVELOPE_BYTES left for the envelope)."""
    out: list[list[Encoded]] = []
    cur: list[Encoded] = []
    size, cap = 0, max(1, max_body_bytes - ENVELOPE_BYTES)
    for e in enc:
        n = len(e[0]) + EVENT_BYTES * len(e[1])
        if cur and size + n > cap:
            out.append(cur)
            cur, size = [], 0
        cur.append(e)
        size += n
    if cur:
        out.append(cur)
    return out


class BatchAssembler:
    """Seq numbers and batch bodies for one run and rank, with what rides on the next batch:
    the run's meta (once), the phase, the last step, the commands acknowledged."""

    def __init__(
        self, run_id: str, rank: int, generation: int, trainer_detectors: bool, inbox: CommandInbox
    ) -> None:
        self.run_id, self.rank, self.generation = run_id, rank, generation
        self.trainer_detectors = trainer_detectors
        self.writer = os.urandom(8).hex()  # tells this process from another started in the same second
        self.lock = threading.Lock()  # seq order and spool order together (module docstring)
        self._inbox = inbox
        self._counter = 0
        self._meta: dict[str, Any] | None = None
        self._phase = PHASE_TRAIN
        self._phase_changed = False
        self._last_step = -1
        self.every = 0.0  # the declared interval of this rank's own beats (0: none)
        self.world = 0  # > 1 on rank 0 of a job whose guard runs per-step collectives on every rank
        self._waiting = False  # inside a collective, waiting for peers (HeartbeatPump)
        self.progress_at = time.monotonic()  # when the last step or phase change came
        self._ranks: dict[str, Any] | None = None  # rank 0: every rank's window vectors, once
        # rank 0's evals and host rows, riding on the next batch; a lock of their own: `lock` is
        # held across a send, and the training thread (an eval) must not wait on the network
        self._side_lock = threading.Lock()
        self._side: dict[str, list[dict[str, Any]]] = {t: [] for t in SIDE_TABLES}

    def set_meta(self, meta: dict[str, Any]) -> None:
        with self.lock:
            self._meta = dict(meta)

    def set_phase(self, phase: str, *, news: bool = True) -> None:
        """`news`: the change alone sends a batch; else the next batch (a step's, a beat) carries it."""
        if phase not in PHASES:
            raise ValueError(f"phase {phase!r} not one of {PHASES}")
        with self.lock:
            if phase != self._phase:
                self.progress_at = time.monotonic()
            self._phase = phase
            self._phase_changed = self._phase_changed or news

    def note_step(self, step: int) -> None:
        """This rank finished `step` (a rank that sends no reports: its beats carry it)."""
        with self.lock:
            if step > self._last_step:
                self._last_step, self.progress_at = step, time.monotonic()

    @property
    def waiting(self) -> bool:
        return self._waiting

    def set_waiting(self, waiting: bool) -> None:
        with self.lock:
            self._waiting = waiting

    def set_ranks(self, vectors: dict[str, Any]) -> None:
        with self.lock:
            self._ranks = vectors

    def add_side(self, table: str, row: dict[str, Any]) -> None:
        """A row of one of SIDE_TABLES (guard/wire/batch.py), sent with the next batch."""
        if table not in self._side:
            raise ValueError(f"table {table!r} is not one of {SIDE_TABLES}")
        with self._side_lock:
            self._side[table].append(row)

    def _take_side(self) -> dict[str, list[dict[str, Any]]]:
        with self._side_lock:
            out = {t: rows[:MAX_SIDE_ROWS] for t, rows in self._side.items() if rows}
            for t, rows in out.items():
                del self._side[t][: len(rows)]
        return out

    def take_news(self) -> bool:
        """Whether meta or a phase change waits for a batch (then one goes out even with no
        reports); the phase change counts as sent. Caller holds `lock`."""
        news = self._meta is not None or self._phase_changed or self._ranks is not None
        self._phase_changed = False
        return news

    def next_seq(self) -> int:
        """Caller holds `lock`."""
        self._counter += 1
        return make_seq(self.generation, self._counter)

    def body(
        self, chunk: list[Encoded], seq: int, final: bool = False, goodbye: dict[str, str] | None = None
    ) -> bytes:
        """The batch body for `chunk` with sequence number `seq` (`goodbye`: why the rank ends,
        on its final batch). Caller holds `lock`."""
        if chunk and (top := max(step for _, _, step in chunk)) > self._last_step:
            self._last_step, self.progress_at = top, time.monotonic()
        meta, self._meta = self._meta, None
        ranks, self._ranks = self._ranks, None
        acked = self._inbox.acknowledged
        b = Batch(
            run=self.run_id,
            rank=self.rank,
            seq=seq,
            writer=self.writer,
            events=[e for _, evs, _ in chunk for e in evs],
            final=final,
            goodbye=goodbye if final else None,
            heartbeat=heartbeat(
                time.time(),
                max(self._last_step, 0),
                self._phase,
                every=self.every,
                waiting=self._waiting,
                world=self.world if chunk else 0,  # a report's step proves the others' (wire docs)
            ),
            ranks=ranks,
            side=self._take_side(),
            meta=meta,
            trainer_detectors=self.trainer_detectors,
            # every batch: a lost heartbeat must not lose the acknowledgement
            commands_ack=acked if acked >= 0 else None,
        )
        return encode_batch(b, [rb for rb, _, _ in chunk])
