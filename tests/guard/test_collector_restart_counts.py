"""The collector's counters survive its restart (issue #17): `moeguard_guard_actions_total` (and
the verdict counter beside it) read the same after a graceful stop, after a SIGKILL whose
batches are only in the write-ahead log, and for a run whose state.json predates the counters.
Before, every restart set them to 0 while the run's actions were all in its store, so the
Grafana "Guard actions" stat and the ActionRate rule read a reset."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from guard.collector.config import STATE_DIR, STATE_FILE
from guard.core import actions, schema
from guard.core.events import Event
from guard.store.reader import count_actions
from tests.helpers_collector import CollectorProc, batch, make_report

pytestmark = pytest.mark.integration
RUN = "restarted"


def _steps(first: int, n: int, acted: dict[int, str]) -> list:
    reps = [make_report(s) for s in range(first, first + n)]
    for r in reps:
        r.action = acted.get(r.step, schema.ACT_APPLY)
    return reps


def _acted(step: int, action: str, detector: str) -> list[dict]:
    """The trainer's events for a step the guard acted on: its verdict and its action."""
    return [
        Event(step=step, kind=schema.EV_VERDICT, detector=detector, action=action).row(),
        Event(step=step, kind=schema.EV_ACTION, detector=detector, action=action).row(),
    ]


def _counts(c: CollectorProc) -> tuple[dict[str, int], dict[str, int]]:
    """(guard actions by action, verdicts by detector) of RUN on the collector's /metrics."""
    m = c.metrics()
    acts = {a: int(m[(schema.M_ACTIONS, (("action", a), ("run", RUN)))]) for a in actions.GUARD_ACTIONS}
    verdicts = {
        dict(labels)["detector"]: int(v)
        for (name, labels), v in m.items()
        if name == schema.M_VERDICTS and ("run", RUN) in labels
    }
    return acts, verdicts


def _post(c: CollectorProc, seq: int, reps: list, events: list[dict]) -> None:
    r = c.post(batch(RUN, 0, seq, reps, events))
    assert r.status_code == 200, r.text


def test_action_and_verdict_counters_survive_collector_restarts(tmp_path: Path) -> None:
    # checkpoints only at a graceful stop: what a SIGKILL leaves is in the write-ahead log alone
    c = CollectorProc(tmp_path / "runs", "--checkpoint-interval", "600").start()
    try:
        # steps 0..19: a skip (grad-norm spike), a rollback that starts an LR cool-down
        ev = _acted(5, schema.ACT_SKIP, schema.DET_GRAD_SPIKE) + _acted(
            12, schema.ACT_ROLLBACK, schema.DET_LOSS_SPIKE
        )
        ev.append(Event(step=12, kind=schema.EV_ACTION, action=schema.ACT_LR_COOLDOWN).row())
        _post(c, 1, _steps(0, 20, {5: schema.ACT_SKIP, 12: schema.ACT_ROLLBACK}), ev)
        want = {**actions.zero(), schema.ACT_SKIP: 1, schema.ACT_ROLLBACK: 1, schema.ACT_LR_COOLDOWN: 1}
        want_v = {schema.DET_GRAD_SPIKE: 1, schema.DET_LOSS_SPIKE: 1}
        assert _counts(c) == (want, want_v)

        c.stop()  # graceful: a checkpoint commits the counters with the rows
        c.start()
        assert _counts(c) == (want, want_v), "after a restart, before the trainer sends again"

        # the trainer goes on: a collapse bias correction (an applied step; its row says bias_correct) and a skip
        ev = _acted(22, schema.ACT_BIAS_CORRECT, schema.DET_MAXVIO) + _acted(
            25, schema.ACT_SKIP, schema.DET_NONFINITE
        )
        _post(c, 2, _steps(20, 10, {22: schema.ACT_BIAS_CORRECT, 25: schema.ACT_SKIP}), ev)
        want.update({schema.ACT_BIAS_CORRECT: 1, schema.ACT_SKIP: 2})
        want_v.update({schema.DET_MAXVIO: 1, schema.DET_NONFINITE: 1})
        assert _counts(c) == (want, want_v)

        c.kill()  # SIGKILL: batch 2 is only in the log, replayed onto the checkpoint's counters
        c.start()
        assert _counts(c) == (want, want_v), "replayed once: neither lost nor counted twice"

        _post(c, 3, _steps(30, 10, {35: schema.ACT_SKIP}), _acted(35, schema.ACT_SKIP, schema.DET_GRAD_SPIKE))
        want[schema.ACT_SKIP] = 3
        want_v[schema.DET_GRAD_SPIKE] = 2
        assert _counts(c) == (want, want_v)
        c.stop()
        run_dir = c.runs / RUN
        assert count_actions(run_dir) == want, "the run store counts what /metrics says"

        # a state.json from before the counters were kept: counted from the run store at start-up
        state_file = run_dir / STATE_DIR / STATE_FILE
        st = json.loads(state_file.read_text())
        assert st["counters"]["actions"] == want
        del st["counters"]
        state_file.write_text(json.dumps(st))
        c.start()
        assert _counts(c) == (want, want_v)
        assert json.loads(state_file.read_text())["counters"]["actions"] == want, "and kept from then on"
    finally:
        c.stop()
