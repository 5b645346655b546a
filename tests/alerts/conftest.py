"""A real Prometheus loaded with alerts/moeguard.rules.yml: its /api/v1/rules is the ground truth
for what the rules say (no YAML parser needed), and /api/v1/query checks that PromQL parses."""

from __future__ import annotations

import json
import shutil
import subprocess
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from guard.resources import resource
from tests.helpers_http import free_port, http_json, wait_http, wait_until

REPO = Path(__file__).resolve().parents[2]
RULES = resource("alerts", "moeguard.rules.yml")  # the checkout's, or the installed wheel's
PROMETHEUS = shutil.which("prometheus")


@dataclass(slots=True)
class PrometheusAPI:
    url: str

    def rules(self) -> list[dict[str, Any]]:
        status, body = http_json(f"{self.url}/api/v1/rules")
        assert status == 200, body
        return [r | {"group": g["name"]} for g in body["data"]["groups"] for r in g["rules"]]

    def query(self, expr: str) -> tuple[int, Any]:
        return http_json(f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expr}))


@pytest.fixture(scope="session")
def prometheus(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrometheusAPI]:
    if PROMETHEUS is None:
        pytest.skip("the prometheus binary is not installed (Debian package `prometheus`; CI installs it)")
    tmp = tmp_path_factory.mktemp("prometheus")
    cfg = {"global": {"evaluation_interval": "1m"}, "rule_files": [str(RULES)]}
    (tmp / "prometheus.yml").write_text(json.dumps(cfg))  # JSON is YAML
    port = free_port()
    with open(tmp / "prometheus.log", "wb") as log:
        proc = subprocess.Popen(
            [
                PROMETHEUS,
                f"--config.file={tmp / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        api = PrometheusAPI(f"http://127.0.0.1:{port}")
        # generous: scripts/test runs the wheel's copy of these tests at nice 19 beside the busy
        # parallel phase, where a starting Prometheus may wait a while for a core
        wait_http(f"{api.url}/-/ready", timeout=180)
        wait_until(api.rules, timeout=60, what="rules to load")
        yield api
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
