"""The collector's write-ahead log: length + crc framed records in numbered segments
(runs/<run>/.collector/wal-<segment>.log). A batch is durable once its record is fdatasync'd."""

from __future__ import annotations

import errno
import logging
import os
import re
import struct
import time
import zlib
from collections.abc import Iterator
from pathlib import Path

from guard.store.layout import fsync_dir

log = logging.getLogger("moeguard.collector")

_REC_HDR = struct.Struct("<II")  # length, crc32
WAL_RE = re.compile(r"^wal-(\d{10})\.log$")


class Wal:
    def __init__(self, d: Path) -> None:
        self.dir = d
        self._warned: set[str] = set()
        self.cur = max(self.segments(), default=0) + 1
        self._fd: int | None = None
        self._size = 0  # bytes of whole records in the open segment
        self._dir_synced = False  # the open segment's directory entry is durable

    def _path(self, seg: int) -> Path:
        return self.dir / f"wal-{seg:010d}.log"

    def segments(self) -> list[int]:
        """Segment numbers on disk; anything else in the folder (a stray `wal-abc.log`) is
        not ours: left alone, named once in the log, never parsed."""
        out = []
        for p in self.dir.glob("wal-*.log"):
            m = WAL_RE.match(p.name)
            if m is not None:
                out.append(int(m.group(1)))
            elif p.name not in self._warned:
                self._warned.add(p.name)
                log.warning("%s: %s is not a log segment of this collector; ignored", self.dir, p.name)
        return sorted(out)

    def append(self, rec: bytes) -> None:
        """Append one record, durably (data and, for a new segment, its directory entry), or
        raise with the segment as it was: a failed append never leaves a torn record that would
        hide the records appended after it."""
        data = _REC_HDR.pack(len(rec), zlib.crc32(rec)) + rec
        if self._fd is None:
            self._fd = os.open(self._path(self.cur), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            self._size, self._dir_synced = os.fstat(self._fd).st_size, False
        try:
            _write_all(self._fd, data)
            os.fdatasync(self._fd)
            if not self._dir_synced:  # a new segment's name must survive a power loss too
                fsync_dir(self.dir)
                self._dir_synced = True
        except BaseException:
            self._undo()
            raise
        self._size += len(data)

    def _undo(self) -> None:
        """Cut the segment back to its last whole record; failing that, end it there (a reader
        stops at the torn tail of a segment and goes on with the next one)."""
        assert self._fd is not None
        try:
            os.ftruncate(self._fd, self._size)
            os.fdatasync(self._fd)
        except OSError:
            log.warning("wal %s: could not cut a failed append; starting a new segment", self._path(self.cur))
            self.rotate()

    def rotate(self) -> int:
        """Close the segment being written; returns the last segment holding records."""
        if self._fd is None:
            return self.cur - 1
        os.close(self._fd)
        self._fd = None
        self.cur += 1
        return self.cur - 1

    def read(self, seg: int) -> Iterator[bytes]:
        """Records of a segment; stops at a torn or corrupt tail (never acknowledged)."""
        data = self._path(seg).read_bytes()
        off = 0
        while off + _REC_HDR.size <= len(data):
            n, crc = _REC_HDR.unpack_from(data, off)
            rec = data[off + _REC_HDR.size : off + _REC_HDR.size + n]
            if len(rec) != n or zlib.crc32(rec) != crc:
                log.warning("wal %s: torn record at byte %d ignored", self._path(seg), off)
                return
            yield rec
            off += _REC_HDR.size + n

    def written_at(self, seg: int) -> float:
        """When segment `seg` was last written, by this machine's clock (capped at now)."""
        try:
            return min(self._path(seg).stat().st_mtime, time.time())
        except OSError:
            return time.time()

    def delete_upto(self, seg: int) -> None:
        for s in self.segments():
            if s <= seg and s != self.cur:
                self._path(s).unlink(missing_ok=True)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def _write_all(fd: int, data: bytes) -> None:
    """Write all of `data`. A write cut short (the disk filled up part-way) is continued, so
    the error that stopped it is the one raised (ENOSPC), not a vague "short write"."""
    view, done = memoryview(data), 0
    while done < len(data):
        n = os.write(fd, view[done:])
        if n <= 0:
            raise OSError(errno.EIO, f"write-ahead log: write returned {n} after {done} of {len(data)} bytes")
        done += n
