"""Synthetic run stores for the app's tests, screenshots and benchmark.

Two writers:
  * `make_store(root)` writes a small zoo of runs through the real writer (RunStore +
    StepReport + Event), so the files are exactly what the trainer writes: a guarded run with
    injected faults, an unguarded twin, halted / crashed / live / stale runs, half-written
    runs and runs from older and newer schema versions.
  * `write_big_run(run_dir, steps, layers, experts)` writes one large run straight to Parquet
    with polars (RunStore row by row would take an hour for 200M expert rows) in the same
    layout, dtypes and part naming, for the load benchmark.

Nothing here needs torch. Values are plausible, not physical: loss decays like a power law,
load shares drift slowly, faults look like the ones the detectors are meant to catch.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl

from guard.core import schema
from guard.core.events import Event, Verdict
from guard.core.report import StepReport
from guard.store.layout import atomic_write_json, polars_schema
from guard.store.runstore import RunStore

T0 = 1_760_000_000.0  # a fixed epoch so stores are reproducible

# Run ids written by make_store(); tests refer to them by these names.
GUARDED = "guarded-faults"
UNGUARDED = "unguarded-faults"
HALTED = "halted-nonfinite"
CRASHED = "crashed-at-150"
LIVE = "live-running"
STALE = "stale-running"
META_ONLY = "half-meta-only"
NO_LAYERS = "half-steps-only"
OLD_SCHEMA = "schema-v0"
NEW_SCHEMA = "schema-v99"

ENV_A: dict[str, Any] = {
    "torch": "2.9.1+cu128",
    "cuda": "12.8",
    "device": "NVIDIA H100 80GB HBM3",
    "peak_flops": 989e12,
    "peak_flops_source": "table:H100 SXM bf16 dense",
    "attention_backend": "flash",
    "expert_kernel": "grouped_mm",
    "compile": "default",
    "dtype": "bfloat16",
    "git_sha": "3f2a9c1",
    "world_size": 8,
    "hostname": "node-a17",
}
ENV_B: dict[str, Any] = {
    **ENV_A,
    "torch": "2.10.0+cu128",
    "attention_backend": "math",
    "expert_kernel": "for_loop",
    "compile": "none",
    "git_sha": "9be04d2",
    "hostname": "node-b03",
}


@dataclass(kw_only=True, slots=True)
class Fault:
    """One injected fault and what the guard made of it."""

    step: int
    inject: str  # schema.INJECT_KINDS
    detector: str  # the detector that fires
    action: str  # what a guarded run does
    value: float
    threshold: float
    layer: int | None = None
    evidence: dict[str, Any] = field(default_factory=dict)


def default_faults() -> list[Fault]:
    """The drill: every verdict kind and every corrective action at least once."""
    return [
        Fault(
            step=100,
            inject="gradspike",
            detector=schema.DET_GRAD_SPIKE,
            action=schema.ACT_SKIP,
            value=84.0,
            threshold=9.1,
            evidence={"median": 1.9, "mad": 0.21, "z": 61.2, "window": 128},
        ),
        Fault(
            step=180,
            inject="lrspike",
            detector=schema.DET_LOSS_SPIKE,
            action=schema.ACT_ROLLBACK,
            value=7.9,
            threshold=4.4,
            evidence={"median": 3.6, "mad": 0.05, "z": 14.3, "rollback_to": 150, "skip_window": [150, 180]},
        ),
        Fault(
            step=240,
            inject="nan",
            detector=schema.DET_NONFINITE,
            action=schema.ACT_SKIP,
            value=float("nan"),
            threshold=float("nan"),
            evidence={"where": "grad_norm", "layers": [2]},
        ),
        Fault(
            step=300,
            inject="collapse",
            detector=schema.DET_MAXVIO,
            action=schema.ACT_BIAS_CORRECT,
            value=3.4,
            threshold=1.5,
            layer=2,
            evidence={"top_expert": 5, "top_share": 0.53, "bias_step": 0.002},
        ),
        Fault(
            step=360,
            inject="collapse",
            detector=schema.DET_DEAD_EXPERTS,
            action=schema.ACT_BIAS_CORRECT,
            value=3.0,
            threshold=0.0,
            layer=1,
            evidence={"dead": [0, 3, 6], "window": 50},
        ),
        Fault(
            step=420,
            inject="gradspike",
            detector=schema.DET_GRAD_SPIKE,
            action=schema.ACT_SKIP,
            value=40.0,
            threshold=8.7,
            evidence={"median": 1.8, "mad": 0.2, "z": 30.1, "window": 128},
        ),
        Fault(
            step=425,
            inject="gradspike",
            detector=schema.DET_GRAD_SPIKE,
            action=schema.ACT_LR_COOLDOWN,
            value=38.0,
            threshold=8.7,
            evidence={
                "median": 1.8,
                "mad": 0.2,
                "z": 28.4,
                "window": 128,
                "escalation": "2 skips in 10 steps",
                "lr_factor": 0.5,
                "cooldown_steps": 100,
            },
        ),
    ]


@dataclass(kw_only=True, slots=True)
class SynthRun:
    """Recipe for one synthetic run written through RunStore."""

    run_id: str
    steps: int = 600
    layers: int = 4  # layer 0 is dense, the rest are MoE
    experts: int = 8
    guarded: bool = True
    faults: list[Fault] = field(default_factory=default_faults)
    env: dict[str, Any] = field(default_factory=lambda: dict(ENV_A))
    status: str = schema.STATUS_FINISHED
    halt_at: int | None = None  # a critical verdict at this step halts the run
    crash_at: int | None = None
    mfu: float = 0.42
    peak_known: bool = True  # False: MFU is NaN (no peak for this device), throughput as usual
    seed: int = 0
    flush_every: int = 50


def write_run(root: str | Path, spec: SynthRun) -> Path:
    """Write one run through the real writer; returns its folder."""
    rng = np.random.default_rng(spec.seed)
    run_dir = Path(root) / spec.run_id
    store = RunStore(run_dir, flush_every=spec.flush_every)
    config = {
        "model": {"layers": spec.layers, "experts": spec.experts, "top_k": 2, "d_model": 512},
        "train": {"steps": spec.steps, "lr": 3e-4, "global_batch_tokens": 65536},
        "guard": {"enabled": spec.guarded},
    }
    store.write_meta(
        {
            "run_id": spec.run_id,
            "status": schema.STATUS_RUNNING,
            "config": config,
            "env": spec.env,
            "started_at": T0,
        }
    )
    faults = {f.step: f for f in spec.faults}
    moe_ids = np.arange(1, spec.layers, dtype=np.int32)
    m, e = len(moe_ids), spec.experts
    share_ME = np.full((m, e), 1.0 / e)
    tokens = 65536
    lr = 3e-4
    cooldown_until = -1
    collapse_layer: int | None = None
    loss_bump = 0.0
    last = spec.steps - 1
    for step in range(spec.steps):
        t = T0 + 0.8 * step
        f = faults.get(step)
        loss = 2.2 + 8.0 / math.sqrt(step + 4) + 0.03 * rng.standard_normal() + loss_bump
        gnorm = 1.8 + 0.15 * rng.standard_normal() + 4.0 / (step + 2)
        layer_gn = np.abs(gnorm / math.sqrt(spec.layers) * (1 + 0.1 * rng.standard_normal(spec.layers)))
        if not spec.guarded:
            loss_bump *= 0.995  # an applied spike decays slowly
        action = schema.ACT_APPLY if spec.guarded else schema.ACT_NONE
        events: list[Event] = []
        if f is not None:
            events.append(
                Event(step=step, time=t, kind=schema.EV_INJECT, detail={"kind": f.inject}, detector="")
            )
            if f.inject == "gradspike":
                gnorm = f.value
                layer_gn[-1] = f.value * 0.9
            elif f.inject == "lrspike":
                loss = f.value
                if not spec.guarded:
                    loss_bump = 1.5
            elif f.inject == "nan":
                loss, gnorm = float("nan"), float("nan")
                layer_gn[2 % spec.layers] = float("nan")
            elif f.inject == "collapse":
                collapse_layer = f.layer
            act = f.action if spec.guarded else schema.ACT_NONE
            v = Verdict(
                detector=f.detector,
                fired=True,
                value=f.value,
                threshold=f.threshold,
                layer=f.layer,
                severity="warning",
                evidence=dict(f.evidence),
            )
            events.append(Event.from_verdict(step, v, act))
            events[-1].time = t
            if spec.guarded:
                detail = {"because": f.detector, **f.evidence}
                if f.layer is not None:
                    detail["layer"] = f.layer
                events.append(
                    Event(
                        step=step,
                        time=t,
                        kind=schema.EV_ACTION,
                        detector=f.detector,
                        value=f.value,
                        threshold=f.threshold,
                        action=act,
                        detail=detail,
                    )
                )
                if act in (schema.ACT_SKIP, schema.ACT_ROLLBACK, schema.ACT_LR_COOLDOWN):
                    action = schema.ACT_SKIP if act == schema.ACT_LR_COOLDOWN else act
                if act == schema.ACT_LR_COOLDOWN:
                    cooldown_until = step + int(f.evidence.get("cooldown_steps", 100))
                # a bias correction rides along an applied step (its step row says apply), as in the trainer
        if spec.halt_at is not None and step == spec.halt_at:
            v = Verdict(
                detector=schema.DET_NONFINITE,
                fired=True,
                layer=None,
                severity="critical",
                evidence={"where": "loss", "consecutive": 3},
            )
            loss, gnorm = float("nan"), float("nan")
            events.append(Event.from_verdict(step, v, schema.ACT_HALT))
            events.append(
                Event(
                    step=step,
                    time=t,
                    kind=schema.EV_HALT,
                    detector=schema.DET_NONFINITE,
                    action=schema.ACT_HALT,
                    detail={"reason": "3 non-finite steps in a row", "last_good_checkpoint": 200},
                )
            )
            action = schema.ACT_HALT
        if spec.crash_at is not None and step == spec.crash_at:
            events.append(Event(step=step, time=t, kind=schema.EV_INJECT, detail={"kind": "crash"}))
        if step % 100 == 0 and step:
            events.append(
                Event(step=step, time=t, kind=schema.EV_CHECKPOINT, detail={"path": f"ckpt/{step}"})
            )
        # routing: a slow random walk of shares, plus the injected collapse
        share_ME = np.clip(share_ME * np.exp(0.01 * rng.standard_normal((m, e))), 1e-4, None)
        share_ME /= share_ME.sum(1, keepdims=True)
        cur = share_ME.copy()
        if collapse_layer is not None and collapse_layer in moe_ids:
            i = int(np.where(moe_ids == collapse_layer)[0][0])
            healed = spec.guarded and step > 330
            if not healed:
                cur[i] = 0.5 / (e - 1)
                cur[i, 5] = 0.5
            if step >= 360 and not (spec.guarded and step > 390):
                j = int(np.where(moe_ids == 1)[0][0]) if 1 in moe_ids else 0
                cur[j, [0, 3, 6]] = 0.0
                cur[j] /= cur[j].sum()
        load_ME = np.rint(cur * tokens * 2).astype(np.int64)
        mean = load_ME.mean(1)
        maxvio = (load_ME.max(1) - mean) / mean
        p = load_ME / load_ME.sum(1, keepdims=True)
        with np.errstate(divide="ignore", invalid="ignore"):
            load_ent = -np.nansum(np.where(p > 0, p * np.log(p), 0.0), 1) / math.log(e)
        router_ent = 0.7 * math.log(e) * load_ent + 0.02 * rng.standard_normal(m)
        dead = (load_ME == 0).sum(1).astype(np.int32)
        if spec.guarded and step == 330 and collapse_layer is not None:
            events.append(
                Event(
                    step=step,
                    time=t,
                    kind=schema.EV_RECOVERED,
                    detector=schema.DET_MAXVIO,
                    detail={"layer": collapse_layer, "maxvio": float(maxvio.max())},
                )
            )
        cur_lr = lr * (0.5 if step <= cooldown_until else 1.0) * min(1.0, (step + 1) / 50)
        # faster kernels = shorter steps: tokens/s and MFU move together across environments
        nominal = 0.8 * 0.42 / spec.mfu
        step_time = nominal * (1 + 0.03 * rng.standard_normal())
        data_wait = abs(0.01 + 0.004 * rng.standard_normal())
        warm = min(1.0, (step + 5) / 25)
        mfu = spec.mfu * nominal / step_time * warm if spec.peak_known else float("nan")
        rep = StepReport(
            step=step,
            time=t,
            loss=loss,
            grad_norm=gnorm,
            lr=cur_lr,
            tokens=tokens,
            step_time_s=step_time,
            data_wait_s=data_wait,
            tokens_per_s=tokens / step_time * warm,
            mfu=mfu,
            mem_peak_bytes=int(61e9 + 1e8 * rng.standard_normal()),
            action=action,
            layer_ids_L=np.arange(spec.layers, dtype=np.int32),
            layer_grad_norm_L=layer_gn,
            moe_layer_ids_M=moe_ids,
            router_entropy_M=router_ent,
            load_entropy_M=load_ent,
            maxvio_M=maxvio,
            dead_experts_M=dead,
            bias_norm_M=np.abs(0.01 * step / 100 + 0.001 * rng.standard_normal(m)),
            load_ME=load_ME,
            bias_ME=0.001 * rng.standard_normal((m, e)),
        )
        store.add_step(rep)
        for ev in events:
            store.add_event(ev)
        if spec.halt_at is not None and step == spec.halt_at:
            last = step
            break
        if spec.crash_at is not None and step == spec.crash_at:
            last = step
            break
    final_loss = float(loss) if math.isfinite(loss) else None
    store.close(status=spec.status, final_step=last, final_loss=final_loss)
    return run_dir


def set_meta(run_dir: Path, **fields: Any) -> None:
    """Overwrite meta.json fields as they are (no schema_version/updated_at stamping)."""
    meta = json.loads((run_dir / schema.META_FILE).read_text())
    meta.update(fields)
    atomic_write_json(run_dir / schema.META_FILE, meta)


def make_store(root: str | Path) -> dict[str, Path]:
    """Write the synthetic run zoo under `root`; returns run_id -> folder."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
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

    # half-written: the trainer wrote meta.json and died before its first flush
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
    out[META_ONLY] = d

    # half-written: steps flushed, the other tables missing entirely
    d = write_run(
        root, SynthRun(run_id=NO_LAYERS, steps=120, faults=[], status=schema.STATUS_RUNNING, seed=7)
    )
    for t in (schema.TABLE_LAYERS, schema.TABLE_EXPERTS, schema.TABLE_EVENTS, schema.TABLE_RANKS):
        shutil.rmtree(d / t)
    out[NO_LAYERS] = d

    # an older writer: schema 0 had no mfu / mem_peak_bytes columns and no expert bias
    d = write_run(root, SynthRun(run_id=OLD_SCHEMA, steps=150, faults=default_faults()[:1], seed=8))
    _drop_columns(d / schema.TABLE_STEPS, ["mfu", "mem_peak_bytes"])
    _drop_columns(d / schema.TABLE_EXPERTS, ["bias"])
    set_meta(d, schema_version=0)
    out[OLD_SCHEMA] = d

    d = write_run(root, SynthRun(run_id=NEW_SCHEMA, steps=100, faults=[], seed=9))
    set_meta(d, schema_version=99)
    out[NEW_SCHEMA] = d

    # a folder that is not a run at all (no meta.json): readers skip it
    (root / "not-a-run").mkdir(exist_ok=True)
    return out


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
# One big run, written directly (benchmark)
# ---------------------------------------------------------------------------------------
def write_big_run(
    run_dir: str | Path,
    *,
    steps: int = 100_000,
    layers: int = 32,
    experts: int = 64,
    part_steps: int = 50,
    seed: int = 0,
    status: str = schema.STATUS_FINISHED,
) -> Path:
    """A `steps`-step run with `layers` MoE layers of `experts` experts, in RunStore's format.

    One part per `part_steps` steps per table (RunStore's default flush_every is 50), so the
    reader faces the same number of files a real run of this length leaves behind.
    """
    rng = np.random.default_rng(seed)
    d = Path(run_dir)
    for t in schema.TABLES:
        (d / t).mkdir(parents=True, exist_ok=True)
    sch = {t: polars_schema(t) for t in schema.TABLES}
    tokens = 4 * 1024 * 1024
    top_k = 8
    faults = {s: i for i, s in enumerate(range(steps // 20, steps, steps // 12))}
    actions_cycle = [schema.ACT_SKIP, schema.ACT_ROLLBACK, schema.ACT_BIAS_CORRECT, schema.ACT_LR_COOLDOWN]
    detectors = [schema.DET_GRAD_SPIKE, schema.DET_LOSS_SPIKE, schema.DET_MAXVIO, schema.DET_GRAD_SPIKE]
    ev_rows: list[dict[str, Any]] = []
    share_LE = rng.dirichlet(np.full(experts, 50.0), size=layers)
    seq = 0
    layer_ids = np.arange(layers, dtype=np.int32)
    for first in range(0, steps, part_steps):
        n = min(part_steps, steps - first)
        step_S = np.arange(first, first + n, dtype=np.int64)
        loss = 2.0 + 9.0 / np.sqrt(step_S + 10) + 0.02 * rng.standard_normal(n)
        gn = 1.5 + 0.1 * rng.standard_normal(n)
        act = np.full(n, schema.ACT_APPLY, dtype=object)
        for s in step_S:
            if int(s) in faults:
                i = faults[int(s)] % 4
                a, det = actions_cycle[i], detectors[i]
                j = int(s - first)
                if det == schema.DET_GRAD_SPIKE:
                    gn[j] = 60.0
                elif det == schema.DET_LOSS_SPIKE:
                    loss[j] = 8.0
                if a in (schema.ACT_SKIP, schema.ACT_ROLLBACK):
                    act[j] = a
                for kind in (schema.EV_VERDICT, schema.EV_ACTION):
                    ev_rows.append(
                        {
                            "step": int(s),
                            "time": T0 + 2.0 * int(s),
                            "kind": kind,
                            "detector": det,
                            "value": float(gn[j]),
                            "threshold": 9.0,
                            "action": a,
                            "detail": json.dumps({"z": 25.0, "layer": i, "median": 1.5}),
                        }
                    )
        st_s = 2.0 * (1 + 0.02 * rng.standard_normal(n))
        steps_df = pl.DataFrame(
            {
                "step": step_S,
                "time": T0 + 2.0 * step_S,
                "loss": loss,
                "grad_norm": gn,
                "lr": np.full(n, 3e-4),
                "tokens": np.full(n, tokens, dtype=np.int64),
                "step_time_s": st_s,
                "data_wait_s": np.abs(0.01 + 0.005 * rng.standard_normal(n)),
                "tokens_per_s": tokens / st_s,
                "mfu": 0.41 * 2.0 / st_s,
                "mem_peak_bytes": np.full(n, 70_000_000_000, dtype=np.int64),
                "action": act.astype(str),
            },
            schema=sch[schema.TABLE_STEPS],
        )
        # layers: n steps x L layers
        ls = np.repeat(step_S, layers)
        ll = np.tile(layer_ids, n)
        share_LE = np.clip(share_LE * np.exp(0.02 * rng.standard_normal(share_LE.shape)), 1e-5, None)
        share_LE /= share_LE.sum(1, keepdims=True)
        load = rng.poisson(lam=np.broadcast_to(share_LE * tokens * top_k / 64, (n, layers, experts)))
        load = load.astype(np.int64)
        mean = load.mean(2)
        maxvio = (load.max(2) - mean) / mean
        p = load / load.sum(2, keepdims=True)
        load_ent = -(p * np.log(np.clip(p, 1e-12, None))).sum(2) / math.log(experts)
        layers_df = pl.DataFrame(
            {
                "step": ls,
                "layer": ll,
                "grad_norm": np.repeat(gn, layers)
                / math.sqrt(layers)
                * (1 + 0.05 * rng.standard_normal(n * layers)),
                "router_entropy": (0.8 * math.log(experts) * load_ent).reshape(-1),
                "load_entropy": load_ent.reshape(-1),
                "maxvio": maxvio.reshape(-1),
                "dead_experts": (load == 0).sum(2).astype(np.int32).reshape(-1),
                "bias_norm": np.full(n * layers, 0.01),
            },
            schema=sch[schema.TABLE_LAYERS],
        )
        experts_df = pl.DataFrame(
            {
                "step": np.repeat(step_S, layers * experts),
                "layer": np.tile(np.repeat(layer_ids, experts), n),
                "expert": np.tile(np.arange(experts, dtype=np.int32), n * layers),
                "load": load.reshape(-1),
                "bias": np.tile((0.001 * rng.standard_normal((layers, experts))).reshape(-1), n),
            },
            schema=sch[schema.TABLE_EXPERTS],
        )
        for t, df in (
            (schema.TABLE_STEPS, steps_df),
            (schema.TABLE_LAYERS, layers_df),
            (schema.TABLE_EXPERTS, experts_df),
        ):
            df.write_parquet(
                d / t / f"part-{first:010d}-{seq:06d}.parquet", compression="zstd", statistics=True
            )
            seq += 1
    if ev_rows:
        pl.DataFrame(ev_rows, schema=sch[schema.TABLE_EVENTS]).write_parquet(
            d / schema.TABLE_EVENTS / f"part-{0:010d}-{seq:06d}.parquet", compression="zstd"
        )
    meta = {
        "run_id": d.name,
        "status": status,
        "schema_version": schema.SCHEMA_VERSION,
        "updated_at": T0 + 2.0 * steps,
        "started_at": T0,
        "final_step": steps - 1,
        "final_loss": float(loss[-1]),
        "config": {
            "model": {"layers": layers, "experts": experts, "top_k": top_k},
            "train": {"steps": steps},
        },
        "env": {**ENV_A, "world_size": 256},
    }
    atomic_write_json(d / schema.META_FILE, meta)
    return d


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
