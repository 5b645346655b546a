"""Multi-rank training: real torchrun, gloo, 2 ranks with 1 torch thread each, the micro config.

What must hold across ranks: a fault on ONE rank leads to the same decision on every rank (and a
genuinely divergent guard halts before anything is applied); a slow rank is named as the
straggler; a hung rank is named by the collector (HeartbeatLost{rank}); operator commands act
on the whole job; a killed job resumes bitwise, on its own under `torchrun --max-restarts`, and
on another world size (DCP checkpoints, a world-size independent data position).

The first tests are in-process and fast; the torchrun ones are marked slow + integration.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import polars as pl
import pytest

from guard.core import schema
from guard.store.reader import read_meta, read_table
from tests.conftest import MICRO, REPO, train_micro

STEPS = 40  # the restart tests' run length (checkpoints every 10 steps in the micro config)
slow = [pytest.mark.slow, pytest.mark.integration]


# ---------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------
def torchrun_cmd(run_dir: Path, *args: str, nproc: int = 2, restarts: int = 0) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        f"--max-restarts={restarts}",
        "-m",
        "guard",
        "train",
        "--config",
        str(MICRO),
        "--run-dir",
        str(run_dir),
        "--no-progress",
        *args,
    ]


def run(
    cmd: list[str], timeout: float = 240, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    e = {**os.environ, **(env or {})}
    e.pop(schema.ENV_COLLECTOR, None)
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=e)
    return p


def descendants(pid: int) -> list[int]:
    """Every process below `pid` (torchrun starts its workers in sessions of their own, so
    killing its process group would leave them running)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def kill_job(p: subprocess.Popen) -> None:
    """SIGKILL the launcher and all its workers at once, like a node loss."""
    for pid in [p.pid, *descendants(p.pid)]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    p.wait(timeout=30)


def steps_of(run_dir: Path) -> pl.DataFrame:
    return read_table(run_dir, schema.TABLE_STEPS).sort("step")


def events_of(run_dir: Path) -> pl.DataFrame:
    return read_table(run_dir, schema.TABLE_EVENTS)


# ---------------------------------------------------------------------------------------
# fast: parsing, data position, fingerprints, operator commands in one process
# ---------------------------------------------------------------------------------------
def test_injections_target_one_rank() -> None:
    from trainer.callbacks.fault_injection import FaultInjection
    from trainer.inject import Injection, parse_injection

    assert parse_injection("nan@45/r1") == Injection("nan", 45, 0.0, 1)
    assert parse_injection("gradspike@45:50@rank1") == Injection("gradspike", 45, 50.0, 1)
    assert str(parse_injection("gradspike@45:50/r1")) == "gradspike@45:50/r1"
    assert parse_injection("gradspike@45:50").rank is None  # unchanged: every rank
    injs = [
        parse_injection(s) for s in ("nan@45/r1", "stall@3:2", "slowrank@10:0.2/r0", "crash@50", "hang@60/r0")
    ]
    r0, r1 = FaultInjection(injs, rank=0), FaultInjection(injs, rank=1)
    assert r0.due(45, "nan") is None and r1.due(45, "nan") is not None
    assert r0.due(3, "stall") and r1.due(3, "stall")
    assert (r0.slow_s(9), r0.slow_s(10), r0.slow_s(500), r1.slow_s(500)) == (0.0, 0.2, 0.2, 0.0)
    restarted = FaultInjection(injs, rank=0, attempt=1)  # a torchrun restart replays the command line
    assert restarted.due(50, "crash") is None and restarted.due(60, "hang") is None
    assert restarted.due(3, "stall") is not None


def test_data_position_does_not_depend_on_the_world_size() -> None:
    from trainer.config import load_config
    from trainer.data import DataLoader

    cfg = load_config(MICRO)

    def loader(rank: int, world: int) -> DataLoader:
        return DataLoader(cfg.data, vocab_size=256, seed=0, rank=rank, world_size=world)

    two = [loader(0, 2), loader(1, 2)]
    for _ in range(7):
        for dl in two:
            dl.next_batch()
    state = two[0].state_dict()
    assert state == two[1].state_dict() == {"epoch": 0, "sample": 7 * 4 * 2}
    # what 2 ranks would read next == what 1 rank reads in its next 2 steps
    nxt2 = {tuple(r) for dl in two for r in dl.next_batch().tolist()}
    one = loader(0, 1)
    one.load_state_dict(state)
    nxt1 = {tuple(r) for _ in range(2) for r in one.next_batch().tolist()}
    assert nxt1 == nxt2 and len(nxt1) == 8
    # and back: 1 -> 2 ranks continues where the single rank stopped
    back = [loader(0, 2), loader(1, 2)]
    for dl in back:
        dl.load_state_dict(one.state_dict())
    assert back[0].sample == back[1].sample == 7 * 8 + 2 * 4


def test_decision_fingerprint_covers_what_changes_state() -> None:
    from guard.core.policy import Decision
    from trainer.distributed import decision_fingerprint

    a = Decision(step=5)
    assert decision_fingerprint(a) == decision_fingerprint(Decision(step=5))
    for other in (
        Decision(step=5, action=schema.ACT_SKIP),
        Decision(step=5, lr_scale=0.5),
        Decision(step=5, bias_boost={1: 10.0}),
        Decision(step=5, skip_batches=20),
        Decision(step=5, action=schema.ACT_CLIP, grad_scale=0.1),
    ):
        assert decision_fingerprint(other) != decision_fingerprint(a)
    assert 0 <= decision_fingerprint(a) < 2**31
    # two ranks that both clip must clip by the same factor
    clip = Decision(step=5, action=schema.ACT_CLIP, grad_scale=0.1)
    assert decision_fingerprint(clip) != decision_fingerprint(
        Decision(step=5, action=schema.ACT_CLIP, grad_scale=0.2)
    )


class FakeExporter:
    """The Exporter surface the trainer uses; hands out scripted operator commands."""

    def __init__(self, script: dict[int, dict[str, Any]]) -> None:
        self.script, self.polls, self.reports, self.metas, self.phases = script, 0, [], [], []

    def poll_commands(self) -> list[dict[str, Any]]:
        self.polls += 1
        return [self.script[self.polls]] if self.polls in self.script else []

    def submit(self, rep: Any, events: Any = ()) -> None:
        self.reports.append(rep)

    def set_meta(self, meta: dict[str, Any]) -> None:
        self.metas.append(meta)

    def set_phase(self, phase: str) -> None:
        self.phases.append(phase)

    def add_side(self, table: str, row: dict[str, Any]) -> None:
        pass

    def close(self, timeout: float = 30, final: bool | None = None, goodbye: dict | None = None) -> bool:
        return True


def test_operator_commands_apply_at_the_next_step(tmp_path: Path) -> None:
    from trainer.config import load_config
    from trainer.loop import Trainer
    from trainer.outcome import EXIT_HALTED

    # poll k happens during step k-1; its command applies at step k
    script = {
        6: {"id": 1, "action": "skip", "reason": "drill"},
        14: {"id": 2, "action": "rollback", "reason": "drill"},
        20: {"id": 3, "action": "halt", "reason": "drill"},
    }
    cfg = load_config(MICRO, {"train.steps": 40, "guard.policy.snapshot_every": 5})
    exp = FakeExporter(script)
    t = Trainer(cfg, tmp_path / "r", progress=False, exporter=exp)
    assert t.run() == EXIT_HALTED
    actions = dict(
        zip(*steps_of(tmp_path / "r").select("step", "action").to_dict(as_series=False).values(), strict=True)
    )
    assert (actions[6], actions[14], actions[20]) == (schema.ACT_SKIP, schema.ACT_ROLLBACK, schema.ACT_HALT)
    assert max(actions) == 20 and sum(a != schema.ACT_APPLY for a in actions.values()) == 3
    ops = events_of(tmp_path / "r").filter(pl.col("kind") == schema.EV_OPERATOR).sort("step")
    assert ops["step"].to_list() == [6, 14, 20] and ops["action"].to_list() == ["skip", "rollback", "halt"]
    assert all(json.loads(d)["reason"] == "drill" for d in ops["detail"])
    rb = events_of(tmp_path / "r").filter(
        (pl.col("kind") == schema.EV_ACTION) & (pl.col("action") == "rollback")
    )
    assert json.loads(rb["detail"].item())["restored_step"] == 10  # newest snapshot before step 14
    meta = read_meta(tmp_path / "r")
    assert meta["status"] == schema.STATUS_HALTED and exp.metas[-1]["status"] == schema.STATUS_HALTED
    assert set(meta["goodput"]) >= {
        "goodput",
        "wall_s",
        "productive_s",
        "data_wait_s",
        "checkpoint_s",
        "skipped_s",
        "rolled_back_s",
        "startup_s",
        "restarts_s",
    }
    assert meta["goodput"]["rolled_back_s"] > 0 and meta["goodput"]["skipped_s"] > 0


# ---------------------------------------------------------------------------------------
# torchrun: one drill run with faults on one rank
# ---------------------------------------------------------------------------------------
DRILL = [
    "--steps",
    "70",
    "--set",
    "telemetry.straggler_every=10",
    "--set",
    "guard.policy.snapshot_every=5",
    "--set",
    "guard.stall.min_seconds=0.3",
    "--inject",
    "slowrank@0:0.04/r1",  # rank 1 computes 40 ms longer every step: a straggler
    "--inject",
    "stall@30:0.8/r1",  # rank 1's loader stalls: every rank must see the stall
    "--inject",
    "nan@45/r1",  # a NaN in rank 1's local gradient
    "--inject",
    "gradspike@48:500/r0",  # a spike in rank 0's local gradient
    "--inject",
    "lrspike@56:100/r1",
]  # only rank 1's LR is wrong: the guards disagree -> halt


@pytest.fixture(scope="module")
def drill(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[tuple[Path, Path, subprocess.CompletedProcess]]:
    root = tmp_path_factory.mktemp("drill")
    p = run(torchrun_cmd(root / "run", *DRILL), env={"MOEGUARD_DECISION_LOG": str(root / "decisions")})
    yield root / "run", root / "decisions", p


def _decisions(d: Path, rank: int) -> list[str]:
    return (d / f"decisions-r{rank}.txt").read_text().splitlines()


@pytest.mark.slow
@pytest.mark.integration
def test_one_rank_faults_give_identical_decisions_on_every_rank(drill: Any) -> None:
    run_dir, dec, p = drill
    r0, r1 = _decisions(dec, 0), _decisions(dec, 1)
    before = [ln for ln in r0 if int(ln.split()[0]) < 56]
    assert before == [ln for ln in r1 if int(ln.split()[0]) < 56], "ranks decided differently"
    assert "DIVERGED" not in "".join(before)
    by_step = {int(ln.split()[0]): ln.split()[1] for ln in before if "snapshot" not in ln}
    # caught on both ranks, before any update: the NaN skipped; the finite spike clipped (the
    # default policy, clip_spikes), the same decision and fingerprint on every rank
    assert (by_step[45], by_step[48]) == (schema.ACT_SKIP, schema.ACT_CLIP)
    assert sum(a not in schema.APPLYING_ACTIONS for a in by_step.values()) == 1  # a correction applies
    assert sum("snapshot" in ln for ln in before) >= 3  # snapshots taken at the same steps too
    ev = events_of(run_dir)
    v = ev.filter(pl.col("kind") == schema.EV_VERDICT)
    seen = set(zip(v["step"].to_list(), v["detector"].to_list(), strict=True))
    # which spike rule catches a one-rank 500x spike at step 48 (before the tail rules' 100-step
    # warm-up: the total or the per-layer early cap, 50-100x / 100-200x) does not matter here;
    # that both ranks do does
    assert {(48, schema.DET_GRAD_SPIKE), (48, schema.DET_LAYER_GRAD_SPIKE)} & seen, seen
    assert {(45, schema.DET_NONFINITE), (30, schema.DET_STALL)} <= set(
        zip(v["step"].to_list(), v["detector"].to_list(), strict=True)
    )
    # the micro config's grad_clip is tighter than the guard's clip: step 48 applied the update
    # the unguarded run takes (no guard action), its verdicts kept with the clip named
    spikes = (schema.DET_GRAD_SPIKE, schema.DET_LAYER_GRAD_SPIKE)
    at48 = v.filter((pl.col("step") == 48) & pl.col("detector").is_in(spikes))
    assert at48.height and set(at48["action"]) == {schema.ACT_NONE}
    assert all("within_grad_clip" in json.loads(d) for d in at48["detail"])
    steps = steps_of(run_dir)
    assert steps.filter(pl.col("step").is_in([45, 48])).sort("step")["action"].to_list() == [
        schema.ACT_SKIP,
        schema.ACT_APPLY,
    ]
    # rank 0's steps row carries the slowest rank's data wait (the step waited for it)
    assert steps.filter(pl.col("step") == 30)["data_wait_s"].item() >= 0.8


@pytest.mark.slow
@pytest.mark.integration
def test_divergent_guard_decisions_halt_every_rank(drill: Any) -> None:
    run_dir, dec, p = drill
    for rank in (0, 1):
        last = _decisions(dec, rank)[-1].split()
        assert last[0] == "56" and last[-1] == "DIVERGED"
    assert "exitcode  : 3" in p.stderr  # the workers' EXIT_HALTED (torchrun itself exits 1)
    halt = events_of(run_dir).filter(pl.col("kind") == schema.EV_HALT)
    d = json.loads(halt["detail"].item())
    assert halt["step"].item() == 56 and "diverged" in d["reason"]
    # rank 1's guard saw a third step verdict within its skip window and escalated; rank 0's saw none
    assert d["actions_by_rank"] == [schema.ACT_APPLY, schema.ACT_ROLLBACK]
    assert read_meta(run_dir)["status"] == schema.STATUS_HALTED
    assert steps_of(run_dir)["step"].max() == 56


@pytest.mark.slow
@pytest.mark.integration
def test_slowed_rank_is_flagged_as_straggler_and_the_other_not(drill: Any) -> None:
    run_dir, _, _ = drill
    ranks = read_table(run_dir, schema.TABLE_RANKS).sort("step", "rank")
    assert ranks["step"].unique().to_list() == [9, 19, 29, 39, 49]  # one all_gather every 10 steps
    score = {r: ranks.filter(pl.col("rank") == r)["straggler_score"].to_numpy() for r in (0, 1)}
    assert (score[0] == 1.0).all()
    assert np.median(score[1]) < 0.75
    ev = events_of(run_dir).filter(pl.col("kind") == schema.EV_STRAGGLER)
    flagged = [json.loads(d) for d in ev["detail"]]
    assert flagged and {d["rank"] for d in flagged if not d.get("recovered")} == {1}
    meta = read_meta(run_dir)
    assert meta["env"]["world_size"] == 2 and meta["env"]["parallel"] == "ddp"


# ---------------------------------------------------------------------------------------
# torchrun: kill -9, restarts, resume on another world size, FSDP
# ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> pl.DataFrame:
    d = tmp_path_factory.mktemp("ref") / "run"
    p = run(torchrun_cmd(d, "--steps", str(STEPS)))
    assert p.returncode == 0, p.stderr[-3000:]
    return steps_of(d)


def _assert_same_trajectory(got: pl.DataFrame, ref: pl.DataFrame) -> None:
    assert got["step"].to_list() == list(range(STEPS)), "each step exactly once"
    # CPU, deterministic algorithms, same world size: bitwise
    assert got["loss"].to_list() == ref["loss"].to_list()
    assert got["grad_norm"].to_list() == ref["grad_norm"].to_list()


@pytest.mark.slow
@pytest.mark.integration
def test_torchrun_restart_resumes_on_its_own_bitwise(tmp_path: Path, reference: pl.DataFrame) -> None:
    d = tmp_path / "run"
    p = run(torchrun_cmd(d, "--steps", str(STEPS), "--inject", "crash@25/r1", restarts=1))
    assert p.returncode == 0, p.stderr[-3000:]
    assert "torchrun restart 1: resuming from" in p.stderr
    _assert_same_trajectory(steps_of(d), reference)
    meta = read_meta(d)
    assert meta["restarts"] == 1 and meta["status"] == schema.STATUS_FINISHED
    assert meta["goodput"]["restarts_s"] > 0  # progress after the step-20 checkpoint was lost
    resume = events_of(d).filter(pl.col("kind") == schema.EV_RESUME)
    assert json.loads(resume["detail"].item())["checkpoint"] == "step-000000020"


@pytest.mark.slow
@pytest.mark.integration
def test_kill_9_mid_run_then_resume_matches_an_uninterrupted_run(
    tmp_path: Path, reference: pl.DataFrame
) -> None:
    d = tmp_path / "run"
    # 50 ms of sleep per step on both ranks (no effect on the numbers) gives the kill a window
    cmd = torchrun_cmd(d, "--steps", str(STEPS), "--inject", "slowrank@0:0.05")
    e = {k: v for k, v in os.environ.items() if k != schema.ENV_COLLECTOR}
    p = subprocess.Popen(cmd, cwd=REPO, env=e, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 180
    while not (d / schema.CHECKPOINT_DIR / "step-000000020" / "host.pt").is_file():
        assert p.poll() is None and time.monotonic() < deadline, "no checkpoint at step 20"
        time.sleep(0.05)
    kill_job(p)
    assert read_meta(d)["status"] == schema.STATUS_RUNNING  # nobody got to say anything
    assert steps_of(d)["step"].max() < STEPS - 1
    shutil.copytree(d, tmp_path / "one")  # the same killed run, resumed below on ONE process
    p = run(torchrun_cmd(d, "--steps", str(STEPS), "--resume"))
    assert p.returncode == 0, p.stderr[-3000:]
    _assert_same_trajectory(steps_of(d), reference)
    assert read_meta(d)["restarts"] == 1
    # 2 -> 1 ranks: DCP reshards, the data position continues in the global stream (one process:
    # this one)
    assert train_micro(tmp_path / "one", overrides={"train.steps": STEPS}, resume=True).exit_code == 0
    one = steps_of(tmp_path / "one")
    assert one["step"].to_list() == list(range(STEPS)) and one["loss"].is_finite().all()
    assert one.filter(pl.col("step") < 20)["loss"].to_list() == reference.head(20)["loss"].to_list()
    assert (one.filter(pl.col("step") >= 20)["tokens"] == 4 * 32).all()  # one rank's batch per step now
    ev = json.loads(events_of(tmp_path / "one").filter(pl.col("kind") == schema.EV_RESUME)["detail"].item())
    assert (ev["saved_world_size"], ev["world_size"]) == (2, 1)


@pytest.mark.slow
@pytest.mark.integration
def test_fsdp_matches_ddp_and_its_checkpoint_resumes_on_one_process(
    tmp_path: Path, reference: pl.DataFrame
) -> None:
    d = tmp_path / "fsdp"
    p = run(torchrun_cmd(d, "--steps", str(STEPS), "--until", "20", "--set", 'train.parallel="fsdp"'))
    assert p.returncode == 0, p.stderr[-3000:]
    got, ref = steps_of(d), reference.head(20)
    assert read_meta(d)["env"]["parallel"] == "fsdp"
    # sharded grads: per-layer norms from all-reduced sums of squares equal the replicated ones
    np.testing.assert_allclose(got["grad_norm"].to_numpy(), ref["grad_norm"].to_numpy(), rtol=1e-4)
    np.testing.assert_allclose(got["loss"].to_numpy(), ref["loss"].to_numpy(), rtol=1e-4)
    # precursors: each rank samples its own shard, the sums ride in the same all-reduce
    np.testing.assert_allclose(
        got["update_ratio"][1:].to_numpy(), ref["update_ratio"][1:].to_numpy(), rtol=0.1
    )
    layers = read_table(d, schema.TABLE_LAYERS).filter(pl.col("step") == 5).sort("layer")
    assert layers.height == 2 and layers["grad_norm"].is_finite().all()
    # max attention logits: sampled every 10th step, MAX-reduced across ranks (no deadlock)
    logit = got["max_logit"].to_numpy()
    assert np.isfinite(logit[::10]).all() and np.isnan(logit[1:10]).all(), logit
    # the FSDP checkpoint resumed on one process: this one
    assert train_micro(d, overrides={"train.steps": STEPS}, resume=True).exit_code == 0
    assert steps_of(d)["step"].to_list() == list(range(STEPS))
    assert steps_of(d)["loss"].is_finite().all()


# ---------------------------------------------------------------------------------------
# torchrun + a real collector: a hung rank is named; operator commands reach every rank
# ---------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.integration
def test_hung_rank_shows_as_heartbeat_lost_and_operator_commands_apply(tmp_path: Path) -> None:
    from tests.helpers_collector import CollectorProc

    c = CollectorProc(
        tmp_path / "collected",
        "--heartbeat-floor",
        "2",
        "--no-detectors",
        "--insecure-no-auth",
        "--progress-floor",
        "2",
        token=None,
    ).start()
    run_dir = tmp_path / "hung"
    job = None
    try:
        # queued before the job starts: rank 0 picks it up with its first batch and every rank skips
        cmd = httpx.post(f"{c.url}/v1/runs/hung/commands", json={"action": "skip", "reason": "drill"}).json()
        assert cmd["ok"], cmd
        args = torchrun_cmd(
            run_dir,
            "--steps",
            "1000",
            "--collector",
            c.url,
            "--set",
            "telemetry.straggler_every=10",
            "--inject",
            "hang@60/r1",
        )
        job = subprocess.Popen(args, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        lost = ("moeguard_heartbeat_lost", (("rank", "1"), ("run", "hung")))
        deadline = time.monotonic() + 150
        m: dict = {}
        while time.monotonic() < deadline:
            m = c.metrics()
            if m.get(lost) == 1.0:
                break
            assert job.poll() is None, "the job ended instead of hanging"
            time.sleep(0.5)
        assert m.get(lost) == 1.0, {k: v for k, v in m.items() if "heartbeat" in k[0]}
        time.sleep(1.5)  # rank 0 waits in the all-reduce: its heartbeat continues
        m = c.metrics()
        assert m[("moeguard_heartbeat_lost", (("rank", "0"), ("run", "hung")))] == 0.0
        assert m[("moeguard_heartbeat_lost", (("rank", "1"), ("run", "hung")))] == 1.0
        assert m[("moeguard_step", (("run", "hung"),))] == 59.0
        for rank in ("0", "1"):  # each rank's score, gathered in the job and sent in rank 0's batch
            assert 0 < m[("moeguard_straggler_score", (("rank", rank), ("run", "hung")))] <= 1
        assert 0 < m[("moeguard_goodput_ratio", (("run", "hung"),))] <= 1  # the trainer's, from its meta
        ranks = httpx.get(f"{c.url}/v1/runs").json()["runs"][0]["ranks"]
        assert ranks["1"]["lost"] is True and ranks["0"]["lost"] is False
        # rank 0 sits in a real all-reduce, beating, not advancing: stuck (RunStuck), rank 1 lost, not stuck
        stuck0 = ("moeguard_rank_stuck", (("phase", "train"), ("rank", "0"), ("run", "hung")))
        deadline = time.monotonic() + 60
        while (m := c.metrics()).get(stuck0) != 1.0 and time.monotonic() < deadline:
            time.sleep(0.5)
        assert m.get(stuck0) == 1.0, {k: v for k, v in m.items() if "stuck" in k[0] or "progress" in k[0]}
        stuck1 = [
            v for (name, labels), v in m.items() if name == "moeguard_rank_stuck" and ("rank", "1") in labels
        ]
        assert stuck1 and not any(stuck1), stuck1  # lost, so not stuck (whatever phase it last said)
        assert m[("moeguard_run_stuck_ranks", (("phase", "train"), ("run", "hung")))] == 1.0
    finally:
        if job is not None:
            kill_job(job)
        c.stop()
    ops = events_of(run_dir).filter(pl.col("kind") == schema.EV_OPERATOR)
    assert ops.height == 1 and ops["action"].item() == schema.ACT_SKIP
    step = ops["step"].item()
    assert steps_of(run_dir).filter(pl.col("step") == step)["action"].item() == schema.ACT_SKIP
