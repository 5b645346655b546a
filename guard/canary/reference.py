"""The canary's yardstick on a CPU: a fixed numpy workload timed in this thread's CPU time, right
beside the training steps it normalises, so a neighbour that slows the core slows both alike.

Two users:
- moeguard's canary worker (trainer/canary_worker.py) times `Reference` after every step;
- a training command the canary runs (`moeguard canary --ab --script/--torchtitan`, guard/canary/
  own.py) gets $MOEGUARD_CANARY_REFERENCE, and GuardedStep (rank 0, on a CPU) times `Yardstick`
  after every step and appends it to the run's `canary-reference.jsonl` (`ReferenceLog`); own.py
  reads it back (`read_reference`), takes its CPU time out of the command's sampled CPU time and
  divides the neighbour out as the worker does.

numpy, not torch, on purpose: the yardstick must not share code with what the canary tests. With a
torch matmul as the reference, a torch upgrade that slows its CPU GEMM slows the yardstick too and
cancels out. numpy's BLAS (OpenBLAS) does not change with torch.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np

from guard.canary.keys import REFERENCE_ENV

REFERENCE_FILE = "canary-reference.jsonl"  # in the run directory: {"step": k, "cpu_s": s} a line


class _Workload:
    """x @ w_in -> silu -> @ w_out, REPS times, timed in this thread's CPU time (seconds)."""

    REPS: int

    def __init__(self, x: np.ndarray, w_in: np.ndarray, w_out: np.ndarray, flops_once: float) -> None:
        self.x, self.w_in, self.w_out = x, w_in, w_out
        self.flops = float(self.REPS * flops_once)
        self()  # warm-up

    def __call__(self) -> float:
        c0 = time.thread_time()
        for _ in range(self.REPS):
            h = self.x @ self.w_in
            h = h / (1.0 + np.exp(-h))  # silu
            float((h @ self.w_out).sum())
        return time.thread_time() - c0


class Reference(_Workload):
    """The worker's workload: x_ND @ w_DF -> silu -> @ w_DF^T.

    ~10 ms, working set ~1.5 MB (beyond L2, like the canary model's). Chosen over torch's matmul,
    a memory stream, many small numpy matmuls and a pure-Python workload: under the other core's
    load (31 processes, docs/NOTES.md) the numpy matmul and torch's tracked the model about equally
    (run-to-run sd of the ratio 3.0-3.2% at raw 8.6%), the stream worse (5.2%), the small-op and
    Python workloads far worse unless fitted. The worker sets one BLAS thread for its process; a
    command it did not start may not, hence `Yardstick`.
    """

    N, D, F, REPS = 512, 128, 512, 4

    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        x_ND = rng.standard_normal((self.N, self.D)).astype(np.float32)
        w_DF = (rng.standard_normal((self.D, self.F)) * 0.1).astype(np.float32)
        super().__init__(x_ND, w_DF, np.ascontiguousarray(w_DF.T), 2 * (2 * self.N * self.D * self.F))


class Yardstick(_Workload):
    """The same kind of workload for a command the canary did not start: a stack of B 64x64
    matmuls -> silu -> matmul (one numpy call each, working set ~3 MB), ~2 ms.

    Each 64x64 product is under OpenBLAS's threading threshold (m*n*k <= 4 x 65536), so it runs
    on this thread whatever OMP_NUM_THREADS / OPENBLAS_NUM_THREADS the command has: the worker's
    512x128x512 product spreads over every core without them, and this thread's CPU time would
    then see only its share (measured on a 2-core box: 22-46 ms of thread time, 34-92 ms of
    process time, against 7.3 ms with one thread), so A = `set:` against B = `set:OMP_NUM_THREADS=1`
    would compare two different yardsticks.
    """

    B, N, REPS = 64, 64, 2

    def __init__(self) -> None:
        rng = np.random.default_rng(0)
        x_BNN = rng.standard_normal((self.B, self.N, self.N)).astype(np.float32)
        w_BNN = (rng.standard_normal((self.B, self.N, self.N)) * 0.1).astype(np.float32)
        super().__init__(x_BNN, w_BNN, w_BNN, 2 * (2 * self.B * self.N**3))


class ReferenceLog:
    """GuardedStep's side: time the yardstick after a step and append it to the run directory."""

    def __init__(self, run_dir: Path) -> None:
        self.yardstick = Yardstick()
        self._f = open(Path(run_dir) / REFERENCE_FILE, "a")  # noqa: SIM115 (open for the run)

    @classmethod
    def from_env(cls, run_dir: Path | None, *, rank: int, on_cpu: bool) -> ReferenceLog | None:
        """A log when the canary asked for one ($MOEGUARD_CANARY_REFERENCE=1), on rank 0 of a CPU
        run with a run directory; else None (nothing is timed)."""
        if os.environ.get(REFERENCE_ENV, "").strip() != "1" or run_dir is None or rank != 0 or not on_cpu:
            return None
        return cls(run_dir)

    def time_step(self, step: int) -> float:
        """Time the yardstick once after `step`; its CPU seconds."""
        cpu_s = self.yardstick()
        self._f.write(json.dumps({"step": step, "cpu_s": cpu_s}) + "\n")
        self._f.flush()  # the canary reads it after the command exits, however it exits
        return cpu_s

    def close(self) -> None:
        self._f.close()


def read_reference(run_dir: Path) -> dict[int, float]:
    """{step: yardstick CPU seconds} from a run's canary-reference.jsonl ({} without one); a step
    timed twice (a replay after a rollback) keeps its last time."""
    path = Path(run_dir) / REFERENCE_FILE
    out: dict[int, float] = {}
    if not path.is_file():
        return out
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
            out[int(row["step"])] = float(row["cpu_s"])
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by a kill: the others still count
    return out
