"""Grafana dashboards as code: every queried metric exists in guard/core/schema.py, the PromQL
parses (promtool), the committed JSON matches the builder, and `moeguard grafana push` makes
the requests Grafana expects (against a local recording server standing in for Grafana)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from dashboards.grafana import boards, panels
from dashboards.grafana import cli as grafana_cli
from guard.cli import main as cli_main
from guard.core import schema

PROMQL_WORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "offset",
    "and",
    "or",
    "unless",
    "inf",
    "nan",
}
HISTOGRAM_SUFFIXES = ("_bucket", "_sum", "_count")
HISTOGRAMS = {schema.M_EXPERT_LOAD_SHARE}


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects: identifiers that are not functions, keywords,
    label names (in {...}, by/without/on/ignoring (...)), variables, durations or numbers."""
    e = re.sub(r'"(?:[^"\\]|\\.)*"', '""', expr)  # string literals
    e = re.sub(r"\{[^}]*\}", "", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)  # range selectors
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", e)  # label lists
    e = re.sub(r"\$\{?\w+\}?", " ", e)  # grafana variables
    names = set()
    for m in re.finditer(r"(?<![\w.])([A-Za-z_:][\w:]*)(\s*\()?", e):
        word, call = m.group(1), m.group(2)
        if call or word.lower() in PROMQL_WORDS:
            continue
        names.add(word)
    return names


def base_metric(name: str) -> str:
    for suffix in HISTOGRAM_SUFFIXES:
        if name.endswith(suffix) and name[: -len(suffix)] in HISTOGRAMS:
            return name[: -len(suffix)]
    return name


def all_exprs(d: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, expr) for every panel target, variable query and annotation."""
    for p in d["panels"]:
        for t in p.get("targets", []):
            yield f"{d['uid']}/{p['title']}", t["expr"]
    for v in d["templating"]["list"]:
        if v["type"] == "query":
            q = v["query"]["query"]
            inner = re.fullmatch(r"label_values\((.*),\s*\w+\)", q)
            yield f"{d['uid']}/var {v['name']}", inner.group(1) if inner else q
    for a in d["annotations"]["list"]:
        if "expr" in a:
            yield f"{d['uid']}/annotation {a['name']}", a["expr"]


def test_metric_name_parser_itself() -> None:
    assert metric_names(
        'sum by (detector) (increase(moeguard_guard_verdicts_total{run="$run"}[$__rate_interval]))'
    ) == {"moeguard_guard_verdicts_total"}
    assert metric_names('moeguard_mfu_ratio{run=~"$run"} / on (run) moeguard_mfu_baseline_ratio') == {
        "moeguard_mfu_ratio",
        "moeguard_mfu_baseline_ratio",
    }
    assert metric_names("count(moeguard_run_halted == 1) or vector(0)") == {"moeguard_run_halted"}
    assert metric_names('time() - max by (rank) (moeguard_x{a="b"})') == {"moeguard_x"}


@pytest.mark.parametrize("dash", boards.build_all(), ids=lambda d: d["uid"])
def test_every_queried_metric_is_in_schema(dash: dict[str, Any]) -> None:
    seen = 0
    for where, expr in all_exprs(dash):
        names = metric_names(expr)
        assert names, f"{where}: no metric in {expr!r}"
        for n in names:
            assert base_metric(n) in schema.METRICS, f"{where}: {n!r} is not in guard/schema.METRICS ({expr})"
        seen += 1
    assert seen >= 5


@pytest.mark.parametrize("dash", boards.build_all(), ids=lambda d: d["uid"])
def test_panels_are_well_formed(dash: dict[str, Any]) -> None:
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids)), "duplicate panel ids"
    for p in dash["panels"]:
        assert p["title"]
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        if p["type"] != "row":
            assert p["targets"] and all(t["datasource"]["uid"] == "${datasource}" for t in p["targets"])
    var_names = {v["name"] for v in dash["templating"]["list"]}
    assert {"datasource", "run"} <= var_names


def test_committed_json_matches_the_builder() -> None:
    for d in boards.build_all():
        p = grafana_cli.GRAFANA_DIR / f"{d['uid']}.json"
        assert p.is_file(), f"{p} missing: run `python -m dashboards.grafana`"
        assert json.loads(p.read_text()) == d, f"{p.name} is stale: run `python -m dashboards.grafana`"


def test_datasource_provisioning_matches_dashboards() -> None:
    text = (grafana_cli.GRAFANA_DIR / "datasource.yml").read_text()
    assert f"uid: {panels.DATASOURCE_UID}" in text and "type: prometheus" in text
    for d in boards.build_all():
        ds_var = next(v for v in d["templating"]["list"] if v["name"] == "datasource")
        assert ds_var["current"]["value"] == panels.DATASOURCE_UID


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool not installed")
def test_promql_parses_with_promtool(tmp_path: Path) -> None:
    rules = []
    for d in boards.build_all():
        for i, (_, expr) in enumerate(all_exprs(d)):
            e = expr.replace("$__rate_interval", "5m").replace("$run", "r").replace("$layer", ".*")
            rules.append(
                f"      - record: moeguard:check:{d['uid'].replace('-', '_')}_{i}\n        expr: {json.dumps(e)}"
            )
    f = tmp_path / "rules.yml"
    f.write_text("groups:\n  - name: dashboards\n    rules:\n" + "\n".join(rules) + "\n")
    r = subprocess.run(["promtool", "check", "rules", str(f)], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_export_writes_json_and_provisioning(tmp_path: Path) -> None:
    assert cli_main(["grafana", "export", str(tmp_path)]) == 0
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names == [
        "dashboards.yml",
        "datasource.yml",
        "moeguard-fleet.json",
        "moeguard-layers.json",
        "moeguard-run.json",
    ]
    assert json.loads((tmp_path / "moeguard-run.json").read_text())["uid"] == "moeguard-run"


# ---------------------------------------------------------------------------------------
# push, against a recording stand-in for Grafana's HTTP API
# ---------------------------------------------------------------------------------------
class _Recorder(BaseHTTPRequestHandler):
    requests: list[dict[str, Any]] = []
    folders: list[dict[str, Any]] = []

    def log_message(self, *args: Any) -> None:  # keep pytest output clean
        pass

    def _body(self) -> Any:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n) if n else b""
        return json.loads(raw) if raw else None

    def _send(self, code: int, obj: Any) -> None:
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _record(self, body: Any) -> None:
        self.requests.append(
            {
                "method": self.command,
                "path": self.path,
                "auth": self.headers.get("Authorization"),
                "json": body,
            }
        )

    def do_GET(self) -> None:  # noqa: N802
        self._record(None)
        if self.path.startswith("/api/folders"):
            self._send(200, self.folders)
        else:
            self._send(404, {"message": "not found"})

    def do_POST(self) -> None:  # noqa: N802
        body = self._body()
        self._record(body)
        if self.path == "/api/folders":
            f = {"uid": "fold-1", "title": body["title"], "id": 7}
            self.folders.append(f)
            self._send(200, f)
        elif self.path == "/api/dashboards/db":
            uid = body["dashboard"]["uid"]
            self._send(200, {"status": "success", "uid": uid, "url": f"/d/{uid}/x", "version": 1, "id": 1})
        else:
            self._send(404, {"message": "not found"})


@pytest.fixture
def fake_grafana() -> Iterator[tuple[str, type[_Recorder]]]:
    handler = type("Rec", (_Recorder,), {"requests": [], "folders": []})
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    t = threading.Thread(target=srv.serve_forever, daemon=True)
    t.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", handler
    finally:
        srv.shutdown()
        srv.server_close()


def test_push_posts_every_dashboard_with_overwrite(fake_grafana, monkeypatch, capsys) -> None:
    url, rec = fake_grafana
    monkeypatch.setenv(grafana_cli.TOKEN_ENV, "s3cret")
    assert cli_main(["grafana", "push", "--url", url, "--folder", "ML training"]) == 0
    posts = [r for r in rec.requests if r["method"] == "POST" and r["path"] == "/api/dashboards/db"]
    assert [p["json"]["dashboard"]["uid"] for p in posts] == [
        "moeguard-run",
        "moeguard-layers",
        "moeguard-fleet",
    ]
    for p in posts:
        assert p["json"]["overwrite"] is True
        assert p["json"]["folderUid"] == "fold-1"
        assert p["auth"] == "Bearer s3cret"
        assert p["json"]["dashboard"]["id"] is None
    # the folder was looked up, then created once
    assert [(r["method"], r["path"].split("?")[0]) for r in rec.requests[:2]] == [
        ("GET", "/api/folders"),
        ("POST", "/api/folders"),
    ]
    assert rec.requests[1]["json"] == {"title": "ML training"}
    assert "moeguard / run overview: success" in capsys.readouterr().out

    # second push: the folder exists now, so it is reused, not created again
    rec.requests.clear()
    assert cli_main(["grafana", "push", "--url", url, "--folder", "ML training"]) == 0
    assert not [r for r in rec.requests if r["path"] == "/api/folders" and r["method"] == "POST"]


def test_push_without_folder_and_unreachable_grafana(fake_grafana, monkeypatch, capsys) -> None:
    url, rec = fake_grafana
    monkeypatch.delenv(grafana_cli.TOKEN_ENV, raising=False)
    assert cli_main(["grafana", "push", "--url", url]) == 0
    posts = [r for r in rec.requests if r["path"] == "/api/dashboards/db"]
    assert len(posts) == 3 and all("folderUid" not in p["json"] for p in posts)
    assert all(p["auth"] is None for p in posts)
    assert cli_main(["grafana", "push", "--url", "http://127.0.0.1:9"]) == 1
    assert "cannot reach http://127.0.0.1:9" in capsys.readouterr().err
