"""What each receiver gets: PagerDuty Events v2, a Slack incoming webhook, or a generic webhook
(the normalised incident as JSON). A sink renders bodies; guard/pager/delivery.py sends them."""

from __future__ import annotations

import math
from typing import Any

from guard.pager.config import PD_SEVERITIES
from guard.pager.intake import FIRING, RESOLVED

# Alertmanager `severity` label -> PagerDuty severity. Unknown values become "error".
_PD_SEVERITY = {
    "critical": "critical",
    "page": "critical",
    "error": "error",
    "warning": "warning",
    "info": "info",
    "none": "info",
}


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


def json_safe(obj: Any) -> Any:
    """NaN/Inf are not JSON; PagerDuty and Slack reject them."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [json_safe(v) for v in obj]
    return obj
