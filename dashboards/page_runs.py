"""Runs: every run in the store with its status, progress, efficiency and guard activity."""

from __future__ import annotations

import polars as pl
import streamlit as st

from dashboards import ui
from dashboards.data import config, loaders, mfu_peak, open_alerts, runs

cfg = config.app_config()
st.title("Runs")
infos = ui.runs_or_stop(cfg)

alerts: dict[str, int] = {}
alert_error = None
if cfg.collector:
    alerts, alert_error = open_alerts.fetch_open_alerts(cfg.collector)
    if alert_error:
        st.warning(f"Open alerts unavailable from `{cfg.collector}`: {alert_error}")

rows = []
notes: list[str] = []
for info in infos:
    summ = loaders.load_summary(info.path, runs.run_signature(info.path)) if info.readable else {}
    env = info.env
    peak = mfu_peak.run_peak(env)
    mfu = summ.get("mfu")
    if summ.get("mfu_over") or mfu_peak.mfu_note(mfu, peak):
        over = (
            f"{summ['mfu_over']:,} step(s) with MFU above 100% (measurement artefacts); "
            if summ.get("mfu_over")
            else ""
        )
        notes.append(f"`{info.run_id}`: {over}MFU of peak {peak.label()}")
    note = (
        "artefact"
        if (mfu or 0) > mfu_peak.MFU_LIMIT or summ.get("mfu_over")
        else mfu_peak.mfu_note(mfu, peak, short=True)
    )
    # config first (it is what runs are compared by), then progress, efficiency, guard activity
    rows.append(
        {
            "run": info.run_id,
            "health": f"health?run={info.run_id}",
            "status": ui.status_cell(info.status),
            "torch": env.get("torch"),
            "attention": env.get("attention_backend"),
            "expert kernel": env.get("expert_kernel"),
            "compile": None if env.get("compile") is None else str(env.get("compile")),
            "step": summ.get("step"),
            "loss": summ.get("loss"),
            "tokens/s": None if summ.get("tokens_per_s") is None else round(summ["tokens_per_s"]),
            "MFU %": None if mfu is None else 100 * mfu,
            "open alerts": alerts.get(info.run_id) if cfg.collector and not alert_error else None,
            "guard actions": summ.get("actions"),
            "verdicts": summ.get("verdicts"),
            "MFU peak": ((f"{note} · " if note else "") + peak.short()) if info.readable else "",
            "last update": ui.age(info.updated_at),
            "note": "; ".join(n for n in (info.status_note, info.note) if n),
        }
    )
df = pl.DataFrame(rows, infer_schema_length=None)
if not cfg.collector:
    df = df.drop("open alerts")
# a column with nothing to say takes no width (a wide empty "note" pushed the kernels off screen)
if (df["note"].fill_null("") == "").all():
    df = df.drop("note")

# one badge per status present, with its count, in the table's colours
st.markdown(ui.status_counts([i.status for i in infos]))

st.dataframe(
    df,
    hide_index=True,
    height=ui.table_height(df.height),  # every run on screen: a scrolled-away row is a run nobody sees
    column_config={
        "run": st.column_config.TextColumn(pinned=True, width="medium"),
        "status": ui.status_column([i.status for i in infos]),
        "health": st.column_config.LinkColumn("open", display_text="health", help="Open the run-health page"),
        "loss": st.column_config.NumberColumn(format="%.4f"),
        "tokens/s": st.column_config.NumberColumn(format="localized", help="median of the last 100 steps"),
        "MFU %": st.column_config.NumberColumn(format="%.1f", help="median of the last 100 steps"),
        "MFU peak": st.column_config.TextColumn(
            help="the peak FLOP/s MFU divides by: datasheet (GPU), pinned (CPU machine class, "
            "configs/cpu_peaks.toml), self-measured (older runs: not comparable), or none (tokens/s only); "
            "'artefact' where MFU went above 100% (not physical). The run's health page shows the full source."
        ),
        "guard actions": st.column_config.NumberColumn(
            help="skipped / rolled-back / halted steps, bias corrections and LR cool-downs started (guard/core/actions.py; "
            "the CLI summary and moeguard_guard_actions_total count the same)"
        ),
        "verdicts": st.column_config.NumberColumn(help="detector verdicts recorded in the events table"),
        "note": st.column_config.TextColumn(
            width="medium",
            help="what happened to the run, in the trainer's words (meta.json status_note), and what the app "
            "cannot show of it",
        ),
    },
)
st.caption(
    f"Stale: marked running but nothing written for more than {ui.stale_after():.0f} s "
    "(change it in the sidebar). tokens/s and MFU are medians of the last 100 steps; MFU compares only "
    "between runs with the same peak, tokens/s between runs of the same model."
)

# the note column sits at the table's right edge, off screen on a laptop: the runs that did not
# end cleanly are spelled out here as well, newest first
endings = ui.endings(infos)
if endings:
    st.markdown(endings)
if notes:
    st.caption("MFU: " + " · ".join(notes))
for info in infos:
    ui.show_problem(info)
stray = runs.stray_folders(cfg.runs_dir)
if stray:
    st.caption(f"Ignored (no meta.json): {', '.join(stray)}")
