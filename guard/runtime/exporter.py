"""Trainer side of the collector link: ship StepReports and events without ever stalling a step.

    exp = Exporter(url, token, run_id, rank, spool_dir)
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

import bisect
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import httpx

from guard.core.events import Event
from guard.core.heartbeat import PHASE_TRAIN, PHASES
from guard.core.report import StepReport
from guard.wire.batch import Batch, encode_batch, encode_report, heartbeat, make_seq
from guard.wire.retry import Backoff, RetryPolicy

log = logging.getLogger("moeguard.exporter")

_STOP = object()
_Encoded = tuple[bytes, list[dict[str, Any]], int]  # report JSON, its events, its step


class Exporter:
    def __init__(
        self,
        url: str,
        token: str | None,
        run_id: str,
        rank: int,
        spool_dir: str | Path,
        *,
        max_queue: int = 1024,
        batch_max: int = 32,
        max_body_bytes: int = 8 << 20,
        timeout_s: float = 10.0,
        poll_s: float = 5.0,
        heartbeat_s: float = 10.0,
        backoff_max_s: float = 30.0,
        trainer_detectors: bool = False,
    ) -> None:
        """`trainer_detectors`: this trainer runs the DetectorSuite itself (guard on, or observing),
        so the collector skips its own detectors for the run."""
        self.url = url.rstrip("/")
        self.run_id, self.rank = run_id, rank
        self.spool_dir = Path(spool_dir)
        self.spool_dir.mkdir(parents=True, exist_ok=True)
        self.batch_max, self.max_body_bytes = batch_max, max_body_bytes
        self.trainer_detectors = trainer_detectors
        self.poll_s, self.heartbeat_s, self.backoff_max_s = poll_s, heartbeat_s, backoff_max_s
        headers = {"content-type": "application/json"}
        if token:
            headers["authorization"] = f"Bearer {token}"
        self._client = httpx.Client(
            headers=headers, timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 3.0))
        )
        self._q: queue.Queue[Any] = queue.Queue(maxsize=max_queue)
        self._prefix = f"{run_id}-r{rank}-"
        # seq and spool order: `_lock` covers seq assignment and the spool index together
        self._lock = threading.Lock()
        self.generation = self._next_generation()
        self.writer = os.urandom(8).hex()  # tells this process from another started in the same second
        self._counter = 0
        self._spool: list[Path] = sorted(self.spool_dir.glob(f"{self._prefix}*.json"))
        self._meta: dict[str, Any] | None = None
        self._phase = PHASE_TRAIN
        self._phase_changed = False
        self._last_step = -1
        self._commands: list[dict[str, Any]] = []
        self._seen_cmd = -1  # highest command id handed to poll_commands' caller
        self._queued_cmd = -1  # highest command id fetched
        self._count_lock = threading.Lock()  # only ever held for an increment
        self._submitted = 0  # steps handed to submit()
        self._processed = 0  # ... of which acknowledged or spooled
        # conflict: batches the collector refused with 409 (another writer generation owns the run)
        self.stats = {"sent": 0, "spooled": 0, "replayed": 0, "rejected": 0, "spilled": 0, "conflict": 0}
        self._conflicted = False  # a 409 was answered: not everything was delivered
        self._conflict_logged = False
        self._thread = threading.Thread(target=self._loop, name=f"moeguard-exporter-r{rank}", daemon=True)
        self._closing = False
        self._thread.start()

    # ---- step path: never blocks on the network --------------------------------------
    def submit(self, report: StepReport, events: Iterable[Event | dict[str, Any]] = ()) -> None:
        """Queue one step (the report must not be mutated afterwards). Never blocks."""
        item = (report, [e.row() if isinstance(e, Event) else dict(e) for e in events])
        with self._count_lock:
            self._submitted += 1
        try:
            self._q.put_nowait(item)
        except queue.Full:
            # The sender is behind (collector slow or down): spill to disk rather than drop.
            enc = self._encode_items([item])
            with self._lock:
                seq = self._next_seq()
                self._spool_write(seq, self._body(enc, seq))
                self.stats["spilled"] += 1
            with self._count_lock:
                self._processed += 1

    def set_meta(self, meta: dict[str, Any]) -> None:
        """Send the run's meta with the next batch (status changes included)."""
        with self._lock:
            self._meta = dict(meta)
        self._wake()

    def set_phase(self, phase: str) -> None:
        """train | checkpoint | eval: a heartbeat goes out now, so the collector knows why it
        may not hear from this rank for a while (checkpoint intervals do not teach timeouts)."""
        if phase not in PHASES:
            raise ValueError(f"phase {phase!r} not one of {PHASES}")
        with self._lock:
            self._phase, self._phase_changed = phase, True
        self._wake()

    def _wake(self) -> None:
        try:
            self._q.put_nowait(None)
        except queue.Full:
            pass  # the sender is busy anyway

    def poll_commands(self) -> list[dict[str, Any]]:
        """Operator commands that arrived since the last call (no network call)."""
        with self._lock:
            out, self._commands = self._commands, []
            if out:
                self._seen_cmd = max(self._seen_cmd, max(c["id"] for c in out))
            return out

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until everything submitted is handled: True when it was all acknowledged, False
        when `timeout` passed or the collector refused batches with 409 (see `_conflict`)."""
        deadline = time.monotonic() + timeout
        while True:
            with self._count_lock:
                done = self._processed == self._submitted
            if done and not self._spool:
                return not self._conflicted
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    def close(self, timeout: float = 30.0, final: bool | None = None) -> bool:
        """Drain and stop. True when everything reached the collector; otherwise the rest is
        on disk in the spool and a later Exporter for the same run and rank sends it.
        `final`: end with a final batch (this rank stopped on purpose); None = unless an
        exception is propagating (close() called from a `finally` during a crash)."""
        if final is None:
            final = sys.exc_info()[0] is None
        ok = self.flush(timeout)
        self._closing = True
        self._q.put(_STOP)
        self._thread.join(timeout=max(1.0, timeout / 4))
        # anything still queued (collector down) is written to the spool, never lost
        leftover = []
        while True:
            try:
                it = self._q.get_nowait()
            except queue.Empty:
                break
            if isinstance(it, tuple):
                leftover.append(it)
        for chunk in self._chunks(self._encode_items(leftover)):
            with self._lock:
                seq = self._next_seq()
                self._spool_write(seq, self._body(chunk, seq))
        if final:
            ok = self._send_final() and ok
        self._client.close()
        return ok and not leftover and not self._conflicted

    def _send_final(self) -> bool:
        """The final batch, last in seq order: POSTed when nothing is spooled and the sender has
        stopped (a batch still in flight must not land after it), else spooled behind the rest."""
        with self._lock:
            seq = self._next_seq()
            body = self._body([], seq, final=True)
            if self._spool or self._thread.is_alive():
                self._spool_write(seq, body)
                return False
        if self._post(body, heartbeat_only=True):
            return True
        with self._lock:
            self._spool_write(seq, body)
        return False

    @property
    def spooled(self) -> int:
        with self._lock:
            return len(self._spool)

    # ---- sequence numbers and spool (callers hold _lock) ------------------------------
    def _next_generation(self) -> int:
        p = self.spool_dir / f"{self._prefix}generation"
        try:
            last = int(p.read_text())
        except (FileNotFoundError, ValueError):
            last = 0
        gen = max(int(time.time()), last + 1)
        tmp = p.with_name(p.name + ".tmp")
        tmp.write_text(str(gen))
        os.replace(tmp, p)
        return gen

    def _next_seq(self) -> int:
        self._counter += 1
        return make_seq(self.generation, self._counter)

    @staticmethod
    def _encode_items(items: list[tuple[StepReport, list[dict[str, Any]]]]) -> list[_Encoded]:
        """Serialise reports outside any lock (the costly part of building a batch)."""
        return [(encode_report(r), evs, r.step) for r, evs in items]

    def _chunks(self, enc: list[_Encoded]) -> list[list[_Encoded]]:
        """Split so that no body exceeds max_body_bytes (64 KiB left for the envelope)."""
        out: list[list[_Encoded]] = []
        cur: list[_Encoded] = []
        size, cap = 0, max(1, self.max_body_bytes - (64 << 10))
        for e in enc:
            n = len(e[0]) + 200 * len(e[1])
            if cur and size + n > cap:
                out.append(cur)
                cur, size = [], 0
            cur.append(e)
            size += n
        if cur:
            out.append(cur)
        return out

    def _body(self, chunk: list[_Encoded], seq: int, final: bool = False) -> bytes:
        """The batch body for `chunk` with sequence number `seq` (guard/wire/batch.py). Holds _lock."""
        if chunk:
            self._last_step = max(self._last_step, max(step for _, _, step in chunk))
        meta, self._meta = self._meta, None
        b = Batch(
            run=self.run_id,
            rank=self.rank,
            seq=seq,
            writer=self.writer,
            events=[e for _, evs, _ in chunk for e in evs],
            final=final,
            heartbeat=heartbeat(time.time(), max(self._last_step, 0), self._phase),
            meta=meta,
            trainer_detectors=self.trainer_detectors,
            # every batch: a lost heartbeat must not lose the acknowledgement
            commands_ack=self._seen_cmd if self._seen_cmd >= 0 else None,
        )
        return encode_batch(b, [rb for rb, _, _ in chunk])

    def _spool_write(self, seq: int, body: bytes) -> None:
        p = self.spool_dir / f"{self._prefix}{seq:020d}.json"
        tmp = p.with_name(f".{p.name}.tmp")
        with open(tmp, "wb") as f:
            f.write(body)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
        bisect.insort(self._spool, p)  # seq order (zero-padded names), whoever wrote it
        self.stats["spooled"] += 1

    # ---- background thread --------------------------------------------------------------
    def _loop(self) -> None:
        retry, retry_at = self._retry_schedule(), 0.0
        next_poll = time.monotonic() + self.poll_s
        last_sent = time.monotonic()
        while True:
            now = time.monotonic()
            wait = min(next_poll, last_sent + self.heartbeat_s, retry_at if self._spool else now + 1.0) - now
            items, stop = self._take(max(0.0, wait))
            chunks = self._chunks(self._encode_items(items)) if items else []
            batches: list[tuple[int, bytes]] = []
            with self._lock:
                if not chunks and (self._meta is not None or self._phase_changed):
                    chunks = [[]]
                if chunks:
                    self._phase_changed = False
                    batches = [(seq, self._body(c, seq)) for c in chunks for seq in (self._next_seq(),)]
                    if self._spool:  # keep order: queue behind what is already spooled
                        for seq, body in batches:
                            self._spool_write(seq, body)
                        batches = []
            for i, (_, body) in enumerate(batches):
                if not self._post(body):
                    with self._lock:
                        for seq, rest in batches[i:]:
                            self._spool_write(seq, rest)
                    retry_at = time.monotonic() + retry.failed()
                    break
                last_sent = time.monotonic()
            if items:
                with self._count_lock:
                    self._processed += len(items)
            if self._spool and time.monotonic() >= retry_at:
                if self._replay():
                    retry.succeeded()
                    last_sent = time.monotonic()
                else:
                    retry_at = time.monotonic() + retry.failed()
            now = time.monotonic()
            if now >= next_poll:
                self._poll()
                next_poll = now + self.poll_s
            if now - last_sent >= self.heartbeat_s:
                with self._lock:  # only when nothing is spooled, checked under the seq lock
                    hb = None if self._spool else self._body([], self._next_seq())
                if hb is not None and self._post(hb, heartbeat_only=True):
                    last_sent = time.monotonic()
                else:
                    last_sent = now  # do not hammer a collector that is down
            if stop or self._closing:
                return

    def _take(self, wait: float) -> tuple[list[tuple[StepReport, list[dict[str, Any]]]], bool]:
        items: list[Any] = []
        stop = False
        try:
            first = self._q.get(timeout=wait) if wait > 0 else self._q.get_nowait()
        except queue.Empty:
            return items, stop
        for it in [first]:
            if it is _STOP:
                return items, True
            if it is not None:
                items.append(it)
        while len(items) < self.batch_max:
            try:
                it = self._q.get_nowait()
            except queue.Empty:
                break
            if it is _STOP:
                stop = True
                break
            if it is not None:
                items.append(it)
        return items, stop

    def _retry_schedule(self) -> Backoff:
        """Waits between tries of the spool (guard/wire/retry.py's policy): 0.25 s doubling up to
        backoff_max_s, with jitter. No attempt limit: the batches wait on disk, nothing is lost."""
        first = min(0.25, self.backoff_max_s)
        return Backoff(RetryPolicy(max_attempts=None, base_s=first, max_delay_s=self.backoff_max_s))

    def _post(self, body: bytes, heartbeat_only: bool = False) -> bool:
        """POST one batch; True when the collector has it (200) or rejected it for good (4xx)."""
        try:
            r = self._client.post(f"{self.url}/v1/ingest", content=body)
        except httpx.HTTPError as e:
            log.debug("collector unreachable: %s", e)
            return False
        if r.status_code == 200:
            self.stats["sent"] += 0 if heartbeat_only else 1
            self._take_commands(r)
            return True
        if r.status_code == 409:
            self._conflict(body, r, heartbeat_only)
            return True
        if r.status_code in (400, 413) and not heartbeat_only:
            # Permanently bad: retrying would block every later batch. Keep it for a human.
            self.stats["rejected"] += 1
            bad = self.spool_dir / "rejected"
            bad.mkdir(exist_ok=True)
            (bad / f"{self._prefix}{time.time_ns()}.json").write_bytes(body)
            log.error("collector rejected a batch (%d): %s", r.status_code, r.text[:300])
            return True
        if r.status_code in (401, 403):  # a missing or wrong token: every retry gets the same answer
            self.stats["unauthorized"] = self.stats.get("unauthorized", 0) + 1
            if self.stats["unauthorized"] == 1:
                log.warning(
                    "collector answered %d: %s; set MOEGUARD_TOKEN to the collector's token (telemetry "
                    "stays spooled and is retried; logged once)",
                    r.status_code,
                    r.text[:200],
                )
            return False
        log.warning("collector answered %d: %s", r.status_code, r.text[:200])
        return False

    def _conflict(self, body: bytes, r: httpx.Response, heartbeat_only: bool) -> None:
        """409: a newer writer generation owns this run id on the collector (a second trainer
        with the same run id, or this process was superseded by a restarted one). Retrying
        cannot succeed and would block every later batch, so the batch is set aside on disk
        (spool_dir/conflict/) and counted as not delivered; logged at ERROR once per run."""
        self._conflicted = True
        if not heartbeat_only:
            self.stats["conflict"] += 1
            bad = self.spool_dir / "conflict"
            bad.mkdir(exist_ok=True)
            (bad / f"{self._prefix}{time.time_ns()}.json").write_bytes(body)
        if self._conflict_logged:
            log.debug("collector refused another batch of run %s (409)", self.run_id)
            return
        self._conflict_logged = True
        try:
            why = str(r.json().get("error", ""))
        except (ValueError, AttributeError):
            why = r.text[:300]
        log.error(
            "run %s rank %d: the collector refuses this trainer's telemetry (409): %s Its batches are NOT "
            "delivered; they are kept in %s. (Logged once; later refusals are counted in stats['conflict'].)",
            self.run_id,
            self.rank,
            why,
            self.spool_dir / "conflict",
        )

    def _replay(self) -> bool:
        """Send spooled batches oldest first; stop at the first failure."""
        while True:
            with self._lock:
                if not self._spool:
                    return True
                p = self._spool[0]
            try:
                body = p.read_bytes()
            except FileNotFoundError:
                body = None
            if body is not None and not self._post(body):
                return False
            with self._lock:
                self._spool.remove(p)
            p.unlink(missing_ok=True)
            self.stats["replayed"] += 1

    def _poll(self) -> None:
        try:
            r = self._client.get(
                f"{self.url}/v1/runs/{self.run_id}/commands",
                params={"rank": self.rank, "after": self._queued_cmd},
            )
        except httpx.HTTPError:
            return
        if r.status_code == 200:
            self._take_commands(r)

    def _take_commands(self, r: httpx.Response) -> None:
        try:
            cmds = r.json().get("commands") or []
        except (ValueError, AttributeError):
            return
        with self._lock:
            for c in cmds:
                if isinstance(c, dict) and isinstance(c.get("id"), int) and c["id"] > self._queued_cmd:
                    self._commands.append(c)
                    self._queued_cmd = c["id"]
