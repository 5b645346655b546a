"""Test helpers for anything that sends HTTP: a recording sink, free ports, waiting.

    sink = RecordingSink()                     # listens on 127.0.0.1:<free port>
    sink.fail_next(2, status=429, path="/pd")  # the next 2 requests to /pd get 429
    ...                                        # point the code under test at sink.url + "/pd"
    [req] = sink.wait_for(lambda r: r.path == "/pd" and r.status == 202)
    sink.close()

Every request is answered (default 202 with `{"status": "success"}`, what PagerDuty answers)
and recorded with method, path, headers, raw body, parsed JSON (None if not JSON) and the
status it got, in arrival order. A request whose client hung up before its whole body arrived
(a sender killed mid-send) is recorded with status CLIENT_GONE and never answered: no real
receiver accepts half a body, so a test must not count it as delivered.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

CLIENT_GONE = 499  # nginx's "client closed request": recorded, never answered


@dataclass(kw_only=True, slots=True)
class Recorded:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes
    json: Any
    status: int
    time: float = field(default_factory=time.monotonic)


@dataclass(kw_only=True, slots=True)
class _Failure:
    remaining: int
    status: int
    path: str | None
    headers: dict[str, str]


class RecordingSink:
    def __init__(self, default_status: int = 202) -> None:
        self.default_status = default_status
        self.requests: list[Recorded] = []
        self._failures: list[_Failure] = []
        self._cond = threading.Condition()
        sink = self

        class Handler(BaseHTTPRequestHandler):
            def _handle(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                try:
                    parsed = json.loads(body) if body else None
                except ValueError:
                    parsed = None
                complete = len(body) == length
                status, extra = sink._answer(self.path) if complete else (CLIENT_GONE, {})
                rec = Recorded(
                    method=self.command,
                    path=self.path,
                    headers=dict(self.headers.items()),
                    body=body,
                    json=parsed,
                    status=status,
                )
                with sink._cond:  # record before answering: once the client has its reply,
                    sink.requests.append(rec)  # a test that then looks must find the request
                    sink._cond.notify_all()
                if not complete:
                    return
                reply = json.dumps({"status": "success" if status < 300 else "error"}).encode()
                self.send_response(status)
                for k, v in extra.items():
                    self.send_header(k, v)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            do_POST = do_PUT = do_GET = _handle  # noqa: N815

            def log_message(self, format: str, *args: Any) -> None:  # quiet
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="recording-sink", daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def fail_next(
        self, n: int, status: int = 429, path: str | None = None, headers: dict[str, str] | None = None
    ) -> None:
        """Answer the next `n` requests (to `path`, or any path) with `status` and `headers`."""
        with self._cond:
            self._failures.append(_Failure(remaining=n, status=status, path=path, headers=headers or {}))

    def clear_failures(self) -> None:
        with self._cond:
            self._failures.clear()

    def _answer(self, path: str) -> tuple[int, dict[str, str]]:
        with self._cond:
            for f in self._failures:
                if f.remaining > 0 and (f.path is None or f.path == path):
                    f.remaining -= 1
                    return f.status, f.headers
        return self.default_status, {}

    def received(self, path: str | None = None) -> list[Recorded]:
        with self._cond:
            return [r for r in self.requests if path is None or r.path == path]

    def wait_for(
        self, pred: Callable[[Recorded], bool], count: int = 1, timeout: float = 10.0
    ) -> list[Recorded]:
        """Block until `count` recorded requests satisfy `pred`; returns them (AssertionError on timeout)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                hits = [r for r in self.requests if pred(r)]
                if len(hits) >= count:
                    return hits
                left = deadline - time.monotonic()
                if left <= 0:
                    seen = [(r.method, r.path, r.status) for r in self.requests]
                    raise AssertionError(
                        f"timed out after {timeout}s waiting for {count} request(s); got {seen}"
                    )
                self._cond.wait(left)

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self) -> RecordingSink:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def free_port() -> int:
    """A port that was free a moment ago (for binaries that cannot take port 0)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(pred: Callable[[], Any], timeout: float = 10.0, interval: float = 0.05, what: str = "") -> Any:
    """Poll `pred` until it returns something truthy; return it (AssertionError on timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or pred}")
        time.sleep(interval)


def http_json(
    url: str,
    body: Any = None,
    method: str | None = None,
    timeout: float = 5.0,
    headers: dict[str, str] | None = None,
) -> tuple[int, Any]:
    """Tiny stdlib client: (status, parsed JSON or raw text). Never raises on HTTP errors."""
    data = body if isinstance(body, bytes) or body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method or ("POST" if data is not None else "GET"))
    req.add_header("Content-Type", "application/json")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    try:
        return status, json.loads(raw)
    except ValueError:
        return status, raw.decode(errors="replace")


def wait_http(url: str, timeout: float = 20.0) -> None:
    """Wait until GET `url` answers 200 (a server finished starting)."""

    def ok() -> bool:
        try:
            return http_json(url, timeout=1.0)[0] == 200
        except OSError:
            return False

    wait_until(ok, timeout=timeout, interval=0.1, what=f"{url} to answer 200")
