"""bench/scale/month_run.py at a tiny size (seconds): it builds a long-run store, opens every
page's data path in fresh processes, replays it, and reports sizes and files per table."""

from __future__ import annotations

import json
from pathlib import Path

from bench.scale import month_run


def test_month_run_tiny(tmp_path: Path) -> None:
    out = tmp_path / "r.json"
    args = [
        "--steps",
        "2000",
        "--steps",
        "3000",
        "--layers",
        "4",
        "--experts",
        "8",
        "--ranks",
        "16",
        "--runs",
        "5",
    ]
    args += [
        "--incident-every",
        "1000",
        "--recent",
        "500",
        "--radius",
        "20",
        "--repeat",
        "1",
        "--add-step",
        "120",
    ]
    month_run.main([*args, "--dir", str(tmp_path / "b"), "--out", str(out)])
    res = json.loads(out.read_text())
    for n in (2000, 3000):
        r = res["results"][f"new-{n}"]
        assert r["measured"]["runs"]["runs"] == 5 and r["measured"]["runs"]["steps"] == n - 1
        assert r["measured"]["health"]["stages"]["figure_json_bytes"] > 0
        assert r["measured"]["replay"]["peak_rss_mb"] > 0
        # compacted: one part per table per 1,000-step segment (+ the events table's one)
        files = r["store"]
        assert files["steps"]["files"] == n // 1000 and files["events"]["files"] == 1
        assert files["rollups/experts-r1000"]["files"] == n // 1000
    assert set(res["growth"]) >= {"runs", "health", "compare", "replay"}
    assert res["add_step"]["steps"] == 120 and res["add_step"]["p999_ms"] > 0
