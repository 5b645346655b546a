"""Attacks on the real `moeguard collector` (issue #13), run by
bench/attacks/collector_attacks.py: kit.py (processes, clients, the ledger of acknowledged rows),
store.py (run folders, part names, I/O faults, replay), writers.py (generations and seqs),
abuse.py (bodies, slow clients, run ids, labels, tokens, limits). The pager's attacks went with
`moeguard pager` (issue #29: Alertmanager pages).

Writes docs/BENCHMARKS.md: no section of its own; part of Collector › Collector and pager under
attack (issues #13 and #32, `bench/attacks/collector_attacks.py`).
"""
