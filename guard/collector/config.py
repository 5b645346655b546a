"""The collector's settings (`moeguard collector` flags become a CollectorConfig) and the names of
its own files inside a run folder."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from guard.core import schema
from guard.core.config import GuardConfig
from guard.core.heartbeat import HeartbeatConfig
from guard.core.limits import CollectorLimits
from guard.core.progress import ProgressConfig
from guard.store.policy import StoreConfig

STATE_DIR = ".collector"  # in each run folder: the log, state.json, commands.json
STATE_FILE, COMMANDS_FILE, QUARANTINE_FILE = "state.json", "commands.json", "quarantine.json"
# in STATE_DIR: every rank's last beat and the learned deadlines, apart from state.json so that a
# 16,384-rank run's ~1 MB of liveness is written when its ranks change or every LIVENESS_EVERY_S,
# not with every checkpoint (issue #30); a restart takes ranks' ages from it (<= that much older)
LIVENESS_FILE = "liveness.json"
LIVENESS_EVERY_S = 30.0
PAGING_STATE_FILE = ".paging.json"  # in --runs: the paging windows (guard/collector/paging.py)
SUPERSEDED_DIR = "superseded"  # in STATE_DIR: rows a new generation re-ran, kept
RETIRED_GENERATIONS = 16  # superseded generations per rank whose late retries still dedupe
COMMAND_ACTIONS = (schema.ACT_ROLLBACK, schema.ACT_HALT, schema.ACT_SKIP)


@dataclass(kw_only=True, slots=True)
class CollectorConfig:
    runs_dir: Path
    token: str | None  # None: no auth (only with --insecure-no-auth)
    max_body_bytes: int = 8 << 20
    checkpoint_interval_s: float = 1.0
    guard: GuardConfig | None = field(default_factory=GuardConfig)  # None: no server-side detectors
    heartbeat: HeartbeatConfig = field(default_factory=HeartbeatConfig)
    progress: ProgressConfig = field(default_factory=ProgressConfig)  # RunStuck deadlines
    # Alertmanagers that critical guard alerts are posted to (guard/collector/paging.py); every
    # instance of a cluster. alert_labels: Prometheus's external labels, so both alerts are one.
    alertmanager_urls: tuple[str, ...] = ()
    alert_labels: dict[str, str] = field(default_factory=dict)
    alert_resend_s: float = 60.0
    alert_resolve_delay_s: float = 120.0  # guard/collector/paging.py RESOLVE_DELAY_S
    limits: CollectorLimits = field(default_factory=CollectorLimits)  # guard/core/limits.py
    store: StoreConfig = field(default_factory=StoreConfig)  # [store]: guard/store/policy.py, --store-config

    def __post_init__(self) -> None:
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes = {self.max_body_bytes}: must be >= 1024")
        if not self.checkpoint_interval_s > 0:
            raise ValueError(f"checkpoint_interval_s = {self.checkpoint_interval_s}: must be > 0")
        for url in self.alertmanager_urls:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"alertmanager_url = {url!r}: must be an http(s) URL")
        if not self.alert_resend_s > 0:
            raise ValueError(f"alert_resend_s = {self.alert_resend_s}: must be > 0")
        if not self.alert_resolve_delay_s >= 0:
            raise ValueError(f"alert_resolve_delay_s = {self.alert_resolve_delay_s}: must be >= 0")
