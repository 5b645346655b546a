"""Does the guard's collapse correction fix a collapse on an aux-loss model it did not write?

For each aux-loss transformers family (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE, GPT-OSS: no selection
bias, so the correction is the per-layer balancing gradient of guard.integrations.base's
AuxGradCorrector) and seed, two guarded runs that differ in one thing only:

  boost    the guard detects the collapse and applies its correction (the policy's boost of the
           layer's switch-loss gradient, aux_coef x boost, while the correction is open)
  control  the same guard detects it, but the model offers no corrector (Attachment.corrector =
           None): nothing is applied and nothing is claimed

Neither run has the standing per-layer balance (`balance_coef` 0): the model trains with
transformers' own pooled aux loss (router_aux_loss_coef 0.01) alone, so whatever brings the layer
back in the boost run and not in the control is the guard's correction. Each run has its own run
folder. A collapse is forced on one layer (its router's row 0 raised along the mean input, as
`force_collapse` does) at --at; the collapse detector's warm-up is 60 steps (the default 250 is
for real runs and would wait past the injection).

Reported per run: the layer's MaxVio (median over 10-step windows) before, at, and after the
injection, the first step from which the 10-step median stays under the detector's MaxVio
threshold (recovered), and the guard's corrections in the events table.

    python bench/drills/collapse_control.py --seeds 0,1 --steps 300 --out /tmp/collapse_control.json

Writes docs/BENCHMARKS.md › transformers families and early-run spikes › The correction's own effect
on aux-loss families (`bench/drills/collapse_control.py`).
"""

from __future__ import annotations

import sys
from pathlib import Path as _P

sys.path.insert(0, str(_P(__file__).resolve().parents[2]))  # `python bench/<group>/x.py` from a checkout

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import torch
from tqdm import tqdm

from bench.drills.real_models import drill
from guard.core import schema
from guard.core.config import CollapseConfig, GuardConfig
from guard.store.reader import read_table

AUX_FAMILIES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss")
WINDOW = 10


def window_medians(maxvio: np.ndarray) -> np.ndarray:
    """Median MaxVio of each trailing WINDOW-step window (NaN for the first WINDOW-1 steps)."""
    out = np.full(maxvio.size, np.nan)
    for i in range(WINDOW - 1, maxvio.size):
        out[i] = np.median(maxvio[i - WINDOW + 1 : i + 1])
    return out


def recovered_at(med: np.ndarray, *, after: int, threshold: float) -> int | None:
    """First step >= after from which the windowed median stays under threshold to the end."""
    bad = np.flatnonzero(~(med[after:] < threshold))
    if bad.size == 0:
        return after
    last_bad = after + int(bad[-1])
    return last_bad + 1 if last_bad + 1 < med.size else None


def summarise(run_dir: Path, *, layer: int, at: int, threshold: float) -> dict[str, Any]:
    layers = read_table(run_dir, "layers").filter(pl.col("layer") == layer).sort("step")
    mv = layers["maxvio"].to_numpy()
    med = window_medians(mv)
    events = read_table(run_dir, "events")
    # (events carry the layer in their JSON detail; only one layer is forced here)
    corr = events.filter((pl.col("kind") == schema.EV_ACTION) & (pl.col("action") == schema.ACT_BIAS_CORRECT))
    collapse_dets = (
        schema.DET_MAXVIO,
        schema.DET_DEAD_EXPERTS,
        schema.DET_LOAD_ENTROPY,
        schema.DET_ROUTER_ENTROPY,
    )
    det = events.filter((pl.col("kind") == schema.EV_VERDICT) & pl.col("detector").is_in(collapse_dets))

    def at_step(s: int) -> float:
        return float(med[min(s, med.size - 1)])

    return {
        "maxvio_before": at_step(at - 1),
        "maxvio_at+20": at_step(at + 20),
        "maxvio_at+50": at_step(at + 50),
        "maxvio_at+100": at_step(at + 100),
        "maxvio_end": at_step(med.size - 1),
        "recovered_at": recovered_at(med, after=at + WINDOW, threshold=threshold),
        "first_verdict": int(det["step"].min()) if det.height else None,
        "corrections": corr.select("step", "action").rows(),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default=",".join(AUX_FAMILIES), help="comma-separated aux-loss families")
    ap.add_argument("--seeds", default="0", help="comma-separated seeds")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--at", type=int, default=100, help="the step the collapse is forced at")
    ap.add_argument("--layer", type=int, default=2, help="the layer forced to collapse")
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    a = ap.parse_args(argv)
    from trainer.data import stdlib_corpus

    fams = a.families.split(",")
    bad = [f for f in fams if f not in AUX_FAMILIES]
    if bad:
        raise SystemExit(f"--families: {bad} are not aux-loss families ({', '.join(AUX_FAMILIES)})")
    torch.set_num_threads(1)
    corpus = stdlib_corpus(4_000_000)
    cfg = GuardConfig(collapse=CollapseConfig(warmup=60))
    results = []
    runs = [(f, int(s), v) for f in fams for s in a.seeds.split(",") for v in ("boost", "control")]
    with tempfile.TemporaryDirectory() as tmp:
        for fam, seed, variant in tqdm(runs, unit="run", desc="collapse control"):
            run_dir = Path(tmp) / f"{fam}-{seed}-{variant}"  # one folder per run
            drill(
                fam,
                seed=seed,
                steps=a.steps,
                corpus=corpus,
                run_dir=run_dir,
                cfg=cfg,
                injections=[("collapse", a.at, float(a.layer))],
                balance_coef=0.0,
                correct=variant == "boost",
            )
            r = {
                "family": fam,
                "seed": seed,
                "variant": variant,
                **summarise(run_dir, layer=a.layer, at=a.at, threshold=cfg.collapse.maxvio),
            }
            results.append(r)
            tqdm.write(json.dumps(r))
    print(
        "\n| family | seed | variant | MaxVio before | +20 | +50 | +100 | end | recovered at | corrections |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        rec = r["recovered_at"] if r["recovered_at"] is not None else "never"
        print(
            f"| {r['family']} | {r['seed']} | {r['variant']} | {r['maxvio_before']:.2f} | {r['maxvio_at+20']:.2f} | "
            f"{r['maxvio_at+50']:.2f} | {r['maxvio_at+100']:.2f} | {r['maxvio_end']:.2f} | {rec} | "
            f"{len(r['corrections'])} |"
        )
    if a.out:
        a.out.write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
