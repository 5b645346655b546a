"""Trainer side of the collector link: ship StepReports and events without ever stalling a step.

    exp = Exporter(url, token, run_id, rank, spool_dir, ExporterConfig(poll_s=2.0))
    exp.submit(report, events)          # every step: an in-memory put, never a network call
    for cmd in exp.poll_commands(): ... # operator commands, fetched in the background
    exp.close(timeout=30)               # drain, then a "final" batch; the rest stays spooled

One background thread owns the network. It takes what has queued up (at most `batch_max`
steps), gives the batch the next sequence number and POSTs it to /v1/ingest. When the collector
does not answer 200, the batch goes to the spool (one JSON file per batch, written to a temp
name, fsynced, renamed) and every later batch queues behind it on disk; the thread retries the
oldest spooled batch with exponential backoff and replays the spool in order once the collector
answers. A full queue spills the step straight to the spool from `submit` (disk, not network;
never dropped). Spooled files outlive the process: a restarted trainer replays them first.
A 409 means another writer generation owns the run id on the collector (a second trainer with
the same run id, or a newer process of this one): the batch is set aside in spool_dir/conflict/,
counted in stats["conflict"] as not delivered (flush() and close() return False), and the
refusal is logged at ERROR once per run.

The batch format (encoding, seq and generations) is guard/wire/batch.py, shared with the collector.
The pieces, one job each: export_queue.py (the bounded queue), export_batch.py (seqs and batch
bodies), export_spool.py (the spool), export_link.py (HTTP and what each answer means),
export_sender.py (the thread: sending, retries, heartbeats, the command poll),
export_commands.py (operator commands) and export_config.py (ExporterConfig). This module wires
them and is the trainer's interface.

Sequence numbers. The collector dedupes by (run, rank, seq) with a high-water mark, so a batch
must never be sent after a batch with a larger seq was accepted, and a retried batch keeps its
seq. seq = generation << 32 | counter: `generation` is this exporter's start time in whole
seconds, raised above the last one recorded in the spool dir, so a restarted trainer counts up
from where the previous process stopped even if its spool dir was lost. Why not derive seq from
the step: after a crash and resume the trainer re-runs steps with NEW data (different batches,
different weights); step-derived seqs would be dropped as duplicates. A new generation whose
first step is not past the stored ones tells the collector to move the stale rows aside.
Ordering is kept by assigning seqs under one lock and sending in seq order: once anything is
spooled, everything newer is spooled behind it. Each batch also carries `writer`, a random id of
this Exporter, so two processes that start in the same second (one generation) are told apart.

The end of a run. close() sends one last, empty batch with `"final": true` (after everything
else, so it has the highest seq): the collector stops expecting heartbeats from this rank, so a
run that ended on purpose (finished, halted, stopped at --until) never pages HeartbeatLost. A
close() that runs while an exception propagates (the trainer's `finally` after a crash) sends no
final, so the silence of a crashed run still pages; `close(final=...)` overrides the guess.

Operator commands come back in ingest answers and from a GET every `poll_s`; each command is
returned by `poll_commands()` once, and the highest id taken is acknowledged in the next batch
(`commands_ack`). A multi-rank trainer should act on rank 0's commands and broadcast them.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from guard.core.events import Event
from guard.core.report import StepReport
from guard.runtime.export_batch import BatchAssembler, chunks, encode_items
from guard.runtime.export_commands import CommandInbox
from guard.runtime.export_config import ExporterConfig
from guard.runtime.export_link import KEEPALIVE_S, CollectorLink
from guard.runtime.export_queue import StepQueue
from guard.runtime.export_sender import Sender
from guard.runtime.export_spool import Spool
from guard.wire.batch import MAX_BEAT_EVERY_S


class Exporter:
    def __init__(
        self,
        url: str,
        token: str | None,
        run_id: str,
        rank: int,
        spool_dir: str | Path,
        config: ExporterConfig | None = None,
    ) -> None:
        """Ship run `run_id`, rank `rank` to the collector at `url` (bearer `token`), spooling
        what it cannot send yet in `spool_dir`. Starts the sender thread."""
        self.cfg = cfg = config if config is not None else ExporterConfig()
        self.run_id, self.rank = run_id, rank
        # counters: sent, spooled, replayed, rejected (400/413), spilled (queue full), conflict
        # (409: another writer generation owns the run, not delivered), unauthorized (401/403)
        self.stats = {"sent": 0, "spooled": 0, "replayed": 0, "rejected": 0, "spilled": 0, "conflict": 0}
        self._spool = Spool(spool_dir, f"{run_id}-r{rank}-", self.stats)
        self._inbox = CommandInbox()
        self._batches = BatchAssembler(
            run_id, rank, self._spool.next_generation(), cfg.trainer_detectors, self._inbox
        )
        self._batches.every = cfg.heartbeat_s if cfg.heartbeat_s <= MAX_BEAT_EVERY_S else 0.0
        self._batches.world = cfg.world if rank == 0 else 0
        self._link = CollectorLink(url, token, run_id, rank, cfg.timeout_s, self._spool, self._inbox)
        self._link.close_each = rank > 0 and cfg.world > 1 and cfg.heartbeat_s >= KEEPALIVE_S
        self._steps = StepQueue(cfg.max_queue)
        self._sender = Sender(self._steps, self._batches, self._spool, self._link, cfg)
        self._sender.start()

    @property
    def generation(self) -> int:
        """This process's writer generation (the high 32 bits of its seqs)."""
        return self._batches.generation

    @property
    def spooled(self) -> int:
        """Batches waiting on disk."""
        return len(self._spool)

    # ---- step path: never blocks on the network --------------------------------------
    def submit(self, report: StepReport, events: Iterable[Event | dict[str, Any]] = ()) -> None:
        """Queue one step (the report must not be mutated afterwards). Never waits on the network;
        when the queue is full it writes one step to the spool (a local file)."""
        item = (report, [e.row() if isinstance(e, Event) else dict(e) for e in events])
        if self._steps.put(item):
            return
        # The sender is behind (collector slow or down): spill the OLDEST queued step to disk and
        # queue this one, so the spool keeps submission order (guard/runtime/export_queue.py).
        # A loop only in case another thread's submit took the freed slot first.
        spilled = 0
        with self._batches.lock:
            while not self._steps.put(item):
                oldest = self._steps.evict_oldest()
                if oldest is None:
                    continue  # the sender emptied it before this lock was taken: the put succeeds
                self._spool_locked(encode_items([oldest]))
                spilled += 1
            self.stats["spilled"] += spilled
        if spilled:
            self._steps.handled(spilled)

    def add_side(self, table: str, row: dict[str, Any]) -> None:
        """A row of rank 0's `evals` or `host` table (guard/wire/batch.py SIDE_TABLES): it rides
        on the next batch (a step's, a beat, the final one). Never waits on the network."""
        self._batches.add_side(table, row)

    def _spool_locked(self, chunk: list) -> None:
        """One batch of encoded steps to the spool with the next seq (the caller holds the seq lock)."""
        seq = self._batches.next_seq()
        self._spool.write(seq, self._batches.body(chunk, seq))

    def set_meta(self, meta: dict[str, Any]) -> None:
        """Send the run's meta with the next batch (status changes included)."""
        self._batches.set_meta(meta)
        self._steps.wake()

    def set_phase(self, phase: str, *, beat: bool = True) -> None:
        """train | data | checkpoint | eval: a heartbeat goes out now, so the collector knows why it
        may not hear from this rank for a while (checkpoint intervals do not teach timeouts).
        `beat=False`: no batch of its own; the next one (a step's report, a timed beat) carries
        the phase (the data phase flips twice a step: a beat each would double the requests)."""
        self._batches.set_phase(phase, news=beat)
        if beat:
            self._steps.wake()

    def note_step(self, step: int) -> None:
        """A rank that sends no per-step report finished `step`: its next beat says so (no batch now)."""
        self._batches.note_step(step)

    def set_waiting(self, waiting: bool) -> None:
        """Whether this rank is waiting inside a collective for its peers (its beats say so)."""
        self._batches.set_waiting(waiting)

    def set_ranks(self, vectors: dict[str, Any]) -> None:
        """Rank 0: every rank's window timing (guard/wire/batch.py `ranks`), on the next batch."""
        self._batches.set_ranks(vectors)

    def poll_commands(self) -> list[dict[str, Any]]:
        """Operator commands that arrived since the last call (no network call)."""
        return self._inbox.take()

    # ---- the end ------------------------------------------------------------------------
    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until everything submitted is handled: True when it was all acknowledged, False
        when `timeout` passed or the collector refused batches with 409 (export_link.py)."""
        deadline = time.monotonic() + timeout
        while True:
            if self._steps.all_handled and not len(self._spool):
                return not self._link.conflicted
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    def close(
        self, timeout: float = 30.0, final: bool | None = None, goodbye: dict[str, str] | None = None
    ) -> bool:
        """Drain and stop. True when everything reached the collector; otherwise the rest is
        on disk in the spool and a later Exporter for the same run and rank sends it.
        `final`: end with a final batch (this rank stopped on purpose); None = unless an
        exception is propagating (close() called from a `finally` during a crash). `goodbye`:
        why the rank ends, carried by the final batch (guard/wire/batch.py `goodbye`)."""
        if final is None:
            final = sys.exc_info()[0] is None
        ok = self.flush(timeout)
        self._sender.stop(timeout=max(1.0, timeout / 4))
        # anything still queued (collector down) is written to the spool, never lost
        leftover = self._steps.drain()
        for chunk in chunks(encode_items(leftover), self.cfg.max_body_bytes):
            with self._batches.lock:
                self._spool_locked(chunk)
        if final:
            ok = self._send_final(goodbye) and ok
        self._link.close()
        return ok and not leftover and not self._link.conflicted

    def _send_final(self, goodbye: dict[str, str] | None = None) -> bool:
        """The final batch, last in seq order: POSTed when nothing is spooled and the sender has
        stopped (a batch still in flight must not land after it), else spooled behind the rest."""
        with self._batches.lock:
            seq = self._batches.next_seq()
            body = self._batches.body([], seq, final=True, goodbye=goodbye)
            if len(self._spool) or self._sender.is_alive():
                self._spool.write(seq, body)
                return False
        if self._link.post(body, heartbeat_only=True):
            return True
        with self._batches.lock:
            self._spool.write(seq, body)
        return False
