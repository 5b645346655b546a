"""A synthetic A/B canary report written through the canary's own writer (guard/canary/ab_report.py):
made-up worker rows (torch 2.13.0 vs 2.14.1, grouped_mm vs bmm) and tiny profiler traces, judged by
the real paired statistic; for the app's data tests. The screenshot test uses a real A/B run."""

from __future__ import annotations

import json
from pathlib import Path

from guard.canary.ab import Paired, pair_ratios, paired_statistic, parse_side
from guard.canary.ab_format import SPEED, Pair
from guard.canary.ab_report import build_report, write_reports
from guard.canary.config import DEFAULT_CONFIG, load_setup
from guard.core import schema
from trainer.canary_cli import TRAINER

ENV = {
    "A": {
        "torch": "2.13.0+cpu",
        "expert_kernel": "grouped_mm",
        "attention_backend": "flash",
        "python": "3.11.7",
    },
    "B": {"torch": "2.14.1+cu130", "expert_kernel": "bmm", "attention_backend": "flash", "python": "3.11.7"},
}
OPS = {
    "A": {"aten::bmm": 1.0, "aten::mm": 2.0},
    "B": {"aten::bmm": 3.0, "aten::mm": 2.0, "aten::new_op": 0.5},
}


def _trace(run_dir: Path, ops: dict[str, float]) -> None:
    """One profiled step: each op a top-level cpu_op of `ms` milliseconds."""
    events, t = [{"ph": "X", "name": "ProfilerStep#3", "ts": 0, "dur": 1e5, "cat": "user_annotation"}], 0.0
    for op, ms in ops.items():
        events.append({"ph": "X", "name": op, "cat": "cpu_op", "ts": t, "dur": ms * 1e3})
        t += ms * 1e3 + 1
    (run_dir / schema.PROFILE_DIR).mkdir(parents=True, exist_ok=True)
    (run_dir / schema.PROFILE_DIR / "trace.json").write_text(json.dumps({"traceEvents": events}))


def _row(side: str, pair: int, speed: float, runs: Path) -> dict:
    run_id = f"ab-synth-p{pair + 1:02d}{side}"
    _trace(runs / run_id, OPS[side])
    return {
        "side": side,
        "pair": pair + 1,
        "run_id": run_id,
        "run_dir": str(runs / run_id),
        "timing": "cpu",
        "flops_per_token": 1e6,
        SPEED: speed,
        "tokens_per_s": speed * 40,
        "mfu": speed / 1e4,
        "tokens_per_s_wall": speed * 30,
        "ref_cpu_ms": 4.5,
        "step_cpu_ms": 25.0 / (speed / 100),
        "mem_peak_bytes": 2e8,
        "final_loss": 5.1,
        "env": ENV[side],
    }


def write_ab_report(report_dir: Path, ratios: list[float]) -> Path:
    """ab.json (and ab.md) in report_dir for pairs with these B/A ratios; returns the ab.json path."""
    setup = load_setup(DEFAULT_CONFIG, {}, TRAINER)
    sides = [
        parse_side("set:", "A", TRAINER.parse_overrides),
        parse_side("set:model.experts_kernel=bmm", "B", TRAINER.parse_overrides),
    ]
    runs = report_dir / "runs"
    rows, pairs = [], []
    for i, r in enumerate(ratios):
        order = "AB" if i % 2 == 0 else "BA"
        got = {"A": _row("A", i, 100.0, runs), "B": _row("B", i, 100.0 * r, runs)}
        rows += [got[s] for s in order]
        pairs.append(
            Pair(
                pair=i + 1,
                order=order,
                a_run=got["A"]["run_id"],
                b_run=got["B"]["run_id"],
                ratio=pair_ratios(got["A"], got["B"]),
                load=1.0 + i / 10,
            )
        )
    stat = paired_statistic(ratios, setup.canary)
    rep = build_report(
        setup=setup, sides=sides, paired=Paired(rows=rows, pairs=pairs, stat=stat, elapsed_s=150.0)
    )
    _, js = write_reports(rep, report_dir)
    return js
