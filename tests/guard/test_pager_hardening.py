"""`moeguard pager` under abuse (issue #13, item 5): no webhook secret in any log or file.

The real service (`python -m guard pager`) runs on loopback against recording HTTP servers
standing in for PagerDuty, Slack and webhooks; the journal tests drive IncidentBook in-process.
"""

from __future__ import annotations

import json
import re
import sys
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # bare `pytest` without an install puts only tests/guard on sys.path
    sys.path.insert(0, str(REPO))

from guard import pager as pg  # noqa: E402
from guard.notify import redact_url, redact_urls  # noqa: E402
from tests.helpers_alerting import HOOK, PD, SLACK, PagerProc, start_pager  # noqa: E402
from tests.helpers_http import RecordingSink, free_port, http_json, wait_until  # noqa: E402

STATE = "pager-state.json"  # what start_pager passes as --state


@pytest.fixture
def sink() -> Iterator[RecordingSink]:
    with RecordingSink() as s:
        yield s


def alert(run: str, status: str = "firing", alertname: str = "RunHalted", **labels: str) -> dict[str, Any]:
    lab = {"alertname": alertname, "run": run, "severity": "critical", **labels}
    return {
        "status": status,
        "labels": lab,
        "annotations": {"summary": f"{alertname} in run {run}"},
        "fingerprint": f"{alertname}-{run}-{labels.get('rank', '')}",
    }


def payload(*alerts: dict[str, Any]) -> dict[str, Any]:
    return {"version": "4", "externalURL": "http://alertmanager.example:9093", "alerts": list(alerts)}


def flush(p: PagerProc, sink: RecordingSink, paths: tuple[str, ...] = (PD, SLACK, HOOK)) -> None:
    """A fresh alert through every sink's FIFO worker: once it is there, nothing older is queued."""
    run = f"marker-{time.monotonic_ns()}"
    assert p.post("/v1/alertmanager", payload(alert(run)))[0] == 200
    for path in paths:
        sink.wait_for(lambda r, p=path: r.path == p and r.status < 300 and run in r.body.decode())


def runs_sent(sink: RecordingSink, path: str, status: str = "firing") -> list[str]:
    """Runs of the accepted deliveries to `path` with `status`, in arrival order (markers left out)."""
    out = []
    for r in sink.received(path):
        if r.status >= 300 or b"marker-" in r.body:
            continue
        if path == PD:
            action = r.json["event_action"]
            if (action == "trigger") == (status == "firing"):
                out.append(r.json["payload"]["group"] if action == "trigger" else r.json["dedup_key"])
        elif path == SLACK:
            if r.json["text"].startswith("[RESOLVED]") == (status == "resolved"):
                out.append(re.search(r"in run (\S+)", r.json["text"]).group(1))
        elif r.json["status"] == status:
            out.append(r.json["run"])
    return out


def vm_kib(pid: int, field: str) -> int:
    m = re.search(rf"^{field}:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text(), re.M)
    assert m, field
    return int(m.group(1))


# ---------------------------------------------------------------------------------------
# 1. No webhook secret in any log line or file the pager writes
# ---------------------------------------------------------------------------------------
class EchoingReceiver:
    """A receiver that refuses every request with 400, quoting the full URL it was called on
    (as some proxies and gateways do): the pager must not copy that into its log or state."""

    def __init__(self) -> None:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                body = json.dumps({"error": f"no such hook: {outer.url}{self.path}"}).encode()
                self.send_response(400)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *a: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def test_redact_urls_keeps_scheme_and_host_only() -> None:
    line = 'HTTP Request: POST https://hooks.slack.com/services/T0/B0/XyZ?a=1 "HTTP/1.1 200 OK"'
    assert redact_urls(line) == 'HTTP Request: POST https://hooks.slack.com "HTTP/1.1 200 OK"'
    assert (
        redact_urls("to http://u:pw@10.0.0.1:8080/p#f, then HTTPS://h/x")
        == "to http://10.0.0.1:8080 then HTTPS://h"
    )
    assert redact_url("hooks.slack.com/services/T0/B0/XyZ") == "hooks.slack.com/..."
    assert redact_url("ftp://u:pw@h/x") == "ftp://h/..."
    with pytest.raises(Exception, match=r"slack_url = 'hooks\.slack\.com/\.\.\.'"):
        pg.PagerConfig(slack_url="hooks.slack.com/services/T0/B0/XyZ")
    assert "XyZ" not in repr(pg.PagerConfig(slack_url="https://hooks.slack.com/services/T0/B0/XyZ"))


def test_no_webhook_secret_in_logs_or_state_at_debug(sink: RecordingSink, tmp_path: Path) -> None:
    secrets = {
        "slack": "T0SECRETSLACK/B0SECRETSLACK/xoxSECRETSLACKtoken",
        "hook": "SECRETHOOKPATH",
        "query": "SECRETQUERYTOKEN",
        "dead": "SECRETDEADPATH",
        "echo": "SECRETECHOPATH",
    }
    slack_path = f"/services/{secrets['slack']}"
    hook_path = f"/hook/{secrets['hook']}?token={secrets['query']}"
    echo = EchoingReceiver()
    try:
        sink.fail_next(1, status=503, path=slack_path)  # a retry, and its log line
        p = start_pager(sink, tmp_path, "--slack-url", sink.url + slack_path,
                        "--webhook-url", sink.url + hook_path,                                    # webhook-1
                        "--webhook-url", f"http://127.0.0.1:{free_port()}/x/{secrets['dead']}",   # webhook-2
                        "--webhook-url", f"{echo.url}/{secrets['echo']}",                         # webhook-3
                        "--max-attempts", "2", "--log-level", "debug")  # fmt: skip
        try:
            assert p.post("/v1/alertmanager", payload(alert("r1")))[0] == 200
            sink.wait_for(lambda r: r.path == slack_path and r.status == 202)
            sink.wait_for(lambda r: r.path == hook_path and r.status == 202)
            wait_until(
                lambda: all(
                    http_json(p.url + "/healthz")[1]["sinks"][w]["failed"] >= 1
                    for w in ("webhook-2", "webhook-3")
                ),
                timeout=15,
                what="the dead and the refusing webhook to fail",
            )
            assert p.post("/v1/alertmanager", payload(alert("r1", "resolved")))[0] == 200
            sink.wait_for(lambda r: r.path == slack_path and r.json["text"].startswith("[RESOLVED]"))
        finally:
            p.stop()
    finally:
        echo.close()

    log = p.log.read_text()
    assert " DEBUG " in log, "the pager should have logged at DEBUG (else this test proves nothing)"
    assert "slack: firing RunHalted" in log and "slack: resolved RunHalted" in log
    assert "webhook-3: could not deliver firing RunHalted" in log
    assert f"no such hook: {echo.url}" in log  # the receiver's answer, its URL cut to scheme://host
    files = {f: f.read_bytes() for f in tmp_path.rglob("*") if f.is_file()}
    for name, secret in secrets.items():
        for f, data in files.items():
            assert secret.encode() not in data, f"{name} secret in {f.name}"
    assert {f.name for f in files} >= {STATE, p.log.name}
    state = json.loads((tmp_path / STATE).read_text())
    [inc] = state["incidents"].values()
    assert inc["errors"]["webhook-3"].startswith(f'HTTP 400: {{"error": "no such hook: {echo.url}')
