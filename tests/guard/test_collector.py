"""The collector: payload validation, Parquet columns, metrics, and a real server over loopback.

Integration tests start `python -m guard collector` as a subprocess (so it can be SIGKILLed)
and talk to it with httpx.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import polars as pl
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from guard.collector.book import HealthBook
from guard.collector.metrics import CollectorMetrics
from guard.core import schema
from guard.core.events import Event
from guard.core.report import StepReport
from guard.core.rows import expert_columns, layer_columns
from guard.runtime.exporter import Exporter, ExporterConfig
from guard.store.reader import read_meta, read_table
from guard.store.writer import report_frames
from guard.wire.batch import BadRequest, parse_batch
from tests.helpers_collector import (
    AUTH,
    TOKEN,
    CollectorProc,
    batch,
    make_report,
    settled_digest,
    tree_digest,
    wait_steps,
)


# ---------------------------------------------------------------------------------------
# pure parts
# ---------------------------------------------------------------------------------------
def test_parse_batch_names_the_bad_field() -> None:
    good = batch("r1", 0, 1, [make_report(0)])
    assert parse_batch(json.dumps(good).encode()).reports[0].step == 0
    cases = {
        "run": {**good, "run": "../etc"},
        "seq": {**good, "seq": -1},
        "rank": {**good, "rank": "0"},
        "reports[0]": {**good, "reports": [{**good["reports"][0], "loss": "high"}]},
        "'step'": {**good, "reports": [{k: v for k, v in good["reports"][0].items() if k != "step"}]},
        "events[0].kind": {**good, "events": [{"step": 1, "kind": "party"}]},
        "heartbeat.phase": {**good, "heartbeat": {"time": 1.0, "step": 1, "phase": "nap"}},
        "reports[0].rank": {**good, "rank": 1},
    }
    for field, payload in cases.items():
        with pytest.raises(BadRequest, match=field.replace("[", r"\[").replace("]", r"\]")):
            parse_batch(json.dumps(payload).encode())
    with pytest.raises(BadRequest, match="JSON"):
        parse_batch(b"[" * 100000)


def test_nan_accepted_as_literal_or_null() -> None:
    rep = make_report(3)
    rep.mfu = float("nan")
    d = batch("r1", 0, 1, [rep])
    assert np.isnan(parse_batch(json.dumps(d).encode()).reports[0].mfu)  # NaN literal
    d["reports"][0]["mfu"] = None
    assert np.isnan(parse_batch(json.dumps(d).encode()).reports[0].mfu)


def test_report_frames_match_runstore_rows() -> None:
    reps = [make_report(s, n_layers=6, n_experts=5) for s in range(3)]
    frames = report_frames(reps)
    lay = frames[schema.TABLE_LAYERS]
    exp = frames[schema.TABLE_EXPERTS]
    # one report at a time (the per-report path) gives the rows the batched frames hold
    want_l = {c: sum((layer_columns([r])[c].tolist() for r in reps), []) for c in schema.LAYERS_COLUMNS}
    want_e = {c: sum((expert_columns([r])[c].tolist() for r in reps), []) for c in schema.EXPERTS_COLUMNS}
    for c, v in want_l.items():
        np.testing.assert_array_equal(
            lay[c].to_numpy(), np.asarray(v, dtype=lay[c].to_numpy().dtype), err_msg=c
        )
    for c, v in want_e.items():
        np.testing.assert_array_equal(exp[c].to_numpy(), np.asarray(v), err_msg=c)
    assert frames[schema.TABLE_STEPS]["step"].to_list() == [0, 1, 2]


def test_metrics_expert_share_histogram_and_heartbeat_age_at_scrape() -> None:
    clock = [1000.0]
    book = HealthBook(clock=lambda: clock[0])
    m = CollectorMetrics(book)
    rep = make_report(1, n_experts=4)
    rep.load_ME = np.array([[0, 0, 0, 100], [25, 25, 25, 25]])
    book.observe_report("r", rep)
    book.beat("r", 0, 1000.0, 1, "train")
    text = m.render().decode()
    s = {
        (x.name, tuple(sorted(x.labels.items()))): x.value
        for f in text_string_to_metric_families(text)
        for x in f.samples
    }
    b = "moeguard_expert_load_share_bucket"
    assert s[(b, (("layer", "1"), ("le", "0.0"), ("run", "r")))] == 3  # three dead experts
    assert s[(b, (("layer", "1"), ("le", "0.75"), ("run", "r")))] == 3
    assert s[(b, (("layer", "1"), ("le", "1.0"), ("run", "r")))] == 4
    # the uniform share 1/E is a bucket bound of its own (issue #17: 1/8 vanished into 0.1-0.2)
    assert s[(b, (("layer", "3"), ("le", "0.1875"), ("run", "r")))] == 0
    assert s[(b, (("layer", "3"), ("le", "0.25"), ("run", "r")))] == 4
    assert s[("moeguard_expert_load_share_count", (("layer", "3"), ("run", "r")))] == 4
    age = ("moeguard_heartbeat_age_seconds", (("rank", "0"), ("run", "r")))
    assert s[age] == 0
    clock[0] += 42
    s2 = {
        (x.name, tuple(sorted(x.labels.items()))): x.value
        for f in text_string_to_metric_families(m.render().decode())
        for x in f.samples
    }
    assert s2[age] == 42  # grows while the run is silent
    assert s2[("moeguard_heartbeat_lost", (("rank", "0"), ("run", "r")))] == 1


# ---------------------------------------------------------------------------------------
# real server
# ---------------------------------------------------------------------------------------
@pytest.mark.integration
def test_refuses_to_start_without_token(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k != schema.ENV_TOKEN}
    r = subprocess.run(
        [sys.executable, "-m", "guard", "collector", "--port", "0", "--runs", str(tmp_path)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 2 and "MOEGUARD_TOKEN" in r.stdout + r.stderr


@pytest.mark.integration
def test_ingest_lands_in_run_store_and_replay_is_idempotent(collector: CollectorProc) -> None:
    reps = [make_report(s) for s in range(25)]
    ev = Event(
        step=7,
        kind=schema.EV_VERDICT,
        detector=schema.DET_GRAD_SPIKE,
        value=9.0,
        threshold=3.0,
        action=schema.ACT_SKIP,
    ).row()
    meta = {
        "run_id": "r1",
        "status": "running",
        "env": {"torch": "2.5.1", "device": "cpu", "expert_kernel": "bmm"},
        "model": {"n_experts": 8},
    }
    p1 = batch("r1", 0, 1, reps[:10], [ev], meta=meta)
    p2 = batch("r1", 0, 2, reps[10:])
    assert collector.post(p1).json() == {"ok": True, "duplicate": False, "commands": []}
    assert collector.post(p2).status_code == 200
    r = collector.post(p1)  # replayed: same seq
    assert r.status_code == 200 and r.json()["duplicate"] is True
    run_dir = collector.runs / "r1"
    df = wait_steps(run_dir, 25)
    time.sleep(0.5)
    df = read_table(run_dir, schema.TABLE_STEPS).sort("step")
    assert df["step"].to_list() == list(range(25))
    assert df["loss"].to_list() == [r.loss for r in reps]
    assert read_table(run_dir, schema.TABLE_EXPERTS).height == 25 * 2 * 8
    assert read_table(run_dir, schema.TABLE_LAYERS).height == 25 * 4
    evs = read_table(run_dir, schema.TABLE_EVENTS)
    assert evs.filter(pl.col("step") == 7)["detector"].to_list() == [schema.DET_GRAD_SPIKE]
    assert read_meta(run_dir)["env"]["torch"] == "2.5.1"
    m = collector.metrics()
    assert m[("moeguard_guard_verdicts_total", (("detector", "grad_norm_spike"), ("run", "r1")))] == 1
    assert (
        m[
            (
                "moeguard_run_info",
                (
                    ("attention", ""),
                    ("compile", ""),
                    ("device", "cpu"),
                    ("expert_kernel", "bmm"),
                    ("run", "r1"),
                    ("torch", "2.5.1"),
                ),
            )
        ]
        == 1
    )  # the kernel, not the expert count
    assert m[("moeguard_ingest_batches_total", (("outcome", "duplicate"),))] == 1
    runs = httpx.get(f"{collector.url}/v1/runs").json()["runs"]
    assert runs[0]["run"] == "r1" and runs[0]["last_step"] == 24 and runs[0]["status"] == "running"
    assert "last_report_time" in runs[0]["ranks"]["0"]


@pytest.mark.integration
def test_rejections_leave_stored_data_unchanged(tmp_path: Path) -> None:
    c = CollectorProc(tmp_path / "runs", "--max-body-bytes", "4096", "--checkpoint-interval", "0.1").start()
    try:
        assert c.post(batch("r1", 0, 1, [make_report(0, n_layers=2, n_experts=2)])).status_code == 200
        before = settled_digest(c.runs)
        good = batch("r1", 0, 2, [make_report(1, n_layers=2, n_experts=2)])
        r = c.post(good, headers={})
        assert r.status_code == 401 and "token" in r.json()["error"]
        assert c.post(good, headers={"authorization": "Bearer wrong"}).status_code == 401
        big = batch("r1", 0, 2, [make_report(s, n_layers=8, n_experts=16) for s in range(1, 4)])
        r = c.post(big)
        assert r.status_code == 413 and "4096" in r.json()["error"]
        # one bad report in an otherwise good batch: nothing of the batch is stored
        bad = batch(
            "r1", 0, 2, [make_report(1, n_layers=2, n_experts=2), make_report(2, n_layers=2, n_experts=2)]
        )
        bad["reports"][1]["load_ME"] = [[1, 2, 3]]
        r = c.post(bad)
        assert r.status_code == 400 and "reports[1]" in r.json()["error"]
        r = c.post({**good, "run": "../../tmp/x"})
        assert r.status_code == 400 and "'run'" in r.json()["error"]
        time.sleep(0.4)
        assert tree_digest(c.runs) == before
        assert not (tmp_path / "tmp").exists()
        assert c.post(good).status_code == 200  # seq 2 was never consumed by a rejected batch
    finally:
        c.stop()


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=5) | st.dictionaries(st.text(max_size=10), kids, max_size=5),
    max_leaves=30,
)
_FIELDS = ["run", "rank", "seq", "meta", "reports", "events", "heartbeat", "commands_ack"]


@st.composite
def garbled_bodies(draw: st.DrawFn) -> bytes:
    kind = draw(st.sampled_from(["bytes", "json", "mutated", "report_field"]))
    if kind == "bytes":
        return draw(st.binary(max_size=300))
    if kind == "json":
        return json.dumps(draw(_json)).encode()
    base = batch("fz", draw(st.integers(0, 3)), 10**6, [make_report(1, n_layers=2, n_experts=2, t=1.0)])
    if kind == "mutated":
        base[draw(st.sampled_from(_FIELDS))] = draw(_json)
        if draw(st.booleans()):
            base.pop(draw(st.sampled_from(_FIELDS)), None)
    else:
        rep = base["reports"][0]
        rep[draw(st.sampled_from(sorted(rep)))] = draw(_json)
    body = json.dumps(base).encode()
    if draw(st.booleans()):  # truncate or flip a byte
        i = draw(st.integers(0, len(body) - 1))
        body = body[:i] if draw(st.booleans()) else body[:i] + bytes([body[i] ^ 0x5A]) + body[i + 1 :]
    return body


@pytest.mark.integration
@pytest.mark.slow
def test_fuzz_never_5xx_and_rejections_store_nothing(tmp_path_factory: pytest.TempPathFactory) -> None:
    c = CollectorProc(tmp_path_factory.mktemp("fuzz") / "runs", "--checkpoint-interval", "0.05").start()
    client = httpx.Client(headers=AUTH, timeout=10)
    try:
        assert c.post(batch("fz", 0, 1, [make_report(0, n_layers=2, n_experts=2)])).status_code == 200
        settled_digest(c.runs)

        @settings(max_examples=200, deadline=None, suppress_health_check=list(HealthCheck))
        @given(body=garbled_bodies())
        def check(body: bytes) -> None:
            before = tree_digest(c.runs)
            r = client.post(f"{c.url}/v1/ingest", content=body)
            assert r.status_code < 500, (r.status_code, r.text, body[:200])
            if r.status_code != 200:
                assert "error" in r.json()
                time.sleep(0.06)  # a checkpoint tick: it must find nothing to write
                assert tree_digest(c.runs) == before
            else:
                settled_digest(c.runs)  # an accepted mutant: its checkpoint lands before the next digest

        check()
    finally:
        client.close()
        c.stop()


@pytest.mark.integration
def test_metrics_expose_every_schema_name(collector: CollectorProc) -> None:
    reps = [make_report(s) for s in range(130)]  # past the baseline window (steps 20..120)
    reps[128].action, reps[129].action = schema.ACT_ROLLBACK, schema.ACT_HALT  # the steps that acted
    halt = Event(step=129, kind=schema.EV_HALT, action=schema.ACT_HALT).row()
    act = Event(step=128, kind=schema.EV_ACTION, action=schema.ACT_ROLLBACK).row()
    meta = {"torch": "2.5.1", "device_name": "cpu", "attention": "sdpa", "n_experts": 8, "compile": False}
    rerun = Event(step=60, kind=schema.EV_RERUN, detector=schema.RERUN_TRANSIENT, detail={"ranks": [1]}).row()
    for i in range(0, 130, 10):
        verdict = Event(
            step=i, kind=schema.EV_VERDICT, detector=schema.DET_MAXVIO, action=schema.ACT_BIAS_CORRECT
        )
        evs = [act, halt] if i == 120 else [verdict.row()] if i == 50 else [rerun] if i == 60 else []
        assert (
            collector.post(
                batch("m1", 0, i + 1, reps[i : i + 10], evs, meta=meta if i == 0 else None)
            ).status_code
            == 200
        )
    collector.post(batch("m1", 1, 1, [make_report(5, rank=1)]))
    collector.post(batch("m2", 0, 1, [make_report(0)]))  # a live run: m1 halted, its heartbeats unwatched
    text = httpx.get(f"{collector.url}/metrics").text
    names = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    missing = [m for m in schema.METRICS if m not in names and f"{m}_bucket" not in names]
    assert not missing
    m = collector.metrics()
    assert m[("moeguard_run_halted", (("run", "m1"),))] == 1
    assert m[("moeguard_suspected_hardware_faults_total", (("rank", "1"), ("run", "m1")))] == 1
    assert m[("moeguard_guard_actions_total", (("action", "rollback"), ("run", "m1")))] == 1
    assert m[("moeguard_guard_actions_total", (("action", "halt"), ("run", "m1")))] == 1
    assert (
        m[("moeguard_guard_actions_total", (("action", "skip"), ("run", "m1")))] == 0
    )  # every action from 0
    assert m[("moeguard_mfu_baseline_ratio", (("run", "m1"),))] == pytest.approx(0.4)
    assert m[("moeguard_tokens_total", (("run", "m1"),))] == 130 * 4096
    assert m[("moeguard_step", (("run", "m1"),))] == 129
    assert m[("moeguard_layer_maxvio_ratio", (("layer", "3"), ("run", "m1")))] == pytest.approx(
        reps[-1].maxvio_M[1]
    )
    assert ("moeguard_straggler_score", (("rank", "1"), ("run", "m1"))) in m
    assert m[("moeguard_heartbeat_lost", (("rank", "0"), ("run", "m2")))] == 0
    assert not [k for k in m if k[0] == "moeguard_heartbeat_lost" and ("run", "m1") in k[1]]
    assert (
        m[("moeguard_ingest_values_total", (("run", "m1"),))]
        == sum(r.n_values() for r in reps) + reps[0].n_values()
    )


@pytest.mark.integration
def test_heartbeat_lost_for_the_silent_rank(tmp_path: Path) -> None:
    c = CollectorProc(tmp_path / "runs", "--heartbeat-floor", "1").start()
    try:
        for rank in (0, 1):
            assert c.post(batch("hb", rank, 1, [make_report(0, rank=rank)])).status_code == 200
        for i in range(15):  # rank 0 keeps beating, rank 1 is silent
            hb = {"time": time.time(), "step": i, "phase": "train"}
            assert c.post({"run": "hb", "rank": 0, "seq": 2 + i, "heartbeat": hb}).status_code == 200
            time.sleep(0.1)
        m = c.metrics()
        assert m[("moeguard_heartbeat_lost", (("rank", "1"), ("run", "hb")))] == 1
        assert m[("moeguard_heartbeat_lost", (("rank", "0"), ("run", "hb")))] == 0
        assert m[("moeguard_heartbeat_age_seconds", (("rank", "1"), ("run", "hb")))] > 1
        ranks = httpx.get(f"{c.url}/v1/runs").json()["runs"][0]["ranks"]
        assert ranks["1"]["lost"] is True and ranks["0"]["lost"] is False
    finally:
        c.stop()


@pytest.mark.integration
def test_operator_commands_round_trip(collector: CollectorProc) -> None:
    url = f"{collector.url}/v1/runs/c1/commands"
    assert httpx.post(url, json={"action": "halt"}).status_code == 401
    r = httpx.post(url, json={"action": "explode"}, headers=AUTH)
    assert r.status_code == 400 and "action" in r.json()["error"]
    cmd = httpx.post(url, json={"action": "rollback", "reason": "loss diverged"}, headers=AUTH).json()[
        "command"
    ]
    assert httpx.get(url, params={"rank": 0}).status_code == 401  # the operators' words need the token too
    assert httpx.get(url, params={"rank": 0}, headers=AUTH).json()["commands"] == [cmd]
    # the trainer picks it up with its next batch, then acknowledges it
    r = collector.post(batch("c1", 0, 1, [make_report(0)]))
    assert r.json()["commands"] == [cmd]
    collector.post(batch("c1", 0, 2, [make_report(1)], commands_ack=cmd["id"]))
    assert httpx.get(url, params={"rank": 0}, headers=AUTH).json()["commands"] == []
    assert httpx.get(url, params={"rank": 1}, headers=AUTH).json()["commands"] == [
        cmd
    ]  # rank 1 has not taken it
    assert httpx.get(f"{collector.url}/v1/runs/nope/commands", headers=AUTH).status_code == 404
    assert httpx.get(f"{collector.url}/v1/runs/..%2Fx/commands", headers=AUTH).status_code in (400, 404)


@pytest.mark.integration
def test_restart_still_dedupes_and_replays_the_log(tmp_path: Path) -> None:
    # checkpoints every 60 s: acknowledged rows live only in the write-ahead log when killed
    c = CollectorProc(tmp_path / "runs", "--checkpoint-interval", "60").start()
    try:
        p = batch("w1", 0, 5, [make_report(s) for s in range(10)])
        assert c.post(p).json()["duplicate"] is False
        c.kill()
        c.start()
        assert c.post(p).json()["duplicate"] is True
        assert c.post(batch("w1", 0, 6, [make_report(10)])).json()["duplicate"] is False
        df = read_table(c.runs / "w1", schema.TABLE_STEPS)  # replay checkpoints at start
        assert sorted(df["step"].to_list()) == list(range(10))
        c.stop()  # graceful: final checkpoint
        assert sorted(read_table(c.runs / "w1", schema.TABLE_STEPS)["step"].to_list()) == list(range(11))
    finally:
        c.stop()


@pytest.mark.integration
def test_resumed_trainer_replaces_rerun_steps(collector: CollectorProc, tmp_path: Path) -> None:
    gen1 = Exporter(collector.url, TOKEN, "rs", 0, tmp_path / "spool")
    for s in range(50):
        gen1.submit(make_report(s, loss=1.0))
    assert gen1.close(20)
    # crash after step 49, resume from the checkpoint at step 29: steps 30.. are re-run
    gen2 = Exporter(collector.url, TOKEN, "rs", 0, tmp_path / "spool")
    assert gen2.generation > gen1.generation
    for s in range(30, 60):
        gen2.submit(make_report(s, loss=2.0))
    assert gen2.close(20)
    collector.stop()
    df = read_table(collector.runs / "rs", schema.TABLE_STEPS).sort("step")
    assert df["step"].to_list() == list(range(60))
    assert df["loss"].to_list() == [1.0] * 30 + [2.0] * 30
    assert read_table(collector.runs / "rs", schema.TABLE_EXPERTS).height == 60 * 2 * 8


@pytest.mark.integration
@pytest.mark.slow
def test_kill_collector_mid_stream_loses_nothing(tmp_path: Path) -> None:
    n = 400
    c = CollectorProc(tmp_path / "runs", "--checkpoint-interval", "0.3").start()
    exp = Exporter(
        c.url, TOKEN, "k1", 0, tmp_path / "spool", ExporterConfig(batch_max=8, backoff_max_s=0.3, timeout_s=2)
    )
    try:
        for s in range(n):
            exp.submit(make_report(s))
            time.sleep(0.004)
            if s in (120, 260):
                c.kill()  # SIGKILL: no final checkpoint, the log is all there is
            if s in (160, 300):
                c.start()
        assert exp.close(60), exp.stats
        assert exp.stats["spooled"] > 0 and exp.stats["replayed"] > 0
        c.stop()
        steps = read_table(c.runs / "k1", schema.TABLE_STEPS)["step"].to_list()
        assert sorted(steps) == list(range(n))  # every step, exactly once
        assert read_table(c.runs / "k1", schema.TABLE_EXPERTS).height == n * 2 * 8
    finally:
        c.stop()


@pytest.mark.integration
def test_server_side_verdicts_and_the_duplicate_event_rule(collector: CollectorProc) -> None:
    def reps() -> list[StepReport]:
        out = [make_report(s, t=1000.0 + s) for s in range(50)]
        out[45].grad_norm = 100.0  # a spike after a warm-up of steady ~1.0 norms
        return out

    trainer_ev = Event(
        step=45, kind=schema.EV_VERDICT, detector=schema.DET_GRAD_SPIKE, value=100.0, action=schema.ACT_SKIP
    ).row()
    # telemetry only: the collector's own verdict becomes an event
    assert collector.post(batch("tel", 0, 1, reps())).status_code == 200
    # the trainer sent its own verdict for step 45 in the same batch: no second event
    assert collector.post(batch("own", 0, 1, reps(), [trainer_ev])).status_code == 200
    # the trainer says it runs the detectors itself: the collector runs none
    assert collector.post(batch("td", 0, 1, reps(), trainer_detectors=True)).status_code == 200
    collector.stop()
    tel = read_table(collector.runs / "tel", schema.TABLE_EVENTS).filter(
        pl.col("detector") == schema.DET_GRAD_SPIKE
    )
    assert tel["step"].to_list() == [45]
    assert json.loads(tel["detail"][0])["source"] == "collector" and tel["action"][0] == schema.ACT_NONE
    own = read_table(collector.runs / "own", schema.TABLE_EVENTS).filter(pl.col("step") == 45)
    assert own["action"].to_list() == [schema.ACT_SKIP]  # the trainer's event only
    assert read_table(collector.runs / "td", schema.TABLE_EVENTS).height == 0


@pytest.fixture
def collector(tmp_path: Path) -> Iterator[CollectorProc]:
    c = CollectorProc(tmp_path / "runs", "--checkpoint-interval", "0.2").start()
    yield c
    c.stop()
