"""Token files -> fixed-length instances, with OLMo-core ``NumpyFSLDataset`` semantics.

- Token files are raw little-endian arrays without a header (``.npy`` name notwithstanding).
- Each file is cut on its own into ``floor(n_tokens / L)`` windows; the remainder is dropped;
  instance ids run over the files concatenated in order (OLMo-core ``NumpyFSLDataset.offsets``).
- The fingerprint is OLMo-core's, bit for bit (``NumpyDatasetBase.fingerprint``), so a value
  stored by either framework can be compared with the other's.
- The repetition filter reproduces ``olmo_core.data.utils.find_periodic_sequences`` decisions
  with a vectorised implementation of our own.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import json
import os
import typing
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np

from olmax import io
from olmax.config import Config, TokenDtype
from olmax.data import DataError

Validate = Literal["none", "sample", "full"]
_REMOTE = io.REMOTE_PREFIXES


@dataclass(frozen=True)
class TokenFile:
    path: str
    label: str | None
    size: int        # bytes
    tokens: int
    instances: int
    start: int       # first global instance id


# --------------------------------------------------------------------------- path resolution


def read_mix(mix_path: str | Path, mix_root: str | None = None,
             mix_tokenizer: str | None = None, field: str = "data.paths") -> list[tuple[str, str]]:
    """``(label, path)`` pairs of an OLMo-core mix file (``label,path`` lines, ``#`` comments).

    ``{root}`` is replaced by ``data.mix_root`` and ``{TOKENIZER}`` by ``data.mix_tokenizer``
    (OLMo-core ``DataMix.build`` writes ``dolma2-tokenizer`` for dolma2); other relative paths
    are taken relative to ``mix_root`` (``build`` prefixes ``base_dir``) or else the mix file's folder.
    """
    if not io.is_remote(mix_path):
        mix_path = Path(mix_path)
        if not mix_path.is_file():
            raise DataError(f"mix file not found: {mix_path} ({field})")
    try:
        text = io.read_text(str(mix_path))
    except io.RemoteError as e:
        raise DataError(f"mix file {e}") from None
    except UnicodeDecodeError as e:
        raise DataError(f"mix file {mix_path} ({field}) is not UTF-8 text ({e.reason} at byte {e.start})") from None
    mix_dir = io.parent(str(mix_path)) if io.is_remote(mix_path) else str(Path(mix_path).parent)
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split(",")
        if len(parts) != 2 or not all(p.strip() for p in parts):
            raise DataError(f"{mix_path}:{n}: expected 'label,path', got {line!r}")
        label, path = (p.strip() for p in parts)
        if "{root}" in path:
            if mix_root is None:
                raise DataError(f"{mix_path}:{n}: path uses {{root}} but data.mix_root is not set")
            path = path.replace("{root}", mix_root.rstrip("/"))
        if "{TOKENIZER}" in path:
            if mix_tokenizer is None:
                raise DataError(f"{mix_path}:{n}: path uses {{TOKENIZER}} but data.mix_tokenizer is not set "
                                "(AI2's dolma2 mixes use dolma2-tokenizer)")
            path = path.replace("{TOKENIZER}", mix_tokenizer)
        if "{" in path:
            raise DataError(f"{mix_path}:{n}: unresolved placeholder in {path!r} (only {{root}} and {{TOKENIZER}} "
                            "are substituted)")
        if not os.path.isabs(path) and not path.startswith(_REMOTE):
            path = io.join(mix_root if mix_root is not None else mix_dir, path)
        if not path.startswith(_REMOTE) and not os.path.isfile(path):
            raise DataError(f"{mix_path}:{n}: token file {path} (label {label!r}) not found")
        out.append((label, path))
    if not out:
        raise DataError(f"mix file {mix_path} lists no token files (expected 'label,path' lines; {field})")
    return out


CHAT_FORMAT = "olmax-chat/1"   # `olmax tokenize --chat`: token ids and label masks per part


TOKEN_DTYPES = typing.get_args(TokenDtype)   # what `olmax tokenize` writes (data.dtype's choices)


def _read_manifest(path: Path | str) -> tuple[dict, list[tuple[str, None]]]:
    """A tokenize folder's manifest and its token files; a manifest of the wrong shape (not an
    object, no ``files`` list, a bad ``dtype``) is a DataError naming the file and the field."""
    try:
        m = io.read_json_object(path, "a token manifest", DataError, " written by `olmax tokenize`")
    except io.RemoteError as e:
        raise DataError(f"manifest {e}") from None
    except OSError as e:
        raise DataError(f"{path}: not a readable token manifest ({e})") from None
    dtype = m.get("dtype")
    if dtype not in TOKEN_DTYPES:
        got = "missing" if "dtype" not in m else f"{dtype!r}"
        raise DataError(f"{path}: field 'dtype' is {got}; expected one of {', '.join(TOKEN_DTYPES)}")
    key = "token_ids" if m.get("format") == CHAT_FORMAT else "path"
    entries = m.get("files")
    if not isinstance(entries, list):
        raise DataError(f"{path}: field 'files' is {'missing' if 'files' not in m else 'not a list'}; "
                        "expected a list of token files")
    base = io.parent(str(path)) if io.is_remote(path) else str(Path(path).parent)
    files = []
    for i, f in enumerate(entries):
        name, tokens = (f.get(key), f.get("tokens")) if isinstance(f, dict) else (None, None)
        if not isinstance(name, str) or isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 0:
            raise DataError(f"{path}: field 'files[{i}]' is not a token file entry (expected "
                            f"{{{key!r}: NAME, 'tokens': COUNT >= 0}}, got {json.dumps(f)[:80]})")
        files.append((io.join(base, name), tokens))
    itemsize = np.dtype(dtype).itemsize
    for f, tokens in files:
        if os.path.isfile(f) and os.path.getsize(f) != tokens * itemsize:
            raise DataError(f"{f}: size {os.path.getsize(f)} bytes does not match its manifest "
                            f"({tokens} {dtype} tokens); the file was changed or truncated")
    return m, [(f, None) for f, _ in files]


def resolve_paths(paths: Sequence[str], mix_root: str | None = None, *, dtype: str | None = None,
                  eos_token_id: int | None = None, vocab_size: int | None = None,
                  mix_tokenizer: str | None = None, field: str = "data.paths") -> list[tuple[str, str | None]]:
    """Expand ``data.paths`` into ``(token file, label)`` pairs, in order.

    Each entry is a token file, an OLMo-core mix file (``.txt``), or a folder / ``manifest.json``
    written by ``olmax tokenize`` (whose dtype and eos id are checked against the config); a local
    ``*``/``?`` pattern stands for the files it matches, sorted.
    ``field`` is what errors name as the source of ``paths`` (``eval.heldout_paths``, ``--data``).
    """
    out: list[tuple[str, str | None]] = []
    for p in expand_globs(paths, field):
        if p.endswith(".txt"):
            out += [(path, label) for label, path in read_mix(p, mix_root, mix_tokenizer, field)]
        elif io.is_remote(p) and (p.endswith("/") or p.endswith(".json")):
            # A remote `olmax tokenize` folder is named by its trailing slash (object stores have no folders).
            mpath = p if p.endswith(".json") else io.join(p, "manifest.json")
            m, files = _read_manifest(mpath)
            _check_manifest(mpath, m, dtype, eos_token_id, vocab_size)
            out += files
        elif os.path.isdir(p) or p.endswith(".json"):
            mpath = Path(p) / "manifest.json" if os.path.isdir(p) else Path(p)
            if not mpath.is_file():
                hint = f"; did you mean {Path(p) / 'train'}?" if (Path(p) / "train" / "manifest.json").is_file() else ""
                raise DataError(f"{p}: no manifest.json ({field} takes token files, mix files or "
                                f"folders written by `olmax tokenize`){hint}")
            m, files = _read_manifest(mpath)
            _check_manifest(mpath, m, dtype, eos_token_id, vocab_size)
            out += files
        else:
            out.append((p, None))
    for path, _label in out:
        # Remote files are checked when their sizes are read (one metadata request each).
        if not io.is_remote(path) and not os.path.isfile(path):
            raise DataError(f"token file not found: {path} ({field})")
    return out


def chat_label_masks(paths: Sequence[str]) -> list[str]:
    """The label-mask files of ``data.paths`` entries that are ``olmax tokenize --chat`` folders
    (or their manifests), in file order; [] when none is. Mixed with other kinds of entry it is an
    error: give ``data.label_mask_paths`` then."""
    out: list[str] = []
    chat = 0
    for p in paths:
        mpath = (io.join(p, "manifest.json") if p.endswith("/") else p) if io.is_remote(p) else (
            str(Path(p) / "manifest.json") if os.path.isdir(p) else p)
        if not mpath.endswith(".json") or not (io.is_remote(mpath) or os.path.isfile(mpath)):
            continue
        try:
            m = json.loads(io.read_text(mpath))
        except (io.RemoteError, OSError, ValueError):
            continue
        if isinstance(m, dict) and m.get("format") == CHAT_FORMAT:
            chat += 1
            base = io.parent(mpath) if io.is_remote(mpath) else str(Path(mpath).parent)
            out += [io.join(base, f["labels_mask"]) for f in m["files"]]
    if chat and chat != len(paths):
        raise DataError("data.paths mixes `olmax tokenize --chat` folders with other token files: give "
                        "data.label_mask_paths for all of them")
    return out


def expand_globs(paths: Sequence[str], field: str = "data.paths") -> list[str]:
    """Local ``*``/``?`` patterns expanded (sorted); anything else kept. A pattern matching nothing
    is an error naming it and ``field``."""
    out: list[str] = []
    for p in paths:
        if not io.is_remote(p) and any(c in p for c in "*?["):
            hits = sorted(glob.glob(p))
            if not hits:
                raise DataError(f"{p} ({field}): the pattern matches no file")
            out += hits
        else:
            out.append(p)
    return out


def label_mask_files(token_paths: Sequence[str], mask_paths: Sequence[str]) -> list[str]:
    """``data.label_mask_paths`` matched one to one with the resolved token files (globs expanded);
    a missing file, a different count or a different length is an error naming the file."""
    masks = expand_globs(mask_paths, "data.label_mask_paths")
    if len(masks) != len(token_paths):
        raise DataError(f"data.label_mask_paths gives {len(masks)} label-mask files for {len(token_paths)} token "
                        "files (data.paths); they pair up one to one, in order")
    for m in masks:
        if not io.is_remote(m) and not os.path.isfile(m):
            raise DataError(f"label-mask file not found: {m} (data.label_mask_paths)")
    return masks


def check_mask_sizes(pairs: Sequence[tuple[str, str, int]], itemsize: int) -> None:
    sizes = file_sizes([m for _, m, _ in pairs])
    for (tok, m, tsize), msize in zip(pairs, sizes):
        if msize != tsize // itemsize:
            raise DataError(f"{m}: {msize} label-mask bytes but {tok} holds {tsize // itemsize} tokens "
                            "(one bool byte per token); the files don't belong together, or one is truncated")


def _check_manifest(mpath: Path | str, m: dict, dtype: str | None, eos_token_id: int | None,
                    vocab_size: int | None) -> None:
    if dtype is not None and m.get("dtype") != dtype:
        raise DataError(f"{mpath}: tokens are {m.get('dtype')} but data.dtype is {dtype}")
    if eos_token_id is not None and m.get("eos_token_id") != eos_token_id:
        raise DataError(f"{mpath}: eos id is {m.get('eos_token_id')} but data.eos_token_id is {eos_token_id}")
    mv = m.get("vocab_size", 0)
    if vocab_size is not None and (isinstance(mv, bool) or not isinstance(mv, int)):
        raise DataError(f"{mpath}: field 'vocab_size' is {mv!r}, not an integer")
    if vocab_size is not None and mv > vocab_size:
        raise DataError(f"{mpath}: tokenizer vocabulary {m['vocab_size']} is larger than model.vocab_size "
                        f"{vocab_size}")


def file_sizes(paths: Sequence[str]) -> list[int]:
    """Sizes in bytes from metadata; remote ones fetched concurrently (mixes list thousands of files)."""
    remote = [p for p in paths if io.is_remote(p)]
    sizes: dict[str, int] = {}
    if remote:
        from concurrent.futures import ThreadPoolExecutor
        try:
            with ThreadPoolExecutor(16) as pool:
                sizes = dict(zip(remote, pool.map(io.size, remote)))
        except io.RemoteError as e:
            raise DataError(f"token file {e}") from None
    return [sizes[p] if p in sizes else os.path.getsize(p) for p in paths]


def open_tokens(path: str, dtype: np.dtype | str, nbytes: int | None = None,
                cache_dir: str | None = None) -> np.ndarray | io.RemoteArray:
    """A 1-D token array: a memory map of a local file, or range reads of a remote one."""
    dtype = np.dtype(dtype)
    if io.is_remote(path):
        return io.RemoteArray(path, dtype, io.size(path) if nbytes is None else nbytes, cache_dir=cache_dir)
    n = (os.path.getsize(path) if nbytes is None else nbytes) // dtype.itemsize
    return np.memmap(path, dtype=dtype.newbyteorder("<"), mode="r", shape=(n,))


# --------------------------------------------------------------------------- validation


def validate_tokens(path: str, dtype: np.dtype | str, vocab_size: int, *, full: bool = False,
                    windows: int = 8, window: int = 1 << 14, nbytes: int | None = None,
                    cache_dir: str | None = None) -> None:
    """Raise if a token id >= ``vocab_size``: a full scan, or (cheap) ``windows`` spread windows."""
    dtype = np.dtype(dtype)
    mm = open_tokens(path, dtype, nbytes, cache_dir)
    n = len(mm)
    if n == 0:
        return
    if full:
        starts = range(0, n, 1 << 24)
        span = 1 << 24
    else:  # first, last and evenly spread windows
        starts = sorted({int(s) for s in np.linspace(0, max(n - window, 0), windows)})
        span = window
    for s in starts:
        chunk = mm[s:s + span]
        if chunk.max() >= vocab_size:
            pos = s + int(np.argmax(chunk >= vocab_size))
            raise DataError(f"{path}: token id {int(mm[pos])} at position {pos} is >= the vocabulary size "
                            f"{vocab_size} (model.vocab_size); wrong data.dtype or a file from another tokenizer?")


# --------------------------------------------------------------------------- content fingerprint

CONTENT_WHOLE_FILE = 1 << 20   # files up to 1 MiB are hashed whole
CONTENT_RANGES = 32            # else this many ranges, evenly spread, first and last included
CONTENT_RANGE_BYTES = 1 << 12  # of 4 KiB each: 128 KiB read per file, whatever its size


def content_hash(path: str) -> str:
    """SHA-256 of a file's size and sampled byte ranges (the whole file up to 1 MiB).

    Cheap for terabytes (128 KiB read per file) and catches what a names-and-sizes fingerprint
    cannot: a file rewritten in place with the same size (a re-tokenization, a different shard).
    An edit that touches none of the sampled ranges of a large file goes unnoticed."""
    size = os.path.getsize(path)
    h = hashlib.sha256(f"size={size},".encode())
    with open(path, "rb") as f:
        if size <= CONTENT_WHOLE_FILE:
            h.update(f.read())
        else:
            for off in np.linspace(0, size - CONTENT_RANGE_BYTES, CONTENT_RANGES).astype(np.int64):
                f.seek(int(off))
                h.update(f.read(CONTENT_RANGE_BYTES))
    return h.hexdigest()


# --------------------------------------------------------------------------- repetition filter


def dirty_instances(tokens: np.ndarray, *, min_period: int = 1, max_period: int = 13, max_count: int = 32
                    ) -> np.ndarray:
    """Bool ``[n]``: True where OLMo-core's instance filter rejects the instance.

    OLMo-core (``NumpyDatasetBase._validate_instance``) rejects an instance when
    ``find_periodic_sequences`` reports a run with ``times >= max_count`` for a period in
    ``min_period..min(max_period, L // 3)``. That function only reports runs with ``times > 2``
    and, for a maximal run of positions i with ``x[i] == x[i - p]`` of length ``l``, reports
    ``times = (l + p) // p`` whatever the run's alignment to its period-wide rows (runs of
    ``times >= 3`` always cover a whole row). So an instance is dirty iff, for some period p,
    ``x[i] == x[i - p]`` holds on ``(max(max_count, 3) - 1) * p`` consecutive positions.
    """
    x = np.atleast_2d(np.asarray(tokens))
    n, length = x.shape
    dirty = np.zeros(n, dtype=bool)
    times = max(max_count, 3)
    for p in range(max(min_period, 1), min(max_period, length // 3) + 1):
        need = (times - 1) * p
        if need > length - p:
            break  # need grows and length - p shrinks with p: no longer period can qualify
        eq = x[:, p:] == x[:, :-p]
        run = np.zeros((n, length - p + 1), dtype=np.int32)
        np.cumsum(eq, axis=1, out=run[:, 1:])
        dirty |= ((run[:, need:] - run[:, :-need]) == need).any(axis=1)
    return dirty


# --------------------------------------------------------------------------- dataset


def olmo_core_fingerprint(cls: str, fields: Sequence[tuple[str, object]], files: Sequence) -> str:
    """OLMo-core's ``NumpyDatasetBase.fingerprint``: the class name, ``name=value,`` per
    fingerprint field, then ``path=basename,size=bytes,`` per file (objects with ``path`` and ``size``)."""
    h = hashlib.sha256()
    h.update(f"class={cls}".encode())
    for name, value in fields:
        h.update(f"{name}={value},".encode())
    for f in files:
        h.update(f"path={os.path.basename(f.path)},size={f.size},".encode())
    return h.hexdigest()


class TokenDataset:
    """Fixed-length instances over memory-mapped token files (OLMo-core ``NumpyFSLDataset``)."""

    def __init__(self, paths: Sequence[str], *, sequence_length: int, vocab_size: int, eos_token_id: int,
                 pad_token_id: int, bos_token_id: int | None = None, dtype: str = "uint32",
                 mix_root: str | None = None, mix_tokenizer: str | None = None, validate: Validate = "sample",
                 remote_cache_dir: str | None = None, label_mask_paths: Sequence[str] = ()):
        if not paths:
            raise DataError("data.paths is empty: give token files, mix files or `olmax tokenize` folders")
        if sequence_length <= 0:
            raise DataError(f"data.sequence_length must be positive, got {sequence_length}")
        self.sequence_length, self.vocab_size = sequence_length, vocab_size
        self.eos_token_id, self.pad_token_id, self.bos_token_id = eos_token_id, pad_token_id, bos_token_id
        self.dtype = np.dtype(dtype)
        item = self.dtype.itemsize
        self.remote_cache_dir = remote_cache_dir
        files, start = [], 0
        resolved = resolve_paths(paths, mix_root, dtype=self.dtype.name, eos_token_id=eos_token_id,
                                 vocab_size=vocab_size, mix_tokenizer=mix_tokenizer)
        for (path, label), size in zip(resolved, file_sizes([p for p, _ in resolved])):
            if size % item:
                raise DataError(f"{path}: size {size} bytes is not a multiple of {item} ({self.dtype.name}, "
                                "data.dtype); wrong dtype or a truncated file")
            n = size // item
            files.append(TokenFile(path, label, size, n, n // sequence_length, start))
            start += n // sequence_length
        if start == 0:
            longest = max(files, key=lambda f: f.tokens)
            raise DataError(f"data.sequence_length={sequence_length} is longer than every token file "
                            f"(longest: {longest.path}, {longest.tokens} tokens): no instances")
        if start >= np.iinfo(np.uint32).max:  # OLMo-core keeps instance ids in uint32
            raise DataError(f"{start} instances do not fit the uint32 global order")
        self.files: tuple[TokenFile, ...] = tuple(files)
        self.mask_paths: tuple[str, ...] = ()
        label_mask_paths = label_mask_paths or chat_label_masks(paths)
        if label_mask_paths:
            self.mask_paths = tuple(label_mask_files([f.path for f in files], label_mask_paths))
            check_mask_sizes([(f.path, m, f.size) for f, m in zip(files, self.mask_paths)], item)
        self.num_instances = start
        self._starts = np.array([f.start for f in files] + [start], dtype=np.int64)
        self._maps: dict = {}
        if validate != "none":
            def check(f: TokenFile) -> None:
                try:
                    validate_tokens(f.path, self.dtype, vocab_size, full=validate == "full", nbytes=f.size,
                                    cache_dir=remote_cache_dir)
                except io.RemoteError as e:
                    raise DataError(f"token file {e}") from None
            if any(io.is_remote(f.path) for f in files):  # network latency: check files concurrently
                from concurrent.futures import ThreadPoolExecutor
                with ThreadPoolExecutor(16) as pool:
                    list(pool.map(check, files))
            else:
                for f in files:
                    check(f)

    @classmethod
    def from_config(cls, cfg: Config, *, validate: Validate = "sample") -> TokenDataset:
        d = cfg.data
        return cls(d.paths, sequence_length=d.sequence_length, vocab_size=cfg.model.vocab_size,
                   eos_token_id=d.eos_token_id, pad_token_id=d.pad_token_id, bos_token_id=d.bos_token_id,
                   dtype=d.dtype, mix_root=d.mix_root, mix_tokenizer=d.mix_tokenizer, validate=validate,
                   remote_cache_dir=getattr(d, "remote_cache_dir", None), label_mask_paths=d.label_mask_paths)

    def __len__(self) -> int:
        return self.num_instances

    # Memory maps are reopened lazily after pickling (Grain worker processes).
    def __getstate__(self) -> dict:
        return {**self.__dict__, "_maps": {}}

    def describe(self) -> dict:
        """The fingerprint's inputs (plus the sequence length), to name what changed on resume."""
        return {"class": "NumpyFSLDataset", "vocab_size": self.vocab_size, "pad_token_id": self.pad_token_id,
                "eos_token_id": self.eos_token_id, "bos_token_id": self.bos_token_id, "dtype": self.dtype.name,
                "sequence_length": self.sequence_length,
                "files": [[os.path.basename(f.path), f.size] for f in self.files],
                **({"label_masks": [os.path.basename(m) for m in self.mask_paths]} if self.mask_paths else {})}

    @property
    def label_masked(self) -> bool:
        return bool(getattr(self, "mask_paths", ()))

    def read_label_mask(self, ids: np.ndarray) -> np.ndarray:
        """Label masks of instances ``ids``, bool ``[len(ids), L]``, from ``data.label_mask_paths``
        (OLMo-core ``NumpyFSLDataset`` reads the same windows of the mask files)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        L = self.sequence_length
        out = np.ones((len(ids), L), dtype=bool)
        if not self.label_masked:
            return out
        file_idx = np.searchsorted(self._starts, ids, side="right") - 1
        for row, (i, fi) in enumerate(zip(ids, file_idx)):
            key = ("mask", int(fi))
            if key not in self._maps:
                self._maps[key] = open_tokens(self.mask_paths[fi], np.uint8, self.files[fi].tokens,
                                              getattr(self, "remote_cache_dir", None))
            local = int(i - self._starts[fi])
            out[row] = np.asarray(self._maps[key][local * L:(local + 1) * L]) != 0
        return out

    @functools.cached_property
    def fingerprint(self) -> str:  # the files are fixed at construction: hash once
        """OLMo-core's ``NumpyFSLDataset.fingerprint`` (fingerprint version v2.0).

        The fields and their formatting follow ``NumpyDatasetBase.fingerprint`` with
        ``NumpyFSLDataset.fingerprint_fields``; like OLMo-core it leaves out the sequence length
        (a change of it is caught through :meth:`describe`).
        """
        return olmo_core_fingerprint("NumpyFSLDataset", (
            ("vocab_size", self.vocab_size), ("pad_token_id", self.pad_token_id),
            ("eos_token_id", self.eos_token_id), ("dtype", self.dtype.type),
            ("max_target_sequence_length", None), ("bos_token_id", self.bos_token_id)), self.files)

    @functools.cached_property
    def content_hashes(self) -> list[list[str | None]]:
        """``[basename, sha256]`` per file over sampled byte ranges (:func:`content_hash`); the hash
        is None for a remote file (s3://, gs://, http(s)://), whose object-store metadata stands in."""
        paths = [f.path for f in self.files] + list(getattr(self, "mask_paths", ()))
        return [[os.path.basename(p), None if io.is_remote(p) else content_hash(p)] for p in paths]

    def _map(self, i: int) -> np.ndarray:
        if i not in self._maps:
            f = self.files[i]
            self._maps[i] = open_tokens(f.path, self.dtype, f.size, getattr(self, "remote_cache_dir", None))
        return self._maps[i]

    def read(self, ids: np.ndarray, step: int | None = None) -> np.ndarray:
        """Tokens of instances ``ids`` as int32 ``[len(ids), L]``.

        Every instance is checked as it is read (a max over its tokens, cheap next to the read):
        an id >= ``vocab_size`` is a ``DataError`` naming the file, the token offset and ``step``
        (the global step being assembled), so it never reaches an update. The construction-time
        check only samples windows of each file."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if len(ids) and (ids.min() < 0 or ids.max() >= self.num_instances):
            raise IndexError(f"instance ids outside [0, {self.num_instances})")
        L = self.sequence_length
        out = np.empty((len(ids), L), dtype=np.int32)
        file_idx = np.searchsorted(self._starts, ids, side="right") - 1
        for row, (i, fi) in enumerate(zip(ids, file_idx)):
            local = int(i - self._starts[fi])
            raw = self._map(int(fi))[local * L:(local + 1) * L]
            if raw.max() >= self.vocab_size:
                pos = int(np.argmax(raw >= self.vocab_size))
                at = f" in global batch {step} (the batch of update {step + 1})" if step is not None else ""
                raise DataError(
                    f"{self.files[fi].path}: token id {int(raw[pos])} at token offset {local * L + pos} (instance "
                    f"{int(i)}) is >= the vocabulary size {self.vocab_size} (model.vocab_size){at}; no update used it. "
                    "Wrong data.dtype, or a file from another tokenizer?")
            out[row] = raw
        return out
