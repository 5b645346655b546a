"""A/B canary reports (`moeguard canary --ab`'s ab.json) as tables for the Canaries page.

Read with guard/canary/ab_format.py, the writer's own definition of the file. Where: the app's
`--ab-reports PATH` (a report file, or a folder searched two levels down, so a kernel matrix's
`cells/<cell>/ab.json` are found too), by default the run store's REPORT_DIR, where `moeguard
canary --ab --runs DIR` writes unless told otherwise."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import polars as pl
import streamlit as st

from guard.canary import ab_format as abf

SEARCH_DEPTH = 3  # DIR/ab.json, DIR/*/ab.json (bench arms), DIR/cells/*/ab.json (a matrix's cells)


def report_paths(where: Path) -> list[Path]:
    """Every ab.json at `where` (a file: itself), newest first."""
    if where.is_file():
        return [where]
    if not where.is_dir():
        return []
    found = [p for depth in range(SEARCH_DEPTH) for p in where.glob("/".join(["*"] * depth + [abf.AB_JSON]))]
    return sorted({p for p in found if p.is_file()}, key=lambda p: p.stat().st_mtime_ns, reverse=True)


@st.cache_data(max_entries=32, show_spinner=False)
def load_report(path: str, mtime_ns: int) -> tuple[abf.Report | None, str]:
    """(the report, "") or (None, why it cannot be read); never raises for a bad file."""
    del mtime_ns
    try:
        return abf.read_report(Path(path)), ""
    except abf.ReportError as e:
        return None, str(e)


def report_label(path: Path, root: Path, rep: abf.Report) -> str:
    """How the report is listed: when, verdict, the median and what was compared."""
    st_ = rep["statistic"]
    where = path.parent.relative_to(root) if path.parent.is_relative_to(root) else path.parent
    med = "—" if st_["median"] is None else f"{st_['median']:.4f}"
    return (
        f"{rep.get('time', '?')} · {rep['verdict'].upper()} · B/A {med} · "
        f"A {rep['sides']['A']['spec']} vs B {rep['sides']['B']['spec']} ({where})"
    )


def interval_words(rep: abf.Report) -> str:
    """The interval and how much of the median it covers, in one line."""
    s = rep["statistic"]
    lo, hi = s["ci"]
    if lo is None or hi is None:
        return "no interval"
    return (
        f"[{lo:.4f}, {hi:.4f}], {100 * s['coverage']:.1f}% sign-test coverage over {s['n_pairs']} pairs; "
        f"fails below {s['fail_below']:.4f}"
    )


def pairs_table(rep: abf.Report) -> pl.DataFrame:
    """One row per pair: its order, the B/A ratios (gated first), the load and the two runs."""
    rows = [
        {
            "pair": p["pair"],
            "order": p["order"],
            "B/A (gated)": p["ratio"][abf.SPEED],
            "B/A tokens/s raw": p["ratio"][abf.TPS_RAW],
            "B/A MFU": p["ratio"][abf.MFU_R],
            "B/A wall tokens/s": p["ratio"][abf.TPS_WALL],
            "load": p["load"],
            "A run": p["a_run"],
            "B run": p["b_run"],
        }
        for p in rep["pairs"]
    ]
    schema = {
        "pair": pl.Int64,
        "order": pl.String,
        "B/A (gated)": pl.Float64,
        "B/A tokens/s raw": pl.Float64,
        "B/A MFU": pl.Float64,
        "B/A wall tokens/s": pl.Float64,
        "load": pl.Float64,
        "A run": pl.String,
        "B run": pl.String,
    }
    return pl.DataFrame(rows, schema=schema, strict=False)


def env_table(rep: abf.Report, *, only_differences: bool = False) -> pl.DataFrame:
    """The environment keys of A and B (torch, CUDA, python, backend used, kernel, ...)."""
    rows = [
        {"key": d["key"], "A": d["a"], "B": d["b"], "differs": d["differs"]}
        for d in rep["env_diff"]
        if d["differs"] or not only_differences
    ]
    return pl.DataFrame(
        rows, schema={"key": pl.String, "A": pl.String, "B": pl.String, "differs": pl.Boolean}
    )


def ops_table(rep: abf.Report, kind: str) -> pl.DataFrame:
    """The ops whose time per step changed most, B - A ("host": self time, "device": kernels)."""
    rows = [
        {
            "op": d["op"],
            "A ms": d["a_ms"],
            "B ms": d["b_ms"],
            "B - A ms": d["delta_ms"],
            "change %": d["delta_pct"],
        }
        for d in rep["profile_diff"][kind]  # type: ignore[literal-required]
    ]
    return pl.DataFrame(
        rows,
        schema={
            "op": pl.String,
            "A ms": pl.Float64,
            "B ms": pl.Float64,
            "B - A ms": pl.Float64,
            "change %": pl.Float64,
        },
    )


def sides_table(rep: abf.Report) -> pl.DataFrame:
    """Per side: its spec, injected slowdown, workers and the medians over its workers."""
    rows: list[dict[str, Any]] = []
    for name in ("A", "B"):
        s = rep["sides"][name]
        rows.append(
            {
                "side": name,
                "environment": s["spec"],
                "workers": s["workers"],
                "injected slowdown %": s["slow_pct"] or None,
                "MFU %": None if s["mfu_median"] is None else 100 * s["mfu_median"],
                "tokens/s": s["tokens_per_s_median"],
                "step CPU ms": s["step_cpu_ms_median"],
                "reference ms": s["ref_cpu_ms_median"],
                "final loss": s["final_loss_median"],
            }
        )
    return pl.DataFrame(rows, strict=False)
