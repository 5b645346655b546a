"""A rank's own words in torchrun's failure report, for an ending that is not a crash (a halt).

torchrun's agent turns any non-zero exit of a rank into a ChildFailedError that torchrun raises
uncaught: a Python traceback of torch's launcher frames, then a "Root Cause" block whose
`traceback :` field is read from the rank's error file ($TORCHELASTIC_ERROR_FILE, which the agent
sets for every rank; torch/distributed/elastic/multiprocessing/errors). With no file it says "To
enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html". Only an exit status
of 0 avoids the traceback, and a halted run must not exit 0 (a scheduler would take it as done),
so a rank cannot make plain torchrun end in one line: the `--nproc-per-node` form of the
torchtitan launcher (guard/integrations/torchtitan/launch.py) does that by being the launcher.
What a rank can do is write the file, so that the block names the halt, its step and reason, and
the exit status (and where torchrun has an error file of its own, set by a scheduler, torchrun
copies the first failed rank's into it). The agent then logs one more line, "no error file
defined for parent, to copy child error file", where torchrun has none.

    tell_launcher("moeguard train: halted at step 12: ...; continue with --resume (exit 3)")
"""

from __future__ import annotations

import json
import os
import time

ENV_ERROR_FILE = "TORCHELASTIC_ERROR_FILE"


def tell_launcher(message: str) -> bool:
    """Write `message` as this rank's error file (the format of torch's ErrorHandler, so the
    agent shows it in place of a traceback); False when no launcher asked for one (not under
    torchrun) or the file cannot be written."""
    path = os.environ.get(ENV_ERROR_FILE)
    if not path:
        return False
    doc = {
        "message": {
            "message": message,
            "extraInfo": {"py_callstack": message, "timestamp": str(int(time.time()))},
        }
    }
    try:
        with open(path, "w") as f:
            json.dump(doc, f)
    except OSError:
        return False
    return True
