"""Compare: is B faster than A? Runs side by side (config, peak, profiler trace), a plain
speed verdict from steady-state tokens/s, any metric overlaid on steps / tokens / wall time,
and MFU / tokens/s distributions grouped by environment."""

from __future__ import annotations

import polars as pl
import streamlit as st

from dashboards import ui
from dashboards.data import compare, config, guard_events, loaders, mfu_peak, runs
from dashboards.figures.compare import compare_distributions, compare_overlay
from guard.core import schema

cfg = config.app_config()
st.title("Compare runs")
infos = [i for i in ui.runs_or_stop(cfg) if i.readable and i.has_steps]
if not infos:
    st.info("No run has readable steps yet; nothing to compare.")
    st.stop()
by_id = {i.run_id: i for i in infos}
chosen = st.multiselect("Runs", list(by_id), default=list(by_id)[:4], key="runs", bind="query-params")
if not chosen:
    st.info("Pick at least one run.")
    st.stop()
sel = [by_id[r] for r in chosen]
sigs = {i.run_id: runs.run_signature(i.path) for i in sel}
perf = {i.run_id: loaders.load_steady_perf(i.path, sigs[i.run_id]) for i in sel}
ident = {i.run_id: compare.speed_identity(i.meta) for i in infos}


def same_config_spread(run_ids: list[str]) -> compare.Spread | None:
    """The widest run-to-run spread of steady tokens/s among the store's runs that share a
    config and environment with any of `run_ids` (None without such a repeat): the noise a
    within-run interval or a violin of steps cannot see."""
    spreads = []
    for run in run_ids:
        peers = [i for i in infos if ident[i.run_id] == ident[run]]
        if len(peers) > 1:
            medians = {
                i.run_id: compare.steady_median(loaders.load_steady_perf(i.path, runs.run_signature(i.path)))
                for i in peers
            }
            spreads.append(compare.run_spread(medians))
    return max((x for x in spreads if x is not None), key=lambda x: x.pct, default=None)


def injected_faults(i: runs.RunInfo) -> str:
    """The faults a run injected on purpose (`--inject`: meta.json "injections"; a loop that
    injects through GuardedStep records only its inject events), "none" when it injected none."""
    planned = i.meta.get("injections")
    if isinstance(planned, list) and planned:
        return ", ".join(map(str, planned))
    ev = loaders.load_events(i.path, sigs.get(i.run_id) or runs.run_signature(i.path))
    ev = ev.filter(pl.col("kind") == schema.EV_INJECT) if ev.height else ev
    seen = []
    for step, detail in ev.select("step", "detail").iter_rows():
        d = guard_events.parse_detail(detail)
        seen.append(str(d.get("injection") or f"{d.get('kind', '?')}@{step}"))
    return ", ".join(seen) or "none"


# ---- the runs side by side --------------------------------------------------------------
rows = []
for i in sel:
    p = perf[i.run_id]
    env, peak = i.env, mfu_peak.run_peak(i.env)
    tps = p["tokens_per_s"].filter(p["tokens_per_s"].is_finite()) if p.height else p["tokens_per_s"]
    mfu = p["mfu"].filter(p["mfu"].is_finite()) if p.height else p["mfu"]
    mfu_p50 = float(mfu.median()) if len(mfu) else None  # type: ignore[arg-type]
    trace = compare.profiler_trace(i.path)
    rows.append(
        {
            "run": i.run_id,
            "torch": env.get("torch"),
            "attention": env.get("attention_backend"),
            "expert kernel": env.get("expert_kernel"),
            "compile": None if env.get("compile") is None else str(env.get("compile")),
            "tokens/s p50": round(float(tps.median())) if len(tps) else None,  # type: ignore[arg-type]
            "MFU p50 %": None if mfu_p50 is None else 100 * mfu_p50,
            "MFU peak": peak.short(),
            "device": env.get("device"),
            "status": ui.status_cell(i.status),
            "steady steps": p.height,
            "profiler trace": trace.name if trace else None,
        }
    )
table = pl.DataFrame(rows, infer_schema_length=None)
if table["MFU p50 %"].null_count() == table.height:  # no peak anywhere: a column of "None" says nothing
    table = table.drop("MFU p50 %")
ui.dataframe(
    table,
    hide_index=True,
    column_config={
        "run": st.column_config.TextColumn(pinned=True),
        "status": ui.status_column([i.status for i in sel]),
        "tokens/s p50": st.column_config.NumberColumn(format="localized", help=ui.TPS_STEADY),
        "MFU p50 %": st.column_config.NumberColumn(format="%.1f", help="steady state, of the peak beside it"),
        "MFU peak": st.column_config.TextColumn(help="the peak FLOP/s MFU divides by, and its source"),
    },
)
st.caption(
    f"tokens/s p50 and MFU p50 on this page: {ui.TPS_STEADY} (Runs and Run health show the "
    f"{ui.TPS_RECENT}, so their figures differ)."
)
traces = [(i, t) for i in sel if (t := compare.profiler_trace(i.path)) is not None]
if traces:
    st.caption(
        "Profiler traces (torch.profiler, Chrome trace format): open them in https://ui.perfetto.dev "
        "or chrome://tracing."
    )
    cols = st.columns(min(4, len(traces)))
    for k, (i, t) in enumerate(traces):
        cols[k % len(cols)].download_button(
            f"{i.run_id}: trace",
            data=t.read_bytes,
            file_name=f"{i.run_id}-{t.name}",
            mime="application/json",
            key=f"trace-{i.run_id}",
            icon=":material/download:",
            on_click="ignore",
            help=f"{t} ({t.stat().st_size / 2**20:.1f} MiB)",
        )
peaks = {(p.kind, p.flops) for p in (mfu_peak.run_peak(i.env) for i in sel)}
if all(flops is None for _, flops in peaks):  # the CPU class has no pinned peak, an unknown GPU
    st.caption(
        "No chosen run has a peak for its device (MFU not computed, not guessed): tokens/s is the measure here."
    )
elif len(sel) > 1 and (len(peaks) > 1 or not all(mfu_peak.run_peak(i.env).trusted for i in sel)):
    st.caption(
        "MFU is not comparable across these runs: they divide by different peaks, or by a peak a run measured "
        "for itself. tokens/s is the measure here."
    )

# ---- is B faster than A? ----------------------------------------------------------------
st.subheader("Is B faster than A?")
if len(sel) < 2:
    st.info("Pick two or more runs.")
else:
    a_col, b_col = st.columns(2)
    run_a = a_col.selectbox("A (reference)", chosen, index=0, key="run_a")
    run_b = b_col.selectbox("B", [r for r in chosen if r != run_a], index=0, key="run_b")
    r = compare.speedup(perf[run_a]["tokens_per_s"].to_numpy(), perf[run_b]["tokens_per_s"].to_numpy())
    if r is None:
        st.info("Not enough steady-state steps (10 per run) to compare throughput.")
    else:
        same_ab = ident[run_a] == ident[run_b]
        spread = None if same_ab else same_config_spread([run_a, run_b])
        st.markdown(
            compare.speedup_sentence(f"A ({run_a})", f"B ({run_b})", r, spread=spread, same_config=same_ab)
        )
        ea, eb = by_id[run_a].env, by_id[run_b].env
        what = "; ".join(
            f"{k} {ea.get(k)} → {eb.get(k)}"
            for k in (*compare.ENV_KEYS, "device", "dtype")
            if ea.get(k) != eb.get(k)
        )
        st.caption(
            f"From steady-state tokens/s ({int(r['n_a'])} and {int(r['n_b'])} steps: after the first 10%, "
            "steps the guard acted on left out); 90% interval by a block bootstrap over steps within "
            "each run. "
            + (f"Same-config runs: {', '.join(spread.runs)}. " if spread else "")
            + (
                f"What differs: {what}. "
                if what
                else "Torch, attention, expert kernel and compile are the same. "
            )
            + (
                ""
                if compare.same_model(by_id[run_a].meta, by_id[run_b].meta)
                else "**The model configs differ: tokens/s compares throughput, not the same work.**"
            )
        )

# ---- any metric overlaid ------------------------------------------------------------------
st.subheader("Overlay")
c1, c2, c3 = st.columns([2, 2, 3])
metric = compare.METRIC_CHOICES[
    c1.selectbox("Metric", list(compare.METRIC_CHOICES), key="metric", bind="query-params")
]
x_label = c2.segmented_control(
    "x-axis", list(compare.X_CHOICES), default="steps", key="x_axis", bind="query-params"
)
x_axis = compare.X_CHOICES[x_label or "steps"]
window = c3.select_slider(
    "Smoothing (rolling median, steps)", [1, 5, 10, 25, 50, 100, 250], value=10, key="smooth"
)
series = {i.run_id: compare.load_overlay(i.path, sigs[i.run_id], metric, x_axis, int(window)) for i in sel}
st.plotly_chart(compare_overlay(series, metric=metric, x_axis=x_axis, window=int(window)), key="overlay")

# ---- distributions by environment ---------------------------------------------------------
st.subheader("Efficiency by environment")
keys = {
    "torch": "torch",
    "attention backend": "attention_backend",
    "expert kernel": "expert_kernel",
    "compile mode": "compile",
    "run": "run",
}
# open on the environment key the chosen runs differ in (two kernels: by kernel, not one violin
# of both under their common torch)
differs = [k for k, c in keys.items() if c != "run" and len({str(i.env.get(c)) for i in sel}) > 1]
first = differs[0] if differs else "torch"
label = (
    st.segmented_control("Group by", list(keys), default=first, key="group_by", bind="query-params") or first
)
key = keys[label]
frames = []
for i in sel:
    group = i.run_id if key == "run" else str(i.env.get(key, "unknown"))
    frames.append(perf[i.run_id].with_columns(group=pl.lit(group), run=pl.lit(i.run_id)))
dist = pl.concat(frames, how="vertical_relaxed") if frames else pl.DataFrame()
if dist.height == 0:
    st.info(
        "The chosen runs have no steady-state steps yet (the first 10% of steps and every step the guard "
        "acted on are left out)."
    )
else:
    noise = same_config_spread(chosen) if len(sel) > 1 else None
    caveat = (
        f"same-config runs here vary by up to {noise.pct:.0f}% run to run: a gap between groups smaller than that is noise"
        if noise
        else "run-to-run noise not shown (no same-config repeat here): moeguard canary --ab decides"
    )
    st.plotly_chart(compare_distributions(dist, label, caveat=caveat), key="dist")
    grouped = (
        dist.group_by("group")
        .agg(
            pl.col("run").unique().sort().str.join(", ").alias("runs"),
            pl.len().alias("steps"),
            pl.col("tokens_per_s").median().round(0).alias("tokens/s p50"),
            (pl.col("mfu").median() * 100).alias("MFU p50 %"),
            (pl.col("mfu").quantile(0.1) * 100).alias("MFU p10 %"),
            (pl.col("mfu").quantile(0.9) * 100).alias("MFU p90 %"),
        )
        .sort("tokens/s p50", descending=True, nulls_last=True)
        .rename({"group": label})
    )
    mfu_cols = ["MFU p50 %", "MFU p10 %", "MFU p90 %"]
    if all(grouped[c].fill_nan(None).null_count() == grouped.height for c in mfu_cols):
        grouped = grouped.drop(mfu_cols)  # no run has MFU (no peak): three columns of nothing
    ui.dataframe(
        grouped,
        hide_index=True,
        column_config={
            c: st.column_config.NumberColumn(format="%.1f") for c in ("MFU p50 %", "MFU p10 %", "MFU p90 %")
        }
        | {"tokens/s p50": st.column_config.NumberColumn(format="localized")},
    )
    st.caption(
        "Steady state: steps after the first 10% (at least 20) on which the guard did not skip or roll back. "
        "A violin is the spread of its runs' steps, within each run; runs made at different times also differ "
        "by host drift and other load, which no violin shows. "
        + (
            f"Same-config runs in this store ({', '.join(noise.runs)}) vary by up to {noise.pct:.1f}% in "
            "steady tokens/s run to run: a gap between groups smaller than that is not a speed difference "
            "this store can show (as *Is B faster than A?* says)."
            if noise
            else "This store has no same-config repeat to measure that noise: read a gap between groups as "
            "run-to-run variation until `moeguard canary --ab A B` (A and B interleaved on one host) decides."
        )
    )

st.subheader("Environment and config differences")
if len(sel) < 2:
    st.info("Pick two or more runs to see what differs.")
else:
    diff = compare.env_differences(
        {
            i.run_id: {
                "env": i.env,
                "config": i.meta.get("config") or {},
                "injected faults": injected_faults(i),
            }
            for i in sel
        }
    )
    if diff.height == 0:
        st.success("Environment and config are identical across the chosen runs.")
    else:
        ui.dataframe(diff, hide_index=True)
