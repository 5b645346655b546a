"""A rank's last batch says why it ends (guard/wire/batch.py `goodbye`); the collector pages a rank
that stops beating without one, however its peers end the run (issue #37), and keeps the run's
status as the job's own meta.json has it (guard/collector/status.py)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from guard.core import schema
from guard.core.heartbeat import HeartbeatConfig
from guard.store.reader import read_meta
from guard.wire.batch import BadRequest, goodbye, parse_batch
from tests.helpers_collector import (
    G1,
    G2,
    batch,
    beat,
    in_process_collectors,
    ingest,
    lost_series,
    make_report,
)

FLOOR_S = 0.6


@pytest.fixture
def inproc(tmp_path: Path) -> Iterator[Any]:
    """In-process collectors over one runs folder (a second one is a restart), closed at the end."""
    with in_process_collectors(tmp_path / "runs") as make:
        yield make


def bye(run: str, rank: int, seq: int, status: str, note: str = "", **extra: Any) -> dict[str, Any]:
    return beat(run, rank, seq, final=True, goodbye=goodbye(status, note), **extra)


def started(c: Any, run: str) -> None:
    """A two-rank run at step 4: rank 0 reports (its meta says running), rank 1 beats."""
    ingest(
        c, batch(run, 0, G1 | 1, [make_report(s) for s in range(5)], meta={"status": schema.STATUS_RUNNING})
    )
    ingest(c, beat(run, 1, G1 | 1, step=4))


def fast(inproc: Any) -> Any:
    return inproc(heartbeat=HeartbeatConfig(floor_s=FLOOR_S, min_intervals=1000))


def test_a_rank_killed_while_its_peer_is_preempted_is_still_paged_by_name(inproc: Any) -> None:
    """torchrun SIGTERMs rank 0 0.2 s after rank 1 died: rank 0 says goodbye (preempted, as it
    may believe), rank 1 says nothing. The run ends as the job says; rank 1 is paged lost."""
    c = fast(inproc)
    started(c, "k")
    note = "SIGTERM (preemption): stopped"
    ingest(c, beat("k", 0, G1 | 2, step=4, meta={"status": schema.STATUS_PREEMPTED, "status_note": note}))
    ingest(c, bye("k", 0, G1 | 3, schema.STATUS_PREEMPTED, note))
    assert set(lost_series(c, "k")) == {"1"}, (
        "the silent rank is still watched; the one that said goodbye is not"
    )
    time.sleep(FLOOR_S + 0.3)
    assert lost_series(c, "k") == {"1": 1.0}
    [r] = c.list_runs()
    assert r.status == schema.STATUS_PREEMPTED and r.ranks[1].lost
    meta = read_meta(c.cfg.runs_dir / "k")
    assert (meta["status"], meta["status_note"]) == (schema.STATUS_PREEMPTED, note)  # the job's own words
    c.close()
    c = fast(inproc)  # a collector restart keeps watching it (state.json) and the run's status
    assert c.list_runs()[0].status == schema.STATUS_PREEMPTED
    time.sleep(FLOOR_S + 0.3)
    assert lost_series(c, "k") == {"1": 1.0}
    # relaunched: rank 1 beats again and is no longer lost; the run trains again
    ingest(c, batch("k", 0, G2 | 1, [make_report(5)]))
    ingest(c, beat("k", 1, G2 | 1, step=5))
    assert lost_series(c, "k") == {"0": 0.0, "1": 0.0} and c.list_runs()[0].status == schema.STATUS_RUNNING


@pytest.mark.parametrize(
    "status",
    [schema.STATUS_PREEMPTED, schema.STATUS_INTERRUPTED, schema.STATUS_FINISHED, schema.STATUS_PEER_LOST],
)
def test_rank_0s_goodbye_is_the_runs_status_in_the_collectors_meta(inproc: Any, status: str) -> None:
    c = inproc()
    started(c, "s")
    note = f"why: {status}"
    ingest(c, beat("s", 1, G1 | 2, final=True, goodbye=goodbye(status, note)))
    ingest(c, beat("s", 0, G1 | 2, step=4, meta={"status": status, "status_note": note}))
    ingest(c, bye("s", 0, G1 | 3, status, note))
    meta = read_meta(c.cfg.runs_dir / "s")
    assert (meta["status"], meta["status_note"]) == (status, note)
    assert c.list_runs()[0].status == status and lost_series(c, "s") == {}  # everyone said goodbye


def test_an_old_exporters_final_without_goodbye_still_finishes_the_run(inproc: Any) -> None:
    c = inproc()
    started(c, "o")
    ingest(c, beat("o", 1, G1 | 2, final=True))
    ingest(c, beat("o", 0, G1 | 2, step=4, final=True))
    assert c.list_runs()[0].status == schema.STATUS_FINISHED and lost_series(c, "o") == {}


def test_a_survivors_peer_lost_ends_the_run_even_when_rank_0_is_the_dead_one(inproc: Any) -> None:
    c = fast(inproc)
    started(c, "p")
    ingest(c, bye("p", 1, G1 | 2, schema.STATUS_PEER_LOST, "a collective failed because a peer rank is gone"))
    meta = read_meta(c.cfg.runs_dir / "p")
    assert meta["status"] == schema.STATUS_PEER_LOST and meta["status_note"].startswith(
        "rank 1: a collective"
    )
    time.sleep(FLOOR_S + 0.3)
    assert lost_series(c, "p") == {"0": 1.0}  # rank 0 said nothing: paged by name
    # a later "preempted" from a rank 0 that was alive after all does not make it a clean stop
    ingest(c, beat("p", 0, G1 | 2, step=4, meta={"status": schema.STATUS_PREEMPTED, "status_note": "x"}))
    ingest(c, bye("p", 0, G1 | 3, schema.STATUS_PREEMPTED, "x"))
    assert read_meta(c.cfg.runs_dir / "p")["status"] == schema.STATUS_PEER_LOST


def test_a_halt_stops_watching_every_rank(inproc: Any) -> None:
    c = fast(inproc)
    started(c, "h")
    ingest(c, bye("h", 0, G1 | 2, schema.STATUS_HALTED, "halted at step 4: operator"))
    assert c.list_runs()[0].status == schema.STATUS_HALTED
    time.sleep(FLOOR_S + 0.3)
    assert lost_series(c, "h") == {}  # RunHalted is the page, not the halted ranks' silence


def test_the_goodbye_field_is_checked() -> None:
    ok = parse_batch(json.dumps(bye("r", 0, 1, schema.STATUS_PREEMPTED, "n")).encode())
    assert ok.goodbye == {"status": schema.STATUS_PREEMPTED, "note": "n"}
    for bad, what in [
        (beat("r", 0, 1, goodbye={"status": "finished"}), "only on a final batch"),
        (beat("r", 0, 1, final=True, goodbye={"status": "gone"}), "'goodbye'"),
        (beat("r", 0, 1, final=True, goodbye={"status": "stale"}), "'goodbye'"),
        (beat("r", 0, 1, final=True, goodbye={"status": "finished", "note": "x" * 501}), "goodbye.note"),
    ]:
        with pytest.raises(BadRequest, match=what):
            parse_batch(json.dumps(bad).encode())
    with pytest.raises(ValueError, match="not one of"):
        goodbye("running-ish")
