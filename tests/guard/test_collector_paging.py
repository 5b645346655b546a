"""The collector's fast path to Alertmanager (guard/collector/paging.py, guard/core/paging.py):
what pages, labelled how, re-sent while firing, resolved once. Alertmanager here is a recording
HTTP server (its v2 API answers 200); tests/integration/test_alertmanager_paging.py runs the
real, clustered Alertmanager."""

from __future__ import annotations

import json
import math
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest

from guard.collector.config import CollectorConfig
from guard.collector.service import Collector
from guard.core import schema
from guard.core.events import Event
from guard.core.paging import (
    HARDWARE_FAULT,
    PAGED,
    REPEATED_NONFINITE,
    ROLLBACK_STORM,
    RUN_HALTED,
    PageBook,
    alert_labels,
)
from tests.helpers_collector import G1, G2, batch, halt_row, ingest, make_report
from tests.helpers_http import Recorded, RecordingSink

RUNBOOKS = "https://runbooks.example/moeguard"


# ---------------------------------------------------------------------------------------
# The pure part: latches and windows
# ---------------------------------------------------------------------------------------
def test_window_alert_fires_at_its_threshold_and_resolves_when_the_window_slides() -> None:
    book = PageBook()
    book.signal(REPEATED_NONFINITE, "r", 0.0)
    assert book.firing(1.0) == {}  # one NaN: the warning tier (Prometheus), not a page
    book.signal(REPEATED_NONFINITE, "r", 100.0)
    [f] = book.firing(101.0).values()
    assert f.labels == {"alertname": "NonFiniteLoss", "severity": "critical", "scope": "run", "run": "r"}
    assert f.starts_at == 101.0 and "2 steps" in f.annotations["description"]
    assert f.annotations["runbook_url"] == "playbooks/NonFiniteLoss.md"
    assert book.firing(1799.0)  # both within 30m
    assert book.firing(1800.5) == {}  # the first slid out
    assert book.firing(1900.0) == {} and book._series == {}  # and nothing is kept


def test_latch_fires_until_cleared_and_a_clear_alone_creates_nothing() -> None:
    book = PageBook()
    book.latch(RUN_HALTED, "r", False, 0.0)
    assert book._series == {}
    book.latch(RUN_HALTED, "r", True, 5.0)
    [f] = book.firing(6.0, RUNBOOKS).values()
    assert f.annotations["runbook_url"] == f"{RUNBOOKS}/playbooks/RunHalted.md"
    assert book.latched(RUN_HALTED) == ["r"]
    book.latch(RUN_HALTED, "r", False, 7.0)
    assert book.firing(8.0) == {} and book.latched(RUN_HALTED) == []


def test_hardware_fault_is_one_alert_per_rank() -> None:
    book = PageBook()
    book.signal(HARDWARE_FAULT, "r", 0.0, "3")
    book.signal(HARDWARE_FAULT, "r", 0.0, "5")
    assert sorted(f.labels["rank"] for f in book.firing(1.0).values()) == ["3", "5"]
    assert alert_labels(HARDWARE_FAULT, "r")["rank"] == "-1"  # the trainer could not tell


def test_windows_survive_a_state_round_trip() -> None:
    book = PageBook()
    book.signal(REPEATED_NONFINITE, "r", 10.0)
    book.signal(HARDWARE_FAULT, "r", 11.0, "2")
    book.latch(RUN_HALTED, "r", True, 12.0)
    again = PageBook()
    again.load_state_dict(json.loads(json.dumps(book.state_dict())))
    assert again.latched(RUN_HALTED) == []  # latches are the run's state, not this file's
    again.signal(REPEATED_NONFINITE, "r", 20.0)
    names = {f.labels["alertname"] for f in again.firing(21.0).values()}
    assert names == {"NonFiniteLoss", "SuspectedHardwareFault"}
    with pytest.raises(ValueError, match="paging state"):
        PageBook().load_state_dict({"windows": [["NoSuchAlert", "r", None, [1.0]]]})


def test_every_paged_alert_is_critical_and_has_a_playbook() -> None:
    repo = Path(__file__).resolve().parents[2]
    for a in PAGED:
        assert alert_labels(a, "r")["severity"] == "critical"
        assert (repo / "playbooks" / f"{a.alertname}.md").is_file()


# ---------------------------------------------------------------------------------------
# The collector posting to a (recorded) Alertmanager
# ---------------------------------------------------------------------------------------
@pytest.fixture
def am() -> Iterator[RecordingSink]:
    with RecordingSink(default_status=200) as s:
        yield s


@pytest.fixture
def collector(tmp_path: Path, am: RecordingSink) -> Iterator[Collector]:
    c = Collector(
        CollectorConfig(
            runs_dir=tmp_path / "runs",
            token=None,
            alertmanager_urls=(am.url, am.url + "/b/api/v2/alerts"),  # two instances: both get all
            alert_labels={"runbook_base": RUNBOOKS, "cluster": "test"},
            alert_resend_s=0.5,
            alert_resolve_delay_s=0.0,
        )
    )
    c.start()
    yield c
    c.close()


def posted(r: Recorded) -> list[dict[str, Any]]:
    assert r.path.endswith("/api/v2/alerts") and r.method == "POST"
    return r.json


def ts(s: str) -> float:
    return datetime.fromisoformat(s.replace("Z", "+00:00")).timestamp()


def _with(run: str, name: str, firing: bool | None = None) -> Any:
    def pred(r: Recorded) -> bool:
        if r.status != 200 or not isinstance(r.json, list):
            return False
        for a in r.json:
            if a["labels"].get("run") == run and a["labels"]["alertname"] == name:
                received = time.time() - (time.monotonic() - r.time)  # wall clock at receipt
                is_firing = ts(a["endsAt"]) > received
                if firing is None or firing == is_firing:
                    return True
        return False

    return pred


def test_a_halt_is_posted_at_once_to_every_alertmanager_resent_and_resolved_on_resume(
    collector: Collector, am: RecordingSink
) -> None:
    t0 = time.monotonic()
    ingest(collector, batch("h", 0, G1 | 1, [make_report(s) for s in range(4)], [halt_row(3)]))
    assert time.monotonic() - t0 < 1.0  # never on the request path
    hits = am.wait_for(_with("h", "RunHalted", True), count=2, timeout=20)
    assert {r.path for r in hits} == {"/api/v2/alerts", "/b/api/v2/alerts"}
    [alert] = [a for a in posted(hits[0]) if a["labels"]["run"] == "h"]
    # the RunHalted rule's labels plus the external labels Prometheus adds: one alert for both
    assert alert["labels"] == {
        "alertname": "RunHalted",
        "severity": "critical",
        "scope": "run",
        "run": "h",
        "runbook_base": RUNBOOKS,
        "cluster": "test",
    }
    assert alert["annotations"]["runbook_url"] == f"{RUNBOOKS}/playbooks/RunHalted.md"
    # what halted it (issue #37): the step, guard or operator, the reason, the run's framework
    assert alert["annotations"]["summary"] == "Run h halted at step 3 by guard"
    assert {k: alert["annotations"][k] for k in schema.HALT_INFO_LABELS} == {
        "step": "3",
        "halted_by": "guard",
        "detector": "",
        "reason": "2 rollbacks within 500 steps",
        "framework": "unknown",  # this run sent no meta.json
    }
    assert ts(alert["endsAt"]) - ts(alert["startsAt"]) == pytest.approx(4 * 0.5, abs=1.0)
    # re-sent while it fires (same startsAt, a later endsAt)
    resent = am.wait_for(_with("h", "RunHalted", True), count=6, timeout=20)
    starts = {a["startsAt"] for r in resent for a in r.json if a["labels"]["run"] == "h"}
    assert starts == {alert["startsAt"]}
    # the exporter retrying the same batch changes nothing; a resume resolves it, once per instance
    assert ingest(collector, batch("h", 0, G1 | 1, [make_report(s) for s in range(4)], [halt_row(3)]))[
        "duplicate"
    ]
    resume = Event(step=4, kind=schema.EV_RESUME, action=schema.ACT_NONE).row()
    ingest(collector, batch("h", 0, G2 | 1, [make_report(4)], [resume]))
    resolved = am.wait_for(_with("h", "RunHalted", False), count=2, timeout=20)
    assert {r.path for r in resolved} == {"/api/v2/alerts", "/b/api/v2/alerts"}
    time.sleep(2.0)  # 4 resend periods: the resolve is not repeated, nothing fires again
    after = [r for r in am.received() if r.time > resolved[-1].time]
    assert not any(_with("h", "RunHalted")(r) for r in after)
    assert collector.notifier is not None and collector.notifier.firing() == []


def test_repeated_nan_rollback_storm_and_hardware_fault_page(collector: Collector, am: RecordingSink) -> None:
    nan = [make_report(s, loss=math.nan) for s in (1, 2)]
    ingest(collector, batch("n", 0, G1 | 1, [make_report(0), nan[0]]))
    ingest(collector, batch("n", 1, G1 | 1, [make_report(1, rank=1, loss=math.nan)]))  # rank 1: not counted
    time.sleep(1.0)
    assert not any(_with("n", "NonFiniteLoss")(r) for r in am.received())  # one NaN is the warning tier
    ingest(collector, batch("n", 0, G1 | 2, [nan[1]]))
    am.wait_for(_with("n", "NonFiniteLoss", True), timeout=20)

    rb = [make_report(s) for s in (5, 6)]
    for r in rb:
        r.action = schema.ACT_ROLLBACK
    ingest(collector, batch("rb", 0, G1 | 1, rb))
    am.wait_for(_with("rb", "GuardRollbackStorm", True), timeout=20)

    rerun = Event(
        step=7,
        kind=schema.EV_RERUN,
        detector=schema.RERUN_TRANSIENT,
        action=schema.ACT_APPLY,
        detail={"ranks": [3]},
    ).row()
    ingest(collector, batch("hw", 0, G1 | 1, [make_report(7)], [rerun]))
    [r] = am.wait_for(_with("hw", "SuspectedHardwareFault", True), timeout=20)[:1]
    [a] = [a for a in r.json if a["labels"]["run"] == "hw"]
    assert a["labels"]["rank"] == "3" and a["labels"]["severity"] == "critical"
    names = {f["alertname"] for f in collector.notifier.firing()}
    assert names == {"NonFiniteLoss", "GuardRollbackStorm", "SuspectedHardwareFault"}
    assert {a.alertname for a in (REPEATED_NONFINITE, ROLLBACK_STORM, HARDWARE_FAULT)} == names


def test_an_alertmanager_that_fails_gets_the_state_when_it_is_back(tmp_path: Path) -> None:
    with RecordingSink(default_status=200) as am:
        am.fail_next(4, status=503)
        c = Collector(
            CollectorConfig(
                runs_dir=tmp_path / "runs", token=None, alertmanager_urls=(am.url,), alert_resend_s=30
            )
        )
        c.start()
        try:
            ingest(c, batch("f", 0, G1 | 1, [make_report(0)], [halt_row(0)]))
            am.wait_for(lambda r: r.status == 200 and _with("f", "RunHalted", True)(r), timeout=30)
            assert [r.status for r in am.received()][:4] == [503] * 4
        finally:
            c.close()


def test_a_restarted_collector_posts_the_restored_halt_and_replay_adds_no_signal(tmp_path: Path) -> None:
    with RecordingSink(default_status=200) as am:
        cfg = CollectorConfig(
            runs_dir=tmp_path / "runs", token=None, alertmanager_urls=(am.url,), alert_resend_s=0.5
        )
        c = Collector(cfg)
        c.start()
        nan = [make_report(s, loss=math.nan) for s in (1, 2)]
        ingest(c, batch("x", 0, G1 | 1, nan, [halt_row(2)]))
        am.wait_for(_with("x", "NonFiniteLoss", True), timeout=20)
        c.close()
        restarted = time.monotonic()
        c = Collector(cfg)
        c.start()
        try:
            got = am.wait_for(lambda r: r.status == 200 and r.time > restarted, timeout=30)
            names = {a["labels"]["alertname"] for a in got[0].json}
            # the halt latch comes back from the run store, the NaN window from the paging state;
            # the replayed write-ahead log adds no signal (two NaN steps, not four)
            assert names == {"RunHalted", "NonFiniteLoss"}, json.dumps(got[0].json)
            [nan_alert] = [a for a in got[0].json if a["labels"]["alertname"] == "NonFiniteLoss"]
            assert "produced 2 steps" in nan_alert["annotations"]["description"]
        finally:
            c.close()


def test_the_resolve_waits_for_prometheus_to_see_the_end_first(tmp_path: Path) -> None:
    """Prometheus sees an end a scrape and an evaluation after the collector and re-sends the
    alert as firing meanwhile; an immediate resolve would be undone and page again."""
    with RecordingSink(default_status=200) as am:
        cfg = CollectorConfig(
            runs_dir=tmp_path / "runs",
            token=None,
            alertmanager_urls=(am.url,),
            alert_resend_s=0.5,
            alert_resolve_delay_s=3.0,
        )
        c = Collector(cfg)
        c.start()
        try:
            ingest(c, batch("d", 0, G1 | 1, [make_report(0)], [halt_row(0)]))
            am.wait_for(_with("d", "RunHalted", True), timeout=20)
            resume = Event(step=1, kind=schema.EV_RESUME, action=schema.ACT_NONE).row()
            ingest(c, batch("d", 0, G2 | 1, [make_report(1)], [resume]))
            resumed = time.monotonic()
            [res] = am.wait_for(_with("d", "RunHalted", False), timeout=20)
            assert res.time - resumed >= 2.5  # not before the delay
            # and nothing in between re-sent it as firing
            between = [r for r in am.received() if resumed + 1.0 < r.time < res.time]
            assert not any(_with("d", "RunHalted", True)(r) for r in between)
        finally:
            c.close()
