"""FreezeSurvivors (guard/collector/gc_policy.py): what survives a full collection is frozen, out
of the next one's scan; a cycle that dies frozen is freed after the sweep."""

from __future__ import annotations

import gc
import weakref

import pytest

from guard.collector.gc_policy import FreezeSurvivors


class Node:
    def __init__(self) -> None:
        self.other: Node | None = None


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def policy():
    clock = Clock()
    p = FreezeSurvivors(sweep_every_s=600.0, clock=clock).install()
    try:
        yield p, clock
    finally:
        p.uninstall()


def _scanned(obj: object) -> bool:
    """Whether a collection would scan `obj` (gc.get_objects() leaves the frozen ones out)."""
    return any(o is obj for o in gc.get_objects())


def test_a_full_collection_freezes_its_survivors(policy):
    p, _ = policy
    survivor = Node()
    assert _scanned(survivor)
    gc.collect()
    assert p.freezes >= 1
    assert gc.get_freeze_count() > 0
    assert not _scanned(survivor)
    young = Node()  # made after the freeze: the next collection scans it
    assert _scanned(young)


def test_young_collections_freeze_nothing(policy):
    p, _ = policy
    gc.collect(0)
    gc.collect(1)
    assert p.freezes == 0 and p.sweeps == 0


def test_a_cycle_that_died_frozen_is_freed_after_the_sweep(policy):
    p, clock = policy
    a, b = Node(), Node()
    a.other, b.other = b, a
    gone = weakref.ref(a)
    gc.collect()  # the cycle is alive: frozen
    del a, b
    gc.collect()
    assert gone() is not None, "a frozen cycle waits for the sweep (the documented trade)"
    clock.t = 601.0
    gc.collect()  # due: this one hands the frozen set back
    assert p.sweeps == 1
    gc.collect()
    assert gone() is None


def test_uninstall_unfreezes_and_stops(policy):
    p, _ = policy
    gc.collect()
    p.uninstall()
    assert gc.get_freeze_count() == 0
    assert p not in gc.callbacks
    n = p.freezes
    gc.collect()
    assert p.freezes == n


@pytest.mark.parametrize("bad", [0, -1.0, float("nan")])
def test_a_bad_sweep_interval_is_named(bad):
    with pytest.raises(ValueError, match="sweep_every_s"):
        FreezeSurvivors(sweep_every_s=bad)
