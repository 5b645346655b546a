"""How well the detectors catch faults against the peers' rules: docs/BENCHMARKS.md › Detection."""
