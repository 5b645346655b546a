"""Guard drills on transformers MoE families moeguard did not write (tiny, random init, CPU).

For each family and seed: train guarded on stdlib bytes (AdamW, the issue's setting) and report
every verdict and action of the run. A clean run must show none; `--inject` adds faults.

    python -m bench.drills.real_models --families mixtral,deepseek_v3 --seeds 0,1 --steps 310
    python -m bench.drills.real_models --observe --seeds 0,1 --steps 1000 --batch 8 --seq 128 --keep DIR
    python -m bench.drills.real_models --inject gradspike@150:1000 --inject nan@200 --inject collapse@120:2

Writes docs/BENCHMARKS.md › transformers families and early-run spikes › Every transformers MoE
family (issue #28) (its drill table); its `--observe --keep` runs are the recorded traces of
Detection's real-model sections.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import polars as pl
import torch

from guard.api import GuardedStep
from guard.core.config import GuardConfig
from guard.integrations.base import BiasCorrector
from guard.integrations.tiny import ALL_FAMILIES, FAMILIES, build
from guard.integrations.transformers import attach, force_collapse
from guard.store.reader import read_table


def byte_batches(corpus: np.ndarray, *, batch: int, seq: int, seed: int) -> Iterator[torch.Tensor]:
    """Endless random windows of byte tokens, reproducible per seed."""
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, corpus.size - seq - 1, size=batch)
        yield torch.from_numpy(np.stack([corpus[s : s + seq] for s in starts]).astype(np.int64))


def parse_inject(spec: str) -> tuple[str, int, float]:
    kind, rest = spec.split("@", 1)
    step, _, arg = rest.partition(":")
    if kind not in ("gradspike", "nan", "collapse"):
        raise SystemExit(f"--inject {spec!r}: KIND must be gradspike, nan or collapse")
    return kind, int(step), float(arg) if arg else 0.0


def drill(
    family: str,
    *,
    seed: int,
    steps: int,
    corpus: np.ndarray,
    run_dir: Path,
    injections: list[tuple[str, int, float]] = (),
    cfg: GuardConfig | None = None,
    lr: float = 3e-3,
    batch: int = 4,
    seq: int = 64,
    balance_coef: float = 1e-2,
    correct: bool = True,
    bias_update: str | None = "sign",
) -> dict[str, Any]:
    """One guarded run; returns its actions, verdicts and final loss. `correct=False`: the guard
    detects but the model offers it no corrector (the control of a collapse drill)."""
    torch.manual_seed(seed)
    model = build(family, seed=seed, aux_loss_coef=0.0 if balance_coef > 0 else 0.01)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    # Balanced as a from-scratch run should be: transformers' DeepSeek-V3 has no bias update of its
    # own, so run DeepSeek-V3's sign update (u = 1e-2: 1e-3 leaves these tiny layers collapsed for
    # hundreds of steps); the aux-loss families get a per-layer balancing weight (transformers' aux
    # loss pools the load over all layers and lets single layers collapse).
    # Every selection-bias family gets the same (issue #28: transformers updates none of them).
    att = attach(model, balance_coef=balance_coef)
    if isinstance(att.corrector, BiasCorrector) and bias_update is not None:
        att.corrector.update = bias_update
        att.corrector.update_rate = 1e-2 if bias_update == "sign" else 0.0
    if not correct:
        att.corrector = None
    guarded = GuardedStep(model, opt, attach=att, run_dir=run_dir, config=cfg, max_lr=lr, grad_clip=1.0)
    data = byte_batches(corpus, batch=batch, seq=seq, seed=seed)
    t0 = time.perf_counter()
    for step, x in enumerate(guarded.batches(data)):
        if step >= steps:
            break
        for kind, at, arg in injections:
            if kind == "collapse" and at == step:
                force_collapse(model, int(arg))
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        for kind, at, arg in injections:
            if at == step and kind == "gradspike":
                for p in model.parameters():
                    if p.grad is not None:
                        p.grad.mul_(arg)
            if at == step and kind == "nan":
                next(p for p in model.parameters() if p.grad is not None).grad.view(-1)[0] = float("nan")
        guarded.step(loss, tokens=x.numel())
    guarded.close()
    steps_t = read_table(run_dir, "steps")
    events = read_table(run_dir, "events")
    acts = steps_t.filter(pl.col("action") != "apply")
    return {
        "family": family,
        "seed": seed,
        "steps": steps_t.height,
        "s_per_step": (time.perf_counter() - t0) / steps,
        "final_loss": float(steps_t["loss"].tail(20).mean()),
        "actions": acts.select("step", "action").rows(),
        "events": events.select("step", "kind", "detector", "action", "value", "threshold").rows(),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--families", default=",".join(FAMILIES), help="comma-separated, from " + ",".join(ALL_FAMILIES)
    )
    ap.add_argument("--seeds", default="0", help="comma-separated seeds")
    ap.add_argument("--steps", type=int, default=310)
    ap.add_argument("--batch", type=int, default=4, help="sequences a step (default 4)")
    ap.add_argument("--seq", type=int, default=64, help="bytes a sequence (default 64)")
    ap.add_argument(
        "--inject", action="append", default=[], help="KIND@STEP[:ARG], KIND gradspike|nan|collapse"
    )
    ap.add_argument("--out", type=Path, help="write the results as JSON here")
    ap.add_argument("--observe", action="store_true", help="detectors on, every action off (record traces)")
    ap.add_argument("--keep", type=Path, help="keep each run store under DIR/<family>-<seed>")
    a = ap.parse_args(argv)
    from trainer.data import stdlib_corpus

    torch.set_num_threads(1)
    corpus = stdlib_corpus(4_000_000)
    inj = [parse_inject(s) for s in a.inject]
    results = []
    for fam in a.families.split(","):
        for seed in (int(s) for s in a.seeds.split(",")):
            cfg = GuardConfig(mode="observe") if a.observe else None
            with tempfile.TemporaryDirectory() as tmp:
                run_dir = a.keep / f"{fam}-{seed}" if a.keep else Path(tmp) / "run"
                r = drill(
                    fam,
                    seed=seed,
                    steps=a.steps,
                    corpus=corpus,
                    run_dir=run_dir,
                    injections=inj,
                    cfg=cfg,
                    batch=a.batch,
                    seq=a.seq,
                )
            results.append(r)
            print(
                f"{fam:12s} seed {seed}: {r['s_per_step'] * 1e3:.0f} ms/step, loss {r['final_loss']:.3f}, "
                f"actions {r['actions'] or 'none'}",
                flush=True,
            )
            for ev in r["events"]:
                print(f"    {ev}")
    if a.out:
        a.out.write_text(json.dumps(results, indent=1, default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
