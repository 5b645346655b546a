"""The exporter's bounded in-memory queue between the training step and the sender thread, and
the count of submitted steps not yet handled (sent, or spooled), which flush() waits on."""

from __future__ import annotations

import queue
import threading
from typing import Any

from guard.runtime.export_batch import Item

_STOP = object()  # the sender's signal to end
_WAKE = None  # a nudge: something other than a step (meta, phase) waits for a batch


class StepQueue:
    def __init__(self, max_queue: int) -> None:
        self._q: queue.Queue[Any] = queue.Queue(maxsize=max_queue)
        self._count_lock = threading.Lock()  # only ever held for an increment
        self._submitted = 0  # steps handed to put()
        self._handled = 0  # ... of which acknowledged or spooled

    def put(self, item: Item) -> bool:
        """Queue a step without blocking; False when the queue is full (the caller spills it)."""
        with self._count_lock:
            self._submitted += 1
        try:
            self._q.put_nowait(item)
        except queue.Full:
            return False
        return True

    def handled(self, n: int) -> None:
        """`n` steps taken from here (or spilled instead) are acknowledged or spooled."""
        with self._count_lock:
            self._handled += n

    @property
    def all_handled(self) -> bool:
        with self._count_lock:
            return self._handled == self._submitted

    def wake(self) -> None:
        try:
            self._q.put_nowait(_WAKE)
        except queue.Full:
            pass  # the sender is busy anyway

    def stop(self) -> None:
        self._q.put(_STOP)

    def take(self, wait: float, most: int) -> tuple[list[Item], bool]:
        """Up to `most` steps, waiting at most `wait` seconds for the first; True when the
        sender was told to stop."""
        items: list[Item] = []
        try:
            first = self._q.get(timeout=wait) if wait > 0 else self._q.get_nowait()
        except queue.Empty:
            return items, False
        if first is _STOP:
            return items, True
        if first is not _WAKE:
            items.append(first)
        while len(items) < most:
            try:
                it = self._q.get_nowait()
            except queue.Empty:
                break
            if it is _STOP:
                return items, True
            if it is not _WAKE:
                items.append(it)
        return items, False

    def drain(self) -> list[Item]:
        """What is still queued after the sender stopped (to be spooled, never lost)."""
        out: list[Item] = []
        while True:
            try:
                it = self._q.get_nowait()
            except queue.Empty:
                return out
            if isinstance(it, tuple):
                out.append(it)
