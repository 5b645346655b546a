"""A long run in the long-run store layout (issue #38), built in bulk for bench/scale/month_run.py
and the tests of the read side.

What a month of Trinity leaves behind once the writer has rolled up, retired and compacted it:
per table one part per 1,000-step segment (compacted), the steps and events tables whole, the
layers / experts / groups / ranks rows at full fidelity only in the recent window and +-radius
steps around every incident, and everything older as 10 / 100 / 1,000-step rollups built by the
writer's own code (guard/store/rollup.py SegmentRoller, one segment at a time), summary.json by
guard/store/summary.py. Rows are bench/scale/big_run.py's (plausible, not physical); Parquet lands
through guard/store/writer.py. Row by row through RunStore would take days at 58 x 256.

Writes docs/BENCHMARKS.md: no section of its own; the long-run store of Long runs and store size ›
Reading a long run (`bench/scale/month_run.py`).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from bench.scale.big_run import _frame, _meta, _routing_parts, _steps_part
from guard.core import schema
from guard.store import layout, summary
from guard.store.rollup import SegmentRoller
from guard.store.writer import write_part_file

SEGMENT = layout.SEGMENT_STEPS
CHUNK = 50  # steps generated at once (memory: CHUNK x layers x experts rows)


def incident_steps(steps: int, every: int) -> list[int]:
    """Where the bench's incidents sit: one every `every` steps, offset so none is on a boundary."""
    return list(range(every // 3, steps, every))


def full_fidelity(steps: int, incidents: list[int], recent: int, radius: int) -> list[tuple[int, int]]:
    """Merged inclusive ranges kept at full fidelity: +-radius around each incident, the recent window."""
    spans = sorted([(max(0, s - radius), min(steps - 1, s + radius)) for s in incidents])
    spans.append((max(0, steps - recent), steps - 1))
    out: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if out and a <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out


def _kept(df: pl.DataFrame, ranges: list[tuple[int, int]]) -> pl.DataFrame:
    keep = pl.lit(False)
    for a, b in ranges:
        keep = keep | pl.col("step").is_between(a, b)
    return df.filter(keep)


def _ranks_part(rng: np.random.Generator, step_S: np.ndarray, ranks: int, every: int) -> pl.DataFrame | None:
    s = step_S[step_S % every == 0]
    if not len(s) or not ranks:
        return None
    n = len(s) * ranks
    st = 2.0 * (1 + 0.02 * rng.standard_normal(n))
    return _frame(
        schema.TABLE_RANKS,
        {
            "step": np.repeat(s, ranks),
            "rank": np.tile(np.arange(ranks, dtype=np.int32), len(s)),
            "step_time_s": st,
            "data_wait_s": np.abs(0.01 + 0.005 * rng.standard_normal(n)),
            "straggler_score": rng.standard_normal(n),
            "tokens": np.full(n, 2048, dtype=np.int64),
        },
        n,
    )


def write_month_run(
    run_dir: str | Path,
    *,
    steps: int = 10_000,
    layers: int = 58,
    experts: int = 256,
    ranks: int = 2048,
    rank_every: int = 20,
    incident_every: int = 25_000,
    recent: int = 10_000,
    radius: int = 25,
    r10_window: int = 100_000,
    tile: bool = False,
    seed: int = 0,
    status: str = schema.STATUS_FINISHED,
) -> dict[str, Any]:
    """Build the run (defaults: guard/store/policy.py StoreConfig's retention). `tile`: quiet
    segments (no incident, before the recent window) after the first are that one's rows shifted
    (the same files, bytes and rows a generated one has, minutes instead of hours at 1M steps). Returns {"ranges": full-fidelity ranges, "incidents": steps,
    "extremes": {table: {column: (min, max)}} of the raw rows before any was retired}."""
    rng = np.random.default_rng(seed)
    d = Path(run_dir)
    for t in schema.TABLES:
        (d / t).mkdir(parents=True, exist_ok=True)
    incidents = incident_steps(steps, incident_every) if incident_every else []
    # big_run's interventions cycle at these steps (its fault map), so each is an incident
    faults = {s: i for i, s in enumerate(incidents)}
    ranges = full_fidelity(steps, incidents, recent, radius)
    doc = summary.empty_summary()
    ev_rows: list[dict[str, Any]] = []
    share_LE = rng.dirichlet(np.full(experts, 50.0), size=layers)
    seq = 0
    loss_last = math.nan
    extremes: dict[str, dict[str, list[float]]] = {}
    if tile and incident_every % SEGMENT:
        raise ValueError(f"tile needs incident_every a multiple of {SEGMENT}, got {incident_every}")
    # kind ("quiet" / "incident") -> (first step, {(table, res: 0 for raw): frame}, its events)
    templates: dict[str, tuple[int, dict[tuple[str, int], pl.DataFrame], list[dict[str, Any]]]] = {}
    for seg in range(0, steps, SEGMENT):
        old_seg = seg + SEGMENT <= steps - recent
        near = any(seg - radius <= s < seg + SEGMENT + radius for s in incidents)
        kind = "incident" if near else "quiet"
        if tile and old_seg and kind in templates:  # the template's rows, shifted
            tmpl_seg, template, tmpl_ev = templates[kind]
            off = seg - tmpl_seg
            for r in tmpl_ev:
                ev_rows.append({**r, "step": r["step"] + off, "time": r["time"] + 2.0 * off})
            if tmpl_ev:
                summary.add_events(doc, _events(ev_rows[-len(tmpl_ev) :]))
            for (t, res), df in template.items():
                if res == layout.ROLLUP_RESOLUTIONS[0] and r10_window and seg + SEGMENT <= steps - r10_window:
                    continue
                sh = df.with_columns(
                    pl.col(c) + off for c in ("step", "step_lo", "step_hi") if c in df.columns
                )
                if "time" in sh.columns:
                    sh = sh.with_columns(pl.col("time") + 2.0 * off)
                if "loss" in sh.columns:  # on big_run's curve at the new steps (no jump at the seam)
                    s_new = pl.col("step").cast(pl.Float64)
                    sh = sh.with_columns(
                        pl.col("loss") + 9.0 / (s_new + 10).sqrt() - 9.0 / (s_new - off + 10).sqrt()
                    )
                od = d / t if res == 0 else layout.rollup_table_dir(d, t, res)
                write_part_file(od / layout.part_name(seg, seq), sh)
                seq += 1
                if t == schema.TABLE_STEPS:
                    summary.add_steps(doc, sh)
            continue
        rollers = {t: SegmentRoller(t, seg, seg + SEGMENT - 1) for t in schema.ROLLUP_KEYS}
        raw: dict[str, list[pl.DataFrame]] = {t: [] for t in schema.TABLES}
        n_ev = len(ev_rows)
        for first in range(seg, min(seg + SEGMENT, steps), CHUNK):
            step_S = np.arange(first, min(first + CHUNK, seg + SEGMENT, steps), dtype=np.int64)
            steps_df = _steps_part(rng, step_S, faults, ev_rows)
            loss_last = float(steps_df["loss"][-1])
            share_LE = np.clip(share_LE * np.exp(0.02 * rng.standard_normal(share_LE.shape)), 1e-5, None)
            share_LE /= share_LE.sum(1, keepdims=True)
            layers_df, experts_df = _routing_parts(rng, step_S, steps_df["grad_norm"].to_numpy(), share_LE)
            for s in step_S[np.isin(step_S, incidents)]:  # a dead expert at every incident
                experts_df = experts_df.with_columns(
                    load=pl.when((pl.col("step") == int(s)) & (pl.col("expert") == 0))
                    .then(0)
                    .otherwise(pl.col("load"))
                )
            frames = {
                schema.TABLE_STEPS: steps_df,
                schema.TABLE_LAYERS: layers_df,
                schema.TABLE_EXPERTS: experts_df,
            }
            rk = _ranks_part(rng, step_S, ranks, rank_every)
            if rk is not None:
                frames[schema.TABLE_RANKS] = rk
            for t, df in frames.items():
                if t in rollers:
                    rollers[t].feed(df)
                    _note_extremes(extremes, t, df)
                    df = _kept(df, ranges)
                if df.height:
                    raw[t].append(df)
        written: dict[tuple[str, int], pl.DataFrame] = {}
        for t, dfs in raw.items():  # one compacted part per table per segment
            if dfs:
                df = pl.concat(dfs)
                write_part_file(d / t / layout.part_name(int(df["step"].min()), seq), df)  # type: ignore[arg-type]
                seq += 1
                written[(t, 0)] = df
        for t, roller in rollers.items():
            for res, df in roller.frames().items():
                od = layout.rollup_table_dir(d, t, res)
                od.mkdir(parents=True, exist_ok=True)
                write_part_file(od / layout.part_name(seg, seq), df)
                seq += 1
                written[(t, res)] = df
        if tile and old_seg and kind not in templates:
            templates[kind] = (seg, written, ev_rows[n_ev:])
        summary.add_steps(doc, pl.concat(raw[schema.TABLE_STEPS]))
        new_ev = ev_rows[n_ev:]
        if new_ev:
            summary.add_events(doc, _events(new_ev))
    if r10_window:  # the finest rollup is kept for the newest r10_window steps only
        for t in schema.ROLLUP_KEYS:
            for p in layout.rollup_part_files(d, t, layout.ROLLUP_RESOLUTIONS[0]):
                if int(p.name.split("-")[1]) + SEGMENT <= steps - r10_window:
                    p.unlink()
    if ev_rows:
        write_part_file(d / schema.TABLE_EVENTS / layout.part_name(0, seq), _events(ev_rows))
    doc["status"] = status
    doc["full_fidelity"] = [list(r) for r in ranges]
    doc["incidents"] = incidents
    doc["rollups"] = {t: list(layout.ROLLUP_RESOLUTIONS) for t in schema.ROLLUP_KEYS}
    doc["rolled_through"] = steps // SEGMENT - 1
    summary.write_summary(d, doc)
    meta = _meta(d.name, status, steps, layers, experts, loss_last)
    meta["config"]["guard"] = {}
    layout.atomic_write_json(d / schema.META_FILE, meta)
    ext = {t: {c: (lo_hi[0], lo_hi[1]) for c, lo_hi in cols.items()} for t, cols in extremes.items()}
    return {"ranges": ranges, "incidents": incidents, "extremes": ext}


def _events(rows: list[dict[str, Any]]) -> pl.DataFrame:
    return _frame(schema.TABLE_EVENTS, {c: [r[c] for r in rows] for c in schema.EVENTS_COLUMNS}, len(rows))


def _note_extremes(out: dict[str, dict[str, list[float]]], table: str, df: pl.DataFrame) -> None:
    cols = out.setdefault(table, {})
    for c in schema.rollup_value_columns(table):
        v = df[c].cast(pl.Float64).fill_nan(None)
        lo, hi = v.min(), v.max()
        if lo is None:
            continue
        cur = cols.setdefault(c, [math.inf, -math.inf])
        cur[0], cur[1] = min(cur[0], float(lo)), max(cur[1], float(hi))  # type: ignore[arg-type]
