"""Guard overhead on each transformers MoE family: the same training loop plain vs guarded,
interleaved in one process (A B A B blocks, so host-load drift hits both variants alike).

Per family (guard/integrations/tiny.py: 4 layers, hidden 64, 8 experts, top-2, byte vocab), the
model is built TWICE from the same seed, each with its own AdamW: identical weights, and both
copies eat the same batches in the same order, so they do the same arithmetic. Two copies rather
than one model alternating, because attach() hooks every router for good and the guard keeps
per-step state (probe counters, detector windows, snapshot ring): a single model would make the
plain loop pay for the hooks and would mix the guard's history across variants.

  A, plain:   forward, backward, clip_grad_norm_(1.0), AdamW step, zero_grad
  B, guarded: forward, backward, GuardedStep.step (attach(model) hooks on every router, the
              probe's one host copy, detectors, policy, grad_clip=1.0, AdamW step, zero_grad,
              snapshot ring, run-store rows; run_dir in a temp dir, so the store's background
              Parquet writer runs too)

torch runs on 1 thread. After --warmup steps of each variant, --blocks pairs of blocks of
--steps-per-block steps alternate, the pair's order flipping each time (A B, B A, A B, ...).
Overhead = median over pairs of (B block time / A block time - 1), with a bootstrap 95% interval
of that median and the min/max over pairs. Block time is the block's TOTAL, not its median step:
the guard's periodic work (a snapshot every policy.snapshot_every = 25 steps, a run-store flush
every 50) would be invisible in a median. The default block (50 steps) holds exactly two
snapshots and one flush wherever it starts; keep --steps-per-block a multiple of 50 for a
measurement that is fair to the periodic work. Reported beside it: the ratio of block medians
(the steady per-step cost alone) and the ratio of the process's CPU time per block (all threads,
the run-store writer included; CPU time leaves out the time other processes hold the cores, so
on a shared box it is the steadier figure; wall time is the one the target is about).

    python bench/overhead/integration_overhead.py --blocks 36 --warmup 30 --out /tmp/integration_overhead.json --write-docs
    python bench/overhead/integration_overhead.py --families mixtral,olmoe --blocks 4

Writes docs/BENCHMARKS.md › Overhead › Guard overhead per transformers MoE family, 256 tokens a step
(1,024 and 4,096 with `--seq`).
"""

from __future__ import annotations

import sys
from pathlib import Path as _P

sys.path.insert(0, str(_P(__file__).resolve().parents[2]))  # `python bench/<group>/x.py` from a checkout

import argparse
import functools
import json
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from guard.api import GuardedStep
from guard.integrations.tiny import FAMILIES, build
from guard.integrations.transformers import attach

LR = 3e-3
CLIP = 1.0


def byte_batches(corpus: np.ndarray, *, batch: int, seq: int, seed: int) -> Iterator[torch.Tensor]:
    """Endless random (batch, seq) windows of byte tokens; one stream per variant, same seed: the
    two variants read the same batches in the same order."""
    rng = np.random.default_rng(seed)
    while True:
        starts = rng.integers(0, corpus.size - seq - 1, size=batch)
        yield torch.from_numpy(np.stack([corpus[s : s + seq] for s in starts]).astype(np.int64))


def guard_version() -> str:
    """The commit the guard code was measured at, '+dirty' when guard/ has uncommitted changes."""
    root = Path(__file__).resolve().parents[2]
    try:
        run = functools.partial(
            subprocess.run, cwd=root, capture_output=True, text=True, timeout=10, check=True
        )
        head = run(["git", "rev-parse", "--short", "HEAD"]).stdout.strip()
        dirty = run(["git", "status", "--porcelain", "--", "guard"]).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("+dirty" if dirty else "")


class Plain:
    """Variant A: the loop a user writes without the guard."""

    def __init__(self, family: str, seed: int, data: Iterator[torch.Tensor]) -> None:
        self.data = data
        self.model = build(family, seed=seed)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR)

    def step(self, x: torch.Tensor) -> None:
        loss = self.model(input_ids=x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), CLIP)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def close(self) -> None:
        pass


class Guarded:
    """Variant B: the same loop through GuardedStep (which clips, steps and zeroes itself)."""

    def __init__(self, family: str, seed: int, data: Iterator[torch.Tensor], run_dir: Path) -> None:
        self.data = data
        self.model = build(family, seed=seed)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=LR)
        self.guarded = GuardedStep(
            self.model, self.opt, attach=attach(self.model), run_dir=run_dir, max_lr=LR, grad_clip=CLIP
        )

    def step(self, x: torch.Tensor) -> None:
        loss = self.model(input_ids=x, labels=x).loss
        loss.backward()
        self.guarded.step(loss, tokens=x.numel())

    def close(self) -> None:
        self.guarded.close()


def run_block(v: Plain | Guarded, n: int) -> tuple[list[float], float]:
    """n steps: (wall time of each step, CPU time of the whole process over the block). Batches
    are cut outside the timed region."""
    times = []
    cpu = 0.0
    for _ in range(n):
        x = next(v.data)
        c0 = time.process_time()
        t0 = time.perf_counter()
        v.step(x)
        times.append(time.perf_counter() - t0)
        cpu += time.process_time() - c0
    return times, cpu


def interleave(
    a: Any, b: Any, *, blocks: int, steps_per_block: int, progress: Any = None, label: str = ""
) -> dict[str, list[float]]:
    """The measured pairs of variant a (plain) and b (guarded), the order flipping each pair (A B,
    B A, ...): every step time and each pair's ratios (block totals, block medians, CPU time)."""
    out: dict[str, list[float]] = {k: [] for k in ("t_a", "t_b", "ratios", "ratios_med", "ratios_cpu")}
    for i in range(blocks):
        if i % 2 == 0:
            (xa, ca), (xb, cb) = run_block(a, steps_per_block), run_block(b, steps_per_block)
        else:
            (xb, cb), (xa, ca) = run_block(b, steps_per_block), run_block(a, steps_per_block)
        out["t_a"] += xa
        out["t_b"] += xb
        out["ratios"].append(sum(xb) / sum(xa) - 1)
        out["ratios_med"].append(statistics.median(xb) / statistics.median(xa) - 1)
        out["ratios_cpu"].append(cb / ca - 1)
        if progress is not None:
            progress.set_postfix_str(
                f"{label} {statistics.median(out['ratios']):+.1%}".strip(), refresh=False
            )
            progress.update(1)
    return out


def bootstrap_median(x: np.ndarray, *, n: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95% percentile-bootstrap interval of the median of x."""
    rng = np.random.default_rng(seed)
    meds = np.median(x[rng.integers(0, x.size, size=(n, x.size))], axis=1)
    lo, hi = np.percentile(meds, [2.5, 97.5])
    return float(lo), float(hi)


def measure(
    family: str,
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
    """Interleaved A/B measurement of one family; times in seconds."""
    t_build = time.perf_counter()
    a = Plain(family, seed, byte_batches(corpus, batch=batch, seq=seq, seed=seed))
    b = Guarded(family, seed, byte_batches(corpus, batch=batch, seq=seq, seed=seed), run_dir)
    run_block(a, warmup)
    run_block(b, warmup)
    try:
        m = interleave(a, b, blocks=blocks, steps_per_block=steps_per_block, progress=progress, label=family)
    finally:
        b.close()
    return {
        "family": family,
        **summary(m, a.model, b.guarded, seed=seed),
        "wall_s": time.perf_counter() - t_build,
    }


def summary(
    m: dict[str, list[float]], model: torch.nn.Module, guarded: GuardedStep, *, seed: int
) -> dict[str, Any]:
    """One model's figures from interleave()'s pairs: step times, the overhead with its interval,
    and what the guard did (anything but "apply" means the two copies stopped doing the same work)."""
    t_a, t_b = m["t_a"], m["t_b"]
    r = np.array(m["ratios"])
    lo, hi = bootstrap_median(r, seed=seed)
    return {
        "model_class": type(model).__name__,
        "params": sum(p.numel() for p in model.parameters()),
        "moe_layers": len(guarded.probe.routers),
        "pairs": len(r),
        "steps_per_variant": len(t_a),
        "median_step_s_plain": statistics.median(t_a),
        "median_step_s_guarded": statistics.median(t_b),
        "mean_step_s_plain": statistics.fmean(t_a),
        "mean_step_s_guarded": statistics.fmean(t_b),
        "overhead": float(np.median(r)),
        "overhead_ci95": [lo, hi],
        "overhead_min": float(r.min()),
        "overhead_max": float(r.max()),
        "overhead_block_medians": statistics.median(m["ratios_med"]),
        "overhead_cpu": statistics.median(m["ratios_cpu"]),
        "pair_ratios": [float(x) for x in m["ratios"]],
        "pair_ratios_cpu": [float(x) for x in m["ratios_cpu"]],
        "guard_actions": dict(guarded.counts),
    }


def markdown(res: dict[str, Any]) -> str:
    c = res["config"]
    rows = []
    for f in res["families"].values():
        lo, hi = f["overhead_ci95"]
        acts = ", ".join(f"{k} {v}" for k, v in sorted(f["guard_actions"].items()))
        rows.append(
            f"| {f['family']} ({f['model_class']}, {f['moe_layers']} MoE layers) "
            f"| {f['median_step_s_plain'] * 1e3:.1f} ms | {f['median_step_s_guarded'] * 1e3:.1f} ms "
            f"| **{f['overhead']:+.2%}** | {lo:+.2%} .. {hi:+.2%} "
            f"| {f['overhead_min']:+.1%} .. {f['overhead_max']:+.1%} "
            f"| {f['overhead_block_medians']:+.2%} | {f['overhead_cpu']:+.2%} "
            f"| {(f['mean_step_s_guarded'] - f['mean_step_s_plain']) * 1e3:.2f} ms | {acts} |"
        )
    worst = max(res["families"].values(), key=lambda f: f["overhead"])
    verdict = "met" if worst["overhead"] <= 0.03 else "NOT met"
    tokens = c["batch"] * c["seq"]
    return f"""## Guard overhead per transformers MoE family, {tokens:,} tokens a step

`{res["command"]}` ({res["machine"]}; {res["wall_s"] / 60:.1f} min; guard code at {res["guard_version"]})

Tiny random-init models from `guard/integrations/tiny.py` (4 layers, hidden 64, 8 experts, top-2,
fp32, eager attention, aux loss 0.01 where the family has one), batch {c["batch"]} x {c["seq"]} stdlib bytes,
AdamW lr {LR}, CPU, `torch.set_num_threads(1)`. A = plain loop (forward, backward,
`clip_grad_norm_(1.0)`, `AdamW.step()`, `zero_grad`); B = the same loop through
`GuardedStep(attach=attach(model), run_dir=<tmp>, grad_clip=1.0)` (router hooks, probe, detectors,
policy, snapshot ring every 25 steps, run store with its background writer). Two copies of the
model from the same seed see the same batches; after {c["warmup"]} warm-up steps each,
{c["blocks"]} pairs of {c["steps_per_block"]}-step blocks alternate A B / B A.
Overhead = median over pairs of (B block total / A block total - 1), so the periodic snapshot and
flush are counted; 95% bootstrap interval of that median; min .. max over pairs. "Block medians"
is the same with each block's median step (the steady per-step cost without the periodic work);
"CPU time" the same with the process's CPU time per block (all threads). "Guard per step" is the
mean step of B minus that of A: the guard's cost in time (host work, small kernels, and routing
statistics that grow with the tokens a step), so the percentage depends on the workload.
"Guard actions" counts B's steps by action: anything but `apply` means B did different work from
A on those steps.

| family | median step A | median step B | overhead | 95% CI | min .. max | block medians | CPU time | guard per step | guard actions |
|---|---|---|---|---|---|---|---|---|---|
{chr(10).join(rows)}

Target: at most 3% on CPU: **{verdict}** (worst: {worst["family"]}, {worst["overhead"]:+.2%}).
"""


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--families",
        default=",".join(FAMILIES),
        help=f"comma-separated, from {', '.join(FAMILIES)} (default: all)",
    )
    ap.add_argument("--blocks", type=int, default=20, help="A/B block pairs per family (default 20)")
    ap.add_argument(
        "--steps-per-block",
        type=int,
        default=50,
        help="steps per block; a multiple of 50 holds the guard's periodic work evenly (default 50)",
    )
    ap.add_argument("--warmup", type=int, default=20, help="unmeasured steps per variant first (default 20)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0, help="model init and batch order")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is steadiest on a busy box)")
    ap.add_argument("--out", type=Path, help="write the results (every pair ratio included) as JSON here")
    ap.add_argument("--write-docs", action="store_true", help="write the table into docs/BENCHMARKS.md")
    ap.add_argument("--no-progress", action="store_true", help="no tqdm bar")
    args = ap.parse_args(argv)
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    bad = [f for f in families if f not in FAMILIES]
    if bad or not families:
        ap.error(f"--families {args.families!r}: each must be one of {', '.join(FAMILIES)}")
    if args.blocks < 1 or args.steps_per_block < 1 or args.warmup < 0:
        ap.error("--blocks and --steps-per-block must be >= 1, --warmup >= 0")

    from tqdm import tqdm

    from bench.common.docs import machine_line, shown_command, write_section
    from trainer.data import stdlib_corpus

    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    corpus = stdlib_corpus(2_000_000)
    bar = tqdm(
        total=len(families) * args.blocks,
        unit="pair",
        file=sys.stderr,
        dynamic_ncols=True,
        mininterval=0.5,
        disable=args.no_progress,
    )
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="moeguard-bench-") as tmp:
        for fam in families:
            bar.set_description(fam)
            out[fam] = measure(
                fam,
                corpus=corpus,
                batch=args.batch,
                seq=args.seq,
                blocks=args.blocks,
                steps_per_block=args.steps_per_block,
                warmup=args.warmup,
                seed=args.seed,
                run_dir=Path(tmp) / fam,
                progress=bar,
            )
    bar.close()
    config = dict(
        batch=args.batch,
        seq=args.seq,
        blocks=args.blocks,
        steps_per_block=args.steps_per_block,
        warmup=args.warmup,
        seed=args.seed,
        threads=args.threads,
        lr=LR,
        grad_clip=CLIP,
    )
    res = {
        "command": shown_command(
            "bench/overhead/integration_overhead.py", sys.argv[1:] if argv is None else argv
        ),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": machine_line(),
        "guard_version": guard_version(),
        "config": config,
        "wall_s": time.perf_counter() - t0,
        "families": out,
    }
    for f in out.values():
        lo, hi = f["overhead_ci95"]
        print(
            f"{f['family']:12s} A {f['median_step_s_plain'] * 1e3:7.2f} ms  B {f['median_step_s_guarded'] * 1e3:7.2f} ms"
            f"  overhead {f['overhead']:+.2%} [{lo:+.2%}, {hi:+.2%}]  block medians {f['overhead_block_medians']:+.2%}"
            f"  cpu {f['overhead_cpu']:+.2%}"
            f"  actions {f['guard_actions']}"
        )
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=2, allow_nan=True))
    if args.write_docs:
        tokens = args.batch * args.seq
        # one section per workload: the 256-token default keeps its historical key
        write_section("integration_overhead" + ("" if tokens == 256 else f"_{tokens}"), markdown(res))
    return res


if __name__ == "__main__":
    main()
