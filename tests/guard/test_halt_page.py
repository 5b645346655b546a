"""RunHalted says what halted the run and how to resume it, one incident per halt (issue #37 item 2).

* the collector exports moeguard_run_halt_info (step, guard or operator, the detector, the
  reason, the run's framework) while a run is halted, and posts RunHalted with the same words
  the rule renders from it (the rule's promtool test in alerts/tests/step_health.yml fixes them);
* alerts/alertmanager.yml: NonFiniteLoss's critical tier, a rollback storm and RunHalted of one
  run are one PagerDuty incident (real Alertmanager);
* meta.json's counts agree with the halt's words: rollbacks that found no snapshot were applied
  as skips, and the halt's reason says so;
* playbooks/RunHalted.md says how to resume each framework's run.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from guard.core import schema
from guard.core.config import load_guard_config
from guard.core.engine import Engine
from guard.core.events import Event
from guard.core.paging import RUN_HALTED, PageBook, halted_annotations
from guard.runtime.session import framework_of
from tests.conftest import REPO
from tests.helpers_alerting import ALERTMANAGER, alerting_stack, am_alert, pagerduty_story
from tests.helpers_collector import G1, batch, beat, ingest, make_report, scrape
from tests.helpers_http import wait_until

STEP_HEALTH = REPO / "alerts" / "tests" / "step_health.yml"


@pytest.fixture
def collector(tmp_path: Path) -> Any:
    from guard.collector.config import CollectorConfig
    from guard.collector.service import Collector

    c = Collector(CollectorConfig(runs_dir=tmp_path / "runs", token=None))
    c.start()
    yield c
    c.close()


def halt_info(c: Any, run: str) -> dict[str, str] | None:
    found = [dict(k[1]) for k in scrape(c) if k[0] == schema.M_HALT_INFO and dict(k[1])["run"] == run]
    assert len(found) <= 1, found
    if not found:
        return None
    return {k: found[0][k] for k in schema.HALT_INFO_LABELS}


def test_a_guard_halt_is_exported_with_its_step_detector_reason_and_framework(collector: Any) -> None:
    verdict = Event(step=7, kind=schema.EV_VERDICT, detector=schema.DET_NONFINITE, action=schema.ACT_HALT)
    halt = Event(
        step=7,
        kind=schema.EV_HALT,
        action=schema.ACT_HALT,
        detail={"severity": "critical", "reason": "3 skips in one incident, after rollback(s) at [4, 6]"},
    )
    meta = {"status": schema.STATUS_RUNNING, "framework": schema.FRAMEWORK_TORCHTITAN}
    ingest(
        collector,
        batch("g", 0, G1 | 1, [make_report(s) for s in range(8)], [verdict.row(), halt.row()], meta=meta),
    )
    assert halt_info(collector, "g") == {
        "step": "7",
        "halted_by": schema.HALTED_BY_GUARD,
        "detector": schema.DET_NONFINITE,
        "reason": "3 skips in one incident, after rollback(s) at [4, 6]",
        "framework": schema.FRAMEWORK_TORCHTITAN,
    }
    # a resume clears it with the latch
    resume = Event(step=8, kind=schema.EV_RESUME).row()
    ingest(collector, batch("g", 0, (G1 + (1 << 32)) | 1, [make_report(8)], [resume]))
    assert halt_info(collector, "g") is None


def test_an_operators_halt_is_named_as_the_operators(collector: Any) -> None:
    op = Event(
        step=5,
        kind=schema.EV_OPERATOR,
        action=schema.ACT_HALT,
        detail={"command": "halt", "id": 1, "reason": "bad data shard 17", "guard_action": "apply"},
    )
    meta = {"status": schema.STATUS_RUNNING, "framework": schema.FRAMEWORK_TRANSFORMERS}
    ingest(collector, batch("o", 0, G1 | 1, [make_report(s) for s in range(6)], [op.row()], meta=meta))
    assert halt_info(collector, "o") is None  # not halted yet: the run ends halted a moment later
    note = "halted at step 5: bad data shard 17"
    ingest(
        collector, beat("o", 0, G1 | 2, step=5, meta={"status": schema.STATUS_HALTED, "status_note": note})
    )
    assert halt_info(collector, "o") == {
        "step": "5",
        "halted_by": schema.HALTED_BY_OPERATOR,
        "detector": "",
        "reason": "bad data shard 17",
        "framework": schema.FRAMEWORK_TRANSFORMERS,
    }


def test_the_collectors_post_and_the_rule_say_the_same_words() -> None:
    """The rule's rendering is fixed by its promtool test (step_health.yml, run r1, from a
    moeguard_run_halt_info series); the collector's post of the same halt must read alike."""
    tests = yaml.safe_load(STEP_HEALTH.read_text())["tests"]
    [case] = [t for t in tests if t["name"].startswith("RunHalted pages after 1m")]
    [series] = [s["series"] for s in case["input_series"] if s["series"].startswith(schema.M_HALT_INFO)]
    labels = dict(kv.split("=", 1) for kv in series[series.index("{") + 1 : -1].split('",'))
    info = {k: labels[k].strip('"') for k in schema.HALT_INFO_LABELS}
    [fired] = [e for e in case["alert_rule_test"] if e["exp_alerts"]]
    expected = fired["exp_alerts"][0]["exp_annotations"]
    book = PageBook()
    book.latch(RUN_HALTED, "r1", True, 0.0, info=info)
    [firing] = book.firing(1.0).values()
    assert firing.annotations == expected
    assert halted_annotations("r1", info) | {"runbook_url": "playbooks/RunHalted.md"} == expected


def test_the_runs_framework_is_in_its_meta() -> None:
    assert framework_of(torch.nn.Linear(2, 2)) == schema.FRAMEWORK_PYTORCH
    transformers = pytest.importorskip("transformers")
    cfg = transformers.MixtralConfig(
        hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, num_local_experts=2, vocab_size=32,
    )  # fmt: skip
    assert framework_of(transformers.MixtralForCausalLM(cfg)) == schema.FRAMEWORK_TRANSFORMERS


def test_rollbacks_that_found_no_snapshot_count_and_read_as_skips() -> None:
    """A NaN run with no snapshot to roll back to: the policy's rollbacks fall back to skips, the
    steps count them as skips (meta.json's counts), and the halt's reason says so (issue #37:
    "rollback 0" beside "4 rollbacks")."""
    e = Engine(load_guard_config(table={"policy": {"halt_after_rollbacks": 2}}))
    actions, halt = [], None
    for s in range(200):
        d = e.decide(make_report(s, loss=math.nan if s >= 60 else 2.0), snapshot_before=lambda step: None)
        actions.append(d.action)
        halt = next((ev for ev in d.events if ev.kind == schema.EV_HALT), None)
        if halt is not None:
            break
    assert halt is not None and schema.ACT_ROLLBACK not in actions
    listed = halt.detail["rollbacks"]
    assert listed and halt.detail["rollbacks_applied_as_skips"] == listed
    assert (
        f"{len(listed)} of those {len(listed)} rollback(s) found no snapshot and were applied as skips"
        in (halt.detail["reason"])
    )
    # the engine's memory of it survives a checkpoint
    again = Engine(load_guard_config())
    again.load_state_dict(e.state_dict())
    assert again.fell_back == e.fell_back


def test_the_playbook_says_how_to_resume_each_framework() -> None:
    text = (REPO / "playbooks" / "RunHalted.md").read_text()
    assert "moeguard train" in text and "--resume" in text
    assert "torchtitan" in text and "same command" in text
    assert "resume_from_checkpoint" in text
    assert "operator" in text


@pytest.mark.skipif(ALERTMANAGER is None, reason="needs alertmanager")
@pytest.mark.timeout(180)
def test_one_incident_per_halt_through_real_alertmanager(tmp_path: Path) -> None:
    """NonFiniteLoss's critical page, then a rollback storm, then RunHalted for the same run: one
    PagerDuty incident, updated, not three pages; once RunHalted fires the others are inhibited.
    Another run's NonFiniteLoss is an incident of its own."""
    with alerting_stack(tmp_path) as st:
        st.post([am_alert("NonFiniteLoss", run="nan1")])
        [first] = st.wait_pd("trigger", run="nan1", timeout=60)
        assert first.json["payload"]["class"] == "NonFiniteLoss"
        st.post([am_alert("NonFiniteLoss", run="nan1"), am_alert("GuardRollbackStorm", run="nan1")])
        time.sleep(3)
        ladder = [
            am_alert("NonFiniteLoss", run="nan1"),
            am_alert("GuardRollbackStorm", run="nan1"),
            am_alert("RunHalted", run="nan1"),
        ]
        st.post([*ladder, am_alert("NonFiniteLoss", run="other")])
        st.wait_pd("trigger", run="other", timeout=60)
        wait_until(
            lambda: st.pd(run="nan1")[-1].json["payload"]["class"] == "RunHalted",
            timeout=30,
            interval=0.2,
            what="the halt's update of nan1's incident",
        )
        # The halted run then stops heartbeating, as a halted job does (its heartbeat timeout after
        # the halt): HeartbeatLost joins and RunHalted inhibits it.
        st.post(
            [*ladder, am_alert("HeartbeatLost", run="nan1", rank="1"), am_alert("NonFiniteLoss", run="other")]
        )
        time.sleep(4)  # group_wait and group_interval 1 s: any further notification is out by now
        mine = st.pd(run="nan1")
        assert [what for what, _ in pagerduty_story(mine)] == ["page"], [r.json for r in mine]
        last = mine[-1].json
        assert last["payload"]["class"] == "RunHalted"  # the halt speaks for its ladder
        assert last["payload"]["custom_details"]["description"] == "Run nan1: RunHalted."
        held = {a["labels"]["alertname"]: a["status"]["state"] for a in st.ams[0].alerts(run="nan1")}
        assert held == {
            "RunHalted": "active",
            "NonFiniteLoss": "suppressed",
            "GuardRollbackStorm": "suppressed",
            "HeartbeatLost": "suppressed",
        }
        assert [w for w, _ in pagerduty_story(st.pd(run="other"))] == ["page"]
