"""Open alerts per run (optional): Alertmanager API v2, or the collector's /v1/runs listing
(guard/wire/runs.py, the type the collector writes)."""

from __future__ import annotations

import streamlit as st

from guard.wire.runs import RunListing, parse_runs


def fetch_collector_runs(url: str, timeout_s: float = 3.0) -> list[RunListing]:
    """The collector's run listing (GET /v1/runs, guard/wire/runs.py). Raises httpx.HTTPError
    or ValueError when the collector cannot be reached or answers something else."""
    import httpx

    r = httpx.get(url.rstrip("/") + "/v1/runs", timeout=timeout_s)
    if r.status_code != 200:
        raise ValueError(f"HTTP {r.status_code}")
    return parse_runs(r.json())


@st.cache_data(ttl=15, show_spinner=False)
def fetch_open_alerts(url: str) -> tuple[dict[str, int], str | None]:
    """run id -> firing alerts. Tries Alertmanager `/api/v2/alerts`, then the collector's
    `/v1/runs` (the alerts each run's entry implies: RunListing.open_alerts). Returns
    ({}, error) when both fail."""
    import httpx

    base = url.rstrip("/")
    errors = []
    try:
        r = httpx.get(
            base + "/api/v2/alerts",
            params={"active": "true", "silenced": "false", "inhibited": "false"},
            timeout=3.0,
        )
        if r.status_code == 200 and isinstance(r.json(), list):
            out: dict[str, int] = {}
            for a in r.json():
                run = (a.get("labels") or {}).get("run")
                if run and (a.get("status") or {}).get("state", "active") == "active":
                    out[run] = out.get(run, 0) + 1
            return out, None
        errors.append(f"/api/v2/alerts: HTTP {r.status_code}")
    except (httpx.HTTPError, ValueError) as e:
        errors.append(f"/api/v2/alerts: {e}")
    try:
        return {e.run: len(e.open_alerts()) for e in fetch_collector_runs(base)}, None
    except (httpx.HTTPError, ValueError) as e:
        errors.append(f"/v1/runs: {e}")
    return {}, "; ".join(errors)
