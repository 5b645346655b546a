"""Many ranks, many runs, long runs: the collector, the run store and the app under size
(docs/BENCHMARKS.md › Scale, Collector, App, Long runs and store size)."""
