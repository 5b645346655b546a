"""The exporter's HTTP link to the collector: POST a batch to /v1/ingest and decide from the
answer whether it is done with (sent, or refused for good and set aside) or must be retried;
GET the operator commands. Commands in any answer go to the CommandInbox.

Answers: 200 stored; 409 another writer generation owns the run id (set aside in conflict/,
counted as not delivered, logged at ERROR once); 400/413 a bad batch (set aside in rejected/);
401/403 a missing or wrong token (retried, logged once); anything else, or no answer: retried.
"""

from __future__ import annotations

import logging
from typing import Any

import httpx

from guard.runtime.export_commands import CommandInbox
from guard.runtime.export_spool import CONFLICT_DIR, REJECTED_DIR, Spool

log = logging.getLogger("moeguard.exporter")


KEEPALIVE_S = 60.0  # under the collector's KEEP_ALIVE_S (guard/wire/conn_guard.py)


class CollectorLink:
    def __init__(
        self,
        url: str,
        token: str | None,
        run_id: str,
        rank: int,
        timeout_s: float,
        spool: Spool,
        inbox: CommandInbox,
    ) -> None:
        """`spool`: where refused batches are set aside; its `stats` are the exporter's counters."""
        self.url = url.rstrip("/")
        self.run_id, self.rank = run_id, rank
        self.spool, self.inbox, self.stats = spool, inbox, spool.stats
        headers = {"content-type": "application/json"}
        if token:
            headers["authorization"] = f"Bearer {token}"
        # Keep the connection across steps longer than httpx's 5 s default (one connection a rank,
        # not one a batch), and drop it before the collector's own keep-alive (75 s) does.
        self._client = httpx.Client(
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=min(timeout_s, 3.0)),
            limits=httpx.Limits(max_connections=2, keepalive_expiry=KEEPALIVE_S),
        )
        # a rank that posts less often than KEEPALIVE_S (a beat a minute in a job of 16,384 ranks)
        # closes each connection after its answer instead of holding one idle: the collector's
        # open files then follow the request rate, not the rank count (issue #30)
        self.close_each = False
        self.conflicted = False  # a 409 was answered: not everything was delivered
        self._conflict_logged = False

    def post(self, body: bytes, heartbeat_only: bool = False) -> bool:
        """POST one batch; True when the collector has it (200) or rejected it for good (4xx)."""
        try:
            r = self._client.post(
                f"{self.url}/v1/ingest",
                content=body,
                headers={"connection": "close"} if self.close_each else None,
            )
        except httpx.HTTPError as e:
            log.debug("collector unreachable: %s", e)
            return False
        if r.status_code == 200:
            self.stats["sent"] += 0 if heartbeat_only else 1
            self._take_commands(r)
            return True
        if r.status_code == 409:
            self._conflict(body, r, heartbeat_only)
            return True
        if r.status_code in (400, 413) and not heartbeat_only:
            # Permanently bad: retrying would block every later batch. Keep it for a human.
            self.stats["rejected"] += 1
            self.spool.set_aside(REJECTED_DIR, body)
            log.error("collector rejected a batch (%d): %s", r.status_code, r.text[:300])
            return True
        if r.status_code in (401, 403):  # a missing or wrong token: every retry gets the same answer
            self.stats["unauthorized"] = self.stats.get("unauthorized", 0) + 1
            if self.stats["unauthorized"] == 1:
                log.warning(
                    "collector answered %d: %s; set MOEGUARD_TOKEN to the collector's token (telemetry "
                    "stays spooled and is retried; logged once)",
                    r.status_code,
                    r.text[:200],
                )
            return False
        log.warning("collector answered %d: %s", r.status_code, r.text[:200])
        return False

    def _conflict(self, body: bytes, r: httpx.Response, heartbeat_only: bool) -> None:
        """409: a newer writer generation owns this run id on the collector (a second trainer
        with the same run id, or this process was superseded by a restarted one). Retrying
        cannot succeed and would block every later batch, so the batch is set aside on disk
        (spool_dir/conflict/) and counted as not delivered; logged at ERROR once per run."""
        self.conflicted = True
        if not heartbeat_only:
            self.stats["conflict"] += 1
            self.spool.set_aside(CONFLICT_DIR, body)
        if self._conflict_logged:
            log.debug("collector refused another batch of run %s (409)", self.run_id)
            return
        self._conflict_logged = True
        try:
            why = str(r.json().get("error", ""))
        except (ValueError, AttributeError):
            why = r.text[:300]
        log.error(
            "run %s rank %d: the collector refuses this trainer's telemetry (409): %s Its batches are NOT "
            "delivered; they are kept in %s. (Logged once; later refusals are counted in stats['conflict'].)",
            self.run_id,
            self.rank,
            why,
            self.spool.dir / CONFLICT_DIR,
        )

    def poll_commands(self) -> None:
        """GET the operator commands after the last one fetched, into the inbox."""
        try:
            r = self._client.get(
                f"{self.url}/v1/runs/{self.run_id}/commands",
                params={"rank": self.rank, "after": self.inbox.fetched},
            )
        except httpx.HTTPError:
            return
        if r.status_code == 200:
            self._take_commands(r)

    def _take_commands(self, r: httpx.Response) -> None:
        try:
            answer: Any = r.json()
        except ValueError:
            return
        self.inbox.offer(answer)

    def close(self) -> None:
        self._client.close()
