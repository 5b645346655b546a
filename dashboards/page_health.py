"""Run health: one run's loss and grad norm with every guard verdict and action, the precursor
signals, per-layer signals, expert load, throughput, and the events table."""

from __future__ import annotations

import math

import numpy as np
import polars as pl
import streamlit as st

from dashboards import step_axis, ui
from dashboards.data import (
    config,
    guard_events,
    health_steps,
    heatmaps,
    loaders,
    mfu_peak,
    runs,
    shaping,
    side_tables,
    step_zoom,
    warmups,
)
from dashboards.figures.health import goodput_figure, health_timeline, host_figure, perf_figure
from dashboards.figures.heatmap import heatmap, share_colors
from dashboards.figures.nonfinite_marks import nonfinite_steps
from dashboards.figures.precursors import precursor_figure
from dashboards.figures.warmup_marks import shade_warmups, warmup_label
from guard.core import actions, schema
from guard.core.goodput import DEFINITION as GOODPUT_DEFINITION
from guard.store import reader

ROUTING_SIGNALS = ("maxvio", "dead_experts", "router_entropy", "load_entropy")  # the collapse detector's

cfg = config.app_config()
st.title("Run health")
infos = ui.runs_or_stop(cfg)
# runs that can be shown first, so the default pick is useful
by_id = {i.run_id: i for i in sorted(infos, key=lambda i: not (i.readable and i.has_steps))}
run_id = st.selectbox("Run", list(by_id), key="run", bind="query-params")
info = by_id[run_id]
ui.show_problem(info)
if not info.readable or not info.has_steps:
    st.stop()

path, sig = info.path, runs.run_signature(info.path)
# a long run's step charts read what they show (health_steps); a short one reads its steps whole
run_span = health_steps.run_span(path, sig)
if run_span is None:
    st.info(f"Run `{run_id}` has step files but no rows yet.")
    st.stop()
summ = loaders.load_summary(path, sig, every_part=True)  # every part checked (incrementally)
env = info.env
ui.show_damaged(run_id, summ["damaged"])

# ---- headline -------------------------------------------------------------------------
ui.status_badge(info.status, help=f"last write {ui.age(info.updated_at)}")
ui.show_status(info)
peak = mfu_peak.run_peak(env)
mfu = summ["mfu"]
c = st.columns(6)
c[0].metric(
    "steps",
    f"{summ['step'] + 1:,}" if summ["step"] is not None else "—",
    help=None
    if summ["step"] is None
    else f"steps run, as --steps counts them; the last is step {summ['step']:,} (0-based)",
)
c[1].metric(
    "loss",
    "—" if summ["loss"] is None else f"{summ['loss']:.4f}" if math.isfinite(summ["loss"]) else "non-finite",
)
# tokens/s first: it needs no peak, so it is the number every run has and runs can be compared by
c[2].metric(
    "tokens/s",
    f"{summ['tokens_per_s']:,.0f}" if summ["tokens_per_s"] is not None else "—",
    help=ui.TPS_RECENT,
)
c[3].metric(
    "MFU" + (" (artefact)" if mfu is not None and mfu > mfu_peak.MFU_LIMIT else ""),
    f"{100 * mfu:.1f}%" if mfu is not None else "—",
    help=f"{ui.TPS_RECENT}, of peak {peak.label()}. Peak source: {peak.source}",
)
c[4].metric(
    "guard actions",
    summ["actions"],
    help="skipped / rolled-back / halted steps, bias corrections and LR "
    f"cool-downs started (guard/core/actions.py): {actions.summary_text(summ['action_counts'])}",
)
c[5].metric("verdicts", summ["verdicts"])
note = mfu_peak.mfu_note(mfu, peak)
st.caption(
    f"tokens/s and MFU above: {ui.TPS_RECENT}. MFU peak: **{peak.short()}** — {peak.source}"
    + (f". **{note}**" if note else "")
    + (f". {summ['mfu_over']:,} step(s) above 100% (marked in the MFU chart)" if summ.get("mfu_over") else "")
)
st.caption(
    " · ".join(
        f"{k}: **{env[k]}**"
        for k in (
            "torch",
            "device",
            "attention_backend",
            "expert_kernel",
            "compile",
            "dtype",
            "world_size",
            "git_sha",
        )
        if k in env
    )
)
if summ["halts"] and info.status != schema.STATUS_HALTED:  # halted now: show_status said so
    st.warning(
        f"Run `{run_id}` halted itself before ({summ['halts']} halt event(s)) and was resumed; "
        "see the events table for why."
    )
if info.compat == runs.COMPAT_OLDER:
    miss = reader.missing_columns(path, schema.TABLE_STEPS)
    if miss:
        st.caption(f"Not in this run's steps table (older writer): {', '.join(miss)}")

# ---- loss / grad norm with guard marks ------------------------------------------------
marks, timeline = health_steps.marks(path, sig)
first_step, last_step = run_span
evals = side_tables.load_evals(path, sig) if info.tables.get(schema.TABLE_EVALS) else {}
# one step axis for every chart of the page: the run's own steps (style.step_range), and any step
# an evaluation was reported at (one before the first step: an evaluation before training)
span = (first_step, last_step)
if (ev_span := side_tables.eval_step_range(evals)) is not None:
    span = (min(span[0], ev_span[0]), max(span[1], ev_span[1]))
# the zoom (a drag on any step chart, or the sidebar's slider): every step chart draws `view`
view = step_axis.control(span)
zoomed = step_zoom.is_zoomed(view, span)
if zoomed:
    st.caption(
        f"Zoomed to {step_zoom.describe(view, span)} on every step chart. *Reset zoom* in the sidebar."
    )
# lines cut to the zoom, so their y-axes fit what is shown (plotly's autorange spans every point)
series = health_steps.series(path, sig, ("loss", "grad_norm", "lr"), view)
fig = health_timeline(
    series,
    step_zoom.clip(marks, view),
    step_zoom.clip(timeline, view),
    steps=view,
    evals=step_zoom.clip(side_tables.loss_like(evals), view),
)
warm = warmups.spans(info.meta, first_step, warmups.SPIKE + warmups.ROUTING)
shade_warmups(fig, warm, steps=span)
step_axis.chart(fig, key="timeline", span=span)
if evals:
    others = {k: v for k, v in evals.items() if k not in side_tables.loss_like(evals)}
    last = "; ".join(f"{k} {df[k][-1]:.4g} (step {df['step'][-1]})" for k, df in sorted(others.items()))
    st.caption(
        "Dashed with dots: the evaluation losses the loop reported (GuardedStep.log, the Trainer's "
        "evaluate), at the last step taken before each evaluation."
        + (f" Other evaluation metrics, last value: {last}." if last else "")
    )
if warm:
    st.caption(
        "Grey bands: detector warm-ups. A detector gives no verdict before it arms (its baseline fills, "
        "routing settles); a fault inside a band is not judged by it: "
        + "; ".join(warmup_label(s, span[1]) for s in warm)
        + ". Set in the run's guard settings."
    )
if res_note := health_steps.resolution_note(path, view):
    st.caption(f"{last_step - first_step + 1:,} steps: {res_note}.")
elif last_step - first_step + 1 > shaping.MAX_LINE_POINTS:
    st.caption(
        f"{last_step - first_step + 1:,} steps drawn as ≤{shaping.MAX_LINE_POINTS:,} points per line: each bucket keeps its first, "
        "last, min and max step, plus every non-finite step and every step with an event."
    )

events = loaders.load_events(path, sig)

# ---- precursors -----------------------------------------------------------------------
st.subheader("Precursors")
pre_series = health_steps.series(path, sig, ("update_ratio", "adam_v_ratio"), view)
groups = loaders.load_group_series(path, sig, "grad_norm") if info.tables.get(schema.TABLE_GROUPS) else {}
logits = loaders.load_max_logits(path, sig) if info.tables.get(schema.TABLE_LAYERS) else {}
groups, logits = step_zoom.clip(groups, view), step_zoom.clip(logits, view)
if not pre_series["update_ratio"]["update_ratio"].is_finite().any() and not groups and not logits:
    st.info(
        f"No precursor signals in {step_zoom.describe(view, span)} (the zoom)."
        if zoomed
        else "No precursor signals in this run: it was written before they existed, its loop gave the "
        "probe no optimizer, or `[guard.precursor] enabled = false`."
    )
else:
    nonfinite = nonfinite_steps(health_steps.step_rows(path, sig), ("loss", "grad_norm"))
    step_axis.chart(
        precursor_figure(
            pre_series,
            groups,
            step_zoom.clip(events, view),
            logits,
            step_zoom.clip(nonfinite, view),
            steps=view,
        ),
        key="precursors",
        span=span,
    )
    n_pre = events.filter(
        (pl.col("kind") == schema.EV_VERDICT) & pl.col("detector").is_in(schema.PRECURSOR_DETECTORS)
    ).height
    logit_note = (
        " Max attention logit: max over heads and causal pairs of q·k/√d, on the steps it was sampled "
        "(every `max_logit_every`-th, over the first `max_logit_seqs` sequences of each micro-batch); above τ = 100 Kimi K2's "
        "QK-clip would have shrunk that head's W_q, W_k."
        if logits
        else ""
    )
    st.caption(
        "Update ratio at step t: ||W_t − W_t−1|| / ||W_t−1||, the update that produced the weights step t "
        f"computed its loss on (from a fixed 1-in-61 sample of the weights).{logit_note} A precursor verdict "
        f"({n_pre} in this run) is a warning: recorded, never acted on unless `[guard.precursor] act = true`."
    )

# ---- events ---------------------------------------------------------------------------
st.subheader("Guard events")
if events.height == 0:
    st.info("No events recorded for this run (no verdicts, actions, checkpoints or injections).")
else:
    kinds = sorted(set(events["kind"].to_list()))
    default = [k for k in kinds if k != schema.EV_CHECKPOINT] or kinds
    shown = st.multiselect("Event kinds", kinds, default=default, key="event_kinds")
    ev = events.filter(pl.col("kind").is_in(shown))
    evidence = [
        "; ".join(f"{k}={guard_events.fmt_value(v)}" for k, v in guard_events.parse_detail(d).items())
        for d in ev["detail"].to_list()
    ]

    # value / threshold as text: an event without one (a checkpoint, an action) shows an empty cell,
    # not "None"; a non-finite value says so
    def _num(c: str) -> pl.Expr:
        nonfinite_value = (pl.col("detector") == schema.DET_NONFINITE) if c == "value" else pl.lit(False)
        return (
            pl.when(pl.col(c).is_null() | (pl.col(c).is_nan() & ~nonfinite_value))
            .then(pl.lit(""))
            .when(pl.col(c).is_nan())
            .then(pl.lit("non-finite"))
            .otherwise(pl.col(c).map_elements(guard_events.fmt_value, return_dtype=pl.String))
            .alias(c)
        )

    ui.dataframe(
        ev.select(
            guard_events.shown_steps(),  # a checkpoint at the last step it holds, as the chart
            pl.from_epoch(pl.col("time"), time_unit="s").alias("time (UTC)"),
            "kind",
            pl.col("detector").fill_null(""),
            pl.col("action").fill_null(""),
            _num("value"),
            _num("threshold"),
        ).with_columns(evidence=pl.Series(evidence, dtype=pl.String)),
        hide_index=True,
        height=ui.table_height(ev.height, max_rows=20),  # a drill's events fit; a long run's scroll
        column_config={
            "step": st.column_config.NumberColumn(
                help="the step the event belongs to; a checkpoint-N at the last step it holds, N - 1"
            ),
            "detector": st.column_config.TextColumn(width="medium"),  # layer_grad_norm_spike was cut off
            "value": st.column_config.TextColumn(help="the detector's value (empty: the event has none)"),
            "threshold": st.column_config.TextColumn(help="the threshold it crossed (empty: none)"),
        },
    )

# ---- per-layer signals ----------------------------------------------------------------
st.subheader("Per layer")
# the heatmaps are read for the steps shown: a zoom gets finer buckets, not wider ones
lo, hi = max(view[0], first_step), min(view[1], last_step)
lo, hi = (lo, hi) if lo <= hi else (first_step, last_step)
if not info.tables.get(schema.TABLE_LAYERS):
    st.info(
        "This run has no `layers` table (yet): per-layer grad norms and routing statistics are not available."
    )
else:
    heats = heatmaps.load_layer_heatmaps(path, sig, lo, hi)
    # (signal, colour-bar title, colour scale, log10, fixed range)
    dead_max = float(np.nanmax(heats["dead_experts"]["z"])) if "dead_experts" in heats else 0.0
    specs = [
        ("grad_norm", "grad norm", "Viridis", True, (None, None)),
        ("maxvio", "MaxVio", "YlOrRd", False, (0.0, None)),
        ("dead_experts", "dead experts", "Reds", False, (0.0, max(1.0, dead_max))),  # all-zero reads white
        ("router_entropy", "nats", "Viridis_r", False, (None, None)),
        ("load_entropy", "load entropy", "Viridis_r", False, (None, None)),
        ("bias_norm", "bias L2", "Cividis", False, (0.0, None)),  # a norm: never below 0
        ("update_ratio", "ΔW/W", "Magma", True, (None, None)),
    ]
    no_bias = "bias_norm" in heats and heatmaps.all_zero(heats["bias_norm"])
    specs = [s for s in specs if s[0] in heats and not (s[0] == "bias_norm" and no_bias)]
    for i in range(0, len(specs), 2):
        cols = st.columns(2)
        for col, (name, ztitle, scale, log, (zmin, zmax)) in zip(cols, specs[i : i + 2], strict=False):
            fig = heatmap(
                heats[name],
                title=heatmaps.LAYER_SIGNALS[name][1],
                x_title="step",
                y_title="layer",
                z_title=ztitle,
                colorscale=scale,
                log=log,
                zmin=zmin,
                zmax=zmax,
                steps=view,
            )
            if name in ROUTING_SIGNALS:
                routing_warm = warmups.spans(info.meta, first_step, warmups.ROUTING)
                shade_warmups(fig, routing_warm, steps=span, over_heatmap=True)
            step_axis.chart(fig, key=f"layer-{name}", span=span, where=col)
    if heats:
        st.caption(
            f"Each column covers {next(iter(heats.values()))['width']} step(s). Dense layers have no routing "
            "statistics (blank rows in the routing maps)."
            + (
                " No expert-bias chart: the expert-bias L2 norm is 0 at every step shown (the model has "
                "no expert biases, or none was moved)."
                if no_bias
                else ""
            )
        )


# ---- expert load (a fragment: picking another layer reruns only this section) ---------
@st.fragment
def expert_load() -> None:
    st.subheader("Expert load")
    layer_ids = heatmaps.load_layer_ids(path, sig) if info.tables.get(schema.TABLE_EXPERTS) else []
    if not layer_ids:
        st.info("This run has no `experts` table (yet): expert load shares are not available.")
    else:
        left, right = st.columns(2)
        with left:
            a, b = st.columns([2, 1], vertical_alignment="bottom")
            worst = guard_events.misbehaving_layer(events)  # open on the layer that misbehaved
            layer = a.selectbox(
                "MoE layer",
                layer_ids,
                index=layer_ids.index(worst) if worst in layer_ids else 0,
                key="expert_layer",
                help="opens on the layer the routing detectors flagged most" if worst in layer_ids else None,
            )
            exact = b.toggle(
                "every step",
                key="expert_exact",
                help=heatmaps.EXACT_HELP,
            )
            h = heatmaps.load_expert_share_over_time(
                path,
                sig,
                int(layer),
                lo,
                hi,
                row_budget=heatmaps.EXACT_ROWS if exact else heatmaps.EXPERT_ROW_BUDGET,
            )
            if h:
                n_exp = len(h["y"])
                step_axis.chart(
                    heatmap(
                        h,
                        title=f"Layer {layer}: load share per expert over time",
                        x_title="step",
                        y_title="expert",
                        z_title="share %",
                        z_scale=100,
                        hover_z="%{z:.2f}%",
                        steps=view,
                        **share_colors(100 * np.asarray(h["z"], dtype=float), n_exp),
                    ),
                    key="expert-time",
                    span=span,
                )
                if step_zoom.clamp(st.session_state.get(step_zoom.KEY, span), span) != view:
                    st.rerun(scope="app")  # zoomed from this fragment's chart: redraw the whole page
                st.caption(
                    f"White: the uniform share ({100 / n_exp:.2f}%); red above it, blue below; dark blue is "
                    f"an expert that got no tokens (0%). Both load-share charts use this one scale. "
                    # collapse-300 (issue #40 shots): a bias correction flipped a collapsed layer between two
                    # expert pairs every step; its window share read ~25% each while its MaxVio was 1
                    "Both sum tokens over steps (a column, the window): a layer collapsed onto different "
                    "experts from step to step reads near uniform here; MaxVio per layer (above) is per step. "
                    f"{h['note']}"
                )
        with right:
            window = st.select_slider(
                "Window (steps)", [10, 50, 100, 500, 1000], value=100, key="expert_window"
            )
            now = heatmaps.load_expert_share_now(path, sig, int(window))
            if now:
                n_exp = len(now["x"])
                st.plotly_chart(
                    heatmap(
                        now,
                        title=f"Current load share, steps {now['from']:,}..{now['to']:,}",
                        x_title="expert",
                        y_title="layer",
                        z_title="share %",
                        z_scale=100,
                        hover_z="%{z:.2f}%",
                        **share_colors(100 * np.asarray(now["z"], dtype=float), n_exp),
                    ),
                    key="expert-now",
                )


expert_load()

# ---- throughput -----------------------------------------------------------------------
st.subheader("Throughput and memory")
perf = health_steps.series(
    path, sig, ("mfu", "tokens_per_s", "step_time_s", "data_wait_s", "mem_peak_bytes"), view
)
step_axis.chart(perf_figure(perf, peak, steps=view), key="perf", span=span)
st.caption(mfu_peak.formula(info.meta.get("flops_per_token"), env.get("world_size"), peak))
host = side_tables.load_host(path, sig) if info.tables.get(schema.TABLE_HOST) else None
if host is not None and host.height and side_tables.host_series(host):
    shown_host = step_zoom.clip(host, view)
    step_axis.chart(host_figure(shown_host, steps=view), key="host", span=span)
    st.caption(
        # a 1-s run has one or two samples: say so, the panel is otherwise mostly empty axes
        f"{shown_host.height:,} sample{'s' if shown_host.height != 1 else ''} in the steps shown. "
        "Sampled by a thread of its own at most once a second and once a step (MOEGUARD_HOST_EVERY_S), "
        "at the last step finished: CPU is the training process's CPU time over wall time (100% = one core); "
        "GPU utilisation needs pynvml, GPU memory is the device's, every process's."
    )

# ---- goodput ---------------------------------------------------------------------------
st.subheader("Goodput")
gp = info.meta.get("goodput")
if isinstance(gp, dict) and isinstance(gp.get("wall_s"), int | float) and gp["wall_s"] > 0:
    st.plotly_chart(goodput_figure(gp), key="goodput")
    st.caption(
        f"{GOODPUT_DEFINITION}. As of the run's end, or of its last checkpoint while it runs "
        "(meta.json `goodput`, guard/core/goodput.py)."
    )
else:
    st.info(
        "No goodput recorded for this run: it is written at each checkpoint and when the run ends "
        "(meta.json `goodput`), and this run has neither yet or was written before goodput existed."
    )

with st.expander("Run metadata (meta.json)"):
    st.json(info.meta, expanded=False)
