"""Transient vs reproducible faults (`[guard.rerun]`, off by default; Megatron-LM's rerun state
machine, done in-job).

When a step's verdicts include a detector of `guard.rerun.on` (non-finite values, a grad-norm or
loss spike), the step is computed again before anything is applied: the same micro-batches, from
the same weights (the optimizer has not stepped), gradients from zero, router statistics from
zero, the RNG and the probe's window as the first pass found them. Then:

    the recompute disagrees (finite vs not, or     a one-off corruption: a suspected hardware
      loss or grad norm apart by > rel_tol)          fault (silent data corruption, a flipped bit).
                                                    The guard's state is put back as it was before
                                                    the step and the clean recompute is judged and
                                                    applied as if the first pass never happened
    the recompute agrees                            the data or the optimisation: the guard's
                                                    decision stands (skip, rollback, ...)

Either way one `rerun` event records it (schema.EV_RERUN; its detector is the classification,
schema.RERUN_TRANSIENT or RERUN_REPRODUCIBLE; its detail names the rank(s), both passes' loss and
grad norm and what was applied). The collector counts the transient ones per rank
(moeguard_suspected_hardware_faults_total), and SuspectedHardwareFault pages.

Multi-rank: every rank reruns together when any flags (one MAX all-reduce of a flag per step), so
the collectives inside the recompute line up; the classification compares reduced values, the same
on every rank. Which rank diverged is found from each rank's own loss and, under ddp, its gradient
norm before the reduction, summed in one all-reduce on a rerun step. Under fsdp the gradients are
reduce-scattered inside backward, so only a divergence of the forward (the loss) names its rank;
otherwise the event says rank -1 (unknown). The recompute's decision is checked across ranks
(fingerprints, one all-reduce); if it differed, the first pass's agreed decision stands.

Cost: a flagged step runs its forward/backward, the probe and the guard twice (2.2-2.3x that step);
every step, when enabled, pickles the guard's state (to put it back; 0.05-0.5 ms of host time) and,
with several ranks, adds the flag's all-reduce and (ddp) one norm over this rank's gradients
(bench/overhead/rerun_overhead.py, docs/BENCHMARKS.md).
Known approximation: with `guard.precursor.adam_v_ratio` on, a rerun step's second-moment ratio
enters its running median twice.
"""

from __future__ import annotations

import math
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from guard.core import schema
from guard.core.config import RerunConfig
from guard.core.events import Event
from guard.core.policy import Decision
from guard.core.report import StepReport
from guard.runtime.guard import Guard
from guard.runtime.probe import Probe, ProbeResult
from trainer.distributed import decision_fingerprint, local
from trainer.train_module import TrainModule

# Precursor fields measured from the previous update, not from this step's gradients: the
# recompute cannot measure them again (the sampler hands its sums out once), so it carries them.
# The max attention logit is this step's, but sampled on every k-th collect only: the recompute's
# collect is off-sample (or shifted), so the first pass's sample is kept too.
_CARRIED_PRECURSORS = (
    "update_ratio",
    "update_ratio_L",
    "group_update_ratio_G",
    "adam_v_ratio",
    "max_logit",
    "max_logit_L",
)


@dataclass(frozen=True, slots=True)
class Pass:
    loss: float
    grad_norm: float


def rel_diff(a: float, b: float) -> float:
    """|a - b| relative to the larger; inf when one is finite and the other not; 0 when neither is
    (NaN twice, or the same infinity, is the same answer)."""
    fa, fb = math.isfinite(a), math.isfinite(b)
    if fa != fb:
        return math.inf
    if not fa:
        return 0.0 if (math.isnan(a) and math.isnan(b)) or a == b else math.inf
    scale = max(abs(a), abs(b))
    return abs(a - b) / scale if scale > 0 else 0.0


def classify(first: Pass, second: Pass, rel_tol: float) -> tuple[str, float]:
    """(schema.RERUN_TRANSIENT or RERUN_REPRODUCIBLE, the larger relative difference)."""
    diff = max(rel_diff(first.loss, second.loss), rel_diff(first.grad_norm, second.grad_norm))
    return (schema.RERUN_TRANSIENT if diff > rel_tol else schema.RERUN_REPRODUCIBLE), diff


@dataclass(slots=True)
class Rerun:
    """What the step goes on with after a rerun."""

    decision: Decision
    events: list[Event]
    probe: ProbeResult
    report: StepReport
    line: str  # for the console


class RerunCheck:
    """The trainer's rerun check; every method is a no-op (or False) when `cfg.enabled` is off."""

    def __init__(
        self, cfg: RerunConfig, guard: Guard, probe: Probe, module: TrainModule, *, rank: int
    ) -> None:
        """`module`: the model side (its optimizer, parameters, collectives and parallel mode)."""
        self.cfg, self.guard, self.probe, self.module = cfg, guard, probe, module
        self.rank, self.world = rank, module.world
        # this rank's gradients exist apart from its peers' before the reduction under ddp only
        # (fsdp reduce-scatters them inside backward)
        self.local_grads = module.parallel == "ddp"
        self.enabled = cfg.enabled
        self._guard_state = b""
        self._probe_state: dict[str, Any] = {}
        self._rng: tuple[torch.Tensor, list[torch.Tensor]] | None = None
        self._local: list[torch.Tensor] = []  # [loss, grad norm] of this rank, per pass (several ranks)

    def remember(self) -> None:
        """At the start of a step: what a recompute must start from."""
        if not self.enabled:
            return
        # pickled, not deep-copied: 10x cheaper for the calibrated detectors' tail memories
        self._guard_state = pickle.dumps(self.guard.state_dict(), protocol=pickle.HIGHEST_PROTOCOL)
        self._probe_state = self.probe.state_dict()
        cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []
        self._rng = (torch.get_rng_state(), cuda)
        self._local = []

    def note_local(self, loss_sum: torch.Tensor) -> None:
        """After backward and before the reduction: this rank's own numbers (several ranks only;
        kept on the device, read on a rerun step only)."""
        if not self.enabled or self.world == 1:
            return
        gn = loss_sum.new_zeros(())
        if self.local_grads:
            grads = [local(p.grad) for p in self.module.params if p.grad is not None]
            if grads:
                gn = torch.stack(torch._foreach_norm(grads)).float().norm()
        self._local.append(torch.stack([loss_sum.detach().float().reshape(()), gn]))

    def wanted(self, d: Decision) -> bool:
        """Whether to rerun this step: one of its verdicts is in `on` on any rank (agreed)."""
        if not self.enabled or d.halt:  # a halt is the same on every rank (agreed before this)
            return False
        mine = any(v.detector in self.cfg.on for v in d.verdicts)
        if self.world == 1:
            return mine
        flag = torch.tensor([float(mine)], device=self.probe.device)
        self.module.comm.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item() > 0)

    def check(
        self,
        d: Decision,
        events: list[Event],
        first: tuple[ProbeResult, StepReport],
        recompute: Callable[[], ProbeResult],
        report: Callable[[ProbeResult], StepReport],
        observe: Callable[[StepReport], Decision],
    ) -> Rerun:
        """Recompute the step (`recompute`: forward/backward, reduction, probe), classify, and
        return what the step goes on with. `report` builds a StepReport from a ProbeResult;
        `observe` asks the guard for a decision on one."""
        pr, rep = first
        self._reset()
        pr2 = recompute()
        pr2.precursors.update({k: pr.precursors[k] for k in _CARRIED_PRECURSORS if k in pr.precursors})
        rep2 = report(pr2)
        a, b = Pass(pr.loss, pr.grad_norm), Pass(pr2.loss, pr2.grad_norm)
        kind, diff = classify(a, b, self.cfg.rel_tol)
        ranks = self._diverged_ranks() if kind == schema.RERUN_TRANSIENT else []
        detail: dict[str, Any] = {
            "flagged_by": sorted({v.detector for v in d.verdicts if v.detector in self.cfg.on}),
            "first": {"loss": a.loss, "grad_norm": a.grad_norm},
            "recompute": {"loss": b.loss, "grad_norm": b.grad_norm},
            "rel_tol": self.cfg.rel_tol,
        }
        out = Rerun(d, events, pr, rep, "")
        if kind == schema.RERUN_TRANSIENT:
            self.guard.load_state_dict(pickle.loads(self._guard_state))  # as if the first pass never ran
            d2 = observe(rep2)
            if not self._same_everywhere(d2):  # guard states differ across ranks: stop, as StepSync does
                d2 = _diverged(d2)
            out = Rerun(d2, list(d2.events), pr2, rep2, "")
            detail["applied"] = f"the clean recompute, judged afresh: {d2.action}"
            rank = ranks[0] if len(ranks) == 1 else -1
            detail.update(rank=rank, ranks=ranks, severity="critical")
            out.line = (
                f"guard step {d.step}: suspected hardware fault on rank {rank if rank >= 0 else '?'}: "
                f"the recompute disagreed (loss {a.loss:.4g} vs {b.loss:.4g}, grad norm {a.grad_norm:.4g} "
                f"vs {b.grad_norm:.4g}); applied {detail['applied']}"
            )
        else:
            detail.update(applied=f"the guard's decision stands: {d.action}", severity="warning")
            out.line = f"guard step {d.step}: rerun reproduced the fault (data or optimisation): {d.action}"
        detail["classification"] = kind
        ev = Event(
            step=d.step,
            kind=schema.EV_RERUN,
            detector=kind,
            value=diff,
            threshold=self.cfg.rel_tol,
            action=out.decision.action,
            detail=detail,
        )
        out.events.append(ev)  # what is recorded
        out.decision.events.append(ev)  # what the decision says it saw
        return out

    # ---- the pieces ---------------------------------------------------------------------------
    def _reset(self) -> None:
        """Back to the state the first pass started from (the weights never changed)."""
        self.module.opt.zero_grad(set_to_none=True)
        self.probe.reset_router_stats()
        self.probe.load_state_dict(self._probe_state)
        if self._rng is not None:
            cpu, cuda = self._rng
            torch.set_rng_state(cpu)
            if cuda:
                torch.cuda.set_rng_state_all(cuda)

    def _diverged_ranks(self) -> list[int]:
        """The ranks whose own loss or gradient norm changed between the passes ([0] alone)."""
        if self.world == 1:
            return [0]
        if len(self._local) < 2:
            return []
        a, b = (t.double().cpu().tolist() for t in self._local[:2])
        mine = any(rel_diff(x, y) > self.cfg.rel_tol for x, y in zip(a, b, strict=True))
        onehot = torch.zeros(self.world, device=self.probe.device)
        onehot[self.rank] = float(mine)
        self.module.comm.all_reduce(onehot)
        return [int(r) for r in torch.nonzero(onehot > 0).reshape(-1).tolist()]

    def _same_everywhere(self, d: Decision) -> bool:
        """Whether every rank reached decision `d` on the recompute (one MAX all-reduce of its
        fingerprint and its negation; trivially true on one rank)."""
        if self.world == 1:
            return True
        fp = decision_fingerprint(d)
        buf = torch.tensor([fp, -fp], dtype=torch.int64, device=self.probe.device)
        self.module.comm.all_reduce(buf, op=dist.ReduceOp.MAX)
        mx, neg_mn = buf.cpu().tolist()
        return mx == -neg_mn


def _diverged(d: Decision) -> Decision:
    ev = Event(
        step=d.step,
        kind=schema.EV_HALT,
        action=schema.ACT_HALT,
        detail={"severity": "critical", "reason": "guard decisions diverged across ranks on a rerun"},
    )
    return Decision(step=d.step, action=schema.ACT_HALT, verdicts=d.verdicts, events=[*d.events, ev])
