"""One synthetic run for the app's tests and screenshots, written through the real writer.

`write_run(root, SynthRun(...))` goes through RunStore + StepReport + Event, so the files are
exactly what the trainer writes. tests/dashboards/synth_store.py builds the zoo of runs the
app tests open from it.

Nothing here needs torch. Values are plausible, not physical: loss decays like a power law,
load shares drift slowly, faults look like the ones the detectors are meant to catch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from guard.core import schema
from guard.core.events import Event, Verdict
from guard.core.report import StepReport
from guard.store.runstore import RunStore

T0 = 1_760_000_000.0  # a fixed epoch so stores are reproducible

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
    stop_at: int | None = None  # the last step written (SIGTERM, Ctrl-C); the config still says `steps`
    nonfinite_from: int | None = None  # loss and grad norm NaN from this step to the end (unguarded)
    status_note: str = ""  # meta.json "status_note", as trainer/outcome.py words it
    mfu: float = 0.42
    peak_known: bool = True  # False: MFU is NaN (no peak for this device), throughput as usual
    seed: int = 0
    flush_every: int = 50


@dataclass(slots=True)
class _Walk:
    """What carries from one step to the next: routing shares and the injected trouble."""

    share_ME: np.ndarray
    loss_bump: float = 0.0  # an applied loss spike (unguarded) that decays slowly
    cooldown_until: int = -1
    collapse_layer: int | None = None


@dataclass(slots=True)
class _Step:
    """One step's values as the injections and the guard leave them."""

    step: int
    time: float
    loss: float
    gnorm: float
    layer_gn: np.ndarray
    action: str
    events: list[Event] = field(default_factory=list)


def _draw_step(spec: SynthRun, rng: np.random.Generator, step: int, walk: _Walk) -> _Step:
    """The step's healthy values: loss decaying like a power law, a steady grad norm."""
    loss = 2.2 + 8.0 / math.sqrt(step + 4) + 0.03 * rng.standard_normal() + walk.loss_bump
    gnorm = 1.8 + 0.15 * rng.standard_normal() + 4.0 / (step + 2)
    layer_gn = np.abs(gnorm / math.sqrt(spec.layers) * (1 + 0.1 * rng.standard_normal(spec.layers)))
    if not spec.guarded:
        walk.loss_bump *= 0.995
    action = schema.ACT_APPLY if spec.guarded else schema.ACT_NONE
    return _Step(step=step, time=T0 + 0.8 * step, loss=loss, gnorm=gnorm, layer_gn=layer_gn, action=action)


def _inject(spec: SynthRun, f: Fault, s: _Step, walk: _Walk) -> None:
    """Apply fault `f` to the step, with the verdict and (guarded) the action the guard records."""
    s.events.append(
        Event(step=s.step, time=s.time, kind=schema.EV_INJECT, detail={"kind": f.inject}, detector="")
    )
    if f.inject == "gradspike":
        s.gnorm = f.value
        s.layer_gn[-1] = f.value * 0.9
    elif f.inject == "lrspike":
        s.loss = f.value
        if not spec.guarded:
            walk.loss_bump = 1.5
    elif f.inject == "nan":
        s.loss, s.gnorm = float("nan"), float("nan")
        s.layer_gn[2 % spec.layers] = float("nan")
    elif f.inject == "collapse":
        walk.collapse_layer = f.layer
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
    s.events.append(Event.from_verdict(s.step, v, act))
    s.events[-1].time = s.time
    if not spec.guarded:
        return
    detail = {"because": f.detector, **f.evidence}
    if f.layer is not None:
        detail["layer"] = f.layer
    s.events.append(
        Event(
            step=s.step,
            time=s.time,
            kind=schema.EV_ACTION,
            detector=f.detector,
            value=f.value,
            threshold=f.threshold,
            action=act,
            detail=detail,
        )
    )
    if act in (schema.ACT_SKIP, schema.ACT_ROLLBACK, schema.ACT_LR_COOLDOWN):
        s.action = schema.ACT_SKIP if act == schema.ACT_LR_COOLDOWN else act
    if act == schema.ACT_LR_COOLDOWN:
        walk.cooldown_until = s.step + int(f.evidence.get("cooldown_steps", 100))
    # a bias correction rides along an applied step (its step row says apply), as in the trainer


def _halt(s: _Step) -> None:
    """A critical non-finite verdict: the run halts itself at this step."""
    v = Verdict(
        detector=schema.DET_NONFINITE,
        fired=True,
        layer=None,
        severity="critical",
        evidence={"where": "loss", "consecutive": 3},
    )
    s.loss, s.gnorm = float("nan"), float("nan")
    s.events.append(Event.from_verdict(s.step, v, schema.ACT_HALT))
    s.events.append(
        Event(
            step=s.step,
            time=s.time,
            kind=schema.EV_HALT,
            detector=schema.DET_NONFINITE,
            action=schema.ACT_HALT,
            detail={"reason": "3 non-finite steps in a row", "last_good_checkpoint": 200},
        )
    )
    s.action = schema.ACT_HALT


def _route(
    spec: SynthRun, rng: np.random.Generator, walk: _Walk, moe_ids: np.ndarray, step: int, tokens: int
) -> dict[str, np.ndarray]:
    """Routing: a slow random walk of shares, plus the injected collapse; the layer statistics."""
    m, e = walk.share_ME.shape
    share_ME = np.clip(walk.share_ME * np.exp(0.01 * rng.standard_normal((m, e))), 1e-4, None)
    share_ME /= share_ME.sum(1, keepdims=True)
    walk.share_ME = share_ME
    cur = share_ME.copy()
    if walk.collapse_layer is not None and walk.collapse_layer in moe_ids:
        i = int(np.where(moe_ids == walk.collapse_layer)[0][0])
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
    return {
        "load_ME": load_ME,
        "maxvio": maxvio,
        "load_ent": load_ent,
        "router_ent": router_ent,
        "dead": dead,
    }


def _report(
    spec: SynthRun,
    rng: np.random.Generator,
    s: _Step,
    walk: _Walk,
    routing: dict[str, np.ndarray],
    moe_ids: np.ndarray,
    tokens: int,
) -> StepReport:
    """The step's StepReport: throughput from the run's MFU, the LR with its warm-up and cool-down."""
    m, e = walk.share_ME.shape
    cur_lr = 3e-4 * (0.5 if s.step <= walk.cooldown_until else 1.0) * min(1.0, (s.step + 1) / 50)
    # faster kernels = shorter steps: tokens/s and MFU move together across environments
    nominal = 0.8 * 0.42 / spec.mfu
    step_time = nominal * (1 + 0.03 * rng.standard_normal())
    data_wait = abs(0.01 + 0.004 * rng.standard_normal())
    warm = min(1.0, (s.step + 5) / 25)
    mfu = spec.mfu * nominal / step_time * warm if spec.peak_known else float("nan")
    return StepReport(
        step=s.step,
        time=s.time,
        loss=s.loss,
        grad_norm=s.gnorm,
        lr=cur_lr,
        tokens=tokens,
        step_time_s=step_time,
        data_wait_s=data_wait,
        tokens_per_s=tokens / step_time * warm,
        mfu=mfu,
        mem_peak_bytes=int(61e9 + 1e8 * rng.standard_normal()),
        action=s.action,
        layer_ids_L=np.arange(spec.layers, dtype=np.int32),
        layer_grad_norm_L=s.layer_gn,
        moe_layer_ids_M=moe_ids,
        router_entropy_M=routing["router_ent"],
        load_entropy_M=routing["load_ent"],
        maxvio_M=routing["maxvio"],
        dead_experts_M=routing["dead"],
        bias_norm_M=np.abs(0.01 * s.step / 100 + 0.001 * rng.standard_normal(m)),
        load_ME=routing["load_ME"],
        bias_ME=0.001 * rng.standard_normal((m, e)),
    )


def _write_meta(store: RunStore, spec: SynthRun) -> None:
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


def write_run(root: str | Path, spec: SynthRun) -> Path:
    """Write one run through the real writer; returns its folder."""
    rng = np.random.default_rng(spec.seed)
    run_dir = Path(root) / spec.run_id
    store = RunStore(run_dir, flush_every=spec.flush_every)
    _write_meta(store, spec)
    faults = {f.step: f for f in spec.faults}
    moe_ids = np.arange(1, spec.layers, dtype=np.int32)
    walk = _Walk(share_ME=np.full((len(moe_ids), spec.experts), 1.0 / spec.experts))
    tokens = 65536
    last = spec.steps - 1
    s = None
    for step in range(spec.steps):
        s = _draw_step(spec, rng, step, walk)
        if (f := faults.get(step)) is not None:
            _inject(spec, f, s, walk)
        if spec.nonfinite_from is not None and step >= spec.nonfinite_from:
            s.loss, s.gnorm = float("nan"), float("nan")
            s.layer_gn[:] = float("nan")
        halted, crashed, stopped = step == spec.halt_at, step == spec.crash_at, step == spec.stop_at
        if halted:
            _halt(s)
        if crashed:
            s.events.append(Event(step=step, time=s.time, kind=schema.EV_INJECT, detail={"kind": "crash"}))
        if (step % 100 == 0 and step) or (stopped and spec.status == schema.STATUS_PREEMPTED):
            s.events.append(
                Event(step=step, time=s.time, kind=schema.EV_CHECKPOINT, detail={"path": f"ckpt/{step}"})
            )
        routing = _route(spec, rng, walk, moe_ids, step, tokens)
        if spec.guarded and step == 330 and walk.collapse_layer is not None:
            s.events.append(
                Event(
                    step=step,
                    time=s.time,
                    kind=schema.EV_RECOVERED,
                    detector=schema.DET_MAXVIO,
                    detail={"layer": walk.collapse_layer, "maxvio": float(routing["maxvio"].max())},
                )
            )
        store.add_step(_report(spec, rng, s, walk, routing, moe_ids, tokens))
        for ev in s.events:
            store.add_event(ev)
        if halted or crashed or stopped:
            last = step
            break
    final_loss = float(s.loss) if s is not None and math.isfinite(s.loss) else None
    note = {"status_note": spec.status_note} if spec.status_note else {}
    store.close(status=spec.status, final_step=last, final_loss=final_loss, **note)
    return run_dir
