"""`moeguard pager`: Alertmanager webhooks and critical guard events in; PagerDuty, Slack and
generic webhooks out. The process's entry (flags, config, serving); the parts, one job each:

    guard/pager/intake.py    payloads -> Updates on incidents (the identity and dedup_key rule)
    guard/pager/book.py      the incident book: desired status, delivered status per sink
    guard/pager/journal.py   the book on disk: snapshot + append-only journal, crash-safe
    guard/pager/sinks.py     what PagerDuty, Slack and a generic webhook each receive
    guard/pager/delivery.py  one worker per sink, bounded retries (guard/wire/retry.py), reconcile
    guard/pager/app.py       the HTTP routes: /v1/alertmanager, /v1/events, /healthz
    guard/pager/config.py    PagerConfig and the environment's secret names

Every change to the book is durable in --state before Alertmanager gets its 200 and before the
next delivery, so a restart, even after a kill -9, neither re-pages nor forgets a resolve. Secrets
come only from the environment (or --slack-url), and no URL is logged or stored past its
scheme://host (guard/wire/redact.py): webhook URLs carry their secret in the path.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from guard.pager.app import build_app
from guard.pager.config import (
    DELIVERY_RETRY,
    ENV_PAGER_TOKEN,
    ENV_PAGERDUTY_ROUTING_KEY,
    ENV_SLACK_WEBHOOK_URL,
    MAX_BODY_BYTES,
    PAGERDUTY_EVENTS_URL,
    PD_SEVERITIES,
    PagerConfig,
    Receivers,
)
from guard.pager.delivery import Pager
from guard.wire.listen import bind_tcp
from guard.wire.redact import quiet_http_logs
from guard.wire.retry import RetryPolicy

log = logging.getLogger("moeguard.pager")


def configure(parser: argparse.ArgumentParser) -> None:
    parser.epilog = (
        f"Secrets come from the environment: {ENV_PAGERDUTY_ROUTING_KEY} (PagerDuty is off without it), "
        f"{ENV_SLACK_WEBHOOK_URL} (instead of --slack-url, which shows in `ps`), {ENV_PAGER_TOKEN} "
        "(bearer token required on POSTs when set)."
    )
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument(
        "--port", type=int, default=9095, help="port to listen on; 0 picks a free one (default 9095)"
    )
    parser.add_argument(
        "--pagerduty-url", default=PAGERDUTY_EVENTS_URL, help="PagerDuty Events API v2 endpoint"
    )
    parser.add_argument("--slack-url", default=None, help="Slack incoming-webhook URL")
    parser.add_argument(
        "--webhook-url",
        action="append",
        default=[],
        metavar="URL",
        help="generic webhook that gets the normalised incident JSON (repeatable)",
    )
    parser.add_argument(
        "--state",
        type=Path,
        default=None,
        help="JSON file (and FILE.journal beside it) that remembers what was paged, so a restart never re-pages",
    )
    parser.add_argument(
        "--runbook-base",
        default="",
        help="URL that repo-relative runbook links (playbooks/X.md) are joined to",
    )
    parser.add_argument(
        "--page-severity",
        default="critical",
        choices=PD_SEVERITIES,
        help="lowest severity sent to PagerDuty (default critical); Slack/webhooks get all",
    )
    r = DELIVERY_RETRY
    parser.add_argument(
        "--max-attempts", type=int, default=r.max_attempts, help="delivery attempts per notification"
    )
    parser.add_argument(
        "--retry-base", type=float, default=r.base_s, help="first retry delay, seconds (doubles)"
    )
    parser.add_argument(
        "--retry-max-delay", type=float, default=r.max_delay_s, help="longest retry delay, seconds"
    )
    parser.add_argument(
        "--timeout", type=float, default=r.timeout_s, help="HTTP timeout per attempt, seconds"
    )
    parser.add_argument(
        "--retry-deadline",
        type=float,
        default=r.deadline_s,
        help="seconds one delivery may take, attempts and waits together; the reconcile loop "
        f"re-drives it later (default {r.deadline_s:g})",
    )
    parser.add_argument(
        "--event-ttl",
        type=float,
        default=3600.0,
        help="seconds before an event-only incident is forgotten and may page again",
    )
    parser.add_argument(
        "--reconcile-interval",
        type=float,
        default=60.0,
        help="seconds between re-drives of undelivered notifications",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=MAX_BODY_BYTES,
        help=f"largest request body accepted; larger ones get 413 as they stream in (default {MAX_BODY_BYTES})",
    )
    parser.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"))


def config_from_args(args: argparse.Namespace, env: dict[str, str] | None = None) -> PagerConfig:
    env = dict(os.environ if env is None else env)
    return PagerConfig(
        host=args.host,
        port=args.port,
        token=env.get(ENV_PAGER_TOKEN) or None,
        max_body_bytes=args.max_body_bytes,
        state=args.state,
        event_ttl_s=args.event_ttl,
        reconcile_s=args.reconcile_interval,
        receivers=Receivers(
            pagerduty_url=args.pagerduty_url,
            routing_key=env.get(ENV_PAGERDUTY_ROUTING_KEY) or None,
            slack_url=args.slack_url or env.get(ENV_SLACK_WEBHOOK_URL) or None,
            webhook_urls=tuple(args.webhook_url),
            runbook_base=args.runbook_base,
            page_severity=args.page_severity,
        ),
        retry=RetryPolicy(
            max_attempts=args.max_attempts,
            base_s=args.retry_base,
            max_delay_s=args.retry_max_delay,
            timeout_s=args.timeout,
            deadline_s=args.retry_deadline,
        ),
    )


def run(args: argparse.Namespace) -> int:
    import uvicorn

    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    quiet_http_logs()  # before anything is sent: httpx logs each URL, secret path included
    cfg = config_from_args(args)
    if cfg.state is not None:
        cfg.state.parent.mkdir(parents=True, exist_ok=True)
    pager = Pager(cfg)
    if not pager.workers:
        log.warning(
            "no receivers configured (set %s, --slack-url or --webhook-url): alerts are only recorded",
            ENV_PAGERDUTY_ROUTING_KEY,
        )
    if cfg.state is None:
        log.warning("no --state file: a restart forgets what was paged and may page again")
    # Bind first so --port 0 works and the real port is printed before anything is accepted.
    try:
        sock = bind_tcp(cfg.host, cfg.port)
    except OSError as e:
        print(f"moeguard pager: cannot listen on {cfg.host}:{cfg.port}: {e}", file=sys.stderr)
        return 2
    port = sock.getsockname()[1]
    receivers = ", ".join(w.sink.name for w in pager.workers) or "none"
    print(f"moeguard pager: listening on http://{cfg.host}:{port} (receivers: {receivers})", flush=True)
    pager.start()
    server = uvicorn.Server(
        uvicorn.Config(build_app(pager, cfg.token), log_level=args.log_level, access_log=False, lifespan="on")
    )
    try:
        server.run(sockets=[sock])
    finally:
        pager.stop()
    return 0
