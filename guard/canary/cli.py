"""`moeguard canary`: an MFU / throughput regression gate for CI, and the kernel-choice matrix.

    moeguard canary --config configs/canary.toml --history configs/canary_history/ci-cpu.jsonl
    moeguard canary --config configs/canary.toml --history H.jsonl --record          # add a baseline
    moeguard canary --config configs/canary.toml --history H.jsonl --inject slow:10  # prove the gate
    moeguard canary --matrix attention=math,flash,efficient experts=loop,bmm,grouped_mm compile=off,on
    moeguard canary --ab set:model.attention=math set:model.attention=auto            # A/B, paired
    moeguard canary --ab py:/opt/venv-old/bin/python py:.venv/bin/python --inject slow:5

One measurement is a fixed short training run of the canary config in a fresh worker process
(clean peak-memory high-water mark, no compile caches or allocator state carried over), stored
in the run store like any run. Its steady state is the steps after `canary.warmup_steps`
(compile, allocator warm-up, LR warm-up and the profiler window excluded); each metric is the
p50 over those steps, never the last sample (a last-sample gate flips on identical runs).

Timing. On a GPU the device is not shared, so MFU and tokens/s are the trainer's wall-clock
numbers. On a CPU that other jobs share, wall time says more about the neighbours than about
the code (measured on 2 cores at load 5-10: the wall-clock p50 of identical runs spread up to
80%). So on CPU the canary
  1. runs torch on one thread: no OpenMP barrier waiting on a descheduled sibling thread;
  2. times each step in the main thread's CPU time: time spent waiting for a core is not counted;
  3. pins glibc's malloc thresholds in the worker, so freed tensors are not handed back to the
     OS and faulted in again every step (that cost 0.5-10 ms of system time per 40 ms step,
     swinging with the neighbours);
  4. times a fixed reference matmul in numpy (same thread, CPU time) right after every step, and
     reports MFU = (FLOPs/token * tokens / p50 step CPU time) / (reference FLOPs / p50 reference
     CPU time): the MFU's peak is measured in the same process, interleaved with the very steps
     it normalises, not once at start-up. Contention from neighbours slows both, to first order.
     The reference is numpy's BLAS, not torch's, so a torch regression cannot slow the yardstick
     and cancel itself out of MFU.
CPU time alone still moves 4-27% between identical runs; the normalised MFU about 3% (sd) per
process, with excursions to -9% when something outside this VM competes for the core (load 1,
wall = CPU time, yet step CPU time +27%): the model then slows 1.4-2x as much as the reference,
and none of the references tried tracked it better. Hence several processes per measurement
(see `measure.measure`) and the gate's lines (docs/BENCHMARKS.md, canary section). The worker that runs
the model and takes these times is trainer/canary_worker.py; the rest is guard/canary/.

Decision. Baseline = median of the last `history_window` baseline entries of the history with
the same fingerprint (hardware class + config hash). A regression must repeat: when the first
run crosses a fail line (or MFU its warn line) the canary re-runs once and judges both runs: a
metric fails only if the mean of the two runs is past its fail line and the re-run alone is past
its warn line; both runs are reported. No baseline for the fingerprint: pass with a notice (CI on
another machine class must not fail for that). `--inject slow:PCT` burns PCT% of each step's own
compute (CPU time on CPU; a sleep after a device sync on GPU) inside the step, so the run store's
step times show it too.

A shared host drifts (on 2026-11-23 a 2-vCPU VM's step CPU time rose 22% in 30 minutes on an
unchanged build), so on CPU the gated MFU is host-adjusted (`gate.HostFit`, fitted on the baseline's
processes), and against baseline entries that span less than `canary.baseline_min_span_h` hours
(24 in configs/canary.toml) its fail line is widened to max(configured, 3 x the baseline's own
spread, 10%) (`gate.young_fail_line`): a regression far beyond the host's drift fails from the first
day, a drift-sized one warns. Record baselines at different times (`--record` on main after each
merge) to narrow the line back to the configured one.

`--ab A B` (guard/canary/ab.py) needs no history: it measures two environments side by side,
interleaved, and judges the paired ratio; the host's drift hits both alike. With `--script "CMD"`
or `--torchtitan CONFIG.toml` it measures YOUR training instead of the canary config's model
(guard/canary/own.py): each worker runs the command, which writes its run store to
$MOEGUARD_RUN_DIR (or the {run_dir} placeholder); the steady-state tokens/s comes from there.

    moeguard canary --ab py:/opt/old/bin/python py:/opt/new/bin/python --script "{python} train.py"
    moeguard canary --ab set: set: --torchtitan my_model.toml --steps 60 --inject slow:10
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from guard.canary.ab_format import REPORT_DIR
from guard.canary.config import DEFAULT_CONFIG, EXIT_USAGE, TrainerSide, load_setup


def configure(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = __doc__.split("\n", 2)[2]
    p.add_argument(
        "--config",
        type=Path,
        default=DEFAULT_CONFIG,
        help="canary config: a training config plus a [canary] table (default: configs/canary.toml)",
    )
    p.add_argument(
        "--history", type=Path, help="JSONL history to compare against (required unless --matrix or --ab)"
    )
    p.add_argument("--record", action="store_true", help="append this run to the history as a baseline entry")
    p.add_argument(
        "--accept",
        action="store_true",
        help="with --record: record even a failing run as a baseline (an intended change)",
    )
    p.add_argument(
        "--append",
        action="store_true",
        help="append this run to the history as a non-baseline entry (a nightly job's trend)",
    )
    p.add_argument(
        "--inject",
        action="append",
        default=[],
        metavar="slow:PCT",
        help="slow each step by PCT percent (to prove the gate fails)",
    )
    p.add_argument(
        "--report-dir",
        type=Path,
        default=None,
        help="where canary.md/canary.json (or matrix.md/matrix.json) go (default: RUNS/canary-report)",
    )
    p.add_argument(
        "--runs", type=Path, default=Path("runs"), help="run store the canary runs go to (default: runs)"
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set train.steps=80 or --set canary.mfu_fail_pct=5",
    )
    p.add_argument(
        "--matrix",
        nargs="+",
        metavar="AXIS=V1,V2",
        help="kernel matrix instead of the gate: attention=..., experts=..., compile=off,on; every cell an "
        "A/B canary against the first cell (each axis's first value); --inject slow:PCT slows the cells, "
        "a:slow:PCT the reference; reports: matrix.md/matrix.json, cells/<cell>/ab.json",
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=None,
        help="matrix: worker pairs per cell against the reference cell, no extension (default: "
        "canary.ab_pairs, up to canary.ab_max_pairs while undecided)",
    )
    p.add_argument(
        "--ab",
        nargs=2,
        metavar=("A", "B"),
        help="A/B canary instead of the gate (no history): two environments, each py:PATH (another "
        "Python interpreter, e.g. a venv's bin/python) or set:KEY=VALUE[,KEY=VALUE...] (this "
        "interpreter with config overrides; set: alone = the config unchanged); worker processes "
        "alternate in ABBA order (canary.ab_order); fails when the sign-test interval of the median "
        "per-pair B/A tokens/s ratio lies wholly below 1 - canary.ab_fail_pct/100 (exit 1). "
        "--inject slow:PCT slows B (a:slow:PCT slows A). Report: ab.md/ab.json in --report-dir",
    )
    p.add_argument(
        "--script",
        metavar="CMD",
        help="with --ab: the A/B canary on YOUR training: each worker runs CMD (one string; it trains "
        "with GuardedStep or MoEGuardCallback) and the canary reads its steady-state tokens/s from the "
        "run store it writes: the run directory is $MOEGUARD_RUN_DIR (the callback's default) and the "
        "{run_dir} placeholder; {python} is the side's interpreter, {steps} is --steps; set:K=V sides "
        "set environment variables (guard/canary/own.py)",
    )
    p.add_argument(
        "--torchtitan",
        metavar="JOB",
        help="with --ab: the A/B canary on torchtitan's own trainer, guarded (torchrun -m "
        "guard.integrations.torchtitan): JOB is a TOML file (module = ..., config = ..., [section] "
        "keys as overrides) or torchtitan's arguments ('--module M --config F ...'); set:K=V sides "
        "are torchtitan overrides (--K V)",
    )
    p.add_argument(
        "--nproc",
        type=int,
        default=1,
        metavar="N",
        help="with --torchtitan: ranks (torchrun --nproc_per_node)",
    )
    p.add_argument(
        "--steps",
        type=int,
        metavar="N",
        help="with --torchtitan: --training.steps N; with --script: {steps} and $MOEGUARD_CANARY_STEPS",
    )


def run(args: argparse.Namespace, trainer: TrainerSide) -> int:
    """`moeguard canary`: the A/B canary, the matrix or the history gate; `trainer` is what the
    training code hands in (trainer/canary_cli.py)."""
    setup = load_setup(args.config, trainer.parse_overrides(args.set), trainer)
    if args.report_dir is None:
        args.report_dir = Path(args.runs) / REPORT_DIR
    own = args.script is not None or args.torchtitan is not None
    if (own or args.steps is not None) and not args.ab:
        print("moeguard canary: --script, --torchtitan and --steps go with --ab A B", file=sys.stderr)
        return EXIT_USAGE
    if args.script is not None and args.torchtitan is not None:
        print("moeguard canary: --script or --torchtitan, not both", file=sys.stderr)
        return EXIT_USAGE
    if args.steps is not None and not own:
        print("moeguard canary: --steps goes with --script or --torchtitan", file=sys.stderr)
        return EXIT_USAGE
    if args.ab:
        clash = [
            flag
            for flag, on in (
                ("--matrix", args.matrix),
                ("--history", args.history),
                ("--record", args.record),
                ("--append", args.append),
                ("--accept", args.accept),
            )
            if on
        ]
        if clash:
            print(
                f"moeguard canary: --ab keeps no history and runs no matrix; drop {', '.join(clash)}",
                file=sys.stderr,
            )
            return EXIT_USAGE
        if own:
            from guard.canary.own import run_own_ab

            return run_own_ab(args, setup)
        from guard.canary.ab import run_ab

        return run_ab(args, setup)
    if args.matrix:
        from guard.canary.matrix import run_matrix

        return run_matrix(args, setup)
    if args.history is None:
        print(
            "moeguard canary: --history FILE is required (the gate against a recorded baseline); "
            "or --ab A B (two environments side by side, no history), or --matrix AXIS=V1,V2 (a kernel matrix)",
            file=sys.stderr,
        )
        return EXIT_USAGE
    if args.accept and not args.record:
        print("moeguard canary: --accept only makes sense with --record", file=sys.stderr)
        return EXIT_USAGE
    from guard.canary.run import run_canary

    return run_canary(args, setup)
