"""How a run ends: its meta.json status (guard/core/schema.py's RUN_STATUSES), the words in
meta.json["status_note"], and the process exit code; and the SIGTERM flag that ends it cleanly.

    finished             0    ran to cfg.train.steps
    finished_nonfinite   0    ran to the end, but the last updates were non-finite (weights unusable)
    running              0    stopped at `until` (a job's time slice), checkpointed; --resume continues
    halted               3    the guard (or an operator) halted it; checkpointed; --resume continues
    preempted          143    SIGTERM: checkpointed at the step boundary; --resume continues
    interrupted        130    Ctrl-C: stopped where it was, no new checkpoint
    crashed        (raises)   an exception; meta.json says which
    peer_lost      (raises)   a collective failed because a peer rank died (this rank did not crash)
"""

from __future__ import annotations

import signal
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from guard.core import schema
from guard.runtime.session import peer_failed

EXIT_HALTED = 3  # the guard halted the run (a checkpoint and a critical event were written)
# SIGTERM (preemption): checkpoint, then exit 128 + SIGTERM, what a process killed by SIGTERM reports.
# Not 0: Kubernetes Jobs, Slurm --requeue and torchrun restarts treat 0 as "done" and would not
# requeue a run that still has steps to go; 143 reads as "terminated", and --resume continues it.
EXIT_PREEMPTED = 128 + signal.SIGTERM
EXIT_INTERRUPTED = 128 + signal.SIGINT  # Ctrl-C (the shell's convention)
EXIT_CRASHED = 1  # only what meta.json records: the exception propagates


@dataclass(slots=True)
class Ending:
    status: str  # meta.json["status"]
    code: int  # the process exit code
    note: str = ""  # meta.json["status_note"]


def _name(checkpoint: Path | None, missing: str) -> str:
    return checkpoint.name if checkpoint is not None else missing


def halted(step: int, why: str, checkpoint: Path | None) -> Ending:
    return Ending(
        schema.STATUS_HALTED,
        EXIT_HALTED,
        f"halted at step {step}: {why}; checkpoint {_name(checkpoint, '-')}; "
        "look at the halt event, then continue with --resume",
    )


def preempted(step: int, checkpoint: Path | None) -> Ending:
    return Ending(
        schema.STATUS_PREEMPTED,
        EXIT_PREEMPTED,
        f"SIGTERM (preemption): stopped after step {step} with checkpoint {_name(checkpoint, '-')}; "
        "continue with --resume",
    )


def nonfinite(since: int, updates: int) -> Ending:
    return Ending(
        schema.STATUS_FINISHED_NONFINITE,
        0,
        f"loss/grad norm non-finite from step {since} to the end ({updates} non-finite updates applied): "
        "the weights are not usable; rerun from a checkpoint before that step with the guard on",
    )


def interrupted(step: int, checkpoint: Path | None) -> Ending:
    note = f"interrupted (Ctrl-C / SIGINT) during step {step}; newest checkpoint: {_name(checkpoint, 'none yet')}"
    return Ending(
        schema.STATUS_INTERRUPTED, EXIT_INTERRUPTED, note + ("; continue with --resume" if checkpoint else "")
    )


def crashed(step: int, e: BaseException) -> Ending:
    """An exception ended the run; when it only says a peer rank is gone, the run is peer_lost (this
    rank says goodbye, so only the rank that died is paged lost: issue #37)."""
    if peer_failed(e):
        return Ending(
            schema.STATUS_PEER_LOST,
            EXIT_CRASHED,
            f"stopped during step {step}: a collective failed because a peer rank is gone: {e}"[:500],
        )
    return Ending(
        schema.STATUS_CRASHED, EXIT_CRASHED, f"crashed during step {step}: {type(e).__name__}: {e}"[:500]
    )


class Preemption:
    """SIGTERM (a scheduler preempting the job; torchrun forwards it to every rank and waits 30 s
    before SIGKILL) only sets `requested`: the loop finishes the step, checkpoints and exits.
    With several ranks the flag rides in the step's all-reduce, and `agreed` says every rank stops
    at the same step."""

    def __init__(self) -> None:
        self.requested = False  # SIGTERM arrived here (set by the handler)
        self.agreed = False  # the step's verdict: stop now (every rank saw a request)
        self._previous: Any = None
        self._installed = False

    def install(self, *, can_agree: bool) -> None:
        """Catch SIGTERM, except off the main thread, or where no per-step all-reduce could carry
        the flag to every rank (`can_agree` False: multi-rank with telemetry off)."""
        if threading.current_thread() is not threading.main_thread() or not can_agree:
            return

        def on_sigterm(signum: int, frame: Any) -> None:
            self.requested = True

        self._previous = signal.signal(signal.SIGTERM, on_sigterm)
        self._installed = True

    def uninstall(self) -> None:
        if self._installed and self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
        self._installed = False
