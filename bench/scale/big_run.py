"""One big run for bench/scale/app_load.py, written straight to Parquet in the run store's layout.

RunStore row by row would take an hour for 200M expert rows, so this builds whole parts with
numpy and lands them through the run store's own writer (guard/store/writer.py: the stored
columns and types, the part names, the atomic write), one part per `part_steps` steps per
table as RunStore's default flush_every (50) leaves behind. Values are plausible, not
physical: loss decays like a power law, load shares drift slowly, a few steps carry guard
verdicts and actions; precursor columns are NaN (not measured). Nothing here needs torch.

Writes docs/BENCHMARKS.md: no section of its own; the big run of App › App load: run-health page on
a big run and of Long runs and store size › Reading a long run (`bench/scale/month_run.py`).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from guard.core import schema
from guard.store.layout import atomic_write_json, part_name
from guard.store.writer import table_frame, write_part_file

T0 = 1_760_000_000.0  # a fixed epoch so the run is reproducible
TOKENS = 4 * 1024 * 1024  # per step
TOP_K = 8
ENV: dict[str, Any] = {
    "torch": "2.9.1+cu128",
    "cuda": "12.8",
    "device": "NVIDIA H100 80GB HBM3",
    "peak_flops": 989e12,
    "peak_flops_source": "table:H100 SXM bf16 dense",
    "attention_backend": "flash",
    "expert_kernel": "grouped_mm",
    "compile": "default",
    "dtype": "bfloat16",
    "git_sha": "3f2a9c1",
    "world_size": 256,
    "hostname": "node-a17",
}
# the guard's interventions cycle through these (action, detector) pairs
INTERVENTIONS = [
    (schema.ACT_SKIP, schema.DET_GRAD_SPIKE),
    (schema.ACT_ROLLBACK, schema.DET_LOSS_SPIKE),
    (schema.ACT_BIAS_CORRECT, schema.DET_MAXVIO),
    (schema.ACT_LR_COOLDOWN, schema.DET_GRAD_SPIKE),
]


def write_big_run(
    run_dir: str | Path,
    *,
    steps: int = 100_000,
    layers: int = 32,
    experts: int = 64,
    part_steps: int = 50,
    seed: int = 0,
    status: str = schema.STATUS_FINISHED,
) -> Path:
    """A `steps`-step run with `layers` MoE layers of `experts` experts, in RunStore's format.

    One part per `part_steps` steps per table, so the reader faces the same number of files a
    real run of this length leaves behind.
    """
    rng = np.random.default_rng(seed)
    d = Path(run_dir)
    for t in schema.TABLES:
        (d / t).mkdir(parents=True, exist_ok=True)
    faults = {s: i for i, s in enumerate(range(steps // 20, steps, steps // 12))}
    ev_rows: list[dict[str, Any]] = []
    share_LE = rng.dirichlet(np.full(experts, 50.0), size=layers)
    seq = 0
    loss_last = float("nan")
    for first in range(0, steps, part_steps):
        step_S = np.arange(first, min(first + part_steps, steps), dtype=np.int64)
        steps_df = _steps_part(rng, step_S, faults, ev_rows)
        loss_last = float(steps_df["loss"][-1])
        share_LE = np.clip(share_LE * np.exp(0.02 * rng.standard_normal(share_LE.shape)), 1e-5, None)
        share_LE /= share_LE.sum(1, keepdims=True)
        layers_df, experts_df = _routing_parts(rng, step_S, steps_df["grad_norm"].to_numpy(), share_LE)
        for t, df in (
            (schema.TABLE_STEPS, steps_df),
            (schema.TABLE_LAYERS, layers_df),
            (schema.TABLE_EXPERTS, experts_df),
        ):
            write_part_file(d / t / part_name(first, seq), df)
            seq += 1
    if ev_rows:
        events = _frame(schema.TABLE_EVENTS, {c: [r[c] for r in ev_rows] for c in schema.EVENTS_COLUMNS}, 0)
        write_part_file(d / schema.TABLE_EVENTS / part_name(0, seq), events)
    atomic_write_json(d / schema.META_FILE, _meta(d.name, status, steps, layers, experts, loss_last))
    return d


def _steps_part(
    rng: np.random.Generator, step_S: np.ndarray, faults: dict[int, int], ev_rows: list[dict[str, Any]]
) -> pl.DataFrame:
    """One part of the steps table; the guard's interventions in it are appended to `ev_rows`."""
    n = len(step_S)
    loss = 2.0 + 9.0 / np.sqrt(step_S + 10) + 0.02 * rng.standard_normal(n)
    gn = 1.5 + 0.1 * rng.standard_normal(n)
    act = np.full(n, schema.ACT_APPLY, dtype=object)
    for j, s in enumerate(step_S.tolist()):
        if s not in faults:
            continue
        i = faults[s] % len(INTERVENTIONS)
        a, det = INTERVENTIONS[i]
        if det == schema.DET_GRAD_SPIKE:
            gn[j] = 60.0
        elif det == schema.DET_LOSS_SPIKE:
            loss[j] = 8.0
        if a in (schema.ACT_SKIP, schema.ACT_ROLLBACK):
            act[j] = a
        for kind in (schema.EV_VERDICT, schema.EV_ACTION):
            ev_rows.append(
                {
                    "step": s,
                    "time": T0 + 2.0 * s,
                    "kind": kind,
                    "detector": det,
                    "value": float(gn[j]),
                    "threshold": 9.0,
                    "action": a,
                    "detail": json.dumps({"z": 25.0, "layer": i, "median": 1.5}),
                }
            )
    st_s = 2.0 * (1 + 0.02 * rng.standard_normal(n))
    return _frame(
        schema.TABLE_STEPS,
        {
            "step": step_S,
            "time": T0 + 2.0 * step_S,
            "loss": loss,
            "grad_norm": gn,
            "lr": np.full(n, 3e-4),
            "tokens": np.full(n, TOKENS, dtype=np.int64),
            "step_time_s": st_s,
            "data_wait_s": np.abs(0.01 + 0.005 * rng.standard_normal(n)),
            "tokens_per_s": TOKENS / st_s,
            "mfu": 0.41 * 2.0 / st_s,
            "mem_peak_bytes": np.full(n, 70_000_000_000, dtype=np.int64),
            "action": act.astype(str),
        },
        n,
    )


def _routing_parts(
    rng: np.random.Generator, step_S: np.ndarray, gn_S: np.ndarray, share_LE: np.ndarray
) -> tuple[pl.DataFrame, pl.DataFrame]:
    """One part each of the layers (n steps x L layers) and experts (x E experts) tables."""
    n = len(step_S)
    layers, experts = share_LE.shape
    layer_ids = np.arange(layers, dtype=np.int32)
    load = rng.poisson(lam=np.broadcast_to(share_LE * TOKENS * TOP_K / 64, (n, layers, experts)))
    load = load.astype(np.int64)
    mean = load.mean(2)
    maxvio = (load.max(2) - mean) / mean
    p = load / load.sum(2, keepdims=True)
    load_ent = -(p * np.log(np.clip(p, 1e-12, None))).sum(2) / math.log(experts)
    layers_df = _frame(
        schema.TABLE_LAYERS,
        {
            "step": np.repeat(step_S, layers),
            "layer": np.tile(layer_ids, n),
            "grad_norm": np.repeat(gn_S, layers)
            / math.sqrt(layers)
            * (1 + 0.05 * rng.standard_normal(n * layers)),
            "router_entropy": (0.8 * math.log(experts) * load_ent).reshape(-1),
            "load_entropy": load_ent.reshape(-1),
            "maxvio": maxvio.reshape(-1),
            "dead_experts": (load == 0).sum(2).astype(np.int32).reshape(-1),
            "bias_norm": np.full(n * layers, 0.01),
        },
        n * layers,
    )
    experts_df = _frame(
        schema.TABLE_EXPERTS,
        {
            "step": np.repeat(step_S, layers * experts),
            "layer": np.tile(np.repeat(layer_ids, experts), n),
            "expert": np.tile(np.arange(experts, dtype=np.int32), n * layers),
            "load": load.reshape(-1),
            "bias": np.tile((0.001 * rng.standard_normal((layers, experts))).reshape(-1), n),
        },
        n * layers * experts,
    )
    return layers_df, experts_df


def _frame(table: str, cols: dict[str, Any], n: int) -> pl.DataFrame:
    """The table's stored frame; a column this bench does not simulate (precursors) is NaN."""
    missing = {c: np.full(n, np.nan) for c in schema.TABLE_COLUMNS[table] if c not in cols}
    return table_frame(table, {**cols, **missing})


def _meta(
    run_id: str, status: str, steps: int, layers: int, experts: int, final_loss: float
) -> dict[str, Any]:
    return {
        "run_id": run_id,
        "status": status,
        "schema_version": schema.SCHEMA_VERSION,
        "updated_at": T0 + 2.0 * steps,
        "started_at": T0,
        "final_step": steps - 1,
        "final_loss": final_loss,
        "config": {
            "model": {"layers": layers, "experts": experts, "top_k": TOP_K},
            "train": {"steps": steps},
        },
        "env": ENV,
    }
