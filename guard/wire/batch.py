"""The ingest batch: the one wire format between the exporter (encode) and the collector (parse).

    POST /v1/ingest   body: one JSON object (NaN may be written as NaN or null)

    run        str, [A-Za-z0-9][A-Za-z0-9._-]{0,127} (it names a directory; nothing else passes)
    rank       int >= 0
    seq        int in [0, 2**63 - 1], strictly increasing per (run, rank). seq = generation <<
               GEN_SHIFT | counter, generation = the exporter's start time in seconds (kept
               increasing through a file in its spool dir), so a restarted trainer keeps counting
               up; a generation more than MAX_GENERATION_AHEAD_S ahead of the collector's clock is
               refused (400, `check_generation`).
    meta       object, optional: the run's meta.json (merged over what is stored)
    reports    list of StepReport.to_json() objects, optional; report.rank must equal rank
    events     list of event rows (guard.core.events.Event.row()), optional: step and kind
               required; detail may be a JSON string or an object
    heartbeat  {"time": float (trainer clock), "step": int, "phase": "train|checkpoint|eval|data",
               "every": float (optional: seconds between this rank's own beats, which the
               collector's lost-rank timeout follows), "waiting": true (optional: made while the
               rank waited inside a collective for its peers), "world": int (optional, rank 0
               only: this step's collectives ran on ranks 0..world-1, so its progress proves
               theirs)}, optional (a batch with reports and no heartbeat beats at its last report)
    ranks      {"step": int, "step_time_s": [float], "data_wait_s": [float], "tokens": [int],
               "straggler_score": [float]}, optional, rank 0 only: every rank's timing over the
               last straggler window, list index = rank (at most --max-ranks long), gathered
               inside the job (guard/runtime/ranks.py) so other ranks send no per-step reports
    commands_ack  int, optional: the highest operator-command id this rank has taken up
    trainer_detectors  bool, optional: true when the trainer runs the DetectorSuite in-process
    writer     str, optional ([A-Za-z0-9_-]{1,64}): a random id of the sending exporter instance;
               two writers whose generations are equal (started in the same second) differ here
    evals      list of rows of the run store's `evals` table (schema.EVALS_COLUMNS: step, time, name,
               value), optional, rank 0 only: the evaluation metrics the loop reported
               (GuardedStep.log, the Trainer's evaluate), stored as the run store stores them
    host       list of rows of the `host` table (schema.HOST_COLUMNS: step, time and the sampled
               values, null where not measurable), optional, rank 0 only: rank 0's host samples
               (guard/runtime/host.py). A missing column is null; unknown keys are ignored. At most
               MAX_SIDE_ROWS rows of each per batch.
    final      bool, optional: true on the last batch of a rank that stopped on purpose
    goodbye    {"status": str, "note": str}, optional, only beside final: why this rank ends, one
               of schema.GOODBYE_STATUSES (finished, preempted, interrupted, halted, peer_lost, ...)
               and in words (at most GOODBYE_NOTE_MAX characters). A rank whose beats stop with
               no final is lost, whatever its peers say (guard/collector/status.py)
Unknown top-level keys are ignored (newer exporters may send more).

What the collector does with each field is in guard/collector/ (service.py's docstring). This
module imports no web framework: the trainer side needs none.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from guard.core import schema
from guard.core.heartbeat import PHASE_TRAIN, PHASES
from guard.core.limits import CollectorLimits, check_rank, check_report
from guard.core.report import StepReport

try:  # optional: 3-5x faster parsing of the numeric arrays; plain json otherwise
    import orjson as _orjson
except ImportError:  # pragma: no cover - depends on the environment
    _orjson = None

RUN_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
WRITER_RE = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
GEN_SHIFT = 32  # seq = generation << GEN_SHIFT | counter
MAX_RANK = 1 << 20
MAX_SEQ = (1 << 63) - 1
# A generation is the exporter's start time in seconds (bumped by one per restart within a
# second); one further ahead of the collector's clock is refused, or it would own the run
# (every real batch answered 409) until the clock caught up.
MAX_GENERATION_AHEAD_S = 3600
# The collector's clock decides liveness, goodput and who owns a run; a trainer's timestamps are
# data. One more than this ahead of the collector's clock is clamped to it (heartbeat and report
# times), and a generation this far ahead may not take a rank over from another writer (409).
MAX_CLOCK_AHEAD_S = 60.0
MAX_CLOCK_BEHIND_S = 7 * 86400.0  # report times further behind are clamped (a spool's old batches are not)


class BadRequest(ValueError):
    """The batch is malformed; the message names the field."""


@dataclass(kw_only=True, slots=True)
class Batch:
    run: str
    rank: int
    seq: int
    meta: dict[str, Any] | None = None
    reports: list[StepReport] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    heartbeat: dict[str, Any] | None = None
    commands_ack: int | None = None
    trainer_detectors: bool = False
    final: bool = False
    writer: str | None = None  # the sending exporter instance (random), when it says
    ranks: dict[str, Any] | None = None  # rank 0: every rank's window timing (RANK_VECTORS)
    goodbye: dict[str, str] | None = None  # with final: {"status", "note"}: why this rank ends
    side: dict[str, list[dict[str, Any]]] = field(default_factory=dict)  # SIDE_TABLES' rows (rank 0)

    @property
    def generation(self) -> int:
        return generation_of(self.seq)


def make_seq(generation: int, counter: int) -> int:
    return generation << GEN_SHIFT | counter


def generation_of(seq: int) -> int:
    return seq >> GEN_SHIFT


def heartbeat(
    t: float, step: int, phase: str, *, every: float = 0.0, waiting: bool = False, world: int = 0
) -> dict[str, Any]:
    """The batch's heartbeat field: the trainer's clock, its last step, what it is doing (the
    optional keys only when set, so a one-rank run's beats stay as they were)."""
    hb: dict[str, Any] = {"time": t, "step": step, "phase": phase}
    if every > 0:
        hb["every"] = every
    if waiting:
        hb["waiting"] = True
    if world > 1:
        hb["world"] = world
    return hb


GOODBYE_NOTE_MAX = 500


def goodbye(status: str, note: str = "") -> dict[str, str]:
    """The final batch's goodbye field: why this rank ends (schema.GOODBYE_STATUSES), in words."""
    if status not in schema.GOODBYE_STATUSES:
        raise ValueError(f"goodbye status {status!r} is not one of {schema.GOODBYE_STATUSES}")
    return {"status": status, "note": note[:GOODBYE_NOTE_MAX]}


MAX_BEAT_EVERY_S = 86400.0  # a declared beat interval longer than a day is none

# rank 0's per-rank vectors, each a list indexed by rank: name -> element type
RANK_VECTORS = {"step_time_s": float, "data_wait_s": float, "tokens": int, "straggler_score": float}

# rank 0's run-store tables that ride on a batch beside the reports; the wire key is the table name
SIDE_TABLES = (schema.TABLE_EVALS, schema.TABLE_HOST)
MAX_SIDE_ROWS = 10_000  # rows of one side table in one batch


# ---------------------------------------------------------------------------------------
# Encoding (the exporter)
# ---------------------------------------------------------------------------------------
def loads(body: bytes) -> Any:
    if _orjson is not None:
        try:
            return _orjson.loads(body)
        except _orjson.JSONDecodeError:
            pass  # NaN/Infinity literals (stdlib json.dumps) are not JSON to orjson
    return json.loads(body)


def dumps(obj: Any) -> bytes:
    if _orjson is not None:  # writes NaN as null, which the collector reads back as NaN
        return _orjson.dumps(obj, option=_orjson.OPT_SERIALIZE_NUMPY)
    return json.dumps(obj, separators=(",", ":")).encode()


def encode_report(rep: StepReport) -> bytes:
    """One report's JSON (the costly part of a batch: done outside any lock)."""
    return dumps(rep.to_json())


def encode_batch(b: Batch, reports_json: Sequence[bytes] | None = None) -> bytes:
    """The request body of `b`. `reports_json`: its reports already encoded (`encode_report`),
    spliced in as they are; None encodes `b.reports`. Optional fields at their default are
    left out."""
    d: dict[str, Any] = {"run": b.run, "rank": b.rank, "seq": b.seq}
    if b.writer is not None:
        d["writer"] = b.writer
    d["events"] = b.events
    if b.final:
        d["final"] = True
        if b.goodbye is not None:
            d["goodbye"] = b.goodbye
    if b.heartbeat is not None:
        d["heartbeat"] = b.heartbeat
    if b.meta is not None:
        d["meta"] = b.meta
    if b.trainer_detectors:
        d["trainer_detectors"] = True
    if b.commands_ack is not None:
        d["commands_ack"] = b.commands_ack
    if b.ranks is not None:
        d["ranks"] = b.ranks
    for t in SIDE_TABLES:
        if b.side.get(t):
            d[t] = b.side[t]
    if reports_json is None:
        reports_json = [encode_report(r) for r in b.reports]
    head = dumps(d)
    return head[:-1] + b',"reports":[' + b",".join(reports_json) + b"]}"


# ---------------------------------------------------------------------------------------
# Parsing (the collector): pure, all-or-nothing
# ---------------------------------------------------------------------------------------
def parse_int(v: Any, name: str, lo: int = 0, hi: int = MAX_SEQ) -> int:
    """An integer field in [lo, hi]; BadRequest naming it otherwise."""
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise BadRequest(f"field {name!r}: expected an integer in [{lo}, {hi}], got {str(v)[:60]!r}")
    return v


def _float(v: Any, name: str) -> float:
    if v is None:
        return math.nan
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise BadRequest(f"field {name!r}: expected a number, got {str(v)[:60]!r}")
    return float(v)


def valid_run_id(run: Any) -> bool:
    return isinstance(run, str) and RUN_ID_RE.fullmatch(run) is not None


def parse_event(d: Any, where: str) -> dict[str, Any]:
    if not isinstance(d, dict):
        raise BadRequest(f"{where}: expected an object")
    for req in ("step", "kind"):
        if req not in d:
            raise BadRequest(f"{where}: missing field {req!r}")
    kind, action, detector = d["kind"], d.get("action", schema.ACT_NONE), d.get("detector", "")
    if kind not in schema.EVENT_KINDS:
        raise BadRequest(f"{where}.kind: {str(kind)[:60]!r} not one of {schema.EVENT_KINDS}")
    if action not in schema.ACTIONS:
        raise BadRequest(f"{where}.action: {str(action)[:60]!r} not one of {schema.ACTIONS}")
    if not isinstance(detector, str) or len(detector) > 200:
        raise BadRequest(f"{where}.detector: expected a short string")
    detail = d.get("detail", "{}")
    if isinstance(detail, dict):
        detail = json.dumps(detail, sort_keys=True, default=str)
    elif not isinstance(detail, str):
        raise BadRequest(f"{where}.detail: expected a JSON string or an object")
    t = _float(d.get("time"), f"{where}.time")
    return {
        "step": parse_int(d["step"], f"{where}.step"),
        "time": t if math.isfinite(t) else time.time(),
        "kind": kind,
        "detector": detector,
        "value": _float(d.get("value"), f"{where}.value"),
        "threshold": _float(d.get("threshold"), f"{where}.threshold"),
        "action": action,
        "detail": detail,
    }


def _parse_reports(raw: Any, rank: int, limits: CollectorLimits | None) -> list[StepReport]:
    if not isinstance(raw, list):
        raise BadRequest("field 'reports': expected a list")
    reports = []
    for i, r in enumerate(raw):
        if not isinstance(r, dict):
            raise BadRequest(f"reports[{i}]: expected an object")
        if limits is not None:
            check_report(r, f"reports[{i}]", limits)  # before any array is built
        try:
            rep = StepReport.from_json(r)
        except BadRequest:
            raise
        except (ValueError, TypeError, OverflowError, RecursionError, MemoryError) as e:
            raise BadRequest(f"reports[{i}]: {str(e)[:200]}") from None
        if "rank" in r and rep.rank != rank:
            raise BadRequest(f"reports[{i}].rank: {rep.rank} differs from the batch rank {rank}")
        rep.rank = rank
        reports.append(rep)
    return reports


def _parse_heartbeat(hb: Any) -> dict[str, Any] | None:
    if hb is None:
        return None
    if not isinstance(hb, dict):
        raise BadRequest("field 'heartbeat': expected an object")
    phase = hb.get("phase", PHASE_TRAIN)
    if phase not in PHASES:
        raise BadRequest(f"heartbeat.phase: {str(phase)[:60]!r} not one of {PHASES}")
    t = _float(hb.get("time"), "heartbeat.time")
    if not math.isfinite(t):
        raise BadRequest("heartbeat.time: must be a finite number")
    every = _float(hb.get("every", 0.0), "heartbeat.every")
    if not (math.isfinite(every) and 0.0 <= every <= MAX_BEAT_EVERY_S):
        raise BadRequest(f"heartbeat.every: {every!r} not in [0, {MAX_BEAT_EVERY_S:g}] seconds")
    waiting = hb.get("waiting", False)
    if not isinstance(waiting, bool):
        raise BadRequest("heartbeat.waiting: expected true or false")
    world = parse_int(hb.get("world", 0), "heartbeat.world", 0, MAX_RANK + 1)
    return heartbeat(
        t, parse_int(hb.get("step", 0), "heartbeat.step"), phase, every=every, waiting=waiting, world=world
    )


def _parse_ranks(raw: Any, rank: int, limits: CollectorLimits | None) -> dict[str, Any] | None:
    """Rank 0's per-rank vectors: equal lengths, at most max_ranks, numbers of the right kind."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise BadRequest("field 'ranks': expected an object")
    if rank != 0:
        raise BadRequest(f"field 'ranks': only rank 0 sends per-rank vectors (this batch is rank {rank})")
    out: dict[str, Any] = {"step": parse_int(raw.get("step"), "ranks.step")}
    n = None
    for name, kind in RANK_VECTORS.items():
        v = raw.get(name)
        if not isinstance(v, list):
            raise BadRequest(f"ranks.{name}: expected a list")
        if n is None:
            n = len(v)
            cap = limits.max_ranks if limits is not None else MAX_RANK + 1
            if n > cap:
                raise BadRequest(f"ranks.{name}: {n} ranks, more than max_ranks ({cap})")
        elif len(v) != n:
            raise BadRequest(f"ranks.{name}: {len(v)} values, expected {n} (one per rank)")
        try:  # numpy, not a Python call per value: 16,384 ranks arrive in one batch
            arr = np.asarray(v, dtype=np.float64)
        except (TypeError, ValueError):
            raise BadRequest(f"ranks.{name}: expected numbers") from None
        if kind is int:
            if arr.size and not (np.isfinite(arr).all() and arr.min() >= 0 and (arr == np.floor(arr)).all()):
                raise BadRequest(f"ranks.{name}: expected integers >= 0")
            arr = arr.astype(np.int64)
        out[name] = arr
    return out


def _parse_goodbye(v: Any, final: bool) -> dict[str, str] | None:
    if v is None:
        return None
    if not final:
        raise BadRequest("field 'goodbye': only on a final batch")
    if not isinstance(v, dict) or v.get("status") not in schema.GOODBYE_STATUSES:
        raise BadRequest(
            f'field \'goodbye\': expected {{"status": one of {list(schema.GOODBYE_STATUSES)}, "note": str}}'
        )
    note = v.get("note", "")
    if not isinstance(note, str) or len(note) > GOODBYE_NOTE_MAX:
        raise BadRequest(f"field 'goodbye.note': expected a string of at most {GOODBYE_NOTE_MAX} characters")
    return {"status": v["status"], "note": note}


def _side_value(v: Any, dtype: str, where: str) -> Any:
    if dtype == "String":
        if not isinstance(v, str) or not 0 < len(v) <= 200:
            raise BadRequest(f"{where}: expected a string of 1 to 200 characters")
        return v
    if v is None:
        return None
    if dtype == "Int64":
        if isinstance(v, float) and v.is_integer():
            v = int(v)
        return parse_int(v, where, -(1 << 63), MAX_SEQ)
    return _float(v, where)


def _parse_side(d: dict[str, Any], rank: int) -> dict[str, list[dict[str, Any]]]:
    """SIDE_TABLES' rows: each a full row of its table (a missing value column is null)."""
    out: dict[str, list[dict[str, Any]]] = {}
    for t in SIDE_TABLES:
        raw = d.get(t)
        if raw is None:
            continue
        if not isinstance(raw, list):
            raise BadRequest(f"field {t!r}: expected a list")
        if raw and rank != 0:
            raise BadRequest(f"field {t!r}: only rank 0 sends {t} rows (this batch is rank {rank})")
        if len(raw) > MAX_SIDE_ROWS:
            raise BadRequest(f"field {t!r}: {len(raw)} rows, more than {MAX_SIDE_ROWS} in one batch")
        rows = []
        for i, r in enumerate(raw):
            where = f"{t}[{i}]"
            if not isinstance(r, dict):
                raise BadRequest(f"{where}: expected an object")
            if "step" not in r:
                raise BadRequest(f"{where}: missing field 'step'")
            row = {c: _side_value(r.get(c), dt, f"{where}.{c}") for c, dt in schema.TABLE_COLUMNS[t].items()}
            row["step"] = parse_int(r["step"], f"{where}.step")
            if row["time"] is None or not math.isfinite(row["time"]):
                row["time"] = time.time()
            rows.append(row)
        if rows:
            out[t] = rows
    return out


def _parse_bool(d: dict[str, Any], name: str) -> bool:
    v = d.get(name, False)
    if not isinstance(v, bool):
        raise BadRequest(f"field {name!r}: expected true or false")
    return v


def parse_batch(body: bytes, limits: CollectorLimits | None = None) -> Batch:
    """Validate a whole batch; raises BadRequest naming the first bad field, LimitExceeded
    naming the first limit it goes over (`limits` None: no limits, for the log replay, so a
    lowered limit never drops a batch that was already acknowledged)."""
    try:
        d = loads(body)
    except (ValueError, RecursionError, UnicodeDecodeError) as e:
        raise BadRequest(f"body is not valid JSON: {str(e)[:120]}") from None
    if not isinstance(d, dict):
        raise BadRequest("body: expected a JSON object")
    for req in ("run", "rank", "seq"):
        if req not in d:
            raise BadRequest(f"missing field {req!r}")
    if not valid_run_id(d["run"]):
        raise BadRequest(f"field 'run': {str(d['run'])[:60]!r} is not a valid run id ({RUN_ID_RE.pattern})")
    rank = parse_int(d["rank"], "rank", 0, MAX_RANK)
    if limits is not None:
        check_rank(rank, limits)
    seq = parse_int(d["seq"], "seq")
    meta = d.get("meta")
    if meta is not None and not isinstance(meta, dict):
        raise BadRequest("field 'meta': expected an object")
    reports = _parse_reports(d.get("reports") or [], rank, limits)
    raw_events = d.get("events") or []
    if not isinstance(raw_events, list):
        raise BadRequest("field 'events': expected a list")
    events = [parse_event(e, f"events[{i}]") for i, e in enumerate(raw_events)]
    hb = _parse_heartbeat(d.get("heartbeat"))
    ack = d.get("commands_ack")
    if ack is not None:
        ack = parse_int(ack, "commands_ack")
    td, final = _parse_bool(d, "trainer_detectors"), _parse_bool(d, "final")
    writer = d.get("writer")
    if writer is not None and not (isinstance(writer, str) and WRITER_RE.fullmatch(writer)):
        raise BadRequest(f"field 'writer': expected {WRITER_RE.pattern}, got {str(writer)[:60]!r}")
    return Batch(
        run=d["run"],
        rank=rank,
        seq=seq,
        meta=meta,
        reports=reports,
        events=events,
        heartbeat=hb,
        commands_ack=ack,
        trainer_detectors=td,
        final=final,
        goodbye=_parse_goodbye(d.get("goodbye"), final),
        writer=writer,
        ranks=_parse_ranks(d.get("ranks"), rank, limits),
        side=_parse_side(d, rank),
    )


def check_generation(b: Batch, now: float) -> None:
    """BadRequest when the batch's generation is too far ahead of `now` (e.g. seq = 2**63 - 1:
    it would own the run, and block it, for decades)."""
    ahead = b.generation - (now + MAX_GENERATION_AHEAD_S)
    if ahead > 0:
        raise BadRequest(
            f"field 'seq': generation {b.generation} (seq >> {GEN_SHIFT}, the writer's "
            f"start time in seconds) is {ahead + MAX_GENERATION_AHEAD_S:.0f} s ahead of this "
            f"collector's clock (at most {MAX_GENERATION_AHEAD_S} s allowed)"
        )
