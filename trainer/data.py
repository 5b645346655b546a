"""Token data: the embedded default corpus (this interpreter's standard library source, as bytes)
and pre-tokenized shards (.bin / .npy, uint16 / uint32) for real runs.

Order is deterministic and resumable: the token stream is cut into non-overlapping windows of
seq_len+1 tokens, windows are visited in a seeded permutation per epoch, and rank r of W takes
every W-th window of each global batch. `state_dict()` is just (epoch, sample): `sample` counts
the windows consumed by ALL ranks in this epoch, so it does not depend on the world size and a
run checkpointed on W ranks resumes on W' ranks at the same place in the stream (no window read
twice, none skipped). A resumed run reads exactly the batches an uninterrupted run would have
read, and a rollback can skip a data window by moving the position forward (PaLM-style).
"""

from __future__ import annotations

import glob
import os
import sysconfig
import time
from pathlib import Path

import numpy as np
import torch

from guard.core.tomlconf import ConfigError
from trainer.data_config import DataConfig as DataConfig

# Data-quality filter for the embedded corpus, as any pretraining pipeline has one: test suites
# and codec tables hold deliberately odd bytes (Latin-1 literals, character maps, binary
# fixtures) that make natural loss and grad-norm spikes of 5-20x on a model this small. Left in,
# a "clean" demo run is not clean. What remains is ~10 MB of library code on CPython 3.11.
_SKIP_DIRS = frozenset({"test", "tests", "idle_test", "encodings", "site-packages", "__pycache__"})
_MAX_NON_ASCII = 0.005  # files with more than 0.5% bytes >= 0x80 are skipped


def _is_clean_source(b: bytes) -> bool:
    non_ascii = int(np.count_nonzero(np.frombuffer(b, dtype=np.uint8) >= 0x80))
    return non_ascii <= _MAX_NON_ASCII * max(1, len(b))


def _library_sources(root: Path) -> list[Path]:
    """Sorted .py files under root, never descending into _SKIP_DIRS (site-packages is large)."""
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
        found += [Path(dirpath) / f for f in filenames if f.endswith(".py")]
    return sorted(found)


def stdlib_corpus(max_bytes: int) -> np.ndarray:
    """Bytes of the running interpreter's stdlib library .py files (tests and codec tables left
    out, see _SKIP_DIRS), sorted by path: deterministic for a given Python build."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise ConfigError(f"the standard library source was not found at {root}")
    chunks: list[bytes] = []
    total = 0
    for p in _library_sources(root):
        try:
            b = p.read_bytes()
        except OSError:
            continue
        if not _is_clean_source(b):
            continue
        chunks.append(b)
        total += len(b)
        if total >= max_bytes:
            break
    if total == 0:
        raise ConfigError(f"no .py files found under the standard library at {root}")
    return np.frombuffer(b"".join(chunks)[:max_bytes], dtype=np.uint8)


def shard_files(path: str) -> list[Path]:
    p = Path(path)
    if p.is_dir():
        files = sorted([*p.glob("*.bin"), *p.glob("*.npy")])
    elif any(c in path for c in "*?["):
        files = sorted(Path(f) for f in glob.glob(path))
    else:
        files = [p] if p.exists() else []
    files = [f for f in files if f.suffix in (".bin", ".npy")]
    if not files:
        raise ConfigError(f"data.path = {path!r}: no .bin or .npy token shards found there")
    return files


SHARD_DTYPES = (np.uint8, np.uint16, np.uint32, np.int32, np.int64)
CHECK_CHUNK = 1 << 24  # tokens per vectorised min/max pass (32-128 MB of a memmap at a time)
CHECK_BAR_MIN = 1 << 27  # tokens to check on this rank before a progress bar is worth showing


def load_shard(f: Path, dtype: str) -> np.ndarray:
    """Memory-map one shard; every way it can be unreadable is a ConfigError naming the file."""
    try:
        size = f.stat().st_size
        if f.suffix == ".npy":
            arr = np.load(f, mmap_mode="r")
        else:
            item = np.dtype(dtype).itemsize
            if size == 0:
                raise ConfigError(f"token shard {f} is empty (0 bytes)")
            if size % item:
                raise ConfigError(
                    f"token shard {f} has {size:,} bytes, not a whole number of {dtype} tokens "
                    f"({item} bytes each): it is truncated, or data.dtype is wrong"
                )
            arr = np.memmap(f, dtype=dtype, mode="r")
    except ConfigError:
        raise
    except (OSError, ValueError, EOFError) as e:  # a damaged .npy header, an unreadable file
        raise ConfigError(f"token shard {f} cannot be read as token ids: {type(e).__name__}: {e}") from None
    if arr.ndim != 1:
        raise ConfigError(f"token shard {f} has shape {arr.shape}; expected a 1-D array of token ids")
    if arr.dtype not in SHARD_DTYPES:
        raise ConfigError(
            f"token shard {f} has dtype {arr.dtype}; expected one of "
            f"{', '.join(np.dtype(d).name for d in SHARD_DTYPES)}"
        )
    if len(arr) == 0:
        raise ConfigError(f"token shard {f} is empty (0 tokens)")
    return arr


def check_shards(
    files: list[Path], arrays: list[np.ndarray], vocab_size: int, *, rank: int = 0, world_size: int = 1
) -> None:
    """Every token id of every shard in [0, vocab_size), or a ConfigError naming the file, the
    position, the value and the vocab size (an id out of range would crash training with an
    IndexError hours in). Vectorised min/max over the memmaps in CHECK_CHUNK pieces, so memory
    stays bounded; rank r of W checks every W-th piece (the ranks read the dataset once between
    them). A progress bar on stderr when this rank has more than CHECK_BAR_MIN tokens to check."""
    from tqdm import tqdm

    pieces = [(i, lo) for i, a in enumerate(arrays) for lo in range(0, len(a), CHECK_CHUNK)]
    mine = pieces[rank::world_size]
    total = sum(min(CHECK_CHUNK, len(arrays[i]) - lo) for i, lo in mine)
    with tqdm(
        total=total,
        unit="tok",
        unit_scale=True,
        desc="checking token shards",
        leave=False,
        disable=total < CHECK_BAR_MIN or None,
    ) as bar:
        for i, lo in mine:
            chunk = arrays[i][lo : lo + CHECK_CHUNK]
            signed = chunk.dtype.kind == "i"
            if int(chunk.max()) >= vocab_size or (signed and int(chunk.min()) < 0):
                bad = np.flatnonzero((chunk >= vocab_size) | (chunk < 0) if signed else chunk >= vocab_size)
                pos = lo + int(bad[0])
                raise ConfigError(
                    f"token shard {files[i]}: token id {int(chunk[bad[0]])} at position {pos:,} (of {len(arrays[i]):,} "
                    f"tokens) is outside [0, {vocab_size}): the vocab size is {vocab_size} ({len(bad):,} such ids in "
                    f"positions {lo:,}..{lo + len(chunk) - 1:,}); the shard was tokenized for another vocabulary, "
                    "or is damaged"
                )
            bar.update(len(chunk))


class TokenWindows:
    """A token stream cut into windows of seq_len+1 tokens across one or more arrays."""

    def __init__(self, arrays: list[np.ndarray], seq_len: int, names: list[str]) -> None:
        self.arrays = arrays
        self.win = seq_len + 1
        counts = [len(a) // self.win for a in arrays]
        self.offsets = np.cumsum([0, *counts])
        if self.offsets[-1] == 0:
            sizes = ", ".join(f"{n}: {len(a)} tokens" for n, a in zip(names, arrays, strict=True))
            raise ConfigError(f"corpus too small for seq_len {seq_len}: {sizes}")

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def get(self, i: int) -> np.ndarray:
        a = int(np.searchsorted(self.offsets, i, side="right") - 1)
        j = i - int(self.offsets[a])
        return np.asarray(self.arrays[a][j * self.win : (j + 1) * self.win], dtype=np.int64)


class DataLoader:
    """Deterministic, resumable batches of [B, T+1] int64 tokens for one rank."""

    def __init__(self, cfg: DataConfig, *, vocab_size: int, seed: int, rank: int = 0, world_size: int = 1):
        self.cfg = cfg
        self.seed = seed
        self.rank = rank
        self.world_size = world_size
        if cfg.source == "stdlib":
            if vocab_size < 256:
                raise ConfigError(
                    f"model.vocab_size = {vocab_size}: the stdlib corpus is bytes and needs >= 256"
                )
            self.windows = TokenWindows([stdlib_corpus(cfg.max_bytes)], cfg.seq_len, ["stdlib"])
        else:
            files = shard_files(cfg.path)
            arrays = [load_shard(f, cfg.dtype) for f in files]
            # data.vocab_size may be smaller than the model's (a tokenizer with unused ids), never larger
            limit = vocab_size if cfg.vocab_size is None else min(cfg.vocab_size, vocab_size)
            check_shards(files, arrays, limit, rank=rank, world_size=world_size)
            self.windows = TokenWindows(arrays, cfg.seq_len, [str(f) for f in files])
        self.epoch = 0
        self.sample = 0  # windows consumed by all ranks in this epoch (world-size independent)
        self._perm = self._permutation(0)
        self.stall_next_s = 0.0  # fault injection: sleep before the next batch

    @property
    def global_batch(self) -> int:
        """Windows one step consumes across all ranks."""
        return self.cfg.batch_size * self.world_size

    @property
    def batches_per_epoch(self) -> int:
        return len(self.windows) // self.global_batch

    @property
    def cursor(self) -> int:
        """Batches consumed by this rank in this epoch."""
        return self.sample // self.global_batch

    def _permutation(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.windows))

    def _advance(self) -> int:
        """Start of the next global batch in this epoch's permutation (rolls the epoch over)."""
        if self.sample + self.global_batch > len(self.windows):
            self.epoch += 1
            self.sample = 0
            self._perm = self._permutation(self.epoch)
        start = self.sample
        self.sample += self.global_batch
        return start

    def next_batch(self) -> torch.Tensor:
        if self.stall_next_s > 0:
            time.sleep(self.stall_next_s)
            self.stall_next_s = 0.0
        if self.batches_per_epoch == 0:
            raise ConfigError(
                f"corpus has {len(self.windows)} windows; too few for batch_size {self.cfg.batch_size} "
                f"x world size {self.world_size}"
            )
        start = self._advance()
        # rank r of W takes windows start+r, start+r+W, ... of the global batch
        idx = self._perm[start + self.rank : start + self.global_batch : self.world_size]
        return torch.from_numpy(np.stack([self.windows.get(int(i)) for i in idx]))

    def skip(self, n_batches: int) -> None:
        """Skip a data window (after a rollback) without reading it."""
        for _ in range(n_batches):
            self._advance()

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "sample": self.sample}

    def load_state_dict(self, d: dict[str, int]) -> None:
        self.epoch = int(d["epoch"])
        # "cursor" (batches of this world size): checkpoints written before positions were global
        self.sample = int(d["sample"]) if "sample" in d else int(d["cursor"]) * self.global_batch
        self._perm = self._permutation(self.epoch)
