"""What the guard costs a training step: docs/BENCHMARKS.md › Overhead."""
