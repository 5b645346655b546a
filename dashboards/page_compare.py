"""Compare: overlay runs, and MFU / tokens/s distributions grouped by environment."""

from __future__ import annotations

import polars as pl
import streamlit as st

from dashboards import data, figures, ui

cfg = data.app_config()
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

curves = {
    i.run_id: data.load_step_series(i.path, data.run_signature(i.path), ("loss", "grad_norm"), 1500)
    for i in sel
}
st.plotly_chart(figures.compare_curves(curves), key="curves")

st.subheader("Efficiency by environment")
keys = {"torch": "torch", "attention backend": "attention_backend", "expert kernel": "expert_kernel",
        "compile mode": "compile", "run": "run"}  # fmt: skip
label = (
    st.segmented_control("Group by", list(keys), default="torch", key="group_by", bind="query-params")
    or "torch"
)
key = keys[label]
frames = []
for i in sel:
    perf = data.load_steady_perf(i.path, data.run_signature(i.path))
    group = i.run_id if key == "run" else str(i.env.get(key, "unknown"))
    frames.append(perf.with_columns(group=pl.lit(group), run=pl.lit(i.run_id)))
dist = pl.concat(frames, how="vertical_relaxed") if frames else pl.DataFrame()
if dist.height == 0:
    st.info("The chosen runs have no steady-state steps yet (the first 10% of steps and every step the guard "
            "acted on are left out).")  # fmt: skip
else:
    st.plotly_chart(figures.compare_distributions(dist, label), key="dist")
    table = (
        dist.group_by("group")
        .agg(
            pl.col("run").unique().sort().str.join(", ").alias("runs"),
            pl.len().alias("steps"),
            (pl.col("mfu").median() * 100).alias("MFU p50 %"),
            (pl.col("mfu").quantile(0.1) * 100).alias("MFU p10 %"),
            (pl.col("mfu").quantile(0.9) * 100).alias("MFU p90 %"),
            pl.col("tokens_per_s").median().round(0).alias("tokens/s p50"),
        )
        .sort("MFU p50 %", descending=True, nulls_last=True)
        .rename({"group": label})
    )
    st.dataframe(table, hide_index=True, column_config={
        c: st.column_config.NumberColumn(format="%.1f") for c in ("MFU p50 %", "MFU p10 %", "MFU p90 %")
    } | {"tokens/s p50": st.column_config.NumberColumn(format="localized")})  # fmt: skip
    st.caption(
        "Steady state: steps after the first 10% (at least 20) on which the guard did not skip or roll back."
    )

st.subheader("Environment and config differences")
if len(sel) < 2:
    st.info("Pick two or more runs to see what differs.")
else:
    diff = data.env_differences({i.run_id: {"env": i.env, "config": i.meta.get("config") or {}} for i in sel})
    if diff.height == 0:
        st.success("Environment and config are identical across the chosen runs.")
    else:
        st.dataframe(diff, hide_index=True)
