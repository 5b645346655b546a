"""Fault injection for drills: `moeguard train --inject KIND@STEP[:ARG][/rRANK]` (repeatable).

    gradspike@S:ARG  scale every gradient by ARG (default 100) after backward
    lrspike@S:ARG    multiply the LR by ARG (default 100) for one step
    nan@S            one non-finite gradient element (last block)
    badbatch@S       the batch at S is uniformly random garbage tokens
    collapse@S:ARG   push MoE layer ARG's router towards expert 0 from S on (a persistent
                     +8 logit offset, like a router whose weights drifted)
    stall@S:ARG      the data loader sleeps ARG seconds (default 6) before batch S
    crash@S          the process dies at S (SIGKILL: nothing is flushed, like a node loss)
    slowrank@S:ARG   from S on, every step computes ARG seconds longer (default 0.05): a straggler
    hang@S           the process stops at S (SIGSTOP: every thread, outside any collective, so
                     its heartbeat stops too: HeartbeatLost)
    hang@S:ARG       step S blocks for ARG seconds as if inside a hung collective: the rank's
                     heartbeat goes on (trainer.distributed.HeartbeatPump) while its step does not
                     advance (RunStuck), then the run carries on (RunStuck resolves)
    flip@S:ARG       a transient fault, like a flipped bit: this rank's gradients of step S's first
                     pass only are multiplied by ARG (default nan: they become NaN); data and state
                     are untouched, so a recompute of the step (guard.rerun) comes out clean

`crash` and `hang` fire in the first attempt of a torchrun job only: a job restarted by
`torchrun --max-restarts` replays the same command line, and a drill's node loss happens once.
`flip` fires once per process: a recompute (guard.rerun) or a re-run after a rollback is clean.
The other faults replay when their step is re-run, like the data or hardware that caused them
(with guard.rerun on, `badbatch`, `nan` and `gradspike` reproduce in the recompute).

Multi-rank: a `/rRANK` suffix (or `@rankRANK`) targets one rank, e.g. `nan@45/r1`,
`gradspike@45:50@rank1`; without it every rank injects. Gradient faults are injected into the
rank's local gradients before the cross-rank reduction, as a real faulty rank would produce them.

This module is the spec (what `--inject` accepts); trainer/callbacks/fault_injection.py injects.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from guard.core import schema
from guard.core.tomlconf import ConfigError

_DEFAULT_ARG = {
    "gradspike": 100.0,
    "lrspike": 100.0,
    "nan": 0.0,
    "badbatch": 0.0,
    "collapse": 0.0,
    "stall": 6.0,
    "crash": 0.0,
    "slowrank": 0.05,
    "hang": 0.0,
    "flip": math.nan,
}
# What ARG means for each kind (`moeguard train --help` lists these; every kind has a line).
INJECT_HELP = {
    "gradspike": "ARG = factor every gradient is scaled by after backward (default 100)",
    "lrspike": "ARG = factor the LR is multiplied by, for that one step (default 100)",
    "nan": "no ARG: one gradient element of the last block becomes NaN",
    "badbatch": "no ARG: the batch at STEP is uniformly random garbage tokens",
    "collapse": "ARG = MoE layer whose router is pushed towards expert 0 from STEP on (default 0)",
    "stall": "ARG = seconds the data loader sleeps before batch STEP (default 6)",
    "crash": "no ARG: the process SIGKILLs itself at STEP, like a node loss (first torchrun attempt only)",
    "slowrank": "ARG = extra seconds every step computes from STEP on (default 0.05): a straggler",
    "hang": "no ARG: the process stops making progress at STEP for good, its heartbeat too (first torchrun "
    "attempt only); ARG = seconds STEP blocks as if in a hung collective while the heartbeat goes on, "
    "then the run carries on (a RunStuck drill)",
    "flip": "ARG = factor this rank's gradients of STEP's first pass only are multiplied by (default nan: "
    "they become NaN), like a flipped bit; a recompute of the step (guard.rerun) is clean: a suspected "
    "hardware fault",
}
_RANK_RE = re.compile(r"(?:/r|@rank)(\d+)$")


@dataclass(frozen=True, slots=True)
class Injection:
    kind: str
    step: int
    arg: float
    rank: int | None = None  # None: every rank

    def __str__(self) -> str:
        return f"{self.kind}@{self.step}:{self.arg:g}" + (f"/r{self.rank}" if self.rank is not None else "")


def parse_injection(spec: str) -> Injection:
    """'gradspike@120:50' -> Injection('gradspike', 120, 50.0); 'nan@45/r1' targets rank 1.
    Errors name the bad part."""
    rank = None
    body = spec
    if m := _RANK_RE.search(spec):
        rank, body = int(m.group(1)), spec[: m.start()]
    kind, sep, rest = body.partition("@")
    if not sep:
        raise ConfigError(f"--inject {spec!r}: expected KIND@STEP[:ARG][/rRANK], e.g. gradspike@100:50")
    if kind not in schema.INJECT_KINDS:
        raise ConfigError(
            f"--inject {spec!r}: unknown kind {kind!r}; kinds: {', '.join(schema.INJECT_KINDS)}"
        )
    step_s, _, arg_s = rest.partition(":")
    try:
        step = int(step_s)
    except ValueError:
        raise ConfigError(f"--inject {spec!r}: STEP {step_s!r} is not an integer") from None
    if step < 0:
        raise ConfigError(f"--inject {spec!r}: STEP must be >= 0")
    try:
        arg = float(arg_s) if arg_s else _DEFAULT_ARG[kind]
    except ValueError:
        raise ConfigError(f"--inject {spec!r}: ARG {arg_s!r} is not a number") from None
    return Injection(kind, step, arg, rank)
