"""kill -9 under real torchrun pages HeartbeatLost naming the dead rank, once (issue #37): the short
CI version of bench/drills/paging_drills.py (the full 60-drill figures are in docs/BENCHMARKS.md).

Per framework (torchtitan's launcher, the transformers Trainer with MoEGuardCallback, `moeguard
train`), all under `torchrun --standalone` with 2 gloo ranks: 3 kills of rank 0 and 3 of rank 1,
each at its own step, covering the losing side of the race on purpose (the survivor's SIGTERM just
before the kill, so it handles the signal before any collective notices the dead peer), the
agent's order (SIGTERM 0.2 s after), no SIGTERM of ours, with and without a checkpoint before the
kill; plus one control, the whole job preempted (SIGTERM to torchrun), that must page nothing.
One collector, Prometheus and Alertmanager for the module (the production rules and config, made
fast: tests/helpers_alerting.py); a framework's drills run concurrently.

Asserted per drill (bench/drills/paging_drills.py Result.problems): exactly one HeartbeatLost incident
for the run, naming the dead rank and no other, within the timeout the collector learned for it
plus the alert path; no other page; the run's status peer_lost at the collector and in the job's
own meta.json (a killed rank 0's written by the survivor); the control preempted in both and
silent.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.helpers_alerting import ALERTMANAGER, PROMETHEUS

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(PROMETHEUS is None or ALERTMANAGER is None, reason="needs prometheus + alertmanager"),
]

drills = pytest.importorskip("bench.drills.paging_drills")
KILLS_PER_RANK = 3
CONCURRENCY = 4


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[drills.Stack]:
    with drills.stack(tmp_path_factory.mktemp("drills")) as st:
        yield st


def check(st: drills.Stack, framework: str) -> None:
    plan = drills.plan([framework], KILLS_PER_RANK)
    kills = [d for d in plan if d.rank != drills.PREEMPT]
    assert {d.rank for d in kills} == {0, 1} and len({(d.rank, d.step) for d in kills}) == 2 * KILLS_PER_RANK
    assert {d.race for d in kills} == set(drills.RACES)
    assert {bool(d.checkpoint) for d in kills} == {True, False}
    results = drills.run_drills(st, plan, CONCURRENCY)
    failed = {r.drill.run: r.problems() for r in results if not r.ok}
    logs = {run: _tail(st.tmp / "jobs" / f"{run}.log") for run in failed}
    assert not failed, f"{failed}\n{logs}"


def _tail(p: Path) -> str:
    return p.read_text(errors="replace")[-1500:] if p.is_file() else ""


@pytest.mark.timeout(600)
def test_moeguard_train_kill_9_drills(stack: drills.Stack) -> None:
    check(stack, "moeguard")


@pytest.mark.timeout(600)
def test_transformers_trainer_kill_9_drills(stack: drills.Stack) -> None:
    pytest.importorskip("transformers")
    check(stack, "transformers")


@pytest.mark.timeout(600)
def test_torchtitan_kill_9_drills(stack: drills.Stack) -> None:
    pytest.importorskip("torchtitan", reason="torchtitan (and triton) not installed")
    check(stack, "torchtitan")
