"""The collector under damaged run folders, I/O faults and a second writer (issue #13, items 1, 3, 4).

Start-up isolation runs a real collector process on loopback; the fault-injection tests drive an
in-process Collector (no HTTP) so an OS call can fail exactly once inside it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import httpx
import pytest

from guard import schema
from guard.runstore import part_name, read_meta, read_table
from tests.guard.test_collector import CollectorProc, batch, make_report

G1 = 1_700_000_000 << 32  # exporter generations (seconds << 32)

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
        assert httpx.get(f"{c.url}/v1/runs/good/commands", params={"rank": 0}, timeout=10).status_code == 200
        assert (
            httpx.get(f"{c.url}/v1/runs/meta-list/commands", params={"rank": 0}, timeout=10).status_code
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
