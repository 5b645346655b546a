"""Every metric, column, event and action name in moeguard, defined once.

Alert rules, dashboards, the collector, the app and the tests import these names (or are
checked against them by tests) so a rename cannot silently break a panel or an alert.
"""

from __future__ import annotations

# Bumped when a run-store table changes shape; readers refuse newer, migrate older.
SCHEMA_VERSION = 3  # 2: precursor columns (update_ratio, adam_v_ratio) and the groups table; 3: max_logit

# ---------------------------------------------------------------------------------------
# Run store tables: runs/<run_id>/<table>/part-*.parquet, plus meta.json.
# Column order here is the column order on disk.
# ---------------------------------------------------------------------------------------
TABLE_STEPS = "steps"
TABLE_LAYERS = "layers"
TABLE_EXPERTS = "experts"
TABLE_EVENTS = "events"
TABLE_RANKS = "ranks"
TABLE_GROUPS = "groups"
TABLE_EVALS = "evals"
TABLE_HOST = "host"
TABLES = (
    TABLE_STEPS,
    TABLE_LAYERS,
    TABLE_EXPERTS,
    TABLE_EVENTS,
    TABLE_RANKS,
    TABLE_GROUPS,
    TABLE_EVALS,
    TABLE_HOST,
)

# name -> polars dtype name (kept as strings so this module imports without polars)
STEPS_COLUMNS: dict[str, str] = {
    "step": "Int64",
    "time": "Float64",  # unix seconds when the step finished
    "loss": "Float64",
    "grad_norm": "Float64",  # total L2 norm before clipping
    "lr": "Float64",
    "tokens": "Int64",  # tokens consumed by this step (all ranks)
    "step_time_s": "Float64",
    "data_wait_s": "Float64",
    "tokens_per_s": "Float64",
    "mfu": "Float64",  # ratio 0..1, NaN when the peak is unknown
    "mem_peak_bytes": "Int64",
    "action": "String",  # the guard's decision for this step (ACTIONS)
    # Precursors (guard/core/config.py PrecursorConfig). update_ratio: ||W_t - W_{t-1}|| / ||W_{t-1}||
    # over every parameter, the update that produced this step's weights (NaN: none applied/measured)
    "update_ratio": "Float64",
    "adam_v_ratio": "Float64",  # max over params of mean(exp_avg_sq) / its running median (NaN: off)
    # max attention logit over layers, heads and causal pairs of q.k * scale (Kimi K2's QK-clip
    # signal); NaN on steps it was not sampled (guard.precursor.max_logit_every) or not watched
    "max_logit": "Float64",
}
LAYERS_COLUMNS: dict[str, str] = {
    "step": "Int64",
    "layer": "Int32",
    "grad_norm": "Float64",
    "router_entropy": "Float64",  # mean per-token entropy of the router distribution, nats
    "load_entropy": "Float64",  # entropy of the load histogram / log(E), 0..1
    "maxvio": "Float64",  # (max load - mean load) / mean load
    "dead_experts": "Int32",  # experts that got no token over the dead-expert window
    "bias_norm": "Float64",  # L2 norm of the expert-selection bias
    "update_ratio": "Float64",  # this layer's ||W_t - W_{t-1}|| / ||W_{t-1}|| (see steps.update_ratio)
    "max_logit": "Float64",  # this layer's max attention logit (see steps.max_logit)
}
EXPERTS_COLUMNS: dict[str, str] = {
    "step": "Int64",
    "layer": "Int32",
    "expert": "Int32",
    "load": "Int64",  # tokens routed to this expert this step (all ranks, all micro-batches)
    "bias": "Float64",
}
EVENTS_COLUMNS: dict[str, str] = {
    "step": "Int64",
    "time": "Float64",
    "kind": "String",  # EVENT_KINDS
    "detector": "String",  # DETECTORS, or "" for events that come from no detector
    "value": "Float64",  # the observed value that triggered it
    "threshold": "Float64",  # the threshold it crossed
    "action": "String",  # ACTIONS
    "detail": "String",  # JSON evidence (layer, baseline, z-score, ...)
}
# Per-rank timing, written every `straggler_every` steps by rank 0 (multi-rank runs).
RANKS_COLUMNS: dict[str, str] = {
    "step": "Int64",
    "rank": "Int32",
    "step_time_s": "Float64",
    "data_wait_s": "Float64",
    "straggler_score": "Float64",
    "tokens": "Int64",
}
# Per optimizer parameter group (index into optimizer.param_groups): Muon and AdamW groups differ
# by orders of magnitude, so one total grad norm hides either.
GROUPS_COLUMNS: dict[str, str] = {
    "step": "Int64",
    "group": "Int32",
    "grad_norm": "Float64",
    "update_ratio": "Float64",
}
# Evaluation metrics the loop reports (GuardedStep.log, MoEGuardCallback from the Trainer's
# evaluate), one row per metric: `step` is the last step taken before it was measured (0-based: the
# Trainer's global_step - 1), so it is drawn where W&B and TensorBoard draw it beside the train loss.
# A new table, not a new shape of one: a store without it reads as a run without evaluations.
EVALS_COLUMNS: dict[str, str] = {
    "step": "Int64",
    "time": "Float64",
    "name": "String",  # the loop's own name for it: eval_loss, eval_accuracy, ...
    "value": "Float64",
}
# Rank 0's host, sampled off the training thread (guard/runtime/host.py) at most once a step and
# once per MOEGUARD_HOST_EVERY_S (1 s): `step` is the last step finished when it was sampled. Null:
# not measurable here (no /proc, no CUDA device, no pynvml for the GPU's utilisation). A new table.
HOST_COLUMNS: dict[str, str] = {
    "step": "Int64",
    "time": "Float64",
    "cpu_pct": "Float64",  # the training process's CPU time over wall time since the last sample, % of one core
    "rss_bytes": "Int64",  # the process's resident memory
    "host_mem_used_bytes": "Int64",  # the host's memory in use (MemTotal - MemAvailable)
    "host_mem_total_bytes": "Int64",
    "gpu_util_pct": "Float64",  # the device's utilisation (torch.cuda.utilization: needs pynvml)
    "gpu_mem_used_bytes": "Int64",  # the device's memory in use, every process's (cudaMemGetInfo)
}
TABLE_COLUMNS: dict[str, dict[str, str]] = {
    TABLE_STEPS: STEPS_COLUMNS,
    TABLE_LAYERS: LAYERS_COLUMNS,
    TABLE_EXPERTS: EXPERTS_COLUMNS,
    TABLE_EVENTS: EVENTS_COLUMNS,
    TABLE_RANKS: RANKS_COLUMNS,
    TABLE_GROUPS: GROUPS_COLUMNS,
    TABLE_EVALS: EVALS_COLUMNS,
    TABLE_HOST: HOST_COLUMNS,
}

# ---------------------------------------------------------------------------------------
# Rollups (long runs): runs/<run_id>/rollups/<table>-r<res>/part-*.parquet, one row per series
# (the table's key columns) per bucket of `res` steps (guard/store/layout.py ROLLUP_RESOLUTIONS,
# guard/store/rollup.py builds them). `step` is the bucket's start (step // res * res), `step_lo` /
# `step_hi` the first and last step actually pooled, `n` the rows pooled; for each value column c of
# the table: c_mean, c_min, c_max, c_last (the value at step_hi). NaN values are left out of
# mean/min/max (a bucket whose values are all NaN has NaN there); c_last is the raw last value.
# Values are Float32: extremes are exact for integers below 2**24 and to float32 precision else.
# ---------------------------------------------------------------------------------------
# The steps table (one series, no key) is rolled up too, so a chart of a month-long run's loss or
# tokens/s reads ~2,000 buckets (their min and max) instead of 1M rows; its raw rows are kept whole.
ROLLUP_KEYS: dict[str, tuple[str, ...]] = {
    TABLE_LAYERS: ("layer",),
    TABLE_EXPERTS: ("layer", "expert"),
    TABLE_GROUPS: ("group",),
    TABLE_RANKS: ("rank",),
    TABLE_STEPS: (),
}
ROLLUP_TABLES = tuple(ROLLUP_KEYS)
# Tables whose old raw rows retention thins (guard/store/retention.py); steps and events stay whole.
THINNED_TABLES = (TABLE_LAYERS, TABLE_EXPERTS, TABLE_GROUPS, TABLE_RANKS)
# The finest resolution written per table where it is coarser than ROLLUP_RESOLUTIONS' first: rank
# rows come every straggler_every (20) steps, so a 10-step rollup would be larger than its rows.
ROLLUP_MIN_RESOLUTION: dict[str, int] = {TABLE_RANKS: 100}
ROLLUP_STATS = ("mean", "min", "max", "last")
ROLLUP_STEP_COLUMNS: dict[str, str] = {"step": "Int64", "step_lo": "Int64", "step_hi": "Int64", "n": "Int32"}


def rollup_value_columns(table: str) -> tuple[str, ...]:
    """The columns of `table` that its rollups summarise (all but step, the key columns and text
    columns: the steps table's `action`)."""
    keys = ROLLUP_KEYS[table]
    cols = TABLE_COLUMNS[table]
    return tuple(c for c, t in cols.items() if c != "step" and c not in keys and t != "String")


def rollup_columns(table: str) -> dict[str, str]:
    """A rollup table's columns, in order: keys, step, step_lo, step_hi, n, then c_<stat> for each
    value column c and stat in ROLLUP_STATS. KeyError for a table that is not rolled up."""
    cols = {k: TABLE_COLUMNS[table][k] for k in ROLLUP_KEYS[table]}
    cols.update(ROLLUP_STEP_COLUMNS)
    for c in rollup_value_columns(table):
        for stat in ROLLUP_STATS:
            cols[f"{c}_{stat}"] = "Float32"
    return cols


SUMMARY_FILE = "summary.json"  # runs/<run_id>/summary.json (guard/store/summary.py)

META_FILE = "meta.json"
# meta.json["tags"]: the run's tags, a list of strings (guard/core/tags.py says what a tag may be)
META_TAGS = "tags"
CHECKPOINT_DIR = "checkpoints"
PROFILE_DIR = "profile"

# The training framework a run is driven by: meta.json["framework"] (RunHalted says how to resume it)
FRAMEWORK_MOEGUARD = "moeguard"  # `moeguard train`
FRAMEWORK_TORCHTITAN = "torchtitan"
FRAMEWORK_TRANSFORMERS = "transformers"  # the Trainer with MoEGuardCallback, or a transformers model
FRAMEWORK_PYTORCH = "pytorch"  # any other loop with GuardedStep
FRAMEWORKS = (FRAMEWORK_MOEGUARD, FRAMEWORK_TORCHTITAN, FRAMEWORK_TRANSFORMERS, FRAMEWORK_PYTORCH)

# Run status, kept in meta.json["status"] (meta.json["status_note"] says what happened in words).
STATUS_RUNNING = "running"
STATUS_FINISHED = "finished"
STATUS_HALTED = "halted"
STATUS_CRASHED = "crashed"
STATUS_STALE = "stale"  # derived by readers: "running" but no update for a while
STATUS_PREEMPTED = "preempted"  # SIGTERM: checkpointed at a step boundary, resumable
STATUS_INTERRUPTED = "interrupted"  # Ctrl-C / SIGINT: stopped where it was, no new checkpoint
STATUS_FINISHED_NONFINITE = "finished_nonfinite"  # ran to the end, but its loss/gradient ended non-finite
# A peer rank died (killed, OOM, a node lost): this rank stopped because of it, not of its own
# accord (its collective lost the peer, or the launcher's SIGTERM came while a peer was silent)
STATUS_PEER_LOST = "peer_lost"
RUN_STATUSES = (
    STATUS_RUNNING,
    STATUS_FINISHED,
    STATUS_HALTED,
    STATUS_CRASHED,
    STATUS_STALE,
    STATUS_PREEMPTED,
    STATUS_INTERRUPTED,
    STATUS_FINISHED_NONFINITE,
    STATUS_PEER_LOST,
)
# The statuses a rank's last batch may say goodbye with (guard/wire/batch.py `goodbye`): every one
# but the readers' stale (running: stopped at `--until`, resumable). All but running end the run.
GOODBYE_STATUSES = tuple(s for s in RUN_STATUSES if s != STATUS_STALE)
ENDED_STATUSES = tuple(s for s in GOODBYE_STATUSES if s != STATUS_RUNNING)

# ---------------------------------------------------------------------------------------
# Guard vocabulary
# ---------------------------------------------------------------------------------------
# Detectors (Verdict.detector)
DET_NONFINITE = "nonfinite"
DET_GRAD_SPIKE = "grad_norm_spike"
DET_LOSS_SPIKE = "loss_spike"
DET_LAYER_GRAD_SPIKE = "layer_grad_norm_spike"
DET_DEAD_EXPERTS = "dead_experts"
DET_MAXVIO = "maxvio"
DET_LOAD_ENTROPY = "load_entropy"
DET_ROUTER_ENTROPY = "router_entropy"
DET_STALL = "data_stall"
DET_THROUGHPUT = "throughput_drop"
DET_LR = "lr_spike"  # the LR about to be applied exceeds the schedule's bound
DET_UPDATE_RATIO = "update_ratio_spike"  # precursor: a layer's update/weight ratio jumped
DET_MAX_LOGIT = "max_logit_growth"  # precursor: a layer's max attention logit jumped or passed 100
# The policy's own findings (guard/core/policy.py), recorded as critical verdicts so the collector
# counts them in moeguard_guard_verdicts_total{detector} and a rule pages: a collapse still there
# after its correction window, a step fault that came back after a rollback (not rolled back again).
DET_COLLAPSE_NOT_RECOVERED = "collapse_not_recovered"
DET_FAULT_RECURRED = "fault_recurred"
DETECTORS = (
    DET_NONFINITE,
    DET_GRAD_SPIKE,
    DET_LOSS_SPIKE,
    DET_LAYER_GRAD_SPIKE,
    DET_DEAD_EXPERTS,
    DET_MAXVIO,
    DET_LOAD_ENTROPY,
    DET_ROUTER_ENTROPY,
    DET_STALL,
    DET_THROUGHPUT,
    DET_LR,
    DET_UPDATE_RATIO,
    DET_MAX_LOGIT,
    DET_COLLAPSE_NOT_RECOVERED,
    DET_FAULT_RECURRED,
)
# Detectors whose verdict means "this update is bad, do not apply it".
STEP_DETECTORS = (DET_NONFINITE, DET_GRAD_SPIKE, DET_LOSS_SPIKE, DET_LAYER_GRAD_SPIKE, DET_LR)
# Precursors: warnings that move before a loss spike; they record an event and act only when
# configured (guard.precursor.act).
PRECURSOR_DETECTORS = (DET_UPDATE_RATIO, DET_MAX_LOGIT)
# Detectors that watch a single MoE layer's routing.
COLLAPSE_DETECTORS = (DET_DEAD_EXPERTS, DET_MAXVIO, DET_LOAD_ENTROPY, DET_ROUTER_ENTROPY)

# Actions (steps.action, events.action). What counts as a *guard action* (skipped, rolled-back
# and halted steps plus bias corrections and LR cool-downs started), and how it is counted for
# the CLI, meta.json, the app and /metrics: guard/core/actions.py, once.
ACT_APPLY = "apply"
ACT_SKIP = "skip"
ACT_ROLLBACK = "rollback"
ACT_BIAS_CORRECT = "bias_correct"
ACT_LR_COOLDOWN = "lr_cooldown"
ACT_HALT = "halt"
ACT_NONE = "none"  # observe only (guard off, or a verdict that needs no action)
# The policy's decision for a finite grad-norm spike (PolicyConfig.clip_spikes, on by default; off,
# such a spike is skipped): guard/runtime/apply.py turns it into an apply where the run's own grad
# clip bounds it under the detector's threshold, else into a skip, so no step's row records it
ACT_CLIP = "clip"
# (appended last: ranks exchange a decision as its index here)
ACTIONS = (ACT_APPLY, ACT_SKIP, ACT_ROLLBACK, ACT_BIAS_CORRECT, ACT_LR_COOLDOWN, ACT_HALT, ACT_NONE, ACT_CLIP)
# Step decisions whose update was applied: bias_correct is an applied step on which a collapse
# correction started (guard/core/actions.py counts it from the step's row); clip is resolved to an
# apply or a skip before the update
APPLYING_ACTIONS = (ACT_APPLY, ACT_BIAS_CORRECT, ACT_CLIP)

# Event kinds (events.kind)
EV_VERDICT = "verdict"  # a detector fired
EV_ACTION = "action"  # the policy acted
EV_RECOVERED = "recovered"  # a corrected layer is healthy again
EV_INJECT = "inject"  # a fault was injected on purpose (drills)
EV_CHECKPOINT = "checkpoint"
EV_RESUME = "resume"
EV_HALT = "halt"  # critical: the run stopped itself; pages a human
EV_OPERATOR = "operator"  # a command from the collector (operator) was applied
EV_STRAGGLER = "straggler"
# A flagged step recomputed from the same state (guard.rerun, trainer/rerun.py); its `detector`
# says what the recompute showed, its detail names the rank(s) and both passes' loss and grad norm.
EV_RERUN = "rerun"
EVENT_KINDS = (
    EV_VERDICT,
    EV_ACTION,
    EV_RECOVERED,
    EV_INJECT,
    EV_CHECKPOINT,
    EV_RESUME,
    EV_HALT,
    EV_OPERATOR,
    EV_STRAGGLER,
    EV_RERUN,
)
# What a rerun showed (events.detector of a `rerun` event): the recompute disagreed with the first
# pass (a one-off corruption: a suspected hardware fault, which pages), or agreed (the data or the
# optimisation: the guard's decision stands).
RERUN_TRANSIENT = "suspected_hardware_fault"
RERUN_REPRODUCIBLE = "reproducible"
RERUN_CLASSES = (RERUN_TRANSIENT, RERUN_REPRODUCIBLE)

# ---------------------------------------------------------------------------------------
# Prometheus metrics (collector /metrics). Base units, counters end in _total.
# Labels: run (run_id), layer where per layer, rank where per rank.
# ---------------------------------------------------------------------------------------
M_STEP = "moeguard_step"
M_LOSS = "moeguard_loss"
M_GRAD_NORM = "moeguard_grad_norm"
M_LR = "moeguard_learning_rate"
M_TOKENS = "moeguard_tokens_total"
M_TOKENS_PER_S = "moeguard_tokens_per_second"
M_MFU = "moeguard_mfu_ratio"
M_STEP_TIME = "moeguard_step_duration_seconds"
M_DATA_WAIT = "moeguard_data_wait_seconds"
M_MEM_PEAK = "moeguard_memory_peak_bytes"
M_LAYER_GRAD_NORM = "moeguard_layer_grad_norm"
M_LAYER_MAXVIO = "moeguard_layer_maxvio_ratio"
M_LAYER_DEAD = "moeguard_layer_dead_experts"
M_LAYER_LOAD_ENTROPY = "moeguard_layer_load_entropy_ratio"
M_LAYER_ROUTER_ENTROPY = "moeguard_layer_router_entropy_nats"
M_LAYER_BIAS_NORM = "moeguard_layer_bias_norm"
M_EXPERT_LOAD_SHARE = "moeguard_expert_load_share"  # histogram per (run, layer) of expert shares
M_VERDICTS = "moeguard_guard_verdicts_total"  # labels: run, detector
M_ACTIONS = "moeguard_guard_actions_total"  # labels: run, action (guard/core/actions.py)
M_NONFINITE = "moeguard_nonfinite_steps_total"
M_HALTED = "moeguard_run_halted"  # 1 when the run halted itself
# 1 while the run is halted, labelled with what halted it: RunHalted's annotations read it
M_HALT_INFO = "moeguard_run_halt_info"
HALT_INFO_LABELS = ("step", "halted_by", "detector", "reason", "framework")
HALTED_BY_GUARD, HALTED_BY_OPERATOR = "guard", "operator"
M_LAST_SEEN = "moeguard_last_report_timestamp_seconds"  # labels: run, rank
M_HEARTBEAT_AGE = "moeguard_heartbeat_age_seconds"  # labels: run, rank
M_HEARTBEAT_TIMEOUT = "moeguard_heartbeat_timeout_seconds"  # labels: run, rank
M_HEARTBEAT_LOST = "moeguard_heartbeat_lost"  # labels: run, rank; 1 when age > timeout
M_PROGRESS_AGE = "moeguard_progress_age_seconds"  # labels: run, rank; since the rank last advanced
M_PROGRESS_DEADLINE = (
    "moeguard_progress_deadline_seconds"  # labels: run, rank; learned (guard/core/progress.py)
)
M_RANK_STUCK = "moeguard_rank_stuck"  # labels: run, rank, phase; 1 when beating but not advancing
M_RUN_STUCK_RANKS = "moeguard_run_stuck_ranks"  # labels: run, phase; how many ranks are stuck
M_QUARANTINED_RUNS = "moeguard_collector_quarantined_runs"  # runs refused at load (damaged files)
M_STRAGGLER = "moeguard_straggler_score"  # labels: run, rank
M_RUN_RANKS = "moeguard_run_ranks"  # labels: run, state (watched|lost|stuck|waiting): rank counts
M_STRAGGLER_MIN = "moeguard_straggler_score_min"  # labels: run; the slowest rank's score
M_GOODPUT = "moeguard_goodput_ratio"
M_MFU_BASELINE = "moeguard_mfu_baseline_ratio"  # median MFU of the run's own first window
M_TPS_BASELINE = "moeguard_tokens_per_second_baseline"
M_INGEST_BATCHES = "moeguard_ingest_batches_total"  # labels: outcome
M_INGEST_VALUES = "moeguard_ingest_values_total"
M_RUN_INFO = "moeguard_run_info"  # labels: run, torch, device, attention, expert_kernel, compile
M_HW_FAULTS = "moeguard_suspected_hardware_faults_total"  # labels: run, rank (from transient reruns)

METRICS = (
    M_STEP,
    M_LOSS,
    M_GRAD_NORM,
    M_LR,
    M_TOKENS,
    M_TOKENS_PER_S,
    M_MFU,
    M_STEP_TIME,
    M_DATA_WAIT,
    M_MEM_PEAK,
    M_LAYER_GRAD_NORM,
    M_LAYER_MAXVIO,
    M_LAYER_DEAD,
    M_LAYER_LOAD_ENTROPY,
    M_LAYER_ROUTER_ENTROPY,
    M_LAYER_BIAS_NORM,
    M_EXPERT_LOAD_SHARE,
    M_VERDICTS,
    M_ACTIONS,
    M_NONFINITE,
    M_HALTED,
    M_LAST_SEEN,
    M_HEARTBEAT_AGE,
    M_HEARTBEAT_TIMEOUT,
    M_HEARTBEAT_LOST,
    M_STRAGGLER,
    M_RUN_RANKS,
    M_STRAGGLER_MIN,
    M_GOODPUT,
    M_MFU_BASELINE,
    M_TPS_BASELINE,
    M_INGEST_BATCHES,
    M_INGEST_VALUES,
    M_RUN_INFO,
    M_PROGRESS_AGE,
    M_PROGRESS_DEADLINE,
    M_RANK_STUCK,
    M_RUN_STUCK_RANKS,
    M_QUARANTINED_RUNS,
    M_HW_FAULTS,
)

# Alert names (alerts/moeguard.rules.yml); each has playbooks/<Alert>.md.
ALERTS = (
    "GradNormSpike",
    "LossSpike",
    "LRSpike",
    "AttentionLogitGrowth",
    "NonFiniteLoss",
    "ExpertCollapse",
    "DeadExperts",
    "RouterEntropyLow",
    "GuardRollbackStorm",
    "FaultRecurred",
    "CollapseNotRecovered",
    "RunHalted",
    "MFUDrop",
    "ThroughputDrop",
    "DataLoaderStall",
    "HeartbeatLost",
    "RunStuck",
    "RunQuarantined",
    "Straggler",
    "SuspectedHardwareFault",
    "Watchdog",
)

# Fault-injection kinds (moeguard train --inject KIND@STEP[:ARG]); canary adds slow:PCT.
INJECT_KINDS = (
    "gradspike",
    "lrspike",
    "nan",
    "badbatch",
    "collapse",
    "stall",
    "crash",
    "slowrank",
    "hang",
    "flip",
)

# Environment variables
ENV_TOKEN = "MOEGUARD_TOKEN"
ENV_COLLECTOR = "MOEGUARD_COLLECTOR"  # URL of the collector for the trainer's exporter
ENV_HOST_EVERY = "MOEGUARD_HOST_EVERY_S"  # seconds between host samples (the host table); 0: none

# The collector's own health and limits (guard/core/limits.py); not run metrics, so not in METRICS.
M_COLLECTOR_HOT_RUNS = "moeguard_collector_hot_runs"  # runs with full state in memory
M_COLLECTOR_KNOWN_RUNS = "moeguard_collector_known_runs"  # runs with a record (hot or evicted)
M_COLLECTOR_PENDING_LOAD = "moeguard_collector_runs_pending_load"  # start-up: run folders not read yet
M_COLLECTOR_EVICTIONS = "moeguard_collector_run_evictions_total"  # LRU evictions of idle runs
M_COLLECTOR_LIMIT_REFUSALS = "moeguard_collector_limit_refusals_total"  # labels: limit
M_COLLECTOR_SERIES_DROPPED = "moeguard_collector_series_dropped"  # labels: run; at the last render
COLLECTOR_METRICS = (
    M_COLLECTOR_HOT_RUNS,
    M_COLLECTOR_KNOWN_RUNS,
    M_COLLECTOR_PENDING_LOAD,
    M_COLLECTOR_EVICTIONS,
    M_COLLECTOR_LIMIT_REFUSALS,
    M_COLLECTOR_SERIES_DROPPED,
)
