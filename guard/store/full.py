"""A full disk, said in one line: which write failed, where, and how much room is left.

A run that fills its disk used to end in a traceback (`RuntimeError: run store writer failed:
... No space left on device`) with meta.json still saying `running` (issue #40). Every writer of a
run (the run store's Parquet parts and meta.json, checkpoints, the profiler's trace) can hit it,
and polars reports it as a ComputeError whose text carries the OS error, so the test walks the
exception's chain and reads both forms. `moeguard train` turns it into `disk_full_line(e)` and
EXIT_DISK_FULL; the run store still ends meta.json (crashed, with this line as its note) when
it can, and says so when it cannot. Imports nothing heavy: guard/cli.py uses it for every command.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
from pathlib import Path

EXIT_DISK_FULL = 4  # `moeguard train`'s exit status when a disk filled up (see trainer/cli.py)
FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # no space, over quota, file size limit
_OS_ERROR = re.compile(r"\(os error (\d+)\)")  # how polars (Rust's std::io::Error) says it


class StoreFull(RuntimeError):
    """The run store could not write: its disk (or quota) is full. The message is the one line."""


def full_errno(exc: BaseException | None) -> int | None:
    """The disk-full errno somewhere in `exc`'s chain (cause or context), else None."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in FULL_ERRNOS:
            return exc.errno
        m = _OS_ERROR.search(str(exc))
        if m is not None and int(m.group(1)) in FULL_ERRNOS:
            return int(m.group(1))
        exc = exc.__cause__ or exc.__context__
    return None


def free_bytes(path: str | Path) -> int | None:
    """Bytes free to this user on the file system holding `path` (its nearest existing parent)."""
    p = Path(path).absolute()
    while not p.exists() and p.parent != p:
        p = p.parent
    try:
        return shutil.disk_usage(p).free
    except OSError:
        return None


def size_text(n: int | None) -> str:
    if n is None:
        return "an unknown amount"
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} bytes"


def full_text(where: str | Path, code: int) -> str:
    """'<where>: no space left on device (12.0 kB free on its disk)'."""
    return f"{where}: {os.strerror(code).lower()} ({size_text(free_bytes(where))} free on its disk)"


def disk_full_line(exc: BaseException, where: str | Path | None = None) -> str | None:
    """The one line for a disk-full error in `exc` (None when it is not one). `where`: the path
    being written, when the error does not name it."""
    code = full_errno(exc)
    if code is None:
        return None
    if isinstance(exc, StoreFull):
        return str(exc)
    path = where if where is not None else _filename(exc) or "a write"
    return f"disk full: {full_text(path, code)}"


def _filename(exc: BaseException | None) -> str | None:
    while exc is not None:
        if isinstance(exc, OSError) and exc.filename:
            return str(exc.filename)
        exc = exc.__cause__ or exc.__context__
    return None
