"""`python -m guard.integrations.torchtitan --nproc-per-node N ...`: the launcher starts its own ranks.

Under `torchrun` a rank's non-zero exit (a guard halt's 3 included) ends in torchrun's
ChildFailedError traceback, which moeguard cannot change from inside a rank. Given
`--nproc-per-node N` outside torchrun, the launcher runs torchrun's own launcher in-process
(`torch.distributed.run`, `--standalone`: one host, a free rendezvous port) over the same command
minus that flag, and ends in one line naming the first failed rank and its exit status:

    guard.integrations.torchtitan: exit 3: the guard halted the run (rank 0's line above says where and why)

The exit status is the rank's (3 halted, 143 preempted; 128+N for a rank killed by signal N).
Multi-host jobs keep using torchrun (or the scheduler's launcher) directly.
"""

from __future__ import annotations

import signal
import sys

from guard.runtime.session import EXIT_PREEMPTED

PROG = "guard.integrations.torchtitan"
EXIT_HALTED = 3
FLAGS = ("--nproc-per-node", "--nproc_per_node")


def without_nproc(argv: list[str]) -> list[str]:
    """The command line minus --nproc-per-node N (or =N): what each rank is given."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a in FLAGS:
            skip = True
        elif not a.startswith(tuple(f + "=" for f in FLAGS)):
            out.append(a)
    return out


def why(code: int) -> str:
    """What a rank's exit status means, in words."""
    if code == EXIT_HALTED:
        return "the guard halted the run (rank 0's line above says where and why)"
    if code == EXIT_PREEMPTED:
        return "preempted (SIGTERM); torchtitan's checkpoint resumes it"
    if code == 2:
        return "a bad flag or guard file (the line above names it)"
    if code < 0:
        return f"killed by {signal.Signals(-code).name}" if -code in signal.valid_signals() else "killed"
    return "the rank failed (its log above says why)"


def launch(nproc: int, argv: list[str]) -> int:
    """Run `torchrun --standalone --nproc-per-node nproc -m guard.integrations.torchtitan argv`
    in this process; one line and the rank's exit status when a rank fails."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    if nproc < 1:
        print(f"{PROG}: --nproc-per-node {nproc}: must be >= 1", file=sys.stderr, flush=True)
        return 2
    targs = get_args_parser().parse_args(
        ["--standalone", f"--nproc-per-node={nproc}", "-m", PROG, *without_nproc(argv)]
    )
    try:
        run(targs)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        code = int(failure.exitcode)
        print(f"{PROG}: exit {code} on rank {rank}: {why(code)}", file=sys.stderr, flush=True)
        return code if code > 0 else 128 - code
    return 0
