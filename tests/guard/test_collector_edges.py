"""Validation at the collector's edge (issue #32, item 4): integers within Int64 and their sense, a
writer's steps strictly increasing (a repeat is idempotent, a step going back is a 400 naming it).

Driven in-process (no HTTP): the answers are what build_app sends.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from guard.collector.config import CollectorConfig
from guard.collector.service import Collector
from guard.store.reader import read_table
from tests.helpers_collector import batch, make_report

G1, G2 = 1_700_000_000 << 32, 1_700_000_100 << 32


@pytest.fixture
def make(tmp_path: Path) -> Iterator[Callable[[], Collector]]:
    made: list[Collector] = []

    def _make() -> Collector:
        c = Collector(CollectorConfig(runs_dir=tmp_path / "runs", token=None, checkpoint_interval_s=3600))
        c.start()
        made.append(c)
        return c

    yield _make
    for c in made:
        c.close()


def _send(
    c: Collector, seq: int, steps: list[int], rank: int = 0, **fields: Any
) -> tuple[int, dict[str, Any]]:
    reps = [make_report(s, rank=rank) for s in steps]
    for k, v in fields.items():
        for r in reps:
            setattr(r, k, v)
    return c.ingest(json.dumps(batch("edge", rank, seq, reps)).encode())


def _steps(c: Collector) -> list[int]:
    c.close()
    return read_table(c.cfg.runs_dir / "edge", "steps")["step"].to_list()


@pytest.mark.parametrize("value", [2**63, -1, 2**64])
def test_an_integer_past_int64_or_negative_is_a_400_naming_it(
    make: Callable[[], Collector], value: int
) -> None:
    c = make()
    status, ans = _send(c, G1 | 1, [0], tokens=value)
    assert status == 400 and "'tokens'" in ans["error"] and str(value) in ans["error"], ans
    status, ans = _send(c, G1 | 2, [0], mem_peak_bytes=value)
    assert status == 400 and "'mem_peak_bytes'" in ans["error"], ans
    assert _steps(c) == []


def test_a_writers_steps_strictly_increase(make: Callable[[], Collector]) -> None:
    c = make()
    status, ans = _send(c, G1 | 1, [4, 4, 3])
    assert status == 400 and "reports[2].step: 3 goes back from step 4" in ans["error"], ans
    assert _send(c, G1 | 2, [4, 4, 5])[0] == 200  # the repeated 4 is stored once
    assert _send(c, G1 | 3, [5, 6])[0] == 200  # 5 again: idempotent, 6 is new
    status, ans = _send(c, G1 | 4, [2, 1])
    assert status == 400 and "reports[0].step: 2 goes back from step 6" in ans["error"], ans
    assert "generation" in ans["error"]
    # other ranks' steps too (they feed liveness and timing)
    assert _send(c, G1 | 1, [7], rank=1)[0] == 200
    assert _send(c, G1 | 2, [3], rank=1)[0] == 400
    # a resumed trainer is a new generation: it may re-run steps (the old rows are set aside)
    assert _send(c, G2 | 1, [5, 6, 7])[0] == 200
    assert sorted(_steps(c)) == [4, 5, 6, 7]


# ---------------------------------------------------------------------------------------
# the collector's clock decides (issue #32, item 3)
# ---------------------------------------------------------------------------------------
def _beat(c: Collector, seq: int, sent: float, step: int, rank: int = 0) -> int:
    body = {
        "run": "edge",
        "rank": rank,
        "seq": seq,
        "heartbeat": {"time": sent, "step": step, "phase": "train"},
    }
    return c.ingest(json.dumps(body).encode())[0]


def _crash(c: Collector) -> None:
    """As a SIGKILL would leave it: no final checkpoint, the log holds what was acknowledged."""
    c.stop_event.set()
    for rs in c.runs.values():
        rs.journal.close()


@pytest.mark.parametrize("skew", [86400.0, -86400.0])
def test_after_a_restart_liveness_follows_the_collectors_clock_not_the_trainers(
    make: Callable[[], Collector], skew: float
) -> None:
    c = make()
    hb = {"time": time.time() + skew, "step": 3, "phase": "train"}  # the trainer's clock, a day off
    assert c.ingest(json.dumps(batch("edge", 0, G1 | 1, [make_report(3)], heartbeat=hb)).encode())[0] == 200
    _crash(c)
    c2 = make()
    st = c2.health.rank_status("edge")[0]
    assert st["last_report_time"] <= time.time() + 1, st  # a day ahead: it would never be lost
    assert st["age_s"] < 60 and not st["lost"], st  # a day behind: it would be lost at once


def test_a_trainer_clock_jumping_ahead_does_not_stretch_the_heartbeat_timeout(
    make: Callable[[], Collector],
) -> None:
    c = make()
    t0 = time.time() - 30
    for i in range(12):
        assert _beat(c, G1 | (i + 1), t0 + i, i) == 200
    assert _beat(c, G1 | 13, time.time() + 30 * 86400, 12) == 200  # one beat stamped a month ahead
    assert c.health.rank_status("edge")[0]["timeout_s"] < 3600


def test_one_report_stamped_a_month_ahead_does_not_ruin_goodput(make: Callable[[], Collector]) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    from guard.core import schema

    c = make()
    now = time.time()
    reps = [make_report(s, t=now - 10 + s) for s in range(10)]
    reps[5].time = now + 30 * 86400
    assert c.ingest(json.dumps(batch("edge", 0, G1 | 1, reps)).encode())[0] == 200
    text = c.metrics.render().decode()
    [goodput] = [
        s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
        if s.name == schema.M_GOODPUT and s.labels.get("run") == "edge"
    ]
    assert goodput > 0.01, goodput  # 10 steps of 0.1 s in ~70 s of wall time; it was 3.9e-07


def test_a_writer_whose_clock_runs_ahead_cannot_take_the_run_over(make: Callable[[], Collector]) -> None:
    c = make()
    good = int(time.time()) - 5
    assert _send(c, good << 32 | 1, [0])[0] == 200
    status, ans = _send(c, (int(time.time()) + 1800) << 32 | 1, [1])  # a second trainer, clock 30 min ahead
    assert status == 409 and "ahead of the collector's clock" in ans["error"], ans
    assert _send(c, good << 32 | 2, [1])[0] == 200  # the correctly clocked trainer keeps the run
    assert _steps(c) == [0, 1]
