"""Canary workers' runs kept apart from the user's (issue #31, item 7): new canaries write under
RUNS/canary-runs/; older ones that wrote beside the user's runs are hidden by default (a sidebar
toggle lists them), so Compare no longer defaults to comparing canary workers."""

from __future__ import annotations

from pathlib import Path

from tests.dashboards import synth_store as synth
from tests.dashboards.synth_run import SynthRun, write_run


def store(root: Path) -> None:
    write_run(root, SynthRun(run_id="mine", steps=120, seed=1))
    for i in range(3):
        d = write_run(root, SynthRun(run_id=f"tiny-canary-{i}", steps=120, seed=2 + i))
        synth.set_meta(d, canary={"variant": "", "slow_pct": 0, "timing": "cpu", "attempt": 1})
    write_run(root / "canary-runs", SynthRun(run_id="tiny-canary-new", steps=120, seed=9))
    (root / "canary-report").mkdir()


def test_runs_page_hides_canary_workers_and_says_where_they_are(tmp_path: Path, open_page) -> None:
    store(tmp_path)
    at = open_page("runs", tmp_path)
    assert not at.exception, [e.value for e in at.exception]
    assert list(at.dataframe[0].value["run"]) == ["mine"]
    captions = " ".join(c.value for c in at.caption)
    assert "4 canary worker run(s) hidden" in captions  # 3 beside the user's runs, 1 in canary-runs/
    assert "kept apart in `canary-runs/`" in captions
    assert "Ignored" not in captions  # canary-runs/ and canary-report/ are moeguard's own, not strays
    at.sidebar.toggle(key="show_canary").set_value(True).run()
    assert set(at.dataframe[0].value["run"]) == {
        "mine",
        "tiny-canary-0",
        "tiny-canary-1",
        "tiny-canary-2",
        "canary-runs/tiny-canary-new",  # issue #40: the toggle did nothing for canaries in canary-runs/
    }


def test_compare_defaults_to_the_users_runs(tmp_path: Path, open_page) -> None:
    store(tmp_path)
    at = open_page("compare", tmp_path)
    assert not at.exception, [e.value for e in at.exception]
    assert at.multiselect(key="runs").value == ["mine"]


def test_a_store_of_canary_runs_only_shows_them(tmp_path: Path, open_page) -> None:
    store(tmp_path)
    at = open_page("runs", tmp_path / "canary-runs")
    assert list(at.dataframe[0].value["run"]) == ["tiny-canary-new"]
