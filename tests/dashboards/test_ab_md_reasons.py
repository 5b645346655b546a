"""Issue #40, item 8: ab.md's reason for a missing MFU ratio is the real one."""

from __future__ import annotations

import json
from pathlib import Path

from guard.canary.ab_report import render_markdown
from tests.dashboards.synth_ab import write_ab_report


def test_ab_md_names_the_real_reason_mfu_is_not_shown(tmp_path: Path) -> None:
    """Item 8: ab.md said "A and B do different FLOPs per token" whenever the MFU ratio was
    missing; with the same FLOPs per token and no peak the reason is the missing peak."""
    rep = json.loads(write_ab_report(tmp_path, [0.99, 1.01, 1.0, 0.98]).read_text())
    assert "MFU ratio not shown" not in render_markdown(rep)  # both sides have MFU: the ratio is there
    rep["other_ratios"].pop("mfu")
    for side in ("A", "B"):
        rep["sides"][side]["mfu_median"] = None
    said = render_markdown(rep)
    assert (
        "MFU ratio not shown: no peak FLOP/s for A and B's device" in said and "FLOPs per token" not in said
    )
    rep["sides"]["A"]["mfu_median"] = rep["sides"]["B"]["mfu_median"] = 0.3
    for w in rep["workers"]:
        w["flops_per_token"] = 2e6 if w["side"] == "B" else 1e6
    assert "MFU ratio not shown: A and B do different FLOPs per token" in render_markdown(rep)
