"""The exporter's background thread, the only one that touches the network while training runs.

Each turn it takes what has queued up (at most `batch_max` steps) and seals it into batches with
the next seqs in one hold of the seq lock (guard/runtime/export_queue.py says why), then POSTs
them; a batch that fails goes to the spool with everything after it, and the spool is retried,
oldest first, on guard/wire/retry.py's backoff. Between steps it
polls for operator commands every `poll_s` and sends an empty heartbeat batch when nothing went
out for `heartbeat_s` (never while something is spooled: a heartbeat must not overtake it).

One early beat per stall (`stall_beat_s`): a rank whose step and phase have not moved for that
long and that is not waiting in a collective beats at once, so that among thousands of ranks
beating once a minute the collector learns within seconds which one stalled (RunStuck names it:
guard/core/progress.py `culprits`); the ranks waiting for it send nothing extra.
"""

from __future__ import annotations

import threading
import time
from typing import TYPE_CHECKING

from guard.runtime.export_batch import BatchAssembler, chunks, encode_items
from guard.runtime.export_link import CollectorLink
from guard.runtime.export_queue import StepQueue
from guard.runtime.export_spool import Spool
from guard.wire.retry import Backoff, RetryPolicy

if TYPE_CHECKING:
    from guard.runtime.export_config import ExporterConfig


def retry_schedule(backoff_max_s: float) -> Backoff:
    """Waits between tries of the spool: 0.25 s doubling up to backoff_max_s, with jitter. No
    attempt limit: the batches wait on disk, nothing is lost."""
    first = min(0.25, backoff_max_s)
    return Backoff(RetryPolicy(max_attempts=None, base_s=first, max_delay_s=backoff_max_s))


class Sender:
    def __init__(
        self,
        steps: StepQueue,
        batches: BatchAssembler,
        spool: Spool,
        link: CollectorLink,
        cfg: ExporterConfig,
    ) -> None:
        self.steps, self.batches, self.spool, self.link, self.cfg = steps, batches, spool, link, cfg
        self.closing = False
        self._thread = threading.Thread(
            target=self._loop, name=f"moeguard-exporter-r{batches.rank}", daemon=True
        )
        self._retry = retry_schedule(cfg.backoff_max_s)
        self._retry_at = 0.0  # when the spool is tried next
        self._next_poll = self._last_sent = 0.0  # set when the thread starts
        self._stall_beaten = 0.0  # progress_at of the stall an early beat already reported

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float) -> None:
        """Let the thread finish its turn and end (at most `timeout` seconds)."""
        self.closing = True
        self.steps.stop()
        self._thread.join(timeout=timeout)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    def _loop(self) -> None:
        self._next_poll = time.monotonic() + self.cfg.poll_s
        self._last_sent = time.monotonic()
        if self.cfg.first_beat_s is not None:  # ranks of one job spread their beats (heartbeat.py)
            self._last_sent += min(self.cfg.first_beat_s, self.cfg.heartbeat_s) - self.cfg.heartbeat_s
        while True:
            self.steps.wait(max(0.0, self._wait()))
            stop = self.steps.stopped  # read before the take: what was queued before stop() goes out
            n_items = self._send_new()
            if n_items:
                self.steps.handled(n_items)
            if len(self.spool) and time.monotonic() >= self._retry_at:
                self._retry_spool()
            now = time.monotonic()
            if now >= self._next_poll:
                self.link.poll_commands()
                self._next_poll = now + self.cfg.poll_s
            if self._stall_due(now):
                self._stall_beaten = self.batches.progress_at
                self._beat(now)
            elif now - self._last_sent >= self.cfg.heartbeat_s:
                self._beat(now)
            if stop or self.closing:
                return

    def _wait(self) -> float:
        """Seconds until the next thing due: a command poll, a heartbeat, a retry of the spool."""
        now = time.monotonic()
        retry_at = self._retry_at if len(self.spool) else now + 1.0
        stall_at = self.batches.progress_at + self.cfg.stall_beat_s if self._stall_watch() else now + 1.0
        return (
            min(self._next_poll, self._last_sent + self.cfg.heartbeat_s, retry_at, max(stall_at, now + 0.1))
            - now
        )

    def _stall_watch(self) -> bool:
        """An early beat may be due: own beats on, this stall not reported yet, not waiting."""
        b = self.batches
        return (
            self.cfg.stall_beat_s < self.cfg.heartbeat_s
            and b.progress_at != self._stall_beaten
            and not b.waiting
        )

    def _stall_due(self, now: float) -> bool:
        b = self.batches
        return (
            self._stall_watch()
            and now - b.progress_at >= self.cfg.stall_beat_s
            and self._last_sent < b.progress_at + self.cfg.stall_beat_s
        )

    def _send_new(self) -> int:
        """Take the queued steps (at most batch_max), seal them (or a meta/phase change) into
        batches and POST them in seq order; on the first failure, spool that batch and every
        later one. Returns how many steps it took."""
        with self.batches.lock:  # take and seal in one hold: see export_queue.py on order
            items = self.steps.pop(self.cfg.batch_max)
            sealed = self._seal(chunks(encode_items(items), self.cfg.max_body_bytes) if items else [])
        self._post(sealed)
        return len(items)

    def _post(self, sealed: list[tuple[int, bytes]]) -> None:
        for i, (_, body) in enumerate(sealed):
            if not self.link.post(body):
                with self.batches.lock:
                    for seq, rest in sealed[i:]:
                        self.spool.write(seq, rest)
                self._retry_at = time.monotonic() + self._retry.failed()
                return
            self._last_sent = time.monotonic()

    def _seal(self, chunked: list[list]) -> list[tuple[int, bytes]]:
        """Give each chunk the next seq and its body; when anything is spooled already, spool
        them behind it (keeps the order) and return nothing to send now. Caller holds the lock."""
        if self.batches.take_news() and not chunked:
            chunked = [[]]
        sealed = [(seq, self.batches.body(c, seq)) for c in chunked for seq in (self.batches.next_seq(),)]
        if sealed and len(self.spool):
            for seq, body in sealed:
                self.spool.write(seq, body)
            return []
        return sealed

    def _retry_spool(self) -> None:
        if self.spool.replay(self.link.post):
            self._retry.succeeded()
            self._last_sent = time.monotonic()
        else:
            self._retry_at = time.monotonic() + self._retry.failed()

    def _beat(self, now: float) -> None:
        """An empty batch, so the collector hears from this rank; only when nothing is spooled
        (checked under the seq lock)."""
        with self.batches.lock:
            hb = None if len(self.spool) else self.batches.body([], self.batches.next_seq())
        if hb is not None and self.link.post(hb, heartbeat_only=True):
            self._last_sent = time.monotonic()
        else:
            self._last_sent = now  # do not hammer a collector that is down
