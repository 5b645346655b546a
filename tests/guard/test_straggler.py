"""StragglerDetector with plain numbers: relative and individual scores, events on change only."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from guard.core import schema
from guard.core.goodput import Goodput
from guard.core.straggler import StragglerConfig, StragglerDetector
from guard.core.tomlconf import ConfigError


def test_relative_score_is_fastest_median_over_own() -> None:
    det = StragglerDetector()
    res = det.update(9, np.array([0.10, 0.10, 0.20, 0.125]))
    assert res.relative_R.tolist() == pytest.approx([1.0, 1.0, 0.5, 0.8])
    assert res.flagged == [2]
    [ev] = res.events
    assert ev.kind == schema.EV_STRAGGLER and ev.value == pytest.approx(0.5) and ev.threshold == 0.75
    d = json.loads(ev.row()["detail"])
    assert d["rank"] == 2 and d["fastest_rank"] == 0 and d["median_step_s"] == pytest.approx(0.2)


def test_events_only_when_a_rank_becomes_or_stops_being_a_straggler() -> None:
    det = StragglerDetector(StragglerConfig(threshold=0.75))
    assert len(det.update(9, np.array([0.1, 0.2])).events) == 1
    assert det.update(19, np.array([0.1, 0.21])).events == []  # still slow: no new event
    res = det.update(29, np.array([0.1, 0.11]))
    assert res.flagged == [] and [json.loads(e.row()["detail"]).get("recovered") for e in res.events] == [
        True
    ]


def test_individual_score_tracks_a_rank_against_its_own_best() -> None:
    det = StragglerDetector()
    det.update(9, np.array([0.1, 0.1]))
    res = det.update(19, np.array([0.2, 0.2]))  # everyone slower: nobody is a straggler
    assert res.flagged == [] and res.relative_R.tolist() == [1.0, 1.0]
    assert res.individual_R.tolist() == pytest.approx([0.5, 0.5])


def test_unknown_times_are_not_scored_and_state_round_trips() -> None:
    det = StragglerDetector()
    res = det.update(9, np.array([0.1, math.nan, 0.3]))
    assert math.isnan(res.relative_R[1]) and res.flagged == [2]
    det2 = StragglerDetector()
    det2.load_state_dict(json.loads(json.dumps(det.state_dict())))
    assert det2.update(19, np.array([0.1, 0.1, 0.3])).events == []  # rank 2 was already flagged
    # a resume on fewer ranks: the state adapts instead of failing
    assert det2.update(29, np.array([0.1, 0.1])).flagged == []


def test_threshold_is_validated() -> None:
    with pytest.raises(ConfigError, match="straggler_threshold"):
        StragglerConfig(threshold=1.5)


def test_goodput_split_adds_up_to_wall_time() -> None:
    g = Goodput(started_at=100.0)
    g.add("startup_s", 5.0)
    g.step(applied=True, step_time_s=1.0, data_wait_s=0.25)  # 0.75 productive
    g.snapshot_taken(1, {1})
    g.step(applied=True, step_time_s=1.0, data_wait_s=0.0)  # lost by the rollback below
    g.step(applied=False, step_time_s=1.0, data_wait_s=0.0)  # skipped
    g.rolled_back(1)
    g.add("checkpoint_s", 2.0)
    g.resumed(checkpoint_time=110.0, process_start=113.0)
    r = g.report(now=130.0)
    assert r["wall_s"] == 30.0 and r["productive_s"] == pytest.approx(0.75)
    assert r["rolled_back_s"] == pytest.approx(1.0) and r["skipped_s"] == 1.0 and r["restarts_s"] == 3.0
    assert r["goodput"] == pytest.approx(0.75 / 30)
    parts = sum(
        r[k]
        for k in (
            "productive_s",
            "data_wait_s",
            "checkpoint_s",
            "skipped_s",
            "rolled_back_s",
            "startup_s",
            "restarts_s",
            "other_s",
        )
    )
    assert parts == pytest.approx(r["wall_s"])
    g2 = Goodput(started_at=0.0)
    g2.load_state_dict(g.state_dict())
    assert g2.started_at == 100.0 and g2.report(130.0)["productive_s"] == pytest.approx(0.75)
