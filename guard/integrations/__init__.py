"""Adapters for models and loops moeguard did not write: one module per framework.

- `transformers`: Hugging Face transformers 5.x MoE families (attach(model) -> Attachment)
- `torchtitan`: torchtitan's MoE models and its Trainer
- `base`: the contract (RoutingSource, correctors, Attachment) every adapter fills in
- `tiny`: tiny random-init transformers models of each family, for drills, tests and benchmarks
"""
