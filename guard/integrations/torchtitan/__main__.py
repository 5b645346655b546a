"""`torchrun -m guard.integrations.torchtitan`: torchtitan's own training, guarded, in one command.

    torchrun --nproc_per_node 8 -m guard.integrations.torchtitan \
        --module deepseek_v3 --config deepseek_v3_debugmodel [torchtitan flags ...] \
        [--guard guard.toml] [--collector URL] [--run-dir DIR]

Every argument but moeguard's own goes to torchtitan's ConfigManager untouched (its --module /
--config / --section.key=value CLI, as `torchtitan.train`). moeguard's flags:

  --guard FILE.toml   guard settings ([guard] table, or the keys at top level); default: built-in
  --collector URL     stream to this collector (default $MOEGUARD_COLLECTOR; token from
                      $MOEGUARD_TOKEN); OTLP too when $OTEL_EXPORTER_OTLP_ENDPOINT is set
  --run-dir DIR       the run store (rank 0) and the exporter's spool; its name is the run id
                      (default runs/tt-<model>-<torchrun run id>)

The guard's state is saved in torchtitan's checkpoint (key "moeguard") and restored with it.
On a host without a CUDA device torchtitan's device globals are pointed at the CPU first
(gloo process groups), so the same command runs on a laptop or CI.

Exit status: 0 finished; 3 the guard (or an operator) halted the run, after a full checkpoint;
143 SIGTERM (the run is recorded as preempted; torchtitan's checkpoint resumes it); 2 a bad
moeguard flag or guard file; an exception ends as torchtitan's would (the run recorded crashed).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

EXIT_HALTED = 3


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="torchrun [torchrun args] -m guard.integrations.torchtitan",
        description="torchtitan's own Trainer with the moeguard guard deciding every optimizer step, "
        "streaming to the collector and saving its state in torchtitan's checkpoint. Arguments "
        "not listed here go to torchtitan (e.g. --module deepseek_v3 --config deepseek_v3_debugmodel "
        "--training.steps 100).",
        epilog="\n\n".join(__doc__.split("\n\n")[4:]),
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
        "--no-guard",
        action="store_true",
        help="torchtitan's own Trainer, unguarded (the baseline of an overhead or canary measurement)",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    p = parser()
    args, rest = p.parse_known_args(sys.argv[1:] if argv is None else argv)
    if args.help:
        p.print_help()
        return 0
    guard_config = None
    if args.guard is not None:
        from guard.core.config import load_guard_config
        from guard.core.tomlconf import ConfigError

        try:
            guard_config = load_guard_config(args.guard)
        except (ConfigError, OSError) as e:
            print(f"--guard {args.guard}: {e}", file=sys.stderr)
            return 2
    if args.torchtitan_help:
        rest = [*rest, "--help"]

    import torch
    from torchtitan.config import ConfigManager
    from torchtitan.tools.logging import init_logger

    from guard.integrations.torchtitan import cpu
    from guard.integrations.torchtitan.trainer import guarded_trainer

    init_logger()
    if cpu.needs_cpu():
        cpu.use_cpu()
        os.environ.setdefault("LOCAL_RANK", "0")  # torchtitan reads it; torchrun sets it, `python -m` not
    config = ConfigManager().parse_args(rest)
    if args.no_guard:
        from torchtitan.trainer import Trainer

        trainer = Trainer(config)
    else:
        trainer = guarded_trainer()(
            config, guard_config=guard_config, run_dir=args.run_dir, collector=args.collector
        )
    try:
        trainer.train()
    except BaseException:
        trainer.close()  # inside the handler: the run is recorded as crashed / preempted / interrupted
        raise
    trainer.close()
    halted = getattr(trainer, "halted", False)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    return EXIT_HALTED if halted else 0


if __name__ == "__main__":
    raise SystemExit(main())
