"""The moeguard MoE trainer: model, data, FLOP accounting, checkpoints and the guarded loop."""
