"""The service half every loop shares: the rank's link to the collector (and OTLP beside it).

moeguard's trainer (trainer/cli.py) and GuardedStep (torchtitan, the transformers Trainer, any
loop) build their exporter here, so a run streams, beats and pages the same whoever drives it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from guard.core import schema
from guard.core.heartbeat import beat_interval_s, first_beat_delay_s

NEVER_S = 1e9  # an ExporterConfig interval that never comes


# A rank's own beats: every this many seconds (a job of many ranks stretches it: `beat_interval_s`).
# Keep it well under the collector's --heartbeat-floor (30 s by default).
HEARTBEAT_S = 5.0
ENV_HEARTBEAT_S = "MOEGUARD_HEARTBEAT_S"
# A rank whose step and phase stand still this long, not waiting in a collective, beats at once
# (once a stall): well under the collector's --progress-floor (60 s), over a long step's time.
STALL_BEAT_S = 10.0


def default_beat_s() -> float:
    """$MOEGUARD_HEARTBEAT_S, else HEARTBEAT_S."""
    return float(os.environ.get(ENV_HEARTBEAT_S, HEARTBEAT_S))


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
    world: int = 1,
) -> Any:
    """The rank's telemetry link: the collector's exporter (token from $MOEGUARD_TOKEN), with OTLP
    beside it on rank 0 when `otlp_endpoint` is set (guard/runtime/otel.py); None when neither is
    configured. Only rank 0 polls for operator commands (they act on the whole job).

    `heartbeat_s`: an empty beat after this many quiet seconds. moeguard's trainer keeps the
    default (never: a beat rides with each step, HeartbeatPump beats while a rank waits in a
    collective, so a rank stuck in its own code goes silent); GuardedStep, which cannot see the
    collectives inside a framework's forward and backward, beats at a bounded rate from the
    exporter's thread, so a dead rank is HeartbeatLost and a live rank that stops advancing is
    RunStuck, named by rank and phase.

    `world` > 1 (issue #30): ranks > 0 send no per-step reports (their timing reaches rank 0
    inside the job: guard/runtime/ranks.py), only beats, every `heartbeat_s` stretched to the
    job's size (guard/core/heartbeat.py `beat_interval_s`: the run's beats stay under 256 a
    second), the ranks' first beats spread over one interval; rank 0's reports prove the others'
    progress (the `world` of its beats)."""
    if world > 1 and (rank > 0 or heartbeat_s < NEVER_S):
        heartbeat_s = beat_interval_s(world, heartbeat_s if heartbeat_s < NEVER_S else default_beat_s())
    url = collector_url(collector)
    link = None
    if url:
        from guard.runtime.exporter import Exporter, ExporterConfig
        from guard.wire.redact import quiet_http_logs

        # httpx logs every ingest and command poll at INFO: under a framework's INFO root logger
        # (torchtitan's init_logger) that was half of a run's log lines
        quiet_http_logs()

        link = Exporter(
            url,
            os.environ.get(schema.ENV_TOKEN, ""),
            run_id,
            rank,
            spool_dir=run_dir / "spool",
            config=ExporterConfig(
                heartbeat_s=heartbeat_s,
                first_beat_s=first_beat_delay_s(rank, world, heartbeat_s) if heartbeat_s < NEVER_S else None,
                # a stalled rank says so within seconds, ranks spread over 2 s (export_sender.py)
                stall_beat_s=STALL_BEAT_S + first_beat_delay_s(rank, world, 2.0)
                if heartbeat_s < NEVER_S
                else NEVER_S,
                world=world,
                poll_s=2.0 if rank == 0 else NEVER_S,
                trainer_detectors=trainer_detectors,
            ),
        )
    if not otlp_endpoint or rank != 0:  # rank 0's reports carry the job's loss and norms
        return link
    from guard.runtime.otel import OtelExporter, TeeExporter

    return TeeExporter(link, OtelExporter(otlp_endpoint, run_id))
