"""Delivery: one worker thread per sink, off the request path, sends only the difference between
an incident's desired status and what that sink last got, with guard/wire/retry.py's bounded
retries (429, 5xx, connection errors, a deadline). Each outcome is recorded in the book (one
journal append) before the next delivery; Alertmanager's repeat notifications and a periodic
reconcile re-drive whatever failed."""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from typing import Any

import httpx

from guard.pager.book import IncidentBook, delivery_needed
from guard.pager.config import PagerConfig, Receivers
from guard.pager.intake import Update
from guard.pager.journal import COMPACT_IDLE_S
from guard.pager.sinks import PagerDutySink, Sink, SlackSink, WebhookSink, json_safe
from guard.wire.redact import quiet_http_logs, redact_urls
from guard.wire.retry import RetryPolicy, post_with_retry

log = logging.getLogger("moeguard.pager")
JSON = {"Content-Type": "application/json"}


def build_sinks(r: Receivers) -> list[Sink]:
    """One sink per configured receiver; PagerDuty only with a routing key."""
    sinks: list[Sink] = []
    if r.routing_key:
        sinks.append(PagerDutySink(r.pagerduty_url, r.runbook_base, r.routing_key, r.page_severity))
    if r.slack_url:
        sinks.append(SlackSink(r.slack_url, r.runbook_base))
    sinks += [WebhookSink(u, r.runbook_base, i) for i, u in enumerate(r.webhook_urls)]
    return sinks


def encode(body: dict[str, Any]) -> bytes:
    return json.dumps(json_safe(body), allow_nan=False, default=str).encode()


class SinkWorker:
    """One thread per sink, so a slow or failing receiver never delays the others."""

    def __init__(self, sink: Sink, book: IncidentBook, policy: RetryPolicy) -> None:
        self.sink, self.book, self.policy = sink, book, policy
        self._queue: queue.Queue[str] = queue.Queue()
        self._queued: set[str] = set()
        self._qlock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"pager-{sink.name}", daemon=True)
        self.delivered = 0
        self.failed = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._queue.put("")  # wake the loop
        if timeout > 0:
            self._thread.join(timeout)

    def enqueue(self, key: str) -> None:
        with self._qlock:
            if key in self._queued:
                return
            self._queued.add(key)
        self._queue.put(key)

    def depth(self) -> int:
        return self._queue.qsize()

    def _loop(self) -> None:
        with httpx.Client(headers={"User-Agent": "moeguard-pager"}) as client:
            while not self._stop.is_set():
                key = self._queue.get()
                with self._qlock:
                    self._queued.discard(key)
                if not key or self._stop.is_set():
                    continue
                try:
                    self._deliver(client, key)
                except Exception as e:  # a dead worker would be a silent paging outage
                    self.failed += 1
                    why = redact_urls(f"{type(e).__name__}: {e}")
                    log.error("%s: delivery of %s failed unexpectedly: %s", self.sink.name, key, why)

    def _deliver(self, client: httpx.Client, key: str) -> None:
        inc = self.book.snapshot(key)
        if inc is None or not self.sink.wants(inc):
            return
        status = delivery_needed(inc, inc["sent"].get(self.sink.name))
        if status is None:
            return
        content = encode(self.sink.body(inc, status))
        out = post_with_retry(client, self.sink.url, content, self.policy, stop=self._stop, headers=JSON)
        alert = inc["identity"].get("alertname")
        if out.ok:
            self.delivered += 1
            log.info("%s: %s %s (%s) %s", self.sink.name, status, alert, key, out.why)
        else:
            self.failed += 1
            log.error("%s: could not deliver %s %s (%s): %s", self.sink.name, status, alert, key, out.why)
        if self.book.record(key, self.sink.name, status if out.ok else None, None if out.ok else out.why):
            self.enqueue(key)  # it changed while we were sending


class Pager:
    """The book, the sinks and their workers, and a reconcile loop that re-drives failures."""

    def __init__(self, cfg: PagerConfig) -> None:
        quiet_http_logs()  # httpx would log every webhook URL, secret path included, at INFO
        self.cfg = cfg
        self.book = IncidentBook(cfg.state)
        self.workers = [SinkWorker(s, self.book, cfg.retry) for s in build_sinks(cfg.receivers)]
        self._stop = threading.Event()
        self._reconciler = threading.Thread(target=self._reconcile_loop, name="pager-reconcile", daemon=True)

    def start(self) -> None:
        for w in self.workers:
            w.start()
        self.reconcile()  # a restart picks up whatever the last process had not delivered
        self._reconciler.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the workers (all at once; a send in flight gets `timeout`), then compact the state."""
        self._stop.set()
        for w in self.workers:
            w.stop(timeout=0)
        deadline = time.monotonic() + timeout
        for w in self.workers:
            w.stop(timeout=max(0.01, deadline - time.monotonic()))
        try:
            self.book.checkpoint()
        except OSError as e:  # the journal still holds every change
            log.error("could not compact the state file at exit: %s", e)

    def accept(self, updates: list[Update]) -> list[str]:
        keys = self.book.apply(updates, time.time())
        for w in self.workers:
            for k in keys:
                w.enqueue(k)
        return keys

    def reconcile(self) -> None:
        self.book.expire_events(time.time())
        for key in self.book.keys():
            for w in self.workers:
                w.enqueue(key)  # the worker skips keys that are up to date

    def health(self) -> dict[str, Any]:
        return {
            "status": "ok",
            **self.book.stats(),
            "sinks": {
                w.sink.name: {"queued": w.depth(), "delivered": w.delivered, "failed": w.failed}
                for w in self.workers
            },
            "state": str(self.cfg.state) if self.cfg.state else None,
        }

    def _reconcile_loop(self) -> None:
        due = time.monotonic() + self.cfg.reconcile_s
        while not self._stop.wait(min(COMPACT_IDLE_S, self.cfg.reconcile_s)):
            try:
                if time.monotonic() >= due:
                    due = time.monotonic() + self.cfg.reconcile_s
                    self.reconcile()
                self.book.compact_if_idle()
            except OSError as e:  # a full disk: say so, keep re-driving
                log.error("reconcile: %s", e)
