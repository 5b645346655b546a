"""`moeguard pager`'s HTTP app (Starlette):

    POST /v1/alertmanager   Alertmanager webhook payload v4
    POST /v1/events         a critical guard event {run, step, kind, detector, value, threshold,
                            action, detail}, posted by the collector the moment a run halts
    GET  /healthz

A POST is answered 200 only once its changes are durable in the book (guard/pager/book.py).
Abuse: bodies are cut off at max_body_bytes while they stream in (413), JSON deeper than
MAX_JSON_DEPTH is refused (400), and with a token every POST needs "Authorization: Bearer <token>".
"""

from __future__ import annotations

import contextlib
import hmac
import time
from collections.abc import AsyncIterator

from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from guard.pager.delivery import Pager
from guard.pager.intake import PayloadError, parse_alertmanager, parse_event, parse_json
from guard.wire.http_limits import BodyLimit, BodyTooLarge, body_too_large_handler


def build_app(pager: Pager, token: str | None = None) -> Starlette:
    def refused(request: Request) -> JSONResponse | None:
        if token is None:
            return None
        given = request.headers.get("authorization", "")
        if hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
            return None
        return JSONResponse({"error": "missing or wrong bearer token"}, status_code=401)

    async def alertmanager(request: Request) -> JSONResponse:
        if (r := refused(request)) is not None:
            return r
        raw = await request.body()  # bounded by BodyLimit
        try:
            updates = await run_in_threadpool(lambda: parse_alertmanager(parse_json(raw)))
        except PayloadError as e:
            return JSONResponse({"error": str(e)}, status_code=400)
        keys = await run_in_threadpool(pager.accept, updates)
        return JSONResponse({"status": "accepted", "alerts": len(updates), "incidents": keys})

    async def events(request: Request) -> JSONResponse:
        if (r := refused(request)) is not None:
            return r
        raw = await request.body()
        try:
            body = await run_in_threadpool(parse_json, raw)
            update = parse_event(body, ttl_s=pager.cfg.event_ttl_s, now=time.time())
        except PayloadError as e:
            return JSONResponse({"error": str(e)}, status_code=400)
        keys = await run_in_threadpool(pager.accept, [update])
        return JSONResponse({"status": "accepted", "incidents": keys, "dedup_key": update.key})

    async def healthz(request: Request) -> JSONResponse:
        return JSONResponse(pager.health())

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        yield
        # uvicorn re-raises SIGTERM once it has shut down, so code after server.run() never
        # runs on a signal: stop here, while the process is still ours.
        await run_in_threadpool(pager.stop)

    return Starlette(
        routes=[
            Route("/v1/alertmanager", alertmanager, methods=["POST"]),
            Route("/v1/events", events, methods=["POST"]),
            Route("/healthz", healthz, methods=["GET"]),
        ],
        middleware=[Middleware(BodyLimit, limit=pager.cfg.max_body_bytes)],
        exception_handlers={BodyTooLarge: body_too_large_handler},
        lifespan=lifespan,
    )
