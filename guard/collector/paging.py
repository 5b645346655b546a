"""The collector's fast path to a page: critical guard alerts posted to every Alertmanager.

    n = AlertmanagerNotifier(["http://am-a:9093", "http://am-b:9093"], health, labels={...})
    n.start()
    n.observe(run, reports, events)   # from ingest, once the batch is durable: a queue put
    n.close()

Why next to Prometheus: RunHalted needs a scrape, a rule evaluation and its `for` before
Alertmanager even groups it (minutes), and a halted run idles its GPUs from the moment it halts.
The alerts are guard/core/paging.py's PAGED, each labelled as its Prometheus rule's alert (plus
`labels`: give the Prometheus external labels), so Alertmanager holds one alert for both sources
and pages once through its own receivers (alerts/alertmanager.yml).

One thread decides (guard/core/paging.py's PageBook): a RunHalted latch read from the HealthBook
(a halt, a resume, a collector restart that restored the latch), windows of signals from the
live batches (non-finite rank-0 steps, rollbacks, transient reruns). One thread per Alertmanager
sends: every change at once, every firing alert again each `resend_s` (endsAt = now + 4 x
resend_s, as Prometheus does), a resolve once, `resolve_delay_s` after the end (see
RESOLVE_DELAY_S); a send that fails is retried with
bounded backoff (guard/wire/retry.py) and the newest state, so a restarted Alertmanager gets
every firing alert back within `resend_s`. After a collector restart the halt latch comes back
from the run store, and the windows' signals from `state` (written whole, atomically, whenever a
signal arrives: critical signals are rare), so a restart neither resolves nor re-pages.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import httpx

from guard.collector.book import HealthBook
from guard.collector.health import rerun_ranks
from guard.core import schema
from guard.core.paging import (
    HARDWARE_FAULT,
    REPEATED_NONFINITE,
    ROLLBACK_STORM,
    RUN_HALTED,
    Firing,
    Key,
    PageBook,
)
from guard.core.report import StepReport
from guard.store.layout import atomic_write_bytes
from guard.wire.alertmanager import post_alerts, postable
from guard.wire.redact import quiet_http_logs, redact_url
from guard.wire.retry import RetryPolicy

log = logging.getLogger("moeguard.paging")

RESEND_S = 60.0  # Prometheus's default --rules.alert.resend-delay
# A resolve is posted this long after the collector saw the alert end. Prometheus raises the same
# alert and sees its end a scrape and an evaluation later, re-sending it as firing meanwhile; a
# resolve posted before that would be undone by the re-send, and Alertmanager would page again.
# With Prometheus, its own resolve (the younger update) ends the alert first; without it, this.
RESOLVE_DELAY_S = 120.0
# One send: short, so a resolve or a new page is not held up; the next round retries.
SEND_RETRY = RetryPolicy(max_attempts=3, base_s=0.5, max_delay_s=4.0, timeout_s=5.0, connect_timeout_s=2.0)
MAX_QUEUE = 10_000
_STOP = object()


def signals(
    reports: Iterable[StepReport], events: Iterable[Mapping[str, Any]]
) -> list[tuple[Any, str | None]]:
    """A batch's window signals, counted as the collector's counters count them (health.py):
    rank-0 non-finite steps, rank-0 rollback decisions, transient reruns per named rank."""
    out: list[tuple[Any, str | None]] = []
    for rep in reports:
        if rep.rank != 0:
            continue
        if not rep.finite:
            out.append((REPEATED_NONFINITE, None))
        if rep.action == schema.ACT_ROLLBACK:
            out.append((ROLLBACK_STORM, None))
    for ev in events:
        if ev.get("kind") == schema.EV_RERUN and ev.get("detector") == schema.RERUN_TRANSIENT:
            out += [(HARDWARE_FAULT, rank) for rank in rerun_ranks(ev)]
    return out


class _Target:
    """One Alertmanager: sends the newest state it was offered, plus resolves it owes."""

    def __init__(self, url: str, resend_s: float, retry: RetryPolicy, stop: threading.Event) -> None:
        self.url, self.resend_s, self.retry, self._stop = url, resend_s, retry, stop
        self._cond = threading.Condition()
        self._firing: dict[Key, Firing] = {}
        self._owed: dict[Key, dict[str, Any]] = {}  # resolves not yet delivered
        self._dirty = False
        self.last_ok = 0.0
        self.stats = {"sent": 0, "failed": 0}
        self._thread = threading.Thread(target=self._loop, name=f"moeguard-am-{redact_url(url)}", daemon=True)

    def offer(self, firing: dict[Key, Firing], resolved: dict[Key, dict[str, Any]]) -> None:
        with self._cond:
            self._firing = firing
            for k in firing:
                self._owed.pop(k, None)  # fires again: the resolve is void
            self._owed.update(resolved)
            self._dirty = True
            self._cond.notify()

    def _loop(self) -> None:
        with httpx.Client(headers={"user-agent": "moeguard-collector"}) as client:
            failures = 0
            while not self._stop.is_set():
                with self._cond:
                    due = self.last_ok + self.resend_s if self._firing else float("inf")
                    while not self._dirty and time.time() < due and not self._stop.is_set():
                        self._cond.wait(min(1.0, max(0.0, due - time.time())))
                    if self._stop.is_set():
                        return
                    firing, owed, self._dirty = dict(self._firing), dict(self._owed), False
                now = time.time()
                ttl = 4 * self.resend_s
                body = [
                    postable(f.labels, f.annotations, starts_at=f.starts_at, ends_at=now + ttl)
                    for f in firing.values()
                ] + list(owed.values())
                if not body:
                    continue
                out = post_alerts(client, self.url, body, self.retry, stop=self._stop)
                if out.ok:
                    failures = 0
                    self.stats["sent"] += 1
                    self.last_ok = now
                    with self._cond:
                        for k, v in owed.items():
                            if self._owed.get(k) is v:
                                del self._owed[k]
                    continue
                self.stats["failed"] += 1
                failures += 1
                log.error(
                    "alertmanager %s: %d alert(s) not delivered (%s); retrying",
                    redact_url(self.url),
                    len(body),
                    out.why,
                )
                with self._cond:
                    self._dirty = True
                self._stop.wait(min(self.resend_s, self.retry.delay(failures)))


class AlertmanagerNotifier:
    """Decides what pages (one thread) and sends it to every Alertmanager (a thread each)."""

    def __init__(
        self,
        urls: Iterable[str],
        health: HealthBook,
        *,
        labels: Mapping[str, str] | None = None,
        resend_s: float = RESEND_S,
        resolve_delay_s: float = RESOLVE_DELAY_S,
        retry: RetryPolicy = SEND_RETRY,
        state: Path | None = None,
    ) -> None:
        quiet_http_logs()
        self.health = health
        self.labels = dict(labels or {})  # Prometheus's external labels, so both alerts are one
        self.runbook_base = self.labels.get("runbook_base", "").rstrip("/")
        self.resend_s = resend_s
        self._stop = threading.Event()
        self.targets = [_Target(u, resend_s, retry, self._stop) for u in urls]
        self._q: queue.Queue[Any] = queue.Queue(maxsize=MAX_QUEUE)
        self._book = PageBook()
        self.state = state
        if state is not None and state.is_file():
            try:
                self._book.load_state_dict(json.loads(state.read_bytes()))
            except (OSError, ValueError) as e:  # a page the window would have held may be lost
                log.error("paging: cannot read %s (%s); starting with empty windows", state, e)
        self._sent: dict[Key, Firing] = {}
        self._resolving: dict[Key, tuple[Firing, float]] = {}  # resolved, resolve not posted yet
        self.resolve_delay_s = resolve_delay_s
        self._thread = threading.Thread(target=self._loop, name="moeguard-paging", daemon=True)
        self.dropped = 0

    def start(self) -> None:
        for t in self.targets:
            t._thread.start()
        self._thread.start()

    def observe(self, run: str, reports: list[StepReport], events: list[dict[str, Any]]) -> None:
        """A durable, live batch's reports and events (never a replay). Never blocks."""
        try:
            self._q.put_nowait((run, reports, events, time.time()))
        except queue.Full:
            self.dropped += 1  # the latch is re-read from the HealthBook each round
            log.error("paging queue full: dropped a batch of run %s", run)

    def close(self, timeout: float = 5.0) -> None:
        """Send the last changes (within `timeout`), then stop."""
        try:
            self._q.put(_STOP, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        deadline = time.monotonic() + timeout
        while any(t._dirty for t in self.targets) and time.monotonic() < deadline:
            time.sleep(0.05)
        self._stop.set()
        for t in self.targets:
            with t._cond:
                t._cond.notify()
            t._thread.join(1.0)

    def firing(self) -> list[dict[str, str]]:
        """The label sets posted as firing (for /healthz and tests)."""
        return [dict(f.labels) for f in self._sent.values()]

    # ---- the deciding thread ---------------------------------------------------------------
    def _loop(self) -> None:
        next_scan = 0.0
        while True:
            touched: set[str] = set()
            stop = new_signals = False
            try:
                item = self._q.get(timeout=1.0)
                while True:
                    if item is _STOP:
                        stop = True
                        break
                    run, reports, events, at = item
                    touched.add(run)
                    for alert, rank in signals(reports, events):
                        self._book.signal(alert, run, at, rank)
                        new_signals = True
                    item = self._q.get_nowait()
            except queue.Empty:
                pass
            now = time.time()
            try:
                if new_signals:
                    self._save()
                if now >= next_scan:  # the whole HealthBook: latches restored at start-up, evictions
                    touched |= set(self.health.runs()) | set(self._book.latched(RUN_HALTED))
                    next_scan = now + min(self.resend_s, 5.0)
                for run in touched:
                    self._book.latch(
                        RUN_HALTED, run, self.health.is_halted(run), now, info=self.health.halt_labels(run)
                    )
                self._publish(now)
            except Exception:  # a bug here must not end paging for good
                log.exception("paging: deciding what fires failed")
            if stop:
                return

    def _save(self) -> None:
        if self.state is None:
            return
        try:
            atomic_write_bytes(self.state, json.dumps(self._book.state_dict()).encode())
        except OSError as e:  # paging goes on; only a restart would forget the windows
            log.error("paging: cannot write %s: %s", self.state, e)

    def _publish(self, now: float) -> None:
        firing = self._book.firing(now, self.runbook_base)
        for f in firing.values():
            f.labels = {**self.labels, **f.labels}  # as Prometheus: the alert's own labels win
        for k in firing:
            self._resolving.pop(k, None)  # fires again within the delay: nothing to resolve
        for k in self._sent.keys() - firing.keys():
            f = self._sent[k]
            log.info("paging: %s resolved for run %s", f.labels["alertname"], f.labels["run"])
            self._resolving[k] = (f, now)
        due = {
            k: postable(f.labels, f.annotations, starts_at=f.starts_at, ends_at=at)
            for k, (f, at) in self._resolving.items()
            if now >= at + self.resolve_delay_s
        }
        for k in due:
            del self._resolving[k]
        if firing.keys() == self._sent.keys() and not due:
            return
        for k in firing.keys() - self._sent.keys():
            log.warning("paging: %s fires for run %s", firing[k].labels["alertname"], firing[k].labels["run"])
        self._sent = firing
        for t in self.targets:
            t.offer(dict(firing), due)
