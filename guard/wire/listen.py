"""The listening socket for moeguard's HTTP services (the collector).

Bound before the server starts so that `--port 0` works and the real port is known first. Made
with proto=IPPROTO_TCP and TCP_NODELAY on purpose: asyncio turns Nagle off only on sockets whose
`proto` is IPPROTO_TCP, and `socket.socket(AF_INET)` has proto 0. With Nagle on, a response
written as headers then body (uvicorn does) waits for the client's delayed ACK: every request
sent less than ~40 ms after the previous answer took 40 ms more (measured: 56 ms instead of
12 ms for a 4-report ingest). Accepted sockets inherit TCP_NODELAY from the listener on Linux.
"""

from __future__ import annotations

import socket


def bind_tcp(host: str, port: int) -> socket.socket:
    """A bound (not yet listening) TCP socket for `host:port`; OSError if it cannot bind."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    return sock
