"""`moeguard canary --ab A B --script "CMD"` / `--torchtitan CONFIG.toml`: the A/B canary on the
user's own training, not on moeguard's canary model.

    moeguard canary --ab py:/opt/torch-2.13/bin/python py:/opt/torch-2.14/bin/python \\
        --script "{python} train.py --steps 200 --out {run_dir}/out"
    moeguard canary --ab set: set:OMP_NUM_THREADS=2 --script "python train.py" --inject slow:10
    moeguard canary --ab py:/opt/old/bin/python py:/opt/new/bin/python --torchtitan my_model.toml --steps 60

What runs. Each worker is one run of the command (a fresh process; it may start torchrun itself),
in the order, pairs and statistics of `--ab` (guard/canary/ab.py: ABBA pairs, the median per-pair
B/A ratio, its sign-test interval, the verdict, the report with the environment diff). The
command trains with GuardedStep or MoEGuardCallback and writes its run store where the canary
says: the canary hands every run a fresh run directory as $MOEGUARD_RUN_DIR (MoEGuardCallback's
default run_dir) and in the `{run_dir}` placeholder (for a loop that passes `run_dir=` itself);
the torchtitan launcher is given it as --run-dir. Other placeholders: `{python}` (the side's interpreter) and
`{steps}` (--steps; also $MOEGUARD_CANARY_STEPS). `--torchtitan JOB` runs torchtitan's own
trainer through moeguard's launcher: `torchrun --standalone --nproc_per_node NPROC -m
guard.integrations.torchtitan --run-dir RUN ARGS --dump_folder RUN/torchtitan [--training.steps N]`,
ARGS torchtitan's own (`--module M --config F ...`) given as one string or as a TOML file:

    module = "deepseek_v3"              # torchtitan's --module (a config registry)
    config = "deepseek_v3_debugmodel"   # its --config (the registry function)
    [training]                          # every other key: --training.local_batch_size 4
    local_batch_size = 4

(torchtitan 0.3.0 reads no TOML itself: --module / --config replaced its --job.config_file.)

Environments. `py:PATH`: the command runs with that interpreter: `{python}` is PATH and PATH's
directory leads $PATH, so a bare `python` is it too (a torchrun in that venv's bin likewise); a
venv without moeguard gets this checkout's on PYTHONPATH. `set:K=V,...`: this interpreter (its
directory leads $PATH the same way), with, for --script, these environment
variables of the command (OMP_NUM_THREADS=2, TORCH_..., your own switches); for --torchtitan,
torchtitan config overrides (`set:training.local_batch_size=4` -> `--training.local_batch_size 4`).

The measure. The steady state is every step at or after canary.warmup_steps in the run store's
`steps` table (`--set canary.warmup_steps=K`; the command must run more than K + 5 steps). On an
accelerator the speed is the median of its tokens_per_s (wall clock). On a CPU (or with
canary.timing = "cpu") the canary cannot put a CPU clock inside a command it did not write, so it
samples the CPU time of the command's process tree from outside (guard/canary/proc_cpu.py) and the
speed is the steady window's tokens per CPU-second: what the code costs, not how long it waited
for a shared core (wall clock is reported beside it). As in moeguard's own canary worker, that is
multiplied by a yardstick's CPU time: the command gets $MOEGUARD_CANARY_REFERENCE, and GuardedStep
(rank 0) times a fixed numpy workload after every step into the run's canary-reference.jsonl
(guard/canary/reference.py); its time leaves the command's, and its median divides out a neighbour
that slowed the core for both (a command without GuardedStep's yardstick is compared raw).
docs/BENCHMARKS.md measures how much noise is left. MFU where the run recorded it.
`--inject slow:PCT` sets $MOEGUARD_CANARY_SLOW_PCT for B's runs: GuardedStep burns PCT% of each
step (guard/canary/slow.py), whichever loop calls it (yours, MoEGuardCallback, the launcher).
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from guard.canary.ab import Side, WorkerFailed, measure_ab, parse_inject, parse_side, probe_interpreter
from guard.canary.ab_format import MFU_R, SPEED, TPS_RAW, TPS_WALL
from guard.canary.config import EXIT_FAIL, EXIT_PASS, TIMING_CPU, TIMING_WALL, Setup
from guard.canary.gate import FAIL
from guard.canary.keys import REFERENCE_ENV, RUN_DIR_ENV, SLOW_ENV, STEPS_ENV
from guard.canary.measure import new_run_dir, progress
from guard.canary.proc_cpu import CpuSampler
from guard.canary.reference import read_reference
from guard.core.tomlconf import ConfigError

SCRIPT, TORCHTITAN = "script", "torchtitan"
PLACEHOLDERS = ("{run_dir}", "{python}", "{steps}")
MIN_STEADY = 5  # steady-state steps a run must leave after canary.warmup_steps
SAMPLE_S = 0.05  # how often the command's process tree's CPU time is sampled
LAUNCHER = "guard.integrations.torchtitan"  # `python -m` it: torchtitan's trainer, guarded


@dataclass(kw_only=True, slots=True)
class Command:
    """What every worker runs: a script template, or torchtitan's trainer on a config."""

    kind: str  # SCRIPT | TORCHTITAN
    text: str  # the script as given, or the torchtitan job (a TOML file's path, or torchtitan's args)
    steps: int | None = None
    job: list[str] | None = None  # TORCHTITAN: torchtitan's own arguments (--module M --config F ...)
    nproc: int = 1  # TORCHTITAN: ranks (torchrun --nproc_per_node)
    reference: bool = True  # ask GuardedStep for the yardstick (CPU timing; off for canary.timing = "wall")

    @property
    def label(self) -> str:
        steps = f", {self.steps} steps" if self.steps else ""
        return f"{self.kind}: {self.text}{steps}"

    def argv(self, side: Side, run_dir: Path) -> list[str]:
        python = side.python or sys.executable
        if self.kind == TORCHTITAN:
            out = [
                python,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc_per_node={self.nproc}",
                "-m",
                LAUNCHER,
                "--run-dir",
                str(run_dir),
                *(self.job or []),
                "--dump_folder",  # a fresh one: torchtitan would resume from an earlier run's checkpoint
                str(run_dir / "torchtitan"),
            ]
            if self.steps:
                out += ["--training.steps", str(self.steps)]
            for key, value in side.overrides.items():
                out += [f"--{key}", str(value)]
            return out
        subst = {"{run_dir}": str(run_dir), "{python}": python, "{steps}": str(self.steps or "")}
        out = []
        for tok in shlex.split(self.text):
            for k, v in subst.items():
                tok = tok.replace(k, v)
            out.append(tok)
        return out

    def env(self, side: Side, run_dir: Path) -> dict[str, str]:
        env = {**os.environ, **side.extra_env, RUN_DIR_ENV: str(run_dir)}
        env.pop(SLOW_ENV, None)
        env.pop(STEPS_ENV, None)
        # a bare `python` (or torchrun) in the command is the side's interpreter (set: this one)
        bindir = os.path.dirname(side.python or sys.executable)
        env["PATH"] = os.pathsep.join(p for p in (bindir, env.get("PATH")) if p)
        if self.kind == SCRIPT:
            env.update({k: str(v) for k, v in side.overrides.items()})
        if self.steps:
            env[STEPS_ENV] = str(self.steps)
        if side.slow_pct:
            env[SLOW_ENV] = f"{side.slow_pct:g}"
        env.pop(REFERENCE_ENV, None)
        if self.reference:
            env[REFERENCE_ENV] = "1"
        return env


def torchtitan_job(text: str) -> list[str]:
    """torchtitan's arguments for a job: from a TOML file (top-level `module` and `config` name the
    config registry function, as torchtitan's --module / --config; every other `[section] key =
    value` becomes --section.key value), or torchtitan's own arguments as one string."""
    from guard.core.tomlconf import load_toml

    path = Path(text)
    if path.suffix == ".toml" or path.is_file():
        if not path.is_file():
            raise ConfigError(f"--torchtitan {text!r}: no such file (a torchtitan job TOML)")
        data = load_toml(path)
        missing = [k for k in ("module", "config") if not isinstance(data.get(k), str)]
        if missing:
            raise ConfigError(
                f"--torchtitan {text!r}: needs top-level {' and '.join(missing)} (torchtitan's --module "
                'and --config, e.g. module = "deepseek_v3", config = "deepseek_v3_debugmodel")'
            )
        out = ["--module", data.pop("module"), "--config", data.pop("config")]

        def flat(prefix: str, table: dict[str, Any]) -> None:
            for k, v in table.items():
                if isinstance(v, dict):
                    flat(f"{prefix}{k}.", v)
                else:
                    out.extend([f"--{prefix}{k}", str(v)])

        flat("", data)
        return out
    try:
        out = shlex.split(text)
    except ValueError as e:
        raise ConfigError(f"--torchtitan {text!r}: cannot split it into words ({e})") from None
    if "--module" not in out or "--config" not in out:
        raise ConfigError(
            f"--torchtitan {text!r}: expected a job TOML file or torchtitan's own arguments with "
            "--module M --config F"
        )
    return out


def parse_command(args: argparse.Namespace) -> Command:
    """--script / --torchtitan / --steps -> Command; a ConfigError names the bad value."""
    if args.steps is not None and args.steps < 1:
        raise ConfigError(f"--steps {args.steps}: must be >= 1")
    if args.nproc < 1:
        raise ConfigError(f"--nproc {args.nproc}: must be >= 1")
    if args.torchtitan is not None:
        return Command(
            kind=TORCHTITAN,
            text=args.torchtitan,
            steps=args.steps,
            job=torchtitan_job(args.torchtitan),
            nproc=args.nproc,
        )
    text = (args.script or "").strip()
    if not text:
        raise ConfigError('--script "": give the command that trains, e.g. --script "python train.py"')
    try:
        if not shlex.split(text):
            raise ValueError("empty")
    except ValueError as e:
        raise ConfigError(f"--script {args.script!r}: cannot split it into words ({e})") from None
    return Command(kind=SCRIPT, text=text, steps=args.steps)


def _pairs(items: list[str]) -> dict[str, Any]:
    """`set:` items as they are (strings): environment variables or torchtitan overrides."""
    return {k.strip(): v.strip() for k, _, v in (i.partition("=") for i in items)}


def prepare(args: argparse.Namespace, runs: Path) -> list[Side]:
    """A and B, their slowdowns, and what each interpreter says about itself (its versions: the
    environment diff)."""
    sides = [parse_side(spec, name, _pairs) for spec, name in zip(args.ab, "AB", strict=True)]
    sides[0].slow_pct, sides[1].slow_pct = parse_inject(args.inject)
    runs.mkdir(parents=True, exist_ok=True)
    probed: dict[str, Side] = {}  # one probe per interpreter (it imports torch: seconds)
    for side in sides:
        python = side.python
        side.python = python or sys.executable  # set: this interpreter, asked the same questions
        if side.python in probed:
            done = probed[side.python]
            side.probe, side.extra_env = dict(done.probe), dict(done.extra_env)
        else:
            probe_interpreter(side, runs)
            probed[side.python] = side
        side.python, side.cwd = python, None  # the command runs where the canary was started
        side.worker = None
    return sides


def steady(run_dir: Path, warmup: int, cpu: CpuSampler | None = None) -> dict[str, Any]:
    """The steady-state numbers of a run store: steps >= warmup (wall-clock tokens/s from the step
    times; with `cpu`, tokens per CPU-second of the command's process tree over the same steps).
    Raises ValueError when the run has too few steps."""
    import polars as pl

    from guard.store.reader import read_table

    steps = read_table(run_dir, "steps")
    if steps.height == 0:
        raise ValueError(
            f"the command wrote no steps to {run_dir} (train with MoEGuardCallback, or GuardedStep with "
            f"run_dir=${RUN_DIR_ENV} or the {{run_dir}} placeholder)"
        )
    steps = steps.sort("step")
    rows = steps.filter(pl.col("step") >= max(warmup, 1))
    if rows.height < MIN_STEADY:
        raise ValueError(
            f"the command ran {steps.height} steps; the canary needs more than canary.warmup_steps + "
            f"{MIN_STEADY} = {warmup + MIN_STEADY} (run more steps or --set canary.warmup_steps=K)"
        )

    def med(col: str) -> float | None:
        if col not in rows.columns:
            return None
        vals = [float(v) for v in rows[col].to_list() if v is not None and math.isfinite(v)]
        return statistics.median(vals) if vals else None

    # The window: from the report time of the step before the first steady one to the last step's
    # (a step's row is stamped when the guard reads it), i.e. the steady steps' own work.
    first = int(rows["step"][0])
    t0 = float(steps.filter(pl.col("step") < first)["time"][-1])
    t1 = float(rows["time"][-1])
    cpu_s = cpu.cpu_between(t0, t1) if cpu is not None else None
    # The yardstick GuardedStep timed after each step (guard/canary/reference.py): those of steps
    # first-1 .. last-1 ran inside the window (each after its step's report), so their CPU time
    # leaves the command's, and the steady steps' median is the machine's speed beside them.
    ref = read_reference(run_dir) if cpu_s else {}
    in_window = [ref.get(k) for k in range(first - 1, int(rows["step"][-1]))]
    ref_ms = None
    if ref and all(v is not None for v in in_window):
        cpu_s -= sum(in_window)
        ref_ms = 1e3 * statistics.median(ref[k] for k in rows["step"].to_list() if k in ref)
    tokens = float(rows["tokens"].sum())
    return {
        "tokens_per_s": med("tokens_per_s"),
        "tokens_per_cpu_s": tokens / cpu_s if cpu_s and cpu_s > 0 else None,
        "ref_cpu_ms": ref_ms,
        "cpu_ms_per_step": 1e3 * cpu_s / rows.height if cpu_s else None,
        "mfu": med("mfu"),
        "step_wall_ms": (med("step_time_s") or 0.0) * 1e3,
        "mem_peak_bytes": med("mem_peak_bytes"),
        "final_loss": statistics.median(rows["loss"].tail(10).to_list()),
        "window_steps": rows.height,
    }


def run_sampled(
    argv: list[str], *, env: dict[str, str], cwd: str | None, timeout: float, out: Path
) -> tuple[int, str, CpuSampler | None]:
    """Run the command, sampling its process tree's CPU time every SAMPLE_S; (exit code, the tail
    of its output, the sampler or None without /proc). Output goes to files under `out`, so a
    chatty command cannot fill a pipe. Raises subprocess.TimeoutExpired (the tree killed)."""
    out.mkdir(parents=True, exist_ok=True)
    log = out / "canary-command.log"
    with open(log, "w") as f:
        p = subprocess.Popen(
            argv, env=env, cwd=cwd, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        sampler = CpuSampler(p.pid) if CpuSampler.available else None
        deadline = time.monotonic() + timeout
        while p.poll() is None:
            if sampler is not None:
                sampler.sample()
            if time.monotonic() > deadline:
                os.killpg(p.pid, 9)
                p.wait()
                raise subprocess.TimeoutExpired(argv, timeout)
            time.sleep(SAMPLE_S)
    tail = "\n".join(log.read_text(errors="replace").strip().splitlines()[-20:])
    return p.returncode, tail, sampler


def measure_command(
    cmd: Command, setup: Setup, side: Side, runs: Path, pair: int, started: str
) -> dict[str, Any]:
    """One run of the command for one side, read back from the run store it wrote."""
    from guard.store.reader import read_meta

    run_dir = new_run_dir(runs, f"canary-ab-{started}-p{pair + 1:02d}{side.name}")
    argv = cmd.argv(side, run_dir)
    t0 = time.perf_counter()
    try:
        rc, tail, cpu = run_sampled(
            argv, env=cmd.env(side, run_dir), cwd=side.cwd, timeout=setup.canary.timeout_s, out=run_dir
        )
    except subprocess.TimeoutExpired:
        return {
            "status": "failed",
            "reason": f"timed out after {setup.canary.timeout_s:g} s (canary.timeout_s)",
        }
    except OSError as e:
        return {"status": "unavailable", "reason": f"cannot run {argv[0]!r}: {e}"}
    wall = time.perf_counter() - t0
    if rc != 0:
        return {"status": "failed", "reason": f"the command exited {rc}", "stderr_tail": tail.splitlines()}
    try:
        s = steady(run_dir, setup.canary.warmup_steps, cpu if setup.canary.timing != TIMING_WALL else None)
    except ValueError as e:
        return {"status": "failed", "reason": str(e), "stderr_tail": tail.splitlines()}
    meta = read_meta(run_dir) or {}
    env = meta.get("env") or {}
    # CPU timing on a CPU device (timing = auto) or when asked (cpu); wall clock on an accelerator
    on_cpu = str(env.get("device", "cpu")).startswith("cpu") or setup.canary.timing == TIMING_CPU
    per_cpu = s["tokens_per_cpu_s"] if on_cpu else None
    ref_ms = s["ref_cpu_ms"] if per_cpu else None
    # CPU: tokens per CPU-second x the yardstick's seconds, as the canary worker (guard/canary/ab.py)
    speed = per_cpu * ref_ms / 1e3 if per_cpu and ref_ms else per_cpu
    return {
        "status": "ok",
        "run_id": run_dir.name,
        "run_dir": str(run_dir),
        "wall_s": wall,
        "loadavg": os.getloadavg()[0],
        "timing": TIMING_CPU if per_cpu else TIMING_WALL,
        "flops_per_token": meta.get("flops_per_token") or env.get("flops_per_token"),
        "env": {**env, "world_size": meta.get("world_size", env.get("world_size"))},
        "metrics": {
            SPEED: speed or s["tokens_per_s"],
            TPS_RAW: per_cpu or s["tokens_per_s"],
            MFU_R: s["mfu"],
            TPS_WALL: s["tokens_per_s"],
            "ref_cpu_ms": ref_ms,
            "step_cpu_ms": s["cpu_ms_per_step"],
            "step_wall_ms": s["step_wall_ms"],
            "mem_peak_bytes": s["mem_peak_bytes"],
            "final_loss": s["final_loss"],
            "window_steps": s["window_steps"],
        },
    }


def run_own_ab(args: argparse.Namespace, setup: Setup) -> int:
    """`--ab A B` with --script or --torchtitan: measure, judge, report."""
    from guard.canary.ab_report import build_report, print_summary, write_reports

    cmd = parse_command(args)
    cmd.reference = setup.canary.timing != TIMING_WALL
    runs = Path(args.runs).resolve()
    sides = prepare(args, runs)
    c = setup.canary
    progress(
        f"A/B on {cmd.label}: A = {sides[0].spec}, B = {sides[1].spec}; {c.ab_pairs} pairs "
        f"({c.ab_order} order), steady state from step {c.warmup_steps} ..."
    )
    try:
        got = measure_ab(
            setup,
            sides,
            runs,
            measure=lambda side, i, started: measure_command(cmd, setup, side, runs, i, started),
        )
    except WorkerFailed as e:
        print(f"moeguard canary: {e.reason}", file=sys.stderr)
        return e.code
    rep = build_report(setup=setup, sides=sides, paired=got)
    rep["config"], rep["config_label"] = cmd.text, cmd.label
    rep["statistic"]["label"] = (
        "tokens/s (gated; steady state from the command's run store; CPU: per CPU-second of its process "
        "tree, times the yardstick GuardedStep timed beside each step)"
    )
    write_reports(rep, Path(args.report_dir))
    print_summary(rep)
    return EXIT_FAIL if rep["verdict"] == FAIL else EXIT_PASS
