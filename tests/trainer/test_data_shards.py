"""Token shards are checked whole before training: every id in [0, vocab), readable files, one
clear error naming the file, the position, the value and the vocab size (issue #13 item 8)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from guard.core.tomlconf import ConfigError
from tests.conftest import MICRO, REPO
from trainer import data
from trainer.data import DataConfig, DataLoader, check_shards, load_shard

VOCAB = 256


def loader(path: Path, **kw: object) -> DataLoader:
    cfg = DataConfig(source="shards", path=str(path), seq_len=32, batch_size=4, **kw)
    return DataLoader(cfg, vocab_size=VOCAB, seed=0)


def test_an_id_past_the_first_million_tokens_is_found(tmp_path: Path) -> None:
    toks = np.random.default_rng(0).integers(0, VOCAB, 3_000_000).astype(np.uint16)
    toks[2_345_678] = 300
    toks.tofile(tmp_path / "late.bin")
    with pytest.raises(ConfigError) as e:
        loader(tmp_path / "late.bin")
    msg = str(e.value)
    assert str(tmp_path / "late.bin") in msg and "token id 300" in msg and "position 2,345,678" in msg
    assert "vocab size is 256" in msg


def test_a_negative_id_in_an_int64_npy_is_found(tmp_path: Path) -> None:
    toks = np.arange(200_000, dtype=np.int64) % VOCAB
    toks[199_999] = -1
    np.save(tmp_path / "neg.npy", toks)
    with pytest.raises(ConfigError, match=r"neg\.npy: token id -1 at position 199,999 .*vocab size is 256"):
        loader(tmp_path / "neg.npy")


def test_data_vocab_size_never_exceeds_the_models(tmp_path: Path) -> None:
    np.full(1000, 255, np.uint16).tofile(tmp_path / "s.bin")
    with pytest.raises(ConfigError, match="token id 255 .*vocab size is 200"):
        loader(tmp_path / "s.bin", vocab_size=200)  # a smaller tokenizer: checked against it
    assert len(loader(tmp_path / "s.bin", vocab_size=100_000).windows) > 0  # larger: the model's 256 applies


@pytest.mark.parametrize(
    ("name", "content", "match"),
    [
        ("empty.bin", b"", "is empty"),
        ("odd.bin", b"\x01\x00\x02", "3 bytes, not a whole number of uint16 tokens"),
        ("damaged.npy", b"\x93NUMPY garbage", "cannot be read as token ids"),
    ],
)
def test_unreadable_shards_name_the_file(tmp_path: Path, name: str, content: bytes, match: str) -> None:
    (tmp_path / name).write_bytes(content)
    with pytest.raises(ConfigError, match=match) as e:
        load_shard(tmp_path / name, "uint16")
    assert str(tmp_path / name) in str(e.value)


def test_an_empty_npy_and_a_float_npy_are_refused(tmp_path: Path) -> None:
    np.save(tmp_path / "e.npy", np.zeros(0, np.uint16))
    with pytest.raises(ConfigError, match="is empty"):
        load_shard(tmp_path / "e.npy", "uint16")
    np.save(tmp_path / "f.npy", np.zeros(10, np.float32))
    with pytest.raises(ConfigError, match="dtype float32"):
        load_shard(tmp_path / "f.npy", "uint16")


def test_ranks_share_the_check_and_together_cover_every_token(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(data, "CHECK_CHUNK", 100)
    a = np.zeros(1000, np.uint16)
    a[750] = 999  # in piece 7: rank 1 of 2 checks it, rank 0 does not read it
    files = [Path("a.bin")]
    check_shards(files, [a], VOCAB, rank=0, world_size=2)
    with pytest.raises(ConfigError, match="position 750"):
        check_shards(files, [a], VOCAB, rank=1, world_size=2)
    with pytest.raises(ConfigError, match="position 750"):
        check_shards(files, [a], VOCAB)  # one rank checks everything


def test_train_cli_says_what_is_wrong_in_one_line(tmp_path: Path) -> None:
    toks = np.zeros(50_000, np.uint32)
    toks[40_000] = 70_000
    toks.tofile(tmp_path / "big-vocab.bin")
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "guard",
            "train",
            "--config",
            str(MICRO),
            "--run-dir",
            str(tmp_path / "r"),
            "--no-progress",
            "--set",
            "train.threads=1",
            "--set",
            "data.source='shards'",
            "--set",
            f"data.path='{tmp_path / 'big-vocab.bin'}'",
            "--set",
            "data.dtype='uint32'",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert p.returncode == 2, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    assert f"token shard {tmp_path / 'big-vocab.bin'}: token id 70000 at position 40,000" in p.stderr
