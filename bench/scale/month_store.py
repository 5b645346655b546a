"""A long run exactly as the in-process run store leaves it (issue #38), built fast enough for a
month of Trinity (1M steps of 58 x 256 experts) in minutes, for bench/scale/month_run.py and the
tests of the read side. Writes docs/BENCHMARKS.md: no section of its own; it builds the store of
Long runs and store size › Reading a long run (`bench/scale/month_run.py`).

Two paths over the same rows (bench/scale/big_run.py's plausible values, as StepReports, events
and rank rows; deterministic in the shape and seed):

- `fast=False`: the real writer path, RunStore.add_event / add_rank_rows / add_step / close with
  the `[store]` policy: what a training job leaves. Hours at Trinity shape (~9 s of upkeep per
  1,000-step segment).
- `fast=True` (default): the same flushes (RunStore's cadence: every 50 steps, and at a step with
  events), written through the writer's own functions (guard/store/writer.py table_frame,
  split_by_segment's naming, write_part_file), and the real StoreMaintainer after each flush: it
  compacts, rolls up, retires, merges rollup blocks and keeps summary.json exactly as in a job.
  Only one thing is skipped: a segment that is retired by the end of the run and of a kind
  ("quiet", or "incident" at the same offset) already built is *tiled*: its layers / experts /
  ranks rows are not generated (their seqs are taken as RunStore would), and what the
  maintainer would have left of them is the template segment's, shifted: the rows its incident
  windows keep (the retirement then rewrites that part, as in a job) and its rollups (10-step
  ones only where they outlive the r10 window). Its steps and events rows are generated and go
  through the real path, so loss curves, incidents and summary.json are the run's own. fsync is
  skipped (a bench store need not survive a power cut; the bytes are the same).

tests/bench/test_month_run.py builds a small shape both ways and checks that the stores are the
same (file names per table and tier, schemas, rows, rollup extremes, summary.json).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from bench.scale.big_run import TOKENS, TOP_K, _meta, _steps_part
from guard.core import schema
from guard.core.events import Event
from guard.core.report import StepReport
from guard.core.rows import expert_columns, layer_columns, steps_columns
from guard.store import layout, retention, summary
from guard.store.maintain import ROLLUP_BLOCK_SEGMENTS, StoreMaintainer
from guard.store.policy import StoreConfig
from guard.store.runstore import RunStore
from guard.store.writer import table_frame, write_part_file

SEGMENT = layout.SEGMENT_STEPS
FLUSH_EVERY = 50  # RunStore's default flush_every
# The collector's copy: its checkpoint (every 1 s) writes one part per table of the rows pending; at
# Trinity's ~3 s step that is one step's rows a checkpoint (guard/collector/journal.py commit:
# write_parts, then the same StoreMaintainer's `wrote`). A build with flush_every 1 is that path.
COLLECTOR_FLUSH_EVERY = 1
THINNED = schema.THINNED_TABLES
_ROUTING = (schema.TABLE_LAYERS, schema.TABLE_EXPERTS)


def incident_steps(steps: int, every: int) -> list[int]:
    """Where the bench's incidents sit: one every `every` steps, offset so none is on a boundary."""
    return list(range(every // 3, steps, every))


@dataclass(kw_only=True, slots=True)
class Plan:
    """Which segments are generated and which are tiled from a template of their kind."""

    steps: int
    policy: StoreConfig
    incidents: list[int]
    tile: bool
    kinds: dict[int, str] = field(default_factory=dict)
    templates: dict[str, int] = field(default_factory=dict)
    tiled: set[int] = field(default_factory=set)

    def __post_init__(self) -> None:
        segs = -(-self.steps // SEGMENT)
        inc_segs = {s // SEGMENT for s in self.incidents}
        self.kinds = {k: "incident" if k in inc_segs else "quiet" for k in range(segs)}
        if not self.tile:
            return
        # incident segments are alike (one template) when every incident sits at one offset in
        # its segment with its window inside it; else each is generated
        offsets = {s % SEGMENT for s in self.incidents}
        r = self.policy.incident_steps
        alike = len(offsets) <= 1 and all(r <= o < SEGMENT - r for o in offsets)
        for k in range(self.retired_through() + 1):
            kind = self.kinds[k]
            if kind == "incident" and not alike:
                continue
            if kind in self.templates:
                self.tiled.add(k)
            else:
                self.templates[kind] = k

    def retired_through(self) -> int:
        """The last segment whose raw rows the policy has retired when the run ends (-1: none)."""
        p, last = self.policy, self.steps - 1
        if not p.retires_raw:
            return -1
        rolled = (last - p.compact_lag_steps + 1) // SEGMENT - 1
        return min(rolled, layout.segment_of(last - p.raw_window_steps + 1) - 1)


@dataclass(slots=True)
class Segment:
    """One segment's rows in the order a training loop hands them to the store."""

    reports: list[StepReport]
    events: dict[int, list[Event]]
    ranks: dict[int, dict[str, list]]


class MonthRows:
    """The run's rows, segment by segment (call `segment` for 0, 1, ... in order). Steps and
    events are generated for every segment; routing and rank rows are generated, copied from the
    segment's template (`routing="template"`, the real path of a tiled segment) or left out
    (`"none"`, the fast path of a tiled one)."""

    def __init__(
        self, plan: Plan, *, layers: int, experts: int, ranks: int, rank_every: int, seed: int
    ) -> None:
        self.plan, self.layers, self.experts, self.ranks, self.rank_every = (
            plan,
            layers,
            experts,
            ranks,
            rank_every,
        )
        self.rng_s = np.random.default_rng(seed)
        self.rng_r = np.random.default_rng([seed, 1])
        self.faults = {s: i for i, s in enumerate(plan.incidents)}
        self.share_LE = self.rng_r.dirichlet(np.full(experts, 50.0), size=layers)
        self._tmpl: dict[str, Segment] = {}  # kind -> its template's rows (steps relative)

    def segment(self, k: int, routing: str, *, keep_template: bool = False) -> Segment:
        lo, hi = k * SEGMENT, min((k + 1) * SEGMENT, self.plan.steps)
        ev_rows: list[dict[str, Any]] = []
        reports: list[StepReport] = []
        for first in range(lo, hi, FLUSH_EVERY):
            step_S = np.arange(first, min(first + FLUSH_EVERY, hi), dtype=np.int64)
            reports += _reports(_steps_part(self.rng_s, step_S, self.faults, ev_rows))
        events: dict[int, list[Event]] = {}
        for r in ev_rows:
            detail = dict(json.loads(r["detail"]))
            ev = Event(
                step=int(r["step"]), kind=r["kind"], detector=r["detector"], value=r["value"],
                threshold=r["threshold"], action=r["action"], detail=detail, time=r["time"],
            )  # fmt: skip
            events.setdefault(ev.step, []).append(ev)
        seg = Segment(reports, events, {})
        if routing == "gen":
            self._routing(seg)
            if keep_template:
                self._tmpl[self.plan.kinds[k]] = _shifted(seg, -lo)
        elif routing == "template":
            t = _shifted(self._tmpl[self.plan.kinds[k]], lo)
            for rep, tr in zip(seg.reports, t.reports, strict=True):
                _copy_routing(rep, tr)
            seg.ranks = t.ranks
        return seg

    def _routing(self, seg: Segment) -> None:
        L, E = self.layers, self.experts
        moe = np.arange(L, dtype=np.int32)
        incidents = set(self.plan.incidents)
        for c in range(0, len(seg.reports), FLUSH_EVERY):
            reps = seg.reports[c : c + FLUSH_EVERY]
            n = len(reps)
            self.share_LE = np.clip(
                self.share_LE * np.exp(0.02 * self.rng_r.standard_normal((L, E))), 1e-5, None
            )
            self.share_LE /= self.share_LE.sum(1, keepdims=True)
            load = self.rng_r.poisson(np.broadcast_to(self.share_LE * TOKENS * TOP_K / 64, (n, L, E)))
            for j, rep in enumerate(reps):
                if rep.step in incidents:
                    load[j, :, 0] = 0  # a dead expert at every incident
            mean = load.mean(2)
            p = load / load.sum(2, keepdims=True)
            ent = -(p * np.log(np.clip(p, 1e-12, None))).sum(2) / math.log(E)
            gn = (
                np.array([r.grad_norm for r in reps])[:, None]
                / math.sqrt(L)
                * (1 + 0.05 * self.rng_r.standard_normal((n, L)))
            )
            bias = 0.001 * self.rng_r.standard_normal((L, E))
            for j, rep in enumerate(reps):
                rep.layer_ids_L = rep.moe_layer_ids_M = moe
                rep.layer_grad_norm_L = gn[j]
                rep.router_entropy_M = 0.8 * math.log(E) * ent[j]
                rep.load_entropy_M = ent[j]
                rep.maxvio_M = (load[j].max(1) - mean[j]) / mean[j]
                rep.dead_experts_M = (load[j] == 0).sum(1).astype(np.int32)
                rep.bias_norm_M = np.full(L, 0.01)
                rep.load_ME = load[j]
                rep.bias_ME = bias
        if self.ranks:
            for rep in seg.reports:
                if rep.step % self.rank_every == 0:
                    m = self.ranks
                    seg.ranks[rep.step] = {
                        "step": [rep.step] * m,
                        "rank": list(range(m)),
                        "step_time_s": (2.0 * (1 + 0.02 * self.rng_r.standard_normal(m))).tolist(),
                        "data_wait_s": np.abs(0.01 + 0.005 * self.rng_r.standard_normal(m)).tolist(),
                        "straggler_score": self.rng_r.standard_normal(m).tolist(),
                        "tokens": [2048] * m,
                    }


def _reports(steps: pl.DataFrame) -> list[StepReport]:
    names = [c for c in schema.STEPS_COLUMNS if c in steps.columns]
    return [StepReport(**{c: row[c] for c in names}) for row in steps.iter_rows(named=True)]


_ROUTING_FIELDS = (
    "layer_ids_L", "layer_grad_norm_L", "moe_layer_ids_M", "router_entropy_M", "load_entropy_M",
    "maxvio_M", "dead_experts_M", "bias_norm_M", "load_ME", "bias_ME",
)  # fmt: skip


def _copy_routing(dst: StepReport, src: StepReport) -> None:
    for f in _ROUTING_FIELDS:
        setattr(dst, f, getattr(src, f))


def _shifted(seg: Segment, off: int) -> Segment:
    reps = []
    for r in seg.reports:
        c = StepReport(
            step=r.step + off, time=r.time, loss=r.loss, grad_norm=r.grad_norm, lr=r.lr, tokens=r.tokens
        )
        _copy_routing(c, r)
        reps.append(c)
    ranks = {s + off: {**cols, "step": [s + off] * len(cols["step"])} for s, cols in seg.ranks.items()}
    return Segment(reps, {}, ranks)


# ---- the fast path -------------------------------------------------------------------------
class _TiledMaintainer(StoreMaintainer):
    """The real upkeep; after a template segment's, what it left of the routing and rank rows is
    kept; after a tiled segment's, that is written for it (shifted)."""

    def __init__(self, run_dir: Path, policy: StoreConfig, build: _FastBuild) -> None:
        self.build = build
        super().__init__(run_dir, policy)

    def _segment(self, k: int, *, compact: bool = True) -> None:
        super()._segment(k, compact=compact)
        b = self.build
        if compact and k == b.plan.templates.get(b.plan.kinds[k]) and k not in b.plan.tiled:
            b.capture(self, k)
        elif compact and k in b.plan.tiled:
            b.emit(self, k)


class _FastBuild:
    def __init__(self, d: Path, plan: Plan, rows: MonthRows, flush_every: int = FLUSH_EVERY) -> None:
        self.d, self.plan, self.rows, self.flush_every = d, plan, rows, flush_every
        self.seq = 0
        self.maint: _TiledMaintainer | None = None
        self.pieces: dict[tuple[str, int], list[tuple[int, int]]] = {}  # (table, segment) -> (first, seq)
        self.kept: dict[str, dict[str, pl.DataFrame]] = {}  # kind -> table -> kept rows (steps from 0)
        self.rolled: dict[str, dict[tuple[str, int], pl.DataFrame]] = {}  # kind -> (table, res) -> rollup
        self.extremes: dict[str, dict[str, list[float]]] = {}
        self._reset()

    def _reset(self) -> None:
        self.reps: list[StepReport] = []
        self.events: list[Event] = []
        self.rank_cols: list[dict[str, list]] = []
        self.first: dict[str, int | None] = dict.fromkeys(schema.TABLES)
        self.since = 0

    def run(self) -> None:
        for k in range(len(self.plan.kinds)):
            tiled = k in self.plan.tiled
            seg = self.rows.segment(k, "none" if tiled else "gen")
            for rep in seg.reports:  # the order RunStore is called in (as the real path)
                s = rep.step
                for ev in seg.events.get(s, []):
                    self.first[schema.TABLE_EVENTS] = _first(self.first[schema.TABLE_EVENTS], ev.step)
                    self.events.append(ev)
                if self.rows.ranks and s % self.rows.rank_every == 0:
                    self.first[schema.TABLE_RANKS] = _first(self.first[schema.TABLE_RANKS], s)
                    if not tiled:
                        self.rank_cols.append(seg.ranks[s])
                for t in (schema.TABLE_STEPS, *_ROUTING):
                    self.first[t] = _first(self.first[t], s)
                self.reps.append(rep)
                self.since += 1
                if self.since >= self.flush_every or seg.events.get(s):
                    self.flush()
        self.flush()

    def flush(self) -> None:
        written: dict[str, pl.DataFrame] = {}
        reps, steps_of = self.reps, [r.step for r in self.reps]
        for t in schema.TABLES:
            first = self.first[t]
            if first is None:
                continue
            if t == schema.TABLE_STEPS:
                df = table_frame(t, steps_columns(reps))
                conceptual = steps_of
            elif t == schema.TABLE_EVENTS:
                df = table_frame(t, {c: [e.row()[c] for e in self.events] for c in schema.EVENTS_COLUMNS})
                conceptual = [e.step for e in self.events]
            elif t in _ROUTING:
                real = [r for r in reps if r.load_ME.size]
                cols = (layer_columns if t == schema.TABLE_LAYERS else expert_columns)(real)
                df = table_frame(t, cols)
                conceptual = steps_of
            else:  # ranks
                cols = {c: [v for rc in self.rank_cols for v in rc[c]] for c in schema.RANKS_COLUMNS}
                df = table_frame(t, cols)
                conceptual = [s for s in steps_of if s % self.rows.rank_every == 0]
            self._write(t, df, conceptual, first)
            if t in (schema.TABLE_STEPS, schema.TABLE_EVENTS):
                written[t] = df
        self._reset()
        if self.maint is None:  # RunStore's first upkeep opens the maintainer (it counts from disk)
            self.maint = _TiledMaintainer(self.d, self.plan.policy, self)
            self.maint.doc["status"] = schema.STATUS_RUNNING
            self.maint.upkeep()
            self.maint.save()
        else:
            self.maint.doc["status"] = schema.STATUS_RUNNING
            self.maint.wrote(written)

    def _write(self, t: str, df: pl.DataFrame, conceptual: list[int], first: int) -> None:
        """writer.write_parts of the table's whole flush (one part per segment it spans), where
        a tiled segment's part is only counted (its seq taken), not written."""
        d = self.d / t
        d.mkdir(parents=True, exist_ok=True)
        segs = sorted({layout.segment_of(s) for s in conceptual})
        for i, k in enumerate(segs):
            name_first = min(s for s in conceptual if layout.segment_of(s) == k)
            if i == 0:
                name_first = min(name_first, first)
            if not (t in THINNED and k in self.plan.tiled):
                piece = df.filter(pl.col("step") // SEGMENT == k) if len(segs) > 1 else df
                write_part_file(d / layout.part_name(name_first, self.seq), piece)
                if t in schema.ROLLUP_TABLES:
                    _note_extremes(self.extremes, t, piece)
            self.pieces.setdefault((t, k), []).append((name_first, self.seq))
            self.seq += 1
        layout.fsync_dir(d)

    def _windows(self, m: StoreMaintainer, k: int) -> list[tuple[int, int]]:
        lo, hi = k * SEGMENT, (k + 1) * SEGMENT - 1
        return [
            (max(a, lo) - lo, min(b, hi) - lo)
            for a, b in retention.kept_windows(m.doc)
            if a <= hi and b >= lo
        ]

    def capture(self, m: StoreMaintainer, k: int) -> None:
        """What the template segment's upkeep left of its routing and rank rows, steps from 0."""
        kind, lo, hi = self.plan.kinds[k], k * SEGMENT, (k + 1) * SEGMENT - 1
        rel = self._windows(m, k)
        kept: dict[str, pl.DataFrame] = {}
        for t in THINNED:
            parts = [p for pi, p in layout.live_parts(self.d / t) if lo <= pi.first_step <= hi]
            if parts:
                df = pl.read_parquet(parts).with_columns(pl.col("step") - lo)
                kept[t] = df.filter(retention.keep_expr(rel))
        self.kept[kind] = kept
        rolled: dict[tuple[str, int], pl.DataFrame] = {}
        for t in THINNED:
            for res in layout.ROLLUP_RESOLUTIONS:
                p = layout.rollup_table_dir(self.d, t, res) / layout.part_name(lo, k)
                if p.is_file():
                    rolled[(t, res)] = pl.read_parquet(p).with_columns(
                        pl.col(c) - lo for c in ("step", "step_lo", "step_hi")
                    )
        self.rolled[kind] = rolled

    def emit(self, m: StoreMaintainer, k: int) -> None:
        """A tiled segment: the template's kept rows (as its compacted part) and rollups, shifted."""
        kind, lo, hi = self.plan.kinds[k], k * SEGMENT, (k + 1) * SEGMENT - 1
        rel = self._windows(m, k)
        for t, df in self.kept[kind].items():
            pieces = self.pieces.get((t, k), [])
            if not pieces:
                continue
            seqs = [s for _, s in pieces]
            name = (
                layout.compacted_part_name(lo, hi, min(seqs), max(seqs))
                if len(pieces) > 1
                else layout.part_name(*pieces[0])
            )
            out = df.filter(retention.keep_expr(rel)).with_columns(pl.col("step") + lo)
            write_part_file(self.d / t / name, out)
            layout.fsync_dir(self.d / t)
        last = self.plan.steps - 1
        windows = self.plan.policy.windows()
        for (t, res), df in self.rolled[kind].items():
            w = windows[res]
            if w and res not in ROLLUP_BLOCK_SEGMENTS and lo + SEGMENT - 1 < last - w:
                continue  # the policy deletes it before the run ends: never written
            rd = layout.rollup_table_dir(self.d, t, res)
            write_part_file(
                rd / layout.part_name(lo, k),
                df.with_columns(pl.col(c) + lo for c in ("step", "step_lo", "step_hi")),
            )
            layout.fsync_dir(rd)


def _first(cur: int | None, step: int) -> int:
    return step if cur is None else cur


# ---- both paths ----------------------------------------------------------------------------
def write_month_run(
    run_dir: str | Path,
    *,
    steps: int = 10_000,
    layers: int = 58,
    experts: int = 256,
    ranks: int = 2048,
    rank_every: int = 20,
    incident_every: int = 25_000,
    recent: int | None = None,
    radius: int | None = None,
    r10_window: int | None = None,
    policy: StoreConfig | None = None,
    tile: bool = True,
    fast: bool = True,
    seed: int = 0,
    status: str = schema.STATUS_FINISHED,
    flush_every: int = FLUSH_EVERY,
) -> dict[str, Any]:
    """Build the run as RunStore leaves it under `policy` (default: the `[store]` defaults;
    `flush_every` steps a flush: FLUSH_EVERY the job's writer, COLLECTOR_FLUSH_EVERY the collector's copy;
    `recent`, `radius`, `r10_window` override raw_window_steps, incident_steps,
    r10_window_steps). Returns {"ranges": full-fidelity ranges (summary.json), "incidents":
    steps, "extremes": {table: {column: (min, max)}} of the raw rows written, "tiled": segments
    tiled}."""
    base = policy or StoreConfig()
    over = {"raw_window_steps": recent, "incident_steps": radius, "r10_window_steps": r10_window}
    policy = dataclasses.replace(base, **{k: v for k, v in over.items() if v is not None})
    d = Path(run_dir)
    incidents = incident_steps(steps, incident_every) if incident_every else []
    plan = Plan(steps=steps, policy=policy, incidents=incidents, tile=tile)
    rows = MonthRows(plan, layers=layers, experts=experts, ranks=ranks, rank_every=rank_every, seed=seed)
    meta = _meta(d.name, schema.STATUS_RUNNING, steps, layers, experts, math.nan)
    meta["config"]["guard"] = {}
    if fast:
        with _no_fsync():
            extremes = _fast(d, plan, rows, meta, status, flush_every)
    else:
        extremes = _real(d, plan, rows, meta, status, flush_every)
    doc = summary.read_summary(d) or {}
    ext = {t: {c: (lo_hi[0], lo_hi[1]) for c, lo_hi in cols.items()} for t, cols in extremes.items()}
    ranges = [tuple(r) for r in doc.get("full_fidelity", [])]
    return {"ranges": ranges, "incidents": incidents, "extremes": ext, "tiled": sorted(plan.tiled)}


@contextlib.contextmanager
def _no_fsync() -> Iterator[None]:
    """A bench store need not survive a power cut: the fast build skips fsync (a fifth of its
    time on a busy disk). The files and their bytes are the same."""
    real = os.fsync
    os.fsync = lambda fd: None  # type: ignore[assignment]
    try:
        yield
    finally:
        os.fsync = real


def _fast(
    d: Path, plan: Plan, rows: MonthRows, meta: dict[str, Any], status: str, flush_every: int = FLUSH_EVERY
) -> dict[str, Any]:
    """The fast path (the module docstring): returns the raw rows' extremes."""
    d.mkdir(parents=True, exist_ok=True)
    for t in schema.TABLES:
        (d / t).mkdir(exist_ok=True)
    layout.atomic_write_json(d / schema.META_FILE, {**meta, "schema_version": schema.SCHEMA_VERSION})
    b = _FastBuild(d, plan, rows, flush_every)
    b.run()
    assert b.maint is not None
    _finish_meta(d, status, b.maint.doc.get("last_loss"))
    b.maint.finish(status)
    return b.extremes


def _finish_meta(d: Path, status: str, loss: Any) -> None:
    from guard.store.reader import read_meta

    meta = read_meta(d) or {}
    meta.update(status=status, final_loss=loss)
    layout.atomic_write_json(d / schema.META_FILE, meta)


def _real(
    d: Path, plan: Plan, rows: MonthRows, meta: dict[str, Any], status: str, flush_every: int = FLUSH_EVERY
) -> dict[str, Any]:
    """The real writer path over the same rows (tiled segments get their template's routing)."""
    store = RunStore(d, flush_every=flush_every, policy=plan.policy)
    store.write_meta(meta)
    extremes: dict[str, dict[str, list[float]]] = {}
    for k in range(len(plan.kinds)):
        keep = plan.templates.get(plan.kinds[k]) == k
        seg = rows.segment(k, "template" if k in plan.tiled else "gen", keep_template=keep)
        for t, df in _segment_frames(seg).items():
            _note_extremes(extremes, t, df)
        for rep in seg.reports:
            for ev in seg.events.get(rep.step, []):
                store.add_event(ev)
            if rep.step in seg.ranks:
                store.add_rank_rows(seg.ranks[rep.step])
            store.add_step(rep)
    store.flush(wait=True)
    store.close(status, final_loss=(summary.read_summary(d) or {}).get("last_loss"))
    return extremes


def _segment_frames(seg: Segment) -> dict[str, pl.DataFrame]:
    out = {
        schema.TABLE_STEPS: table_frame(schema.TABLE_STEPS, steps_columns(seg.reports)),
        schema.TABLE_LAYERS: table_frame(schema.TABLE_LAYERS, layer_columns(seg.reports)),
        schema.TABLE_EXPERTS: table_frame(schema.TABLE_EXPERTS, expert_columns(seg.reports)),
    }
    if seg.ranks:
        rk = list(seg.ranks.values())
        out[schema.TABLE_RANKS] = table_frame(
            schema.TABLE_RANKS, {c: [v for r in rk for v in r[c]] for c in schema.RANKS_COLUMNS}
        )
    return out


def _note_extremes(out: dict[str, dict[str, list[float]]], table: str, df: pl.DataFrame) -> None:
    cols = out.setdefault(table, {})
    for c in schema.rollup_value_columns(table):
        v = df[c].cast(pl.Float64).fill_nan(None)
        lo, hi = v.min(), v.max()
        if lo is None:
            continue
        cur = cols.setdefault(c, [math.inf, -math.inf])
        cur[0], cur[1] = min(cur[0], float(lo)), max(cur[1], float(hi))  # type: ignore[arg-type]
