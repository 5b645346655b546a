"""`moeguard pager` under abuse and crashes (issue #13, items 5 and 6): no webhook secret in any
log or file, a delivery that costs the same whatever the size of the incident book, nothing
acknowledged lost on kill -9, and request bodies bounded while they stream in.

The real service (`python -m guard pager`) runs on loopback against recording HTTP servers
standing in for PagerDuty, Slack and webhooks; the journal tests drive IncidentBook in-process.
"""

from __future__ import annotations

import json
import os
import re
import select
import signal
import socket
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

from guard.pager import journal  # noqa: E402
from guard.pager.book import PRUNE_AFTER_S, IncidentBook  # noqa: E402
from guard.pager.config import PagerConfig, Receivers  # noqa: E402
from guard.pager.intake import FIRING, MAX_JSON_DEPTH, parse_alertmanager  # noqa: E402
from guard.pager.journal import COMPACT_FACTOR, STATE_VERSION, journal_path, read_state  # noqa: E402
from guard.wire.redact import redact_url, redact_urls  # noqa: E402
from tests.helpers_alerting import HOOK, PD, SLACK, PagerProc, start_pager  # noqa: E402
from tests.helpers_http import CLIENT_GONE, RecordingSink, free_port, http_json, wait_until  # noqa: E402

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
        Receivers(slack_url="hooks.slack.com/services/T0/B0/XyZ")
    receivers = Receivers(slack_url="https://hooks.slack.com/services/T0/B0/XyZ", routing_key="RKEY")
    assert not {"XyZ", "RKEY"} & set(re.split(r"\W+", repr(PagerConfig(receivers=receivers))))


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
        p = start_pager(
            sink,
            tmp_path,
            "--slack-url",
            sink.url + slack_path,
            "--webhook-url",
            sink.url + hook_path,  # webhook-1
            "--webhook-url",
            f"http://127.0.0.1:{free_port()}/x/{secrets['dead']}",  # webhook-2
            "--webhook-url",
            f"{echo.url}/{secrets['echo']}",  # webhook-3
            "--max-attempts",
            "2",
            "--log-level",
            "debug",
        )
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
            p.stop()  # SIGTERM: the state is compacted into its snapshot on the way out
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
    assert {f.name for f in files} >= {STATE, STATE + ".journal", p.log.name}
    state = json.loads((tmp_path / STATE).read_text())
    [inc] = state["incidents"].values()
    assert inc["errors"]["webhook-3"].startswith(f'HTTP 400: {{"error": "no such hook: {echo.url}')


# ---------------------------------------------------------------------------------------
# 2. Incremental persistence: journal, compaction, crashes
# ---------------------------------------------------------------------------------------
def fill(book: IncidentBook, runs: range) -> list[str]:
    return book.apply(parse_alertmanager(payload(*(alert(f"r{i}", rank="0") for i in runs))), time.time())


def live(book: IncidentBook) -> dict[str, Any]:
    return {k: book.snapshot(k) for k in book.keys()}


def test_journal_round_trips_and_compacts_at_start(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    journal = journal_path(state)
    book = IncidentBook(state)
    assert (
        json.loads(journal.read_text()) == {"generation": 1}
        and json.loads(state.read_text())["incidents"] == {}
    )
    keys = fill(book, range(20))
    snapshot = state.stat()
    book.record(keys[0], "slack", FIRING, None)
    book.record(keys[1], "pagerduty", None, "HTTP 503")
    book.record(keys[1], "pagerduty", FIRING, None)
    assert book.expire_events(time.time() + 2 * PRUNE_AFTER_S) == 0
    # Changes went to the journal, one line per batch; the snapshot was not rewritten.
    assert (state.stat().st_ino, state.stat().st_mtime_ns) == (snapshot.st_ino, snapshot.st_mtime_ns)
    assert len(journal.read_bytes().splitlines()) == 1 + 1 + 3  # header, the apply, three records
    assert read_state(state) == (1, live(book))
    assert live(book)[keys[1]]["sent"] == {"pagerduty": FIRING} and live(book)[keys[1]]["errors"] == {}

    again = IncidentBook(state)  # a restart replays, then compacts into generation 2
    assert live(again) == live(book)
    assert json.loads(journal.read_text()) == {"generation": 2}
    assert json.loads(state.read_text())["generation"] == 2 and read_state(state) == (2, live(book))


def test_a_delivery_appends_the_same_bytes_whatever_the_book_size(tmp_path: Path) -> None:
    """The quadratic cost of issue #13 was a rewrite of the whole book per delivery."""
    grown = []
    for n in (10, 1000):
        state = tmp_path / f"{n}" / "state.json"
        state.parent.mkdir()
        book = IncidentBook(state)
        key = fill(book, range(n))[0]
        before = journal_path(state).stat().st_size
        book.record(key, "slack", FIRING, None)
        grown.append(journal_path(state).stat().st_size - before)
    assert grown[0] == grown[1] < 200, grown


def test_journal_compacts_when_it_outgrows_the_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(journal, "COMPACT_MIN_BYTES", 0)
    state = tmp_path / "state.json"
    book = IncidentBook(state)
    keys = fill(book, range(10))
    for i in range(500):
        book.record(keys[i % 10], f"sink{i % 3}", FIRING if i % 2 else None, f"HTTP 50{i % 4}")
        assert journal_path(state).stat().st_size <= COMPACT_FACTOR * state.stat().st_size + 200
    generation, incidents = read_state(state)
    assert generation >= 3 and incidents == live(book)  # two compactions by size


def test_compact_if_idle_leaves_the_snapshot_current(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    book = IncidentBook(state)
    fill(book, range(3))
    assert not book.compact_if_idle(idle_s=3600)  # not idle yet
    wait_until(lambda: book.compact_if_idle(idle_s=0), timeout=5)  # after COMPACT_DUTY x the last one
    assert json.loads(state.read_text())["incidents"] == live(book)
    assert not book.compact_if_idle(idle_s=0)  # nothing new


def test_torn_last_line_is_ignored_and_damage_elsewhere_is_refused(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    book = IncidentBook(state)
    keys = fill(book, range(5))
    book.record(keys[0], "slack", FIRING, None)
    acknowledged = live(book)
    journal = journal_path(state)
    intact = journal.read_bytes()
    journal.write_bytes(intact + b'{"ops":[["sent","' + keys[1].encode())  # kill -9 inside an append
    assert read_state(state)[1] == acknowledged
    assert live(IncidentBook(state)) == acknowledged

    book = IncidentBook(state)
    book.record(keys[2], "slack", FIRING, None)
    lines = journal_path(state).read_bytes().splitlines(keepends=True)
    journal_path(state).write_bytes(lines[0] + b"garbage\n" + b"".join(lines[1:]))
    with pytest.raises(SystemExit, match="line 2 is damaged"):
        IncidentBook(state)


def test_compaction_cut_short_and_a_replaced_snapshot(tmp_path: Path) -> None:
    state = tmp_path / "state.json"
    journal = journal_path(state)
    book = IncidentBook(state)
    keys = fill(book, range(4))
    book.record(keys[0], "slack", FIRING, None)
    old_snapshot, old_journal = state.read_bytes(), journal.read_bytes()  # generation 1
    book.checkpoint()  # snapshot 2, then journal 2
    acknowledged = live(book)
    journal.write_bytes(old_journal)  # killed between the snapshot and the new journal
    assert read_state(state) == (2, acknowledged)  # journal 1 is inside snapshot 2: not replayed
    assert live(IncidentBook(state)) == acknowledged

    state.write_bytes(old_snapshot)  # generation 1 under journal 3: someone restored a backup
    with pytest.raises(SystemExit, match="replaced by hand"):
        IncidentBook(state)


def test_version_1_state_file_is_read_and_rewritten(tmp_path: Path) -> None:
    legacy = IncidentBook()
    fill(legacy, range(3))
    state = tmp_path / "state.json"
    state.write_text(json.dumps({"version": 1, "incidents": live(legacy)}))
    book = IncidentBook(state)
    assert live(book) == live(legacy)
    assert json.loads(state.read_text())["version"] == STATE_VERSION


def test_the_sink_does_not_accept_half_a_body(sink: RecordingSink) -> None:
    """A sender killed mid-send leaves half a body: the stand-in receiver must not count it as
    delivered (CI once saw a kill -9 land mid-request and the half body read as a 202)."""
    with socket.create_connection(("127.0.0.1", int(sink.url.rsplit(":", 1)[1])), timeout=10) as s:
        s.sendall(f'POST {SLACK} HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{{"text": '.encode())
    [got] = sink.wait_for(lambda r: r.path == SLACK)
    assert (got.status, got.json, got.body) == (CLIENT_GONE, None, b'{"text": ')
    assert runs_sent(sink, SLACK) == []


def test_kill_9_loses_nothing_acknowledged(sink: RecordingSink, tmp_path: Path) -> None:
    sink.fail_next(10**6, status=500, path=PD)  # PagerDuty is down: every page stays owed
    p = start_pager(sink, tmp_path, "--max-attempts", "1")
    delivered = [f"d{i}" for i in range(10)]
    for run in delivered:
        assert p.post("/v1/alertmanager", payload(alert(run)))[0] == 200
    sink.wait_for(lambda r: r.path == SLACK and r.status == 202, count=len(delivered))
    wait_until(  # Slack's deliveries are on disk (recorded right after each answer)
        lambda: sum(i["sent"].get("slack") == FIRING for i in read_state(tmp_path / STATE)[1].values()) == 10,
        timeout=10,
    )
    in_flight = [f"f{i}" for i in range(10)]
    for run in in_flight:
        assert p.post("/v1/alertmanager", payload(alert(run)))[0] == 200
    os.kill(p.proc.pid, signal.SIGKILL)  # right after the last 200: deliveries in flight
    p.proc.wait(10)

    sink.clear_failures()  # PagerDuty is back
    q = start_pager(sink, tmp_path)
    try:
        sink.wait_for(lambda r: r.path == PD and r.status == 202, count=20, timeout=30)
        flush(q, sink)
        assert sorted(runs_sent(sink, PD)) == sorted(delivered + in_flight)  # each acknowledged alert, once
        slack = runs_sent(sink, SLACK)
        assert [r for r in slack if r in delivered] == delivered  # recorded before the kill: no re-page
        assert set(in_flight) <= set(slack)  # at least once
    finally:
        q.stop()


# ---------------------------------------------------------------------------------------
# 3. Request bodies: bounded while streaming, deep nesting refused
# ---------------------------------------------------------------------------------------
def raw_request(port: int, head: str, body: Iterator[bytes]) -> tuple[bytes, int]:
    """Send `head`, then `body` piece by piece until the server answers. (answer, bytes sent)."""
    sent = 0
    with socket.create_connection(("127.0.0.1", port), timeout=30) as s:
        s.sendall(head.encode())
        try:
            readable = select.select([s], [], [], 0.5)[0]
            for piece in body:
                if readable:
                    break
                s.sendall(piece)
                sent += len(piece)
                readable = select.select([s], [], [], 0)[0]
        except OSError:  # it hung up while we were sending: read what it said
            pass
        answer = b""
        try:
            while chunk := s.recv(65536):
                answer += chunk
        except OSError:
            pass
    return answer, sent


def answer_json(answer: bytes) -> tuple[int, Any]:
    head, _, body = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), json.loads(body)


@pytest.fixture
def limited(sink: RecordingSink, tmp_path: Path) -> Iterator[PagerProc]:
    p = start_pager(sink, tmp_path, "--max-body-bytes", str(1 << 20))
    yield p
    p.stop()


def test_content_length_over_the_limit_gets_413_before_the_body(limited: PagerProc) -> None:
    peak = vm_kib(limited.proc.pid, "VmHWM")
    head = (
        "POST /v1/alertmanager HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {200 << 20}\r\n\r\n"
    )
    answer, sent = raw_request(limited.port, head, iter([b"[" * (1 << 20)] * 200))
    status, reply = answer_json(answer)
    assert status == 413 and f"over the limit of {1 << 20} bytes" in reply["error"]
    assert b"connection: close" in answer.lower() and sent == 0
    assert vm_kib(limited.proc.pid, "VmHWM") - peak < 8 << 10  # KiB
    assert limited.post("/v1/alertmanager", payload(alert("r1")))[0] == 200  # still serving


def test_chunked_body_past_the_limit_gets_413_while_streaming(limited: PagerProc) -> None:
    peak = vm_kib(limited.proc.pid, "VmHWM")
    head = "POST /v1/events HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    piece = b"[" + b"0," * (1 << 15)  # 64 KiB
    chunks = (b"%x\r\n%s\r\n" % (len(piece), piece) for _ in range((200 << 20) // len(piece)))
    answer, sent = raw_request(limited.port, head, chunks)
    status, reply = answer_json(answer)
    assert status == 413 and "streamed past the limit" in reply["error"]
    assert sent < 32 << 20, f"the client got {sent} bytes out before the answer"  # limit + socket buffers
    assert vm_kib(limited.proc.pid, "VmHWM") - peak < 32 << 10  # KiB
    assert http_json(limited.url + "/healthz")[1]["incidents"] == 0


def test_deeply_nested_json_gets_400_not_500(limited: PagerProc) -> None:
    status, reply = limited.post("/v1/alertmanager", b"[" * 100_000)
    assert status == 400 and f"nested deeper than {MAX_JSON_DEPTH} levels" in reply["error"]
    # Deep enough to pass json.loads, too deep for what the pager does with it (copies, dumps)
    detail: Any = {}
    for _ in range(300):
        detail = {"d": detail}
    status, reply = limited.post("/v1/events", {"run": "r1", "kind": "halt", "detail": detail})
    assert status == 400 and "nested deeper" in reply["error"]
    assert http_json(limited.url + "/healthz")[1]["incidents"] == 0
    status, _ = limited.post(
        "/v1/events", {"run": "r1", "kind": "halt", "detail": {"a": {"b": [1, {"c": 2}]}}}
    )
    assert status == 200
