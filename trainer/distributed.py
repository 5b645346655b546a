"""Multi-rank plumbing of the training loop (torchrun / torch.distributed; gloo on CPU, NCCL on GPU).

Parallel modes (`[train] parallel`):
    ddp   every rank holds the whole model; after backward the gradients are averaged with ONE
          coalesced all-reduce (`allreduce_grads`). This is data parallelism as DDP does it, but
          not torch's DistributedDataParallel wrapper, on purpose:
            * a faulty rank's gradient can be injected before the reduction (drills);
            * the time a rank waits for its peers is measured apart from its own work (DDP hides
              the wait inside backward), which straggler scores need;
            * no `find_unused_parameters` graph walk, no buffer broadcast, no `no_sync()` for
              gradient accumulation.
          Cost: no overlap of communication with backward. That matters at GPU scale (use fsdp
          there: FSDP2 overlaps its reduce-scatter with backward); on CPU/gloo it does not.
    fsdp  FSDP2: `fully_shard` on every block, then the root. Parameters, gradients and
          optimizer state are DTensor shards; the probe sums squared gradient norms across
          ranks, so the per-layer norms are the full ones. The collectives run inside
          forward/backward, so per-rank busy time (straggler score) cannot leave out the time a
          rank waited for peers there: scores under fsdp only see data-loading stragglers well.
    none  one process; WORLD_SIZE > 1 is refused.

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
from torch import nn

from guard.core import schema
from guard.core.commands import OPERATOR_ACTIONS, CommandInbox, OperatorCommand
from guard.core.events import Event
from guard.core.heartbeat import PHASE_TRAIN
from guard.core.policy import Decision
from guard.core.straggler import StragglerConfig, StragglerDetector
from guard.core.tomlconf import ConfigError

ENV_RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"  # set by torchrun: 0 first, then 1, 2, ... per restart
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


def setup_distributed(device_pref: str) -> tuple[Dist, torch.device]:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    use_cuda = device_pref == "cuda" or (device_pref == "auto" and torch.cuda.is_available())
    if device_pref == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device = 'cuda': no CUDA device is available (use 'auto' or 'cpu')")
    d = Dist()
    if world > 1:
        if not dist.is_initialized():
            backend = "nccl" if use_cuda else "gloo"
            if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
                _init_in_agent_store(backend, world)
            else:
                dist.init_process_group(backend=backend)
        d = Dist(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")))
    if use_cuda:
        torch.cuda.set_device(d.local_rank)
        return d, torch.device("cuda", d.local_rank)
    return d, torch.device("cpu")


def _init_in_agent_store(backend: str, world: int) -> None:
    """Under torchrun, join the agent's store with a key prefix per restart attempt.

    With torch 2.13 + gloo, `init_process_group("env://")` after a torchrun restart reads the
    peers' addresses of the previous attempt from the agent's store and fails ("Gloo
    connectFullMesh failed ... Connection refused"); a prefix per attempt keeps each attempt's
    rendezvous keys apart (checked by tests/trainer/test_distributed.py's restart test)."""
    import datetime

    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        world,
        is_master=False,
        timeout=datetime.timedelta(seconds=300),
    )
    prefixed = dist.PrefixStore(f"moeguard/attempt_{restart_count()}", store)
    dist.init_process_group(backend=backend, store=prefixed, rank=int(os.environ["RANK"]), world_size=world)


def resolve_parallel(mode: str, world: int) -> str:
    """The mode that actually runs: one process needs none of them."""
    if world == 1:
        return "none"
    if mode == "none":
        raise ConfigError(f"train.parallel = 'none' but WORLD_SIZE = {world}; use 'ddp' or 'fsdp'")
    return mode


def restart_count() -> int:
    """How many times torchrun restarted this job (0 outside torchrun)."""
    try:
        return int(os.environ.get(ENV_RESTART_COUNT, "0"))
    except ValueError:
        return 0


def shard_fsdp(model: nn.Module) -> None:
    """FSDP2: shard every transformer block, then the root (embeddings, final norm, head)."""
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a DTensor (FSDP2 shard), or the tensor itself."""
    return t.to_local() if hasattr(t, "to_local") else t


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


def allreduce_grads(params: list[torch.nn.Parameter], world: int, comm: Comm | None = None) -> None:
    """Average gradients across ranks in one coalesced call (a parameter without a gradient this
    step gets zeros, so every rank flattens the same layout)."""
    grads = []
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    flat = torch._utils._flatten_dense_tensors(grads)
    if comm is not None:
        comm.all_reduce(flat)
    else:
        dist.all_reduce(flat)
    flat /= world
    for g, r in zip(grads, torch._utils._unflatten_dense_tensors(flat, grads), strict=True):
        g.copy_(r)


# ---------------------------------------------------------------------------------------
# Every rank agrees on the decision, and on the operator's command
# ---------------------------------------------------------------------------------------
def decision_fingerprint(d: Decision) -> int:
    """A 31-bit digest of everything in a decision that changes state on a rank."""
    key = (
        f"{d.action}|{d.lr_scale:.12g}|{sorted(d.bias_boost.items())}|{sorted(d.aux_boost.items())}|"
        f"{d.rollback_before}|{d.skip_batches}"
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
    """Beats for a rank that is blocked in a collective, i.e. waiting for a peer.

    The trainer's exporters send no idle heartbeats: a beat goes out with each step's report, so
    a rank stuck in its own code (a hung data loader, a wedged kernel launch) goes silent and the
    collector names it (HeartbeatLost{rank}). Its peers block in the next collective; this thread
    keeps them beating while they wait. If every rank is stuck inside a collective (a hung
    all-reduce), they beat without advancing: the collector's progress deadline pages RunStuck
    naming the phase and the ranks (guard/core/progress.py); after `max_wait_s` they go silent and the
    whole run shows as lost too. Runs on one rank as well, where only `--inject hang@S:SECONDS`
    enters a (simulated) collective."""

    def __init__(self, comm: Comm, exporter: Any, interval_s: float = 0.5, max_wait_s: float = 300.0) -> None:
        self.comm, self.exporter = comm, exporter
        self.interval_s, self.max_wait_s = interval_s, max_wait_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="moeguard-heartbeat-pump", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            since = self.comm.inside_since
            if since is not None and self.interval_s <= time.monotonic() - since <= self.max_wait_s:
                try:
                    self.exporter.set_phase(PHASE_TRAIN)  # "a heartbeat goes out now"
                except Exception:  # never let telemetry take the trainer down
                    pass

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=2)
