"""Goodbyes between the ranks of a job: after a SIGTERM, was it the whole job, or did a peer die?

torchrun's agent answers a rank's death by sending SIGTERM to every survivor (~0.2 s later on a
loaded host); a scheduler preempting the job sends SIGTERM to every rank. A survivor cannot tell
the two apart from the signal, and calling the first "preempted" hid the dead rank: the run read
as a clean stop (issue #37). So each rank says goodbye in the job's own c10d store the moment a
SIGTERM lands, from a thread (the main thread may sit in a collective waiting for a peer that is
itself handling the signal), and a rank that ends on a SIGTERM waits up to GOODBYE_WAIT_S for
every peer's goodbye: all there is a preemption; a peer that said none is dead (killed -9, OOM,
its node gone) or hung, and the run ends `peer_lost`, naming it.

How the thread hears the signal at once: `signal.set_wakeup_fd`. CPython's C-level handler writes
the signal's number to that fd the moment the signal arrives, whatever the main thread is doing;
the Python-level handler (the session's Preempted) still runs in the main thread as before. Where
someone else owns the wakeup fd (an asyncio loop in the main thread), the watch stands aside and
the goodbye is said when the main thread handles the signal.

A dead rank 0 cannot record how the run ended in the job's meta.json (only rank 0 writes the
run store): its meta.json said `running` while the collector's copy said `peer_lost`. So rank 0
says in the store that it is recording its ending (say_ending), and a survivor ending `peer_lost`
asks rank0_gone: no goodbye and no ending of rank 0's within GOODBYE_WAIT_S (or no store: it lived
with rank 0) and the survivor records `peer_lost` for it (guard/runtime/record.py).

The store is the one torch.distributed was initialised with (torchrun: the agent's, prefixed per
restart attempt, so one attempt's goodbyes never answer for the next).
"""

from __future__ import annotations

import signal
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

GOODBYE_WAIT_S = 5.0  # how long a rank ending on SIGTERM waits for its peers' goodbyes
_KEY = "moeguard/goodbye/{}"
_ENDED = "moeguard/ended/{}"  # this rank is alive and records how it ended (any ending)


def default_store() -> Any:
    """The job's c10d store, or None (no process group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        from torch.distributed.distributed_c10d import _get_default_store

        return _get_default_store()
    except Exception:
        return None


class Goodbyes:
    """One rank's side: say goodbye on SIGTERM (from a thread), and ask who else did."""

    def __init__(self, rank: int, world: int, store: Any) -> None:
        self.rank, self.world, self.store = rank, world, store
        self.sigterm = threading.Event()  # a SIGTERM reached this process
        self.sigterm_at = 0.0  # time.monotonic() when it did
        self._said = False
        self._lock = threading.Lock()
        self._sock: tuple[socket.socket, socket.socket] | None = None
        self._watch()

    @classmethod
    def for_job(cls, rank: int, world: int) -> Goodbyes | None:
        """None in a one-rank run or without a process group (nothing to ask)."""
        store = default_store() if world > 1 else None
        return cls(rank, world, store) if store is not None else None

    def _watch(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        r, w = socket.socketpair()
        w.setblocking(False)
        try:
            old = signal.set_wakeup_fd(w.fileno(), warn_on_full_buffer=False)
        except ValueError:
            r.close(), w.close()
            return
        if old != -1:  # someone else's (an event loop): leave it theirs
            signal.set_wakeup_fd(old)
            r.close(), w.close()
            return
        self._sock = (r, w)
        threading.Thread(target=self._read, args=(r,), name="moeguard-goodbye", daemon=True).start()

    def _read(self, r: socket.socket) -> None:
        while True:
            try:
                data = r.recv(64)
            except OSError:
                return
            if not data:
                return
            if signal.SIGTERM in data:
                self.heard_sigterm()

    def heard_sigterm(self) -> None:
        """A SIGTERM arrived (the watch thread, or the session's handler): say goodbye now."""
        if not self.sigterm.is_set():
            self.sigterm_at = time.monotonic()
            self.sigterm.set()
        self.say()

    def say(self) -> None:
        with self._lock:
            if self._said:
                return
            self._said = True
        try:
            self.store.set(_KEY.format(self.rank), "1")
        except Exception:
            pass  # the store is gone with its host: the peers read it as silence

    def silent_peers(self, wait_s: float = GOODBYE_WAIT_S) -> list[int]:
        """Say goodbye, then wait up to `wait_s` for every peer's: the ranks that said none (all of
        them when the store does not answer: whoever hosted it is gone)."""
        self.say()
        missing = [r for r in range(self.world) if r != self.rank]
        deadline = time.monotonic() + wait_s
        while missing:
            try:
                missing = [r for r in missing if not self.store.check([_KEY.format(r)])]
            except Exception:
                return missing
            if not missing or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
        return missing

    def close(self) -> None:
        """Give the wakeup fd back (main thread only: elsewhere the watch stays, harmless)."""
        if self._sock is None or threading.current_thread() is not threading.main_thread():
            return
        if signal.set_wakeup_fd(-1) != self._sock[1].fileno():  # taken over since: give it back
            signal.set_wakeup_fd(signal.set_wakeup_fd(-1))
        for s in self._sock:
            s.close()
        self._sock = None


def say_ending(rank: int, store: Any = None) -> None:
    """This rank is alive and records how it ends (rank 0: in the job's meta.json); nothing
    without a process group. Not a goodbye: silent_peers' preempted-or-dead question is apart."""
    store = store if store is not None else default_store()
    if store is None:
        return
    try:
        store.set(_ENDED.format(rank), "1")
    except Exception:
        pass


def rank0_gone(
    store: Any, wait_s: float = GOODBYE_WAIT_S, recorded: Callable[[], bool] = lambda: False
) -> bool:
    """Whether rank 0 is gone (killed, its host lost): within `wait_s` it neither said goodbye nor
    began recording its ending, and `recorded()` (its meta.json says the run ended) stayed False.
    True at once when the store does not answer: whoever hosted it is gone."""
    keys = [_KEY.format(0), _ENDED.format(0)]
    deadline = time.monotonic() + wait_s
    while True:
        if recorded():
            return False
        try:
            if any(store.check([k]) for k in keys):
                return False
        except Exception:
            return True
        if time.monotonic() >= deadline:
            return True
        time.sleep(0.05)
