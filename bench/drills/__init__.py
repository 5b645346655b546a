"""What the guard does to a run (fault, escalation, collapse and paging drills, actions on clean
runs): docs/BENCHMARKS.md › Detection, transformers families and early-run spikes, Paging drills."""
