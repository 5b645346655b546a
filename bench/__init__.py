"""Benchmarks, grouped by what they measure; each writes its section of docs/BENCHMARKS.md.

common/ (what they share), overhead/, detection/, drills/, scale/, canary/, attacks/, gpu/.
"""
