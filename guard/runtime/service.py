"""The service half every loop shares: the rank's link to the collector (and OTLP beside it).

moeguard's trainer (trainer/cli.py) and GuardedStep (torchtitan, the transformers Trainer, any
loop) build their exporter here, so a run streams, beats and pages the same whoever drives it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from guard.core import schema

NEVER_S = 1e9  # an ExporterConfig interval that never comes


def collector_url(explicit: str | None) -> str:
    """The collector to stream to: `explicit`, else $MOEGUARD_COLLECTOR, else '' (none)."""
    return explicit or os.environ.get(schema.ENV_COLLECTOR, "")


def make_exporter(
    *,
    collector: str | None,
    otlp_endpoint: str | None,
    run_id: str,
    run_dir: Path,
    rank: int,
    trainer_detectors: bool,
    heartbeat_s: float = NEVER_S,
) -> Any:
    """The rank's telemetry link: the collector's exporter (token from $MOEGUARD_TOKEN), with OTLP
    beside it on rank 0 when `otlp_endpoint` is set (guard/runtime/otel.py); None when neither is
    configured. Only rank 0 polls for operator commands (they act on the whole job).

    `heartbeat_s`: an empty beat after this many quiet seconds. moeguard's trainer keeps the
    default (never: a beat rides with each step, HeartbeatPump beats while a rank waits in a
    collective, so a rank stuck in its own code goes silent); GuardedStep, which cannot see the
    collectives inside a framework's forward and backward, beats at a bounded rate from the
    exporter's thread, so a dead rank is HeartbeatLost and a live rank that stops advancing is
    RunStuck, named by rank and phase."""
    url = collector_url(collector)
    link = None
    if url:
        from guard.runtime.exporter import Exporter, ExporterConfig

        link = Exporter(
            url,
            os.environ.get(schema.ENV_TOKEN, ""),
            run_id,
            rank,
            spool_dir=run_dir / "spool",
            config=ExporterConfig(
                heartbeat_s=heartbeat_s,
                poll_s=2.0 if rank == 0 else NEVER_S,
                trainer_detectors=trainer_detectors,
            ),
        )
    if not otlp_endpoint or rank != 0:  # rank 0's reports carry the job's loss and norms
        return link
    from guard.runtime.otel import OtelExporter, TeeExporter

    return TeeExporter(link, OtelExporter(otlp_endpoint, run_id))
