"""`moeguard train`: train an MoE model with the stability guard on.

    moeguard train --config configs/tiny.toml --steps 600 --run-dir runs/tiny
    moeguard train --config configs/tiny.toml --inject gradspike@200:50 --inject nan@300
    torchrun --nproc_per_node 2 -m guard train --config configs/tiny.toml --inject nan@300/r1
    torchrun --standalone --nproc_per_node 2 --max-restarts 3 -m guard train --run-dir runs/tiny
    torchrun --standalone --nproc_per_node 2 -m guard train --set train.parallel=fsdp

Under torchrun, a restarted job (TORCHELASTIC_RESTART_COUNT > 0) resumes from the newest
checkpoint in --run-dir on its own. A checkpoint written on W ranks resumes on any number of ranks.
Without --run-dir, multi-rank runs are named after torchrun's run id when it has one (stable
across restarts), else after rank 0's start time.

Exit status (meta.json "status" in brackets; "status_note" says what happened in words):
  0    finished [finished, or finished_nonfinite when the loss/gradient ended non-finite],
       or stopped at --until [running]
  1    crashed [crashed]
  2    bad command line or config, nothing trained
  3    the guard or an operator halted the run, with a checkpoint [halted]
  4    a disk filled up (the run store, a checkpoint): one line names the path and the space
       left [crashed, the note says which write; still running when even meta.json could not
       be written, and the line says so]; rows written before are kept; free some space and
       continue with --resume
  130  Ctrl-C / SIGINT: stopped at once, no new checkpoint [interrupted]
  143  SIGTERM (preemption): the step in flight finishes, a checkpoint is written, then exit
       [preempted]; --resume continues. 143 = 128 + SIGTERM, as if killed by it, so schedulers
       (Kubernetes Jobs, Slurm --requeue, torchrun --max-restarts) retry the unfinished run.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from guard.core import schema
from guard.core.config import load_guard_config
from guard.core.tomlconf import ConfigError
from guard.resources import resource

DEFAULT_CONFIG = resource("configs", "tiny.toml")


def inject_help() -> str:
    """The --help section on fault injection: what STEP and ARG mean for every kind."""
    from guard.core.inject import help_lines

    return help_lines()


def configure(p: argparse.ArgumentParser) -> None:
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    from guard.core.goodput import DEFINITION as GOODPUT

    p.epilog = __doc__.split("\n", 2)[2] + "\n" + inject_help() + "\n\nThe end-of-run summary's " + GOODPUT
    p.add_argument(
        "--config",
        type=Path,
        default=None,
        help=f"training config TOML (default: {DEFAULT_CONFIG.name}, the CPU demo config)",
    )
    p.add_argument("--steps", type=int, help="override train.steps")
    p.add_argument("--seed", type=int, help="override train.seed")
    p.add_argument("--run-dir", type=Path, help="run store folder (default: runs/<name>-<timestamp>)")
    p.add_argument(
        "--until",
        type=int,
        metavar="STEP",
        help="stop at STEP with a checkpoint (the LR schedule still spans --steps); resume later",
    )
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --run-dir")
    p.add_argument(
        "--no-guard", action="store_true", help="keep telemetry and verdicts, turn every guard action off"
    )
    p.add_argument(
        "--guard", type=Path, metavar="FILE.toml", help="guard settings ([guard] table) to use instead"
    )
    p.add_argument(
        "--inject",
        action="append",
        default=[],
        metavar="KIND@STEP[:ARG][/rRANK]",
        help=f"inject a fault for a drill (repeatable; /rRANK: on that rank only); kinds: "
        f"{', '.join(schema.INJECT_KINDS)}; what ARG means for each: below",
    )
    p.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override any config key, e.g. --set model.experts_kernel=bmm (TOML value syntax)",
    )
    p.add_argument(
        "--collector", help=f"collector URL to stream telemetry to (default: ${schema.ENV_COLLECTOR})"
    )
    p.add_argument(
        "--tag",
        action="append",
        default=[],
        metavar="TAG",
        help='tag the run (repeatable; added to the config\'s `tags`): meta.json "tags", the Runs page filters by them',
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


def parse_overrides(items: list[str]) -> dict[str, Any]:
    import tomllib

    out: dict[str, Any] = {}
    for item in items:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"--set {item!r}: expected KEY=VALUE, e.g. model.n_experts=16")
        try:
            out[key.strip()] = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            out[key.strip()] = raw  # bare strings: --set model.attention=math
    return out


def build_config(args: argparse.Namespace) -> Any:
    from trainer.config import load_config

    overrides = parse_overrides(args.set)
    if args.steps is not None:
        overrides["train.steps"] = args.steps
    if args.seed is not None:
        overrides["train.seed"] = args.seed
    cfg = load_config(args.config or DEFAULT_CONFIG, overrides)
    if args.tag:
        from guard.core.tags import clean_tags

        try:
            cfg.tags = clean_tags([*cfg.tags, *args.tag], "--tag")
        except ValueError as e:
            raise ConfigError(str(e)) from None
    if args.guard is not None:
        cfg.guard = load_guard_config(args.guard)
    if args.no_guard:
        cfg.guard.mode = "observe"
    return cfg


def make_exporter(cfg: Any, run_id: str, run_dir: Path, rank: int) -> Any:
    """The rank's telemetry link (guard/runtime/service.py, shared with every integration). Rank 0
    beats with each step's report (and from HeartbeatPump while it waits in a collective); other
    ranks of a multi-rank job send no per-step report and beat at the job's bounded rate."""
    from guard.runtime.service import make_exporter as shared

    return shared(
        collector=cfg.telemetry.collector,
        otlp_endpoint=cfg.telemetry.otlp_endpoint,
        run_id=run_id,
        run_dir=run_dir,
        rank=rank,
        trainer_detectors=cfg.telemetry.enabled,
        world=int(os.environ.get("WORLD_SIZE", "1")),
    )


def default_run_dir(cfg: Any) -> Path:
    """runs/<name>-<torchrun run id> (stable across torchrun restarts) or runs/<name>-<rank 0's time>."""
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        return Path("runs") / f"{cfg.name}-{run_id}"
    name = f"{cfg.name}-{time.strftime('%Y%m%d-%H%M%S')}"
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:  # every rank must write to the same place
        import torch.distributed as dist

        from trainer.distributed import setup_distributed

        setup_distributed(cfg.train.device)
        box = [name]
        dist.broadcast_object_list(box, src=0)
        name = box[0]
    return Path("runs") / name


def held_run(run_dir: Path) -> str | None:
    """What says `run_dir` already holds a run ("meta.json: status finished, 300 steps"), or None.
    Under a torchrun restart, a run that this torchrun job wrote itself does not count."""
    from guard.store.reader import read_meta
    from trainer.checkpoint import list_checkpoints
    from trainer.distributed import restart_count
    from trainer.record import JOB_KEY

    meta = read_meta(run_dir) if (run_dir / schema.META_FILE).is_file() else None
    if restart_count() > 0:  # this job's first attempt may have written here: resume or restart it
        job = os.environ.get("TORCHELASTIC_RUN_ID", "")
        if meta is None or job in ("", "none") or meta.get(JOB_KEY) == job:
            return None
    if meta is not None or (run_dir / schema.META_FILE).is_file():
        meta = meta or {}
        steps = f", {meta['final_step']} steps" if isinstance(meta.get("final_step"), int) else ""
        return f"{schema.META_FILE}: status {meta.get('status', '?')}{steps}"
    if ckpts := list_checkpoints(run_dir / schema.CHECKPOINT_DIR):
        return f"checkpoint {ckpts[-1].name}"
    for table in schema.TABLES:
        if any((run_dir / table).glob("*.parquet")):
            return f"a {table} table"
    return None


def refuse_reused_run_dir(run_dir: Path, *, rank: int, device: str) -> None:
    """A new run (no --resume) must not land in a folder that holds another run: its rows would
    mix with the old ones (steps 0,1,2,0,1,2) and meta.json would be overwritten. Rank 0 looks
    before anything is written and tells every rank, so all of them stop."""
    held = held_run(run_dir) if rank == 0 else None
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        import torch.distributed as dist

        from trainer.distributed import setup_distributed

        setup_distributed(device)
        box = [held]
        dist.broadcast_object_list(box, src=0)
        held = box[0]
        if held is not None:  # leave no process group behind: its threads abort the exit
            dist.destroy_process_group()
    if held is not None:
        raise ConfigError(
            f"--run-dir {str(run_dir)!r} already holds a run ({held}); continue it with --resume, "
            "or pass a new --run-dir (nothing was written)"
        )


def _device_kind(pref: str) -> str:
    """ "cuda" or "cpu", as setup_distributed will choose (trainer/distributed.py)."""
    import torch

    return "cuda" if pref == "cuda" or (pref == "auto" and torch.cuda.is_available()) else "cpu"


def check_run_id(run_dir: Path) -> None:
    """The run folder's name is the run's id (meta.json, the collector, the app): a name the
    collector would refuse must stop the run at start, not leave it unwatched to the end."""
    from guard.wire.batch import RUN_ID_RE, valid_run_id

    if not valid_run_id(run_dir.name):
        raise ConfigError(
            f"run folder {str(run_dir)!r}: its name {run_dir.name!r} is not a valid run id "
            f"({RUN_ID_RE.pattern}); the collector would refuse every batch of it"
        )


def check_device(device: str) -> None:
    """train.device = "cuda" on a host with no CUDA device: one line before anything is built (a
    GPU-sized model on the CPU grew to 21.7 GB in minutes, with no word, issue #40)."""
    if device != "cuda":
        return
    import torch

    if not torch.cuda.is_available():
        raise ConfigError(
            "train.device = 'cuda' but this host has no CUDA device (torch "
            f"{torch.__version__}, built with CUDA {torch.version.cuda or 'none'}); to train on the CPU "
            "anyway, pass --set train.device=cpu (and a CPU-sized model, e.g. the default configs/tiny.toml)"
        )


def run(args: argparse.Namespace) -> int:
    # The config and the command line first: every mistake there is one line in well under a
    # second, before torch's import (seconds on a busy host; issue #40).
    from trainer.inject import check_injections, parse_injection

    cfg = build_config(args)
    if args.collector:
        cfg.telemetry.collector = args.collector
    injections = [parse_injection(s) for s in args.inject]
    check_injections(injections, cfg.train.steps)
    if args.until is not None and args.until < 0:
        raise ConfigError(f"--until {args.until}: must be a step >= 0")
    run_dir = args.run_dir or default_run_dir(cfg)
    check_run_id(run_dir)
    check_device(cfg.train.device)
    rank = int(os.environ.get("RANK", "0"))
    if args.resume and rank == 0 and run_dir.is_dir():
        # a damaged run store too (the Trainer checks it again, on the rank that writes it)
        from trainer.resume_check import check_store_for_resume

        check_store_for_resume(run_dir)
    from trainer.step_gc import gc_off_through_start_up

    with gc_off_through_start_up(cfg.train.gc_every):
        return train(args, cfg, injections, run_dir, rank)


def train(args: argparse.Namespace, cfg: Any, injections: list[Any], run_dir: Path, rank: int) -> int:
    """The run itself, once the command line and the config are known to be good."""
    from guard.runtime.elastic import tell_launcher
    from guard.store.layout import run_dir_problem
    from guard.store.reader import read_meta
    from trainer.checkpoint import latest_checkpoint
    from trainer.distributed import restart_count
    from trainer.loop import Trainer
    from trainer.memcheck import check_model_fits
    from trainer.outcome import EXIT_HALTED

    if args.resume and not run_dir.is_dir():
        raise ConfigError(f"--resume: run folder {str(run_dir)!r} does not exist")
    resume = args.resume
    if (why := run_dir_problem(run_dir)) is not None:
        raise ConfigError(
            f"--run-dir {str(run_dir)!r}: {why}; pass a folder you can write to (nothing was written)"
        )
    if (
        not resume
        and restart_count() > 0
        and (read_meta(run_dir) or {}).get("status") == schema.STATUS_HALTED
    ):
        # The guard (or an operator) halted the run and paged a human: a torchrun restart must
        # not carry on past that. Each remaining restart ends here at once; --resume overrides.
        # Every rank reads meta.json itself, before anything joins a process group: a rank that
        # left with gloo's threads still running aborted at exit (SIGABRT, "terminate called
        # without an active exception") about half the time on a loaded host, and torchrun's
        # report then named that signal as the root cause instead of this line.
        line = (
            f"moeguard train: {run_dir} is halted; not resuming it automatically "
            "(look at its halt event, then rerun with --resume)"
        )
        tell_launcher(f"{line} (exit {EXIT_HALTED})")
        if rank == 0:
            print(line, file=sys.stderr)
        return EXIT_HALTED
    if not resume:
        refuse_reused_run_dir(run_dir, rank=rank, device=cfg.train.device)
    if not resume and restart_count() > 0 and latest_checkpoint(run_dir / schema.CHECKPOINT_DIR) is not None:
        resume = True  # torchrun restarted the job after a failure: continue from the last good checkpoint
        if rank == 0:
            print(
                f"moeguard train: torchrun restart {restart_count()}: resuming from "
                f"{latest_checkpoint(run_dir / schema.CHECKPOINT_DIR)}",
                file=sys.stderr,
            )
    check_model_fits(cfg, _device_kind(cfg.train.device))
    exporter = make_exporter(cfg, run_dir.name, run_dir, rank)
    trainer = Trainer(
        cfg, run_dir, resume=resume, injections=injections, progress=not args.no_progress, exporter=exporter
    )
    if rank == 0 and not resume:  # a drill whose fault lands before a detector arms says so
        # (after the Trainer is built: a config it refuses is the one line the user sees)
        from guard.core.warmup import notices

        for line in notices(cfg.guard, cfg.train.steps, [(i.kind, i.step, str(i)) for i in injections]):
            print(f"moeguard train: note: {line}", file=sys.stderr)
    code = trainer.run(until=args.until)
    if code == EXIT_HALTED:  # under plain torchrun, its failure report names the halt, not a link
        note = (read_meta(run_dir) or {}).get("status_note") or "the guard or an operator halted the run"
        tell_launcher(f"moeguard train: {note} (exit {EXIT_HALTED})")
    if trainer.dist.main:
        summarize(trainer, run_dir)
    if trainer.dist.world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    return code


def summarize(trainer: Any, run_dir: Path) -> None:
    from guard.runtime.record import summary_lines

    gp = trainer.goodput()
    for line in summary_lines(
        run_dir,
        steps=trainer.step,
        counts=trainer.state.counts,
        guard_actions=trainer.state.guard_actions,
        goodput=gp["goodput"],
    ):
        print(line)
