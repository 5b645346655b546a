"""What the benches share: the docs/BENCHMARKS.md section writer and the torchtitan and
transformers Trainer jobs that benches and tests launch."""
