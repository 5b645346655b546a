"""StepReport <-> run-store table rows: the one mapping, both ways.

report -> rows: `steps_columns`, `layer_columns`, `expert_columns`, `group_columns` turn many
reports into the columns of the `steps`, `layers`, `experts` and `groups` tables at once (the in-process run store and
the collector both write through them, guard/store/writer.py). rows -> report:
`reports_from_columns` rebuilds the reports from those tables (`moeguard replay`, through
guard/store/reader.py). Pure numpy: the store turns columns into Parquet.

Shapes (suffix legend, see report.py): L = transformer layers, M = MoE layers, E = experts.
Each table has one row per (step, layer) or (step, MoE layer, expert); dense layers carry NaN
routing statistics and 0 dead experts, which is also how rows -> report tells them apart.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from guard.core import schema
from guard.core.report import StepReport

# schema dtype name -> numpy dtype, so the columns come out as the tables store them
_NUMPY = {"Int64": np.int64, "Int32": np.int32, "Float64": np.float64}

# Per-MoE-layer statistics stored per layer row, with the value a dense layer (no router) gets.
_ROUTING_STATS = (
    ("router_entropy", "router_entropy_M", math.nan),
    ("load_entropy", "load_entropy_M", math.nan),
    ("maxvio", "maxvio_M", math.nan),
    ("dead_experts", "dead_experts_M", 0),
    ("bias_norm", "bias_norm_M", math.nan),
)


def _typed(table: str, cols: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    dtypes = schema.TABLE_COLUMNS[table]
    return {c: np.asarray(cols[c], dtype=_NUMPY[dtypes[c]]) for c in dtypes}


def _empty(table: str) -> dict[str, np.ndarray]:
    return _typed(table, {c: np.zeros(0) for c in schema.TABLE_COLUMNS[table]})


# ---------------------------------------------------------------------------------------
# report -> rows
# ---------------------------------------------------------------------------------------
def steps_row(rep: StepReport) -> dict[str, Any]:
    """The report's one row of the `steps` table."""
    return {c: getattr(rep, c) for c in schema.STEPS_COLUMNS}


def steps_columns(reps: Sequence[StepReport]) -> dict[str, list]:
    """Columns of the `steps` table, one row per report."""
    return {c: [getattr(r, c) for r in reps] for c in schema.STEPS_COLUMNS}


def layer_columns(reps: Sequence[StepReport]) -> dict[str, np.ndarray]:
    """Columns for the `layers` table from many reports at once: one row per (step, transformer
    layer). Dense layers carry NaN routing statistics (0 dead experts). Reports that share one
    layout (the usual case) are converted with a handful of array operations in total."""
    reps = [r for r in reps if len(r.layer_ids_L)]
    if not reps:
        return _empty(schema.TABLE_LAYERS)
    n = np.array([len(r.layer_ids_L) for r in reps])
    cols: dict[str, np.ndarray] = {
        "step": np.repeat(np.array([r.step for r in reps], dtype=np.int64), n),
        "layer": np.concatenate([r.layer_ids_L for r in reps]),
        "grad_norm": np.concatenate([r.layer_grad_norm_L for r in reps]),
        "update_ratio": np.concatenate([_per_layer(r.update_ratio_L, len(r.layer_ids_L)) for r in reps]),
        "max_logit": np.concatenate([_per_layer(r.max_logit_L, len(r.layer_ids_L)) for r in reps]),
    }
    first = reps[0]
    same_layout = all(
        np.array_equal(r.layer_ids_L, first.layer_ids_L)
        and np.array_equal(r.moe_layer_ids_M, first.moe_layer_ids_M)
        for r in reps
    )
    for col, attr, fill in _ROUTING_STATS:
        if same_layout:
            dst, src = _moe_positions(first)
            out = np.full((len(reps), len(first.layer_ids_L)), fill, dtype=np.float64)
            if dst.size:
                out[:, dst] = np.stack([np.asarray(getattr(r, attr), dtype=np.float64) for r in reps])[:, src]
            cols[col] = out.reshape(-1)
        else:
            parts = []
            for r in reps:
                dst, src = _moe_positions(r)
                row = np.full(len(r.layer_ids_L), fill, dtype=np.float64)
                row[dst] = np.asarray(getattr(r, attr), dtype=np.float64)[src]
                parts.append(row)
            cols[col] = np.concatenate(parts)
    return _typed(schema.TABLE_LAYERS, cols)


def _per_layer(values: np.ndarray, n: int) -> np.ndarray:
    """A per-layer array, or NaN per layer where it was not measured (empty)."""
    return values if values.size == n else np.full(n, math.nan)


def _moe_positions(r: StepReport) -> tuple[np.ndarray, np.ndarray]:
    """(positions in layer_ids_L, positions in moe_layer_ids_M) of the MoE layers the report lists."""
    where = {int(lid): i for i, lid in enumerate(r.layer_ids_L)}
    pairs = [(where[int(lid)], j) for j, lid in enumerate(r.moe_layer_ids_M) if int(lid) in where]
    return np.array([d for d, _ in pairs], dtype=np.int64), np.array([s for _, s in pairs], dtype=np.int64)


def expert_columns(reps: Sequence[StepReport]) -> dict[str, np.ndarray]:
    """Columns for the `experts` table from many reports: one row per (step, MoE layer, expert)."""
    reps = [r for r in reps if r.load_ME.ndim == 2 and r.load_ME.size]
    if not reps:
        return _empty(schema.TABLE_EXPERTS)
    sizes = np.array([r.load_ME.size for r in reps])
    cols = {
        "step": np.repeat(np.array([r.step for r in reps], dtype=np.int64), sizes),
        "layer": np.concatenate([np.repeat(r.moe_layer_ids_M, r.load_ME.shape[1]) for r in reps]),
        "expert": np.concatenate([np.tile(np.arange(r.load_ME.shape[1]), r.load_ME.shape[0]) for r in reps]),
        "load": np.concatenate([r.load_ME.reshape(-1) for r in reps]),
        "bias": np.concatenate(
            [r.bias_ME.reshape(-1) if r.bias_ME.size else np.zeros(r.load_ME.size) for r in reps]
        ),
    }
    return _typed(schema.TABLE_EXPERTS, cols)


def group_columns(reps: Sequence[StepReport]) -> dict[str, np.ndarray]:
    """Columns for the `groups` table: one row per (step, optimizer parameter group)."""
    reps = [r for r in reps if r.group_grad_norm_G.size]
    if not reps:
        return _empty(schema.TABLE_GROUPS)
    sizes = np.array([r.group_grad_norm_G.size for r in reps])
    cols = {
        "step": np.repeat(np.array([r.step for r in reps], dtype=np.int64), sizes),
        "group": np.concatenate([np.arange(n) for n in sizes]),
        "grad_norm": np.concatenate([r.group_grad_norm_G for r in reps]),
        "update_ratio": np.concatenate(
            [_per_layer(r.group_update_ratio_G, r.group_grad_norm_G.size) for r in reps]
        ),
    }
    return _typed(schema.TABLE_GROUPS, cols)


# ---------------------------------------------------------------------------------------
# rows -> report
# ---------------------------------------------------------------------------------------
def reports_from_columns(
    steps: Mapping[str, Sequence[Any]],
    layers: Mapping[str, np.ndarray],
    experts: Mapping[str, np.ndarray],
    groups: Mapping[str, np.ndarray] | None = None,
) -> Iterator[StepReport]:
    """StepReports rebuilt from the tables' columns, one per `steps` row in its order.
    `layers` must be sorted by (step, layer), `experts` by (step, layer, expert) and `groups` by
    (step, group); a missing value (None) in `steps` reads as NaN. MoE layers are the layer rows
    with a router entropy."""
    by_step_l = _row_ranges(layers)
    by_step_e = _row_ranges(experts)
    by_step_g = _row_ranges(groups or {})
    names = [c for c in schema.STEPS_COLUMNS if c in steps]
    for i in range(len(steps["step"])):
        rep = StepReport(**{c: (v if (v := steps[c][i]) is not None else math.nan) for c in names})
        lo_hi = by_step_l.get(rep.step)
        if lo_hi is not None:
            sl = slice(*lo_hi)
            moe = _moe_rows(layers, sl, experts, by_step_e.get(rep.step))
            rep.layer_ids_L = np.asarray(layers["layer"][sl], dtype=np.int32)
            rep.layer_grad_norm_L = np.asarray(layers["grad_norm"][sl], dtype=np.float64)
            if "update_ratio" in layers:
                ratio = np.asarray(layers["update_ratio"][sl], dtype=np.float64)
                rep.update_ratio_L = ratio if not np.isnan(ratio).all() else np.zeros(0)
            if "max_logit" in layers:
                logit = np.asarray(layers["max_logit"][sl], dtype=np.float64)
                rep.max_logit_L = logit if not np.isnan(logit).all() else np.zeros(0)
            rep.moe_layer_ids_M = rep.layer_ids_L[moe]
            rep.router_entropy_M = np.asarray(layers["router_entropy"][sl])[moe]
            rep.load_entropy_M = np.asarray(layers["load_entropy"][sl])[moe]
            rep.maxvio_M = np.asarray(layers["maxvio"][sl])[moe]
            rep.dead_experts_M = np.asarray(layers["dead_experts"][sl])[moe].astype(np.int32)
            rep.bias_norm_M = np.asarray(layers["bias_norm"][sl])[moe]
        lo_hi = by_step_e.get(rep.step)
        if lo_hi is not None and len(rep.moe_layer_ids_M):
            sl, m = slice(*lo_hi), len(rep.moe_layer_ids_M)
            rep.load_ME = np.asarray(experts["load"][sl]).reshape(m, -1)
            rep.bias_ME = np.asarray(experts["bias"][sl]).reshape(m, -1)
        lo_hi = by_step_g.get(rep.step)
        if lo_hi is not None and groups is not None:
            sl = slice(*lo_hi)
            rep.group_grad_norm_G = np.asarray(groups["grad_norm"][sl], dtype=np.float64)
            rep.group_update_ratio_G = np.asarray(groups["update_ratio"][sl], dtype=np.float64)
        yield rep


def _moe_rows(
    layers: Mapping[str, np.ndarray],
    sl: slice,
    experts: Mapping[str, np.ndarray],
    expert_rows: tuple[int, int] | None,
) -> np.ndarray:
    """Which of a step's layer rows are MoE layers: those with expert rows that step. (A router
    entropy is not enough: after a divergence it is NaN on every layer.) Without expert rows,
    the layers that report a router entropy."""
    layer_ids = np.asarray(layers["layer"][sl])
    if expert_rows is not None and "layer" in experts:
        return np.isin(layer_ids, np.asarray(experts["layer"][slice(*expert_rows)]))
    return ~np.isnan(np.asarray(layers["router_entropy"][sl], dtype=np.float64))


def _row_ranges(cols: Mapping[str, np.ndarray]) -> dict[int, tuple[int, int]]:
    """step -> (first row, end row) of a table sorted by step."""
    step = np.asarray(cols.get("step", np.zeros(0, np.int64)))
    if not step.size:
        return {}
    values, starts = np.unique(step, return_index=True)
    ends = np.append(starts[1:], step.size)
    return {int(s): (int(a), int(b)) for s, a, b in zip(values, starts, ends, strict=True)}
