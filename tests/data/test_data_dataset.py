"""Dataset: instances, fingerprint and repetition filter against OLMo-core itself; mix files; bad input."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from data_testlib import VOCAB, random_files, write_tokens
from olmo_core.data import NumpyFSLDataset
from olmo_core.data.utils import find_periodic_sequences

from olmax.data import DataError
from olmax.data.dataset import TokenDataset, dirty_instances, read_mix, validate_tokens

KW = dict(vocab_size=VOCAB, eos_token_id=0, pad_token_id=1)


def reference(paths: list[str], L: int, dtype=np.uint16, **kw) -> NumpyFSLDataset:
    return NumpyFSLDataset(*paths, sequence_length=L, pad_token_id=kw.get("pad", 1), eos_token_id=kw.get("eos", 0),
                           vocab_size=kw.get("vocab", VOCAB), dtype=dtype, bos_token_id=kw.get("bos"))


@pytest.mark.parametrize("dtype", ["uint16", "uint32"])
def test_instances_and_fingerprint_equal_olmo_core(tmp_path: Path, dtype: str) -> None:
    paths = random_files(tmp_path, dtype=dtype)
    ours = TokenDataset(paths, sequence_length=32, dtype=dtype, **KW)
    ref = reference(paths, 32, getattr(np, dtype))
    assert len(ours) == len(ref) == 258
    assert ours.fingerprint == ref.fingerprint
    ids = np.arange(len(ours))
    assert np.array_equal(ours.read(ids), np.stack([ref[int(i)]["input_ids"].numpy() for i in ids]))
    # Every field OLMo-core hashes changes the value, as it does theirs.
    for change in (dict(bos=5), dict(eos=2), dict(pad=3), dict(vocab=1001)):
        kw = {"vocab_size": change.get("vocab", VOCAB), "eos_token_id": change.get("eos", 0),
              "pad_token_id": change.get("pad", 1), "bos_token_id": change.get("bos")}
        other = TokenDataset(paths, sequence_length=32, dtype=dtype, **kw)
        assert other.fingerprint == reference(paths, 32, getattr(np, dtype), **change).fingerprint != ours.fingerprint
    assert TokenDataset(paths[::-1], sequence_length=32, dtype=dtype, **KW).fingerprint != ours.fingerprint


def test_patterns_in_data_paths_stand_for_the_files_they_match(tmp_path: Path) -> None:
    """data.paths takes local * / ? patterns (expanded and sorted), as packed data and
    data.label_mask_paths do; a pattern that matches nothing names itself and the field."""
    paths = random_files(tmp_path)
    listed = TokenDataset(sorted(paths), sequence_length=32, dtype="uint16", **KW)
    pattern = TokenDataset([str(tmp_path / "*.npy")], sequence_length=32, dtype="uint16", **KW)
    assert [f.path for f in pattern.files] == sorted(paths)
    assert pattern.fingerprint == listed.fingerprint
    with pytest.raises(DataError, match=r"nothing-\*\.npy \(data.paths\): the pattern matches no file"):
        TokenDataset([str(tmp_path / "nothing-*.npy")], sequence_length=32, **KW)


def test_mix_file(tmp_path: Path) -> None:
    paths = random_files(tmp_path / "root" / "tok")
    mix = tmp_path / "mix.txt"
    # {root} is data.mix_root; other relative paths are under mix_root (OLMo-core's base_dir).
    mix.write_text("# a comment\n\n" + "".join(
        f"src{i},{'{root}/' if i % 2 else ''}tok/{Path(p).name}\n" for i, p in enumerate(paths)))
    ours = TokenDataset([str(mix)], sequence_length=32, dtype="uint16", mix_root=str(tmp_path / "root"), **KW)
    assert [f.label for f in ours.files] == [f"src{i}" for i in range(len(paths))]
    assert [Path(f.path).resolve() for f in ours.files] == [Path(p).resolve() for p in paths]
    assert ours.fingerprint == reference(paths, 32).fingerprint
    # Without mix_root, relative paths are taken from the mix file's folder.
    mix.write_text("".join(f"s,root/tok/{Path(p).name}\n" for p in paths))
    assert [Path(p).resolve() for _, p in read_mix(mix)] == [Path(p).resolve() for p in paths]

    mix.write_text(f"a,{paths[0]}\nb,{tmp_path}/gone.npy\n")
    with pytest.raises(DataError, match=r"mix.txt:2: token file .*gone.npy \(label 'b'\) not found"):
        TokenDataset([str(mix)], sequence_length=32, **KW)
    mix.write_text("a,{root}/x.npy\n")
    with pytest.raises(DataError, match=r"mix.txt:1: .*data.mix_root is not set"):
        read_mix(mix)
    mix.write_text("a,{TOKENIZER}/x.npy\n")
    with pytest.raises(DataError, match=r"mix.txt:1: .*data.mix_tokenizer is not set"):
        read_mix(mix, "/r")
    # AI2's mixes name the tokenizer folder with a placeholder (OLMo-core fills in dolma2-tokenizer).
    (tmp_path / "dolma2-tokenizer").mkdir()
    (tmp_path / "dolma2-tokenizer" / "x.npy").write_bytes(b"\0\0")
    mix.write_text("a,{TOKENIZER}/x.npy\n")
    assert read_mix(mix, str(tmp_path), "dolma2-tokenizer") == [("a", str(tmp_path / "dolma2-tokenizer" / "x.npy"))]
    mix.write_text("a,{OTHER}/x.npy\n")
    with pytest.raises(DataError, match=r"mix.txt:1: unresolved placeholder"):
        read_mix(mix, "/r")
    mix.write_text("just-a-path.npy\n")
    with pytest.raises(DataError, match=r"mix.txt:1: expected 'label,path'"):
        read_mix(mix)


def test_manifest_folder(tmp_path: Path) -> None:
    paths = random_files(tmp_path / "t", sizes=(500, 700))
    files = [{"path": Path(p).name, "tokens": n} for p, n in zip(paths, (500, 700))]
    (tmp_path / "t" / "manifest.json").write_text(json.dumps({"dtype": "uint16", "eos_token_id": 0, "vocab_size": 1000,
                                                              "files": files}))
    assert len(TokenDataset([str(tmp_path / "t")], sequence_length=32, dtype="uint16", **KW)) == 15 + 21
    with pytest.raises(DataError, match="tokens are uint16 but data.dtype is uint32"):
        TokenDataset([str(tmp_path / "t")], sequence_length=32, dtype="uint32", **KW)
    with pytest.raises(DataError, match="eos id is 0 but data.eos_token_id is 2"):
        TokenDataset([str(tmp_path / "t")], sequence_length=32, dtype="uint16", vocab_size=VOCAB, eos_token_id=2,
                     pad_token_id=1)
    with pytest.raises(DataError, match="tokenizer vocabulary 1000 is larger than model.vocab_size 900"):
        TokenDataset([str(tmp_path / "t")], sequence_length=32, dtype="uint16", vocab_size=900, eos_token_id=0,
                     pad_token_id=1)
    with open(paths[1], "ab") as f:
        f.write(b"\0\0")
    with pytest.raises(DataError, match="part-00001.npy: size 1402 bytes does not match its manifest"):
        TokenDataset([str(tmp_path / "t")], sequence_length=32, dtype="uint16", **KW)


@pytest.mark.parametrize("manifest, match", [
    ([], r"manifest.json: not a token manifest \(expected a JSON object written by `olmax tokenize`, got list"),
    ({"eos_token_id": 0, "files": []}, r"manifest.json: field 'dtype' is missing"),
    ({"dtype": "float99", "eos_token_id": 0, "files": []}, r"manifest.json: field 'dtype' is 'float99'"),
    ({"dtype": "uint16", "eos_token_id": 0, "files": {"a": 1}}, r"manifest.json: field 'files' is not a list"),
    ({"dtype": "uint16", "eos_token_id": 0, "files": [{"path": "part-00000.npy"}]},
     r"manifest.json: field 'files\[0\]' is not a token file entry"),
    ({"dtype": "uint16", "eos_token_id": 0, "vocab_size": "big", "files": []},
     r"manifest.json: field 'vocab_size' is 'big'"),
])
def test_manifest_of_the_wrong_shape_names_file_and_field(tmp_path: Path, manifest: object, match: str) -> None:
    """Valid JSON that is not a token manifest (a list, no or a bad dtype, ...) is a DataError naming
    the manifest and the field, not an AttributeError / KeyError / TypeError."""
    random_files(tmp_path / "t", sizes=(500,))
    (tmp_path / "t" / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(DataError, match=match):
        TokenDataset([str(tmp_path / "t")], sequence_length=32, dtype="uint16", **KW)


def test_mix_file_not_utf8_names_the_file(tmp_path: Path) -> None:
    mix = tmp_path / "mix.txt"
    mix.write_bytes(b"a,x.npy\n\xff\xfe,y.npy\n")
    with pytest.raises(DataError, match=r"mix file .*mix.txt \(data.paths\) is not UTF-8 text"):
        TokenDataset([str(mix)], sequence_length=32, **KW)


def test_bad_files(tmp_path: Path) -> None:
    paths = random_files(tmp_path, sizes=(100, 200))
    with pytest.raises(DataError, match=r"token file not found: .*missing.npy"):
        TokenDataset([*paths, str(tmp_path / "missing.npy")], sequence_length=32, **KW)
    odd = tmp_path / "odd.npy"
    odd.write_bytes(b"\1\0\2\0\3")
    with pytest.raises(DataError, match=r"odd.npy: size 5 bytes is not a multiple of 2 \(uint16"):
        TokenDataset([paths[0], str(odd)], sequence_length=32, dtype="uint16", **KW)
    with pytest.raises(DataError,
                       match=r"data.sequence_length=512 is longer than every token file .*part-00001.npy, 200"):
        TokenDataset(paths, sequence_length=512, **{**KW}, dtype="uint16")
    with pytest.raises(DataError, match="data.paths is empty"):
        TokenDataset([], sequence_length=32, **KW)
    # Remote paths (s3://, gs://, http(s)://) are read, not refused: tests/test_remote.py.


def test_token_ids_beyond_vocab(tmp_path: Path) -> None:
    tokens = np.random.default_rng(0).integers(0, VOCAB, 200_000)
    tokens[123_457] = VOCAB + 7      # between the sampled windows: only a full check sees it
    bad = write_tokens(tmp_path / "bad.npy", tokens)
    TokenDataset([bad], sequence_length=32, dtype="uint16", **KW)  # the cheap sample misses it
    with pytest.raises(DataError, match=r"bad.npy: token id 1007 at position 123457 is >= the vocabulary size 1000"):
        TokenDataset([bad], sequence_length=32, dtype="uint16", validate="full", **KW)
    tokens[-1] = 60000               # the sample always reads both ends of a file
    write_tokens(tmp_path / "bad.npy", tokens)
    with pytest.raises(DataError, match=r"token id 60000 at position 199999"):
        validate_tokens(bad, "uint16", VOCAB)
    # Reading uint16 files as uint32 (a wrong data.dtype) is caught by the sample check.
    with pytest.raises(DataError, match="vocabulary size"):
        TokenDataset([write_tokens(tmp_path / "ok.npy", tokens[:4000])], sequence_length=32, dtype="uint32", **KW)


# --------------------------------------------------------------------------- repetition filter


def planted(rng: np.random.Generator, n: int, L: int, vocab: int) -> np.ndarray:
    """Random instances with a p-periodic run planted at the start, the end or in the middle;
    counts around the thresholds (2, 3, 31, 32, 33, ...) and partial trailing periods."""
    X = rng.integers(0, vocab, size=(n, L))
    for i in range(n):
        p = int(rng.integers(1, 17))
        c = int(rng.choice([2, 3, 4, 5, 6, 7, 8, 31, 32, 33, int(rng.integers(2, 40))]))
        pat = rng.integers(0, vocab, size=p)
        rep = np.concatenate([np.tile(pat, c), pat[:int(rng.integers(0, p))]])[:L]
        where = i % 3
        s = 0 if where == 0 else L - len(rep) if where == 1 else int(rng.integers(0, L - len(rep) + 1))
        X[i, s:s + len(rep)] = rep
    return X


def test_repetition_filter_equals_olmo_core() -> None:
    rng = np.random.default_rng(1234)
    checked = dirty = 0
    # Sequence lengths below 39 cap the period at L // 3; tiny vocabularies add accidental runs.
    for L, vocab in ((512, 100), (64, 3), (100, 1000), (128, 5), (33, 2), (9, 2), (700, 50000)):
        for lo, hi, count in ((1, 13, 32), (1, 13, 4), (2, 5, 3), (1, 13, 2), (3, 13, 6)):
            X = planted(rng, 160, L, vocab)
            mine = dirty_instances(X.astype(np.int32), min_period=lo, max_period=hi, max_count=count)
            # OLMo-core NumpyDatasetBase._validate_instance, on its own find_periodic_sequences:
            ref = np.array([any(m.times >= count for m in find_periodic_sequences(x, max_period=hi, min_period=lo))
                            for x in X])
            assert np.array_equal(mine, ref), (L, vocab, lo, hi, count, np.nonzero(mine != ref)[0][:5])
            checked, dirty = checked + len(X), dirty + int(ref.sum())
    assert checked == 5600 and 0.2 * checked < dirty < 0.8 * checked   # both decisions well represented


def test_repetition_filter_thresholds() -> None:
    L, x = 700, np.arange(700) + 100
    for p, c, expect in ((1, 32, True), (1, 31, False), (13, 32, True), (13, 31, False), (14, 40, False)):
        y = x.copy()
        y[10:10 + p * c] = np.tile(np.arange(p), c)
        assert dirty_instances(y[None], max_count=32)[0] == expect, (p, c)
    assert not dirty_instances(np.zeros((1, 2)), max_count=32)[0]      # L // 3 == 0: no period to test
    assert dirty_instances(np.zeros((1, L)), min_period=1, max_period=13)[0]
