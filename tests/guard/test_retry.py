"""guard/wire/retry.py: the one retry policy every moeguard HTTP client uses (the exporter, the
collector's Alertmanager client), against a local recording server."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from guard.core.tomlconf import ConfigError
from guard.wire.retry import Backoff, RetryPolicy, post_with_retry, retry_after_s
from tests.helpers_http import RecordingSink, free_port

FAST = RetryPolicy(max_attempts=4, base_s=0.01, max_delay_s=0.02, timeout_s=2.0)


@pytest.fixture
def sink() -> Iterator[RecordingSink]:
    with RecordingSink() as s:
        yield s


@pytest.fixture
def client() -> Iterator[httpx.Client]:
    with httpx.Client() as c:
        yield c


def test_delay_doubles_with_jitter_up_to_the_cap_and_honours_retry_after() -> None:
    pol = RetryPolicy(base_s=1.0, max_delay_s=8.0)
    for _ in range(50):
        assert 0.5 <= pol.delay(0) <= 1.0
        assert 1.0 <= pol.delay(1) <= 2.0
        assert 4.0 <= pol.delay(3) <= 8.0
        assert 4.0 <= pol.delay(10_000) <= 8.0  # capped, and no overflow however long it failed
    assert len({pol.delay(2) for _ in range(20)}) > 1  # jittered: clients that failed together spread out
    assert pol.delay(0, retry_after=5.0) == 5.0
    assert pol.delay(0, retry_after=100.0) == 8.0  # capped: a hostile Retry-After cannot stall us
    assert retry_after_s("3") == 3.0 and retry_after_s("-1") == 0.0
    assert retry_after_s(None) is None and retry_after_s("Wed, 21 Oct 2015 07:28:00 GMT") is None


def test_which_answers_and_errors_are_retried() -> None:
    assert all(RetryPolicy.retries_status(s) for s in (429, 500, 502, 503, 504))
    assert not any(RetryPolicy.retries_status(s) for s in (400, 401, 403, 404, 409, 413))
    assert RetryPolicy.retries_error(httpx.ConnectError("refused"))
    assert RetryPolicy.retries_error(httpx.ReadTimeout("slow"))
    assert not RetryPolicy.retries_error(httpx.TooManyRedirects("loop"))


@pytest.mark.parametrize(
    ("kwargs", "key"),
    [
        ({"max_attempts": 0}, "max_attempts"),
        ({"base_s": 0}, "retry_base"),
        ({"base_s": 2.0, "max_delay_s": 1.0}, "retry_max_delay"),
        ({"timeout_s": 0}, "timeout"),
        ({"deadline_s": 0}, "retry_deadline"),
        ({"connect_timeout_s": -1}, "connect_timeout"),
    ],
)
def test_a_bad_policy_names_its_key(kwargs: dict[str, float], key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        RetryPolicy(**kwargs)


def test_timeout_is_cut_to_the_deadline_and_connect_bounded() -> None:
    pol = RetryPolicy(timeout_s=10.0, connect_timeout_s=3.0)
    assert pol.timeout().read == 10.0 and pol.timeout().connect == 3.0
    assert pol.timeout(left_s=2.0).read == 2.0 and pol.timeout(left_s=2.0).connect == 2.0
    assert RetryPolicy(timeout_s=10.0).timeout().connect == 10.0


def test_5xx_and_429_are_retried_until_a_2xx(sink: RecordingSink, client: httpx.Client) -> None:
    sink.fail_next(1, status=503)
    sink.fail_next(1, status=429)
    out = post_with_retry(client, sink.url + "/x", b"{}", FAST)
    assert out.ok and out.attempts == 3 and out.why == "HTTP 202"
    assert [r.status for r in sink.received()] == [503, 429, 202]


def test_a_4xx_is_final_at_once(sink: RecordingSink, client: httpx.Client) -> None:
    sink.fail_next(5, status=400)
    out = post_with_retry(client, sink.url + "/x", b"{}", FAST)
    assert not out.ok and out.attempts == 1 and out.why.startswith("HTTP 400")
    assert out.response is not None and out.response.status_code == 400


def test_attempts_are_bounded_and_the_reason_names_no_url_path(
    sink: RecordingSink, client: httpx.Client
) -> None:
    sink.fail_next(100, status=500)
    out = post_with_retry(client, sink.url + "/services/SECRET", b"{}", FAST)
    assert not out.ok and out.attempts == 4 and "gave up after 4 attempts" in out.why
    assert len(sink.received()) == 4
    dead = f"http://127.0.0.1:{free_port()}/hooks/SECRET"  # nothing listens: connection refused
    out = post_with_retry(client, dead, b"{}", FAST)
    assert not out.ok and out.attempts == 4 and "SECRET" not in out.why and "ConnectError" in out.why


def test_the_deadline_ends_retries_before_max_attempts(sink: RecordingSink, client: httpx.Client) -> None:
    sink.fail_next(100, status=500)
    pol = RetryPolicy(max_attempts=None, base_s=0.1, max_delay_s=0.2, timeout_s=2.0, deadline_s=0.5)
    t0 = time.monotonic()
    out = post_with_retry(client, sink.url + "/x", b"{}", pol)
    # ended at the deadline, not a wait (>= base_s) past it: a loaded host's scheduling may add
    # a few ms to the last attempt (a CI clone read 0.504 s)
    assert not out.ok and "deadline" in out.why and time.monotonic() - t0 < pol.deadline_s + pol.base_s
    assert 2 <= out.attempts == len(sink.received()) <= 6


def test_stop_cuts_a_wait_short(sink: RecordingSink, client: httpx.Client) -> None:
    sink.fail_next(100, status=500)
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    t0 = time.monotonic()
    pol = RetryPolicy(max_attempts=5, base_s=30.0, max_delay_s=30.0)
    out = post_with_retry(client, sink.url + "/x", b"{}", pol, stop=stop)
    assert not out.ok and "shutting down" in out.why and time.monotonic() - t0 < 5.0


def test_backoff_counts_failures_and_resets() -> None:
    b = Backoff(RetryPolicy(max_attempts=None, base_s=0.25, max_delay_s=30.0))
    waits = [b.failed() for _ in range(10)]
    assert 0.125 <= waits[0] <= 0.25 and 8.0 <= waits[6] <= 16.0 and 15.0 <= waits[9] <= 30.0
    b.succeeded()
    assert b.failures == 0 and b.failed() <= 0.25
