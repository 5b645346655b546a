"""Every GPU figure in one prepared run: `bench/gpu/run.sh` (issue #42). common.py says what it
measures; run.sh --help prints it.

Writes docs/BENCHMARKS.md › GPU, through `bench/gpu/report.py`: no section of its own.
"""
