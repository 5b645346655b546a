"""Optional OpenTelemetry export of the core step metrics (for shops that run an OTel collector
instead of scraping Prometheus). Same names as the Prometheus metrics in guard/core/schema.py.

    otel = OtelExporter("http://otel-collector:4318/v1/metrics", run_id="run-42")
    otel.submit(report)     # every step: stores the report, no I/O
    otel.close()

Gauges are observable: the SDK's reader calls back at its own cadence (PeriodicExportingMetricReader,
OTLP over HTTP) and reads the last report, so `submit` costs a reference swap and two counter
adds. Attributes: run on all, layer on per-layer gauges. Units are left empty on purpose: an
OTLP->Prometheus bridge appends unit suffixes, and the names already carry their base unit.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterable
from typing import Any

from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource

from guard.core import schema
from guard.core.report import StepReport

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
        export_interval_s: float = 10.0,
        headers: dict[str, str] | None = None,
    ) -> None:
        """`endpoint`: OTLP/HTTP metrics URL; ignored when `reader` is given (tests, custom setups)."""
        if reader is None:
            from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter

            reader = PeriodicExportingMetricReader(
                OTLPMetricExporter(endpoint=endpoint, headers=headers),
                export_interval_millis=export_interval_s * 1000,
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

    def close(self) -> None:
        self.provider.shutdown()

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
