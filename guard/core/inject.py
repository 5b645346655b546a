"""Fault-injection specs for drills, defined once: `KIND@STEP[:ARG][/rRANK]`.

Every way of asking for a drill reads this: `moeguard train --inject`, the torchtitan launcher's
`--inject`, `GuardedStep(inject=...)` / `MoEGuardCallback(inject=...)` and `$MOEGUARD_INJECT`
(comma-separated specs). STEP is the guard's 0-based step.

    gradspike@S:ARG  scale every gradient by ARG (default 100) after backward
    lrspike@S:ARG    multiply the LR by ARG (default 100) for one step
    nan@S            one non-finite gradient element (last block)
    badbatch@S       the batch at S is uniformly random garbage tokens
    collapse@S:ARG   push MoE layer ARG's router towards expert 0 from S on (a persistent
                     push, like a router whose weights drifted)
    stall@S:ARG      the data loader sleeps ARG seconds (default 6) before batch S
    crash@S          the process dies at S (SIGKILL: nothing is flushed, like a node loss)
    slowrank@S:ARG   from S on, every step computes ARG seconds longer (default 0.05): a straggler
    hang@S           the process stops at S (SIGSTOP: every thread, outside any collective, so
                     its heartbeat stops too: HeartbeatLost)
    hang@S:ARG       step S blocks for ARG seconds as if inside a hung collective: the rank's
                     heartbeat goes on while its step does not advance (RunStuck), then the run
                     carries on (RunStuck resolves)
    flip@S:ARG       a transient fault, like a flipped bit: this rank's gradients of step S's first
                     pass only are multiplied by ARG (default nan: they become NaN); data and state
                     are untouched, so a recompute of the step (guard.rerun) comes out clean

`crash` and `hang` fire in the first attempt of a torchrun job only: a job restarted by
`torchrun --max-restarts` replays the same command line, and a drill's node loss happens once.
`flip` fires once per process. The other faults replay when their step is re-run, like the data
or hardware that caused them.

Multi-rank: a `/rRANK` suffix (or `@rankRANK`) targets one rank, e.g. `nan@45/r1`,
`gradspike@45:50@rank1`; without it every rank injects.

Where each fault is applied: trainer/callbacks/fault_injection.py (moeguard's trainer, before the
cross-rank reduction) and guard/runtime/inject.py (GuardedStep: any framework's loop).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from guard.core import schema
from guard.core.tomlconf import ConfigError

ENV_INJECT = "MOEGUARD_INJECT"  # comma-separated specs for GuardedStep / MoEGuardCallback / torchtitan
PROCESS_FAULTS = ("crash", "hang")  # they end the attempt: a torchrun restart does not replay them
SYNTAX = "KIND@STEP[:ARG][/rRANK]"

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
# What ARG means for each kind (`--help` lists these; every kind has a line).
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
    spec: str = field(default="", compare=False)  # as the user wrote it (what str() echoes)

    def __str__(self) -> str:
        if self.spec:
            return self.spec
        return f"{self.kind}@{self.step}:{self.arg:g}" + (f"/r{self.rank}" if self.rank is not None else "")


def parse_injection(spec: str, *, flag: str = "--inject") -> Injection:
    """'gradspike@120:50' -> Injection('gradspike', 120, 50.0); 'nan@45/r1' targets rank 1.
    Errors (ConfigError) name `flag`, the spec and the bad part."""
    spec = spec.strip()
    rank = None
    body = spec
    if m := _RANK_RE.search(spec):
        rank, body = int(m.group(1)), spec[: m.start()]
    kind, sep, rest = body.partition("@")
    if not sep:
        raise ConfigError(f"{flag} {spec!r}: expected {SYNTAX}, e.g. gradspike@100:50")
    if kind not in schema.INJECT_KINDS:
        raise ConfigError(f"{flag} {spec!r}: unknown kind {kind!r}; kinds: {', '.join(schema.INJECT_KINDS)}")
    step_s, _, arg_s = rest.partition(":")
    try:
        step = int(step_s)
    except ValueError:
        raise ConfigError(f"{flag} {spec!r}: STEP {step_s!r} is not an integer") from None
    if step < 0:
        raise ConfigError(f"{flag} {spec!r}: STEP must be >= 0")
    try:
        arg = float(arg_s) if arg_s else _DEFAULT_ARG[kind]
    except ValueError:
        raise ConfigError(f"{flag} {spec!r}: ARG {arg_s!r} is not a number") from None
    return Injection(kind, step, arg, rank, spec)


def parse_injections(specs: str | Iterable[str], *, flag: str = "--inject") -> list[Injection]:
    """Several specs: a list, or one comma-separated string (as $MOEGUARD_INJECT holds them)."""
    items = specs.split(",") if isinstance(specs, str) else list(specs)
    return [parse_injection(s, flag=flag) for s in items if s.strip()]


def from_env(environ: dict[str, str] | None = None) -> list[Injection]:
    """The drills asked for in $MOEGUARD_INJECT (none when unset or empty)."""
    text = (os.environ if environ is None else environ).get(ENV_INJECT, "")
    return parse_injections(text, flag=f"${ENV_INJECT}")


def check_injections(injections: Iterable[Injection], steps: int, *, more: str = "raise --steps") -> None:
    """An injection at or past the last step would never fire: a drill that silently does nothing."""
    late = [str(i) for i in injections if i.step >= steps]
    if late:
        raise ConfigError(
            f"--inject {', '.join(late)}: past the run's last step ({steps - 1}; the run has "
            f"{steps} steps, 0..{steps - 1}): it would never fire; inject at an earlier step or {more}"
        )


def help_lines() -> str:
    """The --help section on fault injection: what STEP and ARG mean for every kind."""
    width = max(map(len, schema.INJECT_KINDS)) + len("@STEP[:ARG]")
    lines = [
        f"  {k + '@STEP' + ('' if INJECT_HELP[k].startswith('no ARG') else ':ARG'):<{width}}  {INJECT_HELP[k]}"
        for k in schema.INJECT_KINDS
    ]
    return (
        f"Fault injection, --inject {SYNTAX} (repeatable). STEP is the 0-based step it\n"
        "fires at (0 .. steps-1); /rRANK injects on that rank only (default: every rank):\n"
        + "\n".join(lines)
    )
