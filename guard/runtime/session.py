"""The run around a GuardedStep: what moeguard's trainer does for its own runs, for any loop.

    session = RunSession(run_dir, collector=URL, rank=r, world=w, meta=...)   # meta.json, exporter
    session.step(report, events, ranks=...)                               # store (rank 0) + stream
    session.phase(PHASE_DATA) ... session.phase(PHASE_TRAIN)               # carried by the next beat
    session.finish(status, note, counts=..., guard_actions=..., goodput=...)

It owns the run store (rank 0), the exporter (every rank: guard/runtime/service.py, the trainer's
own; rank 0 sends the full reports, the others their own timing), meta.json with the environment
fingerprint, and how the run ended: `ending()` maps how the process is leaving (normal close,
SIGTERM, Ctrl-C, an exception, exit without close) to a run status, so a third-party run ends
in the app, the collector and Prometheus exactly as a `moeguard train` run does.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch

from guard.core import schema
from guard.core.events import Event
from guard.core.heartbeat import PHASE_TRAIN
from guard.core.report import StepReport
from guard.runtime.envinfo import fingerprint
from guard.runtime.goodbye import Goodbyes
from guard.runtime.peak import peak_flops
from guard.runtime.record import RunRecord, summary_lines
from guard.runtime.service import default_beat_s, make_exporter
from guard.store.reader import read_meta
from guard.store.runstore import RunStore
from guard.store.writer import truncate_after

EXIT_PREEMPTED = 128 + signal.SIGTERM  # what a process killed by SIGTERM reports: schedulers requeue it


class Preempted(SystemExit):
    """Raised in the main thread by SIGTERM while a GuardedStep is open: the loop unwinds through
    its `finally`/`with`, close() records the run as preempted, the process exits 143."""

    def __init__(self) -> None:
        super().__init__(EXIT_PREEMPTED)


# What a collective raises on this rank when a PEER rank died (gloo reads a reset connection;
# NCCL and the c10d store raise DistBackendError / DistNetworkError).
PEER_GONE = ("Connection reset by peer", "Connection closed by peer", "Broken pipe")


def peer_failed(exc: BaseException | None) -> bool:
    """This rank failed only because another rank is gone (its collective lost the peer)."""
    import torch.distributed as dist

    if isinstance(exc, dist.DistBackendError | dist.DistNetworkError):
        return True
    return isinstance(exc, RuntimeError) and any(s in str(exc) for s in PEER_GONE)


def ending(exc: BaseException | None) -> tuple[str, str]:
    """(run status, note) for a run whose process is leaving with `exc` propagating (None: a
    normal close)."""
    if peer_failed(exc):
        return schema.STATUS_PEER_LOST, f"a collective failed because a peer rank is gone: {exc}"[:500]
    if exc is None:
        return schema.STATUS_FINISHED, ""
    if isinstance(exc, Preempted):
        return schema.STATUS_PREEMPTED, "SIGTERM (preemption): stopped; the framework's checkpoint resumes it"
    if isinstance(exc, KeyboardInterrupt):
        return schema.STATUS_INTERRUPTED, "interrupted (Ctrl-C / SIGINT)"
    if isinstance(exc, SystemExit) and exc.code in (0, None):
        return schema.STATUS_FINISHED, ""
    return schema.STATUS_CRASHED, f"crashed: {type(exc).__name__}: {exc}"[:500]


def compute_dtype(model: torch.nn.Module, device: torch.device) -> torch.dtype:
    """The dtype MFU is measured against: bf16 on an accelerator (mixed precision, torchtitan's
    convention: its MFU uses the bf16 dense peak too), the parameters' own dtype on a CPU."""
    if device.type != "cpu":
        return torch.bfloat16
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


AUTOCAST_LABELS = {torch.bfloat16: "bf16-autocast", torch.float16: "fp16-autocast"}  # moeguard train's words


def dtype_label(model: torch.nn.Module, autocast: torch.dtype | None = None) -> str:
    """meta.json env "dtype": what the step computes in, so Compare tells bf16 and fp32 runs apart:
    the autocast dtype ("bf16-autocast", as `moeguard train` writes it) when the forward runs under
    torch.autocast, else the parameters' own dtype ("float32")."""
    if autocast is not None:
        return AUTOCAST_LABELS.get(autocast, f"{str(autocast).removeprefix('torch.')}-autocast")
    p = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return str(p).removeprefix("torch.")


def framework_of(model: torch.nn.Module) -> str:
    """The framework whose model this is (meta.json["framework"]: RunHalted says how to resume
    it): transformers or torchtitan by the module of a class it is made of (FSDP's wrapper class
    derives from the model's), else plain PyTorch."""
    for cls in type(model).__mro__:
        top = cls.__module__.split(".", 1)[0]
        if top in (schema.FRAMEWORK_TRANSFORMERS, schema.FRAMEWORK_TORCHTITAN):
            return top
    return schema.FRAMEWORK_PYTORCH


def attention_backend_of(model: torch.nn.Module) -> str:
    """What attention the model runs: transformers' `_attn_implementation`, torchtitan's inner
    attention class, or 'unknown'."""
    impl = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if isinstance(impl, str) and impl:
        return impl
    for name, m in model.named_modules():
        if name.endswith("inner_attention"):
            return type(m).__name__
    return "unknown"


class RunSession:
    def __init__(
        self,
        run_dir: Path | None,
        *,
        collector: str | None,
        rank: int,
        world: int,
        model: torch.nn.Module,
        device: torch.device,
        flops_per_token: float | None,
        meta: dict[str, Any],
        started_at: float | None = None,
        autocast: torch.dtype | None = None,
    ) -> None:
        """`meta`: what the caller knows of the run (integration, guard config); the session adds
        the run id, status, start time, the environment fingerprint and the FLOP accounting.
        `started_at`: when this process's training began (default now); `autocast`: the dtype the
        forward runs in under torch.autocast, when the caller knows it (see dtype_label)."""
        self.run_dir, self.rank, self.world = run_dir, rank, world
        self.started_at = started_at if started_at is not None else time.time()
        dtype = compute_dtype(model, device)
        self.peak, peak_source = peak_flops(device, dtype)
        self.flops_per_token = flops_per_token
        self.env = fingerprint(
            device=device,
            dtype=dtype_label(model, autocast),
            peak_flops=self.peak,
            peak_source=peak_source,
            attention_backend=attention_backend_of(model),
            expert_kernel="framework",
            compile=False,
            world_size=world,
            code_dir=Path.cwd(),
        )
        store = RunStore(run_dir) if run_dir is not None and rank == 0 else None
        exporter = None
        if run_dir is not None:
            exporter = make_exporter(
                collector=collector,
                otlp_endpoint=os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT") or None,
                run_id=run_dir.name,
                run_dir=run_dir,
                rank=rank,
                trainer_detectors=True,
                heartbeat_s=default_beat_s(),
                world=world,
            )
        self.exporter = exporter
        self.record = RunRecord(run_dir or Path("."), store, exporter, rank=rank)
        before = (read_meta(run_dir) or {}) if store is not None else {}
        self.meta = {
            "run_id": run_dir.name if run_dir is not None else "",
            "status": schema.STATUS_RUNNING,
            # a relaunch into the same folder (a framework's resume) keeps the run's first start
            "started_at": before.get("started_at", self.started_at),
            "restarts": before.get("restarts", 0),
            "env": self.env,
            "flops_per_token": flops_per_token,
            "framework": framework_of(model),
            **meta,
        }
        self.record.started(self.meta, restarted=False)
        if exporter is not None:
            self.record.announce(lambda: self.meta)
        self.closed = False
        self._first_step = True
        self._sigterm_prev: Any = None
        self._sigterm = False  # a SIGTERM reached the session's handler
        # multi-rank: say goodbye in the job's store on SIGTERM, and ask who else did (goodbye.py)
        self.goodbyes = Goodbyes.for_job(rank, world)
        self._install_sigterm()
        atexit.register(self._at_exit)

    @property
    def store(self) -> RunStore | None:
        return self.record.store

    # ---- per step ----------------------------------------------------------------------------
    def mfu(self, tokens_per_s: float) -> float:
        """Model FLOPs utilisation against the devices' summed peak (the trainer's definition)."""
        if not self.peak or not self.flops_per_token:
            return float("nan")
        return self.flops_per_token * tokens_per_s / (self.peak * self.world)

    def step(self, rep: StepReport, events: list[Event], ranks: dict[str, Any] | None = None) -> None:
        if self._first_step:
            self._first_step = False
            if rep.step == 0 and self.store is not None and self.run_dir is not None:
                # A relaunch into this folder that resumed nothing (killed before its first
                # checkpoint): the earlier attempt's rows would mix with these (steps 0,1,2,0,1,2).
                if dropped := truncate_after(self.run_dir, -1):
                    self.store.add_event(
                        Event(
                            step=0, kind=schema.EV_RESUME, detail={"rows_dropped": dropped, "checkpoint": ""}
                        )
                    )
        self.record.step(rep, events, ranks)

    def phase(self, phase: str, *, beat: bool = False) -> None:
        """The rank's phase, carried by its next beat (`beat=True`: a beat goes out now)."""
        if self.exporter is not None:
            self.exporter.set_phase(phase, beat=beat)

    def resumed(self, step: int, checkpoint: str = "", **detail: Any) -> None:
        """The loop restored a checkpoint at `step`: rows after it are dropped (they are written
        again), meta.json counts the restart, a resume event says from where."""
        self._first_step = False
        if self.run_dir is not None:
            where = Path(checkpoint or "the loop's own checkpoint")
            self.record.resumed(step, where, self.env, lambda: self.meta, **detail)

    def computes_in(self, autocast: torch.dtype) -> None:
        """The forward was seen running under torch.autocast(dtype=...): meta.json's env says so."""
        label = dtype_label(torch.nn.Module(), autocast)
        if self.env.get("dtype") == label:
            return
        self.env["dtype"] = label
        if self.store is not None:
            self.store.update_meta(env=self.env)
        self.record.announce(lambda: self.meta)

    def checkpoint_starts(self) -> None:
        self.record.checkpoint_starts()

    def checkpoint_saved(self, step: int, path: Path, goodput: Any) -> None:
        self.record.checkpoint_saved(step, path, goodput)
        self.phase(PHASE_TRAIN, beat=True)

    # ---- the end -----------------------------------------------------------------------------
    def finish(self, status: str, note: str, **fields: Any) -> None:
        """meta.json says how the run ended; the exporter sends its last batch (a final one unless
        it crashed: a crashed run's silence must page)."""
        if self.closed:
            return
        self.closed = True
        atexit.unregister(self._at_exit)
        # A SIGTERM now (torchrun stopping the other ranks after one failed) must not cut the
        # record of how the run ended short: it is held until meta.json and the last batch are out.
        held = self._hold_sigterm()
        try:
            status, note = self._judge(status, note)
            self.record.finish(status, note, **fields)
        finally:
            self._uninstall_sigterm()
            if self.goodbyes is not None:
                self.goodbyes.close()
            if held is not None and held[0]:
                os.kill(os.getpid(), signal.SIGTERM)  # delivered now, to whoever handles it

    def _judge(self, status: str, note: str) -> tuple[str, str]:
        """A SIGTERM ending in a multi-rank job: preempted when every peer said goodbye too (the
        whole job was stopped), peer_lost naming the ranks that did not (torchrun stopping the
        survivors of a rank that died: issue #37). A collective that lost its peer after a SIGTERM
        every peer had too is the same preemption (the peer just left first)."""
        g = self.goodbyes
        if g is None:
            return status, note
        sigterm = self._sigterm or g.sigterm.is_set()
        if status == schema.STATUS_PREEMPTED or (status == schema.STATUS_PEER_LOST and sigterm):
            silent = g.silent_peers()
            if silent:
                ranks = ", ".join(map(str, silent))
                return schema.STATUS_PEER_LOST, (
                    f"rank {ranks} said no goodbye (killed, or hung) when this rank got SIGTERM "
                    f"(torchrun stops the survivors when a rank dies); {note}"
                )[:500]
            if status == schema.STATUS_PEER_LOST:
                return schema.STATUS_PREEMPTED, (
                    "SIGTERM (preemption) reached every rank; a peer left first. " + ending(Preempted())[1]
                )
        return status, note

    def summary(self, **fields: Any) -> list[str]:
        if self.run_dir is None or self.rank != 0:
            return []
        return summary_lines(self.run_dir, **fields)

    def _at_exit(self) -> None:
        """The process leaves without close(): an uncaught exception (sys.last_value) or a loop
        that never closed. Either way meta.json must not say running forever."""
        if self.closed:
            return
        exc = getattr(sys, "last_value", None)
        if exc is None and self._sigterm:  # Preempted is a SystemExit: it leaves no last_value
            exc = Preempted()
        status, note = ending(exc)
        if exc is None:
            status, note = schema.STATUS_CRASHED, "the process exited without GuardedStep.close()"
        self.finish(status, note)

    def _install_sigterm(self) -> None:
        """SIGTERM raises Preempted in the main thread (only where nobody else handles SIGTERM)."""
        if threading.current_thread() is not threading.main_thread():
            return
        if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
            return  # the framework or the user handles it; their handler decides

        def on_sigterm(signum: int, frame: Any) -> None:
            self._sigterm = True
            if self.goodbyes is not None:
                self.goodbyes.heard_sigterm()
            raise Preempted()

        self._sigterm_prev = signal.signal(signal.SIGTERM, on_sigterm)

    def _hold_sigterm(self) -> list[bool] | None:
        """Defer SIGTERM (main thread only); the list says whether one arrived meanwhile."""
        if threading.current_thread() is not threading.main_thread():
            return None
        got = [False]

        def hold(signum: int, frame: Any) -> None:
            got[0] = True

        prev = signal.signal(signal.SIGTERM, hold)
        if self._sigterm_prev is None:
            self._sigterm_prev = prev
        return got

    def _uninstall_sigterm(self) -> None:
        if self._sigterm_prev is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, self._sigterm_prev)
            self._sigterm_prev = None
