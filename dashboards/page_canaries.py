"""Canaries: MFU history over commits from `moeguard canary`'s JSONL history, with the gate's
baseline; below it the A/B canaries' reports (dashboards/canary_ab_view.py)."""

from __future__ import annotations

import polars as pl
import streamlit as st

from dashboards import ui
from dashboards.canary_ab_view import render_ab_section
from dashboards.data import canaries, config
from dashboards.data.config import AppConfig
from dashboards.figures.canaries import canary_figure
from guard.canary.keys import CPU_EFFICIENCY


def _history_section(cfg: AppConfig) -> None:
    st.header("History gate")
    if cfg.history is None:
        st.info(
            "No canary history given. Start the app with `moeguard app --runs DIR --history FILE`, where FILE is "
            "the JSONL history that `moeguard canary --history FILE` appends to."
        )
        return
    if not cfg.history.is_file():
        st.warning(
            f"Canary history `{cfg.history}` does not exist yet; `moeguard canary --history {cfg.history} "
            "--record` creates it with a first baseline."
        )
        return

    hist, problems = canaries.load_canary_history(str(cfg.history), cfg.history.stat().st_mtime_ns)
    if problems:
        st.warning(
            f"{len(problems)} line(s) of `{cfg.history}` skipped: "
            + "; ".join(problems[:5])
            + (" ..." if len(problems) > 5 else "")
        )
    if hist.height == 0:
        st.info(f"`{cfg.history}` has no canary entries yet.")
        return

    fps = sorted(set(hist["fingerprint"].to_list()))
    fp = st.selectbox("Hardware / config fingerprint", fps, key="fingerprint") if len(fps) > 1 else fps[0]
    sub = hist.filter(pl.col("fingerprint") == fp).drop("n").with_row_index("n")
    last_warn = sub["warn_pct"].drop_nulls()
    last_fail = sub["fail_pct"].drop_nulls()
    c1, c2 = st.columns(2)
    warn = c1.number_input(
        "Warn below baseline by (%)", 0.5, 50.0, float(last_warn[-1]) if len(last_warn) else 5.0, 0.5
    )
    fail = c2.number_input(
        "Fail below baseline by (%)", 0.5, 50.0, float(last_fail[-1]) if len(last_fail) else 10.0, 0.5
    )
    gate = canaries.canary_gate(sub, warn_pct=warn, fail_pct=fail)  # for the latest entry: baseline before it

    # on a CPU class the canary gates a CPU efficiency (MFU against a per-step reference matmul), not
    # an MFU against a datasheet peak: one name per measure on every surface (guard/canary/keys.py)
    on_cpu = any(part.strip().startswith("cpu:") for part in str(fp).split("|"))  # the device part
    measure = CPU_EFFICIENCY if on_cpu else "MFU"
    latest = sub.row(-1, named=True)
    deltas = canaries.canary_deltas(sub)
    m = st.columns(4)
    base = gate["baseline"]
    m[0].metric(
        f"baseline {measure} (median)",
        f"{100 * base:.2f}%" if base else "—",
        help=f"median {measure} p50 of the {int(gate.get('n_baseline') or 0)} baseline entries recorded before the "
        f"latest one with its fingerprint and config hash (the last {canaries.CANARY_WINDOW}: the rule `moeguard "
        "canary` judges by, guard/canary/history.py); the latest entry is never part of its own baseline",
    )
    m[1].metric(
        f"latest {measure} p50",
        f"{100 * latest['mfu_p50']:.2f}%",
        delta=f"{deltas[-1]:+.1f}% vs baseline" if deltas[-1] is not None else None,
    )
    m[2].metric("latest verdict", latest["verdict"])
    m[3].metric("failures", int((sub["verdict"] == "fail").sum()))
    if base is None:
        st.info(
            "The latest entry has no baseline before it (the first `--record` makes one); nothing to judge it by."
        )

    st.plotly_chart(canary_figure(sub, gate, fingerprint=fp, measure=measure), key="canary")
    st.caption(
        "Band: the latest entry's baseline ± warn %. Dashed red: fail threshold. Verdicts are the canary's own "
        f"(recorded at the time with its thresholds; on CPU it gates the host-adjusted {CPU_EFFICIENCY}, so its delta can differ "
        "from the raw one here); the band uses the thresholds above."
    )
    ui.dataframe(
        sub.with_columns(deltas)
        .sort("n", descending=True)
        .select(
            "time",
            "git_sha",
            "torch",
            "verdict",
            "baseline",
            (pl.col("mfu_p50") * 100).alias(f"{measure} p50 %"),
            "vs baseline %",
            pl.col("tokens_per_s_p50").round(0),
            "config",
        ),
        hide_index=True,
        column_config={
            f"{measure} p50 %": st.column_config.NumberColumn(format="%.2f"),
            "vs baseline %": st.column_config.NumberColumn(
                format="%+.1f",
                help=f"{measure} p50 vs the median of the baseline entries recorded before this one",
            ),
            "tokens_per_s_p50": st.column_config.NumberColumn("tokens/s p50", format="localized"),
        },
    )

    st.subheader("Top kernels: latest vs its baseline")
    base_rows = canaries.canary_baseline_rows(sub, int(latest["n"]))
    kern = canaries.kernel_deltas(
        canaries.profile_top(latest.get("profile_top")),
        [canaries.profile_top(j) for j in base_rows["profile_top"].to_list()] if base_rows.height else [],
    )
    if kern.height == 0:
        st.info("No per-op profile to compare (the latest entry or its baseline has no `profile_top`).")
    else:
        overall = kern["now ms"].sum() / kern["baseline ms"].sum() - 1
        st.caption(
            f"Self time per step of the ops both profiles list: **{100 * overall:+.1f}% overall**. An op is suspect "
            "when it moved relative to the rest (`vs overall`, share change), not when it moved with everything: "
            "a uniform slowdown raises every op's raw time and no op's share. Sorted by share change."
        )
        ui.dataframe(
            kern.head(15),
            hide_index=True,
            column_config={
                "op": st.column_config.TextColumn(width="large"),  # aten::_scaled_dot_product_... was cut off
                "now ms": st.column_config.NumberColumn(format="%.3f"),
                "baseline ms": st.column_config.NumberColumn(format="%.3f"),
                "raw change %": st.column_config.NumberColumn(
                    format="%+.1f", help="moves with the whole step"
                ),
                "vs overall %": st.column_config.NumberColumn(
                    format="%+.1f",
                    help="this op's change divided by the overall change: ~0 under a uniform slowdown",
                ),
                "share now %": st.column_config.NumberColumn(format="%.1f"),
                "share before %": st.column_config.NumberColumn(format="%.1f"),
                "share change (pts)": st.column_config.NumberColumn(format="%+.1f"),
            },
        )


cfg = config.app_config()
st.title("Canaries")
_history_section(cfg)
render_ab_section(cfg)
