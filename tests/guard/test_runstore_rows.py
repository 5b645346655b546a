"""StepReport <-> table rows (guard/core/rows.py): the one mapping, through the one writer and
the one reader, gives back what went in."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from guard.core import schema
from guard.core.report import StepReport
from guard.core.rows import expert_columns, layer_columns, reports_from_columns, steps_columns
from guard.store.reader import read_reports, read_table
from guard.store.runstore import RunStore
from guard.store.writer import report_frames
from tests.helpers_collector import make_report

ARRAYS = (
    "layer_ids_L",
    "layer_grad_norm_L",
    "moe_layer_ids_M",
    "router_entropy_M",
    "load_entropy_M",
    "maxvio_M",
    "dead_experts_M",
    "bias_norm_M",
    "load_ME",
    "bias_ME",
)


def assert_same(a: StepReport, b: StepReport) -> None:
    for c in schema.STEPS_COLUMNS:
        va, vb = getattr(a, c), getattr(b, c)
        assert va == vb or (va != va and vb != vb), c  # NaN == NaN here
    for name in ARRAYS:
        np.testing.assert_array_equal(getattr(a, name), getattr(b, name), err_msg=name)


def reports() -> list[StepReport]:
    reps = [make_report(s, n_layers=6, n_experts=5) for s in range(4)]
    reps.append(make_report(4, n_layers=3, n_experts=5))  # another layout: the per-report path
    dense = make_report(5, n_layers=2)
    dense.moe_layer_ids_M = np.zeros(0, np.int32)
    for name in ("router_entropy_M", "load_entropy_M", "maxvio_M", "bias_norm_M"):
        setattr(dense, name, np.zeros(0))
    dense.dead_experts_M = np.zeros(0, np.int32)
    dense.load_ME, dense.bias_ME = np.zeros((0, 0), np.int64), np.zeros((0, 0))
    reps.append(dense)
    reps[1].mfu = float("nan")
    return reps


def test_columns_round_trip_in_memory() -> None:
    reps = reports()
    back = list(reports_from_columns(steps_columns(reps), layer_columns(reps), expert_columns(reps)))
    assert len(back) == len(reps)
    for a, b in zip(reps, back, strict=True):
        assert_same(a, b)


def test_columns_have_the_stored_types() -> None:
    for table, cols in (
        (schema.TABLE_LAYERS, layer_columns(reports())),
        (schema.TABLE_EXPERTS, expert_columns([])),
    ):
        for c, dtype in schema.TABLE_COLUMNS[table].items():
            assert cols[c].dtype == np.dtype(dtype.lower()), (table, c)


def test_written_by_either_path_and_read_back(tmp_path: Path) -> None:
    reps = reports()
    store = RunStore(tmp_path / "inproc", flush_every=2)
    for r in reps:
        store.add_step(r)
    store.close()
    for a, b in zip(reps, read_reports(tmp_path / "inproc"), strict=True):
        assert_same(a, b)
    # the collector's frames (the same writer): the same tables
    frames = report_frames(reps)
    for table, df in frames.items():
        assert df.equals(read_table(tmp_path / "inproc", table).sort(df.columns[:3])), table


def test_a_diverged_step_with_nan_router_entropy_reads_back() -> None:
    """After a divergence every router entropy is NaN; the step's MoE layers are still the ones
    with expert rows (moeguard replay crashed on such runs: 'cannot reshape array of size 32')."""
    reps = [make_report(s, n_layers=4, n_experts=8) for s in range(3)]
    reps[2].router_entropy_M = np.full_like(reps[2].router_entropy_M, np.nan)
    reps[2].loss = float("nan")
    back = list(reports_from_columns(steps_columns(reps), layer_columns(reps), expert_columns(reps)))
    assert len(back) == 3
    np.testing.assert_array_equal(back[2].moe_layer_ids_M, reps[2].moe_layer_ids_M)
    assert back[2].load_ME.shape == reps[2].load_ME.shape
    assert np.isnan(back[2].router_entropy_M).all()
