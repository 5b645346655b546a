"""HeartbeatTracker with plain numbers: learned timeouts, checkpoint exclusion, the floor."""

from __future__ import annotations

import math

import pytest

from guard.core.heartbeat import HeartbeatConfig, HeartbeatTracker
from guard.core.tomlconf import ConfigError


def beats(hb: HeartbeatTracker, rank: int, times: list[float], phase: str = "train") -> None:
    for i, t in enumerate(times):
        hb.beat(rank, t, i, phase)


def test_floor_until_enough_intervals() -> None:
    hb = HeartbeatTracker(HeartbeatConfig(floor_s=30, min_intervals=10))
    beats(hb, 0, [0, 1, 2, 3])  # 3 intervals of 1 s: still learning
    assert hb.timeout(0) == 30
    assert hb.lost(now=33.1) == {0: True}
    assert hb.lost(now=32.9) == {0: False}


def test_learned_timeout_is_safety_factor_times_max_interval() -> None:
    hb = HeartbeatTracker(HeartbeatConfig(floor_s=1, min_intervals=5, safety_factor=5.0))
    beats(hb, 0, [0, 2, 4, 10, 12, 14])  # intervals 2, 2, 6, 2, 2 -> max 6
    assert hb.timeout(0) == pytest.approx(30.0)
    assert hb.lost(now=14 + 29.9) == {0: False}
    assert hb.lost(now=14 + 30.1) == {0: True}


def test_floor_bounds_a_fast_rank() -> None:
    hb = HeartbeatTracker(HeartbeatConfig(floor_s=30, min_intervals=3))
    beats(hb, 0, [0, 0.1, 0.2, 0.3, 0.4])
    assert hb.timeout(0) == 30  # 5 x 0.1 s would page on a GC pause


def test_checkpoint_intervals_do_not_teach() -> None:
    hb = HeartbeatTracker(HeartbeatConfig(floor_s=1, min_intervals=3, quiet_phase_timeout_s=1000))
    hb.beat(0, 0, 0)
    hb.beat(0, 1, 1)
    hb.beat(0, 2, 2, phase="checkpoint")  # the interval 1 -> 2 started while training: counts
    assert hb.timeout(0) == 1000  # while checkpointing, the quiet-phase timeout applies
    hb.beat(0, 602, 2)  # 600 s checkpoint: started in checkpoint phase, excluded
    hb.beat(0, 603, 3)
    assert hb.ranks[0].max_interval == 1
    assert hb.timeout(0) == 5  # 5 x 1 s, not 5 x 600 s


def test_sent_clock_measures_intervals_and_now_measures_age() -> None:
    hb = HeartbeatTracker(HeartbeatConfig(floor_s=1, min_intervals=2))
    # The collector was down: three beats made 1 s apart arrive in a burst at t=100.
    hb.beat(0, 100.0, 0, sent=10.0)
    hb.beat(0, 100.0, 1, sent=11.0)
    hb.beat(0, 100.1, 2, sent=12.0)
    assert hb.ranks[0].max_interval == 1.0  # not 88 s (the outage) nor 0 s (the burst)
    assert hb.age(0, 103.0) == pytest.approx(2.9)


def test_replayed_beat_proves_life_but_teaches_nothing() -> None:
    hb = HeartbeatTracker(HeartbeatConfig(floor_s=1, min_intervals=1))
    hb.beat(0, 0.0, 0, sent=0.0)
    hb.beat(0, 5.0, 1, sent=5.0)
    hb.beat(0, 50.0, 1, sent=5.0)  # same beat again (a retried batch)
    assert hb.ranks[0].n_intervals == 1
    assert hb.age(0, 50.0) == 0.0


def test_per_rank_and_unknown_rank() -> None:
    hb = HeartbeatTracker(HeartbeatConfig(floor_s=10))
    hb.beat(0, 100, 5)
    hb.beat(1, 80, 5)
    assert hb.lost(now=95) == {0: False, 1: True}
    assert math.isnan(hb.age(7, 100))
    assert hb.timeout(7) == 10


def test_bad_phase_and_config() -> None:
    with pytest.raises(ValueError, match="phase"):
        HeartbeatTracker().beat(0, 0, 0, phase="nap")
    with pytest.raises(ConfigError, match="safety_factor"):
        HeartbeatConfig(safety_factor=0.5)
