"""Every tokens/s figure says which window it is taken over (issue #40, item 11): the Runs table and
Run health's metrics the last 100 steps, Compare the steady state, `moeguard train`'s progress
line the last step (tests/trainer/test_console.py). The three read differently for one run and
no label said which was which."""

from __future__ import annotations

from pathlib import Path

import pytest

from dashboards import ui
from tests.dashboards import synth_store as synth
from tests.dashboards.synth_run import ENV_A, SynthRun, write_run

FAST = "fast-kernel"


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tps-runs")
    write_run(root, SynthRun(run_id=synth.GUARDED, seed=1))
    write_run(root, SynthRun(run_id=FAST, faults=[], env={**ENV_A, "expert_kernel": "bmm"}, seed=4))
    return root


def captions(at) -> str:
    return " ".join(c.value for c in at.caption)


def test_runs_and_health_say_last_100_steps(store: Path, open_page) -> None:
    at = open_page("runs", store)
    assert not at.exception
    assert f"tokens/s and MFU: {ui.TPS_RECENT}" in captions(at)
    at = open_page("health", store, run=synth.GUARDED)
    assert not at.exception
    assert f"tokens/s and MFU above: {ui.TPS_RECENT}" in captions(at)
    assert next(m for m in at.metric if m.label == "tokens/s").help == ui.TPS_RECENT


def test_compare_says_steady_state(store: Path, open_page) -> None:
    at = open_page("compare", store)
    at.multiselect(key="runs").set_value([synth.GUARDED, FAST]).run()
    assert not at.exception
    cap = captions(at)
    assert f"tokens/s p50 and MFU p50 on this page: {ui.TPS_STEADY}" in cap, cap
    assert ui.TPS_RECENT in cap  # and why the other pages' figures differ
