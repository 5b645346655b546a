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
    is none, is answered 503 with Retry-After and closed. An authenticated connection is never
    closed to make room.
  * a header deadline (`guarded_protocol`): a connection must send a whole request head within
    `header_timeout_s` of connecting, or of the first byte of its next request (a keep-alive
    connection may idle between requests for uvicorn's `timeout_keep_alive`). Slow-loris heads
    are cut; a body is bounded by BodyLimit (http_limits.py).
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from dataclasses import dataclass, field
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
    opened: float = field(default_factory=time.monotonic)
    trusted: bool = False


class ConnectionBudget:
    """The open connections of one service, who may stay and who goes. Event-loop thread only,
    except `trust` (called from request handlers, which run on the loop too)."""

    def __init__(self, cap: int, trusted_share: float = 0.5) -> None:
        if cap < 4:
            raise ValueError(f"connection cap {cap}: must be >= 4")
        self.cap = cap
        self.untrusted_max = max(1, cap - int(cap * trusted_share))
        self._open: dict[tuple[Any, ...], _Conn] = {}  # client address -> connection
        self.refused = 0  # connections answered 503 at the door
        self.evicted = 0  # idle unauthenticated connections closed to make room
        self.header_timeouts = 0

    @classmethod
    def for_open_files(cls, nofile: int, cap: int | None = None) -> ConnectionBudget:
        """The budget under an open-files limit: `cap`, or the limit less the file reserve."""
        return cls(cap if cap is not None else max(4, nofile - file_reserve(nofile)))

    @property
    def trusted_kept(self) -> int:
        return self.cap - self.untrusted_max

    def counts(self) -> tuple[int, int]:
        """(open connections, of which authenticated)."""
        return len(self._open), sum(c.trusted for c in self._open.values())

    def admit(self, key: tuple[Any, ...], proto: Any) -> bool:
        """A new connection: True when it may stay (something idle may have been closed for it)."""
        total, trusted = self.counts()
        if total - trusted >= self.untrusted_max or total >= self.cap:
            victim = self._oldest_idle_untrusted()
            if victim is None:
                self.refused += 1
                return False
            self.evicted += 1
            del self._open[victim.key]  # now, not when the loop reports it closed: the next may pick
            victim.proto.close_idle()
        self._open[key] = _Conn(key, proto)
        return True

    def _oldest_idle_untrusted(self) -> _Conn | None:
        idle = [c for c in self._open.values() if not c.trusted and c.proto.idle()]
        return min(idle, key=lambda c: c.opened, default=None)

    def gone(self, key: tuple[Any, ...], proto: Any) -> None:
        c = self._open.get(key)
        if c is not None and c.proto is proto:
            del self._open[key]

    def trust(self, client: Any) -> None:
        """The connection from `client` (scope["client"]) sent an authenticated request."""
        c = self._open.get(tuple(client)) if client else None
        if c is not None:
            c.trusted = True

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
        """No request being served: nothing lost by closing it (a client retries a fresh one)."""
        return self.conn.their_state is h11.IDLE and (self.cycle is None or self.cycle.response_complete)

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


def guarded_protocol(budget: ConnectionBudget, header_timeout_s: float = HEADER_TIMEOUT_S) -> type:
    """A protocol class for `uvicorn.Config(http=...)` bound to `budget`."""
    return type(
        "GuardedH11Protocol",
        (GuardedH11Protocol,),
        {"budget": budget, "header_timeout_s": header_timeout_s},
    )
