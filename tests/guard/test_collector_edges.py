"""Validation at the collector's edge (issue #32, item 4): integers within Int64 and their sense, a
writer's steps strictly increasing (a repeat is idempotent, a step going back is a 400 naming it).

Driven in-process (no HTTP): the answers are what build_app sends.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from guard.collector.config import CollectorConfig
from guard.collector.service import Collector
from guard.store.reader import read_table
from tests.guard.test_collector import batch, make_report

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
