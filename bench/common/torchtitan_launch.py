"""The command that launches a guarded torchtitan job on this machine's CPU ranks (tests, benches).

    torchrun_command(2, "tiny_moe", "--training.steps", "40")
      -> python -m torch.distributed.run --standalone --nproc_per_node 2
         -m guard.integrations.torchtitan --module bench.common.torchtitan_registry --config tiny_moe ...

The README's recipe, with `bench/common/torchtitan_registry.py`'s CPU configs.

Writes docs/BENCHMARKS.md: no section of its own; the launcher of Overhead › Guard overhead inside
torchtitan's Trainer, 2 ranks, streaming (debugmodel) and of the paging drills.
"""

from __future__ import annotations

import sys


def torchrun_command(nproc: int, config: str, *args: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        str(nproc),
        "-m",
        "guard.integrations.torchtitan",
        "--module",
        "bench.common.torchtitan_registry",
        "--config",
        config,
        *args,
    ]
