"""Optional OpenTelemetry export of the core step metrics (for shops that run an OTel collector
instead of scraping Prometheus). Same names as the Prometheus metrics in guard/core/schema.py.

    otel = OtelExporter("http://otel-collector:4318", run_id="run-42")   # or .../v1/metrics
    otel.submit(report)     # every step: stores the report, no I/O
    otel.close()

`moeguard train` turns it on with `telemetry.otlp_endpoint` (rank 0 only: its reports carry the
job's loss and gradient norm); `TeeExporter` hands it the steps beside the collector link, so the
trainer still sees one exporter. Export cadence: OTEL_METRIC_EXPORT_INTERVAL (milliseconds, the
SDK's own variable) or 10 s; headers (an auth token): OTEL_EXPORTER_OTLP_HEADERS, read by the SDK.

Gauges are observable: the SDK's reader calls back at its own cadence (PeriodicExportingMetricReader,
OTLP over HTTP) and reads the last report, so `submit` costs a reference swap and two counter
adds. Attributes: run on all, layer on per-layer gauges. Units are left empty on purpose: an
OTLP->Prometheus bridge appends unit suffixes, and the names already carry their base unit.
"""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Iterable
from typing import Any
from urllib.parse import urlsplit

from guard.extras import MissingExtra, require

try:
    from opentelemetry.metrics import CallbackOptions, Observation
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
    from opentelemetry.sdk.resources import Resource
except ImportError:  # one line naming the extra, not a traceback into opentelemetry
    require("otel", "OTLP export (telemetry.otlp_endpoint)")
    raise MissingExtra("OTLP export needs the 'otel' extra: pip install \"moeguard[otel]\"") from None

from guard.core import schema
from guard.core.events import Event
from guard.core.report import StepReport

OTLP_METRICS_PATH = "/v1/metrics"
DEFAULT_EXPORT_INTERVAL_S = 10.0

_STEP_GAUGES: tuple[tuple[str, str], ...] = (
    (schema.M_STEP, "step"),
    (schema.M_LOSS, "loss"),
    (schema.M_GRAD_NORM, "grad_norm"),
    (schema.M_LR, "lr"),
    (schema.M_TOKENS_PER_S, "tokens_per_s"),
    (schema.M_MFU, "mfu"),
    (schema.M_STEP_TIME, "step_time_s"),
    (schema.M_DATA_WAIT, "data_wait_s"),
    (schema.M_MEM_PEAK, "mem_peak_bytes"),
)
_LAYER_GAUGES: tuple[tuple[str, str], ...] = (
    (schema.M_LAYER_MAXVIO, "maxvio_M"),
    (schema.M_LAYER_DEAD, "dead_experts_M"),
    (schema.M_LAYER_LOAD_ENTROPY, "load_entropy_M"),
    (schema.M_LAYER_ROUTER_ENTROPY, "router_entropy_M"),
    (schema.M_LAYER_BIAS_NORM, "bias_norm_M"),
)


class OtelExporter:
    def __init__(
        self,
        endpoint: str | None,
        run_id: str,
        *,
        reader: MetricReader | None = None,
        export_interval_s: float | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        """`endpoint`: the OTLP/HTTP receiver (its base URL, or its full /v1/metrics URL); ignored
        when `reader` is given (tests, custom setups). `export_interval_s`: None = the
        environment's OTEL_METRIC_EXPORT_INTERVAL, else 10 s."""
        if reader is None:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

            interval_s = export_interval_s if export_interval_s is not None else env_export_interval_s()
            reader = PeriodicExportingMetricReader(
                OTLPMetricExporter(endpoint=metrics_url(endpoint) if endpoint else None, headers=headers),
                export_interval_millis=interval_s * 1000,
            )
        self.run_id = run_id
        self.reader = reader
        self._attrs = {"run": run_id}
        self._last: StepReport | None = None
        self._lock = threading.Lock()
        self.provider = MeterProvider(
            resource=Resource.create({"service.name": "moeguard", "moeguard.run": run_id}),
            metric_readers=[reader],
        )
        meter = self.provider.get_meter("moeguard")
        for name, attr in _STEP_GAUGES:
            meter.create_observable_gauge(name, callbacks=[self._scalar_cb(attr)])
        meter.create_observable_gauge(schema.M_LAYER_GRAD_NORM, callbacks=[self._layer_grad_cb])
        for name, attr in _LAYER_GAUGES:
            meter.create_observable_gauge(name, callbacks=[self._moe_cb(attr)])
        self._tokens = meter.create_counter(schema.M_TOKENS)
        self._nonfinite = meter.create_counter(schema.M_NONFINITE)

    def submit(self, report: StepReport) -> None:
        """Record one rank-0 step (other ranks' reports are ignored)."""
        if report.rank != 0:
            return
        with self._lock:
            self._last = report
        self._tokens.add(max(0, report.tokens), self._attrs)
        if not report.finite:
            self._nonfinite.add(1, self._attrs)

    def flush(self, timeout_s: float = 10.0) -> bool:
        return bool(self.provider.force_flush(int(timeout_s * 1000)))

    def close(self, timeout_s: float = 30.0) -> None:
        """Export what the last step left (one final collection), then stop the reader."""
        self.provider.shutdown(timeout_millis=timeout_s * 1000)

    # ---- callbacks (run on the reader's thread) ------------------------------------------
    def _scalar_cb(self, attr: str) -> Any:
        def cb(options: CallbackOptions) -> Iterable[Observation]:
            rep = self._last
            if rep is None:
                return []
            v = float(getattr(rep, attr))
            return [Observation(v, self._attrs)] if math.isfinite(v) else []

        return cb

    def _layer_grad_cb(self, options: CallbackOptions) -> Iterable[Observation]:
        rep = self._last
        if rep is None:
            return []
        return [
            Observation(float(v), {**self._attrs, "layer": str(lid)})
            for lid, v in zip(rep.layer_ids_L.tolist(), rep.layer_grad_norm_L.tolist(), strict=True)
            if math.isfinite(v)
        ]

    def _moe_cb(self, attr: str) -> Any:
        def cb(options: CallbackOptions) -> Iterable[Observation]:
            rep = self._last
            if rep is None:
                return []
            return [
                Observation(float(v), {**self._attrs, "layer": str(lid)})
                for lid, v in zip(rep.moe_layer_ids_M.tolist(), getattr(rep, attr).tolist(), strict=True)
                if math.isfinite(v)
            ]

        return cb


def metrics_url(endpoint: str) -> str:
    """A receiver's base URL (http://otel:4318, as OTEL_EXPORTER_OTLP_ENDPOINT is written) gets
    /v1/metrics; a URL with a path is taken as the full metrics URL."""
    if urlsplit(endpoint).path in ("", "/"):
        return endpoint.rstrip("/") + OTLP_METRICS_PATH
    return endpoint


def env_export_interval_s() -> float:
    try:
        return max(0.01, float(os.environ["OTEL_METRIC_EXPORT_INTERVAL"]) / 1000)
    except (KeyError, ValueError):
        return DEFAULT_EXPORT_INTERVAL_S


class TeeExporter:
    """The trainer's exporter protocol over the collector link (an Exporter, or None) and OTLP:
    each step goes to both; heartbeats, meta, phases and operator commands are the collector's."""

    def __init__(self, collector: Any | None, otel: OtelExporter) -> None:
        self.collector, self.otel = collector, otel

    def submit(self, report: StepReport, events: Iterable[Event | dict[str, Any]] = ()) -> None:
        self.otel.submit(report)
        if self.collector is not None:
            self.collector.submit(report, events)

    def set_meta(self, meta: dict[str, Any]) -> None:
        if self.collector is not None:
            self.collector.set_meta(meta)

    def set_phase(self, phase: str, *, beat: bool = True) -> None:
        if self.collector is not None:
            self.collector.set_phase(phase, beat=beat)

    def set_waiting(self, waiting: bool) -> None:
        if self.collector is not None:
            self.collector.set_waiting(waiting)

    def set_ranks(self, vectors: dict[str, Any]) -> None:
        if self.collector is not None:
            self.collector.set_ranks(vectors)

    def note_step(self, step: int) -> None:
        if self.collector is not None:
            self.collector.note_step(step)

    def add_side(self, table: str, row: dict[str, Any]) -> None:
        if self.collector is not None:
            self.collector.add_side(table, row)

    def poll_commands(self) -> list[dict[str, Any]]:
        return self.collector.poll_commands() if self.collector is not None else []

    def close(
        self, timeout: float = 30.0, final: bool | None = None, goodbye: dict[str, str] | None = None
    ) -> bool:
        """Close both; True when the collector got everything (OTLP is best effort)."""
        ok = (
            self.collector.close(timeout=timeout, final=final, goodbye=goodbye)
            if self.collector is not None
            else True
        )
        self.otel.close(timeout_s=timeout)
        return ok
