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
    rows.append({
        "run": info.run_id,
        "health": f"health?run={info.run_id}",
        "status": info.status,
        "note": info.note,
        "step": summ.get("step"),
        "loss": summ.get("loss"),
        "MFU %": None if summ.get("mfu") is None else 100 * summ["mfu"],
        "tokens/s": None if summ.get("tokens_per_s") is None else round(summ["tokens_per_s"]),
        "open alerts": alerts.get(info.run_id) if cfg.collector and not alert_error else None,
        "guard actions": summ.get("actions"),
        "verdicts": summ.get("verdicts"),
        "torch": env.get("torch"),
        "attention": env.get("attention_backend"),
        "expert kernel": env.get("expert_kernel"),
        "compile": None if env.get("compile") is None else str(env.get("compile")),
        "last update": ui.age(info.updated_at),
    })  # fmt: skip
df = pl.DataFrame(rows, infer_schema_length=None)
if not cfg.collector:
    df = df.drop("open alerts")

counts = {s: sum(1 for i in infos if i.status == s) for s in ui.STATUS_STYLE}
cols = st.columns(len(counts))
for c, (s, n) in zip(cols, counts.items(), strict=True):
    c.metric(f"{ui.STATUS_STYLE[s][0]} {s}", n)

st.dataframe(
    df,
    hide_index=True,
    column_config={
        "run": st.column_config.TextColumn(pinned=True),
        "note": st.column_config.TextColumn(width="large"),
        "health": st.column_config.LinkColumn(
            "open", display_text="health →", help="Open the run-health page"
        ),
        "loss": st.column_config.NumberColumn(format="%.4f"),
        "MFU %": st.column_config.NumberColumn(format="%.1f", help="median of the last 100 steps"),
        "tokens/s": st.column_config.NumberColumn(format="localized", help="median of the last 100 steps"),
        "guard actions": st.column_config.NumberColumn(
            help="skip / rollback / bias_correct / lr_cooldown / halt"
        ),
        "verdicts": st.column_config.NumberColumn(help="detector verdicts recorded in the events table"),
    },
)
st.caption(
    f"Stale: marked running but nothing written for more than {ui.stale_after():.0f} s "
    "(change it in the sidebar). MFU and tokens/s are medians of the last 100 steps."
)

for info in infos:
    ui.show_problem(info)
stray = data.stray_folders(cfg.runs_dir)
if stray:
    st.caption(f"Ignored (no meta.json): {', '.join(stray)}")
