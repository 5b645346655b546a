"""The data config ([data] table), validated on load without importing torch (trainer/cli.py
refuses a bad config before torch's import); trainer/data.py reads the data and re-exports it."""

from __future__ import annotations

from dataclasses import dataclass

from guard.core.tomlconf import check, check_choice


@dataclass(kw_only=True, slots=True)
class DataConfig:
    source: str = "stdlib"  # stdlib | shards
    path: str = ""  # shards: a glob, a directory or a file (.bin/.npy)
    dtype: str = "uint16"  # shards stored as raw .bin: uint16 | uint32 (.npy carries its own)
    seq_len: int = 128
    batch_size: int = 8  # sequences per micro-batch per rank
    max_bytes: int = 16_000_000  # stdlib corpus: read files in sorted order up to this many bytes
    vocab_size: int | None = None  # shards: check every token is below this (None: the model's)

    def __post_init__(self) -> None:
        check_choice("data.source", self.source, ("stdlib", "shards"))
        check_choice("data.dtype", self.dtype, ("uint16", "uint32"))
        check(self.seq_len >= 2, "data.seq_len", self.seq_len, "must be >= 2")
        check(self.batch_size >= 1, "data.batch_size", self.batch_size, "must be >= 1")
        check(self.max_bytes >= 4096, "data.max_bytes", self.max_bytes, "must be >= 4096")
        if self.source == "shards":
            check(
                bool(self.path), "data.path", self.path, "must name token shards when data.source = 'shards'"
            )
