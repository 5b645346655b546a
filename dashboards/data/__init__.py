"""The app's data access: run discovery, cached loaders, downsampling, aggregation.

Pages stay thin: they call the loaders here and hand the results to `dashboards.figures`.
Nothing here imports torch; nothing here draws. The run store is read only through
guard/store/reader.py (the one tolerant reader), the collector only through guard/wire/runs.py.

  config.py        the app's settings (command line after `--`, else environment variables)
  runs.py          run discovery, status (stale), compatibility, the cache-key signature
  status.py        each run status's words, badge colour and meaning (pure)
  shaping.py       downsampling and heatmap bucketing (pure)
  guard_events.py  guard events as chart marks, timeline rows and hover text (pure)
  mfu_peak.py      which peak a run's MFU divides by, and whether to trust it (pure)
  loaders.py       cached loaders: the summary, steps, events, groups, steady-state perf
  heatmaps.py      cached per-layer and per-expert heatmaps
  compare.py       the Compare page: overlays, "is B faster than A", env differences
  canaries.py      the canary history as tables, judged by guard/canary's rules
  open_alerts.py   open alerts per run from Alertmanager or the collector

Every cached loader takes (run path as str, `runs.run_signature()`, knobs), so a live run
refreshes on the next rerun and a finished one is read once.
"""
