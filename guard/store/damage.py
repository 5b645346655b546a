"""Damaged run-store parts: which part files readers skip and why (a truncated write, a full
disk, a copy in progress, not Parquet at all), checked once per file size and mtime. The reader
(guard/store/reader.py) skips what this finds; the app and `moeguard replay` list it."""

from __future__ import annotations

import errno
import os
import warnings
from dataclasses import dataclass
from pathlib import Path

import polars as pl

from guard.core import schema
from guard.store import summary
from guard.store.layout import newest_part_names, part_files

PARQUET_MAGIC = b"PAR1"  # a Parquet file starts and ends with it; the footer length sits before the end


class DamagedPartWarning(UserWarning):
    """A part file that is not whole Parquet was skipped (the message names the file)."""


class PartGone(FileNotFoundError):
    """A listed part that is no longer there: merged into a compacted part or retired after the
    listing (the store's upkeep deletes what it replaced at once: store.grace_s 0). Not damage,
    and nothing is lost: the reader lists the folder again (the app reruns its page,
    reader.read_reports re-lists its window)."""

    def __init__(self, path: str | Path) -> None:
        super().__init__(errno.ENOENT, "listed, then compacted or retired: list the folder again", str(path))


@dataclass(frozen=True, slots=True)
class DamagedPart:
    path: Path
    reason: str

    def message(self) -> str:
        return f"skipped damaged part {self.path}: {self.reason}; the rest of the run reads without it"


# Footer checks run so far in this process (tests count them: a part is checked once, again only
# when its size or mtime changes).
footer_checks = 0
# table folder -> part name -> (size, mtime_ns, problem or None). One entry per part file the
# process has seen (about 200 bytes each); a folder's entries for parts that left it are dropped
# when it is listed again, so nothing grows past the live parts and there is no cliff where a
# bounded cache starts evicting and every scan re-reads every footer.
_checked: dict[str, dict[str, tuple[int, int, str | None]]] = {}


def part_problem(path: str | Path) -> str | None:
    """Why a part file cannot be read as Parquet (None when it can): its magic bytes, footer
    length and footer are checked once per (path, size, mtime), so a file that a copy finishes
    later, or that is damaged after it was first checked, is checked again, and nothing else is."""
    global footer_checks
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise PartGone(path) from None
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    folder, name = os.path.split(str(path))
    seen = _checked.setdefault(folder, {})
    hit = seen.get(name)
    if hit is not None and hit[0] == st.st_size and hit[1] == st.st_mtime_ns:
        return hit[2]
    footer_checks += 1
    why = _check_footer(str(path), st.st_size)
    seen[name] = (st.st_size, st.st_mtime_ns, why)
    return why


def forget_gone(folder: str, names: tuple[str, ...]) -> None:
    """Drop the remembered checks of parts no longer in `folder` (compacted away, retired)."""
    seen = _checked.get(folder)
    if seen and len(seen) > len(names):
        keep = set(names)
        for n in [n for n in seen if n not in keep]:
            del seen[n]


def part_truncated(path: str | Path) -> str | None:
    """`part_problem`'s cheap half (a few bytes read, the footer not parsed, nothing cached): why
    the file is not whole Parquet (too short, no magic bytes, no footer), None when it looks
    whole. For listing many runs (the Runs page); readers use part_problem."""
    try:
        return _check_footer(str(path), os.stat(path).st_size, parse=False)
    except FileNotFoundError:
        return None  # compacted or retired since the listing: not damage (PartGone)
    except OSError as e:
        return f"cannot be read ({e.strerror})"


def _check_footer(path: str, size: int, *, parse: bool = True) -> str | None:
    if size < 12:
        return f"{size} bytes, too short to be Parquet (a crash or a full disk?)"
    try:
        with open(path, "rb") as f:
            head = f.read(4)
            f.seek(size - 8)
            tail = f.read(8)
    except FileNotFoundError:
        raise PartGone(path) from None
    except OSError as e:
        return f"cannot be read ({e.strerror})"
    if head != PARQUET_MAGIC:
        return "does not start with Parquet's magic bytes (not a Parquet file)"
    if tail[4:] != PARQUET_MAGIC:
        return "has no Parquet footer: truncated (a crash, a full disk or a copy in progress?)"
    if int.from_bytes(tail[:4], "little") + 12 > size:
        return "its footer length points before the file's start (damaged)"
    if not parse:
        return None
    try:
        pl.read_parquet_schema(path)
    except Exception as e:  # polars raises several kinds for a bad footer
        return "its footer cannot be parsed (" + (str(e).splitlines() or [type(e).__name__])[0][:120] + ")"
    return None


def good_parts(parts: list[Path]) -> list[Path]:
    """`parts` without the damaged ones; each skipped file is reported as a DamagedPartWarning."""
    out = []
    for p in parts:
        why = part_problem(p)
        if why is None:
            out.append(p)
        else:
            warnings.warn(DamagedPart(Path(p), why).message(), DamagedPartWarning, stacklevel=3)
    return out


def damaged_parts(run_dir: str | Path) -> list[DamagedPart]:
    """Every part of every table of the run that readers skip, with the reason."""
    found = []
    for t in schema.TABLES:
        for p in part_files(run_dir, t):
            try:
                why = part_problem(p)
            except PartGone:
                continue  # compacted or retired since the listing: not damage
            if why is not None:
                found.append(DamagedPart(p, why))
    return found


def newest_damaged(run_dir: str | Path, doc: dict | None) -> list[DamagedPart]:
    """Damaged parts among each table's newest (the open segment's, from summary.json's
    last_step, and the summary.TAIL_BEFORE before them; the newest summary.TAIL_MAX): what the Runs page checks, flat in the
    run's length. Where summary.json lists them and is current (summary.current_tails: no
    folder changed since the writer listed it), each is checked by one stat(): the size the
    writer recorded means it is whole, and only a part of another size has its bytes read.
    Otherwise (an older summary, a live run between its parts and its next save) each table
    folder is listed and its newest parts checked for truncation (`part_truncated`)."""
    doc = doc or {}
    tails = summary.current_tails(doc, run_dir)
    found = []
    for t in schema.TABLES:
        d = os.path.join(run_dir, t)
        if tails is not None:
            base = d + os.sep
            for name, size in tails[t]:
                try:
                    same = os.stat(base + name).st_size == size
                except (OSError, TypeError):
                    same = False
                if not same and (why := part_truncated(base + str(name))) is not None:
                    found.append(DamagedPart(Path(d, str(name)), why))
            continue
        open_from = summary.open_segment_start(doc.get("last_step"))
        for name in newest_part_names(d, open_from, summary.TAIL_BEFORE, summary.TAIL_MAX):
            if (why := part_truncated(os.path.join(d, name))) is not None:
                found.append(DamagedPart(Path(d, name), why))
    return found


def forget_checks() -> None:
    """Drop every remembered footer check (reader.clear_cache)."""
    _checked.clear()
