"""The services' listening socket: connections it accepts have Nagle off (see guard/wire/listen.py)."""

from __future__ import annotations

import socket

import pytest

from guard.wire.listen import bind_tcp


def test_accepted_connections_have_tcp_nodelay() -> None:
    srv = bind_tcp("127.0.0.1", 0)
    try:
        srv.listen(1)
        with socket.create_connection(srv.getsockname()[:2]) as _client:
            conn, _ = srv.accept()
            with conn:
                assert conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0
                assert conn.proto == socket.IPPROTO_TCP  # what asyncio checks before its own NODELAY
    finally:
        srv.close()


def test_a_taken_port_raises_and_leaks_nothing() -> None:
    first = bind_tcp("127.0.0.1", 0)
    try:
        first.listen(1)
        with pytest.raises(OSError):
            bind_tcp("127.0.0.1", first.getsockname()[1])
    finally:
        first.close()
