"""The Canaries page's A/B section: one `moeguard canary --ab` report (ab.json) at a time: the
verdict, the per-pair ratios with the median and its interval, the environment diff, the ops
that changed most."""

from __future__ import annotations

import streamlit as st

from dashboards import ui
from dashboards.data import canary_ab
from dashboards.data.config import AppConfig
from dashboards.figures.canary_ab import ab_pairs_figure
from guard.canary.ab_format import AB_JSON, RATIO_LABELS, SPEED, TPS_RAW, Report
from guard.canary.config import TIMING_CPU

VERDICT_BOX = {"pass": st.success, "warn": st.warning, "fail": st.error}
RATIO_FORMAT = st.column_config.NumberColumn(format="%.4f")
ROW_PX = 35  # Streamlit's dataframe row height


def render_ab_section(cfg: AppConfig) -> None:
    st.header("A/B canaries")
    where = cfg.ab_reports
    paths = canary_ab.report_paths(where) if where is not None else []
    if not paths:
        st.info(
            f"No A/B canary report (`{AB_JSON}`) at `{where}`. `moeguard canary --ab A B --runs "
            f"{cfg.runs_dir}` writes one there; start the app with `--ab-reports PATH` to read one elsewhere."
        )
        return
    loaded = [(p, *canary_ab.load_report(str(p), p.stat().st_mtime_ns)) for p in paths]
    bad = [(p, why) for p, rep, why in loaded if rep is None]
    good = [(p, rep) for p, rep, _ in loaded if rep is not None]
    if bad:
        st.warning(f"{len(bad)} file(s) skipped: " + "; ".join(why for _, why in bad[:3]))
    if not good:
        return
    labels = [canary_ab.report_label(p, where, rep) for p, rep in good]  # type: ignore[arg-type]
    pick = (
        st.selectbox(
            "Report (newest first)", range(len(good)), format_func=labels.__getitem__, key="ab_report"
        )
        if len(good) > 1
        else 0
    )
    path, rep = good[pick]
    st.caption(f"`{path}`")
    _verdict(rep)
    pairs = canary_ab.pairs_table(rep)
    st.plotly_chart(ab_pairs_figure(rep, pairs), key="ab_pairs")
    st.caption(
        "Each pair is one worker process of A and one of B, run back to back (ABBA order: a drift slower "
        f"than two processes hits both sides alike). {ratio_words(rep)} The band is the median's sign-test "
        "interval: the verdict fails only when it lies wholly below the fail line."
    )
    st.subheader("Environment diff")
    env = canary_ab.env_table(rep)
    differs = env.filter(env["differs"])
    st.markdown(
        "Differs: " + ", ".join(f"**{k}** (A `{a}`, B `{b}`)" for k, a, b, _ in differs.iter_rows())
        if differs.height
        else "A and B report the same environment (only the injected slowdown, if any, differs)."
    )
    env = env.sort("differs", descending=True, maintain_order=True)  # what differs first
    ui.dataframe(env, hide_index=True, height=ROW_PX * (env.height + 1) + 3)  # every row, no inner scroll
    _changed_ops(rep)
    with st.expander("Pairs and per-side medians"):
        ui.dataframe(
            pairs,
            hide_index=True,
            column_config={c: RATIO_FORMAT for c in pairs.columns if c.startswith("B/A")}
            | {"load": st.column_config.NumberColumn(format="%.1f")},
        )
        ui.dataframe(canary_ab.sides_table(rep), hide_index=True)


def ratio_words(rep: Report) -> str:
    """What the chart's two marks are, in ab.md's own words (RATIO_LABELS, defined once): on CPU
    timing the gated ratio is normalised by each process's reference matmul and the grey one is
    not; on wall timing neither is, and they are one ratio."""
    if rep.get("timing") == TIMING_CPU:
        return f"Filled: the gated ratio, {RATIO_LABELS[SPEED]}; open grey: {RATIO_LABELS[TPS_RAW]}."
    return (
        f"Filled: the gated ratio, wall-clock tokens/s (timing {rep.get('timing')}: not normalised by a "
        "reference matmul, so the open grey raw tokens/s ratio is the same number)."
    )


def _verdict(rep: Report) -> None:
    s = rep["statistic"]
    med = "—" if s["median"] is None else f"{s['median']:.4f} ({s['delta_pct']:+.2f}%)"
    VERDICT_BOX.get(rep["verdict"], st.info)(f"**{rep['verdict'].upper()}**: {rep['state']}")
    m = st.columns(4)
    m[0].metric("median B/A", med, help=s.get("label"))
    lo, hi = s["ci"]
    m[1].metric(
        "interval",
        "—" if lo is None or hi is None else f"{lo:.4f} .. {hi:.4f}",
        help=canary_ab.interval_words(rep),
    )
    m[2].metric(
        "pairs", s["n_pairs"], help=f"B faster in {s['b_faster_pairs']} of them; order {rep['sequence']}"
    )
    m[3].metric("minutes", f"{rep['elapsed_s'] / 60:.1f}")
    st.markdown(" · ".join(_side_words(rep, name) for name in ("A", "B")))
    st.caption(
        f"config `{rep['config_label']}` · timing {rep['timing']} · order {rep['sequence']} · "
        f"interval {canary_ab.interval_words(rep)}"
    )


def _side_words(rep: Report, name: str) -> str:
    side = rep["sides"][name]
    slow = f" (injected slowdown {side['slow_pct']:g}%)" if side["slow_pct"] else ""
    return f"**{name}** = `{side['spec']}`{slow}"


def _changed_ops(rep: Report) -> None:
    st.subheader("Ops that changed most")
    prof = rep["profile_diff"]
    shown = False
    for kind, title in (
        ("host", "Host ops, self time per step"),
        ("device", "Device kernels, time per step"),
    ):
        ops = canary_ab.ops_table(rep, kind)
        if ops.height == 0:
            continue
        shown = True
        st.markdown(f"**{title}** (B - A, median over each side's profiled workers)")
        ui.dataframe(
            ops,
            hide_index=True,
            column_config={
                "op": st.column_config.TextColumn(width="large"),
                "A ms": st.column_config.NumberColumn(format="%.4f"),
                "B ms": st.column_config.NumberColumn(format="%.4f"),
                "B - A ms": st.column_config.NumberColumn(format="%+.4f"),
                "change %": st.column_config.NumberColumn(format="%+.0f"),
            },
        )
    if shown:
        w = prof["workers_profiled"]
        st.caption(
            f"Profiled workers: A {w.get('A', 0)}, B {w.get('B', 0)}; a few steps each: read only large changes "
            "and ops that appear or vanish."
        )
    else:
        st.info("No profiler traces in these workers (telemetry.profile = false?).")
