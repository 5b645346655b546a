"""Alertmanager's v2 API, the part a client that raises alerts uses: `POST /api/v2/alerts`.

    body = postable(labels, annotations, starts_at=t0, ends_at=now + ttl)   # firing
    body = postable(labels, annotations, starts_at=t0, ends_at=now)         # resolved
    outcome = post_alerts(client, "http://am:9093", [body, ...], policy)

Alertmanager treats alerts with the same label set as one alert, whoever sent them, and merges
them (earliest startsAt; the latest update's endsAt). A client re-sends a firing alert before its
endsAt, or Alertmanager resolves it at endsAt on its own; an endsAt in the past resolves it now.
High availability: a client sends every alert to every instance; the cluster notifies once.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

import httpx

from guard.wire.retry import Outcome, RetryPolicy, post_with_retry

ALERTS_PATH = "/api/v2/alerts"


def alerts_url(url: str) -> str:
    """An Alertmanager base URL (http://am:9093) or its full alerts URL -> the alerts URL."""
    url = url.rstrip("/")
    return url if url.endswith(ALERTS_PATH) else url + ALERTS_PATH


def rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def postable(
    labels: dict[str, str],
    annotations: dict[str, str],
    *,
    starts_at: float,
    ends_at: float,
    generator_url: str = "",
) -> dict[str, Any]:
    """One alert as the v2 API takes it (`postableAlert`)."""
    body: dict[str, Any] = {
        "labels": labels,
        "annotations": annotations,
        "startsAt": rfc3339(starts_at),
        "endsAt": rfc3339(ends_at),
    }
    if generator_url:
        body["generatorURL"] = generator_url
    return body


def post_alerts(
    client: httpx.Client,
    url: str,
    alerts: list[dict[str, Any]],
    policy: RetryPolicy,
    **kw: Any,
) -> Outcome:
    """POST a list of postable alerts to one Alertmanager, with the policy's retries."""
    content = json.dumps(alerts, allow_nan=False).encode()
    headers = {"content-type": "application/json"}
    return post_with_retry(client, alerts_url(url), content, policy, headers=headers, **kw)
