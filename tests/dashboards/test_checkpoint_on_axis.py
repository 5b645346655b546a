"""A run's last checkpoint sits on the run's step axis (issue #40, item 7): checkpoint-N is
recorded at step N (the steps it holds are 0..N-1), so a 20-step run's final save at step 20 was
drawn past the axis, which ends at the run's last step (dashboards/figures/style.step_range)."""

from __future__ import annotations

import json

import polars as pl

from dashboards.data import guard_events
from dashboards.figures.style import step_range
from guard.core import schema


def test_a_checkpoint_dot_sits_on_the_last_step_it_holds() -> None:
    base = {"time": 0.0, "detector": "", "value": float("nan"), "threshold": float("nan")}
    ev = pl.DataFrame(
        [
            {
                **base,
                "step": 10,
                "kind": schema.EV_CHECKPOINT,
                "action": "",
                "detail": json.dumps({"path": "checkpoint-10"}),
            },
            {
                **base,
                "step": 20,
                "kind": schema.EV_CHECKPOINT,
                "action": "",
                "detail": json.dumps({"path": "checkpoint-20"}),
            },
            {
                **base,
                "step": 12,
                "kind": schema.EV_VERDICT,
                "detector": schema.DET_MAXVIO,
                "action": schema.ACT_NONE,
                "detail": "{}",
            },
        ]
    )
    rows = guard_events.timeline_rows(ev)
    dots = rows.filter(pl.col("kind") == schema.EV_CHECKPOINT).sort("step")
    assert dots["step"].to_list() == [9, 19]
    assert "checkpoint-20" in dots["hover"][1] and "saved after step 19" in dots["hover"][1]
    lo, hi = step_range(0, 19)  # a 20-step run's axis
    assert all(lo <= s <= hi for s in rows["step"].to_list())
    assert rows.filter(pl.col("kind") == schema.EV_VERDICT)["step"].to_list() == [12]  # others as they were
