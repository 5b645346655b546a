"""What comes into `moeguard pager`, normalised: Alertmanager webhook payloads (v4) and critical
guard events become `Update`s, news about one member of one incident.

Incidents, not alerts. An incident is what a human is paged for once: alert name, severity,
run and, for per-layer alerts, layer. Ranks are members of their run's incident, so 500 ranks
losing their heartbeat together page once, and it resolves when the last one is back. The
PagerDuty dedup_key is a hash of that identity, so the guard's halt event for run r1 and the
Prometheus alert RunHalted{run="r1"} a minute later land on the same incident.

Abuse: JSON deeper than MAX_JSON_DEPTH is refused (PayloadError, answered with 400).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from guard.core import schema

FIRING = "firing"
RESOLVED = "resolved"
ORIGIN_ALERTMANAGER = "alertmanager"
ORIGIN_EVENT = "guard_event"
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
MAX_JSON_DEPTH = 32  # an Alertmanager payload is 4 deep; deeper input is refused, not recursed into


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
