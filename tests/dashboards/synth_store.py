"""The synthetic run store the app tests open, and a canary history.

`make_store(root)` writes a small zoo of runs through the real writer (tests/dashboards/
synth_run.py): a guarded run with injected faults, an unguarded twin, halted / crashed / live /
stale runs, runs that were preempted, interrupted or ended non-finite, half-written runs and runs from older and newer schema versions.
`write_canary_history(path)` writes the JSONL `moeguard canary --history FILE` appends to.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Iterable
from pathlib import Path

import numpy as np
import polars as pl

from guard.core import schema
from guard.store.layout import atomic_write_json
from guard.store.runstore import RunStore
from tests.dashboards.synth_run import ENV_A, ENV_B, T0, SynthRun, default_faults, write_run
from trainer import outcome

# Run ids written by make_store(); tests refer to them by these names.
GUARDED = "guarded-faults"
UNGUARDED = "unguarded-faults"
HALTED = "halted-nonfinite"
CRASHED = "crashed-at-150"
LIVE = "live-running"
STALE = "stale-running"
PREEMPTED = "preempted-at-212"
INTERRUPTED = "interrupted-at-95"
NONFINITE = "unguarded-nan-ended"
META_ONLY = "half-meta-only"
NO_LAYERS = "half-steps-only"
OLD_SCHEMA = "schema-v0"
NEW_SCHEMA = "schema-v99"


def set_meta(run_dir: Path, **fields: object) -> None:
    """Overwrite meta.json fields as they are (no schema_version/updated_at stamping)."""
    meta = json.loads((run_dir / schema.META_FILE).read_text())
    meta.update(fields)
    atomic_write_json(run_dir / schema.META_FILE, meta)


def make_store(root: str | Path) -> dict[str, Path]:
    """Write the synthetic run zoo under `root`; returns run_id -> folder."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    out = _ended_early_runs(root)  # first: the others are newer, so the app's default picks stay theirs
    out.update(_whole_runs(root))
    out.update(_half_written_runs(root))
    out.update(_other_schema_runs(root))
    # a folder that is not a run at all (no meta.json): readers skip it
    (root / "not-a-run").mkdir(exist_ok=True)
    return out


def _whole_runs(root: Path) -> dict[str, Path]:
    """Finished, halted, crashed, live and stale runs."""
    out: dict[str, Path] = {}
    out[GUARDED] = write_run(root, SynthRun(run_id=GUARDED, seed=1))
    out[UNGUARDED] = write_run(
        root, SynthRun(run_id=UNGUARDED, guarded=False, env=dict(ENV_B), mfu=0.31, seed=2)
    )
    out[HALTED] = write_run(
        root,
        SynthRun(
            run_id=HALTED,
            steps=400,
            halt_at=250,
            status=schema.STATUS_HALTED,
            status_note=outcome.halted(
                250, "3 non-finite steps in a row", Path("checkpoints/step-000000200")
            ).note,
            faults=default_faults()[:2],
            seed=3,
        ),
    )
    out[CRASHED] = write_run(
        root,
        SynthRun(
            run_id=CRASHED,
            steps=400,
            crash_at=150,
            faults=default_faults()[:1],
            status=schema.STATUS_CRASHED,
            status_note=outcome.crashed(150, RuntimeError("injected crash at step 150")).note,
            env=dict(ENV_B),
            mfu=0.30,
            seed=4,
        ),
    )
    out[LIVE] = write_run(
        root,
        SynthRun(run_id=LIVE, steps=220, faults=default_faults()[:1], status=schema.STATUS_RUNNING, seed=5),
    )
    out[STALE] = write_run(
        root,
        SynthRun(
            run_id=STALE,
            steps=160,
            faults=[],
            status=schema.STATUS_RUNNING,
            env={**ENV_A, "compile": "max-autotune"},
            mfu=0.44,
            seed=6,
        ),
    )
    set_meta(out[STALE], updated_at=time.time() - 7200)
    _age_files(out[STALE], 7200)
    return out


def _ended_early_runs(root: Path) -> dict[str, Path]:
    """The endings trainer/outcome.py writes besides finished, halted and crashed: SIGTERM,
    Ctrl-C, and an unguarded run whose loss went NaN and stayed NaN to its last step. Their
    status_note is the trainer's own words."""
    out: dict[str, Path] = {}
    ckpt = Path("checkpoints/step-000000212")
    out[PREEMPTED] = write_run(
        root,
        SynthRun(
            run_id=PREEMPTED,
            steps=400,
            stop_at=212,
            faults=default_faults()[:2],
            status=schema.STATUS_PREEMPTED,
            status_note=outcome.preempted(212, ckpt).note,
            seed=12,
        ),
    )
    out[INTERRUPTED] = write_run(
        root,
        SynthRun(
            run_id=INTERRUPTED,
            steps=400,
            stop_at=95,
            faults=[],
            status=schema.STATUS_INTERRUPTED,
            status_note=outcome.interrupted(95, None).note,
            env=dict(ENV_B),
            mfu=0.31,
            seed=13,
        ),
    )
    out[NONFINITE] = write_run(
        root,
        SynthRun(
            run_id=NONFINITE,
            steps=400,
            guarded=False,
            faults=default_faults()[:1],
            nonfinite_from=260,
            status=schema.STATUS_FINISHED_NONFINITE,
            status_note=outcome.nonfinite(260, 140).note,
            seed=14,
        ),
    )
    return out


def _half_written_runs(root: Path) -> dict[str, Path]:
    """Runs a trainer left behind mid-way: meta.json only, or steps without the other tables."""
    # the trainer wrote meta.json and died before its first flush
    d = root / META_ONLY
    store = RunStore(d)
    store.write_meta(
        {
            "run_id": META_ONLY,
            "status": schema.STATUS_RUNNING,
            "config": {},
            "env": dict(ENV_A),
            "started_at": time.time(),
        }
    )
    store.close()
    # steps flushed, the other tables missing entirely
    steps_only = write_run(
        root, SynthRun(run_id=NO_LAYERS, steps=120, faults=[], status=schema.STATUS_RUNNING, seed=7)
    )
    for t in (schema.TABLE_LAYERS, schema.TABLE_EXPERTS, schema.TABLE_EVENTS, schema.TABLE_RANKS):
        shutil.rmtree(steps_only / t)
    return {META_ONLY: d, NO_LAYERS: steps_only}


def _other_schema_runs(root: Path) -> dict[str, Path]:
    """A run from an older writer and one from a newer moeguard."""
    # schema 0 had no mfu / mem_peak_bytes columns and no expert bias
    old = write_run(root, SynthRun(run_id=OLD_SCHEMA, steps=150, faults=default_faults()[:1], seed=8))
    _drop_columns(old / schema.TABLE_STEPS, ["mfu", "mem_peak_bytes"])
    _drop_columns(old / schema.TABLE_EXPERTS, ["bias"])
    set_meta(old, schema_version=0)
    new = write_run(root, SynthRun(run_id=NEW_SCHEMA, steps=100, faults=[], seed=9))
    set_meta(new, schema_version=99)
    return {OLD_SCHEMA: old, NEW_SCHEMA: new}


def _age_files(run_dir: Path, seconds: float) -> None:
    """Backdate every file and folder of a run, as if nothing had written it for `seconds`."""
    t = time.time() - seconds
    for p in [*run_dir.rglob("*"), run_dir]:
        os.utime(p, (t, t))


def _drop_columns(table_dir: Path, cols: Iterable[str]) -> None:
    for p in sorted(table_dir.glob("part-*.parquet")):
        df = pl.read_parquet(p)
        df.drop([c for c in cols if c in df.columns]).write_parquet(p, compression="zstd")


# ---------------------------------------------------------------------------------------
# Canary history (JSONL), in the format `moeguard canary --history FILE` appends
# ---------------------------------------------------------------------------------------
def write_canary_history(path: str | Path, *, n: int = 30, seed: int = 0) -> Path:
    """`n` canary entries: 5 baselines, steady passes, a torch upgrade that costs ~12% MFU
    (a warn, then fails), then a fix. Plus one garbage line the reader must skip."""
    rng = np.random.default_rng(seed)
    lines = []
    base = 0.412
    for i in range(n):
        torch_v = "2.9.1+cu128" if i < n // 2 else "2.10.0+cu128"
        drop = 0.0
        if n // 2 <= i < n // 2 + 1:
            drop = 0.06
        elif n // 2 + 1 <= i < n // 2 + 5:
            drop = 0.12
        mfu = base * (1 - drop) * (1 + 0.006 * rng.standard_normal())
        pct = (1 - mfu / base) * 100
        verdict = "fail" if pct > 10 else "warn" if pct > 5 else "pass"
        lines.append(
            json.dumps(
                {
                    "time": T0 + 86400 * i,
                    "git_sha": f"{rng.integers(0, 16**7):07x}{'0' * 33}",
                    "torch": torch_v,
                    "fingerprint": "H100-SXM x8 / moe-1b-64e",
                    "config": "configs/canary_moe_1b.toml",
                    "mfu_p50": round(mfu, 5),
                    "tokens_per_s_p50": round(mfu / base * 1.9e6, 1),
                    "verdict": verdict,
                    "baseline": i < 5,
                    "warn_pct": 5.0,
                    "fail_pct": 10.0,
                }
            )
        )
        if i == 7:
            lines.append("{not json")
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text("\n".join(lines) + "\n")
    return p
