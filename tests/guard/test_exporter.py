"""Exporter against a real collector (spool, replay, spill, commands) and OtelExporter with the
SDK's in-memory reader."""

from __future__ import annotations

import json
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from guard.core import schema
from guard.core.events import Event
from guard.runtime.export_spool import Spool
from guard.runtime.exporter import Exporter, ExporterConfig
from guard.runtime.otel import OtelExporter
from guard.store.reader import read_table
from guard.wire.batch import GEN_SHIFT, parse_batch
from tests.helpers_collector import AUTH, TOKEN, CollectorProc, free_port, make_report


def test_submit_never_blocks_and_spills_when_the_queue_is_full(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # nobody listens
    exp = Exporter(
        url,
        TOKEN,
        "sp",
        0,
        tmp_path / "spool",
        ExporterConfig(max_queue=4, batch_max=2, backoff_max_s=0.2, timeout_s=0.5),
    )
    t0 = time.perf_counter()
    for s in range(200):
        exp.submit(make_report(s, n_layers=2, n_experts=2))
    per_step = (time.perf_counter() - t0) / 200
    assert per_step < 0.01  # spilling is a small local file write, never a network wait
    assert exp.close(timeout=0.5) is False
    assert exp.stats["spilled"] > 0
    files = sorted((tmp_path / "spool").glob("sp-r0-*.json"))
    assert files, "unsent batches must be on disk"
    seqs = [int(p.stem.rsplit("-", 1)[1]) for p in files]
    assert len(set(seqs)) == len(seqs)


def test_a_full_queue_spools_every_step_in_submission_order(tmp_path: Path) -> None:
    """The queue overflows while the sender is mid-turn (collector down): the spool, replayed
    oldest seq first as a restarted trainer would, must hold every step exactly once and in the
    order submitted (the collector's server-side detectors read steps in arrival order). A spilled
    step used to get its seq before older steps still queued or taken but not yet sealed."""
    url = f"http://127.0.0.1:{free_port()}"  # nobody listens
    cfg = ExporterConfig(max_queue=4, batch_max=2, backoff_max_s=0.2, timeout_s=0.5)
    exp = Exporter(url, TOKEN, "so", 0, tmp_path / "spool", cfg)
    for s in range(300):
        exp.submit(make_report(s, n_layers=2, n_experts=2))
    assert exp.close(timeout=0.5) is False
    assert exp.stats["spilled"] > 0  # the queue did overflow
    replayed: list[int] = []

    def record(body: bytes) -> bool:
        replayed.extend(r.step for r in parse_batch(body).reports)
        return True

    assert Spool(tmp_path / "spool", "so-r0-", {"spooled": 0, "replayed": 0}).replay(record)
    assert replayed == list(range(300))


def test_generation_keeps_counting_up(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    a = Exporter(url, None, "g", 0, tmp_path)
    b = Exporter(url, None, "g", 0, tmp_path)  # same second: still a larger generation
    assert b.generation > a.generation
    assert (b.generation << GEN_SHIFT) > (a.generation << GEN_SHIFT | (1 << GEN_SHIFT) - 1)
    a.close(0.1), b.close(0.1)


@pytest.mark.integration
def test_spool_is_replayed_in_order_by_a_restarted_trainer(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    exp = Exporter(
        url, TOKEN, "rp", 0, tmp_path / "spool", ExporterConfig(max_queue=8, batch_max=4, timeout_s=0.5)
    )
    for s in range(40):
        exp.submit(make_report(s), [Event(step=s, kind=schema.EV_CHECKPOINT)] if s % 10 == 0 else [])
    assert exp.close(timeout=0.5) is False  # collector down: everything stays on disk
    c = CollectorProc(tmp_path / "runs", port=port).start()
    try:
        exp2 = Exporter(url, TOKEN, "rp", 0, tmp_path / "spool", ExporterConfig(backoff_max_s=0.2))
        for s in range(40, 50):
            exp2.submit(make_report(s))
        assert exp2.close(timeout=30), exp2.stats
        assert not list((tmp_path / "spool").glob("rp-r0-*.json"))
        c.stop()
        steps = read_table(c.runs / "rp", schema.TABLE_STEPS)["step"].to_list()
        assert sorted(steps) == list(range(50))
        assert read_table(c.runs / "rp", schema.TABLE_EVENTS)["step"].to_list() == [0, 10, 20, 30]
    finally:
        c.stop()


@pytest.mark.integration
def test_rejected_batch_is_set_aside_and_does_not_block(tmp_path: Path) -> None:
    c = CollectorProc(tmp_path / "runs").start()
    try:
        exp = Exporter(c.url, TOKEN, "rj", 0, tmp_path / "spool", ExporterConfig(batch_max=1))
        bad = make_report(0)
        bad.load_ME = np.zeros((5, 3), np.int64)  # wrong shape: the collector answers 400
        exp.submit(bad)
        assert exp.flush(10)
        for s in range(1, 6):
            exp.submit(make_report(s))
        assert exp.close(10)
        assert exp.stats["rejected"] == 1
        assert len(list((tmp_path / "spool" / "rejected").iterdir())) == 1
        c.stop()
        assert sorted(read_table(c.runs / "rj", schema.TABLE_STEPS)["step"].to_list()) == [1, 2, 3, 4, 5]
    finally:
        c.stop()


@pytest.mark.integration
def test_commands_reach_poll_commands_once_and_are_acknowledged(tmp_path: Path) -> None:
    c = CollectorProc(tmp_path / "runs").start()
    try:
        exp = Exporter(c.url, TOKEN, "cm", 0, tmp_path / "spool", ExporterConfig(poll_s=0.1))
        exp.submit(make_report(0))
        assert exp.flush(10)
        r = httpx.post(
            f"{c.url}/v1/runs/cm/commands", json={"action": "skip", "reason": "bad shard"}, headers=AUTH
        )
        cmd = r.json()["command"]
        got: list[dict] = []
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            got = exp.poll_commands()  # no network call: fetched in the background
            time.sleep(0.05)
        assert [g["id"] for g in got] == [cmd["id"]] and got[0]["action"] == "skip"
        exp.submit(make_report(1))  # carries commands_ack
        assert exp.flush(10)
        time.sleep(0.3)
        assert exp.poll_commands() == []
        assert (
            httpx.get(f"{c.url}/v1/runs/cm/commands", params={"rank": 0}, headers=AUTH).json()["commands"]
            == []
        )
        exp.close(10)
    finally:
        c.stop()


def test_close_ends_with_one_final_batch_unless_the_trainer_crashed(tmp_path: Path) -> None:
    from tests.helpers_http import RecordingSink

    with RecordingSink(default_status=200) as collector:  # records what a collector would get
        exp = Exporter(collector.url, TOKEN, "fin", 0, tmp_path / "a")
        for s in range(5):
            exp.submit(make_report(s))
        assert exp.close(10)
        bodies = [r.json for r in collector.received("/v1/ingest")]
        assert [b.get("final", False) for b in bodies][-1] is True
        assert sum(b.get("final", False) for b in bodies) == 1
        assert bodies[-1]["reports"] == [] and bodies[-1]["seq"] == max(b["seq"] for b in bodies)
        assert bodies[-1]["heartbeat"]["step"] == 4

        collector.requests.clear()
        crashing = Exporter(collector.url, TOKEN, "crash", 0, tmp_path / "b")
        crashing.submit(make_report(0))
        with pytest.raises(RuntimeError):
            try:
                raise RuntimeError("boom")  # the trainer's loop dies ...
            finally:
                crashing.close(10)  # ... and its `finally` closes the exporter: no final
        assert not any(r.json.get("final") for r in collector.received())
        assert [s for r in collector.received() for s in (x["step"] for x in r.json["reports"])] == [0]


def test_final_batch_is_spooled_behind_unsent_batches(tmp_path: Path) -> None:
    url = f"http://127.0.0.1:{free_port()}"  # collector down
    exp = Exporter(url, TOKEN, "fs", 0, tmp_path, ExporterConfig(timeout_s=0.5, backoff_max_s=0.2))
    for s in range(3):
        exp.submit(make_report(s))
    assert exp.close(timeout=0.5) is False
    files = sorted(tmp_path.glob("fs-r0-*.json"))
    assert len(files) >= 2 and json.loads(files[-1].read_bytes()).get("final") is True
    assert not any(json.loads(f.read_bytes()).get("final") for f in files[:-1])


def test_otel_exporter_records_core_metrics() -> None:
    reader = InMemoryMetricReader()
    otel = OtelExporter(None, "otel-run", reader=reader)
    for s in range(3):
        otel.submit(make_report(s, n_layers=4))
    last = make_report(3, n_layers=4, loss=float("nan"))
    otel.submit(last)
    otel.submit(make_report(9, rank=1))  # other ranks are ignored
    data = reader.get_metrics_data()
    points: dict[str, list] = {}
    for rm in data.resource_metrics:
        assert rm.resource.attributes["moeguard.run"] == "otel-run"
        for sm in rm.scope_metrics:
            for m in sm.metrics:
                points[m.name] = list(m.data.data_points)
    assert points[schema.M_TOKENS][0].value == 4 * 4096
    assert points[schema.M_NONFINITE][0].value == 1
    assert points[schema.M_STEP][0].value == 3
    assert schema.M_LOSS not in points or not points[schema.M_LOSS]  # NaN is not exported
    assert points[schema.M_GRAD_NORM][0].value == pytest.approx(last.grad_norm)
    assert points[schema.M_GRAD_NORM][0].attributes == {"run": "otel-run"}
    by_layer = {p.attributes["layer"]: p.value for p in points[schema.M_LAYER_MAXVIO]}
    assert by_layer == pytest.approx({"1": last.maxvio_M[0], "3": last.maxvio_M[1]})
    assert len(points[schema.M_LAYER_GRAD_NORM]) == 4
    otel.close()
