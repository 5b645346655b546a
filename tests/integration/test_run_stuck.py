"""End to end: a run that hangs while its heartbeats go on is named stuck, and clears when it moves.

    moeguard train --inject hang@25:8 --collector URL   ->   moeguard collector (/metrics, /v1/runs)

A real micro training run on one thread streams to a real collector on loopback. At step 25 the
step blocks for 8 s inside a (simulated) collective: the process is alive and its heartbeat goes
on (trainer.distributed.HeartbeatPump), but no step completes. The collector must mark rank 0
stuck in phase `train` (moeguard_rank_stuck, moeguard_run_stuck_ranks: what RunStuck alerts on)
once the learned deadline has passed, never call the rank lost, and clear the mark when the
step completes. The delay (time since the rank's last progress when the mark first shows, the
collector's own clock) and the learned deadline are saved to test-output/run_stuck/. `serial`: the
mark must show within a second of the deadline, which a neighbour test's load would skew.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from guard.core import schema
from tests.conftest import MICRO, REPO
from tests.helpers_collector import CollectorProc
from tests.helpers_http import http_json, wait_until

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.serial(cost=13)]

TOKEN = "stuck-token"
RUN = "hung"
HANG_STEP, HANG_S = 25, 8.0  # > the learned deadline (~the floor) + a scrape; short: the test is serial
PROGRESS_FLOOR_S = 2.0  # small, so the drill is quick; a loaded box's step hiccups stay well under it
FIRST_DEADLINE_S = 60.0
HEARTBEAT_FLOOR_S = 3.0  # far below the hang: a heartbeat that stopped would show as lost
POLL_S = 0.1
ARTIFACTS = REPO / "test-output" / "run_stuck"


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    import urllib.request

    with urllib.request.urlopen(f"{url}/metrics", timeout=10) as r:
        text = r.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def rank_value(m: dict[tuple[str, tuple], float], name: str, **labels: str) -> float | None:
    want = tuple(sorted({"run": RUN, **labels}.items()))
    return m.get((name, want))


@pytest.mark.timeout(300)
def test_hung_step_is_stuck_within_the_learned_deadline_and_clears_when_it_moves(tmp_path: Path) -> None:
    env = {**os.environ, schema.ENV_TOKEN: TOKEN, "PYTHONUNBUFFERED": "1"}
    env.pop(schema.ENV_COLLECTOR, None)
    tlog = open(tmp_path / "train.log", "wb")
    collector = CollectorProc(
        tmp_path / "collector-runs",
        "--checkpoint-interval",
        "0.5",
        "--heartbeat-floor",
        str(HEARTBEAT_FLOOR_S),
        "--progress-floor",
        str(PROGRESS_FLOOR_S),
        "--progress-first-deadline",
        str(FIRST_DEADLINE_S),
        token=TOKEN,
        stderr=tmp_path / "collector.log",
    )
    trainer = None
    result: dict[str, float] = {}
    try:
        url = collector.start().url
        trainer = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "guard",
                "train",
                "--config",
                str(MICRO),
                "--run-dir",
                str(tmp_path / "train" / RUN),
                "--steps",
                "40",
                "--no-progress",
                "--collector",
                url,
                "--set",
                "train.threads=1",
                "--inject",
                f"hang@{HANG_STEP}:{HANG_S:g}",
            ],
            cwd=REPO,
            env=env,
            stdout=tlog,
            stderr=subprocess.STDOUT,
        )

        # Watch every 0.1 s until the run is finished: the rank must never be lost, and must be
        # stuck only while the hung step blocks.
        stuck_at = cleared_at = ended_at = None
        seen: list[dict[str, float | None]] = []
        while True:
            m = scrape(url)
            stuck = rank_value(m, schema.M_RANK_STUCK, rank="0", phase="train")
            lost = rank_value(m, schema.M_HEARTBEAT_LOST, rank="0")
            assert lost in (None, 0.0), "the heartbeat went on during the hang: the rank must not be lost"
            if stuck == 1.0 and stuck_at is None:
                stuck_at = time.monotonic()
                _, body = http_json(f"{url}/v1/runs")
                [run] = [r for r in body["runs"] if r["run"] == RUN]
                rk = run["ranks"]["0"]
                seen.append(
                    {
                        "age": rank_value(m, schema.M_PROGRESS_AGE, rank="0"),
                        "deadline": rank_value(m, schema.M_PROGRESS_DEADLINE, rank="0"),
                        "run_stuck_ranks": rank_value(m, schema.M_RUN_STUCK_RANKS, phase="train"),
                        "last_step": rk["last_step"],
                        "stuck": rk["stuck"],
                        "lost": rk["lost"],
                    }
                )
            # cleared: 0, or no series at all once the same batches also finished the run
            if stuck_at is not None and stuck != 1.0 and cleared_at is None:
                cleared_at = time.monotonic()
            if trainer.poll() is not None:
                # The steps after the hang take well under a second: the trainer can exit before
                # the collector has taken the batches that move the rank. Watch a little longer.
                ended_at = ended_at if ended_at is not None else time.monotonic()
                if cleared_at is not None or stuck_at is None or time.monotonic() - ended_at > 10:
                    break
            time.sleep(POLL_S)
        assert trainer.returncode == 0, (tmp_path / "train.log").read_text()[-3000:]

        assert stuck_at is not None, "the collector never marked the hung rank stuck"
        [first] = seen
        assert first["stuck"] is True and first["lost"] is False
        assert first["last_step"] == HANG_STEP - 1, "stuck at the hung step, not before it"
        assert first["run_stuck_ranks"] == 1.0
        deadline, delay = first["deadline"], first["age"]
        assert deadline is not None and delay is not None
        assert PROGRESS_FLOOR_S <= deadline < FIRST_DEADLINE_S, "a learned deadline, not the first one"
        # marked once the deadline passed, and within a scrape or two of it
        assert deadline < delay <= deadline + 1.0, (delay, deadline)
        result = {
            "learned_deadline_s": round(deadline, 3),
            "detected_after_s": round(delay, 3),
            "hang_s": HANG_S,
        }

        # ... and it cleared when the hung step completed: HANG_S after the hang began
        assert cleared_at is not None, "the stuck mark did not clear when the run moved again"
        hang_began = stuck_at - delay
        result["cleared_after_hang_began_s"] = round(cleared_at - hang_began, 2)
        assert HANG_S - 1.0 <= cleared_at - hang_began <= HANG_S + 5.0, result

        def finished() -> bool:
            _, body = http_json(f"{url}/v1/runs")
            return any(r["run"] == RUN and r["status"] == schema.STATUS_FINISHED for r in body["runs"])

        wait_until(finished, timeout=30, what="the run finished at the collector")
        m = scrape(url)
        assert (
            rank_value(m, schema.M_RANK_STUCK, rank="0", phase="train") is None
        )  # an ended run is not watched
    finally:
        if trainer is not None and trainer.poll() is None:
            trainer.kill()
            trainer.wait(10)
        collector.stop()
        tlog.close()
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        (ARTIFACTS / "result.json").write_text(json.dumps(result, indent=2))
        for log in tmp_path.glob("*.log"):
            (ARTIFACTS / log.name).write_bytes(log.read_bytes())
