"""The guard never leaves a run worse than no guard (issue #39): guarded vs unguarded vs clean.

Tiny transformers MoE models (guard.integrations.tiny with the family's own aux loss; attach()
with a standing per-layer balancing weight of 1e-2, as bench/drills/real_models.py and the family matrix
balance a from-scratch run; the collapse correction on these bias-free routers is a bounded bias
on the collapsed layer's logits, LogitBias in guard/integrations/router_push.py, plus the per-layer
balancing gradient), stdlib bytes, AdamW 3e-3, grad clip 1.0, the same
data and seed for every run. Faults are keyed on the batch drawn from the data stream (a
rollback's skipped window moves steps, not faults):

  nan       a NaN in one gradient element at batch 120 (element 0 of the last parameter with a
            gradient, the LM head: unguarded, every later loss is NaN)
  x50       every gradient x50 at batch 160
  collapse  +10 on expert 0's router logit of layer 1 from batch 200 on (a cause that stays)
  all       the three together

Per run: held-out eval loss at the end (8 batches the training stream never draws), every
action, whether it halted, and the pushed layer's MaxVio: the steps from the collapse onset until
it has been under the detector's line for 5 steps running. Modes: guarded (GuardConfig's
defaults), unguarded (the same loop with mode = "observe": telemetry, no action), clean
(unguarded, no fault) and clean-guarded (the 0-actions check).

    python -m bench.drills.fault_drill --families mixtral,qwen3_moe --steps 400 --out OUT.jsonl
    python -m bench.drills.fault_drill --table OUT.jsonl
    python -m bench.drills.fault_drill --self-collapse --steps 400 --out OUT.jsonl   # attach() defaults
    python -m bench.drills.fault_drill --skip-spikes --modes guarded --out OUT.jsonl  # skip, not clip
    python -m bench.drills.fault_drill --faults x50 --grad-clip 0 --out OUT.jsonl  # the guard's clip binds

--self-collapse: clean runs with attach()'s defaults (no standing per-layer balance: the family's
aux loss pools the load over all layers, and layers 2-3 of the tiny Mixtral collapse on their own
from step ~20), guarded vs observe-only: each layer's MaxVio over the last 50 steps.

Writes docs/BENCHMARKS.md › Detection › Escalation drill: the guard never leaves a run worse than no
guard (issue #39).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import torch
import torch.nn.functional as F
from torch import nn

from bench.drills.real_models import byte_batches
from guard.api import GuardedStep
from guard.core.config import GuardConfig, PolicyConfig
from guard.integrations.tiny import build
from guard.integrations.transformers import attach, decoder_layers
from guard.store.reader import read_table

NAN_AT, X50_AT, COLLAPSE_AT = 120, 160, 200
COLLAPSE_LAYER, OFFSET = 1, 10.0
FAULTS = {"nan": ("nan",), "x50": ("x50",), "collapse": ("collapse",), "all": ("nan", "x50", "collapse")}
MODES = ("guarded", "unguarded")  # per fault; "clean" and "clean-guarded" once per family
EVAL_SEED = 10_007  # held-out windows: a stream the training seeds never draw


def offset_router(
    model: nn.Module, layer: int, expert: int = 0, offset: float = OFFSET
) -> Callable[[], None]:
    """Add a constant `offset` to expert `expert`'s router logit of MoE layer `layer` at every
    forward from now on (a router that prefers one expert for a reason no batch removes: a
    miscalibrated init, a bad merge), for top-k routers of the (logits, weights, indices) form
    (Mixtral, Qwen2/3-MoE, OLMoE). The router's own forward is replaced, so every hook (the
    guard's counters) sees the offset logits and ids. Returns the undo."""
    gate = getattr(decoder_layers(model)[layer].mlp, "gate", None)
    if gate is None or getattr(gate, "weight", None) is None or not hasattr(gate, "top_k"):
        raise ValueError(f"layer {layer} of {type(model).__name__}: no top-k router with a weight")
    renorm = getattr(gate, "norm_topk_prob", True)

    def forward(hidden_states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = hidden_states.reshape(-1, gate.weight.shape[1])
        logits = F.linear(h, gate.weight)
        logits = logits + logits.new_zeros(logits.shape[-1]).index_fill_(0, torch.tensor([expert]), offset)
        probs = logits.float().softmax(-1)
        top, idx = probs.topk(gate.top_k, dim=-1)
        if renorm:
            top = top / top.sum(-1, keepdim=True)
        return logits, top.to(logits.dtype), idx

    gate.forward = forward
    return lambda: delattr(gate, "forward")


@torch.no_grad()
def eval_loss(model: nn.Module, corpus: np.ndarray, n: int = 8) -> float:
    model.eval()
    data = byte_batches(corpus, batch=4, seq=64, seed=EVAL_SEED)
    out = float(np.mean([float(model(input_ids=(x := next(data)), labels=x).loss) for _ in range(n)]))
    model.train()
    return out


def run(
    family: str,
    faults: tuple[str, ...],
    *,
    guarded: bool,
    steps: int,
    corpus: np.ndarray,
    run_dir: Path,
    seed: int = 0,
    cfg: GuardConfig | None = None,
    at: dict[str, int] | None = None,
    balance_coef: float = 1e-2,
    final_evals: int = 5,
    grad_clip: float = 1.0,
) -> dict[str, Any]:
    """One run of `steps` loop iterations; `at` overrides the fault batches (CI's short drill);
    the final loss is the mean held-out loss at the last `final_evals` of every 10th iteration (a
    model at lr 3e-3 swings from step to step: one eval at the end differed by 2% between two
    runs one skipped batch apart). An unguarded run stops at its first non-finite loss (its
    weights are non-finite from there on: the eval says so)."""
    when = {"nan": NAN_AT, "x50": X50_AT, "collapse": COLLAPSE_AT, **(at or {})}
    torch.manual_seed(seed)
    model = build(family, seed=seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        att = attach(model, balance_coef=balance_coef)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    cfg = cfg or GuardConfig()
    if not guarded:
        cfg = GuardConfig(mode="observe")
    g = GuardedStep(model, opt, attach=att, run_dir=run_dir, config=cfg, max_lr=3e-3, grad_clip=grad_clip)
    data = enumerate(byte_batches(corpus, batch=4, seq=64, seed=seed))
    halted_at, evals = None, {}
    t0 = time.perf_counter()
    for step, (b, x) in enumerate(g.batches(data)):
        if step >= steps:
            break
        if "collapse" in faults and b >= when["collapse"] and not hasattr(_gate(model), "forward_offset"):
            offset_router(model, COLLAPSE_LAYER)
            _gate(model).forward_offset = True
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        if "x50" in faults and b == when["x50"]:
            for p in model.parameters():
                if p.grad is not None:
                    p.grad.mul_(50.0)
        if "nan" in faults and b == when["nan"]:
            [p for p in model.parameters() if p.grad is not None][-1].grad.view(-1)[0] = float("nan")
        d = g.step(loss, tokens=x.numel())
        if d.halt:
            halted_at = step
            break
        if step + 1 > steps - 10 * final_evals and (steps - step - 1) % 10 == 0:
            evals[step + 1] = round(eval_loss(model, corpus), 4)
        if not guarded and not torch.isfinite(loss.detach()):
            break
    g.close()
    s_per_step = (time.perf_counter() - t0) / max(1, step)
    st = read_table(run_dir, "steps")
    ev = read_table(run_dir, "events")
    layers = read_table(run_dir, "layers").sort("step")
    lay = layers.filter(pl.col("layer") == COLLAPSE_LAYER)
    acts = st.filter(pl.col("action") != "apply").select("step", "action").rows()
    out: dict[str, Any] = {
        "family": family,
        "faults": "+".join(faults) or "clean",
        "guarded": guarded,
        "steps": st.height,
        "eval_loss": round(float(np.mean(list(evals.values()))) if evals else eval_loss(model, corpus), 4),
        "eval_at": evals,
        "halted_at": halted_at,
        "actions": acts,
        "events": ev.filter(pl.col("kind") != "verdict").select("step", "kind", "action", "detector").rows(),
        # every verdict with what its step did (a clip within grad_clip: action none)
        "verdicts": ev.filter(pl.col("kind") == "verdict").select("step", "detector", "action").rows(),
        "s_per_step": round(s_per_step, 4),
        "maxvio_last50": {
            int(k[0]): round(float(g["maxvio"].tail(50).mean()), 3)
            for k, g in layers.group_by("layer", maintain_order=True)
        },
    }
    if "collapse" in faults:
        onset = _onset_step(run_dir, when["collapse"], st)
        thr = cfg.collapse.maxvio
        mv = dict(zip(lay["step"].to_list(), lay["maxvio"].to_list(), strict=True))
        out["collapse_onset"] = onset
        # a run that stopped before the onset (unguarded, NaN weights) has nothing to come back from
        out["collapse_back_after"] = _back_after(mv, onset, thr) if st.height > onset else None
    return out


def _gate(model: nn.Module) -> nn.Module:
    return decoder_layers(model)[COLLAPSE_LAYER].mlp.gate


def _onset_step(run_dir: Path, batch: int, st: pl.DataFrame) -> int:
    """The step the collapse batch was trained at: batch index minus the batches rollbacks
    skipped before it (the store counts steps; faults are keyed on batches)."""
    skipped = 0
    ev = read_table(run_dir, "events").filter(pl.col("action") == "rollback")
    for step, detail in ev.select("step", "detail").rows():
        d = json.loads(detail) if isinstance(detail, str) else (detail or {})
        if step + skipped < batch:
            skipped += int(d.get("skip_batches", 0))
    return batch - skipped


def _back_after(maxvio_at: dict[int, float], onset: int, thr: float, run: int = 5) -> int | None:
    """Steps from `onset` until MaxVio has been under `thr` for `run` steps running (counted to the
    first of them), or None if never. The first steps after onset count only once MaxVio rose."""
    rose, k = False, 0
    for s in sorted(x for x in maxvio_at if x >= onset):
        rose = rose or maxvio_at[s] > thr
        if not rose:
            continue
        k = k + 1 if maxvio_at[s] < thr else 0
        if k == run:
            return s - run + 1 - onset
    return None if rose else 0


def _fmt(r: dict[str, Any] | None) -> str:
    return "-" if r is None else f"{r['eval_loss']:.3f}"


def table(rows: list[dict[str, Any]]) -> str:
    by = {(r["family"], r["faults"], r["guarded"]): r for r in rows}
    lines = [
        "| family | fault | eval loss guarded / unguarded / clean | guarded vs clean | actions (guarded) "
        "| halted | collapse back under the line after (guarded / unguarded) |",
        "|---|---|---|---|---|---|---|",
    ]
    for fam in sorted({r["family"] for r in rows}):
        clean = by.get((fam, "clean", False))
        cg = by.get((fam, "clean", True))
        if cg is not None:
            lines.append(
                f"| {fam} | clean | {cg['eval_loss']:.3f} / {_fmt(clean)} / - "
                f"| - | {len(cg['actions'])} {cg['actions'][:6]} | {cg['halted_at']} | - |"
            )
        for f in ("nan", "x50", "collapse", "nan+x50+collapse"):
            gr, ug = by.get((fam, f, True)), by.get((fam, f, False))
            if gr is None or ug is None:
                continue
            c = clean["eval_loss"] if clean else float("nan")
            rel = f"{100 * (gr['eval_loss'] / c - 1):+.1f}%" if clean else "-"
            kinds: dict[str, int] = {}
            for _, a in gr["actions"]:
                kinds[a] = kinds.get(a, 0) + 1
            back = (
                f"{gr.get('collapse_back_after')} / {ug.get('collapse_back_after')}"
                if "collapse" in f
                else "-"
            )
            lines.append(
                f"| {fam} | {f} | {gr['eval_loss']:.3f} / {ug['eval_loss']:.3f} / {c:.3f} | {rel} "
                f"| {', '.join(f'{k} {n}' for k, n in kinds.items()) or '0'} | {gr['halted_at']} | {back} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--families", default="mixtral,qwen3_moe", help="comma-separated tiny families")
    ap.add_argument("--faults", default="clean,nan,x50,collapse,all", help="comma-separated fault sets")
    ap.add_argument("--steps", type=int, default=400, help="loop iterations a run (default 400)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, help="append one JSON line per run here")
    ap.add_argument("--table", nargs="+", type=Path, help="print the Markdown table of these result files")
    ap.add_argument(
        "--self-collapse", action="store_true", help="clean runs with attach() defaults, guarded vs observe"
    )
    ap.add_argument(
        "--skip-spikes",
        action="store_true",
        help="guarded runs with PolicyConfig.clip_spikes off (the default before issue #39): a finite "
        "grad-norm spike skipped, not clipped",
    )
    ap.add_argument(
        "--modes", default="guarded,unguarded", help="which runs of each fault set (guarded, unguarded)"
    )
    ap.add_argument(
        "--grad-clip",
        type=float,
        default=1.0,
        help="the loop's own grad clip (default 1.0; 0: none, so the guard's clip of a spike binds)",
    )
    a = ap.parse_args(argv)
    if a.grad_clip < 0:
        ap.error(f"--grad-clip {a.grad_clip}: must be >= 0 (0: no grad clip)")
    if a.table:
        rows = [json.loads(line) for p in a.table for line in p.read_text().splitlines() if line.strip()]
        print(table(rows))
        return 0
    from trainer.data import stdlib_corpus

    torch.set_num_threads(1)
    corpus = stdlib_corpus(4_000_000)
    faults = ["clean"] if a.self_collapse else a.faults.split(",")
    for f in faults:
        if f != "clean" and f not in FAULTS:
            ap.error(f"--faults {f!r}: must be clean or one of {', '.join(FAULTS)}")
    cfg = GuardConfig(policy=PolicyConfig(clip_spikes=False)) if a.skip_spikes else None
    modes = [m == "guarded" for m in a.modes.split(",")]
    for fam in a.families.split(","):
        for f in faults:
            for guarded in modes:
                with tempfile.TemporaryDirectory() as tmp:
                    r = run(
                        fam,
                        () if f == "clean" else FAULTS[f],
                        guarded=guarded,
                        steps=a.steps,
                        corpus=corpus,
                        run_dir=Path(tmp) / "r",
                        seed=a.seed,
                        cfg=cfg,
                        balance_coef=0.0 if a.self_collapse else 1e-2,
                        grad_clip=a.grad_clip,
                    )
                r["self_collapse"] = a.self_collapse
                r["clip_spikes"] = not a.skip_spikes
                r["grad_clip"] = a.grad_clip
                print(json.dumps(r, default=str), flush=True)
                if a.out:
                    with a.out.open("a") as fh:
                        fh.write(json.dumps(r, default=str) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
