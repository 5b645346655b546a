"""The exporter's bounded in-memory queue between the training step and the sender thread, and
the count of submitted steps not yet handled (sent, or spooled), which flush() waits on.

Order. Seqs are assigned under the batch assembler's lock (guard/runtime/export_batch.py), and
the spool replays by seq, so every step must get its seq in the order it was submitted. Hence:
the sender removes steps from here only while holding that lock, and seals them (assigns their
seqs) before it lets go (`wait` then `pop`); and a submit that finds the queue full spills the
OLDEST queued step, not the new one, under the same lock (`evict_oldest`), then queues the new
one. Either way no step can be overtaken: not by a spilled newer step while older ones wait in
the queue, nor while the sender holds older steps it has taken but not yet sealed.
"""

from __future__ import annotations

import collections
import threading

from guard.runtime.export_batch import Item


class StepQueue:
    def __init__(self, max_queue: int) -> None:
        self.max_queue = max_queue
        self._items: collections.deque[Item] = collections.deque()
        self._cond = threading.Condition()  # guards _items, _woken, _stopped
        self._woken = False  # something other than a step (meta, phase) waits for a batch
        self._stopped = False
        self._count_lock = threading.Lock()  # only ever held for an increment
        self._submitted = 0  # steps handed to put()
        self._handled = 0  # ... of which acknowledged or spooled

    def put(self, item: Item) -> bool:
        """Queue a step without blocking; False when the queue is full (the caller makes room
        with evict_oldest, under the seq lock, and puts it again)."""
        with self._cond:
            if len(self._items) >= self.max_queue:
                return False
            self._items.append(item)
            self._cond.notify()
        with self._count_lock:
            self._submitted += 1
        return True

    def evict_oldest(self) -> Item | None:
        """The oldest queued step, removed (to be spooled by the caller, who holds the seq lock)."""
        with self._cond:
            return self._items.popleft() if self._items else None

    def handled(self, n: int) -> None:
        """`n` steps taken from here (or spilled instead) are acknowledged or spooled."""
        with self._count_lock:
            self._handled += n

    @property
    def all_handled(self) -> bool:
        with self._count_lock:
            return self._handled == self._submitted

    @property
    def stopped(self) -> bool:
        with self._cond:
            return self._stopped

    def wake(self) -> None:
        with self._cond:
            self._woken = True
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()

    def wait(self, timeout: float) -> None:
        """Until a step is queued, a wake() or stop(), or `timeout` seconds pass. Removes nothing."""
        with self._cond:
            if not (self._items or self._woken or self._stopped) and timeout > 0:
                self._cond.wait(timeout)
            self._woken = False

    def pop(self, most: int) -> list[Item]:
        """Up to `most` steps, oldest first, without waiting (the sender holds the seq lock)."""
        with self._cond:
            n = min(most, len(self._items))
            return [self._items.popleft() for _ in range(n)]

    def drain(self) -> list[Item]:
        """What is still queued after the sender stopped (to be spooled, never lost)."""
        with self._cond:
            out = list(self._items)
            self._items.clear()
            return out
