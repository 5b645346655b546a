"""The MFU / throughput canary (`moeguard canary`): the gate, its statistics, history and reports.

Pure pieces, one job each (no torch at module level; the model runs in a worker process):
  keys.py       metric and history-entry names, once (the history is read by the app too)
  config.py     CanaryConfig ([canary] table), Setup (config + overrides + hash), TrainerSide
  stats.py      one measurement's numbers: steady window, p50s, pooling worker processes
  gate.py       compare with a baseline, HostFit, the young-baseline line, the re-run decision
  history.py    the JSONL history: parse, the baseline rule, append (dashboards use it too)
  profile.py    top ops from a run's torch.profiler trace, and their change vs the baseline
  measure.py    spawn worker processes and pool them into one Measurement
  report.py     canary.md / canary.json
  run.py        one history-gated canary: measure, compare, confirm, report, record
  ab.py, ab_report.py   `--ab A B`: two environments, paired, no history
  ab_format.py  ab.json's location, shape and reader, once (the app and the power bench read it)
  matrix.py     the kernel-choice matrix: each cell an A/B canary against the reference cell
  own.py        `--ab --script CMD` / `--torchtitan JOB`: the A/B canary on the user's own training
  proc_cpu.py   CPU time of a command's process tree, sampled from /proc (own.py's CPU timing)
  slow.py       `--inject slow:PCT` inside a command the canary did not write (GuardedStep burns it)
  cli.py        `moeguard canary`'s arguments and dispatch

The measuring worker (a Trainer that times each step) lives in trainer/canary_worker.py and
trainer/canary_cli.py hands guard what it needs from the trainer (config schema, `--set` parser,
worker command): guard never imports trainer.
"""
