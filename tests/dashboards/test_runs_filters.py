"""Runs filterable by name, status, tag and start date (issue #40): the filter functions over the
runs' meta.json, and the Runs page under AppTest. A run written before tags existed still lists."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

from dashboards.data import run_filter, runs
from guard.core import schema
from guard.core.tags import clean_tags, run_tags
from guard.store.layout import atomic_write_json
from guard.store.reader import read_meta
from tests.dashboards.synth_run import T0, SynthRun, write_run

DAY = 86400.0
# run id -> (status, tags, days after T0 it started); "old-run" has no tags entry at all
RUNS = {
    "ablation-a": (schema.STATUS_FINISHED, ["ablation", "h100"], 0),
    "ablation-b": (schema.STATUS_CRASHED, ["ablation"], 2),
    "baseline": (schema.STATUS_FINISHED, ["baseline", "h100"], 5),
    "old-run": (schema.STATUS_HALTED, None, 9),
}


@pytest.fixture(scope="module")
def tagged_store(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("tagged")
    for run_id, (status, tags, day) in RUNS.items():
        d = write_run(root, SynthRun(run_id=run_id, steps=20, faults=[], status=status))
        meta = read_meta(d)
        assert meta is not None
        meta["started_at"] = T0 + day * DAY
        if tags is not None:
            meta[schema.META_TAGS] = tags
        atomic_write_json(d / schema.META_FILE, meta)
    return root


def _day(n: int) -> dt.date:
    return dt.datetime.fromtimestamp(T0 + n * DAY).date()


def test_clean_tags_is_the_one_rule() -> None:
    assert clean_tags([" a ", "b", "a"]) == ["a", "b"]
    assert clean_tags("solo") == ["solo"] and clean_tags(None) == []
    for bad in ([""], [3], ["x" * 65]):
        with pytest.raises(ValueError, match="--tag"):
            clean_tags(bad, "--tag")  # type: ignore[arg-type]
    assert run_tags({}) == [] and run_tags({"tags": "not-a-list"}) == [] and run_tags(None) == []


def test_filters_by_name_status_tag_and_date(tagged_store: Path) -> None:
    infos = runs.discover(tagged_store)

    def ids(**kw) -> set[str]:
        return {i.run_id for i in run_filter.apply(infos, run_filter.RunFilter(**kw))}

    assert ids() == set(RUNS)
    assert ids(name="ABLATION") == {"ablation-a", "ablation-b"}
    assert ids(statuses=frozenset({schema.STATUS_FINISHED})) == {"ablation-a", "baseline"}
    assert ids(tags=frozenset({"h100"})) == {"ablation-a", "baseline"}
    assert ids(tags=frozenset({"baseline", "ablation"})) == {"ablation-a", "ablation-b", "baseline"}
    assert ids(since=_day(1), until=_day(5)) == {"ablation-b", "baseline"}
    assert ids(name="a", tags=frozenset({"ablation"}), statuses=frozenset({schema.STATUS_CRASHED})) == {
        "ablation-b"
    }
    assert run_filter.all_tags(infos) == ["ablation", "baseline", "h100"]
    assert run_filter.date_span(infos) == (_day(0), _day(9))


def test_runs_page_filters_before_the_table(tagged_store: Path, open_page) -> None:
    at = open_page("runs", tagged_store)
    assert not at.exception, [e.value for e in at.exception]
    df = at.dataframe[0].value
    assert set(df["run"]) == set(RUNS)
    tags = dict(zip(df["run"], df["tags"], strict=True))
    assert list(tags["ablation-a"]) == ["ablation", "h100"] and len(tags["old-run"]) == 0
    at.multiselect(key="runs_tags").set_value(["h100"]).run()
    assert set(at.dataframe[0].value["run"]) == {"ablation-a", "baseline"}
    assert any("2 of 4 runs match" in c.value for c in at.caption)
    at.multiselect(key="runs_status").set_value([schema.STATUS_FINISHED]).run()
    at.text_input(key="runs_name").set_value("base").run()
    assert set(at.dataframe[0].value["run"]) == {"baseline"}
    at.multiselect(key="runs_tags").set_value([]).run()
    at.multiselect(key="runs_status").set_value([]).run()
    at.text_input(key="runs_name").set_value("").run()
    at.date_input(key="runs_dates").set_value((_day(1), _day(5))).run()
    assert set(at.dataframe[0].value["run"]) == {"ablation-b", "baseline"}
    at.text_input(key="runs_name").set_value("nothing-like-this").run()
    assert not at.dataframe and any("No run matches" in i.value for i in at.info)


def test_a_filtered_view_is_a_link(tagged_store: Path, open_page, monkeypatch) -> None:
    from streamlit.testing.v1 import AppTest

    from dashboards.data import config
    from tests.dashboards.conftest import APP

    monkeypatch.setenv(config.ENV_RUNS, str(tagged_store))
    at = AppTest.from_file(str(APP), default_timeout=60).run()
    at.switch_page("page_canaries.py").run()  # the Runs page's widgets are forgotten
    at.query_params["runs_tags"] = "ablation"
    at.query_params["runs_name"] = "-b"
    at.switch_page("page_runs.py").run()  # opened from a link
    assert not at.exception, [e.value for e in at.exception]
    assert set(at.dataframe[0].value["run"]) == {"ablation-b"}
