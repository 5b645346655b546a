"""A killed rank 0 cannot record how the run ended; a survivor does it for it (issue #37): the job's
meta.json said `running` (the app showed it stale) while the collector's copy said `peer_lost` from
the survivor's goodbye. RunRecord.finish on a surviving rank, with the job's c10d store played by
an in-process HashStore; the real kill -9 under torchrun is drilled by
tests/integration/test_paging_drills.py."""

from __future__ import annotations

import functools
import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from guard.core import schema
from guard.runtime import goodbye, record
from guard.runtime.record import RunRecord
from guard.store.reader import read_meta
from guard.store.runstore import RunStore

WAIT_S = 0.3  # rank0_gone's wait, short for the tests (GOODBYE_WAIT_S in a job)


class Exporter:
    """Records the goodbye the rank's final batch would carry."""

    def __init__(self) -> None:
        self.bye: dict[str, str] | None = None

    def close(self, timeout: float = 30, final: bool | None = None, goodbye: dict | None = None) -> bool:
        self.bye = goodbye
        return True

    def set_meta(self, meta: dict[str, Any]) -> None:
        pass

    def add_side(self, table: str, row: dict[str, Any]) -> None:
        pass


@pytest.fixture
def store(monkeypatch: pytest.MonkeyPatch) -> dist.Store:
    s = dist.PrefixStore("attempt0/", dist.HashStore())
    monkeypatch.setattr(record, "default_store", lambda: s)
    monkeypatch.setattr(record, "rank0_gone", functools.partial(goodbye.rank0_gone, wait_s=WAIT_S))
    return s


def run_dir(tmp_path: Path, status: str = schema.STATUS_RUNNING) -> Path:
    d = tmp_path / "run-a"
    d.mkdir()
    meta = {"run_id": d.name, "status": status, "framework": "pytorch", "restarts": 1}
    (d / schema.META_FILE).write_text(json.dumps(meta))
    return d


NOTE = "stopped during step 7: a collective failed because a peer rank is gone: Connection reset by peer"


def test_a_survivor_records_peer_lost_for_a_dead_rank0_as_the_collector_does(
    tmp_path: Path, store: dist.Store
) -> None:
    d = run_dir(tmp_path)
    exp = Exporter()
    RunRecord(d, None, exp, rank=1).finish(schema.STATUS_PEER_LOST, NOTE, final_step=7)
    meta = read_meta(d)
    assert meta is not None and meta["status"] == schema.STATUS_PEER_LOST
    assert exp.bye is not None and exp.bye["status"] == schema.STATUS_PEER_LOST
    assert exp.bye["note"].startswith("rank 0 is gone") and exp.bye["note"].endswith(NOTE)
    # the collector writes a non-zero rank's goodbye as "rank N: <note>": the same words here
    assert meta["status_note"] == f"rank 1: {exp.bye['note']}"
    assert meta["status_by_rank"] == 1
    assert (meta["framework"], meta["restarts"]) == ("pytorch", 1)  # the rest of rank 0's document kept
    assert not list(d.glob(".*tmp*"))  # written whole (write-rename), nothing left beside it


@pytest.mark.parametrize("status", [schema.STATUS_PREEMPTED, schema.STATUS_HALTED, schema.STATUS_FINISHED])
def test_an_ending_rank0_wrote_is_left_as_it_is(tmp_path: Path, store: dist.Store, status: str) -> None:
    d = run_dir(tmp_path, status)
    before = (d / schema.META_FILE).read_text()
    exp = Exporter()
    RunRecord(d, None, exp, rank=1).finish(schema.STATUS_PEER_LOST, NOTE)
    assert (d / schema.META_FILE).read_text() == before
    assert exp.bye == {"status": schema.STATUS_PEER_LOST, "note": NOTE}


@pytest.mark.parametrize("said", ["ending", "goodbye"])
def test_a_live_rank0_records_its_own_ending(tmp_path: Path, store: dist.Store, said: str) -> None:
    """Rank 0 began recording its ending, or said goodbye on a SIGTERM: it is alive and writes
    meta.json itself; the survivor neither writes nor names it."""
    d = run_dir(tmp_path)
    if said == "ending":
        goodbye.say_ending(0, store)
    else:
        goodbye.Goodbyes(0, 2, store).say()
    exp = Exporter()
    RunRecord(d, None, exp, rank=1).finish(schema.STATUS_PEER_LOST, NOTE)
    assert read_meta(d)["status"] == schema.STATUS_RUNNING
    assert exp.bye == {"status": schema.STATUS_PEER_LOST, "note": NOTE}


def test_rank0_says_it_records_its_ending(tmp_path: Path, store: dist.Store) -> None:
    d = tmp_path / "run-b"
    rs = RunStore(d)
    rec = RunRecord(d, rs, None, rank=0)
    rec.started({"run_id": d.name, "status": schema.STATUS_RUNNING}, restarted=False)
    assert not store.check(["moeguard/ended/0"])
    rec.finish(schema.STATUS_PEER_LOST, "rank 1 said no goodbye")
    assert store.check(["moeguard/ended/0"])
    assert read_meta(d)["status"] == schema.STATUS_PEER_LOST


def test_a_survivor_on_another_host_only_names_rank0_to_the_collector(
    tmp_path: Path, store: dist.Store
) -> None:
    """No shared filesystem: the run's folder here has no meta.json (rank 0's is on its own host)."""
    d = tmp_path / "run-c"
    d.mkdir()
    exp = Exporter()
    RunRecord(d, None, exp, rank=1).finish(schema.STATUS_PEER_LOST, NOTE)
    assert read_meta(d) is None and not list(d.iterdir())
    assert exp.bye is not None and exp.bye["note"].startswith("rank 0 is gone")


def test_only_a_peer_lost_ending_asks_after_rank0(tmp_path: Path, store: dist.Store) -> None:
    d = run_dir(tmp_path)
    exp = Exporter()
    RunRecord(d, None, exp, rank=1).finish(schema.STATUS_PREEMPTED, "SIGTERM (preemption)")
    assert read_meta(d)["status"] == schema.STATUS_RUNNING
    assert exp.bye == {"status": schema.STATUS_PREEMPTED, "note": "SIGTERM (preemption)"}


class DeadStore:
    """The store lived with rank 0 (a launcher without an agent): every call fails."""

    def check(self, keys: list[str]) -> bool:
        raise RuntimeError("Connection reset by peer")


def test_rank0_gone_answers() -> None:
    s = dist.HashStore()
    assert goodbye.rank0_gone(s, wait_s=0.1)
    assert not goodbye.rank0_gone(s, wait_s=0.1, recorded=lambda: True)
    goodbye.say_ending(1, s)  # another rank's ending says nothing of rank 0
    assert goodbye.rank0_gone(s, wait_s=0.1)
    goodbye.say_ending(0, s)
    assert not goodbye.rank0_gone(s, wait_s=0.1)
    t0 = time.monotonic()
    assert goodbye.rank0_gone(DeadStore(), wait_s=10)
    assert time.monotonic() - t0 < 5  # at once, not after the wait
    goodbye.say_ending(0, None)  # no process group: nothing to say, no error
