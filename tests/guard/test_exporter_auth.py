"""A trainer with a missing or wrong MOEGUARD_TOKEN: the collector's 401 is logged once, with the fix."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from guard.runtime.exporter import Exporter, ExporterConfig
from tests.helpers_collector import CollectorProc, make_report


def test_repeated_401_is_logged_once_with_a_token_hint(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    collector = CollectorProc(tmp_path / "runs").start()
    try:
        caplog.set_level(logging.WARNING, logger="moeguard.exporter")
        exp = Exporter(
            collector.url,
            "wrong-token",
            "auth",
            0,
            tmp_path / "spool",
            ExporterConfig(backoff_max_s=0.2, heartbeat_s=1e9, poll_s=1e9),
        )
        for s in range(5):
            exp.submit(make_report(s, n_layers=2, n_experts=2))
        deadline = time.monotonic() + 30
        while exp.stats.get("unauthorized", 0) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert exp.close(timeout=0.5) is False  # nothing got through: it stays spooled
    finally:
        collector.stop()
    assert exp.stats["unauthorized"] >= 4, exp.stats
    said = [r.getMessage() for r in caplog.records if "collector answered" in r.getMessage()]
    assert len(said) == 1, said
    assert "401" in said[0] and "MOEGUARD_TOKEN" in said[0]
    assert list((tmp_path / "spool").glob("auth-r0-*.json")), "telemetry must stay spooled for a retry"
