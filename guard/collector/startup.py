"""Start-up and quarantine: the collector listens first, then scans the run folders it wrote
(meta.json and state.json only, the same damage checks as a full load; a run with log records to
replay is loaded, and checkpointed, in full). A run whose files cannot be loaded safely is
quarantined: kept out of service, said so everywhere, and touched no further.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Protocol

from guard.collector.config import QUARANTINE_FILE, STATE_DIR
from guard.collector.errors import RunDamaged, RunQuarantined, StorageFailed
from guard.collector.storage import scan_run
from guard.store.layout import atomic_write_bytes
from guard.wire.batch import valid_run_id

if TYPE_CHECKING:
    from guard.collector.book import HealthBook
    from guard.collector.config import CollectorConfig
    from guard.collector.run import RunState

log = logging.getLogger("moeguard.collector")


class Collector(Protocol):
    """What the start-up scan and the quarantine use of the Collector (service.py), named here so
    that this module does not import the service that calls it (no import circle)."""

    cfg: CollectorConfig
    health: HealthBook
    runs: dict[str, RunState]
    quarantined: dict[str, str]  # run -> why it was not loaded
    runs_lock: threading.Lock
    stop_event: threading.Event
    pending_load: int
    loaded: threading.Event

    def run_state(self, run: str) -> RunState: ...


def load_all(collector: Collector) -> None:
    """Scan every run folder this collector wrote (the start-up scan; see the service docstring)."""
    t0 = time.monotonic()
    try:
        with os.scandir(collector.cfg.runs_dir) as it:
            names = sorted(e.name for e in it if valid_run_id(e.name) and e.is_dir())
        names = [n for n in names if os.path.lexists(collector.cfg.runs_dir / n / STATE_DIR)]
    except OSError as e:
        log.error("cannot list %s: %r; runs load on their first request", collector.cfg.runs_dir, e)
        names = []
    collector.pending_load = len(names)
    for run in names:
        if collector.stop_event.is_set():
            break
        try:
            _load_one(collector, run)
        except Exception:  # one run must not stop the scan
            log.exception("run %s: start-up scan failed; it loads on its first request", run)
        collector.pending_load -= 1
    collector.pending_load = 0
    collector.loaded.set()
    log.info(
        "start-up scan done: %d runs in %.1f s (%d held in full, %d quarantined)",
        len(names),
        time.monotonic() - t0,
        len(collector.runs),
        len(collector.quarantined),
    )


def _load_one(collector: Collector, run: str) -> None:
    """Scan one run at start-up: a compact record from its JSON files, or a full load when it
    has log records to replay or its files are damaged (which quarantines it)."""
    if run in collector.runs or run in collector.quarantined or collector.health.is_complete(run):
        return
    try:
        cold = scan_run(collector.cfg.runs_dir / run)
    except (RunDamaged, OSError):
        cold = None  # the full load below says what is wrong, and quarantines it
    if cold is None:
        try:
            collector.run_state(run)
        except StorageFailed:
            pass  # quarantined and logged by run_state
        return
    with collector.runs_lock:
        if run not in collector.runs and run not in collector.quarantined:
            collector.health.cold_load(
                run,
                meta=cold.meta,
                beats=cold.beats,
                stored_step=cold.last_step,
                liveness=cold.liveness,
                counters=cold.counters,
            )


def quarantine(collector: Collector, run: str, reason: str) -> RunQuarantined:
    """Keep a damaged run out of service, say so everywhere (log, metric, /v1/runs, a
    record in the run's own folder when it can be written) and touch nothing else of it.
    Its trainers get 503 and keep their batches spooled until someone repairs the folder
    and restarts the collector. Only for content that does not load: an OS error that passes
    (EMFILE, ENOSPC, EIO) is a 503/507 and never gets here (errors.py). Caller holds `runs_lock`."""
    collector.quarantined[run] = reason
    collector.health.end_heartbeats(run)  # a refused run is not "lost": the quarantine alerts
    log.warning("run %s: quarantined, not served until repaired and the collector restarts: %s", run, reason)
    state_dir = collector.cfg.runs_dir / run / STATE_DIR
    if state_dir.is_dir():
        try:
            atomic_write_bytes(
                state_dir / QUARANTINE_FILE,
                json.dumps(
                    {"run": run, "reason": reason, "time": time.time(), "pid": os.getpid()}, indent=2
                ).encode(),
            )
        except OSError as e:
            log.warning("run %s: could not record the quarantine in %s: %r", run, state_dir, e)
    return RunQuarantined(run, reason)
