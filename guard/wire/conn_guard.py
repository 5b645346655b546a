"""Connection hygiene for moeguard's HTTP services: open files, a connection cap with a share kept
for authenticated clients, and a deadline for a request's headers.

Without them ~1,000 idle TCP connections (under the common open-files limit of 1,024) took the
collector offline with no credentials: every new connection timed out and the exporter already
connected got 503 on every batch (issue #32). Three rules, all in the event loop, none per byte:

  * open files: the soft limit is raised at start-up to what the ranks to serve need, up to the
    hard limit (open_files.py sizes it and says in one line what it got and what it covers).
  * a cap below that limit (`ConnectionBudget`): the service's own files (write-ahead logs,
    Parquet parts, state) keep the descriptors open_files.py sets aside; connections get the
    rest. Half of the cap (`trusted_share`) is kept for connections that have sent an
    authenticated request: a new connection past the untrusted share closes the oldest idle
    unauthenticated one, or, when there is none, is answered 503 with Retry-After and closed. An authenticated connection, or one
    whose request has arrived, is never closed to make room. The listen backlog (asyncio accepts
    that many in one burst, and a closed descriptor is freed only on the loop's next turn) is
    part of that reserve, so a burst cannot push the process past its limit.
  * a header deadline (`guarded_protocol`): a connection must send a whole request head within
    `header_timeout_s` of connecting, or of the first byte of its next request (a keep-alive
    connection may idle between requests for uvicorn's `timeout_keep_alive`). Slow-loris heads
    are cut; a body is bounded by BodyLimit (http_limits.py).

Both of uvicorn's HTTP/1.1 parsers are guarded the same way: h11 (pure Python, always there) and
httptools (llhttp in C, from the collector extra), which cuts the collector's CPU a small request
by ~15% (docs/BENCHMARKS.md, issue #30); `http_stack` picks it when installed.
"""

from __future__ import annotations

import asyncio
import fcntl
import importlib.util
import logging
import struct
import termios
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from guard.wire.open_files import FilePlan

log = logging.getLogger("moeguard.connections")

HTTP_PARSERS = ("auto", "httptools", "h11")
EVENT_LOOPS = ("auto", "uvloop", "asyncio")
HEADER_TIMEOUT_S = 10.0  # a request head (request line + headers) must arrive within this
KEEP_ALIVE_S = 75  # idle keep-alive: above a typical step time, so a rank keeps its connection
_BUSY_BODY = b'{"error": "too many connections; retry in a second"}'
BUSY_ANSWER = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY)
)


@dataclass(eq=False)
class _Conn:
    key: tuple[Any, ...]  # its client address
    proto: Any  # the protocol instance (GuardedH11Protocol)
    trusted: bool = False


class ConnectionBudget:
    """The open connections of one service, who may stay and who goes. Event-loop thread only,
    except `trust` (called from request handlers, which run on the loop too)."""

    def __init__(self, cap: int, trusted_share: float = 0.5, backlog: int | None = None) -> None:
        if cap < 4:
            raise ValueError(f"connection cap {cap}: must be >= 4")
        self.cap = cap
        self.untrusted_max = max(1, cap - int(cap * trusted_share))
        # The listen backlog, which is also how many connections asyncio accepts in one go before
        # any is closed: a closed connection's descriptor is freed on the loop's next turn, so one
        # burst may hold this many more than the cap (open_files.py keeps room for it).
        self.accept_batch = backlog if backlog is not None else min(2048, max(64, cap // 8))
        self.ranks_wanted: int | None = None  # what the service was asked to serve (for /healthz)
        # open_files' WARNING when the limit is short of the capacity asked for: logged once, when the
        # cap is first reached (the connections at hand need more than the limit covers); None when
        # the service already said it at start
        self.short_warning: str | None = None
        self._warned_short = False
        # client address -> connection, each in the order it was admitted (oldest first)
        self._untrusted: dict[tuple[Any, ...], _Conn] = {}
        self._trusted: dict[tuple[Any, ...], _Conn] = {}
        self.refused = 0  # connections answered 503 at the door
        self.evicted = 0  # idle unauthenticated connections closed to make room
        self.header_timeouts = 0

    @classmethod
    def for_plan(cls, plan: FilePlan) -> ConnectionBudget:
        """The budget open_files.plan_open_files shared out."""
        budget = cls(plan.cap, backlog=plan.backlog)
        budget.ranks_wanted = plan.ranks_wanted
        budget.short_warning = plan.warning()
        return budget

    @property
    def trusted_kept(self) -> int:
        return self.cap - self.untrusted_max

    def counts(self) -> tuple[int, int]:
        """(open connections, of which authenticated)."""
        return len(self._untrusted) + len(self._trusted), len(self._trusted)

    def admit(self, key: tuple[Any, ...], proto: Any) -> bool:
        """A new connection: True when it may stay (something idle may have been closed for it).
        O(1) in the common case: the oldest unauthenticated connection is idle."""
        total, trusted = self.counts()
        if total - trusted >= self.untrusted_max or total >= self.cap:
            self._warn_short_once(total)
            victim = next((c for c in self._untrusted.values() if c.proto.idle()), None)
            if victim is None:
                self.refused += 1
                return False
            self.evicted += 1
            del self._untrusted[victim.key]  # now, not when the loop reports it closed: the next may pick
            victim.proto.close_idle()
        self._untrusted[key] = _Conn(key, proto)
        return True

    def _warn_short_once(self, total: int) -> None:
        """open_files' WARNING, the first time the cap is reached (a connection is turned away or
        an idle one closed for room): the connections at hand need more than the limit covers."""
        if self.short_warning is not None and not self._warned_short:
            self._warned_short = True
            log.warning("the connection cap was reached at %d open: %s", total, self.short_warning)

    def gone(self, key: tuple[Any, ...], proto: Any) -> None:
        for d in (self._untrusted, self._trusted):
            c = d.get(key)
            if c is not None and c.proto is proto:
                del d[key]

    def trust(self, client: Any) -> None:
        """The connection from `client` (scope["client"]) sent an authenticated request."""
        c = self._untrusted.pop(tuple(client), None) if client else None
        if c is not None:
            c.trusted = True
            self._trusted[c.key] = c

    def stats(self) -> dict[str, int]:
        """For /healthz: what is open now and what the budget did so far."""
        total, trusted = self.counts()
        return {
            "open": total,
            "authenticated": trusted,
            "cap": self.cap,
            "kept_for_authenticated": self.trusted_kept,
            "ranks_covered": self.trusted_kept,
            **({"ranks_wanted": self.ranks_wanted} if self.ranks_wanted is not None else {}),
            "refused": self.refused,
            "closed_for_room": self.evicted,
            "header_timeouts": self.header_timeouts,
        }


class _Guarded:
    """The budget and the header deadline, for either of uvicorn's HTTP/1.1 protocols (mixed in
    before it). Its subclass says when a request head is awaited and when the connection is busy."""

    budget: ConnectionBudget
    header_timeout_s: float = HEADER_TIMEOUT_S
    # set by the uvicorn protocol it is mixed into
    client: Any
    connections: set[Any]
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport

    def connection_made(self, transport: asyncio.Transport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        self._admit(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._forget()
        super().connection_lost(exc)  # type: ignore[misc]

    def _admit(self, transport: asyncio.Transport) -> None:
        """After the protocol's own connection_made: keep the connection or answer 503 and close."""
        self._key = tuple(self.client) if self.client else (id(self),)
        self._header_timer: asyncio.TimerHandle | None = None
        if not self.budget.admit(self._key, self):
            self.connections.discard(self)
            try:
                transport.write(BUSY_ANSWER)
            finally:
                transport.close()
            return
        self._arm_header_deadline()

    def _forget(self) -> None:
        """Before the protocol's own connection_lost."""
        self._disarm_header_deadline()
        self.budget.gone(getattr(self, "_key", (id(self),)), self)

    def _awaiting_head(self) -> bool:
        raise NotImplementedError

    def _serving(self) -> bool:
        """A request whose head arrived, or its response, is in progress."""
        raise NotImplementedError

    def idle(self) -> bool:
        """No request being served and none waiting unread: nothing lost by closing it. The unread
        check matters under a flood: the loop accepts a burst of connections before it reads any,
        and a client whose request already arrived must not be closed for the burst behind it."""
        return not self._serving() and _unread_bytes(self.transport) == 0

    def close_idle(self) -> None:
        self._disarm_header_deadline()
        if not self.transport.is_closing():
            self.transport.close()

    def _arm_header_deadline(self) -> None:
        self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_deadline)

    def _disarm_header_deadline(self) -> None:
        t = getattr(self, "_header_timer", None)
        if t is not None:
            t.cancel()
            self._header_timer = None

    def _header_deadline(self) -> None:
        self._header_timer = None
        if self._awaiting_head() and not self.transport.is_closing():
            self.budget.header_timeouts += 1
            self.transport.close()


class GuardedH11Protocol(_Guarded, H11Protocol):
    """uvicorn's h11 protocol under a ConnectionBudget and a header deadline (class attributes
    set by `guarded_protocol`)."""

    def data_received(self, data: bytes) -> None:
        waiting = self.conn.their_state is h11.IDLE
        if waiting and self._header_timer is None:
            self._arm_header_deadline()  # the first byte of the next request on a kept-alive connection
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            self._disarm_header_deadline()  # a whole head arrived (or the connection is going)

    def _awaiting_head(self) -> bool:
        return self.conn.their_state is h11.IDLE

    def _serving(self) -> bool:
        return self.conn.their_state is not h11.IDLE or (
            self.cycle is not None and not self.cycle.response_complete
        )


def _httptools_protocol() -> type:
    """GuardedHttpToolsProtocol, built on first use: httptools is optional (the collector extra)."""
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    class GuardedHttpToolsProtocol(_Guarded, HttpToolsProtocol):
        """uvicorn's httptools protocol under a ConnectionBudget and a header deadline. The parser
        calls back at a message's first byte, at the end of its head and at its end; those three
        moments are kept, as h11's `their_state` keeps them for the h11 protocol."""

        _in_message = False  # a request's first byte arrived, its end has not
        _head_done = False  # the head of the request being read (or the last one) is whole

        def data_received(self, data: bytes) -> None:
            if not self._in_message and self._header_timer is None:
                self._head_done = False  # a new request begins: its head is awaited
                self._arm_header_deadline()
            super().data_received(data)
            if self._head_done or self.transport.is_closing():
                self._disarm_header_deadline()

        def on_message_begin(self) -> None:
            self._in_message, self._head_done = True, False
            super().on_message_begin()

        def on_headers_complete(self) -> None:
            self._head_done = True
            super().on_headers_complete()

        def on_message_complete(self) -> None:
            self._in_message = False
            super().on_message_complete()

        def _awaiting_head(self) -> bool:
            return not self._head_done

        def _serving(self) -> bool:
            return (
                (self._in_message and self._head_done)
                or bool(self.pipeline)
                or (self.cycle is not None and not self.cycle.response_complete)
            )

    return GuardedHttpToolsProtocol


def _unread_bytes(transport: asyncio.BaseTransport) -> int:
    """Bytes waiting in the socket's receive buffer (FIONREAD); 0 when it cannot tell."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return 0
    try:
        buf = fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0")
    except OSError:
        return 0
    return struct.unpack("i", buf)[0]


def http_stack(http: str = "auto", loop: str = "auto") -> tuple[str, str]:
    """The HTTP parser and event loop to serve with. `http` "auto" takes httptools when installed
    (the collector extra), h11 when not. `loop` "auto" is asyncio: uvloop only when named, because
    under EMFILE libuv accepts and at once closes every pending connection (its "EMFILE trick"),
    so a client gets a dropped connection where asyncio keeps it waiting in the backlog until a
    descriptor frees (bench/attacks/collector_attacks.py emfile_mid_run: held on asyncio, a new client
    disconnected on uvloop), for a few percent of CPU (docs/BENCHMARKS.md). A named one must be
    installed (ValueError naming the flag otherwise)."""
    if http not in HTTP_PARSERS or loop not in EVENT_LOOPS:
        raise ValueError(f"--http {http!r} / --loop {loop!r}: expected one of {HTTP_PARSERS} / {EVENT_LOOPS}")
    for flag, want in (("--http", http), ("--loop", loop)):
        if want in ("httptools", "uvloop") and importlib.util.find_spec(want) is None:
            extra = ' (pip install "moeguard[collector]" brings it)' if want == "httptools" else ""
            raise ValueError(f"{flag} {want}: not installed{extra}")
    if http == "auto":
        http = "httptools" if importlib.util.find_spec("httptools") is not None else "h11"
    return http, "asyncio" if loop == "auto" else loop


def guarded_protocol(
    budget: ConnectionBudget, header_timeout_s: float = HEADER_TIMEOUT_S, http: str = "h11"
) -> type:
    """A protocol class for `uvicorn.Config(http=...)` bound to `budget`; `http` is "h11" or
    "httptools" (as `http_stack` chose)."""
    base = GuardedH11Protocol if http == "h11" else _httptools_protocol()
    return type(base.__name__, (base,), {"budget": budget, "header_timeout_s": header_timeout_s})
