"""A config table sets only the keys it names; the rest keep the enclosing section's default.

Before 2026-11-24 a `[guard.loss_spike]` table was built from SpikeConfig's class defaults, so
naming one key silently swapped GuardConfig's budget rule (early z 6, 8x ceiling) for a bare
rule: configs/tiny.toml's loss rule had no early z, a x5 loss spike at step 148 passed, joined
the tail fit, and every later x5 passed too (bench/detection/detector_quality.py on recorded tiny runs).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from guard.core.config import GuardConfig, load_guard_config
from guard.core.detectors.calibrated import CalibratedSpikeDetector
from guard.core.detectors.suite import DetectorSuite
from guard.core.tomlconf import ConfigError

REPO = Path(__file__).resolve().parents[2]


def test_a_partial_spike_table_keeps_the_default_rule() -> None:
    default = GuardConfig().loss_spike
    got = load_guard_config(table={"loss_spike": {"budget": 1e-4}}).loss_spike
    assert got.budget == 1e-4
    assert (got.early_z, got.rel_max, got.early_rel_max, got.tail_warmup, got.rel_min) == (
        default.early_z,
        default.rel_max,
        default.early_rel_max,
        default.tail_warmup,
        default.rel_min,
    )
    assert got.early_z == 6.0  # the class default is None: the old behaviour lost it


def test_a_nested_table_inside_a_section_keeps_its_field_default() -> None:
    """precursor.update_spike's default is not SpikeConfig(): rel_max None, warmup 16."""
    got = load_guard_config(table={"precursor": {"update_spike": {"z": 7.0}}}).precursor.update_spike
    assert (got.z, got.rel_max, got.warmup, got.rel_min, got.level_window) == (7.0, None, 16, 2.0, 8)


def test_none_unsets_an_optional_key_and_gives_the_fixed_z_rule() -> None:
    cfg = load_guard_config(table={"grad_spike": {"budget": "none", "z": 8.0}})
    assert cfg.grad_spike.budget is None and cfg.grad_spike.z == 8.0
    suite = DetectorSuite(cfg)
    assert type(suite.detectors["grad_spike"].det).__name__ == "SpikeDetector"
    assert type(DetectorSuite(GuardConfig()).detectors["grad_spike"]).__name__ == "GradSpikes"
    assert load_guard_config(table={"loss_spike": {"early_z": "None"}}).loss_spike.early_z is None


def test_bad_values_still_name_the_key() -> None:
    with pytest.raises(ConfigError, match=r"guard\.loss_spike\.budget = 0\.5"):
        load_guard_config(table={"loss_spike": {"budget": 0.5}})
    with pytest.raises(ConfigError, match=r"guard\.grad_spike\.budget must be a number, got 'nope'"):
        load_guard_config(table={"grad_spike": {"budget": "nope"}})
    with pytest.raises(ConfigError, match=r"unknown key 'guard\.loss_spike\.budgt'"):
        load_guard_config(table={"loss_spike": {"budgt": 1e-4}})
    with pytest.raises(ConfigError, match=r"guard\.grad_spike\.early_rel_floor = 50\.0"):
        # the inherited adaptive floor (50x) cannot sit above a 20x early cap: the message says so
        load_guard_config(table={"grad_spike": {"early_rel_max": 20.0}})


def test_set_overrides_merge_the_same_way() -> None:
    from trainer.config import load_config

    cfg = load_config(REPO / "configs" / "tiny.toml", {"guard.loss_spike.budget": 1e-4})
    assert cfg.guard.loss_spike.budget == 1e-4 and cfg.guard.loss_spike.early_z == 6.0


def test_tiny_toml_loss_rule_flags_an_early_x5_spike() -> None:
    """configs/tiny.toml names no loss table: its loss rule is GuardConfig's, so a x5 loss at step
    148 (before the tail is fitted) is flagged by the early z and never enters the baseline."""
    cfg = load_guard_config(REPO / "configs" / "tiny.toml")
    assert cfg.loss_spike == GuardConfig().loss_spike
    rng = np.random.default_rng(0)
    det = CalibratedSpikeDetector(cfg.loss_spike, name="loss_spike")
    for x in 2.5 * np.exp(rng.normal(0.0, 0.01, 148)):
        assert not det.update(float(x)).fired
    v = det.update(2.5 * 5)
    assert v.fired and v.evidence["rule"] == "early_z", v
    assert det.n_accepted == 148 and math.isfinite(v.threshold)
