"""Smoke test of bench/overhead/integration_overhead.py: the JSON it writes, not the timings."""

from __future__ import annotations

import json
import math

import pytest


def test_integration_overhead_smoke(tmp_path):
    from bench.overhead.integration_overhead import main, markdown

    out = tmp_path / "r.json"
    main(
        [
            "--families",
            "mixtral",
            "--blocks",
            "2",
            "--steps-per-block",
            "3",
            "--warmup",
            "1",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    res = json.loads(out.read_text())
    assert {"command", "date", "machine", "config", "wall_s", "families"} <= res.keys()
    # the command a docs section shows names no path of the machine that ran it
    assert str(tmp_path) not in res["command"] and "--out OUT.json" in res["command"]
    assert res["config"]["blocks"] == 2 and res["config"]["steps_per_block"] == 3
    assert list(res["families"]) == ["mixtral"]
    f = res["families"]["mixtral"]
    for key in ("median_step_s_plain", "median_step_s_guarded", "mean_step_s_plain", "mean_step_s_guarded"):
        assert math.isfinite(f[key]) and f[key] > 0, key
    assert f["pairs"] == 2 and len(f["pair_ratios"]) == 2 and f["steps_per_variant"] == 6
    lo, hi = f["overhead_ci95"]
    for x in (f["overhead"], lo, hi, f["overhead_min"], f["overhead_max"], f["overhead_block_medians"]):
        assert math.isfinite(x) and x > -1
    assert f["overhead_min"] <= lo <= f["overhead"] <= hi <= f["overhead_max"]
    assert f["moe_layers"] == 4 and f["params"] > 0
    assert sum(f["guard_actions"].values()) == 1 + 2 * 3  # warm-up + measured steps, all through the guard
    table = markdown(res)
    assert "| mixtral (MixtralForCausalLM, 4 MoE layers) |" in table and res["command"] in table


def test_integration_overhead_rejects_unknown_family():
    from bench.overhead.integration_overhead import main

    with pytest.raises(SystemExit):
        main(["--families", "mixtral,llama", "--no-progress"])
