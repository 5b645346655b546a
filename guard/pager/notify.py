"""The collector's fast path to `moeguard pager`: critical guard events, posted in the background.

    n = PagerNotifier("http://pager:9095", token=None)
    n.start()
    n.submit(run, event_row)     # from ingest: a put on a bounded queue, never a network call
    n.close(timeout=5)

Why a second path next to Prometheus: RunHalted needs a scrape, a rule evaluation and its `for`
before Alertmanager even groups it (minutes). A halted run idles its GPUs from the moment it
halts, so the collector posts the halt event to the pager's /v1/events as soon as it is durably
stored. The pager files the event under the same incident (same dedup_key) as the RunHalted
alert that follows, so a human is paged once, seconds after the halt, and Alertmanager's
resolve closes it.

Delivery is best effort with guard/wire/retry.py's bounded retries (connection errors, 429 and
5xx; a 4xx other than 429 is final; NOTIFY_RETRY below). The queue is bounded: past `max_queue`
the oldest event is dropped (and logged), never the request that ingested it. Events are not
persisted: after a collector crash the RunHalted alert is the page. No URL is logged past its
scheme://host (guard/wire/redact.py).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import queue
import threading
from typing import Any

import httpx

from guard.wire.redact import quiet_http_logs
from guard.wire.retry import RetryPolicy, post_with_retry

log = logging.getLogger("moeguard.notify")

EVENTS_PATH = "/v1/events"
# A halt is worth a page within seconds: short waits; the RunHalted alert is the fallback.
# A pager that is down refuses at once; a lost host must not hold the queue for the whole timeout.
NOTIFY_RETRY = RetryPolicy(max_attempts=5, base_s=0.5, max_delay_s=8.0, timeout_s=5.0, connect_timeout_s=3.0)
_STOP = object()


def events_url(url: str) -> str:
    """The pager's base URL (http://pager:9095) or its full /v1/events URL -> the events URL."""
    url = url.rstrip("/")
    return url if url.endswith(EVENTS_PATH) else url + EVENTS_PATH


def pager_body(run: str, row: dict[str, Any]) -> dict[str, Any]:
    """A stored event row -> the pager's event body; NaN/Inf become null (not JSON)."""

    def num(v: Any) -> float | None:
        return float(v) if isinstance(v, int | float) and math.isfinite(v) else None

    return {
        "run": run,
        "step": int(row["step"]),
        "kind": row["kind"],
        "detector": row.get("detector") or "",
        "value": num(row.get("value")),
        "threshold": num(row.get("threshold")),
        "action": row.get("action") or "",
        "detail": row.get("detail") or "{}",  # a JSON string, as stored; the pager parses it
    }


class PagerNotifier:
    def __init__(
        self, url: str, token: str | None = None, *, max_queue: int = 1000, retry: RetryPolicy = NOTIFY_RETRY
    ) -> None:
        quiet_http_logs()
        self.url = events_url(url)
        self.retry = retry
        headers = {"content-type": "application/json", "user-agent": "moeguard-collector"}
        if token:
            headers["authorization"] = f"Bearer {token}"
        self._client = httpx.Client(headers=headers)  # the policy times each attempt
        self._q: queue.Queue[Any] = queue.Queue(maxsize=max_queue)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="moeguard-pager-notify", daemon=True)
        self.stats = {"sent": 0, "failed": 0, "dropped": 0}

    def start(self) -> None:
        self._thread.start()

    def submit(self, run: str, row: dict[str, Any]) -> None:
        """Queue one event for the pager. Never blocks: a full queue drops its oldest event."""
        body = pager_body(run, row)
        while True:
            try:
                self._q.put_nowait(body)
                return
            except queue.Full:
                try:
                    old = self._q.get_nowait()
                except queue.Empty:
                    continue
                if old is _STOP:  # closing: keep the stop marker, drop the new event
                    with contextlib.suppress(queue.Full):
                        self._q.put_nowait(old)
                    return
                self.stats["dropped"] += 1
                log.error("pager queue full: dropped the %s event of run %s", old["kind"], old["run"])

    def close(self, timeout: float = 5.0) -> None:
        """Send what is queued within `timeout`, then stop (retry waits are cut short)."""
        try:
            self._q.put(_STOP, timeout=timeout)
        except queue.Full:
            pass
        self._thread.join(timeout)
        self._stop.set()
        self._thread.join(1.0)
        self._client.close()

    def _loop(self) -> None:
        while True:
            body = self._q.get()
            if body is _STOP:
                return
            self._send(body)

    def _send(self, body: dict[str, Any]) -> None:
        content = json.dumps(body, allow_nan=False).encode()
        out = post_with_retry(self._client, self.url, content, self.retry, stop=self._stop)
        if out.ok:
            self.stats["sent"] += 1
            log.info(
                "pager: %s event of run %s at step %s delivered", body["kind"], body["run"], body["step"]
            )
            return
        self.stats["failed"] += 1
        log.error(
            "pager: could not deliver the %s event of run %s (%s); the RunHalted alert still pages",
            body["kind"],
            body["run"],
            out.why,
        )
