"""GuardedStep's service half: a plain loop streams, measures and ends like `moeguard train`.

A third-party loop (tests/guard/test_api.py's Net) against a real collector on loopback: what it
streams, MFU against the shared peak rules, the environment fingerprint, data wait through
batches(), and the run's status when it ends normally, on SIGTERM and on an exception.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import torch

from guard.api import GuardedStep
from guard.core import schema
from guard.store.reader import read_meta, read_table
from tests.conftest import REPO
from tests.guard.test_api import Net
from tests.helpers_collector import TOKEN, CollectorProc
from tests.helpers_http import wait_until

AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def collector(tmp_path: Path) -> Iterator[CollectorProc]:
    c = CollectorProc(tmp_path / "collector-runs").start()
    try:
        yield c
    finally:
        c.stop()


def slow_loader(n: int, wait_s: float) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    for _ in range(n):
        time.sleep(wait_s)
        yield torch.randn(64, 16, generator=g), torch.randn(64, generator=g)


@pytest.mark.integration
def test_a_plain_loop_streams_measures_and_ends_like_the_trainer(
    tmp_path: Path,
    collector: CollectorProc,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    import guard.runtime.session as session

    monkeypatch.setenv(schema.ENV_TOKEN, TOKEN)
    monkeypatch.setattr(session, "peak_flops", lambda device, dtype: (1e9, "test: 1 GFLOP/s"))
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    run_dir = tmp_path / "plain-loop"
    with GuardedStep(model, opt, run_dir=run_dir, collector=collector.url, flops_per_token=1000.0) as guarded:
        for x, y in guarded.batches(slow_loader(30, 0.02)):
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            guarded.step(loss, tokens=64)
    steps = read_table(run_dir, "steps").sort("step")
    assert steps.height == 30
    # MFU = flops/token x tokens/s / peak, the trainer's definition, against the shared peak rules
    mfu = steps["mfu"].to_numpy()
    expect = 1000.0 * steps["tokens_per_s"].to_numpy() / 1e9
    assert abs(mfu - expect).max() < 1e-12 and (mfu > 0).all()
    assert (steps["data_wait_s"].to_numpy()[1:] >= 0.015).all()  # the loader's sleep, through batches()
    meta = read_meta(run_dir)
    assert meta["status"] == schema.STATUS_FINISHED and meta["final_step"] == 30
    env = meta["env"]
    for key in ("torch", "cuda", "device", "attention_backend", "world_size", "git_sha", "peak_flops"):
        assert key in env, key
    assert env["peak_flops"] == 1e9 and env["world_size"] == 1 and meta["flops_per_token"] == 1000.0
    assert "run plain-loop: 30 steps, 30 updates applied" in capsys.readouterr().err  # the trainer's summary
    # the collector has the same run: its rows, its meta and a final batch (not lost)
    wait_until(lambda: (collector.runs / "plain-loop" / "meta.json").is_file(), timeout=30)
    listing = httpx.get(f"{collector.url}/v1/runs", headers=AUTH).json()["runs"]
    run = next(r for r in listing if r["run"] == "plain-loop")
    assert run["last_step"] == 29
    metrics = httpx.get(f"{collector.url}/metrics").text
    assert 'moeguard_step{run="plain-loop"} 29' in metrics
    assert 'moeguard_heartbeat_lost{rank="0",run="plain-loop"} 1' not in metrics


def test_collector_without_a_run_dir_is_refused_by_name() -> None:
    model = Net()
    with pytest.raises(ValueError, match="needs run_dir="):
        GuardedStep(model, torch.optim.AdamW(model.parameters()), collector="http://127.0.0.1:1")


LOOP = textwrap.dedent(
    """
    import sys, time, torch
    sys.path.insert(0, {repo!r})
    from guard.api import GuardedStep
    from tests.guard.test_api import Net
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    guarded = GuardedStep(model, opt, run_dir={run_dir!r})
    try:
        for step in range(100000):
            x, y = torch.randn(64, 16), torch.randn(64)
            loss = ((model(x) - y) ** 2).mean()
            loss.backward()
            guarded.step(loss, tokens=64)
            if step == 5:
                print("ready", flush=True)
            if step == 8 and {crash!r}:
                raise RuntimeError("the user's loop broke")
    finally:
        guarded.close()
    """
)


def run_loop(tmp_path: Path, *, crash: bool) -> subprocess.Popen:
    code = LOOP.format(repo=str(REPO), run_dir=str(tmp_path / "run"), crash=crash)
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def test_sigterm_ends_the_run_as_preempted_with_exit_143(tmp_path: Path) -> None:
    p = run_loop(tmp_path, crash=False)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    p.send_signal(signal.SIGTERM)
    assert p.wait(timeout=60) == 143
    meta = read_meta(tmp_path / "run")
    assert meta["status"] == schema.STATUS_PREEMPTED and meta["final_step"] >= 6


def test_an_exception_in_the_loop_ends_the_run_as_crashed_naming_it(tmp_path: Path) -> None:
    p = run_loop(tmp_path, crash=True)
    assert p.wait(timeout=60) == 1
    meta = read_meta(tmp_path / "run")
    assert meta["status"] == schema.STATUS_CRASHED and "the user's loop broke" in meta["status_note"]
    assert meta["final_step"] == 9


def test_a_loop_that_never_closes_is_not_left_running(tmp_path: Path) -> None:
    code = textwrap.dedent(
        f"""
        import sys, torch
        sys.path.insert(0, {str(REPO)!r})
        from guard.api import GuardedStep
        from tests.guard.test_api import Net
        model = Net()
        guarded = GuardedStep(model, torch.optim.AdamW(model.parameters()), run_dir={str(tmp_path / "run")!r})
        for _ in range(3):
            loss = model(torch.randn(8, 16)).pow(2).mean()
            loss.backward()
            guarded.step(loss, tokens=8)
        """
    )
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
    meta = read_meta(tmp_path / "run")
    assert meta["status"] == schema.STATUS_CRASHED and "without GuardedStep.close()" in meta["status_note"]
    assert read_table(tmp_path / "run", "steps").height == 3  # the rows made it to disk


def test_the_standing_bias_updates_momentum_survives_a_resume(tmp_path: Path) -> None:
    """SMEBU keeps a momentum per layer; a framework's resume (state_dict -> load_state_dict) must
    bring it back, or the first steps after every resume update the bias differently."""
    pytest.importorskip("transformers")
    from guard.integrations.tiny import build
    from guard.integrations.transformers import attach

    def run(model: torch.nn.Module) -> GuardedStep:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return GuardedStep(model, opt, attach=attach(model, bias_update="smebu"))

    torch.manual_seed(0)
    model = build("deepseek_v3")
    guarded = run(model)
    for _ in range(3):
        x = torch.randint(0, 256, (2, 16))
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        guarded.step(loss, tokens=32)
    state = guarded.state_dict()
    assert state["corrector"]["momentum"], "SMEBU kept no momentum"
    guarded.close()
    fresh = run(build("deepseek_v3"))
    fresh.load_state_dict(state)
    assert fresh.corrector.state_dict() == state["corrector"]
    fresh.close()
