"""Evaluations and host samples reach the collector (issue #40): they ride on the ingest batch
(guard/wire/batch.py `evals`, `host`) and the collector stores them in its copy of the run, so the
app on the collector's store shows the eval line and the host chart as on the trainer's own."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

from dashboards.data import config
from guard.core import schema
from guard.runtime.exporter import Exporter
from guard.runtime.record import RunRecord
from guard.store.reader import read_table
from guard.store.runstore import RunStore
from guard.wire.batch import BadRequest, Batch, encode_batch, parse_batch
from tests.dashboards.app_helpers import chart_titled, traces
from tests.dashboards.conftest import APP
from tests.helpers_collector import TOKEN, CollectorProc, make_report

HOST_ROW = {
    "step": 3,
    "time": 1.7e9,
    "cpu_pct": 97.5,
    "rss_bytes": 2 << 30,
    "host_mem_used_bytes": 6 << 30,
    "host_mem_total_bytes": 16 << 30,
    "gpu_util_pct": None,
    "gpu_mem_used_bytes": None,
}


def test_side_rows_round_trip_on_the_wire() -> None:
    ev = {"step": 9, "time": 1.7e9, "name": "eval_loss", "value": 2.5}
    b = Batch(run="r", rank=0, seq=1, side={schema.TABLE_EVALS: [ev], schema.TABLE_HOST: [HOST_ROW]})
    got = parse_batch(encode_batch(b))
    assert got.side == {schema.TABLE_EVALS: [ev], schema.TABLE_HOST: [HOST_ROW]}
    # a batch without them is as before (no key on the wire)
    assert "evals" not in json.loads(encode_batch(Batch(run="r", rank=0, seq=2)))
    # a missing value column is null; unknown keys are ignored
    got = parse_batch(json.dumps({"run": "r", "rank": 0, "seq": 3, "host": [{"step": 1, "x": 1}]}).encode())
    assert got.side[schema.TABLE_HOST][0]["cpu_pct"] is None


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"rank": 1, "evals": [{"step": 1, "name": "a", "value": 1.0}]}, "only rank 0"),
        ({"evals": [{"name": "a", "value": 1.0}]}, "evals[0]: missing field 'step'"),
        ({"evals": [{"step": 1, "value": 1.0}]}, "evals[0].name"),
        ({"evals": [{"step": 1, "name": "a", "value": "high"}]}, "evals[0].value"),
        ({"host": [{"step": 1, "rss_bytes": 1.5}]}, "host[0].rss_bytes"),
        ({"host": {"step": 1}}, "field 'host': expected a list"),
    ],
)
def test_bad_side_rows_are_refused_by_name(extra: dict, says: str) -> None:
    with pytest.raises(BadRequest, match=says.replace("[", r"\[").replace("]", r"\]")):
        parse_batch(json.dumps({"run": "r", "rank": 0, "seq": 1, **extra}).encode())


@pytest.mark.integration
def test_evals_and_host_samples_land_in_the_collectors_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A trainer's RunRecord (its own store and the real exporter) against the real collector on
    loopback: the collector's copy of the run has the evaluation rows and host samples, and Run
    health on the collector's store draws the eval line and the host chart."""
    monkeypatch.setenv("MOEGUARD_HOST_EVERY_S", "0.05")
    c = CollectorProc(tmp_path / "collector-runs", "--checkpoint-interval", "0.2").start()
    try:
        run_dir = tmp_path / "trainer-runs" / "side"
        store = RunStore(run_dir)
        exp = Exporter(c.url, TOKEN, "side", 0, tmp_path / "spool")
        rec = RunRecord(run_dir, store, exp, rank=0)
        rec.started({"run_id": "side", "status": schema.STATUS_RUNNING}, restarted=False)
        rec.announce(lambda: {"run_id": "side"})
        for s in range(20):
            rec.step(make_report(s), [])
            time.sleep(0.01)  # the host sampler takes a few samples
            if s in (9, 19):
                rec.evals(s, time.time(), {"eval_loss": 3.0 - 0.1 * s, "eval_accuracy": 0.5})
        assert rec.host is not None
        rec.host.close()
        rec.host = None
        assert exp.close(20), exp.stats
        store.close(status=schema.STATUS_FINISHED)
    finally:
        c.stop()  # the final checkpoint: every pending row in parts
    mine, theirs = run_dir, c.runs / "side"
    for table in (schema.TABLE_EVALS, schema.TABLE_HOST):
        a = read_table(mine, table).sort("step", "time")
        b = read_table(theirs, table).sort("step", "time")
        assert b.height == a.height > 0, table
        assert b.columns == list(schema.TABLE_COLUMNS[table])
        assert b.equals(a.select(b.columns)), table
    ev = read_table(theirs, schema.TABLE_EVALS)
    assert sorted(set(ev["step"].to_list())) == [9, 19] and set(ev["name"]) == {"eval_loss", "eval_accuracy"}

    # Run health on the collector's store
    monkeypatch.setenv(config.ENV_RUNS, str(c.runs))
    monkeypatch.delenv(config.ENV_HISTORY, raising=False)
    at = AppTest.from_file(str(APP), default_timeout=60).run()
    at.switch_page("page_health.py")
    at.query_params["run"] = "side"
    at.run()
    assert not at.exception, at.exception
    loss = chart_titled(at, "Loss and grad norm")
    assert [round(v, 6) for v in traces(loss, "eval_loss")[0]["y"]] == [2.1, 1.1]
    assert chart_titled(at, "Host utilisation")["data"]
