"""Transient OS errors are not damage (issue #32, item 2): out of descriptors, a full disk or EIO
answers a retryable status (503 with Retry-After, 507 for a full disk), quarantines nothing, and
the run comes back by itself when the condition clears; no temp file is left behind, and a write
the disk cut short is logged as what it was.

Driven in-process (no HTTP) so an OS call fails exactly when the test says; the answers are what
build_app sends (its Retry-After header is checked in test_collector_flood.py's real process).
"""

from __future__ import annotations

import errno
import json
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from guard.collector.config import CollectorConfig
from guard.collector.service import Collector
from guard.collector.wal import Wal
from guard.store.reader import read_table
from tests.helpers_collector import batch, make_report

G1 = 1_700_000_000 << 32


@pytest.fixture
def make(tmp_path: Path) -> Iterator[Callable[..., Collector]]:
    made: list[Collector] = []

    def _make(interval: float = 3600.0) -> Collector:
        c = Collector(CollectorConfig(runs_dir=tmp_path / "runs", token=None, checkpoint_interval_s=interval))
        c.start()
        made.append(c)
        return c

    yield _make
    for c in made:
        c.close()


def _body(seq: int, steps: range) -> bytes:
    return json.dumps(batch("io", 0, G1 | seq, [make_report(s) for s in steps])).encode()


class _Switch:
    """os.<name> (or Path.<name>) raises OSError(code) while on, for calls `when` accepts."""

    def __init__(
        self, mp: pytest.MonkeyPatch, owner: object, name: str, code: int, when: Callable[..., bool]
    ) -> None:
        self.on, self.hits = True, 0
        real = getattr(owner, name)

        def flaky(*a: object, **kw: object) -> object:
            if self.on and when(*a):
                self.hits += 1
                raise OSError(code, os.strerror(code))
            return real(*a, **kw)

        mp.setattr(owner, name, flaky)


def test_out_of_descriptors_on_load_is_a_503_not_a_quarantine(
    make: Callable[..., Collector], monkeypatch: pytest.MonkeyPatch
) -> None:
    c = make()
    assert c.ingest(_body(1, range(4)))[0] == 200
    c.close()
    emfile = _Switch(monkeypatch, Path, "read_bytes", errno.EMFILE, lambda p: p.name == "state.json")
    c2 = make()  # the start-up scan and the first request both hit EMFILE
    status, ans = c2.ingest(_body(2, range(4, 8)))
    assert emfile.hits and status == 503 and ans["retry_after_s"] == 1, ans
    assert "EMFILE" in ans["error"] and not c2.quarantined
    emfile.on = False  # the descriptors are back: the exporter's retry is stored
    assert c2.ingest(_body(2, range(4, 8))) == (200, {"ok": True, "duplicate": False, "commands": []})
    assert not c2.quarantined


def test_a_full_disk_at_the_log_append_is_a_507_and_the_retry_stores_once(
    make: Callable[..., Collector], monkeypatch: pytest.MonkeyPatch
) -> None:
    c = make()
    full = _Switch(monkeypatch, os, "fdatasync", errno.ENOSPC, lambda fd: True)
    status, ans = c.ingest(_body(1, range(4)))
    assert full.hits and status == 507 and "disk full" in ans["error"], ans
    full.on = False
    assert c.ingest(_body(1, range(4)))[1]["duplicate"] is False
    assert c.ingest(_body(1, range(4)))[1]["duplicate"] is True
    assert not c.quarantined


def test_a_checkpoint_on_a_full_disk_recovers_by_itself_and_leaves_no_temp_file(
    make: Callable[..., Collector], monkeypatch: pytest.MonkeyPatch
) -> None:
    c = make(interval=0.1)
    assert c.ingest(_body(1, range(2)))[0] == 200
    full = _Switch(monkeypatch, os, "fsync", errno.ENOSPC, lambda fd: True)
    assert c.ingest(_body(2, range(2, 4)))[0] == 200  # the log uses fdatasync: stored
    deadline = time.monotonic() + 10
    while c.runs["io"].failed is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert full.hits and c.runs["io"].failed is not None  # the checkpoint hit the full disk
    run_dir = c.cfg.runs_dir / "io"
    assert not [p for p in run_dir.rglob("*") if ".tmp" in p.name]  # no temp file left in the run
    full.on = False  # space freed: no request comes, the collector recovers the run itself
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        rs = c.runs.get("io")
        if rs is not None and rs.failed is None and read_table(run_dir, "steps").height == 4:
            break
        time.sleep(0.05)
    assert c.runs["io"].failed is None and sorted(read_table(run_dir, "steps")["step"].to_list()) == [
        0,
        1,
        2,
        3,
    ]
    assert c.ingest(_body(3, range(4, 6)))[0] == 200 and not c.quarantined


def test_a_log_write_cut_short_by_a_full_disk_raises_enospc_not_short_write(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    wal = Wal(tmp_path)
    wal.append(b"first record")
    real, calls = os.write, []

    def disk_fills(fd: int, data: bytes) -> int:
        calls.append(len(data))
        if len(calls) == 1:
            return real(fd, bytes(data[: len(data) // 2]))  # the kernel wrote what fitted
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "write", disk_fills)
    with pytest.raises(OSError) as e:
        wal.append(b"x" * 1000)
    monkeypatch.undo()
    assert e.value.errno == errno.ENOSPC and "short" not in str(e.value)
    wal.close()
    assert list(Wal(tmp_path).read(1)) == [b"first record"]  # the torn half was cut off
