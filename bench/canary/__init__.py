"""The canary's power: false alarms and detected slowdowns (docs/BENCHMARKS.md › Canaries)."""
