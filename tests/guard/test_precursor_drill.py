"""The precursor drill: an LR ramp on the micro config, the guard observing. The update-ratio
precursor must fire before the loss spike the ramp causes (docs/BENCHMARKS.md records the lead
time on configs/tiny.toml)."""

from __future__ import annotations

from pathlib import Path

import polars as pl

from guard.core import schema
from guard.store.reader import read_table
from tests.conftest import train_micro

RAMP_FROM = 40
# LR x2, x4, ... x4096 over 12 steps (each lrspike multiplies one step's LR)
RAMP = [f"lrspike@{RAMP_FROM + i}:{2 ** (i + 1)}" for i in range(12)]


def first_verdict(events: pl.DataFrame, detector: str) -> int | None:
    hits = events.filter((pl.col("kind") == schema.EV_VERDICT) & (pl.col("detector") == detector))
    return int(hits["step"].min()) if hits.height else None  # type: ignore[arg-type]


def test_update_ratio_precursor_fires_before_the_loss_spike_of_an_lr_ramp(tmp_path: Path) -> None:
    run = tmp_path / "r"
    train_micro(run, injections=RAMP, guard_mode="observe", overrides={"train.steps": 64})
    events = read_table(run, schema.TABLE_EVENTS)
    precursor = first_verdict(events, schema.DET_UPDATE_RATIO)
    loss_spike = first_verdict(events, schema.DET_LOSS_SPIKE)
    assert precursor is not None and loss_spike is not None, events
    assert RAMP_FROM < precursor < loss_spike, (precursor, loss_spike)
    # a warning that records, never acts
    pre = events.filter(pl.col("detector") == schema.DET_UPDATE_RATIO)
    assert set(pre["action"].to_list()) == {schema.ACT_NONE}
    # the signal itself is in the run store: steps.update_ratio and layers.update_ratio
    steps = read_table(run, schema.TABLE_STEPS)
    ratio = dict(zip(steps["step"].to_list(), steps["update_ratio"].to_list(), strict=True))
    assert ratio[precursor] > 2 * ratio[RAMP_FROM]
    assert read_table(run, schema.TABLE_LAYERS)["update_ratio"].is_not_nan().sum() > 0
    assert read_table(run, schema.TABLE_GROUPS).height == 2 * 64  # two AdamW groups per step
