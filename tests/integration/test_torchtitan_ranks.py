"""torchtitan's own Trainer on two ranks, guarded through the one launch command:

    torchrun --nproc_per_node 2 -m guard.integrations.torchtitan \
        --module bench.common.torchtitan_registry --config tiny_moe ...

Real torchrun, real torchtitan (its DeepSeek-V3, its FSDP2 / replicate, its DCP checkpointer), gloo
on CPU (the launcher points torchtitan at the CPU on a host without CUDA). Faults come from
$MOEGUARD_TT_FAULTS inside torchtitan's own loss (bench/common/torchtitan_registry.py); each rank writes its
decisions ($MOEGUARD_DECISION_LOG), a digest of its parameters and torchtitan's own expert counters
($MOEGUARD_TT_PROBE_DIR) for the comparisons.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
from pathlib import Path

import polars as pl
import pytest
import torch

pytest.importorskip(
    "torchtitan", reason="torchtitan (and triton) not installed: pip install torchtitan==0.3.0 triton"
)

from bench.common.torchtitan_launch import torchrun_command  # noqa: E402
from guard.core import schema  # noqa: E402
from guard.store.reader import read_meta, read_table  # noqa: E402
from tests.conftest import REPO  # noqa: E402
from tests.helpers_http import wait_until  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BATCH, SEQ, TOP_K = 8, 64, 2  # tiny_moe's local batch, sequence and router top-k


def job_pids(marker: str) -> list[int]:
    """Every process launched with MOEGUARD_TEST_JOB=<marker>: torchrun's agent and its workers
    (which torchrun starts in sessions of their own, out of reach of a killpg of the agent)."""
    out = []
    for pid in (int(p) for p in os.listdir("/proc") if p.isdigit()):
        try:
            env = set(Path(f"/proc/{pid}/environ").read_bytes().split(b"\0"))
        except OSError:
            continue
        if f"MOEGUARD_TEST_JOB={marker}".encode() in env:
            out.append(pid)
    return out


def kill_job(marker: str) -> None:
    """kill -9 of the whole job: the agent and every rank."""
    for pid in job_pids(marker):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def launch(tmp: Path, run: str, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """The README's command on two ranks, in its own process group (so a test can kill -9 it)."""
    cmd = torchrun_command(
        2, "tiny_moe", "--dump_folder", str(tmp / "out"), "--run-dir", str(tmp / run), *args
    )
    full_env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "OMP_NUM_THREADS": "1",
        "MOEGUARD_DECISION_LOG": str(tmp / "decisions"),
        "MOEGUARD_TT_PROBE_DIR": str(tmp / "probe"),
        "MOEGUARD_TEST_JOB": str(tmp / run),  # how kill_job finds every process of this job
        **(env or {}),
    }
    full_env.pop(schema.ENV_COLLECTOR, None)
    log = open(tmp / f"{run}.log", "ab")
    return subprocess.Popen(
        cmd, cwd=REPO, env=full_env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def finish(proc: subprocess.Popen, tmp: Path, run: str, timeout: float = 420) -> int:
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_job(str(tmp / run))
        raise AssertionError(
            f"torchrun did not finish; log:\n{(tmp / f'{run}.log').read_text()[-4000:]}"
        ) from None


def decisions(tmp: Path, rank: int) -> list[str]:
    return (tmp / "decisions" / f"decisions-r{rank}.txt").read_text().splitlines()


def _decided(tmp: Path, step: int) -> bool:
    """Both ranks have logged their decision for `step`."""
    logs = [tmp / "decisions" / f"decisions-r{r}.txt" for r in (0, 1)]
    return all(p.is_file() and f"\n{step} " in "\n" + p.read_text() for p in logs)


def guard_state(checkpoint: Path) -> dict:
    """The guard's state as torchtitan's checkpoint holds it (key 'moeguard')."""
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    sd = _load_state_dict_from_keys(keys={"moeguard"}, checkpoint_id=str(checkpoint))
    blob = sd["moeguard"]["blob"]
    raw = blob.getvalue() if isinstance(blob, io.BytesIO) else bytes(blob)
    return torch.load(io.BytesIO(raw), weights_only=False)


@pytest.mark.timeout(900)
def test_a_fault_on_one_rank_is_one_decision_on_every_rank_and_the_replicas_stay_identical(
    tmp_path: Path,
) -> None:
    """Replicated data parallel (every rank holds every parameter, so they can be compared):
    a x1000 loss spike on rank 1 only at step 35 (past the spike rules' 32-step warm-up), a NaN
    on rank 0 only at step 40."""
    run = "faults"
    proc = launch(
        tmp_path,
        run,
        "--training.steps",
        "45",
        "--checkpoint.interval",
        "1000",
        "--parallelism.data_parallel_replicate_degree",
        "2",
        "--parallelism.data_parallel_shard_degree",
        "1",
        env={"MOEGUARD_TT_FAULTS": "gradspike@35:1000/r1,nan@40/r0"},
    )
    assert finish(proc, tmp_path, run) == 0, (tmp_path / f"{run}.log").read_text()[-4000:]
    r0, r1 = decisions(tmp_path, 0), decisions(tmp_path, 1)
    assert r0 == r1 and len(r0) == 45 and not any("DIVERGED" in line for line in r0)
    skipped = [int(line.split()[0]) for line in r0 if line.split()[1] != schema.ACT_APPLY]
    assert skipped == [35, 40]
    # the replicas are bit-identical after the last update
    d0, d1 = ((tmp_path / "probe" / f"digest-r{r}.txt").read_text().split() for r in (0, 1))
    assert d0 == d1 and d0[0] == "44"
    steps = read_table(tmp_path / run, "steps").sort("step")
    assert steps["step"].to_list() == list(range(45))
    assert steps.filter(pl.col("action") != schema.ACT_APPLY)["step"].to_list() == [35, 40]
    assert steps["tokens"].unique().to_list() == [2 * BATCH * SEQ]  # both ranks' tokens
    # stored loads are torchtitan's own counters summed over the ranks (applied steps: the hook
    # that recorded them runs inside optimizer.step)
    counts = [
        {
            row["step"]: row["counts"]
            for row in map(json.loads, (tmp_path / "probe" / f"counts-r{r}.jsonl").open())
        }
        for r in (0, 1)
    ]
    experts = read_table(tmp_path / run, "experts")
    stored = {
        (int(s), int(la)): g.sort("expert")["load"].to_list()
        for (s, la), g in experts.group_by(["step", "layer"], maintain_order=True)
    }
    compared = 0
    for step, per_layer in counts[0].items():
        for layer, c0 in per_layer.items():
            c1 = counts[1][step][layer]
            assert stored[(step, int(layer))] == [round(a + b) for a, b in zip(c0, c1, strict=True)]
            assert sum(stored[(step, int(layer))]) == 2 * BATCH * SEQ * TOP_K
            compared += 1
    assert compared == 43 * 3  # 43 applied steps x 3 MoE layers
    meta = read_meta(tmp_path / run)
    assert meta["status"] == schema.STATUS_FINISHED and meta["world_size"] == 2
    assert meta["env"]["world_size"] == 2 and meta["flops_per_token"] > 0
    assert meta["guard_actions"][schema.ACT_SKIP] == 2


@pytest.mark.timeout(900)
def test_kill_9_and_relaunch_resume_from_torchtitans_checkpoint_with_the_guards_baselines(
    tmp_path: Path,
) -> None:
    """FSDP over both ranks, a checkpoint every 10 steps; the job is SIGKILLed while it sits in
    step 25 (after the step-20 checkpoint) and launched again with the same command."""
    run = "resumed"
    args = ("--training.steps", "40", "--checkpoint.interval", "10")
    proc = launch(tmp_path, run, *args, env={"MOEGUARD_TT_FAULTS": "hang@25:300"})
    ckpt = tmp_path / "out" / "checkpoint"
    try:
        # the rows up to the checkpoint are on disk when it exists; the kill lands inside step 25
        # (hung there): both ranks have decided step 24 (a fixed 3 s sleep waited for this before)
        wait_until(lambda: (ckpt / "step-20").is_dir() or proc.poll() is not None, timeout=600)
        wait_until(lambda: _decided(tmp_path, 24) or proc.poll() is not None, timeout=300)
    finally:
        kill_job(str(tmp_path / run))  # the whole job: torchrun's agent and both ranks
    proc.wait(timeout=30)
    wait_until(lambda: not job_pids(str(tmp_path / run)), timeout=30)
    assert not (ckpt / "step-40").exists(), "the job finished before it was killed"
    first = guard_state(ckpt / "step-20")
    assert first["step"] == 20
    relaunched = launch(tmp_path, run, *args)
    assert finish(relaunched, tmp_path, run) == 0, (tmp_path / f"{run}.log").read_text()[-4000:]
    last = guard_state(ckpt / "step-40")
    # baselines carried on from step 20, not rebuilt from nothing after the relaunch
    det0, det1 = first["guard"]["detectors"], last["guard"]["detectors"]
    assert det0["loss_spike"]["n_accepted"] == 20 and det1["loss_spike"]["n_accepted"] == 40
    assert last["counts"][schema.ACT_APPLY] == 40
    steps = read_table(tmp_path / run, "steps").sort("step")
    assert steps["step"].to_list() == list(range(40))  # each step once: the killed attempt's tail was dropped
    meta = read_meta(tmp_path / run)
    assert meta["status"] == schema.STATUS_FINISHED and meta["restarts"] == 1
    resumes = read_table(tmp_path / run, "events").filter(pl.col("kind") == schema.EV_RESUME)
    assert resumes["step"].to_list() == [20]
    assert json.loads(resumes["detail"].item())["checkpoint"] == "step-20"


@pytest.mark.timeout(600)
def test_no_guard_is_torchtitans_own_trainer_untouched(tmp_path: Path) -> None:
    """`--no-guard` (the overhead and canary baseline): torchtitan trains, nothing of moeguard's runs."""
    run = "plain"
    proc = launch(tmp_path, run, "--training.steps", "5", "--checkpoint.interval", "1000", "--no-guard")
    assert finish(proc, tmp_path, run) == 0, (tmp_path / f"{run}.log").read_text()[-4000:]
    assert not (tmp_path / run).exists()  # no run store
    assert not (tmp_path / "decisions").exists()  # no guard decided anything
    assert len((tmp_path / "probe" / "digest-r0.txt").read_text().split()) == 2  # torchtitan stepped
