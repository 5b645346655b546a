"""alerts/README.md's Prometheus snippet pages as fast as alerts/prometheus.yml (issue #37: it had
no intervals, so Prometheus's 1m defaults paged a minute later), scrapes the collector's default
port, is a valid Prometheus config, and the page names Alertmanager's cluster port."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from guard.collector.main import DEFAULT_PORT
from guard.resources import resource

# The checkout's alerts/, or the installed wheel's share/moeguard/alerts (scripts/test-wheel).
ALERTS = resource("alerts")
PROMTOOL = shutil.which("promtool")


def snippet() -> dict:
    text = (ALERTS / "README.md").read_text()
    block = re.search(r"Prometheus:\n\n```yaml\n(.*?)```", text, re.S)
    assert block is not None, "no Prometheus snippet under 'Prometheus:' in alerts/README.md"
    return yaml.safe_load(block.group(1))


def test_the_snippet_has_the_example_configs_intervals_and_the_collectors_port() -> None:
    example = yaml.safe_load((ALERTS / "prometheus.yml").read_text())
    s = snippet()
    for key in ("scrape_interval", "evaluation_interval"):
        assert s["global"][key] == example["global"][key], key
    [target] = s["scrape_configs"][0]["static_configs"][0]["targets"]
    assert target.endswith(f":{DEFAULT_PORT}")


def test_the_page_names_alertmanagers_cluster_port() -> None:
    text = " ".join((ALERTS / "README.md").read_text().split())
    assert "--cluster.listen-address=0.0.0.0:9094" in text
    assert "cluster port (9094" in text and "TCP and UDP" in text


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (scripts/test installs it)")
def test_the_snippet_is_a_valid_prometheus_config(tmp_path: Path) -> None:
    s = snippet()
    shutil.copy(ALERTS / "moeguard.rules.yml", tmp_path / "moeguard.rules.yml")
    s["rule_files"] = ["moeguard.rules.yml"]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(s))
    r = subprocess.run(
        [str(PROMTOOL), "check", "config", str(tmp_path / "prometheus.yml")], capture_output=True, text=True
    )
    assert r.returncode == 0, r.stdout + r.stderr
