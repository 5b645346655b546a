"""`moeguard canary --matrix`: the kernel-choice matrix, each cell an A/B canary against a reference.

    moeguard canary --matrix attention=math,flash,efficient experts=loop,bmm,grouped_mm compile=off,on

The cells are the product of the axes' values; the reference is the first cell (each axis's first
value: list the config's current choice first). Every other cell is measured by the A/B runner
(guard/canary/ab.py: `measure_ab`) as `--ab set:<reference> set:<cell>` would be: worker pairs in
ABBA order, the median per-pair B/A tokens/s ratio with its sign-test interval, more pairs while
undecided. A host's drift between one cell's minutes and the next's then cancels in each cell's
ratio instead of ranking the cells. Each cell's full A/B report (ab.json / ab.md, with the
environment diff: the backend actually used) goes to REPORT_DIR/cells/<cell>/; matrix.json /
matrix.md rank the cells by their ratio and say when the reference is not the fastest.

No gate: a slower cell is information (exit 0); a cell that cannot run here (flash attention on
a CPU) is listed as unavailable; a worker that fails, or a reference that cannot run, exits 1.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import statistics
from pathlib import Path
from typing import Any

from guard.canary.ab import WorkerFailed, measure_ab, parse_inject, parse_side
from guard.canary.ab_format import Report
from guard.canary.ab_report import build_report, write_reports
from guard.canary.config import EXIT_FAIL, EXIT_PASS, Setup
from guard.canary.history import finite
from guard.canary.measure import progress, slug
from guard.canary.report import write_json_and_markdown
from guard.core.tomlconf import ConfigError

MATRIX_AXES = {"attention": "model.attention", "experts": "model.experts_kernel", "compile": "train.compile"}
_BOOL_WORDS = {"on": True, "off": False, "true": True, "false": False, "1": True, "0": False}


def parse_matrix(tokens: list[str]) -> list[tuple[str, dict[str, Any]]]:
    """['attention=math,flash', 'compile=off,on'] -> [(label, overrides)] (the cartesian product).

    Axes: attention, experts, compile, or any dotted config key (e.g. model.top_k=1,2)."""
    axes: list[tuple[str, str, list[tuple[str, Any]]]] = []
    for tok in tokens:
        name, sep, vals = tok.partition("=")
        if not sep or not name or not vals:
            raise ConfigError(
                f"--matrix {tok!r}: expected AXIS=V1,V2 (axes: {', '.join(MATRIX_AXES)} or a dotted key)"
            )
        key = MATRIX_AXES.get(name, name)
        if "." not in key:
            raise ConfigError(
                f"--matrix {tok!r}: unknown axis {name!r}; axes: {', '.join(MATRIX_AXES)} or a dotted key"
            )
        values = []
        for raw in (v.strip() for v in vals.split(",") if v.strip()):
            values.append((raw, _matrix_value(key, raw)))
        axes.append((name, key, values))
    variants = []
    for combo in itertools.product(*(vals for _, _, vals in axes)):
        label = " ".join(f"{name}={raw}" for (name, _, _), (raw, _) in zip(axes, combo, strict=True))
        variants.append((label, {key: v for (_, key, _), (_, v) in zip(axes, combo, strict=True)}))
    return variants


def _matrix_value(key: str, raw: str) -> Any:
    if key == "train.compile" or raw.lower() in ("on", "off"):
        if raw.lower() not in _BOOL_WORDS:
            raise ConfigError(f"--matrix {key}={raw!r}: expected on|off")
        return _BOOL_WORDS[raw.lower()]
    for conv in (int, float):
        try:
            return conv(raw)
        except ValueError:
            pass
    return raw


def set_spec(overrides: dict[str, Any]) -> str:
    """A cell's overrides as the `--ab set:` environment that measures it."""
    text = {True: "true", False: "false"}
    return "set:" + ",".join(f"{k}={text[v] if isinstance(v, bool) else v}" for k, v in overrides.items())


def pairs_per_cell(setup: Setup, repeats: int | None) -> Setup:
    """`--repeats N`: N pairs per cell, no extension; else canary.ab_pairs .. ab_max_pairs."""
    if repeats is None:
        return setup
    if repeats < 2:
        raise ConfigError(f"--repeats {repeats}: a cell needs at least 2 pairs")
    c = dataclasses.replace(setup.canary, ab_pairs=repeats, ab_max_pairs=repeats)
    return dataclasses.replace(setup, canary=c)


def run_matrix(args: argparse.Namespace, setup: Setup) -> int:
    cells = parse_matrix(args.matrix)
    if len(cells) < 2:
        raise ConfigError(
            f"--matrix {' '.join(args.matrix)}: one cell; a matrix needs two values on some axis"
        )
    setup = pairs_per_cell(setup, args.repeats)
    slow_ref, slow_cell = parse_inject(args.inject)
    sides = []
    for i, (label, ov) in enumerate(cells):
        side = parse_side(set_spec(ov), "A" if i == 0 else "B", setup.trainer.parse_overrides)
        side.slow_pct = slow_ref if i == 0 else slow_cell
        try:  # every cell's config now, before minutes of measuring
            setup.train_config(side.overrides)
        except ConfigError as e:
            raise ConfigError(f"--matrix cell {label!r}: {e}") from None
        sides.append(side)
    runs, report_dir = Path(args.runs).resolve(), Path(args.report_dir)
    reports: dict[str, Report] = {}
    failed: dict[str, WorkerFailed] = {}
    for k, ((label, _), side) in enumerate(zip(cells[1:], sides[1:], strict=True), 1):
        progress(f"[{k}/{len(cells) - 1}] {label} vs the reference {cells[0][0]} ...")
        try:
            paired = measure_ab(setup, [sides[0], side], runs, tag=slug(label))
        except WorkerFailed as e:
            progress(f"    {'unavailable' if e.unavailable else 'error'}: {e.reason}")
            failed[label] = e
            if e.side == "A":  # the reference itself cannot run: nothing can be judged
                break
            continue
        reports[label] = build_report(setup=setup, sides=[sides[0], side], paired=paired)
        write_reports(reports[label], report_dir / "cells" / slug(label))
        st = reports[label]["statistic"]
        progress(
            f"    B/A {st['median']:.4f} [{st['ci'][0]:.4f}, {st['ci'][1]:.4f}]: {judge(reports[label])}"
        )
    rep = matrix_report(setup, cells, reports, failed, report_dir)
    md, _ = write_json_and_markdown(rep, report_dir, "matrix", render_matrix_markdown)
    print(render_matrix_table(rep))
    if rep["not_fastest"]:
        print(rep["not_fastest"])
    print(f"report: {md}")
    bad = any(not e.unavailable or e.side == "A" for e in failed.values())
    return EXIT_FAIL if bad else EXIT_PASS


def judge(rep: Report) -> str:
    """A cell against the reference, in words: by the interval of its median B/A, not the median."""
    lo, hi = rep["statistic"]["ci"]
    if hi is not None and hi < 1:
        return "slower"
    if lo is not None and lo > 1:
        return "faster"
    return "no clear difference"


def _env_of(rep: Report, side: str) -> dict[str, str]:
    return {d["key"]: d["a" if side == "A" else "b"] for d in rep["env_diff"]}


def cell_row(label: str, overrides: dict[str, Any], rep: Report, report_dir: Path) -> dict[str, Any]:
    st, b = rep["statistic"], rep["sides"]["B"]
    env = _env_of(rep, "B")
    return {
        "cell": label,
        "overrides": overrides,
        "status": "ok",
        "judged": judge(rep),
        "ratio_median": st["median"],
        "ci": st["ci"],
        "coverage": st["coverage"],
        "n_pairs": st["n_pairs"],
        "ab_verdict": rep["verdict"],
        "mfu_median": b["mfu_median"],
        "tokens_per_s_median": b["tokens_per_s_median"],
        "attention_backend": env.get("attention_backend"),
        "expert_kernel": env.get("expert_kernel"),
        "compile": env.get("compile"),
        "runs": b["run_ids"],
        "ab_report": str(report_dir / "cells" / slug(label) / "ab.json"),
    }


def matrix_report(
    setup: Setup,
    cells: list[tuple[str, dict[str, Any]]],
    reports: dict[str, Report],
    failed: dict[str, WorkerFailed],
    report_dir: Path,
) -> dict[str, Any]:
    """matrix.json: the reference and every cell (its ratio, interval, what it ran), the fastest."""
    ref_label, ref_ov = cells[0]
    ref_env = _env_of(next(iter(reports.values())), "A") if reports else {}
    ref_mfu = [r["sides"]["A"]["mfu_median"] for r in reports.values() if r["sides"]["A"]["mfu_median"]]
    rows: list[dict[str, Any]] = [
        {
            "cell": ref_label,
            "overrides": ref_ov,
            "status": "reference",
            "judged": "reference",
            "ratio_median": 1.0,
            "mfu_median": statistics.median(ref_mfu) if ref_mfu else None,
            "attention_backend": ref_env.get("attention_backend"),
            "expert_kernel": ref_env.get("expert_kernel"),
            "compile": ref_env.get("compile"),
            "runs": [rid for r in reports.values() for rid in r["sides"]["A"]["run_ids"]],
        }
    ]
    for label, ov in cells[1:]:
        if label in reports:
            rows.append(cell_row(label, ov, reports[label], report_dir))
        elif label in failed:
            e = failed[label]
            status = "error" if e.side == "A" or not e.unavailable else "unavailable"
            rows.append({"cell": label, "overrides": ov, "status": status, "reason": e.detail})
        else:
            rows.append(
                {"cell": label, "overrides": ov, "status": "not measured", "reason": "the reference failed"}
            )
    faster = [r for r in rows if r.get("judged") == "faster"]
    best = max(faster, key=lambda r: r["ratio_median"]) if faster else None
    c = setup.canary
    return finite(
        {
            "kind": "matrix",
            "config": str(setup.path),
            "config_label": setup.label(),
            "reference": ref_label,
            "pairs": f"{c.ab_pairs} pairs per cell"
            + ("" if c.ab_max_pairs == c.ab_pairs else f", up to {c.ab_max_pairs}"),
            "order": c.ab_order,
            "cells": rows,
            "not_fastest": (
                f"The reference ({ref_label}) is not the fastest: {best['cell']} is faster, "
                f"B/A {best['ratio_median']:.4f} (interval {best['ci'][0]:.4f} .. {best['ci'][1]:.4f})"
                if best
                else ""
            ),
        }
    )


def render_matrix_table(rep: dict[str, Any]) -> str:
    ranked = sorted(
        (r for r in rep["cells"] if r.get("ratio_median") is not None), key=lambda r: -r["ratio_median"]
    )
    rest = [r for r in rep["cells"] if r.get("ratio_median") is None]
    lines = [
        "| cell | B/A vs reference | interval | pairs | judged | MFU (median) | attention used | experts | compile |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in ranked:
        ci = r.get("ci")
        interval = f"[{ci[0]:.4f}, {ci[1]:.4f}]" if ci and None not in ci else "—"
        mfu = f"{100 * r['mfu_median']:.3f}%" if r.get("mfu_median") is not None else "—"
        lines.append(
            f"| {r['cell']} | {r['ratio_median']:.4f} | {interval} | {r.get('n_pairs', '—')} | {r['judged']} | "
            f"{mfu} | {r.get('attention_backend')} | {r.get('expert_kernel')} | {r.get('compile')} |"
        )
    for r in rest:
        lines.append(f"| {r['cell']} | — | — | — | {r['status']} | — | — | — | — |")
    lines += [f"\n{r['cell']}: {r['status']}: {r.get('reason', '')}" for r in rest]
    return "\n".join(lines)


def render_matrix_markdown(rep: dict[str, Any]) -> str:
    return "\n".join(
        [
            "# Canary kernel matrix",
            "",
            f"- config: `{rep['config_label']}`; reference: `{rep['reference']}`; {rep['pairs']} ({rep['order']} order)",
            "- B/A: the median over the cell's worker pairs of its tokens/s over the reference's (CPU: per "
            "CPU-second, normalised by each process's reference matmul); judged by its sign-test interval: "
            "slower (wholly below 1), faster (wholly above 1), else no clear difference. Each cell's A/B report "
            "(pairs, environment diff, ops that changed): `cells/<cell>/ab.md`.",
            *([f"- **{rep['not_fastest']}**"] if rep["not_fastest"] else []),
            "",
            render_matrix_table(rep),
            "",
        ]
    )
