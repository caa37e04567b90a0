"""``olmax tokenize`` / ``olmax data batches`` / ``olmax data audit`` through their argparse parsers."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pytest
from data_testlib import write_tokens

from olmax.config import ConfigError
from olmax.data import DataError
from olmax.data.commands import register
from olmax.data.dataset import TokenDataset
from olmax.data.order import GlobalOrder, process_share


def run(*argv: str) -> int:
    parser = argparse.ArgumentParser(prog="olmax")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args([str(a) for a in argv])
    return args.func(args)


def test_tokenize_then_batches_then_audit(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    lines = [json.dumps({"text": f"document {i} " + "word " * (i % 50) + "end."}) for i in range(400)]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "tok"
    assert run("tokenize", "--train-bpe", 300, "--out", out, "--heldout", 0.1, "--shard-tokens", 2000,
               "--processes", 2, "--no-progress", tmp_path / "in.jsonl") == 0
    assert "train:" in capsys.readouterr().out
    man = json.loads((out / "train" / "manifest.json").read_text())
    assert man["dtype"] == "uint16" and man["eos_token_id"] == 0 and len(man["files"]) > 1

    sets = [f"data.paths={out / 'train'}", "model.vocab_size=300", "data.sequence_length=16",
            "train.global_batch_size=12", f"data.cache_dir={tmp_path / 'cache'}"]
    sets_args = [a for s in sets for a in ("--set", s)]
    assert run("data", "batches", "tiny", *sets_args, "--steps", "3:9", "--process-index", 1,
               "--process-count", 3, "--out", tmp_path / "ids.npy", "--filter-out", tmp_path / "dirty.npy") == 0
    assert "instance ids [6, 4] for steps 3..8, process 1 of 3" in capsys.readouterr().out
    ids, dirty = np.load(tmp_path / "ids.npy"), np.load(tmp_path / "dirty.npy")
    ds = TokenDataset([str(out / "train")], sequence_length=16, vocab_size=300, eos_token_id=0, pad_token_id=1,
                      dtype="uint16")
    order = GlobalOrder(len(ds), 12, 34521)
    assert ids.dtype == np.int64 and np.array_equal(ids, process_share(order, np.arange(3, 9), 1, 3))
    assert dirty.shape == ids.shape and dirty.dtype == bool and not dirty.any()   # filter off in tiny

    assert run("data", "audit", "tiny", *sets_args, "--processes", 3, "--workers", 2, "--json") == 0
    res = json.loads(capsys.readouterr().out)
    assert res["ok"] and res["processes"] == 3 and res["workers"] == 2 and not res["problems"]


def test_filter_out_marks_dirty_instances(tmp_path: Path) -> None:
    tokens = np.random.default_rng(0).integers(2, 500, 16 * 48)
    tokens[16 * 5:16 * 6] = 3                             # instance 5: one token repeated 16 times
    path = write_tokens(tmp_path / "t.npy", tokens)
    sets = [f"data.paths={path}", "data.sequence_length=16", "train.global_batch_size=48",
            "data.repetition_filter=true", "data.repetition_max_count=10", f"data.cache_dir={tmp_path}"]
    assert run("data", "batches", "tiny", *[a for s in sets for a in ("--set", s)], "--steps", "0:1",
               "--out", tmp_path / "ids.npy", "--filter-out", tmp_path / "dirty.npy") == 0
    ids, dirty = np.load(tmp_path / "ids.npy"), np.load(tmp_path / "dirty.npy")
    assert sorted(ids[0]) == list(range(48)) and ids[0][dirty[0]].tolist() == [5]


def test_cli_errors(tmp_path: Path) -> None:
    path = write_tokens(tmp_path / "t.npy", np.arange(640) % 100)
    base = ["--set", f"data.paths={path}", "--set", f"data.cache_dir={tmp_path}"]
    with pytest.raises(DataError, match="--steps must be A:B"):
        run("data", "batches", "tiny", *base, "--steps", "3", "--out", tmp_path / "x.npy")
    with pytest.raises(DataError, match="--process-index 2 is outside 0..1"):
        run("data", "batches", "tiny", *base, "--steps", "0:2", "--process-index", 2, "--process-count", 2,
            "--out", tmp_path / "x.npy")
    with pytest.raises(DataError, match="global_batch_size=16 is larger than the epoch"):
        run("data", "audit", "tiny", *base, "--set", "data.sequence_length=64")
    with pytest.raises(DataError, match="token file not found"):
        run("data", "audit", "tiny", "--set", f"data.paths={tmp_path / 'nope.npy'}")
    with pytest.raises(ConfigError, match="unknown config key"):
        run("data", "audit", "tiny", *base, "--set", "data.pathz=x")
    with pytest.raises(DataError, match="input file not found"):
        run("tokenize", "--train-bpe", 300, "--out", tmp_path / "o", tmp_path / "missing.txt")
    assert not (tmp_path / "x.npy").exists()


def test_tokenize_chat_tokenizer_not_utf8_names_it(tmp_path: Path) -> None:
    """--chat loads its tokenizer through the same helper as plain tokenize (tests/data/test_data_tokenize.py)."""
    (tmp_path / "chat.jsonl").write_text(json.dumps({"messages": [{"role": "user", "content": "hi"}]}) + "\n")
    (tmp_path / "notok.json").write_bytes(b"\xff\xfe{}")
    with pytest.raises(DataError, match=r"tokenizer .*notok.json is not UTF-8 text"):
        run("tokenize", "--chat", "--tokenizer", tmp_path / "notok.json", "--out", tmp_path / "o", "--no-progress",
            tmp_path / "chat.jsonl")
    assert not (tmp_path / "o").exists()


def _batches_args(tmp_path: Path) -> list:
    path = write_tokens(tmp_path / "t.npy", np.arange(640) % 100)
    return ["data", "batches", "tiny", "--set", f"data.paths={path}", "--set", "data.sequence_length=16",
            "--set", "train.global_batch_size=8", "--set", f"data.cache_dir={tmp_path / 'cache'}", "--steps", "0:2"]


@pytest.mark.parametrize("flag", ["--out", "--filter-out", "--dump-instances"])
def test_batches_output_that_is_a_folder_is_refused(tmp_path: Path, flag: str) -> None:
    (tmp_path / "emptyd").mkdir()
    extra = [] if flag == "--out" else ["--out", tmp_path / "ids.npy"]
    with pytest.raises(DataError, match=rf"{flag} .*emptyd: is a folder"):
        run(*_batches_args(tmp_path), *extra, flag, tmp_path / "emptyd")
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []   # no temporary file
    assert not (tmp_path / "ids.npy").exists()


def test_batches_output_in_a_missing_folder_is_refused(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"--out .*nodir/x.npy: the folder .*nodir does not exist"):
        run(*_batches_args(tmp_path), "--out", tmp_path / "nodir" / "x.npy")


def test_batches_failed_write_leaves_no_temporary_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    def full(*a: object, **k: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")
    monkeypatch.setattr(np, "save", full)
    with pytest.raises(DataError, match=r"--out .*ids.npy: cannot write it \(No space left on device\)"):
        run(*_batches_args(tmp_path), "--out", tmp_path / "ids.npy")
    assert not (tmp_path / "ids.npy").exists() and not list(tmp_path.glob(".ids.npy.tmp*"))
