"""The precursor drill: an LR ramp on the micro config, the guard observing. The update-ratio
precursor must fire before the loss spike the ramp causes (docs/BENCHMARKS.md records the lead
time on configs/tiny.toml)."""

from __future__ import annotations

import json
from pathlib import Path

import polars as pl
import pytest

from guard.core import schema
from guard.store.reader import read_table
from tests.conftest import REPO, train_micro

RAMP_FROM = 40
# LR x2, x4, ... x4096 over 12 steps (each lrspike multiplies one step's LR)
RAMP = [f"lrspike@{RAMP_FROM + i}:{2 ** (i + 1)}" for i in range(12)]


def first_verdict(events: pl.DataFrame, detector: str) -> int | None:
    hits = events.filter((pl.col("kind") == schema.EV_VERDICT) & (pl.col("detector") == detector))
    return int(hits["step"].min()) if hits.height else None  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def drill(tmp_path_factory: pytest.TempPathFactory) -> Path:
    run = tmp_path_factory.mktemp("runs") / "ramp"
    train_micro(run, injections=RAMP, guard_mode="observe", overrides={"train.steps": 64})
    return run


def test_update_ratio_precursor_fires_before_the_loss_spike_of_an_lr_ramp(drill: Path) -> None:
    run = drill
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


def test_the_health_page_shows_the_precursors_of_the_drill(
    drill: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from streamlit.testing.v1 import AppTest

    from dashboards.data import config

    monkeypatch.setenv(config.ENV_RUNS, str(drill.parent))
    monkeypatch.delenv(config.ENV_HISTORY, raising=False)
    at = AppTest.from_file(str(REPO / "dashboards" / "app.py"), default_timeout=60).run()
    at.switch_page("page_health.py")
    at.query_params["run"] = drill.name
    at.run()
    assert not at.exception, [e.value for e in at.exception]
    figs = {
        str(f["layout"]["title"]["text"]): f
        for f in (json.loads(el.proto.spec) for el in at.get("plotly_chart"))
    }
    pre = next(f for t, f in figs.items() if t.startswith("Precursors"))
    names = {t.get("name") for t in pre["data"]}
    assert {"update ratio", "precursor: update ratio spike", "loss spike (episode start)"} <= names, names
    assert {"group 0 grad norm", "group 1 grad norm"} <= names, names
    assert any(t.startswith("Update ratio ||ΔW|| / ||W|| per layer") for t in figs), list(figs)
