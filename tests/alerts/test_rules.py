"""alerts/: the rules are valid and unit-tested (promtool), the Alertmanager config is valid and
routes as intended (amtool), and rules, schema and playbooks agree with each other.

promtool ships in the Debian package `prometheus`, amtool in `prometheus-alertmanager`; CI
installs both, so these tests only skip on a machine without them.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from guard.core import schema
from guard.resources import resource
from tests.alerts.conftest import PrometheusAPI
from tests.alerts.promql import known_metric, label_values, metric_names

REPO = Path(__file__).resolve().parents[2]
ALERTS_DIR = resource("alerts")  # the checkout's, or the installed wheel's (scripts/test-wheel)
RULES = ALERTS_DIR / "moeguard.rules.yml"
AM_CONFIG = ALERTS_DIR / "alertmanager.yml"
PROM_CONFIG = ALERTS_DIR / "prometheus.yml"  # the example: several collectors, one rule set
PROMTOOL_TESTS = sorted((ALERTS_DIR / "tests").glob("*.yml"))
PLAYBOOKS = resource("playbooks")
PROMTOOL = shutil.which("promtool")
AMTOOL = shutil.which("amtool")
LAYER_ALERTS = {"ExpertCollapse", "DeadExperts", "RouterEntropyLow"}
PAGING = {
    "NonFiniteLoss",
    "ExpertCollapse",
    "GuardRollbackStorm",
    "FaultRecurred",
    "CollapseNotRecovered",
    "RunHalted",
    "HeartbeatLost",
    "RunStuck",
    "RunQuarantined",
    "SuspectedHardwareFault",
}

needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool not installed (Debian package `prometheus`)"
)
needs_amtool = pytest.mark.skipif(
    AMTOOL is None, reason="amtool not installed (Debian `prometheus-alertmanager`)"
)


def run(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)


def runbook_template(alert: str) -> str:
    return f"{{{{ with $externalLabels.runbook_base }}}}{{{{ . }}}}/{{{{ end }}}}playbooks/{alert}.md"


# ---------------------------------------------------------------------------------------
# promtool / amtool
# ---------------------------------------------------------------------------------------
@needs_promtool
def test_promtool_check_rules() -> None:
    r = run(PROMTOOL, "check", "rules", "--lint=all", "--lint-fatal", str(RULES))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


@needs_promtool
def test_promtool_unit_tests_pass() -> None:
    assert PROMTOOL_TESTS, "no promtool tests in alerts/tests/"
    r = run(PROMTOOL, "test", "rules", *map(str, PROMTOOL_TESTS))
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.count("SUCCESS") == len(PROMTOOL_TESTS), r.stdout


@needs_promtool
def test_the_example_prometheus_config_scrapes_several_collectors_with_the_rules() -> None:
    r = run(PROMTOOL, "check", "config", str(PROM_CONFIG))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS: 1 rule files found" in r.stdout and RULES.name in r.stdout
    targets = re.search(r"- targets: \[(.*)\]", PROM_CONFIG.read_text())
    # every target on `moeguard collector`'s default port (9090 is Prometheus's own)
    from guard.collector.main import DEFAULT_PORT

    assert targets is not None and targets.group(1).count(f":{DEFAULT_PORT}") >= 2


@needs_amtool
def test_alertmanager_config_is_valid() -> None:
    r = run(AMTOOL, "check-config", str(AM_CONFIG))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


@needs_amtool
@pytest.mark.parametrize(
    ("labels", "receiver"),
    [
        (["alertname=Watchdog", "severity=none", "scope=run"], "blackhole"),
        (["alertname=RunHalted", "severity=critical", "scope=run", "run=r1"], "page"),
        (
            ["alertname=ExpertCollapse", "severity=warning", "scope=layer", "run=r1", "layer=3"],
            "notify",
        ),
        (["alertname=ExpertCollapse", "severity=critical", "scope=layer", "run=r1", "layer=3"], "page"),
        (["alertname=Straggler", "severity=warning", "scope=run", "run=r1", "rank=5"], "notify"),
    ],
)
def test_alertmanager_routes(labels: list[str], receiver: str) -> None:
    r = run(AMTOOL, "config", "routes", "test", f"--config.file={AM_CONFIG}", *labels)
    assert r.returncode == 0, r.stdout + r.stderr
    assert r.stdout.split() == [receiver]


def test_alertmanager_pages_through_its_own_receivers_with_resolves() -> None:
    text = AM_CONFIG.read_text()
    for receiver in ("pagerduty_configs:", "slack_configs:", "webhook_configs:"):
        assert receiver in text
    assert text.count("send_resolved: true") == 3
    # secrets come from files, never from this file
    assert "routing_key_file:" in text and "api_url_file:" in text
    assert "routing_key:" not in text and "api_url:" not in text
    assert "group_by: [alertname, run]" in text
    assert re.search(
        r'source_matchers: \[scope="run", severity="critical"\]\s+target_matchers: \[scope="layer"\]'
        r"\s+equal: \[run\]",
        text,
    )


def test_the_collectors_alerts_carry_their_rules_labels(prometheus: PrometheusAPI) -> None:
    """guard/core/paging.py's PAGED alerts are posted by the collector with the labels of the
    rule that fires for the same thing, so Alertmanager merges them into one alert: same name,
    critical tier, same static labels, the rule's `by (...)` labels, window and threshold."""
    from guard.core.paging import PAGED, alert_labels

    rules = {(r["name"], r["labels"]["severity"]): r for r in alerting(prometheus)}
    recorded = {r["name"]: r["query"] for r in prometheus.rules() if r["type"] == "recording"}
    for a in PAGED:
        rule = rules[(a.alertname, "critical")]
        labels = alert_labels(a, "r1", "0")
        static = {k: v for k, v in labels.items() if k not in a.by}
        assert static == {"alertname": a.alertname, **rule["labels"]}, a.alertname
        query = rule["query"]
        for name, expr in recorded.items():  # read through the recording rule it uses
            query = query.replace(name, f"({expr})")
        by = re.findall(r"by \(([a-z, ]+)\)", query)
        assert by and all(tuple(b.split(", ")) == a.by for b in by[:1]), (a.alertname, by)
        if a.window_s > 0:
            window = (
                f"offset {int(a.window_s // 60)}m"
                if a.window_s < 3600
                else f"offset {int(a.window_s // 3600)}h"
            )
            assert window in query, (a.alertname, window, query)
            assert re.search(rf"(>= {a.threshold}|> {a.threshold - 1})\s*$", rule["query"]), rule["query"]


# ---------------------------------------------------------------------------------------
# Rules, schema and playbooks agree (rules as Prometheus itself parsed them)
# ---------------------------------------------------------------------------------------
def alerting(prometheus: PrometheusAPI) -> list[dict]:
    return [r for r in prometheus.rules() if r["type"] == "alerting"]


def test_every_schema_alert_has_a_rule_a_playbook_and_a_runbook_link(prometheus: PrometheusAPI) -> None:
    rules = alerting(prometheus)
    assert {r["name"] for r in rules} == set(schema.ALERTS)
    for r in rules:
        name = r["name"]
        ann = r["annotations"]
        assert ann.get("summary") and ann.get("description"), name
        assert ann.get("runbook_url") == runbook_template(name), name
        assert (PLAYBOOKS / f"{name}.md").is_file(), f"playbooks/{name}.md is missing"


def test_rule_labels_severity_and_scope(prometheus: PrometheusAPI) -> None:
    severities: dict[str, set[str]] = {}
    for r in alerting(prometheus):
        name, labels = r["name"], r["labels"]
        assert labels.get("scope") == ("layer" if name in LAYER_ALERTS else "run"), name
        assert labels.get("severity") in ({"none"} if name == "Watchdog" else {"critical", "warning"}), name
        severities.setdefault(name, set()).add(labels["severity"])
        if name in LAYER_ALERTS:  # the inhibition and the PagerDuty incident (group_by) need the layer label
            assert re.search(r"by \(run, layer\)", r["query"]), name
    assert {n for n, s in severities.items() if "critical" in s} == PAGING


def test_every_alert_rule_has_a_for_clause() -> None:
    # /api/v1/rules reports duration 0 for both "for: 0m" and no `for`; read the file for this one
    blocks = re.split(r"\n\s+- (?=alert:|record:)", RULES.read_text())
    alerts = [b for b in blocks if b.startswith("alert:")]
    assert len(alerts) >= len(schema.ALERTS)
    for b in alerts:
        assert re.search(r"^\s+for: \d+[smh]$", b, re.M), b.splitlines()[0]


def test_exprs_and_annotation_queries_use_only_schema_metrics(prometheus: PrometheusAPI) -> None:
    rules = prometheus.rules()
    recorded = {r["name"] for r in rules if r["type"] == "recording"}
    metrics = set(schema.METRICS) | recorded
    for r in rules:
        used = metric_names(r["query"])
        for tmpl in r.get("annotations", {}).values():  # {{ with printf "max(x{...})" ... | query }}
            for q in re.findall(r'printf "((?:\\.|[^"\\])*)"', tmpl):
                if "%" in q and "(" in q:
                    used |= metric_names(q.replace("%q", '"x"').replace("%s", "x"))
        unknown = {m for m in used if not known_metric(m, metrics)}
        assert not unknown, f"{r['name']}: {unknown} not in guard/core/schema.py METRICS"
    assert all(":" in n for n in recorded), "recording rules follow level:metric:operations"


def test_detector_and_action_label_values_exist_in_schema(prometheus: PrometheusAPI) -> None:
    seen = set()
    for r in prometheus.rules():
        dets, acts = label_values(r["query"], "detector"), label_values(r["query"], "action")
        assert dets <= set(schema.DETECTORS), (r["name"], dets - set(schema.DETECTORS))
        assert acts <= set(schema.ACTIONS), (r["name"], acts - set(schema.ACTIONS))
        seen |= dets | acts
    assert {schema.DET_GRAD_SPIKE, schema.DET_LOSS_SPIKE, schema.DET_STALL, schema.ACT_ROLLBACK} <= seen


def test_every_alert_has_a_firing_and_a_silent_promtool_case() -> None:
    fires: set[str] = set()
    silent: set[str] = set()
    for f in PROMTOOL_TESTS:
        for case in re.split(r"\n\s+- eval_time:", f.read_text())[1:]:
            name = re.search(r"alertname: (\w+)", case).group(1)
            if re.search(r"exp_alerts: \[\]", case):
                silent.add(name)
            elif re.search(r"exp_alerts:\n\s+- exp_labels:", case):
                assert "exp_annotations:" in case and "runbook_url:" in case, (
                    f"{f.name}: {name} case lacks annotations"
                )
                fires.add(name)
    assert fires == set(schema.ALERTS), set(schema.ALERTS) - fires
    # Watchdog is always firing by design; every other alert has a case where it stays quiet
    assert silent == set(schema.ALERTS) - {"Watchdog"}, set(schema.ALERTS) - {"Watchdog"} - silent


def test_metric_names_parser() -> None:
    assert metric_names('sum by (run) (increase(moeguard_x_total{detector=~"a|b"}[15m])) > 0') == {
        "moeguard_x_total"
    }
    assert metric_names(
        "min by (run, layer) (a_b) < on (run) group_left 0.5 * quantile by (run) (0.5, c_d) and on () count(e offset 1h) > 1e3"
    ) == {"a_b", "c_d", "e"}
    assert metric_names("vector(1)") == set()
    assert metric_names('lvl:metric:op{x="y"} > bool 2') == {"lvl:metric:op"}
    assert label_values('x{detector=~"a|b", action="rollback"}', "detector") == {"a", "b"}
