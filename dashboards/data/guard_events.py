"""The guard's events as the charts show them: the actions marked on the loss and grad-norm
lines, the timeline strip's rows, and the evidence as hover text. Pure: no streamlit, no I/O."""

from __future__ import annotations

import json
import math
from typing import Any

import polars as pl

from guard.core import actions, schema

# Actions marked on the charts (every event that names one, evidence merged per step and action).
# Counting them is guard/core/actions.py's job: one definition for the CLI, meta.json, app and /metrics.
ACTIVE_ACTIONS = (
    schema.ACT_SKIP,
    schema.ACT_ROLLBACK,
    schema.ACT_BIAS_CORRECT,
    schema.ACT_LR_COOLDOWN,
    schema.ACT_HALT,
    schema.ACT_CLIP,
)


def parse_detail(detail: str | None) -> dict[str, Any]:
    if not detail:
        return {}
    try:
        out = json.loads(detail)
    except (json.JSONDecodeError, TypeError):
        return {"detail": str(detail)[:200]}
    return out if isinstance(out, dict) else {"detail": out}


def fmt_value(v: Any) -> str:
    if isinstance(v, float):
        if not math.isfinite(v):
            return str(v)
        return f"{v:.4g}"
    if isinstance(v, list | tuple):
        return "[" + ", ".join(fmt_value(x) for x in v[:12]) + (", ..." if len(v) > 12 else "") + "]"
    return str(v)


def evidence_text(row: dict[str, Any]) -> str:
    """One event as hover HTML: what fired, value vs threshold, then the JSON evidence."""
    head = row.get("kind", "")
    if row.get("detector"):
        head += f" {row['detector']}"
    parts = [f"<b>{head}</b>"]
    v, t = row.get("value"), row.get("threshold")
    if v is not None and isinstance(v, float) and (math.isfinite(v) or (t is not None and math.isfinite(t))):
        parts.append(f"value {fmt_value(v)} vs threshold {fmt_value(t)}")
    elif isinstance(v, float) and math.isnan(v) and row.get("detector") == schema.DET_NONFINITE:
        parts.append("value non-finite")
    acted = row.get("action") in ACTIVE_ACTIONS
    for k, val in parse_detail(row.get("detail")).items():
        if k == "severity":
            # the detector's default level, not what happened: a "warning" that skipped the step
            # read as if nothing was done. What the guard did is the mark's (or the line's) action.
            if acted:
                continue
            val = f"{val} (recorded, no action)" if row.get("kind") == schema.EV_VERDICT else val
        parts.append(f"{k}: {fmt_value(val)}")
    return "<br>".join(parts)


def misbehaving_layer(events: pl.DataFrame) -> int | None:
    """The MoE layer the routing detectors flagged most (ties: the earliest), else the layer a bias
    correction last targeted; None when no event names a layer. The expert-load panel opens on it."""
    if events.height == 0:
        return None
    routing = events.filter(
        ((pl.col("kind") == schema.EV_VERDICT) & pl.col("detector").is_in(list(schema.COLLAPSE_DETECTORS)))
        | (pl.col("action") == schema.ACT_BIAS_CORRECT)
    )
    counts: dict[int, int] = {}
    for d in routing["detail"].to_list():
        layer = parse_detail(d).get("layer")
        if isinstance(layer, int):
            counts[layer] = counts.get(layer, 0) + 1
    return max(counts, key=lambda k: (counts[k], -k)) if counts else None


def action_marks(events: pl.DataFrame, steps: pl.DataFrame) -> pl.DataFrame:
    """One row per (step, action) the guard took, with y positions and the evidence as hover.

    A verdict and the action event it caused are merged into one mark (same step, same
    action). Marks follow guard/core/actions.py's definition, the one every count uses: skip /
    rollback / halt as the step's row says (a rollback that found no snapshot and skipped is a
    skip mark, the fallback in its hover; no mark where the row says the update was applied),
    bias_correct / lr_cooldown only where an action event started one. `y_loss` / `y_grad_norm` are the series values at that step; where the value is
    non-finite (the NaN that was skipped) the mark is pinned to the series' finite maximum and
    `nf_loss` / `nf_grad_norm` say so (`nonfinite`: either), so the chart can label it.
    """
    sch = {
        "step": pl.Int64,
        "action": pl.String,
        "hover": pl.String,
        "y_loss": pl.Float64,
        "y_grad_norm": pl.Float64,
        "nf_loss": pl.Boolean,
        "nf_grad_norm": pl.Boolean,
        "nonfinite": pl.Boolean,
    }
    cols = list(sch)
    if events.height == 0:
        return pl.DataFrame(schema=sch)
    ev = events.filter(pl.col("action").is_in(ACTIVE_ACTIONS))
    decided = _step_decisions(steps, ev["step"])
    started = {  # corrections the policy started: an action event each (a verdict alone started none)
        (int(r["step"]), r["action"])
        for r in ev.iter_rows(named=True)
        if actions.is_event_action(r["kind"], r["action"])
    }
    rows: dict[tuple[int, str], list[str]] = {}
    for r in ev.iter_rows(named=True):
        step, action = int(r["step"]), r["action"]
        if action in actions.STEP_ACTIONS:  # what happened to the update is the step row's word
            row = decided.get(step, action)
            if action == schema.ACT_BIAS_CORRECT:
                # a correction's own event keeps its name (a new run's row says bias_correct too; a
                # run recorded before issue #28 has it on another row); a verdict is its evidence
                if r["kind"] != schema.EV_ACTION and row != action:
                    continue
            else:
                action = row
            if action not in actions.STEP_ACTIONS:
                continue  # the step applied its update: this event is evidence (the timeline shows it)
        elif action in actions.EVENT_ACTIONS and (step, action) not in started:
            continue  # a verdict during a correction already under way: evidence, not a new correction
        rows.setdefault((step, action), []).append(evidence_text(r))
    if not rows:
        return pl.DataFrame(schema=sch)
    marks = pl.DataFrame(
        {
            "step": [k[0] for k in rows],
            "action": [k[1] for k in rows],
            "hover": [
                f"<b>{k[1].upper()}</b> at step {k[0]}<br>" + "<br>—<br>".join(dict.fromkeys(v))
                for k, v in rows.items()
            ],
        },
        schema={"step": pl.Int64, "action": pl.String, "hover": pl.String},
    )
    s = steps.select("step", "loss", "grad_norm").unique("step", keep="last")
    out = marks.join(s, on="step", how="left")
    lmax = steps["loss"].filter(steps["loss"].is_finite()).max() if steps.height else None
    gmax = steps["grad_norm"].filter(steps["grad_norm"].is_finite()).max() if steps.height else None
    return (
        out.with_columns(
            nf_loss=~pl.col("loss").is_finite().fill_null(False),
            nf_grad_norm=~pl.col("grad_norm").is_finite().fill_null(False),
            nonfinite=~(pl.col("loss").is_finite() & pl.col("grad_norm").is_finite()).fill_null(False),
            y_loss=pl.when(pl.col("loss").is_finite())
            .then(pl.col("loss"))
            .otherwise(pl.lit(lmax, pl.Float64)),
            y_grad_norm=pl.when(pl.col("grad_norm").is_finite())
            .then(pl.col("grad_norm"))
            .otherwise(pl.lit(gmax, pl.Float64)),
        )
        .select(cols)
        .sort("step")
    )


def _step_decisions(steps: pl.DataFrame, at: pl.Series) -> dict[int, str]:
    """step -> its row's decision (apply, skip, ...), for the steps in `at`; {} without the column."""
    if "action" not in steps.columns or steps.height == 0 or at.len() == 0:
        return {}
    rows = steps.filter(pl.col("step").is_in(at.unique().implode())).select("step", "action").drop_nulls()
    return dict(zip(rows["step"].to_list(), rows["action"].to_list(), strict=True))


def shown_step(kind: str, step: int) -> int:
    """The step an event is shown at. checkpoint-N holds steps 0..N-1 and is recorded at step N:
    it is shown at the last step it holds, so a 20-step run's final checkpoint (step 20) is on the
    run's axis (style.step_range) and the events table says the step the chart does."""
    return step - 1 if kind == schema.EV_CHECKPOINT and step > 0 else step


def shown_steps() -> pl.Expr:
    """shown_step over an events frame's rows, as its `step` column."""
    return (
        pl.when((pl.col("kind") == schema.EV_CHECKPOINT) & (pl.col("step") > 0))
        .then(pl.col("step") - 1)
        .otherwise(pl.col("step"))
        .alias("step")
    )


def timeline_rows(events: pl.DataFrame) -> pl.DataFrame:
    """Events for the timeline strip: one dot per (step, lane, kind), lane = detector for verdicts
    else kind. Events that would stack on one dot (a detector flagging several layers at one step)
    share it, their evidence one after another in its hover, so none is hidden under another."""
    sch = {"step": pl.Int64, "lane": pl.String, "kind": pl.String, "hover": pl.String}
    if events.height == 0:
        return pl.DataFrame(schema=sch)
    dots: dict[tuple[int, str, str], list[str]] = {}
    for r in events.iter_rows(named=True):
        lane = r["detector"] if r["kind"] == schema.EV_VERDICT else r["kind"]
        text = evidence_text(r) + (
            f"<br>action: {r['action']}" if r["action"] not in (schema.ACT_NONE, "", None) else ""
        )
        step = shown_step(r["kind"], int(r["step"]))
        if step != int(r["step"]):
            text += f"<br>saved after step {step}"
        dots.setdefault((step, lane, r["kind"]), []).append(text)
    return pl.DataFrame(
        {
            "step": [k[0] for k in dots],
            "lane": [k[1] for k in dots],
            "kind": [k[2] for k in dots],
            "hover": [
                f"step {k[0]}" + (f" ({len(v)} events)" if len(v) > 1 else "") + "<br>" + "<br>—<br>".join(v)
                for k, v in dots.items()
            ],
        },
        schema=sch,
    )
