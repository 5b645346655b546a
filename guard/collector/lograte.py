"""Rate-limited logging for the collector: a repeated error is written a few times, then counted.

Under a connection flood or a full disk the same line repeats thousands of times a second (the
event loop's accept error, one warning per refused batch); the log then grew ~7 MB/s, enough to
fill the disk the run store is on (issue #32). A line is keyed by its logger, level and format
string (not its arguments, which differ per run or per socket): at most `burst` of a key per
`window_s`; when the window turns, one line says how many were left out.
"""

from __future__ import annotations

import logging
import threading
import time

BURST = 10
WINDOW_S = 10.0


class RepeatFilter(logging.Filter):
    """Lets `burst` records of a key through per `window_s`, then counts the rest."""

    def __init__(self, burst: int = BURST, window_s: float = WINDOW_S) -> None:
        super().__init__()
        self.burst, self.window_s = burst, window_s
        self._lock = threading.Lock()
        self._seen: dict[tuple[str, int, str], list[float | int]] = {}  # key -> [window start, n, dropped]

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.WARNING:
            return True  # only warnings and errors repeat in a storm; debug/info pass untouched
        key = (record.name, record.levelno, str(record.msg))
        now = time.monotonic()
        with self._lock:
            w = self._seen.get(key)
            if w is None or now - w[0] >= self.window_s:
                dropped = int(w[2]) if w is not None else 0
                self._seen[key] = [now, 1, 0]
                if len(self._seen) > 4096:  # keys are format strings: few; never grow without bound
                    self._seen = {key: self._seen[key]}
                if dropped:
                    record.msg = (
                        f"{record.msg} [and {dropped} more like this in the last {self.window_s:.0f} s]"
                    )
                return True
            w[1] = int(w[1]) + 1
            if w[1] <= self.burst:
                return True
            w[2] = int(w[2]) + 1
            return False


LOGGERS = ("", "uvicorn", "uvicorn.error", "uvicorn.access")  # those with their own handlers


def install(burst: int = BURST, window_s: float = WINDOW_S) -> RepeatFilter:
    """Put one RepeatFilter on every handler of the root logger and uvicorn's (call after
    basicConfig and after uvicorn.Config, which sets up uvicorn's handlers)."""
    f = RepeatFilter(burst, window_s)
    for name in LOGGERS:
        for h in logging.getLogger(name).handlers:
            if f not in h.filters:
                h.addFilter(f)
    return f
