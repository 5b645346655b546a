"""Online detectors: small pure classes that turn each step's numbers into Verdicts.

The same code runs in the trainer, in the collector and in `moeguard replay` (all through
guard/core/engine.py), so it does no I/O and imports no torch. Every detector keeps its state
in plain fields and round-trips it through a JSON-able `state_dict()`, so a resumed run keeps
its baselines.

    robust.py     shared robust statistics (ring buffer, O(n) median, MAD scale)
    nonfinite.py  NaN/Inf in loss or gradients
    spike.py      grad-norm, loss and per-layer grad-norm spikes (log-scale robust z)
    collapse.py   MoE routing collapse per layer
    timing.py     data-loader stalls, throughput drops
    registry.py   the `Detector` protocol and the registry the suite is built from
    suite.py      DetectorSuite: every enabled detector, fed one StepReport per step
    precursor.py  warnings that move before a loss spike (update-ratio spikes, max attention
                  logit growth), never acting
"""

from guard.core.detectors import precursor as _precursor  # noqa: F401  (registers its detectors)
