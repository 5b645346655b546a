"""The open-files limit a service needs for the ranks it serves, raised at start-up (issue #30).

A rank keeps one keep-alive connection to its collector (the exporter's pool keeps an idle one
60 s, guard/runtime/export_link.py; the collector keeps it 75 s, conn_guard.KEEP_ALIVE_S), so the
open-files limit (RLIMIT_NOFILE) bounds the ranks one collector serves. Under the common 1,024 a
collector stopped accepting at ~1,000 ranks; the connection cap of issue #32 (conn_guard.py) keeps
it alive there, and this module sizes the limit and the cap from the ranks it is to serve:

    connections   2 x ranks. ConnectionBudget keeps half its cap for authenticated clients, so
                  `ranks` ranks stay served through any flood of unauthenticated connections, and
                  a whole job may connect at once (a rank is unauthenticated until its first request)
    run files     one open write-ahead-log segment per run held in memory (--max-hot-runs): a run
                  keeps it open from its first batch after a checkpoint to the next checkpoint
    base          FILE_RESERVE_MIN: stdio, the event loop, the listening socket, the Parquet parts
                  and state.json being written or read at the moment
    accept burst  the listen backlog: asyncio accepts that many connections in one go before it
                  closes one it refused, so they may all be open for a moment

The soft limit is raised to that sum, never past the hard limit (`plan_open_files`); the
connection cap is what the limit in force leaves after the other three, so the service never
runs into EMFILE whatever the clients do.

A hard limit too low for the ranks asked is a WARNING line at start-up (naming the limit, its value
and the ranks it covers), not a refusal to start. Why: the cap follows the limit, so a short limit
costs no crash and no data: a rank past the cap is answered 503 with Retry-After and keeps its
batches spooled until a connection frees, while the ranks the limit covers are served as usual.
The rank count asked by default is --max-ranks (16,384), the largest job a collector accepts, not
the job at hand: refusing to start on a host whose hard limit is 4,096 or 20,000 would take the
collector away from every 8-rank job there to keep a 16k-rank job off it. What it covers is also
in /healthz (`connections.ranks_covered` next to `ranks_wanted`).
"""

from __future__ import annotations

import resource
from dataclasses import dataclass

FILE_RESERVE_MIN = 128  # descriptors for the service's own files and sockets, at least
NOFILE_CEILING = 1 << 20  # never ask for more than this (an "unlimited" hard limit included)


def raise_open_files(want: int | None = None) -> tuple[int, int, int]:
    """Raise RLIMIT_NOFILE's soft limit to `want` (default: the hard limit), never past the hard
    limit or NOFILE_CEILING, never down. Returns (soft before, soft now, hard)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    top = NOFILE_CEILING if hard == resource.RLIM_INFINITY else min(hard, NOFILE_CEILING)
    target = top if want is None else min(want, top)
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError):
            return soft, soft, hard
        return soft, target, hard
    return soft, soft, hard


def accept_burst(ranks: int) -> int:
    """The listen backlog for `ranks` ranks: an eighth of them, 64 .. 2,048 (a job's ranks connect
    together at its start; the kernel caps it at net.core.somaxconn anyway)."""
    return min(2048, max(64, ranks // 8))


def files_needed(ranks: int, hot_runs: int) -> int:
    """The open-files limit that serves `ranks` ranks and `hot_runs` runs in memory."""
    return 2 * ranks + hot_runs + FILE_RESERVE_MIN + accept_burst(ranks)


@dataclass(frozen=True, slots=True)
class FilePlan:
    """What the service got: the limit in force and how it is shared out."""

    ranks_wanted: int  # --rank-capacity
    hot_runs_wanted: int  # --max-hot-runs
    before: int  # the soft limit at start
    nofile: int  # the soft limit now
    hard: int
    cap: int  # connections at most (ConnectionBudget)
    backlog: int  # the listen backlog (one accept burst)
    needed: int  # files_needed(...), or what an explicit --max-connections needs

    @property
    def ranks_covered(self) -> int:
        """Ranks kept served through any connection flood: the budget's authenticated share."""
        return self.cap // 2

    @property
    def run_files(self) -> int:
        """Descriptors left for the runs' open logs."""
        return max(0, self.nofile - self.cap - self.backlog - FILE_RESERVE_MIN)

    @property
    def short(self) -> bool:
        return self.ranks_covered < self.ranks_wanted or self.run_files < self.hot_runs_wanted

    def summary(self) -> str:
        """The one INFO line at start-up."""
        got = f"raised from {self.before}" if self.nofile > self.before else "not raised"
        return (
            f"open files: soft limit {self.nofile} ({got}; hard {_n(self.hard)}; {self.needed} needed for "
            f"{self.ranks_wanted} ranks and {self.hot_runs_wanted} runs in memory); connections capped at "
            f"{self.cap}, {self.ranks_covered} kept for authenticated clients (one keep-alive connection "
            f"a rank), backlog {self.backlog}"
        )

    def warning(self) -> str | None:
        """The one WARNING line when the hard limit is short, else None."""
        if not self.short:
            return None
        files = (
            f" and {self.run_files} runs' logs (--max-hot-runs asks {self.hot_runs_wanted})"
            if self.run_files < self.hot_runs_wanted
            else ""
        )
        return (
            f"open files: the hard limit (ulimit -Hn) is {_n(self.hard)}, enough for {self.ranks_covered} "
            f"ranks (--rank-capacity asks {self.ranks_wanted}){files}; ranks past that are answered 503 and "
            f"retry from their spool: raise the hard limit to {self.needed} (limits.conf nofile, systemd "
            f"LimitNOFILE=, docker --ulimit nofile=) or lower --rank-capacity / --max-hot-runs"
        )


def plan_open_files(ranks: int, hot_runs: int, max_connections: int | None = None) -> FilePlan:
    """Raise the soft limit to what `ranks` ranks and `hot_runs` runs in memory need (or, with
    `max_connections`, what that many connections need), then share out the limit in force.

    When the limit covers everything, connections get all the rest (a soft limit already higher
    than needed is kept). When it cannot cover even the runs' files, connections get half the
    limit and the burst an eighth, and the files what is left (the WARNING says how many)."""
    backlog = accept_burst(ranks)
    files = hot_runs + FILE_RESERVE_MIN + backlog
    needed = files + (2 * ranks if max_connections is None else max_connections)
    before, nofile, hard = raise_open_files(needed)
    spare = nofile - files
    if max_connections is not None:
        cap = max_connections
        backlog = max(1, min(backlog, (nofile - FILE_RESERVE_MIN - cap) // 2))
    elif spare >= nofile // 2:
        cap = spare
    else:
        cap, backlog = nofile // 2, min(backlog, max(16, nofile // 8))
    return FilePlan(
        ranks_wanted=ranks,
        hot_runs_wanted=hot_runs,
        before=before,
        nofile=nofile,
        hard=hard,
        cap=cap,
        backlog=backlog,
        needed=needed,
    )


def _n(limit: int) -> str:
    return "unlimited" if limit == resource.RLIM_INFINITY else str(limit)
