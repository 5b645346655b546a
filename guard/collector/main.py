"""`moeguard collector`: flags, then the HTTP service (see service.py for what it does).

MOEGUARD_TOKEN=... moeguard collector --host 127.0.0.1 --port 18321 --runs runs/

The default port, 18321, is one no common service uses (9090, the default until issue #37, is
Prometheus's own: a collector beside Prometheus failed to start, or a job streamed into Prometheus).
A port another process holds is one line and exit 2, before anything is read or written.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from guard.collector.app import build_app
from guard.collector.config import CollectorConfig
from guard.collector.gc_policy import FreezeSurvivors
from guard.collector.lograte import install as rate_limit_logs
from guard.collector.service import Collector
from guard.core import schema
from guard.core.config import GuardConfig, load_guard_config
from guard.core.heartbeat import HeartbeatConfig
from guard.core.limits import FLAGS as LIMIT_FLAGS
from guard.core.limits import CollectorLimits
from guard.core.progress import ProgressConfig
from guard.store.layout import atomic_write_bytes
from guard.store.policy import StoreConfig, load_store_config
from guard.wire.conn_guard import (
    EVENT_LOOPS,
    HEADER_TIMEOUT_S,
    HTTP_PARSERS,
    KEEP_ALIVE_S,
    ConnectionBudget,
    guarded_protocol,
    http_stack,
)
from guard.wire.listen import bind_tcp
from guard.wire.open_files import FILE_RESERVE_MIN, plan_open_files
from guard.wire.redact import quiet_http_logs

log = logging.getLogger("moeguard.collector")

SWITCH_INTERVAL_S = 0.001  # see run()
DEFAULT_PORT = 18321  # no common service's (IANA-unassigned, below Linux's ephemeral range)


class DefaultsShown(argparse.HelpFormatter):
    """`--help` names every flag's default (a help text that already says it is left alone)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, False, [], argparse.SUPPRESS):
            return text
        return f"{text} (default: %(default)s)".lstrip()


def configure(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = DefaultsShown
    _service_flags(parser)
    _detection_flags(parser)
    _progress_flags(parser)
    _peer_flags(parser)
    _limit_flags(parser)
    parser.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="log lines at this level and above",
    )


def _service_flags(parser: argparse.ArgumentParser) -> None:
    """Where it listens, where runs are stored, who may write, how often rows move to Parquet."""
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (0.0.0.0: every interface)")
    parser.add_argument(
        "--port",
        type=int,
        default=DEFAULT_PORT,
        help="port to listen on; 0 picks a free one (see --port-file). A port in use is one line and exit 2",
    )
    parser.add_argument("--runs", default="runs", help="run store directory (runs/<run_id>/...)")
    parser.add_argument(
        "--insecure-no-auth",
        action="store_true",
        help=f"accept writes without a bearer token (otherwise ${schema.ENV_TOKEN} is required)",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=8 << 20,
        help="a larger request body on any endpoint gets 413, read no further",
    )
    parser.add_argument(
        "--rank-capacity",
        type=int,
        default=None,
        metavar="N",
        help="ranks streaming to this collector at once, over all its runs (default: --max-ranks, one job "
        "of the largest size). Each keeps one keep-alive connection: at start the open-files soft limit "
        "is raised to 2 x N connections (half kept for clients that sent the bearer token) + one log file "
        "per --max-hot-runs + a reserve, up to the hard limit; a hard limit short of that is one WARNING "
        "line naming it and the ranks it covers (ranks past them get 503 and retry from their spool)",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=None,
        metavar="N",
        help="open connections at most (default: what the open-files limit leaves after the files, see "
        "--rank-capacity); half are kept for clients that sent the bearer token",
    )
    parser.add_argument(
        "--http",
        default="auto",
        choices=HTTP_PARSERS,
        help="HTTP/1.1 parser: httptools (C, from the collector extra) or h11 (pure Python); auto takes "
        "httptools when installed (default %(default)s)",
    )
    parser.add_argument(
        "--loop",
        default="auto",
        choices=EVENT_LOOPS,
        help="event loop: asyncio, or uvloop when installed by hand (a few percent less CPU; under EMFILE it "
        "drops new connections where asyncio keeps them waiting); auto is asyncio (default %(default)s)",
    )
    parser.add_argument(
        "--header-timeout",
        type=float,
        default=HEADER_TIMEOUT_S,
        metavar="SECONDS",
        help="a connection that has not sent a whole request head this long after connecting (or after "
        "the first byte of its next request) is closed (default %(default)s)",
    )
    parser.add_argument(
        "--checkpoint-interval",
        type=float,
        default=1.0,
        help="seconds between moves of logged rows into Parquet parts",
    )


def _detection_flags(parser: argparse.ArgumentParser) -> None:
    """The server-side detectors and the heartbeat floor."""
    parser.add_argument(
        "--guard", default=None, help="guard TOML for the server-side detectors (default config)"
    )
    parser.add_argument("--no-detectors", action="store_true", help="do not run detectors server-side")
    parser.add_argument(
        "--store-config",
        default=None,
        metavar="FILE",
        help="TOML whose [store] table sets retention, rollups and compaction of the runs' stores "
        "(default: guard/store/policy.py's; docs/long-runs.md)",
    )
    parser.add_argument(
        "--heartbeat-floor", type=float, default=30.0, help="minimum heartbeat timeout, seconds"
    )


def _progress_flags(parser: argparse.ArgumentParser) -> None:
    """RunStuck's learned deadlines (guard/core/progress.py)."""
    pc = ProgressConfig()
    parser.add_argument(
        "--progress-safety",
        type=float,
        default=pc.safety_factor,
        metavar="X",
        help="RunStuck: a phase's deadline is X times the longest duration seen for it "
        f"(default {pc.safety_factor:g})",
    )
    parser.add_argument(
        "--progress-floor",
        type=float,
        default=pc.floor_s,
        metavar="SECONDS",
        help=f"RunStuck: no deadline is shorter than this (default {pc.floor_s:g})",
    )
    parser.add_argument(
        "--progress-first-deadline",
        type=float,
        default=pc.first_deadline_s,
        metavar="SECONDS",
        help="RunStuck: the deadline of a phase never seen to complete, and of a rank's start-up "
        f"(default {pc.first_deadline_s:g})",
    )


def _peer_flags(parser: argparse.ArgumentParser) -> None:
    """What the collector tells others: its port (to a launcher), critical alerts (to Alertmanager)."""
    parser.add_argument("--port-file", default=None, help="write the bound port here once listening")
    parser.add_argument(
        "--alertmanager-url",
        action="append",
        default=[],
        metavar="URL",
        help="Alertmanager base URL (e.g. http://127.0.0.1:9093; repeat for every instance of a cluster): "
        "critical guard alerts (RunHalted, repeated NaN, rollback storm, suspected hardware fault) are "
        "posted to its /api/v2/alerts the moment they happen, labelled as the Prometheus rule's alert",
    )
    parser.add_argument(
        "--alert-label",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a label added to every alert posted to Alertmanager (repeatable): give Prometheus's "
        "external_labels, so Alertmanager sees the collector's alert and the rule's as one",
    )
    parser.add_argument(
        "--alert-resend",
        type=float,
        default=60.0,
        metavar="SECONDS",
        help="re-send firing alerts this often; each one expires 4x later unless re-sent (default 60)",
    )
    parser.add_argument(
        "--alert-resolve-delay",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="post a resolve this long after an alert ends: longer than Prometheus's scrape plus "
        "evaluation interval, whose resolve comes first; else its late re-send pages again (default 120)",
    )


def _limit_flags(parser: argparse.ArgumentParser) -> None:
    """guard/core/limits.py's CollectorLimits, one flag each (LIMIT_FLAGS names them)."""
    d = CollectorLimits()
    lim = parser.add_argument_group(
        "limits", "a batch over one is refused whole with 400 naming it; see guard/core/limits.py"
    )
    lim.add_argument(
        "--max-hot-runs",
        type=int,
        default=d.max_hot_runs,
        help="runs held in full in memory; the least recently used beyond are checkpointed and evicted, "
        "and reload on their next batch (default %(default)s)",
    )
    lim.add_argument(
        "--max-ranks", type=int, default=d.max_ranks, help="rank ids must be below this (default %(default)s)"
    )
    lim.add_argument(
        "--max-layers",
        type=int,
        default=d.max_layers,
        help="layer ids per report, and every layer id must be below this (default %(default)s)",
    )
    lim.add_argument(
        "--max-detectors",
        type=int,
        default=d.max_detectors,
        help="distinct detector names per run (default %(default)s)",
    )
    lim.add_argument(
        "--max-series-per-run",
        type=int,
        default=d.max_series_per_run,
        help="/metrics series per run; the rest are left out and counted in "
        f"{schema.M_COLLECTOR_SERIES_DROPPED} (default %(default)s)",
    )


def run(args: argparse.Namespace) -> int:
    import uvicorn

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    quiet_http_logs()  # httpx's INFO line per request (the Alertmanager client) stays out of the log
    token = os.environ.get(schema.ENV_TOKEN) or None
    if token is None and not args.insecure_no_auth:
        print(
            f"moeguard collector: set {schema.ENV_TOKEN} (writes need a bearer token), "
            "or pass --insecure-no-auth to accept unauthenticated writes",
            flush=True,
        )
        return 2
    guard_cfg = None if args.no_detectors else load_guard_config(args.guard) if args.guard else GuardConfig()
    try:
        limits = CollectorLimits(**{k: getattr(args, k) for k in LIMIT_FLAGS})
        alert_labels = parse_labels(args.alert_label)
        store = load_store_config(args.store_config) if args.store_config else StoreConfig()
    except ValueError as e:
        print(f"moeguard collector: {e}", flush=True)
        return 2
    try:
        cfg = CollectorConfig(
            runs_dir=Path(args.runs),
            token=token,
            max_body_bytes=args.max_body_bytes,
            limits=limits,
            store=store,
            checkpoint_interval_s=args.checkpoint_interval,
            guard=guard_cfg,
            heartbeat=HeartbeatConfig(floor_s=args.heartbeat_floor),
            alertmanager_urls=tuple(args.alertmanager_url),
            alert_labels=alert_labels,
            alert_resend_s=args.alert_resend,
            alert_resolve_delay_s=args.alert_resolve_delay,
            progress=ProgressConfig(
                safety_factor=args.progress_safety,
                floor_s=args.progress_floor,
                first_deadline_s=args.progress_first_deadline,
            ),
        )
    except ValueError as e:
        print(f"moeguard collector: {e}", flush=True)
        return 2
    # A /metrics render is seconds of pure Python at 10k runs; with the default 5 ms GIL switch
    # interval every hand-off an ingest request needs (event loop, worker thread, after each
    # fdatasync) waits up to 5 ms behind it. 1 ms keeps ingest p99 low while a scrape renders.
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    FreezeSurvivors().install()  # full collections scan what is new, not every connection (gc_policy.py)
    try:
        http, loop = http_stack(args.http, args.loop)
    except ValueError as e:
        print(f"moeguard collector: {e}", flush=True)
        return 2
    try:  # before anything else starts: a port in use is one line, and touches no run
        sock = bind_tcp(args.host, args.port)
    except OSError as e:
        print(port_problem(args.host, args.port, e), file=sys.stderr, flush=True)
        return 2
    conns = _connection_budget(args)
    if conns is None:
        sock.close()
        return 2
    collector = Collector(cfg)  # started by the app's lifespan, so it listens before the runs are scanned
    port = sock.getsockname()[1]
    if args.port_file:
        atomic_write_bytes(Path(args.port_file), str(port).encode())
    log.info(
        "collector listening on http://%s:%d (%s, %s), runs in %s%s",
        args.host,
        port,
        http,
        loop,
        cfg.runs_dir,
        "" if token else " (NO AUTH)",
    )
    server = uvicorn.Server(
        uvicorn.Config(
            build_app(collector, conns),
            log_level=args.log_level,
            access_log=False,
            timeout_graceful_shutdown=10,
            http=guarded_protocol(conns, args.header_timeout, http),
            loop=loop,
            backlog=conns.accept_batch,
            timeout_keep_alive=KEEP_ALIVE_S,
        )
    )
    rate_limit_logs()  # after uvicorn.Config: it sets up its own loggers' handlers
    server.run(sockets=[sock])
    return 0


def _connection_budget(args: argparse.Namespace) -> ConnectionBudget | None:
    """Raise the open-files soft limit to what --rank-capacity needs, cap connections below the limit
    in force; one line says what it got, one more when the hard limit is short (open_files.py says
    why that is a warning, not a refusal). None after one line naming a bad flag."""
    ranks = args.max_ranks if args.rank_capacity is None else args.rank_capacity
    for flag, v in (("--rank-capacity", ranks), ("--max-hot-runs", args.max_hot_runs)):
        if not v >= 1:
            print(f"moeguard collector: {flag} {v}: must be >= 1", flush=True)
            return None
    if not args.header_timeout > 0:
        print(f"moeguard collector: --header-timeout {args.header_timeout}: must be > 0", flush=True)
        return None
    plan = plan_open_files(ranks, args.max_hot_runs, args.max_connections)
    top = plan.nofile - FILE_RESERVE_MIN  # the run store's files need descriptors too
    if args.max_connections is not None and not 4 <= args.max_connections <= top:
        print(
            f"moeguard collector: --max-connections {args.max_connections}: must be in [4, {top}] "
            f"(the open-files limit, `ulimit -n`, is {plan.nofile}; {FILE_RESERVE_MIN} stay for files)",
            flush=True,
        )
        return None
    log.info("%s", plan.summary())
    warning = plan.warning()
    budget = ConnectionBudget.for_plan(plan)
    if warning is not None and args.rank_capacity is not None:
        log.warning("%s", warning)  # the capacity asked for is short: said at once
        budget.short_warning = None  # and not again when the cap is reached
    elif warning is not None:
        # The default capacity is --max-ranks (16,384), the largest job, not the job at hand: most
        # hosts' hard limit is short of it, and a warning at every start for 2 ranks cried wolf.
        # Said here at debug level; ConnectionBudget warns once when the cap is actually reached.
        log.debug("%s", warning)
    return budget


def port_problem(host: str, port: int, e: OSError) -> str:
    """The one line for a port the collector cannot listen on."""
    import errno

    where = f"{host}:{port}"
    if e.errno == errno.EADDRINUSE:
        return (
            f"moeguard collector: --port {port}: {where} is in use by another process (find it with "
            f"`ss -ltnp 'sport = :{port}'`); stop it, or pick another port with --port N (0: any free one, "
            "written to --port-file)"
        )
    return f"moeguard collector: cannot listen on {where}: {e.strerror or e}"


def parse_labels(items: list[str]) -> dict[str, str]:
    """["k=v", ...] -> {k: v}; ValueError naming the bad one."""
    out = {}
    for item in items:
        name, sep, value = item.partition("=")
        if not sep or not name.isidentifier():
            raise ValueError(f"--alert-label {item!r}: expected NAME=VALUE with NAME a label name")
        out[name] = value
    return out
