"""The canary's metric and history-entry names, defined once.

A summary (one measurement), a history entry (one JSONL line) and the reports share these keys;
the app's Canaries page reads the history through guard/canary/history.py with the same names.
"""

from __future__ import annotations

# History entry keys (JSONL, one object per line). The app's Canaries page reads time, git_sha,
# torch, fingerprint, config, mfu_p50, tokens_per_s_p50, verdict, baseline (and warn_pct/fail_pct).
H_TIME, H_SHA, H_TORCH, H_FP, H_HW = "time", "git_sha", "torch", "fingerprint", "hardware"
H_CFG_HASH, H_CFG, H_VERDICT, H_BASELINE = "config_hash", "config", "verdict", "baseline"
H_WARN_PCT, H_FAIL_PCT, H_PROFILE_TOP = "warn_pct", "fail_pct", "profile_top"
H_TIME_FORMAT = "%Y-%m-%dT%H:%M:%SZ"  # what `moeguard canary` writes (UTC)

# Gated metrics of a measurement (a summary) and of a history entry.
MFU, TPS, MEM, DATA_WAIT, LOSS = (
    "mfu_p50",
    "tokens_per_s_p50",
    "mem_peak_bytes",
    "data_wait_share",
    "final_loss",
)
REF = "ref_cpu_ms_p50"  # the paired reference's p50 CPU time (CPU timing): how contended the core was
MFU_ADJ = "mfu_host_adj_p50"  # CPU timing: MFU corrected for the host's speed (HostFit); the gated MFU
PROC_MFU, PROC_REF = "process_mfu", "process_ref_ms"  # per worker process: MFU p50 and reference p50
MFU_METRICS = (MFU, MFU_ADJ)
# One MFU on every surface (CLI, Runs, Compare, canary report): the trainer's, against the peak of the
# devices or CPU threads the run used. On CPU timing the canary gates on another number, named apart:
# training FLOPs per CPU-second over a reference matmul's FLOPs per CPU-second, timed beside each step.
MFU_DEFINITION = (
    "MFU = training FLOPs/token x tokens/s / (peak FLOP/s per device or thread x devices or threads used)"
)
CPU_EFFICIENCY = "CPU efficiency"  # the CPU-timed canary's gated measure (mfu_p50 / mfu_host_adj_p50 keys)

# The environment keys a history entry keeps and the report compares with the baseline's.
ENV_KEYS = (
    "torch",
    "cuda",
    "python",
    "device",
    "attention_backend",
    "expert_kernel",
    "compile",
    "dtype",
    "peak_flops_source",
    "world_size",
)

# What `moeguard canary --ab --script/--torchtitan` hands the training command it runs (guard/canary/
# own.py), as environment variables: where to write its run store (MoEGuardCallback's default
# run_dir; the torchtitan launcher is given --run-dir), how many steps to run when --steps says so,
# and the injected slowdown (`--inject slow:PCT`, burnt inside GuardedStep.step: guard/canary/slow.py).
RUN_DIR_ENV, STEPS_ENV, SLOW_ENV = "MOEGUARD_RUN_DIR", "MOEGUARD_CANARY_STEPS", "MOEGUARD_CANARY_SLOW_PCT"
# ... and, when the canary times on a CPU, asks GuardedStep to time its yardstick after each step
# (guard/canary/reference.py), so the command's CPU time can be divided by the machine's speed.
REFERENCE_ENV = "MOEGUARD_CANARY_REFERENCE"
