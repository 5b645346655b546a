"""The collector's HTTP app (starlette): routes, bearer-token checks, body limits, and the
operator-command endpoints' parameter checks. Everything else is the Collector's (service.py).
"""

from __future__ import annotations

import hmac
import logging
import os
from typing import Any

from guard.collector.config import COMMAND_ACTIONS, STATE_DIR
from guard.collector.errors import StorageFailed
from guard.collector.service import Collector
from guard.wire.batch import MAX_RANK, BadRequest, dumps, loads, parse_int, valid_run_id
from guard.wire.http_limits import BodyLimit, BodyTooLarge
from guard.wire.runs import runs_body

log = logging.getLogger("moeguard.collector")


def build_app(collector: Collector) -> Any:
    from contextlib import asynccontextmanager

    from starlette.applications import Starlette
    from starlette.concurrency import run_in_threadpool
    from starlette.middleware import Middleware
    from starlette.requests import Request
    from starlette.responses import JSONResponse, Response
    from starlette.routing import Route

    cfg = collector.cfg
    token = cfg.token.encode() if cfg.token else None

    def authorized(request: Request) -> bool:
        if token is None:
            return True
        h = request.headers.get("authorization", "")
        scheme, _, cred = h.partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(cred.strip().encode(), token)

    def answer(status: int, payload: dict[str, Any]) -> Response:
        return Response(dumps(payload), status_code=status, media_type="application/json")

    async def ingest(request: Request) -> Response:
        if not authorized(request):
            collector.health.batch("unauthorized")
            return answer(401, {"error": "missing or wrong bearer token"})
        body = await request.body()  # bounded by BodyLimit (413 past --max-body-bytes)
        status, payload = await run_in_threadpool(collector.ingest, body)
        return answer(status, payload)

    async def runs(request: Request) -> Response:
        return answer(200, runs_body(await run_in_threadpool(collector.list_runs)))

    async def commands(request: Request) -> Response:
        run = request.path_params["run"]
        if request.method == "POST":
            if not authorized(request):
                return answer(401, {"error": "missing or wrong bearer token"})
            body = await request.body()  # bounded by BodyLimit
            return answer(*(await run_in_threadpool(post_command, collector, run, body)))
        q = request.query_params
        return answer(*(await run_in_threadpool(get_commands, collector, run, q.get("rank"), q.get("after"))))

    async def metrics(request: Request) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(await run_in_threadpool(collector.metrics.render), media_type=CONTENT_TYPE_LATEST)

    async def healthz(request: Request) -> Response:
        return JSONResponse(
            {
                "ok": True,
                "runs": len(collector.runs),
                "quarantined": len(collector.quarantined),
                "known_runs": len(collector.health.runs()),
                "pending_load": collector.pending_load,
            }
        )

    def refused(path: str) -> None:
        if path == "/v1/ingest":
            collector.health.batch("too_large")

    async def body_too_large(request: Request, exc: Exception) -> Response:
        return answer(413, {"error": str(exc)})

    @asynccontextmanager
    async def lifespan(app: Any) -> Any:
        if not collector.started:  # `moeguard collector`: scan the runs while already listening
            collector.start(background=True)
        yield
        await run_in_threadpool(collector.close)

    return Starlette(
        routes=[
            Route("/v1/ingest", ingest, methods=["POST"]),
            Route("/v1/runs", runs, methods=["GET"]),
            Route("/v1/runs/{run}/commands", commands, methods=["GET", "POST"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/healthz", healthz, methods=["GET"]),
        ],
        middleware=[Middleware(BodyLimit, limit=cfg.max_body_bytes, on_refused=refused)],
        exception_handlers={BodyTooLarge: body_too_large},
        lifespan=lifespan,
    )


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
