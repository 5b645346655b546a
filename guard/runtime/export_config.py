"""ExporterConfig: how an Exporter (exporter.py) batches, retries and paces. Its own module so
that the sender thread (export_sender.py) reads it without importing the exporter that wires it;
exporter.py re-exports it (`from guard.runtime.exporter import ExporterConfig` keeps working).
"""

from __future__ import annotations

from dataclasses import dataclass

from guard.core.tomlconf import check


@dataclass(kw_only=True, slots=True)
class ExporterConfig:
    """How an Exporter batches, retries and paces; the defaults suit one trainer rank."""

    max_queue: int = 1024  # steps held in memory for the sender; past it submit() spills to the spool
    batch_max: int = 32  # steps in one batch at most
    max_body_bytes: int = 8 << 20  # a batch body stays under this (the collector's --max-body-bytes)
    timeout_s: float = 10.0  # one HTTP request (connecting: at most 3 s of it)
    poll_s: float = 5.0  # seconds between GETs of operator commands (1e9: never)
    heartbeat_s: float = 10.0  # an empty batch after this many quiet seconds (1e9: never)
    first_beat_s: float | None = None  # the first one after this many (None: heartbeat_s); spreads ranks
    stall_beat_s: float = 1e9  # one early beat when step and phase stand still this long (1e9: never)
    world: int = 1  # ranks in the job: rank 0's reports then prove the others alive (wire docs)
    backoff_max_s: float = 30.0  # longest wait between tries of the spool
    # this trainer runs the detectors itself (guard on, or observing): the collector skips its own
    trainer_detectors: bool = False

    def __post_init__(self) -> None:
        check(self.max_queue >= 1, "max_queue", self.max_queue, "must be >= 1")
        check(self.batch_max >= 1, "batch_max", self.batch_max, "must be >= 1")
        check(self.max_body_bytes > 0, "max_body_bytes", self.max_body_bytes, "must be > 0")
        check(self.timeout_s > 0, "timeout_s", self.timeout_s, "must be > 0")
        check(self.backoff_max_s > 0, "backoff_max_s", self.backoff_max_s, "must be > 0")
