"""OTLP export end to end: `moeguard train` with `telemetry.otlp_endpoint` set sends its step
metrics over OTLP/HTTP (opentelemetry-sdk's exporter) to a local receiver, which decodes every
POST with opentelemetry-proto's types; what arrives is the run's own loss, gradient norm and
token count, as its run store recorded them."""

from __future__ import annotations

import gzip
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from opentelemetry.proto.collector.metrics.v1.metrics_service_pb2 import (
    ExportMetricsServiceRequest,
    ExportMetricsServiceResponse,
)

from guard.core import schema
from guard.runtime.otel import metrics_url
from guard.store.reader import read_table
from tests.conftest import MICRO, REPO

STEPS = 40


@dataclass(frozen=True)
class Point:
    export: int  # which POST it came in, in arrival order
    name: str
    value: float
    attributes: dict[str, str]


class OtlpReceiver:
    """A loopback OTLP/HTTP metrics receiver: records and decodes every POST to /v1/metrics."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, ExportMetricsServiceRequest]] = []
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                request = ExportMetricsServiceRequest()
                request.ParseFromString(body)
                with receiver._lock:
                    receiver.requests.append((self.path, request))
                reply = ExportMetricsServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args: Any) -> None:  # keep pytest's output clean
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def __enter__(self) -> OtlpReceiver:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()

    def resources(self) -> list[dict[str, str]]:
        with self._lock:
            return [
                {a.key: a.value.string_value for a in rm.resource.attributes}
                for _, req in self.requests
                for rm in req.resource_metrics
            ]

    def points(self) -> list[Point]:
        out = []
        with self._lock:
            requests = list(self.requests)
        for i, (_, req) in enumerate(requests):
            for rm in req.resource_metrics:
                for sm in rm.scope_metrics:
                    for m in sm.metrics:
                        kind = m.WhichOneof("data")
                        for dp in getattr(m, kind).data_points:
                            value = dp.as_double if dp.WhichOneof("value") == "as_double" else dp.as_int
                            attrs = {a.key: a.value.string_value for a in dp.attributes}
                            out.append(Point(i, m.name, float(value), attrs))
        return out


@pytest.fixture
def receiver() -> Iterator[OtlpReceiver]:
    with OtlpReceiver() as r:
        yield r


def test_metrics_url_takes_a_base_or_a_full_url() -> None:
    assert metrics_url("http://otel:4318") == "http://otel:4318/v1/metrics"
    assert metrics_url("http://otel:4318/") == "http://otel:4318/v1/metrics"
    assert metrics_url("https://otel/custom/metrics") == "https://otel/custom/metrics"


def test_an_endpoint_without_a_scheme_is_refused_at_load() -> None:
    from guard.core.tomlconf import ConfigError
    from trainer.config import load_config

    with pytest.raises(ConfigError, match="telemetry.otlp_endpoint"):
        load_config(MICRO, {"telemetry.otlp_endpoint": "otel-collector:4318"})


def test_a_guarded_run_exports_its_step_metrics_over_otlp(receiver: OtlpReceiver, tmp_path: Path) -> None:
    run = tmp_path / "otlp-run"
    env = {k: v for k, v in os.environ.items() if k != schema.ENV_COLLECTOR and not k.startswith("OTEL_")}
    env["OTEL_METRIC_EXPORT_INTERVAL"] = "50"  # ms: several exports while the run trains
    cmd = [sys.executable, "-m", "guard", "train", "--config", str(MICRO), "--run-dir", str(run)]
    cmd += ["--steps", str(STEPS), "--no-progress", "--set", "train.threads=1"]
    cmd += ["--set", f"telemetry.otlp_endpoint={receiver.url}"]  # the base URL: /v1/metrics is added
    p = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]

    assert receiver.requests and {path for path, _ in receiver.requests} == {"/v1/metrics"}
    assert all(
        r["service.name"] == "moeguard" and r["moeguard.run"] == run.name for r in receiver.resources()
    )
    points = receiver.points()
    assert all(pt.attributes["run"] == run.name for pt in points)
    names = {pt.name for pt in points}
    expected = {
        schema.M_STEP,
        schema.M_LOSS,
        schema.M_GRAD_NORM,
        schema.M_LR,
        schema.M_TOKENS_PER_S,
        schema.M_STEP_TIME,
        schema.M_TOKENS,
        schema.M_LAYER_GRAD_NORM,
        schema.M_LAYER_MAXVIO,
        schema.M_LAYER_LOAD_ENTROPY,
    }
    assert expected <= names, expected - names

    steps = read_table(run, "steps").sort("step")
    assert steps.height == STEPS
    loss_of = dict(zip(steps["step"].to_list(), steps["loss"].to_list(), strict=True))
    norm_of = dict(zip(steps["step"].to_list(), steps["grad_norm"].to_list(), strict=True))
    # Every exported value is one of the run's real steps, and the exports followed the run.
    seen_steps = {int(pt.value) for pt in points if pt.name == schema.M_STEP}
    assert seen_steps <= set(loss_of) and len(seen_steps) >= 2
    for pt in points:
        if pt.name == schema.M_LOSS:
            assert any(pt.value == pytest.approx(v, rel=1e-6) for v in loss_of.values()), pt
        if pt.name == schema.M_GRAD_NORM:
            assert any(pt.value == pytest.approx(v, rel=1e-6) for v in norm_of.values()), pt
    # The last export (the shutdown's) holds the last step, exactly as the run store has it.
    last_export = max(pt.export for pt in points if pt.name == schema.M_STEP)
    final = {pt.name: pt.value for pt in points if pt.export == last_export and "layer" not in pt.attributes}
    last = STEPS - 1
    assert final[schema.M_STEP] == last
    assert final[schema.M_LOSS] == pytest.approx(loss_of[last], rel=1e-6)
    assert final[schema.M_GRAD_NORM] == pytest.approx(norm_of[last], rel=1e-6)
    assert final[schema.M_TOKENS] == steps["tokens"].sum()  # a cumulative counter: every step's tokens
    layers = {pt.attributes["layer"] for pt in points if pt.name == schema.M_LAYER_GRAD_NORM}
    assert layers == {"0", "1"}  # the micro model's two layers
