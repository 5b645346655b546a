"""Runs: every run in the store with its status, progress, efficiency and guard activity."""

from __future__ import annotations

import polars as pl
import streamlit as st

from dashboards import data, ui

cfg = data.app_config()
st.title("Runs")
infos = ui.runs_or_stop(cfg)

alerts: dict[str, int] = {}
alert_error = None
if cfg.collector:
    alerts, alert_error = data.fetch_open_alerts(cfg.collector)
    if alert_error:
        st.warning(f"Open alerts unavailable from `{cfg.collector}`: {alert_error}")

rows = []
for info in infos:
    summ = data.load_summary(info.path, data.run_signature(info.path)) if info.readable else {}
    env = info.env
    peak = data.run_peak(env)
    mfu = summ.get("mfu")
    note = data.mfu_note(mfu, peak) if mfu is not None else ""
    if summ.get("mfu_over"):
        note = note or f"{summ['mfu_over']:,} step(s) with MFU above 100%: measurement artefacts"
    rows.append({
        "run": info.run_id,
        "health": f"health?run={info.run_id}",
        "status": info.status,
        "step": summ.get("step"),
        "loss": summ.get("loss"),
        "tokens/s": None if summ.get("tokens_per_s") is None else round(summ["tokens_per_s"]),
        "MFU %": None if mfu is None else 100 * mfu,
        "MFU peak": peak.label() if info.readable else None,
        "MFU note": note or None,
        "open alerts": alerts.get(info.run_id) if cfg.collector and not alert_error else None,
        "guard actions": summ.get("actions"),
        "verdicts": summ.get("verdicts"),
        "torch": env.get("torch"),
        "attention": env.get("attention_backend"),
        "expert kernel": env.get("expert_kernel"),
        "compile": None if env.get("compile") is None else str(env.get("compile")),
        "last update": ui.age(info.updated_at),
        "note": info.note or None,
    })  # fmt: skip
df = pl.DataFrame(rows, infer_schema_length=None)
if not cfg.collector:
    df = df.drop("open alerts")
# columns with nothing to say take no width (a wide empty "note" pushed the kernels off screen)
df = df.drop([c for c in ("MFU note", "note") if df[c].null_count() == df.height])

counts = {s: sum(1 for i in infos if i.status == s) for s in ui.STATUS_STYLE}
cols = st.columns(len(counts))
for c, (s, n) in zip(cols, counts.items(), strict=True):
    c.metric(f"{ui.STATUS_STYLE[s][0]} {s}", n)

st.dataframe(
    df,
    hide_index=True,
    column_config={
        "run": st.column_config.TextColumn(pinned=True),
        "health": st.column_config.LinkColumn(
            "open", display_text="health →", help="Open the run-health page"
        ),
        "loss": st.column_config.NumberColumn(format="%.4f"),
        "tokens/s": st.column_config.NumberColumn(format="localized", help="median of the last 100 steps"),
        "MFU %": st.column_config.NumberColumn(format="%.1f", help="median of the last 100 steps"),
        "MFU peak": st.column_config.TextColumn(
            help="the peak FLOP/s MFU divides by, and where it came from (hover a run's health page for the "
            "full source)"
        ),
        "MFU note": st.column_config.TextColumn(width="medium"),
        "guard actions": st.column_config.NumberColumn(
            help="skipped / rolled-back / halted steps, bias corrections and LR cool-downs started (guard/actions.py; "
            "the CLI summary and moeguard_guard_actions_total count the same)"
        ),
        "verdicts": st.column_config.NumberColumn(help="detector verdicts recorded in the events table"),
        "note": st.column_config.TextColumn(width="medium"),
    },
)
st.caption(
    f"Stale: marked running but nothing written for more than {ui.stale_after():.0f} s "
    "(change it in the sidebar). tokens/s and MFU are medians of the last 100 steps; MFU compares only "
    "between runs with the same peak, tokens/s between runs of the same model."
)

for info in infos:
    ui.show_problem(info)
stray = data.stray_folders(cfg.runs_dir)
if stray:
    st.caption(f"Ignored (no meta.json): {', '.join(stray)}")
