"""Connection hygiene for moeguard's HTTP services: open files, a connection cap with a share kept
for authenticated clients, and a deadline for a request's headers.

Without them ~1,000 idle TCP connections (under the common open-files limit of 1,024) took the
collector offline with no credentials: every new connection timed out and the exporter already
connected got 503 on every batch (issue #32). Three rules, all in the event loop, none per byte:

  * open files: the soft limit is raised to the hard one at start-up (`raise_open_files`); the
    service says in one line what it got and how many connections that allows.
  * a cap below that limit (`ConnectionBudget`): the service's own files (write-ahead logs,
    Parquet parts, state) keep `file_reserve` descriptors; connections get the rest. Half of the
    cap (`trusted_share`) is kept for connections that have sent an authenticated request: a new
    connection past the untrusted share closes the oldest idle unauthenticated one, or, when there
    is none, is answered 503 with Retry-After and closed. An authenticated connection, or one
    whose request has arrived, is never closed to make room. The listen backlog (asyncio accepts
    that many in one burst, and a closed descriptor is freed only on the loop's next turn) is
    kept under half the file reserve, so a burst cannot push the process past its limit.
  * a header deadline (`guarded_protocol`): a connection must send a whole request head within
    `header_timeout_s` of connecting, or of the first byte of its next request (a keep-alive
    connection may idle between requests for uvicorn's `timeout_keep_alive`). Slow-loris heads
    are cut; a body is bounded by BodyLimit (http_limits.py).
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import resource
import struct
import termios
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("moeguard.connections")

HEADER_TIMEOUT_S = 10.0  # a request head (request line + headers) must arrive within this
KEEP_ALIVE_S = 75  # idle keep-alive: above a typical step time, so a rank keeps its connection
FILE_RESERVE_MIN = 128  # descriptors kept for the service's own files, at least
_BUSY_BODY = b'{"error": "too many connections; retry in a second"}'
BUSY_ANSWER = (
    b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nretry-after: 1\r\n"
    b"connection: close\r\ncontent-length: %d\r\n\r\n%s" % (len(_BUSY_BODY), _BUSY_BODY)
)


def raise_open_files(want: int | None = None) -> tuple[int, int, int]:
    """Raise RLIMIT_NOFILE's soft limit to `want` (default: the hard limit, at most 1,048,576).
    Returns (soft before, soft now, hard)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else 1 << 20
    target = min(target if want is None else want, 1 << 20)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            return soft, soft, hard
        return soft, target, hard
    return soft, soft, hard


def file_reserve(nofile: int) -> int:
    """Descriptors kept for files: a quarter of the limit, at least FILE_RESERVE_MIN."""
    return max(FILE_RESERVE_MIN, nofile // 4)


@dataclass(eq=False)
class _Conn:
    key: tuple[Any, ...]  # its client address
    proto: Any  # the protocol instance (GuardedH11Protocol)
    trusted: bool = False


class ConnectionBudget:
    """The open connections of one service, who may stay and who goes. Event-loop thread only,
    except `trust` (called from request handlers, which run on the loop too)."""

    def __init__(self, cap: int, trusted_share: float = 0.5) -> None:
        if cap < 4:
            raise ValueError(f"connection cap {cap}: must be >= 4")
        self.cap = cap
        self.nofile = cap + FILE_RESERVE_MIN  # the open-files limit it was sized for (for_open_files sets it)
        self.untrusted_max = max(1, cap - int(cap * trusted_share))
        # client address -> connection, each in the order it was admitted (oldest first)
        self._untrusted: dict[tuple[Any, ...], _Conn] = {}
        self._trusted: dict[tuple[Any, ...], _Conn] = {}
        self.refused = 0  # connections answered 503 at the door
        self.evicted = 0  # idle unauthenticated connections closed to make room
        self.header_timeouts = 0

    @classmethod
    def for_open_files(cls, nofile: int, cap: int | None = None) -> ConnectionBudget:
        """The budget under an open-files limit: `cap`, or the limit less the file reserve."""
        budget = cls(cap if cap is not None else max(4, nofile - file_reserve(nofile)))
        budget.nofile = nofile
        return budget

    @property
    def accept_batch(self) -> int:
        """The listen backlog, which is also how many connections asyncio accepts in one go before
        any is closed: a closed connection's descriptor is freed on the loop's next turn, so one
        burst may hold this many more than the cap. Kept under half the file reserve."""
        return min(2048, max(64, (self.nofile - self.cap) // 2))

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
            victim = next((c for c in self._untrusted.values() if c.proto.idle()), None)
            if victim is None:
                self.refused += 1
                return False
            self.evicted += 1
            del self._untrusted[victim.key]  # now, not when the loop reports it closed: the next may pick
            victim.proto.close_idle()
        self._untrusted[key] = _Conn(key, proto)
        return True

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
            "refused": self.refused,
            "closed_for_room": self.evicted,
            "header_timeouts": self.header_timeouts,
        }

    def summary(self, nofile: int) -> str:
        return (
            f"open files: soft limit {nofile}; connections capped at {self.cap} "
            f"({self.trusted_kept} kept for authenticated clients, so about {self.trusted_kept} ranks "
            "stream through any connection flood, one keep-alive connection each)"
        )


class GuardedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol under a ConnectionBudget and a header deadline (class attributes
    set by `guarded_protocol`)."""

    budget: ConnectionBudget
    header_timeout_s: float = HEADER_TIMEOUT_S

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
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

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_header_deadline()
        self.budget.gone(getattr(self, "_key", (id(self),)), self)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        waiting = self.conn.their_state is h11.IDLE
        if waiting and self._header_timer is None:
            self._arm_header_deadline()  # the first byte of the next request on a kept-alive connection
        super().data_received(data)
        if self.conn.their_state is not h11.IDLE or self.transport.is_closing():
            self._disarm_header_deadline()  # a whole head arrived (or the connection is going)

    def idle(self) -> bool:
        """No request being served and none waiting unread: nothing lost by closing it. The unread
        check matters under a flood: the loop accepts a burst of connections before it reads any,
        and a client whose request already arrived must not be closed for the burst behind it."""
        if self.conn.their_state is not h11.IDLE or (
            self.cycle is not None and not self.cycle.response_complete
        ):
            return False
        return _unread_bytes(self.transport) == 0

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
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.budget.header_timeouts += 1
            self.transport.close()


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


def guarded_protocol(budget: ConnectionBudget, header_timeout_s: float = HEADER_TIMEOUT_S) -> type:
    """A protocol class for `uvicorn.Config(http=...)` bound to `budget`."""
    return type(
        "GuardedH11Protocol",
        (GuardedH11Protocol,),
        {"budget": budget, "header_timeout_s": header_timeout_s},
    )
