"""Issue #30: a job of thousands of ranks through one collector. The collector's per-step work
and its /metrics must not grow with the rank count; a stalled rank is named by RunStuck among
16,384, a dead one by HeartbeatLost; nothing healthy is called lost or stuck.

These drive the collector's HealthBook (guard/collector/book.py, what ingest writes and /metrics
reads) with the beats the exporter sends (guard/wire/batch.py), with explicit clocks; the
collector process end to end is bench/scale/rank_scale.py's (tests/bench/test_rank_scale.py).
"""

from __future__ import annotations

import json
import time

import pytest

from guard.collector.book import HealthBook
from guard.collector.metrics import CollectorMetrics
from guard.core import schema
from guard.core.heartbeat import DECLARED_FACTOR, HeartbeatConfig, beat_interval_s, first_beat_delay_s
from guard.core.limits import CollectorLimits
from guard.core.progress import ProgressConfig
from guard.wire.batch import BadRequest, heartbeat, parse_batch
from tests.helpers_http import wait_until

RUN = "big"
WORLD = 16_384
STEP_S = 1.0
EVERY = beat_interval_s(WORLD, 5.0)  # 64 s


def book() -> HealthBook:
    return HealthBook(heartbeat=HeartbeatConfig(floor_s=30.0), progress=ProgressConfig(floor_s=20.0))


def run_job(b: HealthBook, t0: float, steps: int, *, beats: bool = True) -> float:
    """`steps` steps of a WORLD-rank job from t0: rank 0's report each step (world = WORLD), every
    other rank's own beat on its spread schedule. Returns the time after the last step."""
    due = sorted((t0 + first_beat_delay_s(r, WORLD, EVERY), r) for r in range(1, WORLD)) if beats else []
    i = 0
    t = t0
    for s in range(steps):
        t = t0 + s * STEP_S
        b.beat(RUN, 0, t, s, "train", t, 1, every=EVERY, world=WORLD)
        while i < len(due) and due[i][0] <= t:
            b.beat(RUN, due[i][1], due[i][0], max(s - 1, 0), "train", due[i][0], 1, every=EVERY)
            i += 1
    return t


def series(b: HealthBook, now: float) -> list[tuple[str, dict[str, str], float]]:
    """Every sample /metrics renders for the run at `now` (the real exposition code)."""
    b.clock = lambda: now
    out = []
    for fam in CollectorMetrics(b).collect():
        for smp in fam.samples:
            if smp.labels.get("run") == RUN:
                out.append((smp.name, dict(smp.labels), smp.value))
    return out


def named(samples: list, metric: str) -> set[str]:
    return {lab["rank"] for name, lab, v in samples if name == metric and v == 1.0}


def test_beat_interval_keeps_a_jobs_own_beats_under_the_budget() -> None:
    assert beat_interval_s(8, 5.0) == 5.0
    assert beat_interval_s(2048, 5.0) == 8.0
    assert beat_interval_s(WORLD, 5.0) == 64.0
    delays = [first_beat_delay_s(r, WORLD, EVERY) for r in range(WORLD)]
    per_second = [0] * int(EVERY)
    for d in delays:
        per_second[int(d)] += 1
    assert max(per_second) <= 257  # spread: no second carries more than the budget


def test_a_healthy_16k_rank_job_is_watched_in_a_handful_of_series() -> None:
    b = book()
    t = run_job(b, 1000.0, 120)
    view = next(b.views(t + 0.5))
    assert view.rank_counts == {"watched": WORLD, "lost": 0, "stuck": 0, "waiting": 0}
    assert not view.all_ranks and view.beats == [] and view.progress == []
    samples = series(b, t + 0.5)
    ranked = [s for s in samples if "rank" in s[1]]
    assert ranked == []  # no per-rank series for 16,384 healthy ranks
    counts = {lab["state"]: v for name, lab, v in samples if name == schema.M_RUN_RANKS}
    assert counts["watched"] == WORLD and counts["lost"] == 0


def test_ranks_not_heard_from_yet_are_not_lost_while_the_job_advances_or_waits() -> None:
    """Ranks whose first own beat is a minute away are covered by rank 0's per-step proof while
    the job advances, and by the interval the job's ranks declare while it waits."""
    b = book()
    t = run_job(b, 1000.0, 40, beats=False)  # no rank > 0 has beaten yet
    view = next(b.views(t + 1.0))
    assert view.rank_counts["lost"] == 0 and view.rank_counts["watched"] == WORLD
    view = next(b.views(t + 45.0))  # a 45 s wait: past the 30 s floor, within 2.5 x 64 s
    assert view.rank_counts["lost"] == 0
    view = next(b.views(t + DECLARED_FACTOR * EVERY + 1))  # then they are lost
    assert view.rank_counts["lost"] == WORLD  # rank 0 too: it went quiet with them


def test_a_stalled_rank_among_16k_is_named_alone() -> None:
    """Rank K stalls; the other 16,383 wait in the next collective (their beats say `waiting`),
    rank K beats early once (10 s into the stall); RunStuck names K only, nobody is lost."""
    b = book()
    k = 12_345
    t = run_job(b, 1000.0, 60)
    stall = t + STEP_S  # rank 0's next report never comes
    # during the stall every rank beats on its schedule, waiting, except K which beats early
    for r in range(1, WORLD):
        at = stall + (first_beat_delay_s(r, WORLD, EVERY) + 7.0) % EVERY
        if r == k:
            at = stall + 10.5
        if at < stall + 40:
            b.beat(RUN, r, at, 59, "train", at, 1, every=EVERY, waiting=r != k)
    b.beat(RUN, 0, stall + 5, 59, "train", stall + 5, 1, every=EVERY, waiting=True)
    now = stall + 40
    view = next(b.views(now))
    assert [p[0] for p in view.progress if p[4]] == [k]
    assert view.rank_counts["stuck"] == 1 and view.rank_counts["lost"] == 0
    samples = series(b, now)
    assert named(samples, schema.M_RANK_STUCK) == {str(k)}
    assert named(samples, schema.M_HEARTBEAT_LOST) == set()
    assert len([s for s in samples if "rank" in s[1]]) < 50  # K's series, not 16,384 x 9


def test_before_the_stalled_rank_speaks_nobody_is_named() -> None:
    """Under the progress floor nothing is stuck yet; the waiting ranks are never the ones named."""
    b = book()
    t = run_job(b, 1000.0, 60)
    for r in range(1, 500):
        b.beat(RUN, r, t + 5, 59, "train", t + 5, 1, every=EVERY, waiting=True)
    view = next(b.views(t + 15))
    assert view.rank_counts["stuck"] == 0


def test_a_hung_collective_names_every_rank_since_none_is_free() -> None:
    world = 100
    b = HealthBook(heartbeat=HeartbeatConfig(floor_s=30.0), progress=ProgressConfig(floor_s=20.0))
    for s in range(30):
        b.beat(RUN, 0, 1000.0 + s, s, "train", 1000.0 + s, 1, world=world)
    for r in range(world):
        b.beat(RUN, r, 1040.0, 29, "train", 1040.0, 1, every=5.0, waiting=True)
    view = next(b.views(1055.0))
    assert view.rank_counts["stuck"] == world


def test_a_dead_rank_among_16k_is_the_one_lost() -> None:
    """Rank D dies (no beat after the job stalls); the others wait and beat: D alone is lost,
    after DECLARED_FACTOR x the declared interval."""
    b = book()
    d = 4_321
    t = run_job(b, 1000.0, 130)  # every rank has beaten at least once
    stall = t + STEP_S
    horizon = stall + DECLARED_FACTOR * EVERY + 10
    for r in range(1, WORLD):
        if r == d:
            continue
        at = stall + first_beat_delay_s(r, WORLD, EVERY)
        while at < horizon:
            b.beat(RUN, r, at, 129, "train", at, 1, every=EVERY, waiting=True)
            at += EVERY
    b.beat(RUN, 0, horizon - 1, 129, "train", horizon - 1, 1, every=EVERY, waiting=True)
    view = next(b.views(horizon))
    lost = {r for r, _, age, timeout in view.beats if age > timeout}
    assert lost == {d}, sorted(lost)[:10]
    assert view.rank_counts["lost"] == 1


def test_rank_vectors_on_the_wire_are_checked() -> None:
    def body(ranks: dict, rank: int = 0) -> bytes:
        import json

        hb = heartbeat(time.time(), 3, "train", every=8.0, world=4)
        return json.dumps({"run": "r", "rank": rank, "seq": 1, "heartbeat": hb, "ranks": ranks}).encode()

    ok = {
        "step": 3,
        "step_time_s": [1.0] * 4,
        "data_wait_s": [0.0] * 4,
        "tokens": [8] * 4,
        "straggler_score": [1.0] * 4,
    }
    b = parse_batch(body(ok), CollectorLimits())
    assert b.heartbeat == {"time": b.heartbeat["time"], "step": 3, "phase": "train", "every": 8.0, "world": 4}
    assert list(b.ranks["tokens"]) == [8] * 4
    with pytest.raises(BadRequest, match=r"ranks.tokens: 3 values, expected 4"):
        parse_batch(body({**ok, "tokens": [8] * 3}), CollectorLimits())
    with pytest.raises(BadRequest, match="only rank 0"):
        parse_batch(body(ok, rank=2), CollectorLimits())
    with pytest.raises(BadRequest, match="more than max_ranks"):
        parse_batch(
            body({k: (v * 3 if isinstance(v, list) else v) for k, v in ok.items()}),
            CollectorLimits(max_ranks=8),
        )
    with pytest.raises(BadRequest, match="integers >= 0"):
        parse_batch(body({**ok, "tokens": [8, 8, -1, 8]}), CollectorLimits())


# ---- the collector process: liveness apart from state.json -------------------------------------
@pytest.mark.integration
def test_liveness_is_written_when_ranks_change_not_with_every_checkpoint(tmp_path) -> None:
    """300 ranks beat, rank 0 reports each step and the collector checkpoints every 0.1 s:
    state.json (rewritten each checkpoint) holds no per-rank record; liveness.json holds every
    rank's and is not rewritten while the set of ranks stays the same; a restarted collector
    still knows every rank (none lost, the proof-covered job watched)."""
    from guard.collector.config import LIVENESS_FILE, STATE_DIR, STATE_FILE
    from tests.helpers_collector import CollectorProc, batch, make_report

    world = 300
    c = CollectorProc(tmp_path / "runs", "--checkpoint-interval", "0.1").start()
    state_dir = tmp_path / "runs" / RUN / STATE_DIR
    try:
        now = time.time()
        for r in range(1, world):
            hb = heartbeat(now, 0, "train", every=8.0)
            assert c.post(batch(RUN, r, 1, [], heartbeat=hb)).status_code == 200
        # the trainer's clock: exactly 0.1 s a step, so the learned step time does not wander
        hb0 = lambda s: heartbeat(now + 0.1 * s, s, "train", every=8.0, world=world)  # noqa: E731
        assert c.post(batch(RUN, 0, 1, [make_report(0)], heartbeat=hb0(0))).status_code == 200
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the checkpoint after the last of them
            if (state_dir / LIVENESS_FILE).is_file():
                if len(json.loads((state_dir / LIVENESS_FILE).read_text())["ranks"]) == world:
                    break
            time.sleep(0.05)
        live = json.loads((state_dir / LIVENESS_FILE).read_text())
        assert len(live["ranks"]) == world
        for s in range(1, 6):  # the step's duration learned (liveness.json rewritten for it)
            assert c.post(batch(RUN, 0, s + 1, [make_report(s)], heartbeat=hb0(s))).status_code == 200
            time.sleep(0.1)
        time.sleep(0.3)
        first = (state_dir / LIVENESS_FILE).stat().st_mtime_ns
        for s in range(6, 15):  # 0.9 s more of steps: ~9 checkpoints
            assert c.post(batch(RUN, 0, s + 1, [make_report(s)], heartbeat=hb0(s))).status_code == 200
            time.sleep(0.1)
        # the checkpoint after step 14's post (every 0.1 s; later than that on a loaded box)
        saved = lambda: (st := json.loads((state_dir / STATE_FILE).read_text()))["last_step"] == 14 and st  # noqa: E731
        state = wait_until(saved, timeout=10, what="the checkpoint of step 14")
        assert "ranks" not in state and state["last_step"] == 14
        assert (state_dir / LIVENESS_FILE).stat().st_mtime_ns == first  # not rewritten
        c.stop()
        c.start()
        counts = {dict(lab)["state"]: v for (n, lab), v in c.metrics().items() if n == schema.M_RUN_RANKS}
        assert counts["watched"] == world and counts["lost"] == 0, counts
    finally:
        c.stop()


def test_own_beats_a_minute_apart_do_not_teach_a_minute_long_step() -> None:
    """Under rank 0's proof, a rank's own beats (8 s apart, 8 steps advanced) are no phase
    duration: the deadline stays the floor (20 s), learned from 1 s steps, not 5 x 8 s."""
    world, every = 2048, beat_interval_s(2048, 5.0)
    b = HealthBook(heartbeat=HeartbeatConfig(floor_s=30.0), progress=ProgressConfig(floor_s=20.0))
    for s in range(100):
        t = 1000.0 + s
        b.beat(RUN, 0, t, s, "train", t, 1, every=every, world=world)
        for r in range(1 + s % 8, world, 8):  # each rank beats every 8 s
            b.beat(RUN, r, t, max(s - 1, 0), "train", t, 1, every=every)
    b.clock = lambda: 1100.0
    view = next(b.views(1100.0))
    assert view.rank_counts["watched"] == world
    assert b._runs[RUN].progress.phase_deadline("train") == 20.0
