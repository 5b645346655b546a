"""`moeguard pager`: the real service (`python -m guard pager`, a subprocess) against a
recording HTTP sink, plus an end-to-end run through real Prometheus and Alertmanager binaries.

Negative checks ("no second page") use a marker: after the action under test, post a fresh
critical alert and wait until every sink got it. Each sink has one FIFO worker, so anything the
pager was going to send for the earlier request has been sent by then.
"""

from __future__ import annotations

import hashlib
import json
import re
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # bare `pytest` without an install puts only tests/guard on sys.path
    sys.path.insert(0, str(REPO))

from guard.core import schema  # noqa: E402
from guard.pager.book import IncidentBook, delivery_needed  # noqa: E402
from guard.pager.config import ENV_PAGER_TOKEN  # noqa: E402
from guard.pager.intake import (  # noqa: E402
    FIRING,
    RESOLVED,
    PayloadError,
    dedup_key,
    incident_identity,
    parse_alertmanager,
    parse_event,
)
from guard.pager.sinks import PagerDutySink, json_safe  # noqa: E402
from tests.helpers_alerting import (  # noqa: E402
    ALERTMANAGER,
    HOOK,
    PD,
    PROMETHEUS,
    ROUTING_KEY,
    RULES,
    RUNBOOKS,
    SLACK,
    PagerProc,
    fast_rules,
    start_alertmanager,
    start_pager,
    start_prometheus,
)
from tests.helpers_http import Recorded, RecordingSink, free_port, http_json, wait_http, wait_until  # noqa: E402


# ---------------------------------------------------------------------------------------
# Fixtures: a recording sink and the real pager process (tests/helpers_alerting.py)
# ---------------------------------------------------------------------------------------
@pytest.fixture
def sink() -> Iterator[RecordingSink]:
    with RecordingSink() as s:
        yield s


@pytest.fixture
def pager(sink: RecordingSink, tmp_path: Path) -> Iterator[PagerProc]:
    p = start_pager(sink, tmp_path)
    yield p
    p.stop()


@pytest.fixture(scope="module")
def shared_pager(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PagerProc]:
    """One pager for tests that must not change its state (malformed requests)."""
    with RecordingSink() as s:
        p = start_pager(s, tmp_path_factory.mktemp("shared-pager"))
        yield p
        p.stop()


# ---------------------------------------------------------------------------------------
# Realistic Alertmanager v4 payloads
# ---------------------------------------------------------------------------------------
def am_alert(
    alertname: str,
    status: str = "firing",
    *,
    run: str = "r1",
    severity: str = "critical",
    scope: str = "run",
    **labels: str,
) -> dict[str, Any]:
    lab = {
        "alertname": alertname,
        "run": run,
        "scope": scope,
        "severity": severity,
        "runbook_base": RUNBOOKS,
        **labels,
    }  # runbook_base: an external label, as Prometheus adds it
    return {
        "status": status,
        "labels": lab,
        "annotations": {
            "summary": f"{alertname} in run {run}",
            "description": f"Run {run}: {alertname} <details> & more.",
            "runbook_url": f"{RUNBOOKS}/playbooks/{alertname}.md",
        },
        "startsAt": "2026-11-22T03:00:00.000Z",
        "endsAt": "2026-11-22T03:10:00.000Z" if status == "resolved" else "0001-01-01T00:00:00Z",
        "generatorURL": "http://prometheus.example:9090/graph?g0.expr=max+by+%28run%29+%28moeguard_run_halted%29+%3D%3D+1",
        "fingerprint": hashlib.sha256(json.dumps(lab, sort_keys=True).encode()).hexdigest()[:16],
    }


def am_payload(*alerts: dict[str, Any]) -> dict[str, Any]:
    first = alerts[0]["labels"]
    group = {"alertname": first["alertname"], "run": first["run"]}
    return {
        "version": "4",
        "groupKey": f'{{}}:{{alertname="{group["alertname"]}", run="{group["run"]}"}}',
        "truncatedAlerts": 0,
        "status": "firing" if any(a["status"] == "firing" for a in alerts) else "resolved",
        "receiver": "moeguard-pager",
        "groupLabels": group,
        "commonLabels": first,
        "commonAnnotations": {},
        "externalURL": "http://alertmanager.example:9093",
        "alerts": list(alerts),
    }


def pd_events(
    sink: RecordingSink, action: str | None = None, cls: str | None = None, accepted: bool = True
) -> list[Recorded]:
    out = []
    for r in sink.received(PD):
        if accepted and r.status >= 300:
            continue
        if action and r.json.get("event_action") != action:
            continue
        if cls and r.json.get("payload", {}).get("class") != cls:
            continue
        out.append(r)
    return out


_markers = iter(range(10**6))


def flush(pager: PagerProc, sink: RecordingSink) -> None:
    """Post a fresh critical alert and wait until all three sinks have it (see module doc)."""
    run = f"marker-{next(_markers)}"
    assert pager.post("/v1/alertmanager", am_payload(am_alert("RunHalted", run=run)))[0] == 200
    for path in (PD, SLACK, HOOK):
        sink.wait_for(lambda r, p=path: r.path == p and r.status < 300 and run in r.body.decode())


def triggers_for(sink: RecordingSink, run: str) -> list[Recorded]:
    return [r for r in pd_events(sink, "trigger") if r.json["payload"]["group"] == run]


def not_marker(r: Recorded) -> bool:
    return b"marker-" not in r.body


# ---------------------------------------------------------------------------------------
# Pure pieces (in-process)
# ---------------------------------------------------------------------------------------
def test_dedup_key_is_stable_short_and_ignores_ranks_and_external_labels() -> None:
    a = incident_identity(
        {
            "alertname": "HeartbeatLost",
            "run": "r1",
            "rank": "3",
            "severity": "critical",
            "scope": "run",
            "runbook_base": RUNBOOKS,
            "cluster": "eu",
        }
    )
    b = incident_identity({"alertname": "HeartbeatLost", "run": "r1", "rank": "7", "severity": "critical"})
    assert dedup_key(a) == dedup_key(b)
    assert dedup_key(a).startswith("moeguard-HeartbeatLost-")
    huge = dedup_key({"alertname": "X" * 1000, "run": "r" * 5000})
    assert len(huge) <= 255
    assert dedup_key({"alertname": "HeartbeatLost", "run": "r2", "severity": "critical"}) != dedup_key(a)
    # per-layer alerts are separate incidents per layer
    l3 = {"alertname": "ExpertCollapse", "run": "r1", "layer": "3", "severity": "critical"}
    assert dedup_key(l3) != dedup_key(l3 | {"layer": "4"})


def test_halt_event_and_runhalted_alert_share_an_incident() -> None:
    ev = parse_event(
        {"run": "r1", "step": 9, "kind": schema.EV_HALT, "action": schema.ACT_HALT}, ttl_s=60, now=0
    )
    [al] = parse_alertmanager(am_payload(am_alert("RunHalted", run="r1")))
    assert ev.key == al.key


def test_pagerduty_body_limits_and_nan_safety() -> None:
    [u] = parse_alertmanager(am_payload(am_alert("LossSpike", run="r1")))
    u.annotations["summary"] = "s" * 5000
    book = IncidentBook()
    book.apply([u], now=0)
    inc = book.snapshot(u.key)
    sink = PagerDutySink("http://x", "", ROUTING_KEY, "critical")
    body = sink.body(inc, FIRING)
    assert len(body["payload"]["summary"]) == 1024
    assert body["payload"]["severity"] == "critical" and body["routing_key"] == ROUTING_KEY
    assert json_safe({"v": float("nan"), "l": [float("inf")]}) == {"v": "nan", "l": ["inf"]}


def test_flags_and_environment_make_the_config() -> None:
    import argparse

    from guard.pager.main import config_from_args, configure

    parser = argparse.ArgumentParser()
    configure(parser)
    args = parser.parse_args(["--webhook-url", "http://h/x", "--max-attempts", "2", "--retry-deadline", "9"])
    cfg = config_from_args(args, env={ENV_PAGER_TOKEN: "tok", "MOEGUARD_PAGERDUTY_ROUTING_KEY": "rk"})
    assert cfg.token == "tok" and cfg.receivers.routing_key == "rk"
    assert cfg.receivers.webhook_urls == ("http://h/x",) and cfg.receivers.slack_url is None
    assert cfg.retry.max_attempts == 2 and cfg.retry.deadline_s == 9.0 and cfg.retry.base_s == 1.0


def test_event_only_incident_is_forgotten_after_its_ttl_without_a_resolve() -> None:
    book = IncidentBook()
    ev = parse_event({"run": "r1", "kind": schema.EV_HALT}, ttl_s=60, now=0)
    book.apply([ev], now=0)
    assert delivery_needed(book.snapshot(ev.key), None) == FIRING
    book.record(ev.key, "pagerduty", FIRING, None)
    assert book.expire_events(now=30) == 0
    assert book.expire_events(now=61) == 1
    assert book.snapshot(ev.key) is None  # forgotten, not resolved: a human closes the page
    # an incident Alertmanager knows about never expires that way
    [al] = parse_alertmanager(am_payload(am_alert("RunHalted", run="r2")))
    book.apply([al], now=0)
    assert book.expire_events(now=10**9) == 0 and book.snapshot(al.key)["status"] == FIRING


def test_alertmanager_takes_over_an_incident_opened_by_an_event() -> None:
    book = IncidentBook()
    ev = parse_event({"run": "r1", "kind": schema.EV_HALT}, ttl_s=3600, now=0)
    book.apply([ev], now=0)
    book.record(ev.key, "pagerduty", FIRING, None)
    [firing] = parse_alertmanager(am_payload(am_alert("RunHalted")))
    book.apply([firing], now=1)
    inc = book.snapshot(ev.key)
    assert delivery_needed(inc, inc["sent"]["pagerduty"]) is None  # same incident: no second page
    [resolved] = parse_alertmanager(am_payload(am_alert("RunHalted", "resolved")))
    book.apply([resolved], now=2)
    inc = book.snapshot(ev.key)
    assert inc["members"] == {} and delivery_needed(inc, FIRING) == RESOLVED


def test_state_file_round_trip(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    book = IncidentBook(state)
    [u] = parse_alertmanager(am_payload(am_alert("RunHalted")))
    book.apply([u], now=time.time())
    book.record(u.key, "pagerduty", FIRING, None)
    again = IncidentBook(state)
    assert again.snapshot(u.key)["sent"] == {"pagerduty": FIRING}
    state.write_text('{"version": 99, "incidents": {}}')
    with pytest.raises(SystemExit, match="version 99"):
        IncidentBook(state)


def test_port_in_use_is_a_clean_error(sink: RecordingSink, tmp_path: Path) -> None:
    first = start_pager(sink, tmp_path)
    try:
        r = subprocess.run(
            [sys.executable, "-m", "guard", "pager", "--port", str(first.port)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert r.returncode == 2 and "cannot listen on 127.0.0.1" in r.stderr and "Traceback" not in r.stderr
    finally:
        first.stop()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        ([], "expected a JSON object"),
        ({"version": "3", "alerts": []}, "unsupported payload version"),
        ({"version": "4", "alerts": "nope"}, "'alerts' must be a list"),
        ({"version": "4", "alerts": [{"status": "firing", "labels": {"run": "r1"}}]}, "no alertname"),
        ({"version": "4", "alerts": [{"status": "weird", "labels": {"alertname": "A"}}]}, "status must be"),
        ({"version": "4", "alerts": [{"status": "firing", "labels": {"alertname": 1}}]}, "string to string"),
    ],
)
def test_parse_alertmanager_rejects_malformed(body: Any, message: str) -> None:
    with pytest.raises(PayloadError, match=re.escape(message)):
        parse_alertmanager(body)


# ---------------------------------------------------------------------------------------
# The real service
# ---------------------------------------------------------------------------------------
def test_firing_alert_becomes_one_pagerduty_trigger_with_runbook_link(
    pager: PagerProc, sink: RecordingSink
) -> None:
    t0 = time.monotonic()
    status, reply = pager.post("/v1/alertmanager", am_payload(am_alert("RunHalted")))
    assert status == 200 and reply["status"] == "accepted" and len(reply["incidents"]) == 1
    [req] = sink.wait_for(lambda r: r.path == PD)
    assert req.status == 202 and time.monotonic() - t0 < 5
    pd = req.json
    assert pd["routing_key"] == ROUTING_KEY
    assert pd["event_action"] == "trigger"
    assert pd["dedup_key"] == reply["incidents"][0] and len(pd["dedup_key"]) <= 255
    p = pd["payload"]
    assert p["summary"] == "RunHalted in run r1"
    assert p["severity"] == "critical" and p["class"] == "RunHalted" and p["group"] == "r1"
    assert p["source"] == "moeguard/r1" and p["component"] == "run"
    assert p["custom_details"]["description"].startswith("Run r1: RunHalted")
    assert {"href": f"{RUNBOOKS}/playbooks/RunHalted.md", "text": "Playbook: RunHalted"} in pd["links"]
    assert pd["client_url"] == "http://alertmanager.example:9093"


def test_slack_and_webhook_receive_the_incident(pager: PagerProc, sink: RecordingSink) -> None:
    pager.post("/v1/alertmanager", am_payload(am_alert("RunHalted")))
    [slack] = sink.wait_for(lambda r: r.path == SLACK)
    [hook] = sink.wait_for(lambda r: r.path == HOOK)
    s = slack.json
    assert s["text"].startswith("[FIRING CRITICAL] RunHalted in run r1")
    assert f"<{RUNBOOKS}/playbooks/RunHalted.md|Playbook: RunHalted>" in s["text"]
    blocks = json.dumps(s["blocks"])
    assert f"<{RUNBOOKS}/playbooks/RunHalted.md|Playbook: RunHalted>" in blocks
    assert "&lt;details&gt; &amp; more" in blocks  # Slack mrkdwn escaping
    assert {b["type"] for b in s["blocks"]} >= {"header", "section", "context"}
    h = hook.json
    assert h["status"] == "firing" and h["alertname"] == "RunHalted" and h["run"] == "r1"
    assert h["runbook_url"] == f"{RUNBOOKS}/playbooks/RunHalted.md"
    assert h["dedup_key"].startswith("moeguard-RunHalted-")


def test_repeated_firing_does_not_page_again_and_resolve_uses_same_key(
    pager: PagerProc, sink: RecordingSink
) -> None:
    firing = am_payload(am_alert("GuardRollbackStorm"))
    pager.post("/v1/alertmanager", firing)
    [trig] = sink.wait_for(lambda r: r.path == PD)
    key = trig.json["dedup_key"]
    for _ in range(3):  # Alertmanager's repeat_interval re-sends
        assert pager.post("/v1/alertmanager", firing)[0] == 200
    flush(pager, sink)
    assert len([r for r in sink.received(PD) if not_marker(r)]) == 1
    assert len([r for r in sink.received(SLACK) if not_marker(r)]) == 1

    resolved = am_payload(am_alert("GuardRollbackStorm", "resolved"))
    pager.post("/v1/alertmanager", resolved)
    [res] = sink.wait_for(lambda r: r.path == PD and r.json["event_action"] == "resolve")
    assert res.json == {"routing_key": ROUTING_KEY, "dedup_key": key, "event_action": "resolve"}
    sink.wait_for(lambda r: r.path == SLACK and r.json["text"].startswith("[RESOLVED]"))
    pager.post("/v1/alertmanager", resolved)  # a duplicate resolve is a no-op
    flush(pager, sink)
    assert len([r for r in pd_events(sink, "resolve") if not_marker(r)]) == 1


def test_429_then_202_is_retried_and_delivered_once(pager: PagerProc, sink: RecordingSink) -> None:
    sink.fail_next(1, status=429, path=PD, headers={"Retry-After": "0"})
    sink.fail_next(2, status=503, path=SLACK)
    pager.post("/v1/alertmanager", am_payload(am_alert("NonFiniteLoss")))
    sink.wait_for(lambda r: r.path == PD and r.status == 202)
    sink.wait_for(lambda r: r.path == SLACK and r.status == 202)
    flush(pager, sink)
    pd = [r for r in sink.received(PD) if not_marker(r)]
    assert [r.status for r in pd] == [429, 202]
    assert pd[0].json == pd[1].json  # the same event, re-sent
    assert [r.status for r in sink.received(SLACK) if not_marker(r)] == [503, 503, 202]


def test_sends_are_off_the_request_path(pager: PagerProc, sink: RecordingSink) -> None:
    sink.fail_next(1, status=503, path=PD, headers={"Retry-After": "1"})
    t0 = time.monotonic()
    assert pager.post("/v1/alertmanager", am_payload(am_alert("RunHalted")))[0] == 200
    answered = time.monotonic() - t0
    sink.wait_for(lambda r: r.path == PD and r.status == 202)
    delivered = time.monotonic() - t0
    assert answered < 0.4 < delivered, (answered, delivered)


def test_non_retryable_error_is_redriven_by_the_next_alertmanager_repeat(
    pager: PagerProc, sink: RecordingSink
) -> None:
    sink.fail_next(1, status=400, path=PD)
    firing = am_payload(am_alert("HeartbeatLost", rank="4"))
    pager.post("/v1/alertmanager", firing)
    sink.wait_for(lambda r: r.path == PD and r.status == 400)
    # the sink records the 400 before the pager has processed the answer: poll
    health = wait_until(lambda: (h := http_json(pager.url + "/healthz")[1])["failing"] == 1 and h, timeout=5)
    assert health["sinks"]["pagerduty"]["failed"] == 1
    pager.post("/v1/alertmanager", firing)  # repeat_interval
    sink.wait_for(lambda r: r.path == PD and r.status == 202)
    assert [r.status for r in sink.received(PD)] == [400, 202]


def test_connection_errors_are_retried_then_reported(sink: RecordingSink, tmp_path: Path) -> None:
    dead = f"http://127.0.0.1:{free_port()}/nobody-listens"
    p = start_pager(sink, tmp_path, "--webhook-url", dead, "--max-attempts", "3")
    try:
        p.post("/v1/alertmanager", am_payload(am_alert("RunHalted")))
        sink.wait_for(lambda r: r.path == PD)  # the healthy receivers are not held up
        wait_until(lambda: http_json(p.url + "/healthz")[1]["sinks"]["webhook-1"]["failed"] == 1, timeout=10)
        assert "ConnectError" in p.log.read_text() and "gave up after 3 attempts" in p.log.read_text()
    finally:
        p.stop()


def test_ranks_fold_into_one_incident_resolved_by_the_last_rank(
    pager: PagerProc, sink: RecordingSink
) -> None:
    ranks = [am_alert("HeartbeatLost", rank=str(r)) for r in (1, 2, 10)]
    pager.post("/v1/alertmanager", am_payload(*ranks))
    [trig] = sink.wait_for(lambda r: r.path == PD)
    assert trig.json["payload"]["component"] == "rank 1, 2, 10"
    assert trig.json["payload"]["custom_details"]["ranks"] == ["1", "2", "10"]
    # ranks 1 and 2 come back: still firing, nothing sent
    pager.post(
        "/v1/alertmanager",
        am_payload(
            *[am_alert("HeartbeatLost", "resolved", rank=r) for r in ("1", "2")],
            am_alert("HeartbeatLost", rank="10"),
        ),
    )
    flush(pager, sink)
    assert [r.json["event_action"] for r in sink.received(PD) if not_marker(r)] == ["trigger"]
    pager.post("/v1/alertmanager", am_payload(am_alert("HeartbeatLost", "resolved", rank="10")))
    [res] = sink.wait_for(lambda r: r.path == PD and r.json["event_action"] == "resolve")
    assert res.json["dedup_key"] == trig.json["dedup_key"]


def test_warnings_go_to_slack_and_webhooks_but_do_not_page(pager: PagerProc, sink: RecordingSink) -> None:
    pager.post("/v1/alertmanager", am_payload(am_alert("MFUDrop", severity="warning")))
    sink.wait_for(lambda r: r.path == SLACK and "MFUDrop" in r.json["text"])
    sink.wait_for(lambda r: r.path == HOOK and r.json["alertname"] == "MFUDrop")
    flush(pager, sink)
    assert pd_events(sink, cls="MFUDrop") == []


def test_guard_halt_event_pages_and_dedupes_with_the_prometheus_alert(
    pager: PagerProc, sink: RecordingSink
) -> None:
    event = {
        "run": "r7",
        "step": 1234,
        "kind": schema.EV_HALT,
        "detector": schema.DET_NONFINITE,
        "value": float("nan"),
        "threshold": 0.0,
        "action": schema.ACT_HALT,
        "detail": json.dumps({"rollbacks": 3, "severity": "critical"}),
    }
    status, reply = pager.post("/v1/events", event)
    assert status == 200, reply
    [trig] = sink.wait_for(lambda r: r.path == PD)
    assert trig.json["dedup_key"] == reply["dedup_key"]
    p = trig.json["payload"]
    assert p["summary"] == "Run r7 halted itself at step 1234" and p["class"] == "RunHalted"
    assert p["custom_details"]["event"]["value"] == "nan"  # NaN made JSON-safe
    assert p["custom_details"]["runbook_url"] == "playbooks/RunHalted.md"  # no --runbook-base: relative
    # a minute later Prometheus' RunHalted arrives for the same run: same incident, no new page
    pager.post("/v1/alertmanager", am_payload(am_alert("RunHalted", run="r7")))
    pager.post("/v1/events", event)  # the collector retrying its post: no new page either
    flush(pager, sink)
    assert len(triggers_for(sink, "r7")) == 1
    pager.post("/v1/alertmanager", am_payload(am_alert("RunHalted", "resolved", run="r7")))
    [res] = sink.wait_for(lambda r: r.path == PD and r.json["event_action"] == "resolve")
    assert res.json["dedup_key"] == reply["dedup_key"]


@pytest.mark.parametrize(
    ("path", "body", "message"),
    [
        ("/v1/alertmanager", b"{not json", "not valid JSON"),
        ("/v1/alertmanager", {"version": "4", "alerts": "nope"}, "'alerts' must be a list"),
        (
            "/v1/alertmanager",
            {"version": "4", "alerts": [{"status": "firing", "labels": {}}]},
            "no alertname",
        ),
        ("/v1/events", {"kind": "halt"}, "run must be a non-empty string"),
        ("/v1/events", {"run": "r1", "kind": "meltdown"}, "kind must be one of"),
        ("/v1/events", {"run": "r1", "kind": "halt", "step": "12"}, "step must be an integer"),
    ],
)
def test_malformed_requests_get_400_with_a_reason(
    shared_pager: PagerProc, path: str, body: Any, message: str
) -> None:
    status, reply = shared_pager.post(path, body)
    assert status == 400
    assert message in reply["error"]
    assert http_json(shared_pager.url + "/healthz")[1]["incidents"] == 0


def test_restart_with_state_does_not_repage(sink: RecordingSink, tmp_path: Path) -> None:
    first = start_pager(sink, tmp_path)
    try:
        firing = am_payload(am_alert("RunHalted", run="r3"))
        first.post("/v1/alertmanager", firing)
        [trig] = sink.wait_for(lambda r: r.path == PD)
    finally:
        first.stop()
    second = start_pager(sink, tmp_path)
    try:
        second.post("/v1/alertmanager", firing)
        flush(second, sink)
        assert len(triggers_for(sink, "r3")) == 1
        second.post("/v1/alertmanager", am_payload(am_alert("RunHalted", "resolved", run="r3")))
        [res] = sink.wait_for(lambda r: r.path == PD and r.json["event_action"] == "resolve")
        assert res.json["dedup_key"] == trig.json["dedup_key"]
    finally:
        second.stop()


def test_undelivered_page_is_sent_after_a_restart(sink: RecordingSink, tmp_path: Path) -> None:
    sink.fail_next(1000, status=500, path=PD)
    first = start_pager(sink, tmp_path, "--max-attempts", "2")
    try:
        first.post("/v1/alertmanager", am_payload(am_alert("RunHalted", run="r4")))
        sink.wait_for(lambda r: r.path == PD, count=2)
    finally:
        first.stop()
    sink.clear_failures()  # PagerDuty is back
    second = start_pager(sink, tmp_path)  # no new alert: the state file says r4 is owed a page
    try:
        [ok] = sink.wait_for(lambda r: r.path == PD and r.status == 202)
        assert ok.json["event_action"] == "trigger" and ok.json["payload"]["group"] == "r4"
    finally:
        second.stop()


def test_bearer_token_is_enforced_when_configured(sink: RecordingSink, tmp_path: Path) -> None:
    p = start_pager(sink, tmp_path, env={ENV_PAGER_TOKEN: "s3cret"})
    try:
        body = am_payload(am_alert("RunHalted"))
        assert p.post("/v1/alertmanager", body)[0] == 401
        assert p.post("/v1/alertmanager", body, headers={"Authorization": "Bearer wrong"})[0] == 401
        assert p.post("/v1/alertmanager", body, headers={"Authorization": "Bearer s3cret"})[0] == 200
        assert http_json(p.url + "/healthz")[0] == 200  # health stays open
    finally:
        p.stop()


# ---------------------------------------------------------------------------------------
# End to end: metrics -> Prometheus (real rules) -> Alertmanager (real config) -> pager
# ---------------------------------------------------------------------------------------
@pytest.fixture
def processes() -> Iterator[list[subprocess.Popen]]:
    procs: list[subprocess.Popen] = []
    yield procs
    for p in procs:
        if p.poll() is None:
            p.terminate()
    for p in procs:
        try:
            p.wait(10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)


@pytest.mark.integration
@pytest.mark.timeout(120)
@pytest.mark.skipif(
    PROMETHEUS is None or ALERTMANAGER is None,
    reason="needs the prometheus and prometheus-alertmanager binaries (Debian packages)",
)
def test_end_to_end_runhalted_pages_and_resolves(
    sink: RecordingSink, tmp_path: Path, processes: list[subprocess.Popen]
) -> None:
    from prometheus_client import CollectorRegistry, Gauge, start_http_server

    reg = CollectorRegistry()
    halted = Gauge(schema.M_HALTED, "1 when the run halted itself", ["run"], registry=reg)
    step = Gauge(schema.M_STEP, "last step", ["run"], registry=reg)
    load_entropy = Gauge(
        schema.M_LAYER_LOAD_ENTROPY, "normalised load entropy", ["run", "layer"], registry=reg
    )
    halted.labels(run="r1").set(1)
    step.labels(run="r1").set(420)
    metrics_server, _ = start_http_server(0, addr="127.0.0.1", registry=reg)
    try:
        pager = start_pager(sink, tmp_path / "pager")
        try:
            _run_stack(sink, tmp_path, processes, pager, metrics_server.server_port, halted, load_entropy)
        finally:
            pager.stop()
    finally:
        metrics_server.shutdown()
        metrics_server.server_close()


def _run_stack(
    sink: RecordingSink,
    tmp: Path,
    processes: list[subprocess.Popen],
    pager: PagerProc,
    metrics_port: int,
    halted: Any,
    load_entropy: Any,
) -> None:
    am = start_alertmanager(tmp, pager.port)
    processes.append(am.proc)
    prom = start_prometheus(tmp, [f"127.0.0.1:{metrics_port}"], am.port, fast_rules(RULES.read_text()))
    processes.append(prom.proc)
    wait_http(f"{am.url}/-/ready", timeout=30)
    wait_http(f"{prom.url}/-/ready", timeout=30)

    def is_pd(action: str, cls: str, run: str) -> Any:
        return lambda r: (
            r.path == PD
            and r.status == 202
            and r.json["event_action"] == action
            and (
                action == "resolve"
                or (r.json["payload"]["class"] == cls and r.json["payload"]["group"] == run)
            )
        )

    # 1) RunHalted fires: a PagerDuty trigger with the absolute playbook link from the external label
    [trig] = sink.wait_for(is_pd("trigger", "RunHalted", "r1"), timeout=30)
    pd = trig.json
    assert pd["routing_key"] == ROUTING_KEY
    assert pd["payload"]["summary"] == "Run r1 halted itself"
    assert "halted run r1 at step 420 after" in pd["payload"]["custom_details"]["description"]
    assert {"href": f"{RUNBOOKS}/playbooks/RunHalted.md", "text": "Playbook: RunHalted"} in pd["links"]

    # 2) Inhibition: with RunHalted(r1) firing, r1's per-layer collapse is muted; r2's is not.
    #    Both ExpertCollapse tiers fire at once here (for: 0s); the critical one mutes the warning.
    load_entropy.labels(run="r1", layer="3").set(0.2)
    load_entropy.labels(run="r2", layer="5").set(0.2)
    sink.wait_for(
        lambda r: r.path == HOOK and r.json["alertname"] == "ExpertCollapse" and r.json["run"] == "r2",
        timeout=30,
    )
    time.sleep(3)  # r1's group had the same timers; give it ample time to (wrongly) show up
    collapse = [r.json for r in sink.received(HOOK) if r.json["alertname"] == "ExpertCollapse"]
    assert [(c["run"], c["layer"], c["severity"]) for c in collapse] == [("r2", "5", "critical")], collapse

    # 3) The run is resumed: RunHalted resolves with the same dedup_key
    halted.labels(run="r1").set(0)
    [res] = sink.wait_for(
        lambda r: (
            r.path == PD and r.json["event_action"] == "resolve" and r.json["dedup_key"] == pd["dedup_key"]
        ),
        timeout=30,
    )
    assert res.json == {"routing_key": ROUTING_KEY, "dedup_key": pd["dedup_key"], "event_action": "resolve"}
    # 4) The Watchdog went to the blackhole, never to a human
    assert not any(b"Watchdog" in r.body for r in sink.received())
