"""The collector under damaged run folders, I/O faults and a second writer (issue #13, items 1, 3, 4).

Start-up isolation runs a real collector process on loopback; the fault-injection tests drive an
in-process Collector (no HTTP) so an OS call can fail exactly once inside it.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from guard.collector.service import Collector
from guard.collector.wal import Wal
from guard.core import schema
from guard.runtime.exporter import Exporter, ExporterConfig
from guard.store.layout import part_name
from guard.store.reader import read_meta, read_table
from tests.helpers_collector import (
    AUTH,
    TOKEN,
    CollectorProc,
    batch,
    in_process_collectors,
    make_report,
    wait_steps,
)

G1, G2 = 1_700_000_000 << 32, 1_700_000_100 << 32  # exporter generations (seconds << 32)

# ---------------------------------------------------------------------------------------
# 1. start-up isolates each run
# ---------------------------------------------------------------------------------------
# run -> (damage, expected words in the quarantine reason; None: the run still serves)
DAMAGE: dict[str, tuple[str, str | None]] = {
    "state-garbage": ("state.json holds garbage", "state.json"),
    "state-empty": ("state.json is {}", "state.json"),
    "commands-garbage": ("commands.json holds garbage", "commands.json"),
    "wal-stray": ("a stray wal-abc.log", None),
    "part-folder": ("a folder named like a part file", "named like a part file"),
    "table-file": ("the layers folder replaced by a file", "layers is not a folder"),
    "meta-list": ("meta.json is a JSON list", "meta.json"),
}


def _damage(run_dir: Path, kind: str) -> None:
    st = run_dir / ".collector"
    if kind == "state-garbage":
        (st / "state.json").write_bytes(b"\x00\x01 not json {")
    elif kind == "state-empty":
        (st / "state.json").write_text("{}")
    elif kind == "commands-garbage":
        (st / "commands.json").write_text("[{oops")
    elif kind == "wal-stray":
        (st / "wal-abc.log").write_bytes(b"someone else's file")
    elif kind == "part-folder":
        (run_dir / "steps" / part_name(99, 42)).mkdir()
    elif kind == "table-file":
        for p in (run_dir / "layers").iterdir():
            p.unlink()
        (run_dir / "layers").rmdir()
        (run_dir / "layers").write_text("not a folder")
    elif kind == "meta-list":
        (run_dir / schema.META_FILE).write_text("[1, 2, 3]")
    else:
        raise AssertionError(kind)


def _digest(d: Path, skip: str = "quarantine.json") -> str:
    h = hashlib.sha256()
    for p in sorted(d.rglob("*")):
        if p.name != skip:
            h.update(str(p.relative_to(d)).encode())
            h.update(p.read_bytes() if p.is_file() else b"<dir>")
    return h.hexdigest()


@pytest.mark.integration
def test_damaged_runs_are_quarantined_and_the_rest_serve(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    names = ["good", *DAMAGE]
    c = CollectorProc(runs, "--checkpoint-interval", "0.2", stderr=tmp_path / "collector.log")
    c.start()
    try:
        for run in names:
            r = c.post(batch(run, 0, G1 | 1, [make_report(s) for s in range(5)], meta={"note": run}))
            assert r.status_code == 200, r.text
        c.stop()  # graceful: every run checkpointed, state.json and parts on disk
        for run in DAMAGE:
            _damage(runs / run, run)
        # a store a trainer wrote straight into the collector's folder, never ingested: loaded
        # on its first batch, not at start
        (runs / "late-meta-list").mkdir()
        (runs / "late-meta-list" / schema.META_FILE).write_text('["x"]')
        before = {run: _digest(runs / run) for run in [*DAMAGE, "late-meta-list"]}

        c.start()  # must come up despite all of it
        quarantined = {run for run, (_, why) in DAMAGE.items() if why is not None}
        listing = {r["run"]: r for r in httpx.get(f"{c.url}/v1/runs", timeout=10).json()["runs"]}
        for run, (what, why) in DAMAGE.items():
            nxt = batch(run, 0, G1 | 3, [make_report(5)])
            r = c.post(nxt)
            if why is None:  # tolerated: served as before
                assert r.status_code == 200 and r.json()["duplicate"] is False, (what, r.text)
                assert "quarantined" not in listing[run]
                continue
            assert r.status_code == 503, (what, r.status_code, r.text)
            assert "quarantined" in r.json()["error"] and why in r.json()["error"], (what, r.text)
            assert why in listing[run]["quarantined"], what
            record = json.loads((runs / run / ".collector" / "quarantine.json").read_text())
            assert record["run"] == run and why in record["reason"], what
        # the lazily loaded run: quarantined on its first batch, not overwritten
        r = c.post(batch("late-meta-list", 0, G1 | 1, [make_report(0)]))
        assert r.status_code == 503 and "meta.json" in r.json()["error"]
        quarantined.add("late-meta-list")
        # the healthy run serves: new rows land, old rows are intact
        assert c.post(batch("good", 0, G1 | 3, [make_report(5)])).json()["duplicate"] is False
        assert (
            httpx.get(
                f"{c.url}/v1/runs/good/commands", params={"rank": 0}, headers=AUTH, timeout=10
            ).status_code
            == 200
        )
        assert (
            httpx.get(
                f"{c.url}/v1/runs/meta-list/commands", params={"rank": 0}, headers=AUTH, timeout=10
            ).status_code
            == 503
        )
        assert c.metrics()[("moeguard_collector_quarantined_runs", ())] == len(quarantined)
        assert httpx.get(f"{c.url}/healthz", timeout=10).json()["quarantined"] == len(quarantined)
        c.stop()
        for run in ("good", "wal-stray"):
            assert read_table(runs / run, schema.TABLE_STEPS).sort("step")["step"].to_list() == list(range(6))
        assert (runs / "wal-stray" / ".collector" / "wal-abc.log").read_bytes() == b"someone else's file"
        for run in quarantined:  # nothing of a quarantined run was changed, only the record added
            assert _digest(runs / run) == before[run], run
        log = (tmp_path / "collector.log").read_text()
        for run in quarantined:
            line = next((ln for ln in log.splitlines() if f"run {run}: quarantined" in ln), None)
            assert line is not None and "WARNING" in line, run
        assert "wal-abc.log is not a log segment" in log

        # repaired by hand, the run serves again after a restart, with everything it had
        (runs / "meta-list" / schema.META_FILE).write_text(json.dumps({"run_id": "meta-list"}))
        c.start()
        r = c.post(batch("meta-list", 0, G1 | 3, [make_report(5)]))
        assert r.status_code == 200 and r.json()["duplicate"] is False
        # the late run has no collector state yet: it is tried again on its next batch
        assert c.metrics()[("moeguard_collector_quarantined_runs", ())] == len(
            quarantined - {"meta-list", "late-meta-list"}
        )
        c.stop()
        assert read_table(runs / "meta-list", schema.TABLE_STEPS).sort("step")["step"].to_list() == list(
            range(6)
        )
        assert read_meta(runs / "meta-list")["run_id"] == "meta-list"
    finally:
        c.stop()


# ---------------------------------------------------------------------------------------
# 3. ingest is all or nothing, durable before the 2xx
# ---------------------------------------------------------------------------------------
def _halt_row(step: int) -> dict:
    return {"step": step, "kind": schema.EV_HALT, "action": schema.ACT_HALT, "detail": {"reason": "drill"}}


def _eight_steps(seq: int = G1 | 1) -> bytes:
    """8 steps, a halt event at the last one and a meta: every kind of thing a batch stores."""
    return json.dumps(
        batch("io", 0, seq, [make_report(s) for s in range(8)], [_halt_row(7)], meta={"owner": "team-a"})
    ).encode()


@pytest.fixture
def app(tmp_path: Path) -> Iterator[Callable[[], Collector]]:
    """make() -> an in-process collector (no HTTP) that checkpoints only when asked, or on close."""
    with in_process_collectors(tmp_path / "runs", checkpoint_interval_s=3600) as make:
        yield make


def _fail_once(monkeypatch: pytest.MonkeyPatch, name: str, when: Callable[..., bool]) -> list[int]:
    """os.<name> raises EIO once, on the first call for which `when(*args)` holds."""
    real, hits = getattr(os, name), []

    def flaky(*args: object, **kw: object) -> object:
        if not hits and when(*args):
            hits.append(1)
            raise OSError(errno.EIO, f"injected: {name} failed")
        return real(*args, **kw)

    monkeypatch.setattr(os, name, flaky)
    return hits


@dataclass
class Answer:
    status_code: int
    body: dict[str, Any]

    def json(self) -> dict[str, Any]:
        return self.body


def _post(c: Collector, body: bytes) -> Answer:
    """What POST /v1/ingest answers (build_app sends exactly this status and body)."""
    return Answer(*c.ingest(body))


def _stored(run_dir: Path) -> tuple[list[int], list[tuple[int, str]]]:
    steps = sorted(read_table(run_dir, schema.TABLE_STEPS)["step"].to_list())
    events = sorted(read_table(run_dir, schema.TABLE_EVENTS).select("step", "kind").rows())
    return steps, events


def test_log_write_failure_stores_nothing_and_the_retry_stores_once(
    app: Callable[[], Collector], monkeypatch: pytest.MonkeyPatch
) -> None:
    c = app()
    hits = _fail_once(monkeypatch, "fdatasync", lambda fd: True)  # the log append is not durable
    r = _post(c, _eight_steps())
    assert hits and r.status_code == 503 and "nothing stored" in r.json()["error"]
    assert _post(c, _eight_steps()).json()["duplicate"] is False  # the exporter's retry
    assert _post(c, _eight_steps()).json()["duplicate"] is True  # and a retry of that
    rs = c.runs["io"]
    assert [r.step for r in rs.pending_reports] == list(range(8)) and len(rs.pending_events) == 1
    # a SIGKILL now (no checkpoint): the log alone must give one copy of everything
    c.stop_event.set()
    for state in c.runs.values():
        state.journal.close()
    c2 = app()
    c2.close()
    assert _stored(c.cfg.runs_dir / "io") == (list(range(8)), [(7, schema.EV_HALT)])
    assert read_meta(c.cfg.runs_dir / "io")["status"] == schema.STATUS_HALTED


def test_meta_write_failure_after_the_commit_answers_stored_and_retries_are_duplicates(
    app: Callable[[], Collector], monkeypatch: pytest.MonkeyPatch
) -> None:
    c = app()
    run_dir = c.cfg.runs_dir / "io"
    hits = _fail_once(monkeypatch, "replace", lambda src, dst: Path(dst).name == schema.META_FILE)
    r = _post(c, _eight_steps())
    assert hits and r.status_code == 200 and r.json()["duplicate"] is False  # in the log: stored
    for _ in range(2):  # the answer was lost: the exporter sends it again
        assert _post(c, _eight_steps()).json()["duplicate"] is True
    assert c.list_runs()[0].status == schema.STATUS_HALTED
    c.runs["io"].checkpoint()  # meta.json is written before the log is let go
    assert read_meta(run_dir)["owner"] == "team-a" and read_meta(run_dir)["status"] == schema.STATUS_HALTED
    assert _stored(run_dir) == (list(range(8)), [(7, schema.EV_HALT)])
    c.close()
    assert _stored(run_dir) == (list(range(8)), [(7, schema.EV_HALT)])


def test_meta_failure_at_checkpoint_postpones_it_and_loses_nothing(
    app: Callable[[], Collector], monkeypatch: pytest.MonkeyPatch
) -> None:
    c = app()
    run_dir = c.cfg.runs_dir / "io"
    rs = c.run_state("io")
    # the meta write after the commit fails, and again at the first checkpoint
    real, calls = os.replace, []

    def flaky(src: object, dst: object) -> None:
        if Path(str(dst)).name == schema.META_FILE and len(calls) < 2:
            calls.append(dst)
            raise OSError(errno.ENOSPC, "injected: disk full")
        real(src, dst)

    monkeypatch.setattr(os, "replace", flaky)
    assert _post(c, _eight_steps()).status_code == 200
    rs.checkpoint()  # postponed: nothing committed, the run still serves
    assert rs.failed is None and rs.journal.segment_done == 0 and len(rs.pending_reports) == 8
    more = batch("io", 0, G1 | 2, [make_report(s) for s in range(8, 12)])
    assert _post(c, json.dumps(more).encode()).json()["duplicate"] is False
    rs.checkpoint()
    assert len(calls) == 2 and rs.failed is None and not rs.pending_reports
    assert read_meta(run_dir)["owner"] == "team-a"
    c.close()
    assert _stored(run_dir) == (list(range(12)), [(7, schema.EV_HALT)])


def test_truncation_failure_for_a_resumed_trainer_is_redone_on_retry(
    app: Callable[[], Collector], monkeypatch: pytest.MonkeyPatch
) -> None:
    c = app()
    run_dir = c.cfg.runs_dir / "rt"
    body = json.dumps(batch("rt", 0, G1 | 1, [make_report(s, loss=1.0) for s in range(20)])).encode()
    assert _post(c, body).status_code == 200
    c.runs["rt"].checkpoint()
    more = batch("rt", 0, G1 | 2, [make_report(s, loss=1.0) for s in range(20, 30)])
    assert _post(c, json.dumps(more).encode()).status_code == 200
    # the trainer resumes from step 15: stored steps 15..19 and pending 20..29 are re-run
    resumed = json.dumps(batch("rt", 0, G2 | 1, [make_report(s, loss=2.0) for s in range(15, 25)])).encode()
    hits = _fail_once(monkeypatch, "replace", lambda src, dst: Path(dst).name.startswith("part-"))
    assert _post(c, resumed).status_code == 503 and hits
    assert len(c.runs["rt"].pending_reports) == 10  # nothing of the batch applied
    assert _post(c, resumed).json()["duplicate"] is False
    c.close()
    df = read_table(run_dir, schema.TABLE_STEPS).sort("step")
    assert df["step"].to_list() == list(range(25))
    assert df["loss"].to_list() == [1.0] * 15 + [2.0] * 10


def test_a_failed_log_append_never_hides_later_records(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_write, real_trunc = os.write, os.ftruncate

    def half_write(fd: int, data: bytes) -> int:
        real_write(fd, data[: len(data) // 2])  # torn: half a record reaches the file
        raise OSError(errno.EIO, "injected: write failed")

    def no_trunc(fd: int, n: int) -> None:
        raise OSError(errno.EIO, "injected: ftruncate failed")

    for cut_fails in (False, True):  # the torn half is cut off; or, when that fails too, left behind
        d = tmp_path / f"wal-{cut_fails}"
        d.mkdir()
        wal = Wal(d)
        wal.append(b"A" * 100)
        monkeypatch.setattr(os, "write", half_write)
        if cut_fails:
            monkeypatch.setattr(os, "ftruncate", no_trunc)
        with pytest.raises(OSError):
            wal.append(b"B" * 100)
        monkeypatch.setattr(os, "write", real_write)
        monkeypatch.setattr(os, "ftruncate", real_trunc)
        wal.append(b"C" * 100)
        wal.close()
        recs = [rec for seg in Wal(d).segments() for rec in Wal(d).read(seg)]
        assert recs == [b"A" * 100, b"C" * 100], cut_fails
        assert len(Wal(d).segments()) == (2 if cut_fails else 1)


# ---------------------------------------------------------------------------------------
# 4. two writers on one run id
# ---------------------------------------------------------------------------------------
def _force_generation(spool: Path, run: str, gen: int) -> None:
    """The next Exporter for `run` rank 0 in `spool` gets generation `gen` (it takes last + 1)."""
    spool.mkdir(parents=True, exist_ok=True)
    (spool / f"{run}-r0-generation").write_text(str(gen - 1))


@pytest.mark.integration
def test_a_second_writer_is_refused_loudly_and_no_stored_row_is_lost(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    c = CollectorProc(tmp_path / "runs", "--checkpoint-interval", "0.2").start()
    run_dir = c.runs / "two"
    try:
        a = Exporter(c.url, TOKEN, "two", 0, tmp_path / "spool-a", ExporterConfig(batch_max=5, poll_s=60))
        for s in range(50):
            a.submit(make_report(s, loss=1.0))
        assert a.flush(20)
        assert wait_steps(run_dir, 50).height == 50
        # a second trainer, started later with the same run id, from step 0 (another experiment)
        _force_generation(tmp_path / "spool-b", "two", a.generation + 10)
        b = Exporter(c.url, TOKEN, "two", 0, tmp_path / "spool-b", ExporterConfig(batch_max=5, poll_s=60))
        for s in range(10):
            b.submit(make_report(s, loss=2.0))
        assert b.flush(20)
        # the first trainer goes on: every batch is refused with 409, set aside, not counted delivered
        with caplog.at_level(logging.DEBUG, logger="moeguard.exporter"):
            for s in range(50, 60):
                a.submit(make_report(s, loss=1.0))
            assert a.flush(20) is False
            assert a.close(10) is False
        errors = [r for r in caplog.records if r.name == "moeguard.exporter" and r.levelno >= logging.ERROR]
        assert len(errors) == 1, [r.getMessage() for r in errors]  # once per run, not per batch
        msg = errors[0].getMessage()
        assert "409" in msg and "'two'" in msg and "generation conflict" in msg and str(a.generation) in msg
        conflicted = sorted((tmp_path / "spool-a" / "conflict").glob("*.json"))
        assert a.stats["conflict"] == len(conflicted) >= 1
        refused = [rep["step"] for p in conflicted for rep in json.loads(p.read_bytes())["reports"]]
        assert sorted(refused) == list(range(50, 60))
        assert b.close(10)
        c.stop()
        live = read_table(run_dir, schema.TABLE_STEPS).sort("step")
        assert live["step"].to_list() == list(range(10)) and set(live["loss"].to_list()) == {2.0}
        # the first trainer's 50 rows were moved aside, not deleted
        [kept] = list((run_dir / ".collector" / "superseded").iterdir())
        old = read_table(kept, schema.TABLE_STEPS).sort("step")
        assert old["step"].to_list() == list(range(50)) and set(old["loss"].to_list()) == {1.0}
        assert read_table(kept, schema.TABLE_EXPERTS).height == 50 * 2 * 8
    finally:
        c.stop()


def test_generations_retries_and_writers(app: Callable[[], Collector]) -> None:
    c = app()

    def post(seq: int, steps: range, writer: str | None = "w1", **kw: Any) -> Answer:
        extra = {"writer": writer} if writer else {}
        return _post(
            c, json.dumps(batch("gw", 0, seq, [make_report(s) for s in steps], **extra, **kw)).encode()
        )

    assert post(G1 | 1, range(0, 5)).json()["duplicate"] is False
    assert post(G1 | 2, range(5, 10)).json()["duplicate"] is False
    # same generation, another process (both started within one second): refused, whatever its seq
    for seq in (G1 | 3, G1 | 1, G1 | 99):
        r = post(seq, range(10, 15), writer="w2")
        assert (
            r.status_code == 409
            and "generation conflict" in r.json()["error"]
            and "'gw'" in r.json()["error"]
        )
        assert r.json()["conflict"] == {
            "run": "gw",
            "rank": 0,
            "generation": G1 >> 32,
            "current_generation": G1 >> 32,
        }
    # a restarted trainer (new generation) takes over; the old one's stored batches stay duplicates
    assert post(G2 | 1, range(10, 15), writer="w3").json()["duplicate"] is False
    assert post(G1 | 2, range(5, 10)).json()["duplicate"] is True  # a late retry of a stored batch
    r = post(G1 | 3, range(10, 15))  # the old writer is still running
    assert r.status_code == 409 and r.json()["conflict"]["current_generation"] == G2 >> 32
    assert post(G2 | 2, range(15, 20), writer="w3").json()["duplicate"] is False
    assert post(G2 | 3, range(20, 25), writer=None).json()["duplicate"] is False  # an exporter without ids
    c.close()
    c = app()  # the marks survive a restart
    assert post(G1 | 2, range(5, 10)).json()["duplicate"] is True
    assert post(G1 | 4, range(10, 15)).status_code == 409
    c.close()
    steps = read_table(c.cfg.runs_dir / "gw", schema.TABLE_STEPS)["step"].to_list()
    assert sorted(steps) == list(range(25))


# Fixed ids: the last value is computed from the clock at collection, and pytest-xdist refuses a
# run whose workers collected different test ids (two workers collecting a second apart did).
@pytest.mark.parametrize(
    "seq",
    [-1, 2**63 - 1, 2**63, 2**64, (int(time.time()) + 7200) << 32],
    ids=["negative", "int64-max", "2^63", "2^64", "generation-2h-ahead"],
)
def test_out_of_range_seq_is_a_400_and_blocks_nothing(app: Callable[[], Collector], seq: int) -> None:
    c = app()
    status, ans = c.ingest(json.dumps(batch("sq", 0, seq, [make_report(0)])).encode())
    assert status == 400 and "'seq'" in ans["error"], ans
    real = (int(time.time()) << 32) | 1
    assert _post(c, json.dumps(batch("sq", 0, real, [make_report(0)])).encode()).json()["duplicate"] is False
    assert (
        _post(c, json.dumps(batch("sq", 0, real + 1, [make_report(1)])).encode()).json()["duplicate"] is False
    )


def test_a_resume_keeps_the_rows_it_replaces(app: Callable[[], Collector]) -> None:
    c = app()
    run_dir = c.cfg.runs_dir / "rz"
    halt = _halt_row(45)
    assert _post(
        c, json.dumps(batch("rz", 0, G1 | 1, [make_report(s, loss=1.0) for s in range(40)])).encode()
    )
    c.runs["rz"].checkpoint()
    body = batch("rz", 0, G1 | 2, [make_report(s, loss=1.0) for s in range(40, 50)], [halt])
    assert _post(c, json.dumps(body).encode()).status_code == 200  # pending, not yet in a part
    resumed = batch("rz", 0, G2 | 1, [make_report(s, loss=2.0) for s in range(30, 35)])
    assert _post(c, json.dumps(resumed).encode()).status_code == 200
    c.close()
    live = read_table(run_dir, schema.TABLE_STEPS).sort("step")
    assert live["step"].to_list() == list(range(35))
    assert live["loss"].to_list() == [1.0] * 30 + [2.0] * 5
    [kept] = list((run_dir / ".collector" / "superseded").iterdir())
    old = read_table(kept, schema.TABLE_STEPS).sort("step")
    assert old["step"].to_list() == list(range(30, 50)) and set(old["loss"].to_list()) == {1.0}
    assert read_table(kept, schema.TABLE_EVENTS).select("step", "kind").rows() == [(45, schema.EV_HALT)]
    assert read_table(kept, schema.TABLE_LAYERS).height == 20 * 4
