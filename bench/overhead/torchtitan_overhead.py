"""Guard overhead on torchtitan's DeepSeek-V3: the same training loop plain vs guarded,
interleaved in one process (A B / B A blocks, so host-load drift hits both variants alike), in the
manner of bench/overhead/integration_overhead.py (whose block timer, bootstrap, batches and version stamp
this imports).

The model (bench/common/torchtitan_model.py, also what tests/guard/test_integration_torchtitan.py trains)
is built from torchtitan's own config builders with torchtitan's ScaledDotProductAttention as
inner attention (FlexAttention has no CPU backward, varlen needs CUDA):
  --model small:      dim 64, 4 blocks (1 dense + 3 MoE), 8 experts top-2, byte vocabulary
  --model debugmodel: torchtitan 0.3.0's own "debugmodel" flavor (dim 256, 6 blocks: 1 dense +
                      5 MoE, 8 experts top-3, MLA, vocab 2048, 33M parameters), about 25x
                      the small one's step

It is built TWICE from the same seed, each copy with its own AdamW and torchtitan's own
aux-loss-free balancing hook (register_moe_load_balancing_hook, over a one-process gloo group for
its ParallelDims), and both copies eat the same batches in the same order. Two copies because
attach() hooks every router for good and the guard keeps per-step state.

  A, plain:   forward, next-token cross-entropy, backward, clip_grad_norm_(1.0), AdamW step
              (torchtitan's hook moves expert_bias_E and zeroes its counters), zero_grad
  B, guarded: forward, loss, backward, GuardedStep.step (attach(model) from
              guard.integrations.torchtitan, the probe's one host copy, detectors, policy,
              grad_clip=1.0, AdamW step with the same hook, zero_grad, snapshot ring, run-store
              rows; run_dir in a temp dir, so the store's background Parquet writer runs too)

torch on --threads threads (1). After --warmup steps of each variant, --blocks pairs of blocks
of --steps-per-block steps alternate, the order flipping each pair. Overhead = median over pairs
of (B block total / A block total - 1), with a bootstrap 95% interval and min/max over pairs;
beside it the ratio of block medians (steady per-step cost) and of the process's CPU time per
block. Keep --steps-per-block a multiple of 50 (a snapshot every 25 steps, a run-store flush
every 50) for a measurement that is fair to the guard's periodic work.

    # small (~27 ms a step at 256 tokens on one thread): about 3 min
    python bench/overhead/torchtitan_overhead.py --model small --out /tmp/tt_small.json --write-docs
    # debugmodel (~0.65 s a step at 256 tokens on one thread): about 12 min
    python bench/overhead/torchtitan_overhead.py --model debugmodel --out /tmp/tt_debug.json --write-docs
    # smoke:
    python bench/overhead/torchtitan_overhead.py --model small --blocks 2 --steps-per-block 5 --warmup 2

Writes docs/BENCHMARKS.md › Overhead › Guard overhead on torchtitan DeepSeek-V3 (small), 256 tokens
a step and › Guard overhead on torchtitan DeepSeek-V3 (debugmodel), 256 tokens a step.
"""

from __future__ import annotations

import sys
from pathlib import Path as _P

sys.path.insert(0, str(_P(__file__).resolve().parents[2]))  # `python bench/<group>/x.py` from a checkout

import argparse
import json
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from bench.common.torchtitan_model import MODELS, build, model_config, one_process_group
from bench.overhead.integration_overhead import byte_batches, guard_version, interleave, run_block, summary

LR = 1e-3
CLIP = 1.0
# per model: (blocks, steps per block, warm-up steps); debugmodel's step is ~25x the small one's
DEFAULTS = {"small": (30, 50, 30), "debugmodel": (10, 50, 10)}


def next_token_loss(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """Cross-entropy of each position's logits against the next byte; x is (batch, seq + 1)."""
    logits = model(x[:, :-1])
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))


class Plain:
    """Variant A: the loop a user writes without the guard (torchtitan's balancing hook on)."""

    def __init__(self, config: Any, seed: int, data: Iterator[torch.Tensor], parallel_dims: Any) -> None:
        from torchtitan.components.optimizer import register_moe_load_balancing_hook

        self.data = data
        self.model = build(config, seed=seed)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
        register_moe_load_balancing_hook(self.opt, [self.model], parallel_dims)

    def step(self, x: torch.Tensor) -> None:
        next_token_loss(self.model, x).backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def close(self) -> None:
        pass


class Guarded(Plain):
    """Variant B: the same loop through GuardedStep (which clips, steps and zeroes itself)."""

    def __init__(
        self, config: Any, seed: int, data: Iterator[torch.Tensor], parallel_dims: Any, run_dir: Path
    ) -> None:
        from guard.api import GuardedStep
        from guard.integrations.torchtitan import attach

        super().__init__(config, seed, data, parallel_dims)
        self.guarded = GuardedStep(
            self.model, self.opt, attach=attach(self.model), run_dir=run_dir, max_lr=LR, grad_clip=CLIP
        )

    def step(self, x: torch.Tensor) -> None:
        loss = next_token_loss(self.model, x)
        loss.backward()
        self.guarded.step(loss, tokens=x[:, 1:].numel())

    def close(self) -> None:
        self.guarded.close()


def measure(
    model: str,
    *,
    corpus: np.ndarray,
    batch: int,
    seq: int,
    blocks: int,
    steps_per_block: int,
    warmup: int,
    seed: int,
    run_dir: Path,
    progress: Any = None,
) -> dict[str, Any]:
    """Interleaved A/B measurement of one model; times in seconds."""
    t_build = time.perf_counter()
    config = model_config(model, max_seq_len=seq)
    with one_process_group() as dims:
        a = Plain(config, seed, byte_batches(corpus, batch=batch, seq=seq + 1, seed=seed), dims)
        b = Guarded(config, seed, byte_batches(corpus, batch=batch, seq=seq + 1, seed=seed), dims, run_dir)
        try:
            run_block(a, warmup)
            run_block(b, warmup)
            m = interleave(a, b, blocks=blocks, steps_per_block=steps_per_block, progress=progress)
        finally:
            b.close()
    return {
        "model": model,
        **summary(m, a.model, b.guarded, seed=seed),
        "wall_s": time.perf_counter() - t_build,
    }


def markdown(res: dict[str, Any]) -> str:
    c, f = res["config"], res["result"]
    lo, hi = f["overhead_ci95"]
    acts = ", ".join(f"{k} {v}" for k, v in sorted(f["guard_actions"].items()))
    verdict = "met" if f["overhead"] <= 0.03 else "NOT met"
    return f"""## Guard overhead on torchtitan DeepSeek-V3 ({f["model"]}), {c["batch"] * c["seq"]:,} tokens a step

`{res["command"]}` ({res["machine"]}; {res["wall_s"] / 60:.1f} min; guard code at {res["guard_version"]})

torchtitan 0.3.0's `{f["model_class"]}` ("{f["model"]}": {f["params"]:,} parameters, {f["moe_layers"]} MoE
layers) from its own config builders (`bench/common/torchtitan_model.py`), random init, fp32, torchtitan's
ScaledDotProductAttention as inner attention, its aux-loss-free balancing hook on the AdamW (lr {LR},
betas 0.9/0.95, weight decay 0.1) in both variants; batch {c["batch"]} x {c["seq"]} stdlib bytes, CPU,
`torch.set_num_threads({c["threads"]})`. A = plain loop (forward, cross-entropy, backward,
`clip_grad_norm_(1.0)`, `AdamW.step()`, `zero_grad`); B = the same loop through
`GuardedStep(attach=guard.integrations.torchtitan.attach(model), run_dir=<tmp>, grad_clip=1.0)`.
Two copies from the same seed see the same batches; after {c["warmup"]} warm-up steps each,
{c["blocks"]} pairs of {c["steps_per_block"]}-step blocks alternate A B / B A. Overhead = median over
pairs of (B block total / A block total - 1); 95% bootstrap interval of that median; min .. max over
pairs; "block medians" and "CPU time" as in the transformers table; "guard per step" = mean step
of B minus that of A; "guard actions" counts B's steps by action.

| model | median step A | median step B | overhead | 95% CI | min .. max | block medians | CPU time | guard per step | guard actions |
|---|---|---|---|---|---|---|---|---|---|
| {f["model"]} | {f["median_step_s_plain"] * 1e3:.1f} ms | {f["median_step_s_guarded"] * 1e3:.1f} ms | **{f["overhead"]:+.2%}** | {lo:+.2%} .. {hi:+.2%} | {f["overhead_min"]:+.1%} .. {f["overhead_max"]:+.1%} | {f["overhead_block_medians"]:+.2%} | {f["overhead_cpu"]:+.2%} | {(f["mean_step_s_guarded"] - f["mean_step_s_plain"]) * 1e3:.2f} ms | {acts} |

Target: at most 3% on CPU: **{verdict}** ({f["overhead"]:+.2%}).
"""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="small", help=f"one of {', '.join(MODELS)} (default small)")
    ap.add_argument("--blocks", type=int, help="A/B block pairs (default: small 30, debugmodel 10)")
    ap.add_argument(
        "--steps-per-block", type=int, help="steps per block, a multiple of 50 is fair (default 50)"
    )
    ap.add_argument(
        "--warmup", type=int, help="unmeasured steps per variant first (default: small 30, debugmodel 10)"
    )
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64, help="tokens a row (each window reads seq + 1 bytes)")
    ap.add_argument("--seed", type=int, default=0, help="model init and batch order")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is steadiest on a busy box)")
    ap.add_argument("--out", type=Path, help="write the results (every pair ratio included) as JSON here")
    ap.add_argument("--write-docs", action="store_true", help="write the table into docs/BENCHMARKS.md")
    ap.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    args = ap.parse_args(argv)
    if args.model not in MODELS:
        ap.error(f"--model {args.model!r}: one of {', '.join(MODELS)}")
    blocks, steps, warmup = DEFAULTS[args.model]
    args.blocks = blocks if args.blocks is None else args.blocks
    args.steps_per_block = steps if args.steps_per_block is None else args.steps_per_block
    args.warmup = warmup if args.warmup is None else args.warmup
    for name in ("blocks", "steps_per_block", "batch", "seq", "threads"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be >= 1")
    if args.warmup < 0:
        ap.error(f"--warmup {args.warmup}: must be >= 0")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)

    from tqdm import tqdm

    from bench.common.docs import machine_line, shown_command, write_section
    from trainer.data import stdlib_corpus

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    corpus = stdlib_corpus(2_000_000)
    bar = tqdm(
        total=args.blocks,
        desc=args.model,
        unit="pair",
        file=sys.stderr,
        dynamic_ncols=True,
        mininterval=0.5,
        disable=args.no_progress,
    )
    with tempfile.TemporaryDirectory(prefix="moeguard-bench-") as tmp:
        result = measure(
            args.model,
            corpus=corpus,
            batch=args.batch,
            seq=args.seq,
            blocks=args.blocks,
            steps_per_block=args.steps_per_block,
            warmup=args.warmup,
            seed=args.seed,
            run_dir=Path(tmp) / args.model,
            progress=bar,
        )
    bar.close()
    config = {
        k: getattr(args, k)
        for k in ("batch", "seq", "blocks", "steps_per_block", "warmup", "seed", "threads")
    }
    res = {
        "command": shown_command(
            "bench/overhead/torchtitan_overhead.py", sys.argv[1:] if argv is None else argv
        ),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": machine_line(),
        "guard_version": guard_version(),
        "config": config | {"lr": LR, "grad_clip": CLIP},
        "wall_s": time.perf_counter() - t0,
        "result": result,
    }
    f = result
    lo, hi = f["overhead_ci95"]
    print(
        f"{f['model']:10s} A {f['median_step_s_plain'] * 1e3:7.2f} ms  B {f['median_step_s_guarded'] * 1e3:7.2f} ms"
        f"  overhead {f['overhead']:+.2%} [{lo:+.2%}, {hi:+.2%}]  block medians {f['overhead_block_medians']:+.2%}"
        f"  cpu {f['overhead_cpu']:+.2%}  actions {f['guard_actions']}"
    )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=2, allow_nan=True))
    if args.write_docs:
        tokens = args.batch * args.seq
        # one section per model and workload: the 256-token default has the plain key
        write_section(
            f"torchtitan_overhead_{args.model}" + ("" if tokens == 256 else f"_{tokens}"), markdown(res)
        )
    return res


if __name__ == "__main__":
    main()
