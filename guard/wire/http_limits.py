"""A streaming request-body limit for moeguard's HTTP services (the collector).

`BodyLimit` is ASGI middleware: a request whose Content-Length passes the limit gets 413 before a
byte of its body is read; one that streams past it (chunked, or lying about its length) gets 413
at that byte (the endpoint's read raises `BodyTooLarge`; the app maps it with
`body_too_large_handler`). Nothing beyond the limit is ever held in memory, on any endpoint.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse


class BodyTooLarge(Exception):
    """The request body passed the limit while it streamed in (answered with HTTP 413)."""


def too_large(why: str) -> JSONResponse:
    # Connection: close, so the client cannot go on streaming into a connection we keep reading.
    return JSONResponse({"error": why}, status_code=413, headers={"Connection": "close"})


async def body_too_large_handler(request: Request, exc: Exception) -> JSONResponse:
    """Starlette exception handler for BodyTooLarge."""
    return too_large(str(exc))


class BodyLimit:
    """ASGI middleware for every endpoint: bodies over `limit` bytes get 413, read no further.
    `on_refused(path)` (optional) is called once per refused request, e.g. to count it."""

    def __init__(self, app: Any, limit: int, on_refused: Callable[[str], None] | None = None) -> None:
        self.app, self.limit, self.on_refused = app, limit, on_refused

    def _refused(self, scope: dict[str, Any]) -> None:
        if self.on_refused is not None:
            self.on_refused(scope.get("path", ""))

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > self.limit:
            why = f"Content-Length {declared.decode(errors='replace')[:20]} is over the limit of {self.limit} bytes"
            self._refused(scope)
            await too_large(why)(scope, receive, send)
            return
        seen = 0

        async def limited_receive() -> dict[str, Any]:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:  # raised inside the endpoint; the app answers 413
                    self._refused(scope)
                    raise BodyTooLarge(f"body streamed past the limit of {self.limit} bytes")
            return message

        await self.app(scope, limited_receive, send)
