"""Tokenising: round trip, EOS per document, manifest, heldout split, process-count invariance."""

from __future__ import annotations

import gzip
import hashlib
import json
import random
from pathlib import Path

import numpy as np
import pytest
import zstandard
from tokenizers import Tokenizer

from olmax.data import DataError
from olmax.data import tokenize as tk
from olmax.data.tokenize import is_heldout, smallest_dtype, tokenize, train_bpe


def make_corpus(root: Path, n: int = 120, seed: int = 0) -> tuple[list[str], list[str]]:
    """A .txt (paragraphs), a .jsonl.gz and a .jsonl.zst; returns (paths, documents in order)."""
    rnd = random.Random(seed)
    words = ["".join(rnd.choice("abcdefghij klmnoé€") for _ in range(rnd.randint(1, 7))).strip() or "x"
             for _ in range(300)]

    def doc() -> str:
        return " ".join(rnd.choice(words) for _ in range(rnd.randint(1, 80)))

    root.mkdir(parents=True, exist_ok=True)
    docs_txt = [doc() for _ in range(n)]
    (root / "a.txt").write_text("\n\n\n".join(d.replace(" x ", "\nx ") for d in docs_txt) + "\n")
    docs_txt = [d.replace(" x ", "\nx ") for d in docs_txt]
    docs_gz = [doc() for _ in range(n)]
    with gzip.open(root / "b.jsonl.gz", "wt", encoding="utf-8") as f:
        for d in docs_gz:
            f.write(json.dumps({"id": 1, "text": d}) + "\n\n")
    docs_zst = [doc() for _ in range(n)]
    payload = "".join(json.dumps({"text": d, "meta": {}}) + "\n" for d in docs_zst).encode()
    (root / "c.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(payload))
    return [str(root / "a.txt"), str(root / "b.jsonl.gz"), str(root / "c.jsonl.zst")], docs_txt + docs_gz + docs_zst


def read_split(d: Path) -> tuple[dict, np.ndarray]:
    m = json.loads((d / "manifest.json").read_text())
    arrays = [np.fromfile(d / f["path"], dtype=np.dtype(m["dtype"]).newbyteorder("<")) for f in m["files"]]
    return m, np.concatenate(arrays) if arrays else np.zeros(0, np.int64)


def split_docs(tokens: np.ndarray, eos: int) -> list[list[int]]:
    ends = np.nonzero(tokens == eos)[0]
    assert len(tokens) == 0 or ends[-1] == len(tokens) - 1, "every document ends with EOS"
    return [tokens[s + 1:e].tolist() for s, e in zip(np.r_[-1, ends[:-1]], ends)]


def test_smallest_dtype() -> None:
    assert [smallest_dtype(v).name for v in (256, 257, 65536, 65537, 100278)] == \
        ["uint8", "uint16", "uint16", "uint32", "uint32"]


def test_round_trip_manifest_and_special_ids(tmp_path: Path) -> None:
    paths, docs = make_corpus(tmp_path / "in")
    out = tmp_path / "out"
    man = tokenize(paths, out, train_bpe_vocab=400, shard_tokens=1500, progress=False)["all"]
    tok = Tokenizer.from_file(str(out / "tokenizer.json"))
    assert tok.token_to_id("<|endoftext|>") == 0 and tok.token_to_id("<|pad|>") == 1
    m, tokens = read_split(out)
    assert m == man and m["dtype"] == "uint16" and m["eos_token_id"] == 0 and m["vocab_size"] == 400
    assert m["tokenizer"]["sha256"] == hashlib.sha256((out / "tokenizer.json").read_bytes()).hexdigest()
    got = split_docs(tokens, 0)
    assert [tok.decode(ids) for ids in got] == docs          # every document, in input order
    assert m["total_documents"] == len(docs) and m["total_tokens"] == len(tokens)
    assert m["text_bytes"] == sum(len(d.encode()) for d in docs) == sum(f["text_bytes"] for f in m["files"])
    for f in m["files"]:
        data = (out / f["path"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == f["sha256"] and len(data) == 2 * f["tokens"]
        arr = np.frombuffer(data, "<u2")
        assert arr[-1] == 0 and (arr == 0).sum() == f["documents"]   # shards end at document ends
        assert f["tokens"] <= 1500 or f["documents"] == 1


def test_same_bytes_for_any_process_count(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    paths, _ = make_corpus(tmp_path / "in", n=200, seed=1)
    monkeypatch.setattr(tk, "_CHUNK_DOCS", 7)   # many small tasks, completing out of order
    tok = tmp_path / "tok.json"
    train_bpe(paths, 350, tok)
    outs = []
    for p in (1, 2, 3):
        out = tmp_path / f"out{p}"
        tokenize(paths, out, tokenizer=tok, heldout=0.25, shard_tokens=997, processes=p, progress=False)
        outs.append({str(f.relative_to(out)): f.read_bytes() for f in sorted(out.rglob("*")) if f.is_file()})
    assert len(outs[0]) > 6 and outs[0] == outs[1] == outs[2]


def test_heldout_split_by_text_hash(tmp_path: Path) -> None:
    paths, docs = make_corpus(tmp_path / "in", n=150, seed=2)
    out = tmp_path / "out"
    tokenize(paths, out, train_bpe_vocab=300, heldout=0.3, progress=False)
    tok = Tokenizer.from_file(str(out / "train" / "tokenizer.json"))
    split = {}
    for s in ("train", "heldout"):
        m, tokens = read_split(out / s)
        assert m["split"] == s
        split[s] = [tok.decode(ids) for ids in split_docs(tokens, m["eos_token_id"])]
    assert split["heldout"] == [d for d in docs if is_heldout(d, 0.3)]
    assert split["train"] == [d for d in docs if not is_heldout(d, 0.3)]
    assert 0.2 < len(split["heldout"]) / len(docs) < 0.4
    assert not set(split["heldout"]) & set(split["train"])


def test_train_bpe_is_deterministic(tmp_path: Path) -> None:
    paths, _ = make_corpus(tmp_path / "in", n=60)
    assert train_bpe(paths, 300, tmp_path / "a.json") == train_bpe(paths, 300, tmp_path / "b.json")


# --------------------------------------------------------------------------- bad input


def test_bad_inputs_name_the_problem_and_write_nothing(tmp_path: Path) -> None:
    paths, _ = make_corpus(tmp_path / "in", n=30)
    tok = tmp_path / "tok.json"
    train_bpe(paths, 300, tok)
    out = tmp_path / "out"

    with pytest.raises(DataError, match="input file not found: .*nope.txt"):
        tokenize([*paths, str(tmp_path / "nope.txt")], out, tokenizer=tok, progress=False)
    (tmp_path / "blank.txt").write_text("\n\n  \n")
    with pytest.raises(DataError, match="empty corpus.*blank.txt"):
        tokenize([str(tmp_path / "blank.txt")], out, tokenizer=tok, progress=False)
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"body": "no text"}\n')
    with pytest.raises(DataError, match=r"bad.jsonl:2: no string field 'text'"):
        tokenize([str(tmp_path / "bad.jsonl")], out, tokenizer=tok, progress=False)
    (tmp_path / "broken.jsonl").write_text('{"text": "ok"}\n{"text": \n')
    with pytest.raises(DataError, match=r"broken.jsonl:2: not valid JSON"):
        tokenize([str(tmp_path / "broken.jsonl")], out, tokenizer=tok, progress=False)
    with pytest.raises(DataError, match=r"a.txt: token id \d+ >= vocab size 100"):
        tokenize(paths, out, tokenizer=tok, vocab_size=100, progress=False)
    with pytest.raises(DataError, match="tokenizer file not found"):
        tokenize(paths, out, tokenizer=tmp_path / "missing.json", progress=False)
    assert not out.exists() and not list(tmp_path.glob(".out.tmp*"))   # nothing left behind

    out.mkdir()
    (out / "keep.npy").write_bytes(b"precious")
    with pytest.raises(DataError, match="already exists and is not empty"):
        tokenize(paths, out, tokenizer=tok, progress=False)
    assert (out / "keep.npy").read_bytes() == b"precious"


@pytest.mark.parametrize("content, match", [
    (b"{}", r"tokenizer .*notok.json cannot be read: .*Hugging Face tokenizer.json"),
    (b"not a tokenizer", r"tokenizer .*notok.json cannot be read"),
    (b"\xff\xfe{}", r"tokenizer .*notok.json is not UTF-8 text"),
])
def test_bad_tokenizer_file_names_it(tmp_path: Path, content: bytes, match: str) -> None:
    """A --tokenizer that is not a tokenizer.json (``{}``, text, not UTF-8) is a DataError naming it,
    raised before anything is written."""
    (tmp_path / "a.txt").write_text("hello world\n")
    (tmp_path / "notok.json").write_bytes(content)
    with pytest.raises(DataError, match=match):
        tokenize([str(tmp_path / "a.txt")], tmp_path / "out", tokenizer=tmp_path / "notok.json", progress=False)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp*"))


def test_corrupt_zst_input_names_the_file(tmp_path: Path) -> None:
    good = zstandard.ZstdCompressor().compress(b'{"text": "hello"}\n' * 1000)
    bad = tmp_path / "bad.jsonl.zst"
    bad.write_bytes(good[:20] + bytes(b ^ 0x55 for b in good[20:]))
    with pytest.raises(DataError, match=r"bad.jsonl.zst: cannot read \(zstd decompress error"):
        list(tk.iter_documents(bad))


def test_corrupt_zst_chat_input_names_the_file(tmp_path: Path) -> None:
    from olmax.data.chat import _read_chunks
    good = zstandard.ZstdCompressor().compress(b'{"messages": []}\n' * 1000)
    bad = tmp_path / "chat.jsonl.zst"
    bad.write_bytes(good[:20] + bytes(b ^ 0x55 for b in good[20:]))
    with pytest.raises(DataError, match=r"chat.jsonl.zst: cannot read \(zstd decompress error"):
        list(_read_chunks([bad]))


def test_corrupt_gz_input_names_the_file(tmp_path: Path) -> None:
    good = gzip.compress(b'{"text": "hello"}\n' * 1000)
    bad = tmp_path / "bad.jsonl.gz"
    bad.write_bytes(good[:20] + bytes(b ^ 0x55 for b in good[20:]))
    with pytest.raises(DataError, match=r"bad.jsonl.gz: cannot read \(Error -3 while decompressing"):
        list(tk.iter_documents(bad))


def test_folder_input_says_it_is_a_folder(tmp_path: Path) -> None:
    (tmp_path / "docs").mkdir()
    with pytest.raises(DataError, match=r"input .*docs is a folder: INPUT takes files"):
        tokenize([str(tmp_path / "docs")], tmp_path / "out", train_bpe_vocab=300, progress=False)
