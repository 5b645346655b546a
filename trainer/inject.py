"""Fault injection for drills: `moeguard train --inject KIND@STEP[:ARG][/rRANK]` (repeatable).

The spec (kinds, ARG, /rRANK, what each means) is guard/core/inject.py, the one parser every
drill entry point uses (moeguard's trainer, the torchtitan launcher, GuardedStep and the
transformers callback); trainer/callbacks/fault_injection.py injects into moeguard's trainer.
"""

from __future__ import annotations

from guard.core.inject import INJECT_HELP, PROCESS_FAULTS, Injection, check_injections, parse_injection

__all__ = ["INJECT_HELP", "PROCESS_FAULTS", "Injection", "check_injections", "parse_injection"]
