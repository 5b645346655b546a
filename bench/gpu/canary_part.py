"""Parts `matrix` and `canary`: `moeguard canary` itself (`python -m guard canary`), on
bench/gpu/canary_gpu.toml on a GPU, on configs/canary.toml shortened for `--dry`.

matrix: `--matrix attention=flash,efficient,math` and `--matrix experts=grouped_mm,loop` (two
        one-axis matrices, 2 worker pairs a cell: three cells against their reference instead of
        the five of the 3 x 2 product, to fit the box), each cell's MFU and B/A ratio.
canary: `--ab set: set:` (A = A: no false alarm expected) and `--ab set: set: --inject slow:5`
        (B slowed 5%: caught expected), PAIRS worker pairs each.

Writes docs/BENCHMARKS.md › GPU, through `bench/gpu/report.py`: no section of its own.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.gpu.common import PartLog

REPO = Path(__file__).resolve().parents[2]
GPU_CONFIG = REPO / "bench" / "gpu" / "canary_gpu.toml"
DRY_CONFIG = REPO / "configs" / "canary.toml"
# dry: the fewest steps the canary accepts (train.steps > canary.warmup_steps + 5): 6 steady steps a
# worker, every line of the worker and of the verdict still run
DRY_SETS = ["train.steps=10", "canary.warmup_steps=4", "canary.processes=1", "telemetry.profile=false"]
MATRICES = {
    "gpu": [["attention=flash,efficient,math"], ["experts=grouped_mm,loop"]],
    "dry": [["attention=math,flash"]],  # the CPU has no efficient-attention kernel: one cell
}
PAIRS = {"gpu": 3, "dry": 2}
SLOW_PCT = 5


def canary(args: list[str], *, dry: bool, tmp: Path, timeout: float) -> tuple[int, str]:
    cfg = DRY_CONFIG if dry else GPU_CONFIG
    sets = [x for s in DRY_SETS for x in ("--set", s)] if dry else []
    cmd = [
        sys.executable,
        "-m",
        "guard",
        "canary",
        "--config",
        str(cfg),
        "--runs",
        str(tmp / "runs"),
        *sets,
        *args,
    ]
    try:
        p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=max(5.0, timeout))
    except subprocess.TimeoutExpired as e:
        out = (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        return -9, f"timed out after {timeout:.0f} s\n{out[-1500:]}"
    return p.returncode, (p.stdout + p.stderr)[-2500:]


def run_matrix(log: PartLog, *, dry: bool, deadline: float) -> None:
    size = "dry" if dry else "gpu"
    with tempfile.TemporaryDirectory(prefix="moeguard-gpu-matrix-") as d:
        tmp = Path(d)
        mats = MATRICES[size]
        for i, axes in enumerate(mats):
            left = deadline - time.monotonic()
            rep = tmp / f"m{i}"
            rc, out = canary(
                ["--matrix", *axes, "--repeats", "2", "--report-dir", str(rep)],
                dry=dry,
                tmp=tmp,
                timeout=left / (len(mats) - i),
            )
            key = " ".join(axes)
            if not (rep / "matrix.json").is_file():
                log.not_done(f"matrix {key}", f"exit {rc}: {out}")
                continue
            m = json.loads((rep / "matrix.json").read_text())
            log.put(
                f"matrix {key}", {"exit": rc, "cells": [_cell(r) for r in m.get("cells", m.get("rows", []))]}
            )


def _cell(r: dict[str, Any]) -> dict[str, Any]:
    keep = ("cell", "status", "judged", "ratio_median", "ci", "mfu_median", "tokens_per_s_median")
    return {k: r.get(k) for k in keep} | {
        k: r.get(k) for k in ("attention_backend", "expert_kernel", "reason") if r.get(k) is not None
    }


def run_ab(log: PartLog, *, dry: bool, deadline: float) -> None:
    size = "dry" if dry else "gpu"
    pairs = PAIRS[size]
    sets = ["--set", f"canary.ab_pairs={pairs}", "--set", f"canary.ab_max_pairs={pairs}"]
    runs = [("A = A", [], "pass"), (f"B slowed {SLOW_PCT}%", ["--inject", f"slow:{SLOW_PCT}"], "fail")]
    if dry:  # CI time: the slowed run exercises every line the A = A run does
        log.put("A = A", "dry: not run (the slowed run below runs the same code; both run on a GPU)")
        runs = runs[1:]
    with tempfile.TemporaryDirectory(prefix="moeguard-gpu-ab-") as d:
        tmp = Path(d)
        for i, (what, extra, expected) in enumerate(runs):
            rep = tmp / f"ab{i}"
            rc, out = canary(
                ["--ab", "set:", "set:", *extra, *sets, "--report-dir", str(rep)],
                dry=dry,
                tmp=tmp,
                timeout=(deadline - time.monotonic()) / (len(runs) - i),
            )
            if not (rep / "ab.json").is_file():
                log.not_done(what, f"exit {rc}: {out}")
                continue
            r = json.loads((rep / "ab.json").read_text())
            st = r["statistic"]
            log.put(
                what,
                {
                    "exit": rc,
                    "verdict": r["verdict"],
                    "expected": expected,
                    "as_expected": r["verdict"] == expected,
                    "ratio_median": st["median"],
                    "ci": st["ci"],
                    "n_pairs": st["n_pairs"],
                    "state": st.get("state"),
                    "mfu_median": [r["sides"][s].get("mfu_median") for s in ("A", "B")],
                    "elapsed_s": r.get("elapsed_s"),
                },
            )
