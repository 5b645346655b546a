"""Smoke test of bench/overhead/torchtitan_overhead.py on the small model: the JSON and table it writes,
not the timings; and its argument checks."""

from __future__ import annotations

import json
import math

import pytest

pytest.importorskip(
    "torchtitan", reason="torchtitan (and triton) not installed: pip install torchtitan==0.3.0 triton"
)


def test_torchtitan_overhead_smoke(tmp_path):
    from bench.overhead.torchtitan_overhead import main, markdown

    out = tmp_path / "r.json"
    argv = ["--model", "small", "--blocks", "2", "--steps-per-block", "3", "--warmup", "1"]
    main([*argv, "--out", str(out), "--no-progress"])
    res = json.loads(out.read_text())
    assert str(tmp_path) not in res["command"] and "--out OUT.json" in res["command"]
    assert res["config"]["blocks"] == 2 and res["config"]["steps_per_block"] == 3
    f = res["result"]
    assert f["model"] == "small" and f["model_class"] == "DeepSeekV3Model" and f["moe_layers"] == 3
    for key in ("median_step_s_plain", "median_step_s_guarded", "mean_step_s_plain", "mean_step_s_guarded"):
        assert math.isfinite(f[key]) and f[key] > 0, key
    assert f["pairs"] == 2 and len(f["pair_ratios"]) == 2 and f["steps_per_variant"] == 6
    lo, hi = f["overhead_ci95"]
    assert f["overhead_min"] <= lo <= f["overhead"] <= hi <= f["overhead_max"]
    assert sum(f["guard_actions"].values()) == 1 + 2 * 3  # warm-up + measured steps, all through the guard
    table = markdown(res)
    assert "| small |" in table and res["command"] in table and "at most 3% on CPU" in table


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["--model", "deepseek"], "--model 'deepseek'"),
        (["--blocks", "0"], "--blocks 0"),
        (["--warmup", "-1"], "--warmup -1"),
    ],
)
def test_torchtitan_overhead_rejects_bad_values_by_name(argv, named, capsys):
    from bench.overhead.torchtitan_overhead import parse_args

    with pytest.raises(SystemExit):
        parse_args(argv)
    assert named in capsys.readouterr().err
