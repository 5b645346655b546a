"""Runs: every run in the store with its status, progress, efficiency and guard activity."""

from __future__ import annotations

import polars as pl
import streamlit as st

from dashboards import ui
from dashboards.data import config, loaders, mfu_peak, open_alerts, run_filter, runs
from guard.core.tags import run_tags

RUN_LINK_TEXT = r"health\?run=(.*)"  # the link's text: the run id out of its URL

# columns said once, above the table, when every run has the same value in them
SAID_ONCE = ("torch", "attention", "expert kernel", "compile", "MFU peak")


def damaged_note(summ: dict) -> str:
    n = len(summ.get("damaged") or [])
    return f"{n} damaged part(s) skipped" if n else ""


def filters(infos: list[runs.RunInfo]) -> run_filter.RunFilter:
    """The filter row above the table: name, status, tag, started-at date (unset: every run)."""
    name_col, status_col, tag_col, date_col = st.columns([3, 3, 3, 3])
    name = name_col.text_input("Name contains", key="runs_name", placeholder="run id", bind="query-params")
    statuses = status_col.multiselect(
        "Status", sorted({i.status for i in infos}), key="runs_status", placeholder="any", bind="query-params"
    )
    tags = run_filter.all_tags(infos)
    picked = tag_col.multiselect(
        "Tag",
        tags,
        key="runs_tags",
        bind="query-params",  # a filtered view is a link: /runs?runs_tags=ablation
        placeholder="any" if tags else "no run has tags",
        disabled=not tags,
        help='runs with any of these tags (meta.json "tags": `moeguard train --tag X`, GuardedStep(tags=...))',
    )
    since = until = None
    span = run_filter.date_span(infos)
    if span is not None:
        picked_days = date_col.date_input(
            "Started", value=span, min_value=span[0], max_value=span[1], key="runs_dates"
        )
        days = list(picked_days) if isinstance(picked_days, tuple | list) else [picked_days]
        # the full span is no filter (a run without a start time stays listed)
        since = days[0] if days and days[0] > span[0] else None
        until = days[-1] if len(days) == 2 and days[1] < span[1] else None
    return run_filter.RunFilter(
        name=name, statuses=frozenset(statuses), tags=frozenset(picked), since=since, until=until
    )


cfg = config.app_config()
st.title("Runs")
every_run = ui.runs_or_stop(cfg)
chosen = filters(every_run)
infos = run_filter.apply(every_run, chosen)
if chosen.active:
    st.caption(f"{len(infos)} of {len(every_run)} runs match the filters.")
if not infos:
    st.info("No run matches the filters: clear one to see more.")
    st.stop()

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
    # the cell flags an artefact; the MFU line under the table says the rest (not comparable, ...)
    artefact = (mfu or 0) > mfu_peak.MFU_LIMIT or bool(summ.get("mfu_over"))
    # config first (it is what runs are compared by), then progress, efficiency, guard activity
    rows.append(
        {
            "run": info.run_id,
            "health": f"health?run={info.run_id}",
            "status": ui.status_cell(info.status),
            "tags": run_tags(info.meta),
            "torch": env.get("torch"),
            "attention": env.get("attention_backend"),
            "expert kernel": env.get("expert_kernel"),
            "compile": None if env.get("compile") is None else str(env.get("compile")),
            # steps run, as `--steps` counts them: a 300-step run ends at step 299 (0-based)
            "steps": None if summ.get("step") is None else summ["step"] + 1,
            "loss": summ.get("loss"),
            "tokens/s": None if summ.get("tokens_per_s") is None else round(summ["tokens_per_s"]),
            "MFU %": None if mfu is None else 100 * mfu,
            # the collector lists runs that have open alerts: one it does not list has none
            "open alerts": alerts.get(info.run_id, 0) if cfg.collector and not alert_error else None,
            "guard actions": summ.get("actions"),
            "verdicts": summ.get("verdicts"),
            "MFU peak": ("artefact · " if artefact else "") + peak.cell() if info.readable else "",
            "last update": ui.age(info.updated_at),
            "note": ui.clip(
                "; ".join(n for n in (ui.run_note(info), damaged_note(summ)) if n), ui.NOTE_CELL_CHARS
            ),
        }
    )
df = pl.DataFrame(rows, infer_schema_length=None)
# a config or peak the same for every run is said once, above the table, not in a column each
same = ui.same_in_every_row(df, SAID_ONCE)
df = df.drop(list(same))
if not cfg.collector:
    df = df.drop("open alerts")
# a column with nothing to say takes no width (a wide empty "note" pushed the kernels off screen)
if (df["note"].fill_null("") == "").all():
    df = df.drop("note")
if df["tags"].list.len().sum() == 0:
    df = df.drop("tags")

# one badge per status present, with its count, in the table's colours
st.markdown(ui.status_counts([i.status for i in infos]))
if same:
    st.caption("Every run: " + " · ".join(f"{c} **{v}**" for c, v in same.items()))

# every column on screen at 1,600 px (sidebar open: ~1,140 px of table): short labels (the help
# says the rest), the run's name is its health page's link (the id stays in the data as "run"),
# long texts clipped in their cells and spelled out under the table
ui.dataframe(
    df,
    hide_index=True,
    height=ui.table_height(df.height),  # every run on screen: a scrolled-away row is a run nobody sees
    column_order=["health", *(c for c in df.columns if c not in ("run", "health"))],
    column_config={
        "health": st.column_config.LinkColumn(
            "run",
            display_text=RUN_LINK_TEXT,
            pinned=True,
            width=ui.text_width(i.run_id for i in infos),
            help="the run's folder name; opens its health page",
        ),
        "status": ui.status_column([i.status for i in infos]),
        "tags": st.column_config.ListColumn(help='the run\'s tags (meta.json "tags")'),
        "attention": st.column_config.TextColumn("attn", help="attention backend"),
        "expert kernel": st.column_config.TextColumn(
            "kernel", help="expert kernel (the MoE layers' expert matmuls)"
        ),
        "steps": st.column_config.NumberColumn(
            format="localized",
            help="steps run so far, as --steps counts them (the last step's index is one less)",
        ),
        "loss": st.column_config.NumberColumn(format="%.3f"),
        "tokens/s": st.column_config.NumberColumn(format="localized", help="median of the last 100 steps"),
        "MFU %": st.column_config.NumberColumn(
            format="%.1f",
            help="median of the last 100 steps; MFU = training FLOPs/token x tokens/s / (peak FLOP/s per "
            "device or thread x devices or threads used), the peak in the next column",
        ),
        "MFU peak": st.column_config.TextColumn(
            "peak FLOP/s",
            help="the peak FLOP/s MFU divides by (GFLOP/s = 1e9, TFLOP/s = 1e12 FLOP/s): table (GPU datasheet), "
            "pinned (CPU machine class, configs/cpu_peaks.toml; scaled to the cores a run pinned to fewer torch "
            "threads can use), self (measured by the run itself: older runs, not "
            "comparable), or none (tokens/s only); 'artefact' where MFU went above 100% (not physical). "
            "The run's health page shows the full source.",
        ),
        "guard actions": st.column_config.NumberColumn(
            "actions",
            help="skipped / rolled-back / halted steps, bias corrections and LR cool-downs started (guard/core/actions.py; "
            "the CLI summary and moeguard_guard_actions_total count the same)",
        ),
        "verdicts": st.column_config.NumberColumn(help="detector verdicts recorded in the events table"),
        "last update": st.column_config.TextColumn("updated", help="last write to the run's folder"),
        "note": st.column_config.TextColumn(
            help="what happened to the run, in the trainer's words (meta.json status_note), and what the app "
            "cannot show of it; a long note is clipped here (…) and spelled out under the table",
        ),
    },
)
st.caption(
    f"Stale: marked running but nothing written for more than {ui.stale_after():.0f} s "
    f"(change it in the sidebar). tokens/s and MFU: {ui.TPS_RECENT}; MFU compares only "
    "between runs with the same peak, tokens/s between runs of the same model."
)

# the runs that did not end cleanly, and every note clipped in its cell, in full, newest first
endings = ui.endings(infos)
if endings:
    st.markdown(endings)
if notes:
    st.caption("MFU: " + " · ".join(notes))
for info in infos:
    ui.show_problem(info)
    if info.readable:
        ui.show_damaged(
            info.run_id, loaders.load_summary(info.path, runs.run_signature(info.path))["damaged"]
        )
if (cfg.runs_dir / runs.WORKER_RUNS_DIR).is_dir():
    st.caption(
        f"Canary worker runs are kept apart in `{runs.WORKER_RUNS_DIR}/`: the sidebar's *Show canary worker "
        f"runs* lists them here, `moeguard app --runs {cfg.runs_dir / runs.WORKER_RUNS_DIR}` opens them alone."
    )
stray = runs.stray_folders(cfg.runs_dir)
if stray:
    st.caption(f"Ignored (no meta.json): {', '.join(stray)}")
