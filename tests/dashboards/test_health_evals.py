"""Evaluation losses on Run health's loss chart (issue #40), on the loss chart's step axis; a run
without evaluations draws nothing extra."""

from __future__ import annotations

from pathlib import Path

import pytest
from app_helpers import chart_titled, traces

from guard.store.runstore import RunStore
from tests.dashboards.synth_run import T0, SynthRun, write_run

HEALTH_TITLE = "Loss and grad norm with guard verdicts and actions"


@pytest.fixture(scope="module")
def eval_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("evals")
    write_run(root, SynthRun(run_id="plain", steps=40, faults=[]))
    d = write_run(root, SynthRun(run_id="with-evals", steps=40, faults=[]))
    store = RunStore(d)  # a loop's evaluations, through the same writer
    for step, loss in ((9, 4.1), (19, 3.7), (29, 3.5), (39, 3.4)):
        store.add_evals(step, T0 + step, {"eval_loss": loss, "eval_accuracy": 0.1 + step / 100})
    store.close()
    return root


def test_eval_loss_is_drawn_over_the_train_loss(eval_store: Path, open_page) -> None:
    at = open_page("health", eval_store, run="with-evals")
    assert not at.exception, [e.value for e in at.exception]
    fig = chart_titled(at, HEALTH_TITLE)
    (ev,) = traces(fig, "eval_loss")
    assert ev["x"] == [9, 19, 29, 39] and ev["y"] == pytest.approx([4.1, 3.7, 3.5, 3.4])
    (loss,) = traces(fig, "loss")
    assert ev["xaxis"] == loss.get("xaxis", "x") and ev["yaxis"] == loss.get("yaxis", "y")
    assert fig["layout"]["xaxis"]["range"] == [-0.5, 39.5]  # the run's own steps: no stretch
    assert not traces(fig, "eval_accuracy")  # not a loss: said in the caption, not on this axis
    assert any("eval_accuracy 0.49 (step 39)" in c.value for c in at.caption)


def test_a_run_without_evaluations_draws_none(eval_store: Path, open_page) -> None:
    at = open_page("health", eval_store, run="plain")
    assert not at.exception, [e.value for e in at.exception]
    fig = chart_titled(at, HEALTH_TITLE)
    assert not [t for t in fig["data"] if str(t.get("name", "")).startswith("eval")]
    assert not any("evaluation" in c.value for c in at.caption)
