"""Corpus -> raw token files in OLMo-core's layout, plus ``manifest.json``.

Token files are little-endian arrays with *no header* despite the ``.npy`` name (as the Dolma
toolkit writes them and OLMo-core reads them), in the smallest unsigned dtype that holds
``vocab_size - 1`` (OLMo-core ``NumpyDatasetConfig.get_dtype``). Every document ends with EOS.
Documents are never split across shards.

Documents are read in order in the main process, encoded in chunks by worker processes and
written back in input order, so the output is byte-identical for any process count.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import multiprocessing as mp
import os
import shutil
import sys
import zlib
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any, Literal

import numpy as np

from olmax.data import DataError

EOS_TOKEN = "<|endoftext|>"      # id 0 in a BPE trained here (the tiny recipe's eos)
PAD_TOKEN = "<|pad|>"            # id 1 (the tiny recipe's pad)
MANIFEST = "manifest.json"
FORMAT = "olmax-tokens/1"
HELDOUT_RULE = "blake2b-64(utf-8 text) / 2**64 < heldout_fraction"
TextUnit = Literal["paragraph", "line", "file"]
_JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
_CHUNK_DOCS, _CHUNK_CHARS = 4096, 1 << 22   # bounded work unit (and memory) per task


def smallest_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype holding ``vocab_size - 1`` (OLMo-core ``get_dtype``)."""
    for dt in (np.uint8, np.uint16, np.uint32, np.uint64):
        if vocab_size - 1 <= np.iinfo(dt).max:
            return np.dtype(dt)
    raise DataError(f"vocab size {vocab_size} does not fit in uint64")


def is_heldout(text: str, fraction: float) -> bool:
    """Deterministic document split by a hash of the text (never by position or process)."""
    if fraction <= 0.0:
        return False
    h = int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")
    return h / 2**64 < fraction


# --------------------------------------------------------------------------- reading


class _Source:
    """An input file opened as text, with the position in the raw (compressed) bytes."""

    def __init__(self, path: Path):
        self.path = path
        self.raw = open(path, "rb")
        stream: io.RawIOBase | io.BufferedIOBase = self.raw
        # What reading may raise for a damaged file (gzip's corrupt deflate data is a zlib.error).
        self.read_errors: tuple[type[BaseException], ...] = (OSError, EOFError, zlib.error)
        suffixes = path.suffixes
        if suffixes and suffixes[-1] == ".gz":
            stream = gzip.GzipFile(fileobj=self.raw)
            suffixes = suffixes[:-1]
        elif suffixes and suffixes[-1] == ".zst":
            import zstandard
            stream = zstandard.ZstdDecompressor().stream_reader(self.raw)
            self.read_errors += (zstandard.ZstdError,)
            suffixes = suffixes[:-1]
        self.jsonl = bool(suffixes) and suffixes[-1] in _JSONL_SUFFIXES
        self.text = io.TextIOWrapper(stream, encoding="utf-8")  # type: ignore[arg-type]

    def close(self) -> None:
        self.text.close()
        self.raw.close()


def iter_documents(path: str | Path, text_field: str = "text", text_unit: TextUnit = "paragraph"
                   ) -> Iterator[tuple[str, int]]:
    """Yield ``(text, raw_bytes_read)`` for each non-empty document of one input file.

    JSONL (``.jsonl/.json/.ndjson``, Dolma style): one document per line, text in ``text_field``.
    Plain text: a document per blank-line separated block (``paragraph``), per line, or per file.
    """
    src = _Source(Path(path))
    try:
        if src.jsonl:
            for n, line in enumerate(src.text, 1):
                if not line.strip():
                    continue
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{n}: not valid JSON ({e.msg})") from None
                text = rec.get(text_field) if isinstance(rec, dict) else None
                if not isinstance(text, str):
                    raise DataError(f"{path}:{n}: no string field {text_field!r} (see --text-field)")
                if text:
                    yield text, src.raw.tell()
        elif text_unit == "file":
            text = src.text.read()
            if text.strip():
                yield text, src.raw.tell()
        else:
            block: list[str] = []
            for line in src.text:
                if text_unit == "line":
                    if line.strip():
                        yield line.rstrip("\n"), src.raw.tell()
                elif line.strip():
                    block.append(line)
                elif block:
                    yield "".join(block).rstrip("\n"), src.raw.tell()
                    block = []
            if block:
                yield "".join(block).rstrip("\n"), src.raw.tell()
    except UnicodeDecodeError as e:
        raise DataError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except src.read_errors as e:
        raise DataError(f"{path}: cannot read ({e}); is the file damaged or truncated?") from None
    finally:
        src.close()


def _check_inputs(inputs: Sequence[str | Path]) -> list[Path]:
    if not inputs:
        raise DataError("no input files given")
    paths = [Path(p) for p in inputs]
    for p in paths:
        if p.is_dir():
            raise DataError(f"input {p} is a folder: INPUT takes files (text, JSONL, .gz or .zst), not folders; "
                            f"name its files (for example {p / '*.jsonl.gz'})")
        if not p.is_file():
            raise DataError(f"input file not found: {p}")
    return paths


def _chunks(paths: list[Path], text_field: str, text_unit: TextUnit
            ) -> Iterator[tuple[str, list[str], int]]:
    """Chunks of documents ``(file name, texts, raw bytes advanced)``; never span two files."""
    for p in paths:
        texts: list[str] = []
        chars = last = 0
        for text, pos in iter_documents(p, text_field, text_unit):
            texts.append(text)
            chars += len(text)
            if len(texts) >= _CHUNK_DOCS or chars >= _CHUNK_CHARS:
                yield str(p), texts, pos - last
                texts, chars, last = [], 0, pos
        yield str(p), texts, p.stat().st_size - last


# --------------------------------------------------------------------------- encoding (workers)

_TOKENIZER = None


def _init_worker(tokenizer_json: str, single_thread: bool) -> None:
    global _TOKENIZER
    if single_thread:
        # One process per core: keep the tokenizers library from spawning its own thread pool.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer
    _TOKENIZER = Tokenizer.from_str(tokenizer_json)


def _encode(task: tuple[str, list[str], int, float]) -> tuple[str, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]:
    """Encode one chunk: tokens (EOS appended per document), lengths, UTF-8 bytes, heldout flags, max id."""
    name, texts, eos, heldout = task
    assert _TOKENIZER is not None
    # No special tokens from the tokenizer's post-processor: EOS is appended explicitly, as the
    # Dolma toolkit does (OLMo 3 data has EOS per document and no BOS).
    encs = _TOKENIZER.encode_batch_fast(texts, add_special_tokens=False)
    flat: list[int] = []
    lens = np.empty(len(encs), dtype=np.int64)
    for i, e in enumerate(encs):
        ids = e.ids
        flat.extend(ids)
        flat.append(eos)
        lens[i] = len(ids) + 1
    tokens = np.array(flat, dtype=np.int64)
    held = np.array([is_heldout(t, heldout) for t in texts], dtype=bool)
    nbytes = np.array([len(t.encode("utf-8")) for t in texts], dtype=np.int64)
    return name, tokens, lens, nbytes, held, int(tokens.max()) if len(tokens) else -1


# --------------------------------------------------------------------------- writing


class _ShardWriter:
    """Writes documents into ``part-NNNNN.npy`` shards of at most ``shard_tokens`` tokens."""

    def __init__(self, root: Path, dtype: np.dtype, shard_tokens: int):
        self.root, self.dtype, self.shard_tokens = root, dtype.newbyteorder("<"), shard_tokens
        root.mkdir(parents=True, exist_ok=True)
        self.files: list[dict] = []
        self._f = None
        self._sha = hashlib.sha256()
        self._tokens = self._docs = self._bytes = 0

    def add(self, tokens: np.ndarray, lens: np.ndarray, text_bytes: np.ndarray) -> None:
        ends = np.cumsum(lens)
        starts = ends - lens
        i = 0
        while i < len(lens):
            room = self.shard_tokens - self._tokens
            j = int(np.searchsorted(ends, starts[i] + room, side="right"))  # docs i..j-1 fit
            if j == i:
                if self._tokens:
                    self._close()
                    continue
                j = i + 1  # a document longer than a shard gets a shard of its own
            self._write(tokens[starts[i]:ends[j - 1]], j - i, int(text_bytes[i:j].sum()))
            i = j
            if self._tokens >= self.shard_tokens:
                self._close()

    def _write(self, tokens: np.ndarray, docs: int, text_bytes: int) -> None:
        if self._f is None:
            self._f = open(self.root / f"part-{len(self.files):05d}.npy", "wb")
        data = tokens.astype(self.dtype).tobytes()
        self._f.write(data)
        self._sha.update(data)
        self._tokens += len(tokens)
        self._docs += docs
        self._bytes += text_bytes

    def _close(self) -> None:
        if self._f is None:
            return
        self._f.close()
        self.files.append({"path": Path(self._f.name).name, "tokens": self._tokens, "documents": self._docs,
                           "bytes": self._tokens * self.dtype.itemsize, "sha256": self._sha.hexdigest(),
                           "text_bytes": self._bytes})
        self._f, self._sha, self._tokens, self._docs, self._bytes = None, hashlib.sha256(), 0, 0, 0

    def finish(self, meta: dict) -> dict:
        self._close()
        manifest = {**meta, "total_tokens": sum(f["tokens"] for f in self.files),
                    "total_documents": sum(f["documents"] for f in self.files),
                    # UTF-8 bytes of the documents' text (bits-per-byte evaluation needs them)
                    "text_bytes": sum(f["text_bytes"] for f in self.files), "files": self.files}
        (self.root / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        return manifest


class _SplitWriters:
    """The shard writers of each split (``all``, or ``train`` and ``heldout``), fed encoded chunks in input order."""

    def __init__(self, writers: dict[str, _ShardWriter], vocab: int):
        self.writers, self.vocab = writers, vocab

    def consume(self, _name: str, result: tuple[str, np.ndarray, np.ndarray, np.ndarray, np.ndarray, int]) -> None:
        name, tokens, lens, nbytes, held, max_id = result
        if max_id >= self.vocab:
            raise DataError(f"{name}: token id {max_id} >= vocab size {self.vocab} (tokenizer and "
                            f"vocab_size disagree)")
        if "all" in self.writers:
            self.writers["all"].add(tokens, lens, nbytes)
            return
        tok_held = np.repeat(held, lens)
        for split, flag in (("train", False), ("heldout", True)):
            if (held == flag).any():
                self.writers[split].add(tokens[tok_held == flag], lens[held == flag], nbytes[held == flag])

    def finish(self, meta: dict, paths: list[Path], heldout: float, tok_path: Path) -> dict:
        """Close the last shards and write each split's manifest; refuse an empty corpus or training split."""
        manifests = {s: w.finish({**meta, "split": s}) for s, w in self.writers.items()}
        if sum(m["total_documents"] for m in manifests.values()) == 0:
            raise DataError(f"empty corpus: no documents in {', '.join(map(str, paths))}")
        if heldout > 0:
            if manifests["train"]["total_documents"] == 0:
                raise DataError(f"--heldout {heldout} left no training documents")
            if manifests["heldout"]["total_documents"] == 0:
                print(f"warning: --heldout {heldout} selected no documents", file=sys.stderr)
            for w in self.writers.values():  # each split is self-contained
                shutil.copyfile(tok_path, w.root / "tokenizer.json")
            tok_path.unlink()
        return manifests


# --------------------------------------------------------------------------- running (tokenize and tokenize --chat)


def check_out_dir(out: Path) -> None:
    """Refuse an existing ``--out`` unless it is an empty folder (output is never overwritten)."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise DataError(f"output directory {out} already exists and is not empty; choose another --out")


@contextlib.contextmanager
def building(out: Path) -> Iterator[Path]:
    """A temporary sibling of ``out`` to write into, renamed to ``out`` when the block ends without an
    error (``out`` may exist only as an empty folder); an error removes it, so a failure leaves nothing."""
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        yield tmp
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def encode_in_order(encode: Callable[[Any], Any], tasks: Iterable[tuple[str, Any, int]],
                    consume: Callable[[str, Any], None], processes: int, init: Callable[..., None],
                    init_args: tuple, bar: Any) -> None:
    """``consume(name, encode(task))`` for each ``(name, task, raw bytes)`` of ``tasks``, in their order,
    advancing the progress ``bar`` by the bytes. With ``processes`` > 1 the tasks are encoded by worker
    processes, set up by ``init(*init_args, single_thread=True)``, a bounded number of tasks ahead of
    ``consume``; the output is the same for any process count."""
    if processes == 1:
        init(*init_args, single_thread=False)
        for name, task, nbytes in tasks:
            consume(name, encode(task))
            bar.update(nbytes)
        return
    # spawn: no fork of a process that may hold tokenizer threads; a worker that dies
    # raises BrokenProcessPool instead of hanging.
    with ProcessPoolExecutor(processes, mp.get_context("spawn"), init, (*init_args, True)) as pool:
        pending: deque = deque()

        def drain(keep: int) -> None:  # in submission order, whatever finishes first
            while len(pending) > keep:
                name, fut, n = pending.popleft()
                consume(name, fut.result())
                bar.update(n)

        try:
            for name, task, nbytes in tasks:
                pending.append((name, pool.submit(encode, task), nbytes))
                drain(2 * processes - 1)  # bounded read-ahead keeps memory flat
            drain(0)
        except BaseException:
            for _, fut, _ in pending:
                fut.cancel()
            raise


# --------------------------------------------------------------------------- entry points


def train_bpe(inputs: Sequence[str | Path], vocab_size: int, out_path: str | Path, *, text_field: str = "text",
              text_unit: TextUnit = "paragraph", heldout: float = 0.0) -> str:
    """Train a byte-level BPE (``<|endoftext|>`` = 0 = eos, ``<|pad|>`` = 1); return its sha256.

    Held-out documents (by :func:`is_heldout`) are left out of training too.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    if vocab_size < 258:
        raise DataError(f"--train-bpe vocabulary {vocab_size} is too small (256 bytes + 2 special tokens)")
    paths = _check_inputs(inputs)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[EOS_TOKEN, PAD_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    docs = (t for p in paths for t, _ in iter_documents(p, text_field, text_unit) if not is_heldout(t, heldout))
    tok.train_from_iterator(docs, trainer)
    out = Path(out_path)
    out.write_text(tok.to_str())
    return hashlib.sha256(out.read_bytes()).hexdigest()


def load_tokenizer(path: str | Path) -> tuple[Any, str]:
    """``(tokenizers.Tokenizer, its JSON text)`` of a ``tokenizer.json``; a missing file, one that is not
    UTF-8 or not a tokenizer is a DataError naming it (for ``olmax tokenize`` and ``tokenize --chat``)."""
    from tokenizers import Tokenizer
    p = Path(path)
    if not p.is_file():
        raise DataError(f"tokenizer file not found: {path}" + (" (a folder; give its tokenizer.json)"
                                                               if p.is_dir() else ""))
    try:
        text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"tokenizer {path} is not UTF-8 text ({e.reason} at byte {e.start}); "
                        "expected a Hugging Face tokenizer.json") from None
    try:
        tok = Tokenizer.from_str(text)
    except Exception as e:  # the library raises a bare Exception for a malformed file
        raise DataError(f"tokenizer {path} cannot be read: {e} (expected a Hugging Face tokenizer.json)") from None
    return tok, text


def _find_eos(tok, eos_token_id: int | None) -> int:
    if eos_token_id is not None:
        return eos_token_id
    for name in (EOS_TOKEN, "<|end_of_text|>", "</s>", "<eos>"):
        tid = tok.token_to_id(name)
        if tid is not None:
            return tid
    raise DataError("cannot tell the tokenizer's EOS token; pass eos_token_id (--eos-token-id)")


def tokenize(inputs: Sequence[str | Path], out_dir: str | Path, *, tokenizer: str | Path | None = None,
             train_bpe_vocab: int | None = None, heldout: float = 0.0, shard_tokens: int = 1 << 28,
             processes: int = 1, text_field: str = "text", text_unit: TextUnit = "paragraph",
             eos_token_id: int | None = None, vocab_size: int | None = None, progress: bool = True) -> dict:
    """Tokenise ``inputs`` into ``out_dir``; return ``{split: manifest}``.

    Layout: ``out_dir/{manifest.json, part-*.npy, tokenizer.json}``, or with ``heldout > 0``
    ``out_dir/train/...`` and ``out_dir/heldout/...``. The output is built in a temporary sibling
    directory and renamed into place at the end: a failure leaves nothing behind, and an existing
    non-empty ``out_dir`` is refused (never overwritten).
    """
    from tqdm import tqdm

    if (tokenizer is None) == (train_bpe_vocab is None):
        raise DataError("give exactly one of a tokenizer file (--tokenizer) or --train-bpe VOCAB_SIZE")
    if not 0.0 <= heldout < 1.0:
        raise DataError(f"--heldout must be in [0, 1), got {heldout}")
    if shard_tokens <= 0 or processes <= 0:
        raise DataError(f"--shard-tokens and --processes must be positive, got {shard_tokens}, {processes}")
    paths = _check_inputs(inputs)
    out = Path(out_dir)
    check_out_dir(out)
    if tokenizer is not None:
        tok, tok_json = load_tokenizer(tokenizer)  # checked before any output is written

    with building(out) as tmp:
        tok_path = tmp / "tokenizer.json"
        if train_bpe_vocab is not None:
            train_bpe(paths, train_bpe_vocab, tok_path, text_field=text_field, text_unit=text_unit, heldout=heldout)
            tok, tok_json = load_tokenizer(tok_path)
        else:
            shutil.copyfile(tokenizer, tok_path)  # type: ignore[arg-type]
        eos = _find_eos(tok, eos_token_id)
        tok_vocab = tok.get_vocab_size(with_added_tokens=True)
        vocab = vocab_size or tok_vocab
        if not 0 <= eos < vocab:
            raise DataError(f"eos token id {eos} is outside the vocabulary ({vocab})")
        dtype = smallest_dtype(vocab)
        meta = {"format": FORMAT, "dtype": dtype.name, "eos_token_id": eos, "vocab_size": vocab,
                "tokenizer": {"file": "tokenizer.json", "sha256": hashlib.sha256(tok_json.encode()).hexdigest(),
                              "vocab_size": tok_vocab},
                "heldout_fraction": heldout, "heldout_rule": HELDOUT_RULE, "text_field": text_field,
                "text_unit": text_unit, "inputs": [p.name for p in paths]}
        splits = {"train": tmp / "train", "heldout": tmp / "heldout"} if heldout > 0 else {"all": tmp}
        writers = _SplitWriters({s: _ShardWriter(d, dtype, shard_tokens) for s, d in splits.items()}, vocab)

        bar = tqdm(total=sum(p.stat().st_size for p in paths), unit="B", unit_scale=True, desc="tokenize",
                   disable=not progress, file=sys.stderr)
        tasks = ((name, (name, texts, eos, heldout), nbytes)
                 for name, texts, nbytes in _chunks(paths, text_field, text_unit))
        try:
            encode_in_order(_encode, tasks, writers.consume, processes, _init_worker, (tok_json,), bar)
        finally:
            bar.close()  # an error gets a line of its own, not the end of the bar's
        return writers.finish(meta, paths, heldout, tok_path)
