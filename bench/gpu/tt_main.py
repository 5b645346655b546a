"""`python -m guard.integrations.torchtitan`, with the GPU bench's host-sync counter.

    MOEGUARD_GPU_SYNCS=3:8 MOEGUARD_GPU_SYNC_FILE=syncs.jsonl \
        python -m bench.gpu.tt_main --module bench.gpu.tt_registry --config gpu_moe [--no-guard] ...

Every argument goes to guard.integrations.torchtitan's main unchanged (plain with --no-guard,
guarded otherwise). With $MOEGUARD_GPU_SYNCS=FIRST:LAST, torchtitan's
`Trainer.train_step` for torchtitan steps FIRST..LAST runs under
`torch.cuda.set_sync_debug_mode("warn")`, and the number of synchronizing CUDA calls it warned
about is appended to $MOEGUARD_GPU_SYNC_FILE, one JSON line a step (null without CUDA). The guard's step runs inside
train_step (it is the optimizer step torchtitan calls), so plain vs guarded is the guard's own.
Only those steps pay for the warnings: keep them in the warm-up that the timing leaves out.

Writes docs/BENCHMARKS.md › GPU, through `bench/gpu/report.py`: no section of its own.
"""

from __future__ import annotations

import json
import os
import warnings
from typing import Any

ENV_SYNCS = "MOEGUARD_GPU_SYNCS"
ENV_SYNC_FILE = "MOEGUARD_GPU_SYNC_FILE"
SYNC_WORD = "synchroniz"  # torch's warning: "called a synchronizing CUDA operation"


def count_syncs(fn: Any) -> tuple[Any, int | None]:
    """fn() under the sync debug mode: (its result, the synchronizing CUDA calls it made). Without
    CUDA, fn() alone and None: the count needs CUDA, the plumbing around it does not (the dry run
    exercises it)."""
    import torch

    if not torch.cuda.is_available():
        return fn(), None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return out, sum(1 for w in caught if SYNC_WORD in str(w.message))


def install_counter(first: int, last: int, path: str) -> None:
    """Wrap torchtitan's Trainer.train_step (GuardedTrainer calls it through super())."""
    from torchtitan.trainer import Trainer

    inner = Trainer.train_step

    def train_step(self: Any, *a: Any, **k: Any) -> Any:
        step = int(self.step)  # torchtitan increments it before train_step
        if not first <= step <= last:
            return inner(self, *a, **k)
        out, n = count_syncs(lambda: inner(self, *a, **k))
        with open(path, "a") as f:
            f.write(json.dumps({"step": step, "syncs": n}) + "\n")
        return out

    Trainer.train_step = train_step  # type: ignore[method-assign]


def main() -> int:
    from guard.integrations.torchtitan.__main__ import main as titan_main

    spec, path = os.environ.get(ENV_SYNCS, ""), os.environ.get(ENV_SYNC_FILE, "")
    if spec and path:  # without CUDA the counter writes null counts (count_syncs)
        first, _, last = spec.partition(":")
        install_counter(int(first), int(last), path)
    return titan_main()


if __name__ == "__main__":
    raise SystemExit(main())
