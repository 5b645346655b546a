"""A compaction between the app's listing of a table and its read (issue #38's store upkeep runs
in the collector while people watch the run): the page reruns, lists again and draws the whole
run, no exception. Real parts, a real compaction (guard/store/compaction.py) at the worst instant:
after the scan listed the parts, before polars reads them."""

from __future__ import annotations

from pathlib import Path

import pytest
from app_helpers import messages

from guard.core import schema
from guard.store import reader
from guard.store.compaction import compact_span
from guard.store.layout import part_files, polars_schema
from tests.dashboards.synth_run import SynthRun, write_run


def compact_after_listing(monkeypatch: pytest.MonkeyPatch, run: Path, times: int, when: str) -> list[int]:
    """The first `times` scans of the run's steps table compact the table right after listing it,
    before the parts' footer checks (`when` "listed") or after them ("checked"): the scan keeps
    the names it listed, whose files are then gone."""
    real = reader.good_parts
    done: list[int] = []
    steps_dir = run / schema.TABLE_STEPS

    def compact(parts: list[Path]) -> None:
        if len(done) < times and len(parts) > 1 and all(p.parent == steps_dir for p in parts):
            merged = compact_span(steps_dir, 0, 10**9, polars_schema(schema.TABLE_STEPS), force=True)
            assert merged is not None and not any(p.exists() for p in parts if p != merged)
            done.append(len(parts))

    def good_parts(parts: list[Path]) -> list[Path]:
        if when == "listed":
            compact(parts)
        out = real(parts)
        if when == "checked":
            compact(out)
        return out

    monkeypatch.setattr(reader, "good_parts", good_parts)
    return done


@pytest.mark.parametrize("when", ["listed", "checked"])
def test_a_compaction_mid_read_reruns_and_draws_the_whole_run(
    when: str, tmp_path: Path, open_page, monkeypatch: pytest.MonkeyPatch
) -> None:
    """ "listed": the parts go before the footer checks, which once skipped them as damaged
    ("cannot be read") and drew the run without their steps; "checked": polars' read fails."""
    run = write_run(tmp_path, SynthRun(run_id="live", steps=300, seed=3))
    n_parts = len(part_files(run, schema.TABLE_STEPS))
    assert n_parts > 1
    done = compact_after_listing(monkeypatch, run, times=1, when=when)
    at = open_page("health", tmp_path, run="live")
    assert done == [n_parts]  # the race happened, on the listed parts
    assert not at.exception, [e.value for e in at.exception]
    assert len(part_files(run, schema.TABLE_STEPS)) == 1  # read from the merged part
    assert at.get("plotly_chart") and not [m for m in messages(at) if "damaged" in m]
    assert {m.label: m.value for m in at.metric}["steps"] == "300"  # every step, none lost or doubled


def test_a_part_that_stays_missing_is_an_error_not_a_loop(
    tmp_path: Path, open_page, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past a few reruns the error shows: a folder that loses parts on every read is not a race."""
    run = write_run(tmp_path, SynthRun(run_id="live", steps=300, seed=3))
    real = reader.good_parts

    def vanishing(parts: list[Path]) -> list[Path]:
        out = real(parts)
        return [*out, run / schema.TABLE_STEPS / "part-0000009999-000001.parquet"] if out else out

    monkeypatch.setattr(reader, "good_parts", vanishing)
    at = open_page("health", tmp_path, run="live")
    assert at.exception and "part-0000009999-000001.parquet" in at.exception[0].value
