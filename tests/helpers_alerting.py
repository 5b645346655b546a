"""Test helpers for the alerting path: the real `moeguard pager`, Prometheus and Alertmanager
binaries, and the production rules and Alertmanager config made fast enough for a test.

    pager = start_pager(sink, tmp / "pager")                 # python -m guard pager, port 0
    am = start_alertmanager(tmp, pager.port)                  # alerts/alertmanager.yml, 1 s timers
    prom = start_prometheus(tmp, ["127.0.0.1:9100"], am.port, fast_rules(RULES.read_text(), 60))

Every process is started on loopback with its own temp dir; `Proc.stop()` terminates it (then
kills). Logs go to files under the temp dir (`Proc.log`) for post-mortems.
"""

from __future__ import annotations

import json
import os
import re
import selectors
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from guard.pager.config import ENV_PAGER_TOKEN, ENV_PAGERDUTY_ROUTING_KEY
from tests.helpers_http import RecordingSink, free_port, http_json, wait_http

REPO = Path(__file__).resolve().parent.parent
RULES = REPO / "alerts" / "moeguard.rules.yml"
AM_CONFIG = REPO / "alerts" / "alertmanager.yml"
PROMETHEUS = shutil.which("prometheus")
ALERTMANAGER = shutil.which("prometheus-alertmanager") or shutil.which("alertmanager")

ROUTING_KEY = "R0UT1NGKEY-test-0123456789abcdef"
RUNBOOKS = "https://runbooks.example/moeguard"
PD, SLACK, HOOK = "/pd", "/slack", "/hook"  # the sink's paths standing in for each receiver


@dataclass(slots=True)
class Proc:
    proc: subprocess.Popen
    port: int
    log: Path

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

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
# moeguard pager
# ---------------------------------------------------------------------------------------
class PagerProc(Proc):
    def post(self, path: str, body: Any, **kw: Any) -> tuple[int, Any]:
        return http_json(self.url + path, body, **kw)


def start_pager(
    sink: RecordingSink, workdir: Path, *extra: str, env: dict[str, str] | None = None
) -> PagerProc:
    """`python -m guard pager` on a free port, PagerDuty/Slack/webhook pointed at `sink` (paths
    PD, SLACK, HOOK), state in workdir/pager-state.json, fast retries."""
    workdir.mkdir(parents=True, exist_ok=True)
    log = workdir / f"pager-{time.monotonic_ns()}.log"
    cmd = [
        sys.executable,
        "-m",
        "guard",
        "pager",
        "--port",
        "0",
        "--pagerduty-url",
        sink.url + PD,
        "--slack-url",
        sink.url + SLACK,
        "--webhook-url",
        sink.url + HOOK,
        "--state",
        str(workdir / "pager-state.json"),
        "--retry-base",
        "0.05",
        "--retry-max-delay",
        "0.5",
        "--timeout",
        "5",
        *extra,
    ]
    full_env = {
        **os.environ,
        ENV_PAGERDUTY_ROUTING_KEY: ROUTING_KEY,
        "PYTHONUNBUFFERED": "1",
        **(env or {}),
    }
    if ENV_PAGER_TOKEN not in (env or {}):
        full_env.pop(ENV_PAGER_TOKEN, None)
    with open(log, "wb") as errf:
        proc = subprocess.Popen(cmd, cwd=REPO, env=full_env, stdout=subprocess.PIPE, stderr=errf)
    line = _readline(proc, timeout=60)
    m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
    if not m:
        proc.kill()
        raise AssertionError(f"pager did not start: {line!r}\n{log.read_text()}")
    p = PagerProc(proc, int(m.group(1)), log)
    wait_http(p.url + "/healthz", timeout=30)
    return p


def _readline(proc: subprocess.Popen, timeout: float) -> str:
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    if not sel.select(timeout):
        return ""
    return proc.stdout.readline().decode(errors="replace")


# ---------------------------------------------------------------------------------------
# Prometheus and Alertmanager with the production rules and config
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


def fast_alertmanager(text: str, pager_port: int) -> str:
    """The production Alertmanager config, pointed at the test pager, with 1 s group timers."""
    for old, new in [
        ("127.0.0.1:9095", f"127.0.0.1:{pager_port}"),
        ("group_wait: 30s", "group_wait: 1s"),
        ("group_interval: 5m", "group_interval: 1s"),
    ]:
        assert old in text, f"alerts/alertmanager.yml no longer contains {old!r}; update this test"
        text = text.replace(old, new)
    return text


def start_alertmanager(tmp: Path, pager_port: int) -> Proc:
    assert ALERTMANAGER is not None
    port = free_port()
    (tmp / "am.yml").write_text(fast_alertmanager(AM_CONFIG.read_text(), pager_port))
    log = tmp / "alertmanager.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [
                ALERTMANAGER,
                f"--config.file={tmp / 'am.yml'}",
                f"--storage.path={tmp / 'am-data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--cluster.listen-address=",
                "--log.level=warn",
            ],
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    return Proc(proc, port, log)


def start_prometheus(tmp: Path, targets: list[str], am_port: int, rules: str) -> Proc:
    """Scrapes `targets` every second, evaluates `rules` every second, alerts `am_port`; the
    external label runbook_base makes runbook links absolute, as in production."""
    assert PROMETHEUS is not None
    port = free_port()
    (tmp / "rules.yml").write_text(rules)
    cfg = {  # JSON is YAML
        "global": {
            "scrape_interval": "1s",
            "evaluation_interval": "1s",
            "external_labels": {"runbook_base": RUNBOOKS},
        },
        "rule_files": [str(tmp / "rules.yml")],
        "alerting": {"alertmanagers": [{"static_configs": [{"targets": [f"127.0.0.1:{am_port}"]}]}]},
        "scrape_configs": [{"job_name": "moeguard", "static_configs": [{"targets": targets}]}],
    }
    (tmp / "prometheus.yml").write_text(json.dumps(cfg))
    log = tmp / "prometheus.log"
    with open(log, "wb") as f:
        proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={tmp / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp / 'prom-data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--rules.alert.resend-delay=1s",
                "--log.level=warn",
            ],
            stdout=f,
            stderr=subprocess.STDOUT,
        )
    return Proc(proc, port, log)
