"""The collector's account of a run's life, in-process (Collector without HTTP): a halt latches
until the run resumes, a final batch ends its heartbeats, the trainer's meta.json status ends it,
and only a new process resumes it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from guard.core import schema
from guard.core.events import Event
from guard.store.reader import read_meta, read_table
from guard.wire.batch import BadRequest, parse_batch
from tests.helpers_collector import (
    G1,
    G2,
    G3,
    batch,
    beat,
    halt_row,
    halted,
    in_process_collectors,
    ingest,
    lost_series,
    make_report,
)


@pytest.fixture
def inproc(tmp_path: Path) -> Iterator[Any]:
    with in_process_collectors(tmp_path / "runs") as make:
        yield make


def test_halt_latches_until_the_run_resumes_and_a_later_halt_latches_again(inproc: Any) -> None:
    c = inproc()
    ingest(c, batch("h", 0, G1 | 1, [make_report(s) for s in range(10)], [halt_row(9)]))
    assert halted(c, "h") == 1 and c.list_runs()[0].status == schema.STATUS_HALTED
    # the restarted exporter beats before its first step: not yet a resume (no reports)
    ingest(c, beat("h", 0, G2 | 1, step=9))
    assert halted(c, "h") == 1
    # `moeguard train --resume`: rank 0 reports of a new generation clear the latch
    ingest(c, batch("h", 0, G2 | 2, [make_report(s) for s in range(10, 15)]))
    assert halted(c, "h") == 0 and c.list_runs()[0].status == schema.STATUS_RUNNING
    ingest(c, batch("h", 0, G2 | 3, [make_report(15)], [halt_row(15)]))
    assert halted(c, "h") == 1
    c.close()
    c = inproc()  # a restarted collector rebuilds the latch from meta.json and the events
    assert halted(c, "h") == 1
    # a trainer that sends its own resume event: that clears it, and no second one is recorded
    own = Event(step=16, kind=schema.EV_RESUME, detail={"checkpoint": "step-16"}).row()
    ingest(c, batch("h", 0, G3 | 1, [make_report(16)], [own]))
    assert halted(c, "h") == 0
    c.close()
    ev = read_table(c.cfg.runs_dir / "h", schema.TABLE_EVENTS).sort("step")
    assert ev.select("step", "kind").rows() == [(9, "halt"), (10, "resume"), (15, "halt"), (16, "resume")]
    assert json.loads(ev["detail"][1])["source"] == "collector"
    assert "source" not in json.loads(ev["detail"][3])
    c = inproc()
    assert halted(c, "h") == 0 and c.list_runs()[0].status == schema.STATUS_RUNNING


def test_a_resume_and_a_new_halt_in_one_batch_end_halted(inproc: Any) -> None:
    c = inproc()
    ingest(c, batch("hh", 0, G1 | 1, [make_report(s) for s in range(5)], [halt_row(4)]))
    ingest(c, batch("hh", 0, G2 | 1, [make_report(s) for s in range(5, 8)], [halt_row(7)]))
    assert halted(c, "hh") == 1
    c.close()
    assert read_table(c.cfg.runs_dir / "hh", schema.TABLE_EVENTS).sort("step")["kind"].to_list() == [
        "halt",
        "resume",
        "halt",
    ]
    assert halted(inproc(), "hh") == 1


def test_final_batch_ends_heartbeats_and_finishes_the_run(inproc: Any) -> None:
    c = inproc()
    ingest(c, batch("f", 0, G1 | 1, [make_report(s) for s in range(5)]))
    ingest(c, beat("f", 1, G1 | 1))
    assert set(lost_series(c, "f")) == {"0", "1"}
    ingest(c, beat("f", 1, G1 | 2, final=True))  # rank 1 stopped on purpose
    assert set(lost_series(c, "f")) == {"0"}
    ingest(c, beat("f", 0, G1 | 2, step=4, final=True))
    assert lost_series(c, "f") == {}
    [r] = c.list_runs()
    assert r.status == schema.STATUS_FINISHED and r.ranks == {}
    assert read_meta(c.cfg.runs_dir / "f")["status"] == schema.STATUS_FINISHED
    c.close()
    c = inproc()  # nothing comes back after a restart
    assert lost_series(c, "f") == {} and c.list_runs()[0].status == schema.STATUS_FINISHED
    # resumed later (e.g. it had stopped at --until): watched again, running again
    ingest(c, batch("f", 0, G2 | 1, [make_report(5)]))
    assert lost_series(c, "f") == {"0": 0.0} and c.list_runs()[0].status == schema.STATUS_RUNNING


def test_trainer_meta_status_ends_the_run_but_only_a_new_process_resumes_it(inproc: Any) -> None:
    c = inproc()
    ingest(c, batch("ms", 0, G1 | 1, [make_report(s) for s in range(5)], [halt_row(4)]))
    ingest(c, beat("ms", 1, G1 | 1))
    # the halted trainer saves a checkpoint and sends its store's meta, which still says running
    ingest(c, beat("ms", 0, G1 | 2, step=4, meta={"status": schema.STATUS_RUNNING, "goodput": {}}))
    ingest(c, beat("ms", 0, G1 | 3, step=4, meta={"status": schema.STATUS_HALTED}))
    assert halted(c, "ms") == 1 and lost_series(c, "ms") == {}
    assert read_meta(c.cfg.runs_dir / "ms")["status"] == schema.STATUS_HALTED
    # the resumed trainer: its meta says running before the first step; its reports resume the run
    ingest(c, beat("ms", 0, G2 | 1, step=4, meta={"status": schema.STATUS_RUNNING}))
    assert halted(c, "ms") == 1
    ingest(c, batch("ms", 0, G2 | 2, [make_report(s) for s in range(5, 9)]))
    ingest(c, beat("ms", 1, G2 | 1))
    assert halted(c, "ms") == 0 and set(lost_series(c, "ms")) == {"0", "1"}
    # the end of the run, told by meta alone: finished, but only a rank's own final batch stops
    # the collector watching it (issue #37: a rank that never says goodbye is lost)
    ingest(c, beat("ms", 0, G2 | 3, step=8, meta={"status": schema.STATUS_FINISHED}))
    assert set(lost_series(c, "ms")) == {"0", "1"} and c.list_runs()[0].status == schema.STATUS_FINISHED
    ingest(c, beat("ms", 1, G2 | 2, final=True))
    ingest(c, beat("ms", 0, G2 | 4, step=8, final=True))
    assert lost_series(c, "ms") == {} and c.list_runs()[0].status == schema.STATUS_FINISHED
    c.close()
    ev = read_table(c.cfg.runs_dir / "ms", schema.TABLE_EVENTS).sort("step")
    assert ev.select("step", "kind").rows() == [(4, "halt"), (5, "resume")]
    assert halted(inproc(), "ms") == 0


def test_halted_run_is_not_watched_for_heartbeats(inproc: Any) -> None:
    c = inproc()
    ingest(c, batch("hb2", 0, G1 | 1, [make_report(0)]))
    ingest(c, beat("hb2", 1, G1 | 1))
    ingest(c, batch("hb2", 0, G1 | 2, [make_report(1)], [halt_row(1)]))
    assert lost_series(c, "hb2") == {}  # RunHalted is the page; silence is expected now
    ingest(c, beat("hb2", 1, G1 | 2))  # a rank that has not stopped yet
    assert lost_series(c, "hb2") == {}


def test_heartbeat_before_the_first_step_does_not_hide_a_resume(inproc: Any) -> None:
    c = inproc()
    ingest(c, batch("rr", 0, G1 | 1, [make_report(s, loss=1.0) for s in range(20)]))
    ingest(c, beat("rr", 0, G2 | 1, step=9))  # the resumed trainer is still loading its checkpoint
    ingest(c, batch("rr", 0, G2 | 2, [make_report(s, loss=2.0) for s in range(10, 15)]))
    c.close()
    df = read_table(c.cfg.runs_dir / "rr", schema.TABLE_STEPS).sort("step")
    assert df["step"].to_list() == list(range(15))
    assert df["loss"].to_list() == [1.0] * 10 + [2.0] * 5


def test_parse_batch_final_flag() -> None:
    assert parse_batch(json.dumps(beat("r", 0, 1, final=True)).encode()).final is True
    assert parse_batch(json.dumps(beat("r", 0, 1)).encode()).final is False
    with pytest.raises(BadRequest, match="'final'"):
        parse_batch(json.dumps(beat("r", 0, 1, final="yes")).encode())
