"""A user's own training command for the canary tests (tests/guard/test_canary_own.py): a plain
PyTorch loop with GuardedStep on a small MLP, its run store where the canary says.

    python tests/guard/own_loop.py --steps 40 [--run-dir DIR] [--fail]

run_dir: --run-dir, else $MOEGUARD_RUN_DIR (what `moeguard canary --ab --script` hands a command).
--inject slow:PCT reaches it as $MOEGUARD_CANARY_SLOW_PCT, which GuardedStep.step honours.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from guard.api import GuardedStep
from guard.canary.keys import RUN_DIR_ENV


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--run-dir", default=None)
    ap.add_argument("--fail", action="store_true", help="die after 3 steps (a broken environment)")
    a = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(256, 256) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guarded = GuardedStep(model, opt, run_dir=a.run_dir or os.environ[RUN_DIR_ENV])
    x = torch.randn(256, 256)
    for step in range(a.steps):
        if a.fail and step == 3:
            print("own_loop: this environment is broken", file=sys.stderr)
            return 3
        loss = model(x).pow(2).mean()
        loss.backward()
        guarded.step(loss, tokens=256)
    guarded.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
