"""Early-run spike coverage on recorded clean runs (issue #28): for every step, would a whole-model
gradient spike of x F (total and every layer's grad norm x F, the loss unchanged: what
`--inject gradspike@STEP:F` shows the detectors) be flagged, and does the clean run itself draw a
step verdict? One pass per run: at each step the detector suite peeks at the spiked copy of the
step (changing nothing) and then takes the clean step, as a live run would have.

    python -m bench.detection.early_spikes RUN [RUN ...] [--guard FILE.toml] [--factors 8,20,50] [--peers]

`--peers`: the same what-ifs judged by the peers' real code at their published defaults
(OLMo-core's SkipStepOptimizer, Lightning's SpikeDetection, ZClip; bench/drills/clean_actions.py), each
on the grad-norm and loss series on its own, from step 0 (their own warm-ups apply): a copy is
caught where the peer flags the spiked grad norm or the step's loss.

Per run: the clean run's step verdicts (false alarms: a live run would skip there), the smallest
per-layer rise of the clean steps (the all-layers statistic: min over layers of grad norm / the
median of the layer's last 16 accepted values) before and after step 200, and for each factor the
steps where the copy is missed, and the first step from which every copy is caught.

Writes docs/BENCHMARKS.md › transformers families and early-run spikes › Every transformers MoE
family (issue #28) (its early-run spike table).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from guard.core import schema
from guard.core.config import GuardConfig, load_guard_config
from guard.core.detectors.all_layers import AllLayersSpike
from guard.core.detectors.suite import DetectorSuite
from guard.store.reader import read_reports

SPIKE_DETECTORS = (schema.DET_GRAD_SPIKE, schema.DET_LAYER_GRAD_SPIKE, schema.DET_LOSS_SPIKE)


def spiked(rep: Any, factor: float) -> Any:
    r = copy.copy(rep)
    r.grad_norm = rep.grad_norm * factor
    r.layer_grad_norm_L = np.asarray(rep.layer_grad_norm_L, dtype=np.float64) * factor
    return r


def peer_coverage(reps: Sequence[Any], name: str, value: float, factors: list[float]) -> dict[str, Any]:
    """One peer's clean flags and missed spiked copies on a run's reports (see the docstring)."""
    from bench.detection.detector_heldout import RealPeer

    on_grad, on_loss = RealPeer(name, value), RealPeer(name, value)
    false: list[int] = []
    missed: dict[float, list[int]] = {f: [] for f in factors}
    for rep in reps:
        if not rep.finite:
            continue
        loss_flag = on_loss.flag(rep.loss)
        for f in factors:
            if not (loss_flag or on_grad.peek(rep.grad_norm * f)):
                missed[f].append(rep.step)
        if on_grad.flag(rep.grad_norm) or loss_flag:
            false.append(rep.step)
    return {"false_verdict_steps": false, **{f"x{f:g}_missed": m for f, m in missed.items()}}


def coverage(run_dir: Path, cfg: GuardConfig, factors: list[float], peers: bool = False) -> dict[str, Any]:
    reps = list(read_reports(run_dir))
    suite = DetectorSuite(cfg)
    rises = AllLayersSpike(cfg.grad_spike)  # the clean run's statistic, for the record
    false: list[int] = []
    missed: dict[float, list[int]] = {f: [] for f in factors}
    rise_max = {"before_200": 0.0, "after_200": 0.0}
    for rep in reps:
        if not rep.finite:
            continue
        for f in factors:
            if not any(v.detector in SPIKE_DETECTORS for v in suite.peek_step(spiked(rep, f))):
                missed[f].append(rep.step)
        fired = [v for v in suite.update(rep) if v.detector in SPIKE_DETECTORS]
        if fired:
            false.append(rep.step)
        if len(rep.layer_grad_norm_L) >= 2:
            r = rises.rise(rep.step, rep.layer_ids_L, rep.layer_grad_norm_L)
            if r is not None and math.isfinite(r):
                key = "before_200" if rep.step < 200 else "after_200"
                rise_max[key] = max(rise_max[key], r)
            rises.accept(rep.step, rep.layer_ids_L, rep.layer_grad_norm_L)
    last = reps[-1].step if reps else -1
    out: dict[str, Any] = {
        "run": run_dir.name,
        "steps": len(reps),
        "false_verdict_steps": false,
        "clean_rise_max": {k: round(v, 2) for k, v in rise_max.items()},
    }
    for f in factors:
        m = missed[f]
        out[f"x{f:g}_missed"] = m
        out[f"x{f:g}_caught_from"] = (max(m) + 1 if m else 0) if (not m or max(m) < last) else None
    if peers:
        from bench.drills.clean_actions import PEERS

        out["peers"] = {name: peer_coverage(reps, name, value, factors) for name, value in PEERS}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "runs", nargs="+", type=Path, help="run folders recorded clean (e.g. bench.drills.real_models --keep)"
    )
    ap.add_argument("--guard", type=Path, help="a TOML with a [guard] table (default: GuardConfig())")
    ap.add_argument("--factors", default="8,20,50", help="comma-separated spike factors")
    ap.add_argument("--json", action="store_true", help="one JSON line per run")
    ap.add_argument("--peers", action="store_true", help="the peers' real code on the same what-ifs")
    a = ap.parse_args(argv)
    cfg = load_guard_config(a.guard) if a.guard else GuardConfig()
    factors = [float(x) for x in a.factors.split(",")]
    for run in a.runs:
        r = coverage(run, cfg, factors, peers=a.peers)
        if a.json:
            print(json.dumps(r), flush=True)
            continue
        parts = [f"{r['run']:22s} false {r['false_verdict_steps'] or '-'}", f"rise {r['clean_rise_max']}"]
        for f in factors:
            m = r[f"x{f:g}_missed"]
            parts.append(
                f"x{f:g} from {r[f'x{f:g}_caught_from']} (missed {len(m)}: {m[:6]}{'...' if len(m) > 6 else ''})"
            )
        print(" | ".join(parts), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
