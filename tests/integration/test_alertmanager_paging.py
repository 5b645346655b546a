"""Paging through Alertmanager itself, high availability included, with every part real:

    moeguard collector --alertmanager-url A --alertmanager-url B   (critical guard alerts, at once)
    Prometheus (alerts/moeguard.rules.yml, scraping the collector)  -> A and B
    Alertmanager A <-gossip-> Alertmanager B (alerts/alertmanager.yml, --cluster.peer on loopback)
        -> a recording sink standing in for PagerDuty (Events v2), Slack and a webhook

One incident is one page and one resolve, whoever raised it (the collector first, the RunHalted
rule a few seconds later: the same labels, so one alert); killing the instance that pages loses
no page and doubles none; restarting it, and the collector, re-pages nothing.

1. the cluster test: halt -> one trigger; kill the leader; a second incident pages once through
   the survivor; the collector restarts; the killed instance comes back; resume -> one resolve.
2. what `moeguard pager`'s tests pinned down, now Alertmanager's job (one instance, alerts posted
   as Prometheus posts them): ranks fold into one incident resolved by the last rank; warnings go
   to Slack and the webhook, never to PagerDuty; a 429 from PagerDuty is retried and delivered
   once; inhibition keeps a layer's warning quiet while its run's page fires.
1. runs in the background on its own stack while 2. runs (the `cluster_drill` fixture).

Waits are polls with bounded timeouts; "nothing more" is checked after QUIET_S, longer than a
group interval (6 s clustered, 1 s alone) plus the peer timeout (1 s) plus the collector's resend
(1 s).
What the sink received is saved to test-output/alertmanager_paging/.
"""

from __future__ import annotations

import contextlib
import json
import math
import shutil
import time
import urllib.parse
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from guard.core import schema
from guard.core.events import Event
from tests.helpers_alerting import (
    ALERTMANAGER,
    HOOK,
    PROMETHEUS,
    REPO,
    ROUTING_KEY,
    RULES,
    RUNBOOKS,
    AlertingStack,
    Proc,
    alerting_stack,
    am_alert,
    fast_rules,
    ingest,
    pagerduty_story,
    start_collector,
    start_prometheus,
)
from tests.helpers_collector import G1, G2, batch, halt_row, make_report
from tests.helpers_http import http_json, wait_until

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.skipif(
        PROMETHEUS is None or ALERTMANAGER is None,
        reason="needs the prometheus and prometheus-alertmanager binaries (Debian packages)",
    ),
]

ARTIFACTS = REPO / "test-output" / "alertmanager_paging"
QUIET_S = 10.0


def save_artifacts(st: AlertingStack, name: str) -> None:
    out = ARTIFACTS / name
    out.mkdir(parents=True, exist_ok=True)
    received = [
        {"t": round(r.time, 3), "path": r.path, "status": r.status, "body": r.json}
        for r in st.sink.received()
    ]
    (out / "received.json").write_text(json.dumps(received, indent=2, sort_keys=True))
    for log in st.tmp.glob("*.log"):
        shutil.copy(log, out / log.name)


def assert_trigger(body: dict[str, Any], alert: str, run: str) -> None:
    assert body["routing_key"] == ROUTING_KEY and body["event_action"] == "trigger"
    p = body["payload"]
    assert p["severity"] == "critical" and p["class"] == alert and p["group"] == run
    assert p["source"] == f"moeguard/{run}"
    assert {"href": f"{RUNBOOKS}/playbooks/{alert}.md", "text": f"Playbook: {alert}"} in body["links"]
    assert (REPO / "playbooks" / f"{alert}.md").is_file()


# ---------------------------------------------------------------------------------------
# 1. two clustered Alertmanagers, the collector and Prometheus sending to both
# ---------------------------------------------------------------------------------------
@dataclass
class Cluster:
    st: AlertingStack
    tmp: Path
    collector: Proc
    prom: Proc

    def restart_collector(self) -> None:
        self.collector.stop()
        self.st.extra.remove(self.collector)
        self.collector = start_collector(self.tmp, self.st.urls, port=self.collector.port)
        self.st.extra.insert(0, self.collector)

    def rule_firing(self, alert: str, run: str) -> bool:
        status, body = http_json(f"{self.prom.url}/api/v1/alerts", timeout=5)
        assert status == 200, body
        return any(
            a["labels"].get("alertname") == alert and a["labels"].get("run") == run and a["state"] == "firing"
            for a in body["data"]["alerts"]
        )


@contextlib.contextmanager
def cluster_stack(tmp_path: Path) -> Iterator[Cluster]:
    with alerting_stack(tmp_path, n_alertmanagers=2) as st:
        try:
            collector = start_collector(tmp_path, st.urls)
            st.extra.append(collector)
            rules = fast_rules(RULES.read_text(), speedup=60, alerts={"RunHalted"})
            prom = start_prometheus(tmp_path, [collector.hostport], st.ports, rules)
            st.extra.append(prom)
            yield Cluster(st, tmp_path, collector, prom)
        finally:
            save_artifacts(st, "cluster")


def one_page_and_one_resolve_through_a_cluster_that_loses_and_regains_a_member(cluster: Cluster) -> None:
    c, st = cluster, cluster.st
    # A guard halt: the collector posts RunHalted to both instances the moment it is stored
    t0 = time.monotonic()
    ingest(c.collector.url, batch("halted", 0, G1 | 1, [make_report(s) for s in range(4)], [halt_row(3)]))
    [trig] = st.wait_pd("trigger", run="halted", timeout=60)
    assert_trigger(trig.json, "RunHalted", "halted")
    assert trig.json["payload"]["summary"] == "Run halted halted at step 3 by guard"
    assert trig.time - t0 < 30  # the collector's path: no scrape, no rule `for`
    key = trig.json["dedup_key"]

    # Prometheus' RunHalted follows with the same labels: each instance holds ONE alert
    wait_until(
        lambda: c.rule_firing("RunHalted", "halted"), timeout=60, interval=0.5, what="the rule to fire"
    )
    time.sleep(2.0)  # Prometheus sends each firing alert every second (--rules.alert.resend-delay=1s)
    for am in st.ams:
        [held] = am.alerts(alertname="RunHalted", run="halted")
        assert held["labels"]["runbook_base"] == RUNBOOKS and held["status"]["state"] == "active"

    # The instance that pages dies mid-incident (SIGKILL)
    leader = st.leader()
    leader.kill()
    survivor = next(am for am in st.ams if am is not leader)

    # A second incident while it is down pages once, through the survivor: two non-finite steps
    nan = [make_report(s, loss=math.nan) for s in (1, 2)]
    ingest(c.collector.url, batch("nan", 0, G1 | 1, [make_report(0), *nan]))
    [nan_trig] = st.wait_pd("trigger", run="nan", timeout=60)
    assert_trigger(nan_trig.json, "NonFiniteLoss", "nan")
    assert survivor.alerts(alertname="NonFiniteLoss", run="nan")

    # The collector restarts (the halt latch comes back from its run store and is posted again),
    # then the killed instance comes back with its storage and cluster ports
    c.restart_collector()
    leader.start()
    st.wait_clustered()
    wait_until(
        lambda: leader.alerts(alertname="RunHalted", run="halted"),
        timeout=30,
        interval=0.5,
        what="the restarted instance to hold RunHalted again",
    )
    time.sleep(QUIET_S)
    assert pagerduty_story(st.pd(run="halted")) == [("page", key)], "re-paged after a restart"
    assert len(st.pd("trigger", run="nan")) == 1, "re-paged after a restart"

    # The operator resumes the run: the rule resolves a scrape and an evaluation later, the
    # collector's own resolve follows its resolve delay (COLLECTOR_RESOLVE_DELAY_S) and changes nothing more
    resume = Event(step=4, kind=schema.EV_RESUME, action=schema.ACT_NONE).row()
    ingest(c.collector.url, batch("halted", 0, G2 | 1, [make_report(4)], [resume]))
    [res] = st.wait_pd("resolve", dedup_key=key, timeout=60)
    assert res.json["routing_key"] == ROUTING_KEY
    time.sleep(QUIET_S)
    mine = [r for r in st.sink.received("/pd") if r.json.get("dedup_key") == key]
    assert pagerduty_story(mine) == [("page", key), ("resolve", key)]
    assert [r.json["event_action"] for r in mine] == ["trigger", "resolve"]  # not even an update
    firing = [r for r in st.slack() if "[FIRING CRITICAL] Run halted halted at step 3" in _title(r)]
    resolved = [r for r in st.slack() if _title(r).startswith("[RESOLVED]") and "halted" in _title(r)]
    assert len(firing) == 1 and len(resolved) == 1, [_title(r) for r in st.slack()]


def _title(r: Any) -> str:
    return r.json["attachments"][0]["title"]


# ---------------------------------------------------------------------------------------
# 2. what the retired pager's tests pinned down, on Alertmanager (alerts posted as Prometheus does)
# ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def cluster_drill(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Future[None]]:
    """The cluster test (1.) runs in the background from the first test of the module on, on a
    stack of its own: its quiet windows overlap the single-instance tests (2.), which share
    nothing with it but the machine. Its test waits for it and judges it."""

    # (made here: pytest's tmp_path_factory is not thread-safe, and the single-instance tests make
    # theirs meanwhile; two first calls at once raced to create the base folder)
    tmp = tmp_path_factory.mktemp("am-cluster")

    def drill() -> None:
        with cluster_stack(tmp) as c:
            one_page_and_one_resolve_through_a_cluster_that_loses_and_regains_a_member(c)

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="am-cluster") as pool:
        yield pool.submit(drill)


@pytest.fixture(scope="module")
def single(tmp_path_factory: pytest.TempPathFactory, cluster_drill: Future[None]) -> Iterator[AlertingStack]:
    with alerting_stack(tmp_path_factory.mktemp("am-single"), n_alertmanagers=1) as st:
        try:
            yield st
        finally:
            save_artifacts(st, "single")


@pytest.mark.timeout(120)
def test_ranks_fold_into_one_incident_that_the_last_rank_resolves(single: AlertingStack) -> None:
    st, run = single, "fold"
    st.post([am_alert("HeartbeatLost", run=run, rank=str(r)) for r in range(3)])

    def named(r: Any) -> list[str]:
        return r.json["payload"]["custom_details"]["ranks"].split()

    # The page names every rank, at once or in the update a group interval later: alerts that
    # started more than group_wait ago (Prometheus's `for`) make Alertmanager flush the group at
    # the first one's arrival, and on a loaded host that flush can go before the POST's other
    # alerts are in the group (a CI clone's page named rank 0 alone). One incident either way.
    trig = wait_until(
        lambda: next((r for r in st.pd("trigger", run=run) if named(r) == ["0", "1", "2"]), None),
        timeout=60,
        what="a HeartbeatLost page naming ranks 0, 1 and 2",
    )
    assert {r.json["dedup_key"] for r in st.pd("trigger", run=run)} == {trig.json["dedup_key"]}
    st.post([am_alert("HeartbeatLost", run=run, rank=str(r), resolved=True) for r in range(2)])
    time.sleep(QUIET_S / 2)
    assert not st.pd("resolve", dedup_key=trig.json["dedup_key"]), "resolved while rank 2 is still lost"
    st.post([am_alert("HeartbeatLost", run=run, rank="2", resolved=True)])
    key = trig.json["dedup_key"]
    st.wait_pd("resolve", dedup_key=key)
    # rank 0 and 1 recovering updated the open incident (a trigger with its key): one page
    mine = [r for r in st.sink.received("/pd") if r.json.get("dedup_key") == key]
    assert pagerduty_story(mine) == [("page", key), ("resolve", key)]


@pytest.mark.timeout(120)
def test_warnings_reach_slack_and_the_webhook_but_never_page(single: AlertingStack) -> None:
    st, run = single, "warn"
    st.post([am_alert("Straggler", run=run, severity="warning", rank="4")])
    single.sink.wait_for(lambda r: r.path == HOOK and r.json["commonLabels"].get("run") == run, timeout=30)
    wait_until(lambda: st.slack(run=run), timeout=30, what="the Slack message")
    assert "[FIRING WARNING] Straggler in run warn" in _title(st.slack(run=run)[0])
    assert not st.pd(run=run)


@pytest.mark.timeout(120)
def test_pagerduty_429_is_retried_and_delivered_once(single: AlertingStack) -> None:
    st, run = single, "busy"
    st.sink.fail_next(2, status=429, path="/pd")
    st.post([am_alert("GuardRollbackStorm", run=run)])
    st.wait_pd("trigger", run=run, timeout=60)
    time.sleep(QUIET_S / 2)
    assert len(st.pd("trigger", run=run)) == 1
    assert [r.status for r in st.sink.received("/pd") if b'"busy"' in r.body] == [429, 429, 202]


@pytest.mark.timeout(120)
def test_a_run_page_inhibits_its_layer_warnings(single: AlertingStack) -> None:
    st, run = single, "inhib"
    st.post([am_alert("RunHalted", run=run)])
    st.wait_pd("trigger", run=run)
    st.post([am_alert("ExpertCollapse", run=run, severity="warning", scope="layer", layer="3")])
    st.post([am_alert("ExpertCollapse", run="other", severity="warning", scope="layer", layer="3")])
    wait_until(lambda: st.slack(run="other"), timeout=30, what="the other run's warning")
    status, body = http_json(
        f"{st.ams[0].url}/api/v2/alerts?" + urllib.parse.urlencode({"filter": f'run="{run}"'}), timeout=5
    )
    assert status == 200
    [collapse] = [a for a in body if a["labels"]["alertname"] == "ExpertCollapse"]
    assert collapse["status"]["state"] == "suppressed" and collapse["status"]["inhibitedBy"]
    assert not [r for r in st.slack(run=run) if "ExpertCollapse" in _title(r)]


@pytest.mark.timeout(300)
def test_one_page_and_one_resolve_through_a_cluster_that_loses_and_regains_a_member(
    cluster_drill: Future[None],
) -> None:
    cluster_drill.result()  # (1.) last in the file: the tests above run while it does
