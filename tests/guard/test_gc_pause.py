"""guard/core/gc_pause.py: start-up with the cyclic GC paused, what it made frozen, handed back at
exit. (What it saves is measured in docs/BENCHMARKS.md, CI duration.)"""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path

import pytest

from guard.core.gc_pause import gc_paused

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def _gc_as_it_was() -> object:
    was = gc.isenabled()
    yield
    gc.unfreeze()
    (gc.enable if was else gc.disable)()


def test_off_inside_on_after_even_on_an_error() -> None:
    gc.enable()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), gc_paused():
        raise RuntimeError("a failed import")
    assert gc.isenabled()


def test_nesting_and_a_collector_already_off_are_left_alone() -> None:
    gc.enable()
    with gc_paused():
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # the inner one did not turn it back on
    assert gc.isenabled()
    gc.disable()
    with gc_paused():
        pass
    assert not gc.isenabled()  # off before: off after, nothing frozen by us


def test_what_was_made_inside_is_frozen() -> None:
    gc.enable()
    gc.unfreeze()
    with gc_paused():
        made = [[i] for i in range(1000)]
    assert gc.get_freeze_count() >= len(made)


def test_a_cycle_made_inside_is_freed_at_exit_not_before() -> None:
    """Frozen, a dead cycle waits; the interpreter's last collection frees it (gc.unfreeze at
    exit, registered once however often the context ran)."""
    code = """
import gc
from guard.core.gc_pause import gc_paused

class Cycle:
    def __del__(self):
        print("freed", flush=True)

with gc_paused():
    c = Cycle()
    c.me = c
    del c
with gc_paused():
    pass
gc.collect()
print("collected", flush=True)
"""
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60, check=True
    )
    assert out.stdout.split() == ["collected", "freed"], out
