"""Test helpers for the alerting path: real Alertmanager (one, or a cluster on loopback), real
Prometheus and the real collector, with the production rules and Alertmanager config made fast
enough for a test, and a recording sink standing in for PagerDuty, Slack and a webhook.

    with alerting_stack(tmp, n_alertmanagers=2) as st:       # sink + clustered Alertmanagers
        col = start_collector(tmp, st.urls)                     # posts critical guard alerts to both
        prom = start_prometheus(tmp, [col.hostport], st.ports, fast_rules(RULES.read_text(), 60))
        st.post([am_alert("RunHalted", run="r1")])              # as Prometheus would, to every instance
        [page] = st.wait_pd("trigger", run="r1")
        st.ams[0].kill(); st.ams[0].start()                     # same storage and cluster ports

Every process is started on loopback with its own temp dir and free ports; `Proc.stop()`
terminates it (then kills). Logs go to files under the temp dir (`Proc.log`) for post-mortems.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from guard.core import schema
from tests.helpers_http import Recorded, RecordingSink, free_port, http_json, wait_http, wait_until

REPO = Path(__file__).resolve().parent.parent
RULES = REPO / "alerts" / "moeguard.rules.yml"
AM_CONFIG = REPO / "alerts" / "alertmanager.yml"
PROMETHEUS = shutil.which("prometheus")
ALERTMANAGER = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")

ROUTING_KEY = "R0UT1NGKEY-test-0123456789abcdef"
RUNBOOKS = "https://runbooks.example/moeguard"
PD, SLACK, HOOK = "/pd", "/slack", "/hook"  # the sink's paths standing in for each receiver
COLLECTOR_TOKEN = "alerting-test-token"
# A cluster's timers keep production's proportions (peer timeout 15 s, group interval 5 m): the
# instance second in line notifies from the group as it was peer-timeout earlier, so a change
# that lands just after its flush started, and that the first instance notifies within that
# time, makes it notify again (Alertmanager's own race, ~(peer/group)^2 / 2 per change: 1.4%
# here, 0.1% in production). A 1 s group interval with a 1 s peer timeout would double pages.
CLUSTER_GROUP_INTERVAL_S = 6.0
CLUSTER_PEER_TIMEOUT_S = 1.0


@dataclass(slots=True)
class Proc:
    proc: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def hostport(self) -> str:
        return f"127.0.0.1:{self.port}"

    def stop(self) -> None:
        stop_process(self.proc)


def stop_process(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


# ---------------------------------------------------------------------------------------
# The production rules and Alertmanager config, fast
# ---------------------------------------------------------------------------------------
_DURATION = re.compile(r"(\d+)([smh])")
_SECONDS = {"s": 1, "m": 60, "h": 3600}


def fast_rules(text: str, speedup: float | None = None, alerts: set[str] | None = None) -> str:
    """The production rules with `for:` shortened, so a test does not wait 30 minutes: to 0s
    (speedup None) or divided by `speedup` (60: 1m -> 1s, 30m -> 30s, which keeps the order of
    two tiers). Only the rules of `alerts` if given: the others keep their production `for`, so
    a test that drives one alert is not paged by another its workload happens to brush against.
    Exprs, labels and annotations are the real ones; the promtool tests cover the real `for`."""
    out, name, n = [], "", 0
    for line in text.splitlines(keepends=True):
        if m := re.match(r"\s+- (?:alert|record):\s*(\S+)", line):
            name = m.group(1)
        m = re.match(r"(\s+for:\s*)(\S+)\s*$", line)
        if m:
            n += 1
            if alerts is None or name in alerts:
                secs = sum(int(k) * _SECONDS[u] for k, u in _DURATION.findall(m.group(2)))
                line = f"{m.group(1)}{0 if speedup is None else round(secs / speedup)}s\n"
        out.append(line)
    assert n == text.count("- alert:"), "every rule should have a `for:` line"
    assert alerts is None or alerts <= set(re.findall(r"- alert:\s*(\S+)", text)), alerts
    return "".join(out)


def fast_alertmanager(text: str, sink_url: str, secrets: Path, group_interval_s: float = 1.0) -> str:
    """The production Alertmanager config with its receivers pointed at the sink (PagerDuty's
    `url`, the Slack URL and routing key written to secret files as in production, the
    webhook's `url`), group_wait 1 s and a short group_interval."""
    secrets.mkdir(parents=True, exist_ok=True)
    (secrets / "pagerduty-routing-key").write_text(ROUTING_KEY)
    (secrets / "slack-webhook-url").write_text(sink_url + SLACK)
    for old, new in [
        ("/etc/alertmanager/moeguard/", f"{secrets}/"),
        ("url: https://events.pagerduty.com/v2/enqueue", f"url: {sink_url}{PD}"),
        ("url: http://127.0.0.1:5001/moeguard", f"url: {sink_url}{HOOK}"),
        ("group_wait: 30s", "group_wait: 1s"),
        ("group_interval: 5m", f"group_interval: {group_interval_s:g}s"),
    ]:
        assert old in text, f"alerts/alertmanager.yml no longer contains {old!r}; update this helper"
        text = text.replace(old, new)
    return text


# ---------------------------------------------------------------------------------------
# Alertmanager: one, or a cluster gossiping on loopback
# ---------------------------------------------------------------------------------------
@dataclass(slots=True)
class AlertmanagerProc:
    """One Alertmanager that can be killed and started again with the same ports and storage."""

    name: str
    config: Path
    storage: Path
    port: int
    cluster_port: int | None
    peers: list[int]
    log: Path
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> AlertmanagerProc:
        assert ALERTMANAGER is not None
        cluster = (
            [
                f"--cluster.listen-address=127.0.0.1:{self.cluster_port}",
                *(f"--cluster.peer=127.0.0.1:{p}" for p in self.peers),
                # fast gossip; the instance second in line waits peer-timeout for the first's
                # notification log before it notifies itself (see CLUSTER_GROUP_INTERVAL_S)
                "--cluster.gossip-interval=100ms",
                "--cluster.pushpull-interval=1s",
                f"--cluster.peer-timeout={CLUSTER_PEER_TIMEOUT_S:g}s",
                "--cluster.settle-timeout=5s",
            ]
            if self.cluster_port is not None
            else ["--cluster.listen-address="]
        )
        with open(self.log, "ab") as f:
            self.proc = subprocess.Popen(
                [
                    ALERTMANAGER,
                    f"--config.file={self.config}",
                    f"--storage.path={self.storage}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    *cluster,
                    "--log.level=info",
                ],
                stdout=f,
                stderr=subprocess.STDOUT,
            )
        wait_http(f"{self.url}/-/ready", timeout=60)
        return self

    def kill(self) -> None:
        """SIGKILL: no clean shutdown, no last snapshot of the notification log."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def status(self) -> dict[str, Any]:
        status, body = http_json(f"{self.url}/api/v2/status", timeout=5)
        assert status == 200, body
        return body

    def alerts(self, **labels: str) -> list[dict[str, Any]]:
        """Alerts it holds (active, silenced or inhibited) whose labels include `labels`."""
        status, body = http_json(f"{self.url}/api/v2/alerts", timeout=5)
        assert status == 200, body
        return [a for a in body if all(a["labels"].get(k) == v for k, v in labels.items())]


def am_alert(
    alertname: str,
    *,
    run: str = "r1",
    severity: str = "critical",
    scope: str = "run",
    resolved: bool = False,
    **labels: str,
) -> dict[str, Any]:
    """A postable alert as Prometheus sends it (external label runbook_base included)."""
    now = time.time()
    lab = {"alertname": alertname, "run": run, "scope": scope, "severity": severity, "runbook_base": RUNBOOKS}
    return {
        "labels": lab | labels,
        "annotations": {
            "summary": f"{alertname} in run {run}",
            "description": f"Run {run}: {alertname}.",
            "runbook_url": f"{RUNBOOKS}/playbooks/{alertname}.md",
        },
        "startsAt": _iso(now - 60),
        "endsAt": _iso(now - 1 if resolved else now + 300),
    }


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z"


@dataclass
class AlertingStack:
    """A recording sink (PagerDuty at PD, Slack at SLACK, a webhook at HOOK) and Alertmanagers."""

    sink: RecordingSink
    ams: list[AlertmanagerProc]
    tmp: Path
    extra: list[Any] = field(default_factory=list)  # other processes to stop at exit

    @property
    def urls(self) -> list[str]:
        return [am.url for am in self.ams]

    @property
    def ports(self) -> list[int]:
        return [am.port for am in self.ams]

    def post(self, alerts: list[dict[str, Any]]) -> None:
        """To every live instance, as Prometheus and the collector do."""
        for am in self.ams:
            if am.alive():
                status, body = http_json(f"{am.url}/api/v2/alerts", alerts, timeout=5)
                assert status == 200, body

    def pd(self, action: str | None = None, **where: str) -> list[Recorded]:
        """PagerDuty events accepted by the sink, in arrival order, filtered by event_action and
        by the moeguard labels in their payload (run -> group, alertname -> class)."""
        return [r for r in self.sink.received(PD) if r.status < 300 and pd_matches(r.json, action, **where)]

    def wait_pd(self, action: str, count: int = 1, timeout: float = 60, **where: str) -> list[Recorded]:
        return self.sink.wait_for(
            lambda r: r.path == PD and r.status < 300 and pd_matches(r.json, action, **where),
            count=count,
            timeout=timeout,
        )

    def slack(self, **where: str) -> list[Recorded]:
        return [
            r
            for r in self.sink.received(SLACK)
            if r.status < 300
            and all(v in r.json.get("attachments", [{}])[0].get("title", "") for v in where.values())
        ]

    def leader(self) -> AlertmanagerProc:
        """The instance that notifies first (position 0: its name sorts first among the peers)."""
        names = sorted(p["name"] for p in self.ams[0].status()["cluster"]["peers"])
        for am in self.ams:
            if am.alive() and am.status()["cluster"]["name"] == names[0]:
                return am
        raise AssertionError("no live instance is first in line")

    def wait_clustered(self, timeout: float = 60) -> None:
        n = len(self.ams)
        wait_until(
            lambda: all(len(am.status()["cluster"]["peers"]) == n for am in self.ams if am.alive()),
            timeout=timeout,
            interval=0.2,
            what=f"{n} Alertmanagers to see each other",
        )


def pagerduty_story(records: list[Recorded]) -> list[tuple[str, str]]:
    """What PagerDuty makes of these events: ("page", key) for a trigger that opens an incident,
    ("resolve", key) for a resolve that closes one. A trigger with the key of an open incident
    only updates it (Alertmanager sends one whenever its group changes, e.g. a rank recovers):
    no new page. https://developer.pagerduty.com/docs/events-api-v2/trigger-events/"""
    open_keys: set[str] = set()
    story = []
    for r in records:
        key, action = r.json["dedup_key"], r.json["event_action"]
        if action == "trigger" and key not in open_keys:
            open_keys.add(key)
            story.append(("page", key))
        elif action == "resolve" and key in open_keys:
            open_keys.discard(key)
            story.append(("resolve", key))
    return story


def pd_matches(body: Any, action: str | None = None, **where: str) -> bool:
    if not isinstance(body, dict) or (action and body.get("event_action") != action):
        return False
    payload = body.get("payload") or {}
    fields = {
        "run": payload.get("group"),
        "alertname": payload.get("class"),
        "dedup_key": body.get("dedup_key"),
    }
    return all(fields.get(k) == v for k, v in where.items())


@contextlib.contextmanager
def alerting_stack(tmp: Path, n_alertmanagers: int = 1) -> Iterator[AlertingStack]:
    """A sink and `n_alertmanagers` Alertmanagers (clustered when more than one) running the
    production config (group_interval 1 s alone, CLUSTER_GROUP_INTERVAL_S clustered);
    everything stopped at exit, logs left under `tmp`."""
    assert ALERTMANAGER is not None
    tmp.mkdir(parents=True, exist_ok=True)
    with RecordingSink() as sink:
        config = tmp / "alertmanager.yml"
        gi = CLUSTER_GROUP_INTERVAL_S if n_alertmanagers > 1 else 1.0
        config.write_text(fast_alertmanager(AM_CONFIG.read_text(), sink.url, tmp / "secrets", gi))
        cluster = [free_port() for _ in range(n_alertmanagers)] if n_alertmanagers > 1 else [None]
        ams = [
            AlertmanagerProc(
                name=f"am{i}",
                config=config,
                storage=tmp / f"am{i}-data",
                port=free_port(),
                cluster_port=cport,
                peers=[p for p in cluster if p is not None and p != cport],
                log=tmp / f"alertmanager-{i}.log",
            )
            for i, cport in enumerate(cluster)
        ]
        st = AlertingStack(sink, ams, tmp)
        try:
            for am in ams:
                am.start()
            if n_alertmanagers > 1:
                st.wait_clustered()
            yield st
        finally:
            for p in reversed(st.extra):
                p.stop()
            for am in ams:
                am.stop()


def start_alertmanager(tmp: Path, sink_port: int) -> AlertmanagerProc:
    """One Alertmanager (production config, 1 s timers) whose receivers post to the recording sink
    on 127.0.0.1:`sink_port` (PagerDuty at PD, Slack at SLACK, the webhook's v4 payload at HOOK).
    `alerting_stack` is the fuller helper (a sink, a cluster, cleanup)."""
    assert ALERTMANAGER is not None
    tmp.mkdir(parents=True, exist_ok=True)
    config = tmp / f"alertmanager-{sink_port}.yml"
    config.write_text(
        fast_alertmanager(AM_CONFIG.read_text(), f"http://127.0.0.1:{sink_port}", tmp / "secrets")
    )
    am = AlertmanagerProc(
        name="am",
        config=config,
        storage=tmp / "am-data",
        port=free_port(),
        cluster_port=None,
        peers=[],
        log=tmp / "alertmanager.log",
    )
    return am.start()


# ---------------------------------------------------------------------------------------
# Prometheus and the collector
# ---------------------------------------------------------------------------------------
def start_prometheus(
    tmp: Path, targets: list[str], am_ports: int | list[int], rules: str, resend_delay_s: float = 1.0
) -> Proc:
    """Scrapes `targets` every second, evaluates `rules` every second, alerts every Alertmanager
    in `am_ports`; the external label runbook_base makes runbook links absolute, as in production.
    `resend_delay_s`: a firing alert is re-sent this often and is valid for 4x as long (endsAt);
    on a loaded box a 1 s delay lets Alertmanager resolve an alert whose re-send came late, and the
    next one pages again. A new firing alert is sent at once whatever this is."""
    assert PROMETHEUS is not None
    am_ports = [am_ports] if isinstance(am_ports, int) else am_ports
    port = free_port()
    (tmp / "rules.yml").write_text(rules)
    cfg = {  # JSON is YAML
        "global": {
            "scrape_interval": "1s",
            "evaluation_interval": "1s",
            "external_labels": {"runbook_base": RUNBOOKS},
        },
        "rule_files": [str(tmp / "rules.yml")],
        "alerting": {
            "alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{p}" for p in am_ports]}]}]
        },
        "scrape_configs": [{"job_name": "moeguard", "static_configs": [{"targets": targets}]}],
    }
    (tmp / "prometheus.yml").write_text(json.dumps(cfg))
    log = tmp / "prometheus.log"
    with open(log, "ab") as f:
        proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={tmp / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp / 'prom-data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                f"--rules.alert.resend-delay={resend_delay_s:g}s",
                "--log.level=warn",
            ],
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    p = Proc(proc, port, log)
    wait_http(f"{p.url}/-/ready", timeout=60)
    return p


# The collector's resolve delay in these tests: 4x Prometheus's 1 s scrape + 1 s evaluation here, as
# the production default (120 s) is 4x its 15 s + 15 s. At 3 s, a loaded clone's Prometheus re-sent
# the firing alert to one instance of the cluster after the collector's resolve, and that instance
# paged again.
COLLECTOR_RESOLVE_DELAY_S = 8.0


def start_collector(
    tmp: Path,
    alertmanagers: list[str],
    *extra: str,
    runs: Path | None = None,
    python: str = sys.executable,
    cwd: Path = REPO,
    resend_s: float = 1.0,
    resolve_delay_s: float = COLLECTOR_RESOLVE_DELAY_S,
    port: int = 0,
) -> Proc:
    """`python -m guard collector` on a free port, posting critical guard alerts to every URL in
    `alertmanagers` with Prometheus's external label (runbook_base), bearer COLLECTOR_TOKEN."""
    port_file = tmp / f"collector-{time.monotonic_ns()}.port"
    log = tmp / "collector.log"
    env = {**os.environ, schema.ENV_TOKEN: COLLECTOR_TOKEN, "PYTHONUNBUFFERED": "1"}
    am_flags = [a for url in alertmanagers for a in ("--alertmanager-url", url)]
    if alertmanagers:
        am_flags += ["--alert-label", f"runbook_base={RUNBOOKS}", "--alert-resend", str(resend_s)]
        am_flags += ["--alert-resolve-delay", str(resolve_delay_s)]
    with open(log, "ab") as f:
        proc = subprocess.Popen(
            [
                python,
                "-m",
                "guard",
                "collector",
                "--port",
                str(port),
                "--port-file",
                str(port_file),
                "--runs",
                str(runs or tmp / "collector-runs"),
                "--checkpoint-interval",
                "0.5",
                *am_flags,
                "--log-level",
                "info",
                *extra,
            ],
            cwd=cwd,
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
        )

    def port() -> int | None:
        assert proc.poll() is None, f"collector exited early:\n{log.read_text()[-3000:]}"
        return int(port_file.read_text()) if port_file.is_file() else None

    c = Proc(proc, wait_until(port, timeout=60, interval=0.1, what="the collector's port file"), log)
    wait_http(f"{c.url}/healthz", timeout=30)
    return c


def ingest(collector_url: str, batch: dict[str, Any]) -> dict[str, Any]:
    """POST one ingest batch (guard/wire/batch.py's JSON) to a collector; asserts it was stored."""
    status, body = http_json(
        f"{collector_url}/v1/ingest",
        batch,
        timeout=10,
        headers={"authorization": f"Bearer {COLLECTOR_TOKEN}"},
    )
    assert status == 200, body
    return body


def flush_marker(st: AlertingStack, post: Callable[[str], None], timeout: float = 60) -> None:
    """Everything Alertmanager had to send before now has been sent: page a fresh marker run
    (through `post`, the path under test) and wait until PagerDuty got it."""
    run = f"marker-{time.monotonic_ns()}"
    post(run)
    st.wait_pd("trigger", run=run, timeout=timeout)
