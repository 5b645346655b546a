"""Callbacks: what the training loop runs at fixed points of a step without knowing what it does
(fault injection for drills, the canary's timing, the profiler). The hooks are in callback.py."""
