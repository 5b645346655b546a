"""Start-up with CPython's cyclic garbage collector paused.

Importing torch and a framework creates hundreds of thousands of objects (modules, classes,
functions) that all live as long as the process. The cyclic collector does not know that: it runs
a full collection each time the long-lived heap has grown by a quarter, and each one scans the
whole heap so far to free almost nothing. Measured on the 2-core CI machine (CPU seconds, 3 runs):
`from transformers import Trainer` 7.0-8.3 with the collector, 5.4-6.1 without; `import torch,
torch._dynamo` (what torch's optimizers import on first use) 4.4-4.6 against 3.6-3.7. Every rank of
every launch pays it, and the test suite starts hundreds of them.

Reference counting still frees everything that is not in a cycle while the collector is paused;
the cycles made during start-up wait for the first collection after it. So pause it around
imports and set-up only, never around a training loop, and not around a framework's own set-up
that manages the collector itself (torchtitan's GarbageCollection disables it for good: leaving
this context would turn it back on). What was made inside is frozen, and handed back at exit, so
that the interpreter's last collection frees it (triton's bindings list whatever is left then as
leaked, on every exit).
"""

from __future__ import annotations

import atexit
import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic collector off inside, back on after (if it was on before: nesting is free), with
    what was made inside frozen (`gc.freeze()`): else the first collections after it scan every
    start-up object three times over (generation 0, 1, then 2: 1.4 CPU-s after a `moeguard train`
    start-up, more than the collections it saved)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        atexit.unregister(gc.unfreeze)  # once, however many times this ran
        atexit.register(gc.unfreeze)
        gc.enable()
