"""The collector's HTTP app (starlette): routes, bearer-token checks, body limits, and the
operator-command endpoints' parameter checks. Everything else is the Collector's (service.py).
"""

from __future__ import annotations

import hmac
import logging
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from guard.collector.config import COMMAND_ACTIONS, STATE_DIR
from guard.collector.errors import RETRY_AFTER_S, StorageBusy, StorageFailed
from guard.collector.service import Collector
from guard.wire.batch import MAX_RANK, BadRequest, dumps, loads, parse_int, valid_run_id
from guard.wire.conn_guard import ConnectionBudget
from guard.wire.http_limits import BodyLimit, BodyTooLarge
from guard.wire.runs import runs_body

log = logging.getLogger("moeguard.collector")


def build_app(collector: Collector, conns: ConnectionBudget | None = None) -> Starlette:
    """The collector's routes, behind the body limit; the app's lifespan starts and closes it.
    `conns`: the server's connection budget, told which connections sent an authenticated request."""
    api = _Endpoints(collector, conns)
    return Starlette(
        routes=[
            Route("/v1/ingest", api.ingest, methods=["POST"]),
            Route("/v1/runs", api.runs, methods=["GET"]),
            Route("/v1/runs/{run}/commands", api.commands, methods=["GET", "POST"]),
            Route("/metrics", api.metrics, methods=["GET"]),
            Route("/healthz", api.healthz, methods=["GET"]),
        ],
        middleware=[Middleware(BodyLimit, limit=collector.cfg.max_body_bytes, on_refused=api.refused)],
        exception_handlers={BodyTooLarge: _body_too_large},
        lifespan=api.lifespan,
    )


def _answer(status: int, payload: dict[str, Any]) -> Response:
    """JSON; a retryable answer (503, 507) says when to retry."""
    headers = {"retry-after": str(RETRY_AFTER_S)} if status in (503, 507) else None
    return Response(dumps(payload), status_code=status, media_type="application/json", headers=headers)


def _gone(request: Request) -> Response:
    """The client hung up before its body arrived: nothing was read, nothing stored, nobody to
    answer. Worth a debug line, not an ERROR traceback per disconnect."""
    log.debug("client %s hung up before sending its body to %s", request.client, request.url.path)
    return Response(status_code=400)


async def _body_too_large(request: Request, exc: Exception) -> Response:
    return _answer(413, {"error": str(exc)})


class _Endpoints:
    """The route handlers over one Collector; the blocking work runs in the thread pool."""

    def __init__(self, collector: Collector, conns: ConnectionBudget | None = None) -> None:
        self.collector, self.conns = collector, conns
        self.token = collector.cfg.token.encode() if collector.cfg.token else None

    def authorized(self, request: Request) -> bool:
        """The bearer token checks out; the connection then keeps a place under a flood."""
        if self.token is not None:
            scheme, _, cred = request.headers.get("authorization", "").partition(" ")
            if not (scheme.lower() == "bearer" and hmac.compare_digest(cred.strip().encode(), self.token)):
                return False
        if self.conns is not None:
            self.conns.trust(request.scope.get("client"))
        return True

    async def ingest(self, request: Request) -> Response:
        if not self.authorized(request):
            self.collector.health.batch("unauthorized")
            return _answer(401, {"error": "missing or wrong bearer token"})
        try:
            body = await request.body()  # bounded by BodyLimit (413 past --max-body-bytes)
        except ClientDisconnect:
            return _gone(request)
        status, payload = await run_in_threadpool(self.collector.ingest, body)
        return _answer(status, payload)

    async def runs(self, request: Request) -> Response:
        return _answer(200, runs_body(await run_in_threadpool(self.collector.list_runs)))

    async def commands(self, request: Request) -> Response:
        run = request.path_params["run"]
        # Both ways need the token: the commands and their reasons are the operators' words.
        if not self.authorized(request):
            return _answer(401, {"error": "missing or wrong bearer token"})
        if request.method == "POST":
            try:
                body = await request.body()  # bounded by BodyLimit
            except ClientDisconnect:
                return _gone(request)
            return _answer(*(await run_in_threadpool(post_command, self.collector, run, body)))
        q = request.query_params
        got = await run_in_threadpool(get_commands, self.collector, run, q.get("rank"), q.get("after"))
        return _answer(*got)

    async def metrics(self, request: Request) -> Response:
        return Response(
            await run_in_threadpool(self.collector.metrics.render), media_type=CONTENT_TYPE_LATEST
        )

    async def healthz(self, request: Request) -> Response:
        c = self.collector
        return JSONResponse(
            {
                "ok": True,
                "runs": len(c.runs),
                "quarantined": len(c.quarantined),
                "known_runs": len(c.health.runs()),
                "pending_load": c.pending_load,
                **({"connections": self.conns.stats()} if self.conns is not None else {}),
            }
        )

    def refused(self, path: str) -> None:
        """BodyLimit refused a request's body (413)."""
        if path == "/v1/ingest":
            self.collector.health.batch("too_large")

    @asynccontextmanager
    async def lifespan(self, app: Starlette) -> AsyncIterator[None]:
        if not self.collector.started:  # `moeguard collector`: scan the runs while already listening
            self.collector.start(background=True)
        yield
        await run_in_threadpool(self.collector.close)


def post_command(collector: Collector, run: str, body: bytes) -> tuple[int, dict[str, Any]]:
    if not valid_run_id(run):
        return 400, {"error": f"run {run[:60]!r} is not a valid run id"}
    try:
        d = loads(body)
    except (ValueError, RecursionError, UnicodeDecodeError):
        return 400, {"error": "body is not valid JSON"}
    if not isinstance(d, dict):
        return 400, {"error": "body: expected a JSON object"}
    action, reason, rank = d.get("action"), d.get("reason", ""), d.get("rank")
    if action not in COMMAND_ACTIONS:
        return 400, {"error": f"field 'action': {str(action)[:60]!r} not one of {COMMAND_ACTIONS}"}
    if not isinstance(reason, str) or len(reason) > 2000:
        return 400, {"error": "field 'reason': expected a string (<= 2000 chars)"}
    if rank is not None:
        try:
            rank = parse_int(rank, "rank", 0, MAX_RANK)
        except BadRequest as e:
            return 400, {"error": str(e)}
    try:
        cmd = collector.with_run(run, lambda rs: rs.add_command(action, reason, rank))
    except StorageBusy as e:
        return e.status, {"error": str(e)}
    except StorageFailed as e:
        return 503, {"error": str(e)}
    log.warning("run %s: operator command %s", run, cmd)
    return 200, {"ok": True, "command": cmd}


def get_commands(
    collector: Collector, run: str, rank: str | None, after: str | None
) -> tuple[int, dict[str, Any]]:
    if not valid_run_id(run):
        return 400, {"error": f"run {run[:60]!r} is not a valid run id"}
    try:
        r = int(rank) if rank is not None else 0
        a = int(after) if after is not None else None
    except ValueError:
        return 400, {"error": "query 'rank' and 'after' must be integers"}
    rs = collector.runs.get(run)
    if rs is None or rs.evicted:
        if not os.path.lexists(collector.cfg.runs_dir / run / STATE_DIR):
            return 404, {"error": f"unknown run {run!r}"}
        try:
            rs = collector.run_state(run)
        except StorageFailed as e:
            return 503, {"error": str(e)}
    return 200, {"commands": rs.pending_commands(r, a)}
