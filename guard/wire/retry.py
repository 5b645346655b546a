"""One retry policy for every moeguard HTTP client: the trainer's exporter and the collector's
Alertmanager client (guard/collector/paging.py).

    policy = RetryPolicy(max_attempts=5, base_s=1.0, max_delay_s=30.0, timeout_s=10.0, deadline_s=120)
    outcome = post_with_retry(client, url, body_bytes, policy, stop=stop_event)
    outcome.ok, outcome.why         # "HTTP 202" or the (URL-redacted) reason of the last failure

What is retried: 429 and 5xx answers and transport errors (refused, reset, DNS, timeouts). Any
other answer is final: the request itself is wrong and every retry would get the same answer.
The wait before retry n (0-based) is min(max_delay_s, base_s * 2**n) with jitter (x U(0.5, 1)), so
many clients that failed together do not retry together; a Retry-After the server sends wins,
capped at max_delay_s so a hostile one cannot stall a sender. A request stops at max_attempts,
at deadline_s (waits and attempts together; the last attempt's timeout is cut to what is left),
or when `stop` is set (shutdown cuts waits short).

Callers that retry on their own schedule rather than in a loop (the exporter spools a failed batch
to disk and retries it, never giving up, while new steps queue behind it) count their failures
with `Backoff`, which asks the same policy for each wait.
"""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass

import httpx

from guard.core.tomlconf import check
from guard.wire.redact import redact_urls

JITTER = (0.5, 1.0)  # the wait is the backoff times U(JITTER)


@dataclass(kw_only=True, slots=True, frozen=True)
class RetryPolicy:
    """Bounded exponential backoff with jitter; the `check` keys name the setting (as a flag would)."""

    max_attempts: int | None = 5  # None: no count limit (the deadline, or the caller, ends it)
    base_s: float = 1.0  # the first wait's ceiling; each later one doubles
    max_delay_s: float = 30.0  # no wait is longer
    timeout_s: float = 10.0  # one attempt
    connect_timeout_s: float | None = None  # of the attempt's timeout, for connecting; None: all of it
    deadline_s: float | None = None  # all attempts of one request and the waits between them

    def __post_init__(self) -> None:
        check(
            self.max_attempts is None or self.max_attempts >= 1,
            "max_attempts",
            self.max_attempts,
            "must be >= 1",
        )
        check(self.base_s > 0, "retry_base", self.base_s, "must be > 0")
        check(self.max_delay_s >= self.base_s, "retry_max_delay", self.max_delay_s, "must be >= retry_base")
        check(self.timeout_s > 0, "timeout", self.timeout_s, "must be > 0")
        connect = self.connect_timeout_s
        check(connect is None or connect > 0, "connect_timeout", connect, "must be > 0")
        check(
            self.deadline_s is None or self.deadline_s > 0, "retry_deadline", self.deadline_s, "must be > 0"
        )

    def timeout(self, left_s: float | None = None) -> httpx.Timeout:
        """One attempt's timeout, cut to the `left_s` seconds the deadline leaves."""
        total = self.timeout_s if left_s is None else max(0.001, min(self.timeout_s, left_s))
        connect = total if self.connect_timeout_s is None else min(total, self.connect_timeout_s)
        return httpx.Timeout(total, connect=connect)

    def delay(self, attempt: int, retry_after: float | None = None) -> float:
        """Seconds to wait after failed attempt number `attempt` (0-based)."""
        backoff = min(self.max_delay_s, self.base_s * 2 ** min(attempt, 64)) * random.uniform(*JITTER)
        if retry_after is not None:
            return min(self.max_delay_s, max(backoff, retry_after))
        return backoff

    @staticmethod
    def retries_status(status: int) -> bool:
        """429 (slow down) and 5xx (the server's trouble) may succeed later; other answers will not."""
        return status == 429 or status >= 500

    @staticmethod
    def retries_error(error: Exception) -> bool:
        """Transport errors (refused, reset, DNS, timeouts) are retried; other httpx errors are final."""
        return isinstance(error, httpx.TransportError)


def retry_after_s(value: str | None) -> float | None:
    """A Retry-After header in seconds; None when absent or an HTTP date (our backoff applies)."""
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


@dataclass(slots=True)
class Outcome:
    ok: bool  # a 2xx answer
    why: str  # "HTTP 200", or the last failure's reason with URLs cut to scheme://host
    response: httpx.Response | None = None  # the last answer, if any came
    attempts: int = 0


def post_with_retry(
    client: httpx.Client,
    url: str,
    content: bytes,
    policy: RetryPolicy,
    *,
    stop: threading.Event | None = None,
    headers: dict[str, str] | None = None,
) -> Outcome:
    """POST `content` until a 2xx, a final answer, max_attempts, the deadline or `stop`."""
    stop = stop or threading.Event()
    started = time.monotonic()
    attempt = 0
    while True:
        left = None if policy.deadline_s is None else policy.deadline_s - (time.monotonic() - started)
        timeout = policy.timeout(left)
        attempt += 1
        retry_after, response = None, None
        try:
            r = client.post(url, content=content, headers=headers, timeout=timeout)
        except httpx.HTTPError as e:
            why = redact_urls(f"{type(e).__name__}: {e}")
            if not policy.retries_error(e):
                return Outcome(False, why, None, attempt)
        else:
            response = r
            if 200 <= r.status_code < 300:
                return Outcome(True, f"HTTP {r.status_code}", r, attempt)
            why = redact_urls(f"HTTP {r.status_code}: {r.text[:200]}")
            if not policy.retries_status(r.status_code):
                return Outcome(False, why, r, attempt)  # the request itself is wrong
            retry_after = retry_after_s(r.headers.get("retry-after"))
        if policy.max_attempts is not None and attempt >= policy.max_attempts:
            return Outcome(False, f"{why} (gave up after {attempt} attempts)", response, attempt)
        wait = policy.delay(attempt - 1, retry_after)
        if policy.deadline_s is not None and time.monotonic() - started + wait >= policy.deadline_s:
            return Outcome(
                False, f"{why} (gave up at the {policy.deadline_s:g}s deadline)", response, attempt
            )
        if stop.wait(wait):
            return Outcome(False, f"{why} (shutting down)", response, attempt)


class Backoff:
    """Consecutive failures of a caller that retries on its own schedule; not thread-safe."""

    def __init__(self, policy: RetryPolicy) -> None:
        self.policy = policy
        self.failures = 0

    def failed(self, retry_after: float | None = None) -> float:
        """One more failure: the seconds to wait before the next try."""
        wait = self.policy.delay(self.failures, retry_after)
        self.failures += 1
        return wait

    def succeeded(self) -> None:
        self.failures = 0
