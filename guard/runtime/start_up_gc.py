"""A training process's start-up heap (torch, the framework, the model: ~1M objects, kept for the
process's life) frozen out of CPython's cyclic GC.

With the GC on through the imports and the first steps, its full collections rescan that heap
again and again: ~0.8 of a torchtitan rank's ~8.6 CPU-s, ~2 of a 30-step transformers Trainer
job's ~8 (docs/BENCHMARKS.md, "CI duration"). A process that turned the GC off for its imports
calls freeze_start_up() once they are done, before its training loop. Turning the GC back on
without the freeze saves nothing: the first collections then scan the whole import heap anyway.
"""

from __future__ import annotations

import atexit
import gc


def freeze_start_up() -> None:
    """Freeze everything alive now, then turn the GC on. Unfrozen at exit, where the interpreter's
    last collection still sees everything (triton's nanobind bindings report frozen objects as
    leaks)."""
    gc.freeze()
    atexit.register(gc.unfreeze)
    gc.enable()
