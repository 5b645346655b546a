"""`torchrun -m guard.integrations.torchtitan`: torchtitan's own training, guarded, in one command.

    torchrun --nproc_per_node 8 -m guard.integrations.torchtitan \
        --module deepseek_v3 --config deepseek_v3_debugmodel [torchtitan flags ...] \
        [--guard guard.toml] [--collector URL] [--run-dir DIR] [--inject KIND@STEP[:ARG][/rRANK]]

Every argument but moeguard's own goes to torchtitan's ConfigManager untouched (its --module /
--config / --section.key=value CLI, as `torchtitan.train`). moeguard's flags:

  --guard FILE.toml   guard settings ([guard] table, or the keys at top level); default: built-in
  --collector URL     stream to this collector (default $MOEGUARD_COLLECTOR; token from
                      $MOEGUARD_TOKEN); OTLP too when $OTEL_EXPORTER_OTLP_ENDPOINT is set
  --run-dir DIR       the run store (rank 0) and the exporter's spool; its name is the run id
                      (default runs/tt-<model>-<torchrun run id>)
  --tag TAG           tag the run (repeatable): meta.json "tags", the app's Runs page filters by them
  --inject SPEC       a drill (repeatable): the fault kinds and spec of `moeguard train --inject`,
                      STEP the guard's 0-based step (default $MOEGUARD_INJECT, comma-separated);
                      guard/runtime/inject.py says where each fault is applied

The guard's state is saved in torchtitan's checkpoint (key "moeguard") and restored with it.
On a host without a CUDA device torchtitan's device globals are pointed at the CPU first
(gloo process groups), so the same command runs on a laptop or CI.

Exit status: 0 finished (or nothing left to train: the checkpoint is at --training.steps, said in
one line); 3 the guard (or an operator) halted the run, after a full checkpoint (one line on rank 0
names the step, the reason and the checkpoint that resumes it); 143 SIGTERM (the run is recorded as
preempted; torchtitan's checkpoint resumes it); 2 a bad moeguard flag or guard file, or torchtitan
not installed (the 'torchtitan' extra); an exception ends as torchtitan's would (the run recorded
crashed).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path
from typing import Any

EXIT_HALTED = 3
PROG = "guard.integrations.torchtitan"


def parser() -> argparse.ArgumentParser:
    from guard.core.inject import help_lines

    p = argparse.ArgumentParser(
        prog="torchrun [torchrun args] -m guard.integrations.torchtitan (or python -m ... --nproc-per-node N)",
        description="torchtitan's own Trainer with the moeguard guard deciding every optimizer step, "
        "streaming to the collector and saving its state in torchtitan's checkpoint. Arguments "
        "not listed here go to torchtitan (e.g. --module deepseek_v3 --config deepseek_v3_debugmodel "
        "--training.steps 100).",
        epilog="\n\n".join([*__doc__.split("\n\n")[4:], help_lines()]),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        add_help=False,
    )
    p.add_argument(
        "-h", "--help", action="store_true", help="this help (torchtitan's own: --torchtitan-help)"
    )
    p.add_argument("--torchtitan-help", action="store_true", help="torchtitan's --help for its flags")
    p.add_argument("--guard", type=Path, metavar="FILE.toml", help="guard settings")
    p.add_argument("--collector", metavar="URL", help="collector URL (default $MOEGUARD_COLLECTOR)")
    p.add_argument("--run-dir", type=Path, metavar="DIR", help="run store folder (its name is the run id)")
    p.add_argument(
        "--inject",
        action="append",
        default=None,
        metavar="KIND@STEP[:ARG][/rRANK]",
        help="a drill, repeatable (default $MOEGUARD_INJECT): the fault kinds of `moeguard train "
        "--inject` (below: what ARG means for each), STEP the guard's 0-based step",
    )
    p.add_argument(
        "--tag",
        action="append",
        default=[],
        metavar="TAG",
        help='tag the run (repeatable): meta.json "tags", the Runs page filters by them',
    )
    p.add_argument(
        "--nproc-per-node",
        "--nproc_per_node",
        type=int,
        metavar="N",
        help="outside torchrun: start N ranks on this host yourself (torchrun --standalone underneath, "
        "launch.py); a failed rank (a guard halt: exit 3) then ends in one line naming it and its exit "
        "status instead of torchrun's ChildFailedError traceback",
    )
    p.add_argument(
        "--no-guard",
        action="store_true",
        help="torchtitan's own Trainer, unguarded (the baseline of an overhead or canary measurement)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    argv = sys.argv[1:] if argv is None else argv
    args, rest = p.parse_known_args(argv)
    if args.help:
        p.print_help()
        return 0
    from guard.core.inject import ENV_INJECT, check_injections, from_env, parse_injections
    from guard.core.tags import clean_tags
    from guard.core.tomlconf import ConfigError
    from guard.extras import MissingExtra, require

    try:
        require("torchtitan", f"python -m {PROG}")
        drills = parse_injections(args.inject) if args.inject is not None else from_env()
    except MissingExtra as e:  # one line naming the extra, not torchtitan's import traceback
        print(e, file=sys.stderr)
        return 2
    except ConfigError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    if args.nproc_per_node is not None and "LOCAL_RANK" not in os.environ:
        from guard.integrations.torchtitan.launch import launch

        return launch(args.nproc_per_node, argv)
    try:
        tags = clean_tags(args.tag, "--tag")
    except ValueError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    if drills and args.no_guard:
        print(
            f"{PROG}: --inject / ${ENV_INJECT}: the drills run in the guard; drop --no-guard", file=sys.stderr
        )
        return 2
    guard_config = None
    if args.guard is not None:
        from guard.core.config import load_guard_config

        try:
            guard_config = load_guard_config(args.guard)
        except (ConfigError, OSError) as e:
            print(f"--guard {args.guard}: {e}", file=sys.stderr)
            return 2
    if args.torchtitan_help:
        rest = [*rest, "--help"]

    # The GC off through a rank's imports, its heap frozen before the Trainer is built
    # (guard/runtime/start_up_gc.py); torchtitan's Trainer then runs the GC as it always does
    # (automatic collections off for the run, generation 1 every `training.gc_freq` steps).
    gc.disable()
    import torch
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger

    from guard.integrations.torchtitan import cpu
    from guard.integrations.torchtitan.trainer import guarded_trainer
    from guard.runtime.start_up_gc import freeze_start_up

    init_logger()
    if cpu.needs_cpu():
        cpu.use_cpu()
        os.environ.setdefault("LOCAL_RANK", "0")  # torchtitan reads it; torchrun sets it, `python -m` not
    config = ConfigManager().parse_args(rest)
    try:
        check_injections(drills, config.training.steps, more="raise --training.steps")
    except ConfigError as e:
        print(f"{PROG}: {e}", file=sys.stderr)
        return 2
    freeze_start_up()
    if args.no_guard:
        from torchtitan.trainer import Trainer

        trainer = Trainer(config)
    else:
        trainer = guarded_trainer()(
            config,
            guard_config=guard_config,
            run_dir=args.run_dir,
            collector=args.collector,
            inject=[str(d) for d in drills],
            tags=tags,
        )
    try:
        trainer.train()
    except BaseException:
        trainer.close()  # inside the handler: the run is recorded as crashed / preempted / interrupted
        raise
    trainer.close()
    halted = getattr(trainer, "halted", False)
    rank0 = not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    line = ending_line(trainer, config)
    if halted:  # under plain torchrun, its failure report names the halt (guard/runtime/elastic.py)
        from guard.runtime.elastic import tell_launcher

        tell_launcher(line)
    if rank0 and line:
        print(line, file=sys.stderr, flush=True)
    return EXIT_HALTED if halted else 0


def ending_line(trainer: Any, config: Any) -> str:
    """Rank 0's last line: why a halted run stopped (exit 3), or that a relaunch found nothing
    left to train (torchtitan resumed a checkpoint already at --training.steps)."""
    if getattr(trainer, "halted", False):
        _, note = trainer._ending()
        return f"{PROG}: the run {note} (exit {EXIT_HALTED})"
    if getattr(trainer, "guarded_steps", None) == 0 and trainer.step >= config.training.steps:
        folder = getattr(trainer.checkpointer, "folder", "the checkpoint folder")
        return (
            f"{PROG}: nothing to train: torchtitan resumed its checkpoint of step {trainer.step} in "
            f"{folder}, and --training.steps is {config.training.steps}; raise --training.steps to "
            "train on, or give a new --dump_folder to start afresh"
        )
    return ""


if __name__ == "__main__":
    raise SystemExit(main())
