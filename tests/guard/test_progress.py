"""Progress deadlines (RunStuck) with plain numbers: learned per phase, the floor, the first
deadline, start-up, resolution, and the collector metrics built on them."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from guard.collector.book import HealthBook
from guard.collector.metrics import CollectorMetrics
from guard.core import schema
from guard.core.heartbeat import HeartbeatConfig, HeartbeatTracker
from guard.core.progress import ProgressConfig, ProgressTracker
from guard.core.tomlconf import ConfigError
from tests.helpers_http import wait_until


def steps(pt: ProgressTracker, rank: int, times: list[float], first_step: int = 0, gen: int = 1) -> None:
    for i, t in enumerate(times):
        pt.beat(rank, t, first_step + i, "train", generation=gen)


def test_first_deadline_until_a_phase_completes_then_safety_times_longest() -> None:
    pt = ProgressTracker(ProgressConfig(safety_factor=5, floor_s=1, first_deadline_s=100))
    pt.beat(0, 0.0, 0, generation=1)
    assert pt.deadline(0) == 100  # nothing learned yet
    steps(pt, 0, [10.0, 11.0, 13.0, 14.0], first_step=1)  # start-up 0 -> 10 not learned; 1, 2, 1
    assert pt.longest == {"train": 2.0}
    assert pt.deadline(0) == pytest.approx(10.0)
    assert not pt.stalled(0, now=14 + 9.9)
    assert pt.stalled(0, now=14 + 10.1)


def test_floor_bounds_fast_steps() -> None:
    pt = ProgressTracker(ProgressConfig(safety_factor=5, floor_s=60, first_deadline_s=1800))
    steps(pt, 0, [0.0, 0.05, 0.1, 0.15, 0.2])
    assert pt.deadline(0) == 60


def test_heartbeats_without_progress_do_not_reset_the_clock_and_progress_resolves() -> None:
    pt = ProgressTracker(ProgressConfig(safety_factor=2, floor_s=1, first_deadline_s=100))
    steps(pt, 0, [0.0, 1.0, 2.0, 3.0])  # 1 s steps -> deadline 2 s
    for t in (3.5, 4.0, 4.5, 5.0, 5.5):  # beats at step 3: alive, not advancing
        pt.beat(0, t, 3, "train", generation=1)
    assert pt.age(0, 5.5) == pytest.approx(2.5)
    assert pt.stalled(0, 5.5)
    pt.beat(0, 6.0, 4, "train", generation=1)  # moves again
    assert not pt.stalled(0, 6.1)
    assert pt.longest["train"] == pytest.approx(3.0)  # the hang taught a longer step: 6 s deadline now


def test_each_phase_learns_its_own_deadline() -> None:
    pt = ProgressTracker(ProgressConfig(safety_factor=3, floor_s=1, first_deadline_s=500))
    steps(pt, 0, [0.0, 1.0, 2.0])
    pt.beat(0, 2.5, 2, "checkpoint", generation=1)
    assert pt.deadline(0) == 500  # no checkpoint has completed yet
    pt.beat(0, 22.5, 2, "train", generation=1)  # a 20 s checkpoint
    assert pt.phase_deadline("checkpoint") == pytest.approx(60.0)
    assert pt.phase_deadline("train") == pytest.approx(3.0)  # 1 s steps, the 0.5 s before the save
    pt.beat(0, 23.0, 2, "checkpoint", generation=1)
    assert pt.deadline(0) == pytest.approx(60.0)
    assert pt.phase_deadline("eval") == 500


def test_a_new_generation_starts_up_again_with_the_first_deadline() -> None:
    pt = ProgressTracker(ProgressConfig(safety_factor=2, floor_s=1, first_deadline_s=300))
    steps(pt, 0, [0.0, 1.0, 2.0, 3.0], gen=1)
    pt.beat(0, 100.0, 2, "train", generation=2)  # restarted trainer, resumed at an older step
    assert pt.deadline(0) == 300  # loading and compiling again
    pt.beat(0, 150.0, 3, "train", generation=2)  # its first step after start-up: not learned
    assert pt.longest["train"] == pytest.approx(1.0)
    assert pt.deadline(0) == pytest.approx(2.0)
    pt.beat(0, 151.0, 9, "train", generation=1)  # a straggling beat of the old process: ignored
    assert pt.ranks[0].step == 3


def test_replayed_beats_teach_nothing() -> None:
    pt = ProgressTracker(ProgressConfig(safety_factor=2, floor_s=0.1, first_deadline_s=300))
    # the collector was down: beats made 1 s apart arrive in a burst at t=100
    for i, sent in enumerate([10.0, 11.0, 12.0, 13.0]):
        pt.beat(0, 100.0 + i * 0.01, i, "train", sent=sent, generation=1)
    pt.beat(0, 100.1, 3, "train", sent=12.5, generation=1)  # out of order
    assert pt.longest["train"] == pytest.approx(1.0)


def test_state_round_trip() -> None:
    pt = ProgressTracker(ProgressConfig(floor_s=1))
    steps(pt, 0, [0.0, 1.0, 3.0])
    pt.beat(1, 3.0, 2, "checkpoint", generation=1)
    back = ProgressTracker(ProgressConfig(floor_s=1))
    back.load_state_dict(pt.state_dict())
    assert back.state_dict() == pt.state_dict()
    with pytest.raises(ValueError):
        back.load_state_dict({"ranks": {"0": [1, "nap", 0, 0, 0, None, True]}})


def test_config_is_validated() -> None:
    with pytest.raises(ConfigError, match="floor_s"):
        ProgressConfig(floor_s=0)
    with pytest.raises(ConfigError, match="safety_factor"):
        ProgressConfig(safety_factor=0.5)


def test_quiet_phase_timeout_is_learned_after_the_first_checkpoint() -> None:
    hb = HeartbeatTracker(HeartbeatConfig(floor_s=30, min_intervals=1, quiet_phase_timeout_s=1800))
    hb.beat(0, 0, 0)
    hb.beat(0, 1, 1)
    hb.beat(0, 2, 1, phase="checkpoint")
    assert hb.timeout(0) == 1800  # no checkpoint seen yet
    hb.beat(0, 2.1, 1)  # a 0.1 s checkpoint
    hb.beat(0, 3, 2)
    hb.beat(0, 4, 2, phase="checkpoint")
    assert hb.timeout(0) == 30  # 5 x 0.1 s, floored: a rank that dies in its second save pages in 30 s
    hb.beat(0, 104, 2)  # a 100 s checkpoint: the next ones get 500 s
    hb.beat(0, 105, 3, phase="checkpoint")
    assert hb.timeout(0) == pytest.approx(500)


def scrape(book: HealthBook) -> dict[tuple[str, tuple], float]:
    m = CollectorMetrics(book, registry=CollectorRegistry())
    out = {}
    for fam in text_string_to_metric_families(m.render().decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_collector_metrics_name_the_stuck_rank_and_phase_and_clear_when_it_moves() -> None:
    clock = [0.0]
    m = HealthBook(
        clock=lambda: clock[0],
        heartbeat=HeartbeatConfig(floor_s=30, min_intervals=1),
        progress=ProgressConfig(safety_factor=2, floor_s=1, first_deadline_s=100),
    )
    for t in range(6):  # two ranks, 1 s steps
        for rank in (0, 1):
            m.beat("r", rank, float(t), t, "train", generation=7)
    for t in (6.0, 7.0, 8.0, 9.0):  # rank 1 keeps beating at step 5; rank 0 moves on
        m.beat("r", 0, t, int(t), "train", generation=7)
        m.beat("r", 1, t, 5, "train", generation=7)
    clock[0] = 9.0
    got = scrape(m)
    stuck = (schema.M_RANK_STUCK, (("phase", "train"), ("rank", "1"), ("run", "r")))
    assert got[stuck] == 1.0
    assert got[(schema.M_RANK_STUCK, (("phase", "train"), ("rank", "0"), ("run", "r")))] == 0.0
    assert got[(schema.M_RUN_STUCK_RANKS, (("phase", "train"), ("run", "r")))] == 1.0
    assert got[(schema.M_RUN_STUCK_RANKS, (("phase", "checkpoint"), ("run", "r")))] == 0.0
    assert got[(schema.M_PROGRESS_DEADLINE, (("rank", "1"), ("run", "r")))] == pytest.approx(2.0)
    assert got[(schema.M_PROGRESS_AGE, (("rank", "1"), ("run", "r")))] == pytest.approx(4.0)
    status = m.rank_status("r", now=9.0)
    assert status[1]["stuck"] and not status[0]["stuck"]
    m.beat("r", 1, 9.5, 9, "train", generation=7)
    clock[0] = 9.6
    assert scrape(m)[stuck] == 0.0


def test_a_silent_rank_is_lost_not_stuck_and_an_ended_rank_is_neither() -> None:
    clock = [0.0]
    m = HealthBook(
        clock=lambda: clock[0],
        heartbeat=HeartbeatConfig(floor_s=5, min_intervals=1),
        progress=ProgressConfig(safety_factor=2, floor_s=1, first_deadline_s=100),
    )
    for t in range(5):
        m.beat("r", 0, float(t), t, "train", generation=1)
    clock[0] = 4.0 + 10  # silent for 10 s: past the 5 s heartbeat timeout
    got = scrape(m)
    assert got[(schema.M_HEARTBEAT_LOST, (("rank", "0"), ("run", "r")))] == 1.0
    assert got[(schema.M_RANK_STUCK, (("phase", "train"), ("rank", "0"), ("run", "r")))] == 0.0
    m.end_heartbeats("r", 0)
    got = scrape(m)
    assert not any(k[0] in (schema.M_RANK_STUCK, schema.M_RUN_STUCK_RANKS) for k in got)


@pytest.mark.integration
def test_learned_deadlines_survive_a_collector_restart(tmp_path: Path) -> None:
    """A real collector learns train and checkpoint durations from beats, is restarted, and still
    applies them (state.json), including the learned quiet-phase heartbeat timeout."""
    from tests.helpers_collector import CollectorProc

    c = CollectorProc(
        tmp_path / "runs",
        "--checkpoint-interval",
        "0.2",
        "--heartbeat-floor",
        "1",
        "--progress-floor",
        "1",
        "--progress-first-deadline",
        "900",
    ).start()
    gen, t0 = int(time.time()), time.time()
    beats = [
        (0, "train", 0.0),
        (1, "train", 0.01),
        (2, "train", 0.02),
        (3, "train", 0.5),
        (3, "checkpoint", 0.51),
        (3, "train", 3.51),
        (4, "train", 3.52),
        (4, "checkpoint", 3.6),
    ]
    try:
        for i, (step, phase, dt) in enumerate(beats, start=1):
            meta = {"meta": {"run_id": "r", "status": "running"}} if i == 1 else {}
            r = c.post(
                {
                    "run": "r",
                    "rank": 0,
                    "seq": gen << 32 | i,
                    "heartbeat": {"time": t0 + dt, "step": step, "phase": phase},
                    **meta,
                }
            )
            assert r.status_code == 200, r.text

        def rank0_or_none() -> dict | None:
            runs = [x for x in httpx.get(f"{c.url}/v1/runs", timeout=10).json()["runs"] if x["run"] == "r"]
            return runs[0]["ranks"].get("0") if runs else None

        def rank0() -> dict:
            got = rank0_or_none()
            assert got is not None
            return got

        before = rank0()
        assert before["phase"] == "checkpoint"
        assert before["progress_deadline_s"] == pytest.approx(15.0)  # 5 x the 3 s checkpoint
        assert before["timeout_s"] == pytest.approx(15.0)  # learned quiet-phase timeout, not 30 min
        time.sleep(0.6)  # a checkpoint of the collector's state
        c.stop()
        c.start()
        after = wait_until(lambda: rank0_or_none(), timeout=30, what="the run listed after the restart")
        assert after["progress_deadline_s"] == pytest.approx(15.0)
        assert after["timeout_s"] == pytest.approx(15.0)
        assert after["last_step"] == 4
    finally:
        c.stop()
