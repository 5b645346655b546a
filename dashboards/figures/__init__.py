"""Plotly figure builders for the app. Pure: data in (from dashboards.data), figure out.

Conventions every chart follows: a title that says what and how it was aggregated, axis
titles with units, a legend when there is more than one trace, and guard actions always
drawn with the same symbol and colour (style.ACTION_STYLE) so a reader learns them once.
Trace names are stable ("action: skip", "event: verdict", ...): tests look them up.

  style.py       action/event symbols, colours, legend and margins, column helpers
  mfu_marks.py   MFU above 100% marked as a measurement artefact, on every MFU chart
  health.py      Run health: loss and grad norm with the guard's marks, throughput and memory
  precursors.py  Run health: the precursor signals (update ratio, group grad norms, Adam v)
  heatmap.py     a step x layer / expert heatmap (Run health)
  compare.py     Compare: metric overlays, steady-state distributions by environment
  canaries.py    Canaries: the MFU history with the gate's band and verdicts
"""
