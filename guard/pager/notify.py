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

Delivery is best effort with bounded retries (connection errors, 429 and 5xx; a 4xx other than
429 is final). The queue is bounded: past `max_queue` the oldest event is dropped (and logged),
never the request that ingested it. Events are not persisted: after a collector crash the
RunHalted alert is the page.

Also here, for every process of moeguard that posts somewhere (this notifier, the pager's sinks):
`quiet_http_logs()` and `redact_urls()`. Webhook URLs carry their secret in the path (Slack's
/services/T.../B.../<secret>), and httpx logs every request's full URL at INFO, so under
`logging.basicConfig(level=INFO)` the secret would land in the log.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import queue
import random
import re
import threading
from typing import Any

import httpx

log = logging.getLogger("moeguard.notify")

EVENTS_PATH = "/v1/events"
_STOP = object()
# scheme://[userinfo@]host[:port] then path, query, fragment: all but scheme and host go
_URL = re.compile(r"(?i)\b(https?)://(?:[^/\s?#@'\"<>]*@)?([^/\s?#'\"<>]*)[^\s'\"<>]*")


def redact_urls(text: str) -> str:
    """Every http(s) URL in `text` cut down to scheme://host[:port]."""
    return _URL.sub(lambda m: f"{m.group(1)}://{m.group(2)}", text)


def redact_url(url: str) -> str:
    """One URL (maybe malformed) as it may be shown: scheme://host, or what precedes its first '/'."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        scheme, rest = "", url
    host = rest.split("/", 1)[0].split("?", 1)[0].split("#", 1)[0].rsplit("@", 1)[-1]
    return f"{scheme}{sep}{host}" + ("/..." if len(host) < len(rest) else "")


class _RedactURLs(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "://" in message:
            record.msg, record.args = redact_urls(message), None
        return True


def quiet_http_logs() -> None:
    """Keep httpx and httpcore at WARNING (their INFO and DEBUG lines name every URL) and redact
    URLs in whatever they still log, should someone turn them back up. Idempotent."""
    for name in ("httpx", "httpcore"):
        logger = logging.getLogger(name)
        if logger.level < logging.WARNING:  # NOTSET included: basicConfig(INFO) would reach it
            logger.setLevel(logging.WARNING)
        if not any(isinstance(f, _RedactURLs) for f in logger.filters):
            logger.addFilter(_RedactURLs())


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
        self,
        url: str,
        token: str | None = None,
        *,
        max_queue: int = 1000,
        max_attempts: int = 5,
        base_delay_s: float = 0.5,
        max_delay_s: float = 8.0,
        timeout_s: float = 5.0,
    ) -> None:
        quiet_http_logs()
        self.url = events_url(url)
        self.max_attempts, self.base_delay_s, self.max_delay_s = max_attempts, base_delay_s, max_delay_s
        headers = {"content-type": "application/json", "user-agent": "moeguard-collector"}
        if token:
            headers["authorization"] = f"Bearer {token}"
        self._client = httpx.Client(
            headers=headers, timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 3.0))
        )
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
        why = ""
        for attempt in range(self.max_attempts):
            try:
                r = self._client.post(self.url, content=content)
            except httpx.HTTPError as e:
                why = redact_urls(f"{type(e).__name__}: {e}")
            else:
                if 200 <= r.status_code < 300:
                    self.stats["sent"] += 1
                    log.info(
                        "pager: %s event of run %s at step %s delivered",
                        body["kind"],
                        body["run"],
                        body["step"],
                    )
                    return
                why = redact_urls(f"HTTP {r.status_code}: {r.text[:200]}")
                if r.status_code != 429 and r.status_code < 500:
                    break  # the request itself is wrong; retrying will not help
            delay = min(self.max_delay_s, self.base_delay_s * 2**attempt) * random.uniform(0.5, 1.0)
            if attempt + 1 < self.max_attempts and self._stop.wait(delay):
                break
        self.stats["failed"] += 1
        log.error(
            "pager: could not deliver the %s event of run %s (%s); the RunHalted alert still pages",
            body["kind"],
            body["run"],
            why,
        )
