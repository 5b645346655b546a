"""The guard's multi-rank side, shared by moeguard's trainer and GuardedStep (any loop under
torchrun): timed collectives, the decision agreement, per-rank timing windows (straggler
scores), the decision log, and the heartbeat pump that keeps a rank waiting in a collective alive.

Per step, every rank makes the same guard decision because every input is reduced first (loss,
router statistics and the slowest rank's data wait in the probe's one all-reduce; gradients by the
all-reduce / reduce-scatter). `Agreement` checks that cheaply: one MAX all-reduce of 4 int64s
carrying a fingerprint of the decision (and its negation, for the minimum) plus the operator
command rank 0 polled; unequal fingerprints mean the guard state diverged across ranks, and the
run halts before any rank applies anything.
"""

from __future__ import annotations

import os
import threading
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from guard.core import schema
from guard.core.commands import OPERATOR_ACTIONS, CommandInbox, OperatorCommand
from guard.core.events import Event
from guard.core.heartbeat import PHASE_TRAIN
from guard.core.policy import Decision
from guard.core.straggler import StragglerConfig, StragglerDetector

ENV_DECISION_LOG = (
    "MOEGUARD_DECISION_LOG"  # a directory: each rank appends its decisions there (tests, audits)
)


@dataclass(slots=True)
class Dist:
    rank: int = 0
    world: int = 1
    local_rank: int = 0

    @property
    def main(self) -> bool:
        return self.rank == 0


def dist_of_process_group() -> Dist:
    """This process's rank and world size (one rank when no process group is up)."""
    if dist.is_available() and dist.is_initialized():
        return Dist(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))
    return Dist()


# ---------------------------------------------------------------------------------------
# Timed collectives
# ---------------------------------------------------------------------------------------
class Comm:
    """The step's collectives, timed. Time inside them (waiting for peers included) is kept out
    of the rank's busy time, and a HeartbeatPump keeps beating while a rank is inside one."""

    def __init__(self, world: int) -> None:
        self.world = world
        self.wait_s = 0.0  # seconds inside collectives since the last take_wait()
        self.inside_since: float | None = None  # monotonic time the current collective began

    @contextmanager
    def timed(self) -> Iterator[None]:
        t0 = time.perf_counter()
        self.inside_since = time.monotonic()
        try:
            yield
        finally:
            self.inside_since = None
            self.wait_s += time.perf_counter() - t0

    def all_reduce(self, t: torch.Tensor, op: Any = None) -> None:
        with self.timed():
            dist.all_reduce(t, op=op if op is not None else dist.ReduceOp.SUM)

    def all_gather(self, t: torch.Tensor) -> torch.Tensor:
        """[world, *t.shape]: every rank's `t`, in rank order."""
        out = torch.empty(self.world * t.numel(), dtype=t.dtype, device=t.device)
        with self.timed():
            dist.all_gather_into_tensor(out, t.contiguous().reshape(-1))
        return out.reshape(self.world, *t.shape)

    def barrier(self) -> None:
        with self.timed():
            dist.barrier()

    def take_wait(self) -> float:
        w, self.wait_s = self.wait_s, 0.0
        return w


# ---------------------------------------------------------------------------------------
# Every rank agrees on the decision, and on the operator's command
# ---------------------------------------------------------------------------------------
def decision_fingerprint(d: Decision) -> int:
    """A 31-bit digest of everything in a decision that changes state on a rank."""
    key = (
        f"{d.action}|{d.lr_scale:.12g}|{d.grad_scale:.12g}|{sorted(d.bias_boost.items())}|"
        f"{sorted(d.aux_boost.items())}|{d.rollback_before}|{d.skip_batches}"
    )
    return zlib.crc32(key.encode()) & 0x7FFFFFFF


@dataclass(slots=True)
class Agreed:
    same: bool  # every rank computed the same decision
    command: str | None  # the operator command to apply at the next step (skip|rollback|halt)
    command_id: int
    actions: list[str] | None = None  # each rank's action, gathered only when they differ


class Agreement:
    """One MAX all-reduce per step of [fp, -fp, command code, command id] (int64)."""

    def __init__(self, comm: Comm, device: torch.device) -> None:
        self.comm = comm
        self.buf = torch.zeros(4, dtype=torch.int64, device=device)

    def sync(self, decision: Decision, command: OperatorCommand | None) -> Agreed:
        fp = decision_fingerprint(decision)
        code = (
            OPERATOR_ACTIONS.index(command.action) + 1
            if command and command.action in OPERATOR_ACTIONS
            else 0
        )
        cid = command.id if code else 0
        host = torch.tensor([fp, -fp, code, cid], dtype=torch.int64)
        self.buf.copy_(host)
        self.comm.all_reduce(self.buf, op=dist.ReduceOp.MAX)
        mx, neg_mn, code_r, cid_r = self.buf.cpu().tolist()
        same = mx == -neg_mn
        actions = None
        if not same:  # rare path: find out who decided what, for the event
            mine = torch.tensor(
                [schema.ACTIONS.index(decision.action)], dtype=torch.int64, device=self.buf.device
            )
            actions = [schema.ACTIONS[int(i)] for i in self.comm.all_gather(mine).reshape(-1).tolist()]
        return Agreed(same, OPERATOR_ACTIONS[code_r - 1] if code_r else None, int(cid_r), actions)


class DecisionLog:
    """Appends `step action fingerprint` per step to <dir>/decisions-r<rank>.txt when
    $MOEGUARD_DECISION_LOG names a directory (how the tests compare ranks' decisions)."""

    def __init__(self, rank: int) -> None:
        d = os.environ.get(ENV_DECISION_LOG, "")
        self.f = None
        if d:
            os.makedirs(d, exist_ok=True)
            self.f = open(os.path.join(d, f"decisions-r{rank}.txt"), "a", buffering=1)

    def write(self, line: str) -> None:
        if self.f is not None:
            self.f.write(line + "\n")

    def close(self) -> None:
        if self.f is not None:
            self.f.close()
            self.f = None


# ---------------------------------------------------------------------------------------
# Per-rank timing windows (straggler scores)
# ---------------------------------------------------------------------------------------
class RankWindow:
    """Busy time (step time minus time in collectives) and data wait of this rank, per step,
    summarised every `every` steps and gathered with ONE all_gather of 4 floats per rank."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.busy: list[float] = []
        self.wait: list[float] = []
        self.tokens = 0

    def record(self, busy_s: float, data_wait_s: float, tokens: int) -> None:
        self.busy.append(busy_s)
        self.wait.append(data_wait_s)
        self.tokens += tokens

    def due(self, steps_done: int) -> bool:
        return self.every > 0 and steps_done % self.every == 0 and bool(self.busy)

    def gather(self, comm: Comm, device: torch.device) -> np.ndarray:
        """[world, 4]: median busy s, best busy s, median data wait s, tokens, per rank."""
        mine = torch.tensor(
            [
                float(np.median(self.busy)),
                float(np.min(self.busy)),
                float(np.median(self.wait)),
                float(self.tokens),
            ],
            dtype=torch.float64,
        )
        self.busy, self.wait, self.tokens = [], [], 0
        return comm.all_gather(mine.to(device)).cpu().numpy()


# ---------------------------------------------------------------------------------------
# The multi-rank and operator side of one step
# ---------------------------------------------------------------------------------------
class StepSync:
    """What each step adds for multi-rank runs and operator commands, in step order:

        take_pending()      the command agreed at the previous step, for the guard to merge
                            (guard/core/commands.py) into this step's decision
        agree(...)          one MAX all-reduce: same decision everywhere (else halt); next command
        end_step(...)       busy time into the window; every N steps ONE all_gather -> scores

    Operator commands are polled on rank 0 only (into the guard's inbox) and ride in the
    agreement's all-reduce (no extra broadcast). In one process the same code runs without
    collectives."""

    def __init__(
        self,
        d: Dist,
        comm: Comm,
        device: torch.device,
        *,
        straggler_every: int,
        straggler_threshold: float,
        exporter: Any = None,
        commands: CommandInbox | None = None,
    ) -> None:
        self.dist, self.comm, self.device, self.exporter = d, comm, device, exporter
        self.inbox = commands if commands is not None else CommandInbox()  # the guard's
        multi = d.world > 1
        self.agreement = Agreement(comm, device) if multi else None
        self.window = RankWindow(straggler_every) if multi else None
        self.stragglers = StragglerDetector(StragglerConfig(threshold=straggler_threshold))
        self.straggler_score = float("nan")  # this rank's, from the last window
        self.pending: OperatorCommand | None = None  # agreed; merged at the next step
        self.log = DecisionLog(d.rank)
        self.vectors: dict[str, Any] | None = None  # rank 0: the last window's per-rank timing, unsent

    def take_pending(self) -> OperatorCommand | None:
        """The command every rank agreed on at the previous step (each is handed out once)."""
        cmd, self.pending = self.pending, None
        return cmd

    def _next_command(self) -> OperatorCommand | None:
        if self.exporter is not None:
            polled = self.exporter.poll_commands()  # no network call; also acknowledges them
            if self.dist.main:  # data parallel: a command acts on the whole job or not at all
                self.inbox.offer(polled)
        return self.inbox.next()

    def agree(self, step: int, d: Decision, events: list[Event]) -> Decision:
        """Every rank ends up with the same decision, or the run halts; the next command travels along."""
        cmd = self._next_command()
        fp = decision_fingerprint(d)
        if self.agreement is None:
            self.pending = cmd
            self.log.write(f"{step} {d.action} {fp:08x}")
            return d
        agreed = self.agreement.sync(d, cmd)
        self.log.write(f"{step} {d.action} {fp:08x}" + ("" if agreed.same else " DIVERGED"))
        if agreed.command is not None and agreed.command_id > self.inbox.applied_id:
            self.pending = OperatorCommand(agreed.command_id, agreed.command, cmd.reason if cmd else "")
        if agreed.same:
            return d
        # Different guard states on different ranks: applying anything could desynchronise the
        # replicas. Stop before any rank touches its weights, and page a human.
        ev = Event(
            step=step,
            kind=schema.EV_HALT,
            action=schema.ACT_HALT,
            detail={
                "severity": "critical",
                "reason": "guard decisions diverged across ranks",
                "actions_by_rank": agreed.actions,
            },
        )
        events.append(ev)
        return Decision(step=step, action=schema.ACT_HALT, verdicts=d.verdicts, events=[*d.events, ev])

    def end_step(
        self, step: int, busy_s: float, data_wait_s: float, tokens: int, store: Any = None
    ) -> list[Event]:
        """Record this rank's busy time; at a window's end gather every rank's summary, score,
        write the `ranks` rows (rank 0's store) and return straggler events."""
        if self.window is None:
            return []
        self.window.record(busy_s, data_wait_s, tokens)
        if not self.window.due(step + 1):
            return []
        g = self.window.gather(self.comm, self.device)  # [world, 4]: median busy, best busy, wait, tokens
        res = self.stragglers.update(step, g[:, 0], g[:, 2])
        self.straggler_score = float(res.relative_R[self.dist.rank])
        if self.dist.main:  # the job's per-rank vectors leave in rank 0's next batch (wire: `ranks`)
            self.vectors = {
                "step": step,
                "step_time_s": g[:, 0].tolist(),
                "data_wait_s": g[:, 2].tolist(),
                "tokens": g[:, 3].astype(np.int64).tolist(),
                "straggler_score": res.relative_R.tolist(),
            }
        if store is not None:
            w = self.dist.world
            store.add_rank_rows(
                {
                    "step": [step] * w,
                    "rank": list(range(w)),
                    "step_time_s": g[:, 0].tolist(),
                    "data_wait_s": g[:, 2].tolist(),
                    "straggler_score": res.relative_R.tolist(),
                    "tokens": g[:, 3].astype(np.int64).tolist(),
                }
            )
        return res.events

    def take_vectors(self) -> dict[str, Any] | None:
        """Rank 0: the per-rank vectors of a window that just ended (each handed out once)."""
        v, self.vectors = self.vectors, None
        return v

    def state_dict(self) -> dict[str, Any]:
        return {"stragglers": self.stragglers.state_dict()}

    def load_state_dict(self, s: dict[str, Any]) -> None:
        self.stragglers.load_state_dict(s.get("stragglers", {}))
        if "applied_command_id" in s:  # a checkpoint from before the guard kept it
            self.inbox.applied_id = max(self.inbox.applied_id, int(s["applied_command_id"]))


# ---------------------------------------------------------------------------------------
# Heartbeats that tell a hung rank from a waiting one
# ---------------------------------------------------------------------------------------
class HeartbeatPump:
    """Tells the collector that a rank blocked in a collective is waiting for a peer.

    Every `interval_s` it looks whether the rank has been inside one of the guard's collectives
    (Comm) for at least that long, and marks its beats `waiting` (the exporter's flag) until it
    leaves. The collector's RunStuck then names the ranks that stalled, not the thousands that wait
    for them (guard/core/progress.py `culprits`); if every stuck rank waits, a collective hangs and
    all are named. `beat_s`: also force a beat that often while waiting, for an exporter that
    sends no idle beats of its own (moeguard's trainer on rank 0, which beats with its reports);
    None when the exporter beats at its own bounded rate (issue #30: no storm of beats at 2 a
    second from every rank while one stalls). After `max_wait_s` inside one collective the
    forced beats stop, so a whole run wedged in one shows as lost too. Runs on one rank as well,
    where only `--inject hang@S:SECONDS` enters a (simulated) collective."""

    def __init__(
        self,
        comm: Comm,
        exporter: Any,
        interval_s: float = 0.5,
        max_wait_s: float = 300.0,
        beat_s: float | None = None,
    ) -> None:
        self.comm, self.exporter = comm, exporter
        self.interval_s, self.max_wait_s, self.beat_s = interval_s, max_wait_s, beat_s
        self._waiting = False
        self._last_forced = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="moeguard-heartbeat-pump", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self._tick(time.monotonic())
            except Exception:  # never let telemetry take the trainer down
                pass

    def _tick(self, now: float) -> None:
        since = self.comm.inside_since
        waiting = since is not None and now - since >= self.interval_s
        if waiting != self._waiting:
            self._waiting = waiting
            self.exporter.set_waiting(waiting)
        if waiting and self.beat_s is not None and now - since <= self.max_wait_s:  # type: ignore[operator]
            if now - self._last_forced >= self.beat_s:
                self._last_forced = now
                self.exporter.set_phase(PHASE_TRAIN)  # "a heartbeat goes out now"

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
