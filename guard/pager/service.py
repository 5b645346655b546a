"""`moeguard pager`: Alertmanager webhooks and critical guard events in; PagerDuty, Slack and
generic webhooks out.

    POST /v1/alertmanager   Alertmanager webhook payload v4
    POST /v1/events         a critical guard event {run, step, kind, detector, value, threshold,
                            action, detail}, posted by the collector the moment a run halts
    GET  /healthz

Incidents, not alerts. An incident is what a human is paged for once: alert name, severity,
run and, for per-layer alerts, layer. Ranks are members of their run's incident, so 500 ranks
losing their heartbeat together page once, and it resolves when the last one is back. The
PagerDuty dedup_key is a hash of that identity, so the guard's halt event for run r1 and the
Prometheus alert RunHalted{run="r1"} a minute later land on the same incident.

Delivery. The book keeps, per incident, the desired status (firing while any member fires) and,
per sink, the status last delivered there. One worker thread per sink, off the request path,
sends only the difference, with bounded retries (429, 5xx, connection errors). Every change
to the book is durable in --state (a snapshot plus an append-only journal beside it, see
IncidentBook) before Alertmanager gets its 200 and before the next delivery, so a restart, even
after a kill -9, neither re-pages nor forgets a resolve; Alertmanager's repeat notifications
and a periodic reconcile re-drive whatever failed. A delivery costs one journal append, however
many incidents are open.

Abuse. Bodies are cut off at --max-body-bytes while they stream in (413), JSON deeper than
MAX_JSON_DEPTH is refused (400). Secrets come only from the environment (or --slack-url), and
no URL is logged or stored past its scheme://host: webhook URLs carry their secret in the path.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import hashlib
import hmac
import json
import logging
import math
import os
import queue
import random
import sys
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from guard.core import schema
from guard.core.tomlconf import check, check_choice
from guard.pager.notify import quiet_http_logs, redact_url, redact_urls
from guard.wire.http_limits import BodyLimit, BodyTooLarge, body_too_large_handler
from guard.wire.listen import bind_tcp

log = logging.getLogger("moeguard.pager")

ENV_PAGERDUTY_ROUTING_KEY = "MOEGUARD_PAGERDUTY_ROUTING_KEY"
ENV_SLACK_WEBHOOK_URL = "MOEGUARD_SLACK_WEBHOOK_URL"  # used when --slack-url is not given
ENV_PAGER_TOKEN = "MOEGUARD_PAGER_TOKEN"  # if set, POSTs need "Authorization: Bearer <token>"
PAGERDUTY_EVENTS_URL = "https://events.pagerduty.com/v2/enqueue"

FIRING = "firing"
RESOLVED = "resolved"
ORIGIN_ALERTMANAGER = "alertmanager"
ORIGIN_EVENT = "guard_event"
PD_SEVERITIES = ("info", "warning", "error", "critical")  # rising
# Alertmanager `severity` label -> PagerDuty severity. Unknown values become "error".
_PD_SEVERITY = {
    "critical": "critical",
    "page": "critical",
    "error": "error",
    "warning": "warning",
    "info": "info",
    "none": "info",
}
# Labels that name an incident (when the alert has a run); everything else is member detail.
IDENTITY_LABELS = ("alertname", "severity", "run", "layer")
LAYER_ALERTS = ("ExpertCollapse", "DeadExperts", "RouterEntropyLow")
# Guard event -> the alert (and playbook) it belongs to.
_DETECTOR_ALERTS = {
    schema.DET_NONFINITE: "NonFiniteLoss",
    schema.DET_GRAD_SPIKE: "GradNormSpike",
    schema.DET_LAYER_GRAD_SPIKE: "GradNormSpike",
    schema.DET_LOSS_SPIKE: "LossSpike",
    schema.DET_LR: "LRSpike",
    schema.DET_DEAD_EXPERTS: "DeadExperts",
    schema.DET_MAXVIO: "ExpertCollapse",
    schema.DET_LOAD_ENTROPY: "ExpertCollapse",
    schema.DET_ROUTER_ENTROPY: "RouterEntropyLow",
    schema.DET_STALL: "DataLoaderStall",
    schema.DET_THROUGHPUT: "ThroughputDrop",
}
GENERIC_EVENT_ALERT = "GuardEvent"  # an event no alert covers; pages without a playbook
MAX_BODY_BYTES = 16 << 20  # one Alertmanager group of 1000 ranks is ~2 MB
MAX_JSON_DEPTH = 32  # an Alertmanager payload is 4 deep; deeper input is refused, not recursed into
STATE_VERSION = 2  # 1: one JSON file rewritten on every change (still read)
PRUNE_AFTER_S = 86400.0  # resolved, delivered incidents are forgotten after a day
# The state journal is folded into its snapshot when it outgrows COMPACT_FACTOR x the snapshot
# (and COMPACT_MIN_BYTES), or after COMPACT_IDLE_S without a change, spending at most
# 1/COMPACT_DUTY of the time compacting.
COMPACT_FACTOR = 4
COMPACT_MIN_BYTES = 1 << 20
COMPACT_IDLE_S = 1.0
COMPACT_DUTY = 20


# ---------------------------------------------------------------------------------------
# Config
# ---------------------------------------------------------------------------------------
@dataclass(kw_only=True, slots=True)
class RetryPolicy:
    """Bounded exponential backoff with jitter; Retry-After wins when the server sends one."""

    max_attempts: int = 5
    base_s: float = 1.0
    max_delay_s: float = 30.0
    timeout_s: float = 10.0

    def __post_init__(self) -> None:
        check(self.max_attempts >= 1, "max_attempts", self.max_attempts, "must be >= 1")
        check(self.base_s > 0, "retry_base", self.base_s, "must be > 0")
        check(self.max_delay_s >= self.base_s, "retry_max_delay", self.max_delay_s, "must be >= retry_base")
        check(self.timeout_s > 0, "timeout", self.timeout_s, "must be > 0")

    def delay(self, attempt: int, retry_after: float | None = None) -> float:
        backoff = min(self.max_delay_s, self.base_s * 2**attempt) * random.uniform(0.5, 1.0)
        if retry_after is not None:
            return min(self.max_delay_s, max(backoff, retry_after))
        return backoff


@dataclass(kw_only=True, slots=True)
class PagerConfig:
    host: str = "127.0.0.1"
    port: int = 9095
    pagerduty_url: str = PAGERDUTY_EVENTS_URL
    # Secrets (the routing key, and webhook URLs, which carry theirs in the path) stay out of repr.
    routing_key: str | None = field(default=None, repr=False)  # env only
    slack_url: str | None = field(default=None, repr=False)
    webhook_urls: tuple[str, ...] = field(default=(), repr=False)
    state: Path | None = None
    runbook_base: str = ""  # makes repo-relative runbook links (playbooks/X.md) absolute
    page_severity: str = "critical"  # PagerDuty gets this severity and above
    event_ttl_s: float = 3600.0  # an event-only incident is forgotten (not resolved) after this
    reconcile_s: float = 60.0
    token: str | None = field(default=None, repr=False)  # env only
    max_body_bytes: int = MAX_BODY_BYTES
    retry: RetryPolicy = field(default_factory=RetryPolicy)

    def __post_init__(self) -> None:
        check(0 <= self.port < 65536, "port", self.port, "must be in 0..65535")
        check_choice("page_severity", self.page_severity, PD_SEVERITIES)
        check(self.event_ttl_s > 0, "event_ttl", self.event_ttl_s, "must be > 0")
        check(self.reconcile_s > 0, "reconcile_interval", self.reconcile_s, "must be > 0")
        check(self.max_body_bytes > 0, "max_body_bytes", self.max_body_bytes, "must be > 0")
        for key, url in [
            ("pagerduty_url", self.pagerduty_url),
            ("slack_url", self.slack_url),
            *(("webhook_url", u) for u in self.webhook_urls),
        ]:
            check(
                url is None or url.startswith(("http://", "https://")),
                key,
                redact_url(url) if url else url,
                "must be an http(s) URL",
            )


# ---------------------------------------------------------------------------------------
# Normalising what comes in
# ---------------------------------------------------------------------------------------
class PayloadError(ValueError):
    """A request body the pager cannot use; the message says why (answered with HTTP 400)."""


@dataclass(kw_only=True, slots=True)
class Update:
    """News about one member alert of one incident."""

    key: str
    identity: dict[str, str]
    member: str
    status: str
    labels: dict[str, str]
    annotations: dict[str, str]
    origin: str
    starts_at: str = ""
    generator_url: str = ""
    external_url: str = ""
    details: dict[str, Any] = field(default_factory=dict)


def incident_identity(labels: dict[str, str]) -> dict[str, str]:
    """The labels that name an incident. moeguard alerts (they carry `run`) are named by alert,
    severity, run and layer, so external labels and ranks never split one; other alerts by all
    their labels but rank."""
    if labels.get("run"):
        return {k: labels[k] for k in IDENTITY_LABELS if labels.get(k)}
    return {k: v for k, v in labels.items() if k != "rank"}


def dedup_key(identity: dict[str, str]) -> str:
    """Stable, <= 255 chars, readable prefix: moeguard-<alertname>-<hash of the identity>."""
    canon = json.dumps(identity, sort_keys=True, separators=(",", ":"))
    digest = hashlib.sha256(canon.encode()).hexdigest()[:24]
    name = "".join(c if c.isalnum() or c in "-_" else "_" for c in identity.get("alertname", "alert"))
    return f"moeguard-{name[:64]}-{digest}"


def _str_map(value: Any, where: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in value.items()
    ):
        raise PayloadError(f"{where} must be an object of string to string")
    return dict(value)


def _opt_str(body: dict[str, Any], key: str, where: str) -> str:
    value = body.get(key)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise PayloadError(f"{where}{key} must be a string, got {type(value).__name__}")
    return value


def parse_alertmanager(body: Any) -> list[Update]:
    """Alertmanager webhook payload v4 -> one Update per alert. Raises PayloadError."""
    if not isinstance(body, dict):
        raise PayloadError("expected a JSON object (Alertmanager webhook payload, version 4)")
    version = body.get("version", "4")
    if str(version) != "4":
        raise PayloadError(f"unsupported payload version {version!r}; this endpoint takes version 4")
    alerts = body.get("alerts")
    if not isinstance(alerts, list):
        raise PayloadError("'alerts' must be a list of alerts")
    external_url = _opt_str(body, "externalURL", "")
    updates = []
    for i, alert in enumerate(alerts):
        where = f"alerts[{i}]"
        if not isinstance(alert, dict):
            raise PayloadError(f"{where} must be an object")
        status = alert.get("status")
        if status not in (FIRING, RESOLVED):
            raise PayloadError(f"{where}.status must be 'firing' or 'resolved', got {status!r}")
        labels = _str_map(alert.get("labels"), f"{where}.labels")
        if not labels.get("alertname"):
            raise PayloadError(f"{where}.labels has no alertname")
        annotations = _str_map(alert.get("annotations") or {}, f"{where}.annotations")
        identity = incident_identity(labels)
        member = _opt_str(alert, "fingerprint", f"{where}.") or _digest(labels)
        updates.append(
            Update(
                key=dedup_key(identity),
                identity=identity,
                member=member,
                status=status,
                labels=labels,
                annotations=annotations,
                origin=ORIGIN_ALERTMANAGER,
                starts_at=_opt_str(alert, "startsAt", f"{where}."),
                generator_url=_opt_str(alert, "generatorURL", f"{where}."),
                external_url=external_url,
            )
        )
    return updates


def event_alertname(kind: str, detector: str, action: str) -> str:
    if kind == schema.EV_HALT or action == schema.ACT_HALT:
        return "RunHalted"
    if kind == schema.EV_STRAGGLER:
        return "Straggler"
    if detector in _DETECTOR_ALERTS:
        return _DETECTOR_ALERTS[detector]
    if action == schema.ACT_ROLLBACK:
        return "GuardRollbackStorm"
    return GENERIC_EVENT_ALERT


def _number(body: dict[str, Any], key: str) -> float | None:
    value = body.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise PayloadError(f"{key} must be a number, got {type(value).__name__}")
    return float(value)


def parse_event(body: Any, *, ttl_s: float, now: float) -> Update:
    """A critical guard event -> an Update on the incident of the alert it belongs to."""
    if not isinstance(body, dict):
        raise PayloadError(
            "expected a JSON object {run, step, kind, detector, value, threshold, action, detail}"
        )
    run = body.get("run")
    if not isinstance(run, str) or not run:
        raise PayloadError("run must be a non-empty string")
    kind = body.get("kind")
    if kind not in schema.EVENT_KINDS:
        raise PayloadError(f"kind must be one of {', '.join(schema.EVENT_KINDS)}; got {kind!r}")
    step = body.get("step")
    if step is not None and (isinstance(step, bool) or not isinstance(step, int)):
        raise PayloadError(f"step must be an integer, got {type(step).__name__}")
    detector = _opt_str(body, "detector", "")
    action = _opt_str(body, "action", "")
    value, threshold = _number(body, "value"), _number(body, "threshold")
    detail = body.get("detail") or {}
    if isinstance(detail, str):  # the run store keeps detail as a JSON string
        try:
            detail = json.loads(detail)
        except json.JSONDecodeError as e:
            raise PayloadError(f"detail is a string but not JSON: {e}") from None
    if not isinstance(detail, dict):
        raise PayloadError("detail must be an object (or a JSON string of one)")
    severity = body.get("severity") or detail.get("severity") or "critical"
    if severity not in ("critical", "warning"):
        raise PayloadError(f"severity must be 'critical' or 'warning', got {severity!r}")

    alertname = event_alertname(kind, detector, action)
    labels = {"alertname": alertname, "severity": severity, "run": run, "scope": "run"}
    if alertname in LAYER_ALERTS and detail.get("layer") is not None:
        labels |= {"layer": str(detail["layer"]), "scope": "layer"}
    at = f" at step {step}" if step is not None else ""
    if alertname == "RunHalted":
        summary = f"Run {run} halted itself{at}"
    else:
        summary = f"{alertname}: guard event '{kind}' in run {run}{at}"
    facts = [f"{k}={v}" for k, v in (("detector", detector), ("action", action)) if v]
    facts += [f"{k}={v:.4g}" for k, v in (("value", value), ("threshold", threshold)) if v is not None]
    description = f"Guard event '{kind}'{at}" + (f": {', '.join(facts)}." if facts else ".")
    annotations = {"summary": summary, "description": description}
    if alertname in schema.ALERTS:
        annotations["runbook_url"] = f"playbooks/{alertname}.md"
    identity = incident_identity(labels)
    return Update(
        key=dedup_key(identity),
        identity=identity,
        member=f"event:{kind}:{detector}",
        status=FIRING,
        labels=labels,
        annotations=annotations,
        origin=ORIGIN_EVENT,
        details={
            "event": {
                "step": step,
                "kind": kind,
                "detector": detector,
                "value": value,
                "threshold": threshold,
                "action": action,
                "detail": detail,
            },
            "expires": now + ttl_s,
        },
    )


def _digest(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------
# The incident book: desired state in, delivered state per sink, persisted
# ---------------------------------------------------------------------------------------
def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    """`path` holds `data` or what it held before, even across a kill -9 or a power cut."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    _fsync_dir(path.parent)


def journal_path(state: Path) -> Path:
    return state.with_name(state.name + ".journal")


def _apply_op(incidents: dict[str, dict[str, Any]], op: list[Any]) -> None:
    """One journal operation; the live book makes its changes through here too, so a replay
    rebuilds exactly what was acknowledged."""
    kind, key = op[0], op[1]
    if kind == "put":
        incidents[key] = op[2]
    elif kind == "del":
        incidents.pop(key, None)
    elif kind == "sent":
        inc = incidents.get(key)
        if inc is None:
            return
        sink, status, error = op[2], op[3], op[4]
        if status is not None:
            inc["sent"][sink] = status
            inc["errors"].pop(sink, None)
        else:
            inc["errors"][sink] = error
    else:
        raise ValueError(f"unknown journal operation {kind!r}")


def read_state(state: Path) -> tuple[int, dict[str, dict[str, Any]]]:
    """(generation, incidents) as acknowledged: the snapshot, then its journal's batches.

    A torn last line (a kill -9 inside the append) was never acknowledged and is skipped. A
    journal of an older generation is left over from a compaction cut short: the snapshot
    already holds it. Raises ValueError on anything else that does not add up."""
    generation, incidents = 0, {}
    if state.exists():
        data = json.loads(state.read_bytes())
        version = data.get("version") if isinstance(data, dict) else None
        if version not in (1, STATE_VERSION):
            raise ValueError(f"state file {state} has version {version!r}, expected {STATE_VERSION}")
        generation, incidents = data.get("generation", 0), data.get("incidents")
        if not isinstance(generation, int) or not isinstance(incidents, dict):
            raise ValueError(f"state file {state} has no generation number or no incidents object")
    journal = journal_path(state)
    if not journal.exists():
        return generation, incidents
    lines = journal.read_bytes().split(b"\n")  # complete lines end with "\n": the last item is b""
    header = json.loads(lines[0])  # written whole (atomically) by the compaction that made it
    journal_generation = header.get("generation") if isinstance(header, dict) else None
    if not isinstance(journal_generation, int):
        raise ValueError(f"journal {journal} has no generation in its first line")
    if journal_generation < generation:
        return generation, incidents
    if journal_generation != generation:
        raise ValueError(
            f"journal {journal} is generation {journal_generation} but {state} is generation "
            f"{generation}: was the state file replaced by hand?"
        )
    for n, line in enumerate(lines[1:-1], start=2):
        try:
            for op in json.loads(line)["ops"]:
                _apply_op(incidents, op)
        except (ValueError, LookupError, TypeError, AttributeError) as e:
            raise ValueError(f"journal {journal} line {n} is damaged: {e!r}") from None
    if lines[-1]:
        log.warning(
            "state journal %s: ignored a torn last line (%d bytes, never acknowledged)",
            journal,
            len(lines[-1]),
        )
    return generation, incidents


class IncidentBook:
    """Incidents by dedup_key. Thread-safe. With a `path`, every change is durable before the
    call that made it returns, at a cost that does not grow with the book:

        path          {"version": 2, "generation": g, "incidents": {...}}, replaced atomically
        path.journal  {"generation": g}, then one line per batch of changes since snapshot g:
                      {"ops": [["put", key, incident] | ["del", key]
                               | ["sent", key, sink, status or null, error or null], ...]}

    A batch is one append and one fdatasync. The journal is folded into a new snapshot
    (generation g+1, then a fresh journal) at start, when the book has been idle a moment, and
    when it outgrows COMPACT_FACTOR x the snapshot, so compaction costs O(1) per change
    amortised and a restart replays little."""

    def __init__(self, path: Path | None = None) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._incidents: dict[str, dict[str, Any]] = {}
        self._generation = 0
        self._journal: Any = None  # binary append handle
        self._journal_bytes = self._snapshot_bytes = 0
        self._dirty = False  # the journal has batches the snapshot lacks
        self._changed_at = self._compacted_at = time.monotonic()
        self._compact_s = 0.0
        if path is not None:
            try:
                self._generation, self._incidents = read_state(path)
            except (OSError, ValueError) as e:
                raise SystemExit(f"moeguard pager: cannot read state file {path}: {e}") from None
            with self._lock:
                self._compact_locked()

    def apply(self, updates: list[Update], now: float) -> list[str]:
        """Record member news; returns the keys whose desired status may have changed."""
        touched: list[str] = []
        with self._lock:
            for u in updates:
                inc = self._incidents.get(u.key)
                if inc is None:
                    if u.status == RESOLVED:
                        continue  # never saw it firing: nothing to resolve
                    inc = self._incidents[u.key] = {
                        "key": u.key,
                        "identity": u.identity,
                        "status": RESOLVED,
                        "members": {},
                        "sent": {},
                        "errors": {},
                        "created": now,
                    }
                if u.origin == ORIGIN_ALERTMANAGER:
                    # Alertmanager knows this incident now; it, not the event TTL, ends it.
                    inc["members"] = {m: v for m, v in inc["members"].items() if v["origin"] != ORIGIN_EVENT}
                if u.status == FIRING:
                    inc["members"][u.member] = {
                        "origin": u.origin,
                        "labels": u.labels,
                        "expires": u.details.get("expires"),
                    }
                    inc.update(
                        labels=u.labels,
                        annotations=u.annotations,
                        origin=u.origin,
                        starts_at=u.starts_at,
                        generator_url=u.generator_url,
                        external_url=u.external_url,
                        event=u.details.get("event"),
                    )
                else:
                    inc["members"].pop(u.member, None)
                inc["status"] = FIRING if inc["members"] else RESOLVED
                inc["updated"] = now
                if u.key not in touched:
                    touched.append(u.key)
            self._log_locked([["put", k, self._incidents[k]] for k in touched])
        return touched

    def expire_events(self, now: float) -> int:
        """Forget event-only incidents past their TTL. No resolve is sent: an event says a run
        needs a human, never that it is fine again, so the page stays open until one closes it.
        Resolved incidents delivered everywhere are forgotten PRUNE_AFTER_S after their change."""
        with self._lock:
            stale = [
                k
                for k, inc in self._incidents.items()
                if inc["members"]
                and all(
                    m["origin"] == ORIGIN_EVENT and (m["expires"] or math.inf) < now
                    for m in inc["members"].values()
                )
            ]
            done = [
                k
                for k, inc in self._incidents.items()
                if inc["status"] == RESOLVED
                and FIRING not in inc["sent"].values()
                and now - inc["updated"] > PRUNE_AFTER_S
            ]
            ops = [["del", k] for k in stale + done]
            for op in ops:
                _apply_op(self._incidents, op)
            self._log_locked(ops)
        return len(stale)

    def snapshot(self, key: str) -> dict[str, Any] | None:
        with self._lock:
            inc = self._incidents.get(key)
            return copy.deepcopy(inc) if inc is not None else None

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._incidents)

    def record(self, key: str, sink: str, status: str | None, error: str | None) -> bool:
        """After a delivery attempt: `status` delivered (or None on failure). Returns whether
        the incident still differs from what `sink` has (its status changed meanwhile)."""
        with self._lock:
            inc = self._incidents.get(key)
            if inc is None:
                return False
            op = ["sent", key, sink, status, None if status is not None else error]
            _apply_op(self._incidents, op)
            self._log_locked([op])
            return status is not None and inc["status"] != status

    def stats(self) -> dict[str, int]:
        with self._lock:
            firing = sum(inc["status"] == FIRING for inc in self._incidents.values())
            failing = sum(bool(inc["errors"]) for inc in self._incidents.values())
            return {"incidents": len(self._incidents), "firing": firing, "failing": failing}

    def compact_if_idle(self, idle_s: float = COMPACT_IDLE_S) -> bool:
        """Fold the journal into the snapshot once nothing changed for `idle_s`, at most
        1/COMPACT_DUTY of the time, so `path` alone is the current book for whoever reads it."""
        with self._lock:
            now = time.monotonic()
            if (
                not self._dirty
                or now - self._changed_at < idle_s
                or now - self._compacted_at < COMPACT_DUTY * self._compact_s
            ):
                return False
            self._compact_locked()
            return True

    def checkpoint(self) -> None:
        """Fold the journal into the snapshot now (a clean stop leaves one current file)."""
        with self._lock:
            if self.path is not None and self._dirty:
                self._compact_locked()

    def _log_locked(self, ops: list[list[Any]]) -> None:
        """Append one batch and fdatasync it; compact when the journal has grown too long."""
        if self.path is None or not ops:
            return
        if self._journal is None:  # a compaction failed half-way: a whole snapshot holds this batch too
            self._compact_locked()
            return
        line = json.dumps({"ops": ops}, separators=(",", ":"), default=str).encode() + b"\n"
        try:
            self._journal.write(line)
            self._journal.flush()
            os.fdatasync(self._journal.fileno())
        except OSError:
            # Cut a partial line off: batches appended after it would read as damage.
            with contextlib.suppress(OSError):
                self._journal.truncate(self._journal_bytes)
            raise
        self._journal_bytes += len(line)
        self._dirty, self._changed_at = True, time.monotonic()
        if self._journal_bytes > max(COMPACT_MIN_BYTES, COMPACT_FACTOR * self._snapshot_bytes):
            try:
                self._compact_locked()
            except OSError as e:  # this batch is durable in the journal already
                log.error("state %s: compaction failed, will retry: %s", self.path, e)

    def _compact_locked(self) -> None:
        """Snapshot g+1, then a fresh journal for g+1. A crash between the two leaves journal g
        beside snapshot g+1, which the next start ignores (the snapshot holds all of it)."""
        assert self.path is not None
        t0 = time.monotonic()
        generation = self._generation + 1
        data = json.dumps(
            {"version": STATE_VERSION, "generation": generation, "incidents": self._incidents},
            sort_keys=True,
            default=str,
        ).encode()
        _write_atomic(self.path, data)
        # From here journal g no longer counts: nothing may be appended to it.
        self._generation, self._snapshot_bytes = generation, len(data)
        if self._journal is not None:
            self._journal.close()
            self._journal = None
        header = json.dumps({"generation": generation}).encode() + b"\n"
        _write_atomic(journal_path(self.path), header)
        self._journal = open(journal_path(self.path), "ab")  # noqa: SIM115 (kept open for appends)
        self._journal_bytes = len(header)
        self._dirty = False
        self._compacted_at = time.monotonic()
        self._compact_s = self._compacted_at - t0


def delivery_needed(inc: dict[str, Any], sent: str | None) -> str | None:
    """The status to deliver to a sink that last got `sent`, or None if it is up to date.
    A sink that never heard of a firing incident gets no resolve."""
    if inc["status"] == FIRING and sent != FIRING:
        return FIRING
    if inc["status"] == RESOLVED and sent == FIRING:
        return RESOLVED
    return None


# ---------------------------------------------------------------------------------------
# Sinks: what each receiver gets
# ---------------------------------------------------------------------------------------
def absolute_url(url: str, base: str) -> str:
    if not url or url.startswith(("http://", "https://")) or not base:
        return url
    return f"{base.rstrip('/')}/{url.lstrip('/')}"


def incident_view(inc: dict[str, Any], status: str, runbook_base: str) -> dict[str, Any]:
    """The normalised incident every sink renders (and what generic webhooks receive)."""
    labels, ann = inc.get("labels", {}), inc.get("annotations", {})
    ident = inc["identity"]
    ranks = sorted(
        {m["labels"]["rank"] for m in inc["members"].values() if m["labels"].get("rank")},
        key=lambda r: (len(r), r),
    )
    return {
        "dedup_key": inc["key"],
        "status": status,
        "alertname": ident.get("alertname", ""),
        "severity": ident.get("severity", labels.get("severity", "")),
        "run": ident.get("run", ""),
        "layer": ident.get("layer", ""),
        "ranks": ranks,
        "summary": ann.get("summary") or f"{ident.get('alertname', 'alert')} {ident}",
        "description": ann.get("description", ""),
        "runbook_url": absolute_url(ann.get("runbook_url", ""), runbook_base),
        "generator_url": inc.get("generator_url", ""),
        "alertmanager_url": inc.get("external_url", ""),
        "starts_at": inc.get("starts_at", ""),
        "origin": inc.get("origin", ""),
        "labels": labels,
        "event": inc.get("event"),
    }


def _is_url(s: str) -> bool:
    return s.startswith(("http://", "https://"))


class Sink:
    name = "sink"

    def __init__(self, url: str, runbook_base: str) -> None:
        self.url = url
        self.runbook_base = runbook_base

    def wants(self, inc: dict[str, Any]) -> bool:
        return inc["identity"].get("severity") != "none"  # Watchdog is for machines

    def body(self, inc: dict[str, Any], status: str) -> dict[str, Any]:
        raise NotImplementedError


class PagerDutySink(Sink):
    """PagerDuty Events API v2: trigger / resolve on one dedup_key per incident."""

    name = "pagerduty"

    def __init__(self, url: str, runbook_base: str, routing_key: str, page_severity: str) -> None:
        super().__init__(url, runbook_base)
        self.routing_key = routing_key
        self.min_rank = PD_SEVERITIES.index(page_severity)

    def wants(self, inc: dict[str, Any]) -> bool:
        return PD_SEVERITIES.index(pd_severity(inc["identity"].get("severity", ""))) >= self.min_rank

    def body(self, inc: dict[str, Any], status: str) -> dict[str, Any]:
        base = {"routing_key": self.routing_key, "dedup_key": inc["key"]}
        if status == RESOLVED:
            return base | {"event_action": "resolve"}
        v = incident_view(inc, status, self.runbook_base)
        component = (
            f"layer {v['layer']}"
            if v["layer"]
            else (f"rank {', '.join(v['ranks'])}" if v["ranks"] else "run")
        )
        links = []
        if _is_url(v["runbook_url"]):
            links.append({"href": v["runbook_url"], "text": f"Playbook: {v['alertname']}"})
        if _is_url(v["generator_url"]):
            links.append({"href": v["generator_url"], "text": "Prometheus query"})
        details = {
            k: v[k]
            for k in ("description", "runbook_url", "ranks", "starts_at", "origin", "labels", "event")
            if v[k]
        }
        body = base | {
            "event_action": "trigger",
            "payload": {
                "summary": _clip(v["summary"], 1024),
                "source": f"moeguard/{v['run']}" if v["run"] else "moeguard",
                "severity": pd_severity(v["severity"]),
                "component": _clip(component, 255),
                "group": v["run"] or "moeguard",
                "class": v["alertname"],
                "custom_details": details,
            },
            "links": links,
            "client": "moeguard pager",
        }
        if _is_url(v["alertmanager_url"]):
            body["client_url"] = v["alertmanager_url"]
        return body


def pd_severity(severity: str) -> str:
    return _PD_SEVERITY.get(severity.lower(), "error")


class SlackSink(Sink):
    """Slack incoming webhook: a fallback `text` plus blocks with the playbook link."""

    name = "slack"

    def body(self, inc: dict[str, Any], status: str) -> dict[str, Any]:
        v = incident_view(inc, status, self.runbook_base)
        state = "RESOLVED" if status == RESOLVED else f"FIRING {v['severity'].upper()}"
        title = f"[{state}] {v['summary']}"
        where = [f"*Run*\n{_slack(v['run'] or '-')}", f"*Severity*\n{_slack(v['severity'])}"]
        if v["layer"]:
            where.append(f"*Layer*\n{_slack(v['layer'])}")
        if v["ranks"]:
            where.append(f"*Ranks*\n{_slack(_clip(', '.join(v['ranks']), 200))}")
        links = []
        if v["runbook_url"]:
            links.append(
                f"<{v['runbook_url']}|Playbook: {v['alertname']}>"
                if _is_url(v["runbook_url"])
                else f"Playbook: `{v['runbook_url']}`"
            )
        if _is_url(v["generator_url"]):
            links.append(f"<{v['generator_url']}|Prometheus query>")
        blocks: list[dict[str, Any]] = [
            {"type": "header", "text": {"type": "plain_text", "text": _clip(title, 150)}},
        ]
        if v["description"] and status == FIRING:
            blocks.append(
                {"type": "section", "text": {"type": "mrkdwn", "text": _clip(_slack(v["description"]), 3000)}}
            )
        blocks.append({"type": "section", "fields": [{"type": "mrkdwn", "text": f} for f in where]})
        if links:
            blocks.append({"type": "context", "elements": [{"type": "mrkdwn", "text": "  |  ".join(links)}]})
        text = _slack(title) + (f"  {links[0]}" if links else "")
        return {"text": text, "blocks": blocks}


class WebhookSink(Sink):
    """Any HTTP endpoint: the normalised incident as JSON."""

    def __init__(self, url: str, runbook_base: str, index: int) -> None:
        super().__init__(url, runbook_base)
        self.name = f"webhook-{index}"

    def body(self, inc: dict[str, Any], status: str) -> dict[str, Any]:
        return {"version": 1, "source": "moeguard-pager"} | incident_view(inc, status, self.runbook_base)


def _clip(s: str, n: int) -> str:
    return s if len(s) <= n else s[: n - 1] + "…"


def _slack(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def _json_safe(obj: Any) -> Any:
    """NaN/Inf are not JSON; PagerDuty and Slack reject them."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [_json_safe(v) for v in obj]
    return obj


# ---------------------------------------------------------------------------------------
# Delivery
# ---------------------------------------------------------------------------------------
def _retry_after(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None  # an HTTP date: fall back to our own backoff


def post_with_retry(
    client: httpx.Client, url: str, body: dict[str, Any], policy: RetryPolicy, stop: threading.Event
) -> tuple[bool, str]:
    """POST JSON; retry 429, 5xx and transport errors with backoff. Returns (delivered, why)."""
    content = json.dumps(_json_safe(body), allow_nan=False, default=str).encode()
    why = ""
    for attempt in range(policy.max_attempts):
        retry_after = None
        try:
            r = client.post(
                url, content=content, headers={"Content-Type": "application/json"}, timeout=policy.timeout_s
            )
        except httpx.TransportError as e:  # refused, reset, DNS, timeout
            why = redact_urls(f"{type(e).__name__}: {e}")
        else:
            if 200 <= r.status_code < 300:
                return True, f"HTTP {r.status_code}"
            why = redact_urls(f"HTTP {r.status_code}: {r.text[:200]}")
            if r.status_code != 429 and r.status_code < 500:
                return False, why  # the request itself is wrong; retrying will not help
            retry_after = _retry_after(r.headers.get("retry-after"))
        if attempt + 1 < policy.max_attempts and stop.wait(policy.delay(attempt, retry_after)):
            return False, f"{why} (shutting down)"
    return False, f"{why} (gave up after {policy.max_attempts} attempts)"


class SinkWorker:
    """One thread per sink, so a slow or failing receiver never delays the others."""

    def __init__(self, sink: Sink, book: IncidentBook, policy: RetryPolicy) -> None:
        self.sink, self.book, self.policy = sink, book, policy
        self._queue: queue.Queue[str] = queue.Queue()
        self._queued: set[str] = set()
        self._qlock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name=f"pager-{sink.name}", daemon=True)
        self.delivered = 0
        self.failed = 0

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        self._queue.put("")  # wake the loop
        if timeout > 0:
            self._thread.join(timeout)

    def enqueue(self, key: str) -> None:
        with self._qlock:
            if key in self._queued:
                return
            self._queued.add(key)
        self._queue.put(key)

    def depth(self) -> int:
        return self._queue.qsize()

    def _loop(self) -> None:
        with httpx.Client(headers={"User-Agent": "moeguard-pager"}) as client:
            while not self._stop.is_set():
                key = self._queue.get()
                with self._qlock:
                    self._queued.discard(key)
                if not key or self._stop.is_set():
                    continue
                try:
                    self._deliver(client, key)
                except Exception as e:  # a dead worker would be a silent paging outage
                    self.failed += 1
                    why = redact_urls(f"{type(e).__name__}: {e}")
                    log.error("%s: delivery of %s failed unexpectedly: %s", self.sink.name, key, why)

    def _deliver(self, client: httpx.Client, key: str) -> None:
        inc = self.book.snapshot(key)
        if inc is None or not self.sink.wants(inc):
            return
        status = delivery_needed(inc, inc["sent"].get(self.sink.name))
        if status is None:
            return
        ok, why = post_with_retry(client, self.sink.url, self.sink.body(inc, status), self.policy, self._stop)
        alert = inc["identity"].get("alertname")
        if ok:
            self.delivered += 1
            log.info("%s: %s %s (%s) %s", self.sink.name, status, alert, key, why)
        else:
            self.failed += 1
            log.error("%s: could not deliver %s %s (%s): %s", self.sink.name, status, alert, key, why)
        if self.book.record(key, self.sink.name, status if ok else None, None if ok else why):
            self.enqueue(key)  # it changed while we were sending


class Pager:
    """The book, the sinks and their workers, and a reconcile loop that re-drives failures."""

    def __init__(self, cfg: PagerConfig) -> None:
        quiet_http_logs()  # httpx would log every webhook URL, secret path included, at INFO
        self.cfg = cfg
        self.book = IncidentBook(cfg.state)
        sinks: list[Sink] = []
        if cfg.routing_key:
            sinks.append(
                PagerDutySink(cfg.pagerduty_url, cfg.runbook_base, cfg.routing_key, cfg.page_severity)
            )
        if cfg.slack_url:
            sinks.append(SlackSink(cfg.slack_url, cfg.runbook_base))
        sinks += [WebhookSink(u, cfg.runbook_base, i) for i, u in enumerate(cfg.webhook_urls)]
        self.workers = [SinkWorker(s, self.book, cfg.retry) for s in sinks]
        self._stop = threading.Event()
        self._reconciler = threading.Thread(target=self._reconcile_loop, name="pager-reconcile", daemon=True)

    def start(self) -> None:
        for w in self.workers:
            w.start()
        self.reconcile()  # a restart picks up whatever the last process had not delivered
        self._reconciler.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Stop the workers (all at once; a send in flight gets `timeout`), then compact the state."""
        self._stop.set()
        for w in self.workers:
            w.stop(timeout=0)
        deadline = time.monotonic() + timeout
        for w in self.workers:
            w.stop(timeout=max(0.01, deadline - time.monotonic()))
        try:
            self.book.checkpoint()
        except OSError as e:  # the journal still holds every change
            log.error("could not compact the state file at exit: %s", e)

    def accept(self, updates: list[Update]) -> list[str]:
        keys = self.book.apply(updates, time.time())
        for w in self.workers:
            for k in keys:
                w.enqueue(k)
        return keys

    def reconcile(self) -> None:
        self.book.expire_events(time.time())
        for key in self.book.keys():
            for w in self.workers:
                w.enqueue(key)  # the worker skips keys that are up to date

    def health(self) -> dict[str, Any]:
        return {
            "status": "ok",
            **self.book.stats(),
            "sinks": {
                w.sink.name: {"queued": w.depth(), "delivered": w.delivered, "failed": w.failed}
                for w in self.workers
            },
            "state": str(self.cfg.state) if self.cfg.state else None,
        }

    def _reconcile_loop(self) -> None:
        due = time.monotonic() + self.cfg.reconcile_s
        while not self._stop.wait(min(COMPACT_IDLE_S, self.cfg.reconcile_s)):
            try:
                if time.monotonic() >= due:
                    due = time.monotonic() + self.cfg.reconcile_s
                    self.reconcile()
                self.book.compact_if_idle()
            except OSError as e:  # a full disk: say so, keep re-driving
                log.error("reconcile: %s", e)


# ---------------------------------------------------------------------------------------
# HTTP
# ---------------------------------------------------------------------------------------
def parse_json(raw: bytes) -> Any:
    """A request body -> JSON no deeper than MAX_JSON_DEPTH. Raises PayloadError."""
    too_deep = f"body is JSON nested deeper than {MAX_JSON_DEPTH} levels"
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PayloadError(f"body is not valid JSON: {e}") from None
    except RecursionError:  # the C decoder stops near the interpreter's recursion limit
        raise PayloadError(too_deep) from None
    # Checked here, iteratively: deepcopy and json.dumps of the incident recurse.
    stack = [(body, 1)] if isinstance(body, dict | list) else []
    while stack:
        obj, depth = stack.pop()
        if depth > MAX_JSON_DEPTH:
            raise PayloadError(too_deep)
        children = obj.values() if isinstance(obj, dict) else obj
        stack.extend((c, depth + 1) for c in children if isinstance(c, dict | list))
    return body


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


# ---------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------
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
    parser.add_argument("--max-attempts", type=int, default=5, help="delivery attempts per notification")
    parser.add_argument("--retry-base", type=float, default=1.0, help="first retry delay, seconds (doubles)")
    parser.add_argument("--retry-max-delay", type=float, default=30.0, help="longest retry delay, seconds")
    parser.add_argument("--timeout", type=float, default=10.0, help="HTTP timeout per attempt, seconds")
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
        pagerduty_url=args.pagerduty_url,
        routing_key=env.get(ENV_PAGERDUTY_ROUTING_KEY) or None,
        slack_url=args.slack_url or env.get(ENV_SLACK_WEBHOOK_URL) or None,
        webhook_urls=tuple(args.webhook_url),
        state=args.state,
        runbook_base=args.runbook_base,
        page_severity=args.page_severity,
        event_ttl_s=args.event_ttl,
        reconcile_s=args.reconcile_interval,
        token=env.get(ENV_PAGER_TOKEN) or None,
        max_body_bytes=args.max_body_bytes,
        retry=RetryPolicy(
            max_attempts=args.max_attempts,
            base_s=args.retry_base,
            max_delay_s=args.retry_max_delay,
            timeout_s=args.timeout,
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
