"""Documents packed into fixed-length instances, with OLMo-core 3.0.0 ``NumpyPackedFSLDataset``
semantics (the SFT data path: ``NumpyPackedFSLDatasetConfig`` with label masks).

- Documents are the EOS-terminated spans of each token file (tokens after the last EOS are not a
  document); a document longer than the sequence length is cut to its first L tokens
  (``long_doc_strategy="truncate"``) or split into L-token pieces (``"fragment"``).
- Each file is packed on its own (``source_group_size=1``) by best-fit decreasing: documents sorted
  by length, longest first (``np.argsort`` of the negated lengths, as OLMo-core sorts), each put
  into the open instance whose free space is the smallest that still holds it, the earliest opened
  among equals, or a new instance when none does (Ding et al. 2024, "Fewer Truncations Improve
  Language Modeling"; OLMo-core finds that instance with a segment tree, we keep a sorted list of
  free-space values: same choice).
- An instance is its documents' tokens in packing order, padded with ``pad_token_id`` to L; its
  label mask is the documents' label masks (all True without label-mask files), False on padding.
- Instance ids run over the files in order; the global order, process split and resume are the
  ones of ``olmax.data.order`` (OLMo-core's data loader treats this dataset like any other).
- Label-mask files are raw bool arrays (one byte per token, no header), one per token file and of
  the same length: ``labels_mask_*.npy`` beside ``token_ids_part_*.npy`` as open-instruct's converter
  writes them.

Document lengths for attention are not stored: the model derives segments from EOS
(``olmo3.document_segments``), which gives OLMo-core's ``get_document_lengths`` (the padding is
one more segment, and a truncated document fills its instance alone).
"""

from __future__ import annotations

import bisect
import functools
import os
from collections import defaultdict, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np

from olmax import io
from olmax.config import Config
from olmax.data import DataError
from olmax.data.dataset import (
    Validate,
    chat_label_masks,
    check_mask_sizes,
    content_hash,
    expand_globs,
    file_sizes,
    label_mask_files,
    olmo_core_fingerprint,
    open_tokens,
    resolve_paths,
    validate_tokens,
)

LongDocStrategy = Literal["truncate", "fragment"]


def document_spans(tokens: np.ndarray, eos_token_id: int, max_length: int,
                   strategy: LongDocStrategy = "truncate", bos_token_id: int | None = None) -> np.ndarray:
    """``[n, 2]`` int64 (start, end) of the documents of one token file, long ones cut to
    ``max_length`` (OLMo-core ``iter_document_indices_with_max_sequence_length``)."""
    tokens = np.asarray(tokens)
    if bos_token_id is None:
        ends = np.flatnonzero(tokens == eos_token_id) + 1
    else:  # a boundary is EOS followed by BOS, and a final EOS
        ends = np.flatnonzero((tokens[:-1] == eos_token_id) & (tokens[1:] == bos_token_id)) + 1
        if len(tokens) and tokens[-1] == eos_token_id:
            ends = np.append(ends, len(tokens))
    starts = np.concatenate([[0], ends[:-1]]).astype(np.int64)
    ends = ends.astype(np.int64)
    lengths = ends - starts
    if not (lengths > max_length).any():
        return np.stack([starts, ends], axis=1).reshape(-1, 2)
    if strategy == "truncate":
        return np.stack([starts, np.minimum(ends, starts + max_length)], axis=1)
    if strategy != "fragment":
        raise DataError(f"data.long_doc_strategy must be 'truncate' or 'fragment', got {strategy!r}")
    out = []
    for s, e in zip(starts.tolist(), ends.tolist()):
        out.extend((p, min(e, p + max_length)) for p in range(s, e, max_length))
    return np.array(out, dtype=np.int64).reshape(-1, 2)


def best_fit_decreasing(spans: np.ndarray, capacity: int) -> tuple[np.ndarray, list[list[int]]]:
    """OLMo-core's ``InstancePacker.pack_documents``: ``(spans sorted longest first, instances)``,
    each instance a list of indices into the sorted spans, in the order they were placed."""
    lengths = spans[:, 1] - spans[:, 0]
    if len(lengths) and (lengths.max() > capacity or lengths.min() <= 0):
        raise DataError(f"document lengths must be in 1..{capacity}")
    order = np.argsort(-1 * lengths.astype(np.int64))  # OLMo-core's call, so ties fall the same way
    spans = np.take(spans, order, axis=0)
    bins: list[list[int]] = []
    free: list[int] = []                                # free-space values with an open instance, sorted
    by_free: dict[int, deque[int]] = defaultdict(deque)  # free space -> instances, oldest first
    for doc, n in enumerate((spans[:, 1] - spans[:, 0]).tolist()):
        k = bisect.bisect_left(free, n)
        if k == len(free):
            bins.append([])
            b, room = len(bins) - 1, capacity
        else:
            room = free[k]
            q = by_free[room]
            b = q.popleft()
            if not q:
                free.pop(k)
        bins[b].append(doc)
        left = room - n
        if left > 0:
            q = by_free[left]
            if not q:
                bisect.insort(free, left)
            q.append(b)
    return spans, bins


@dataclass(frozen=True)
class PackedFile:
    path: str
    mask_path: str | None
    size: int                 # bytes of the token file
    tokens: int
    spans: np.ndarray         # [docs, 2] sorted longest first
    offsets: np.ndarray       # [instances + 1] into ``docs``
    docs: np.ndarray          # document indices (into spans), instance by instance
    start: int                # first global instance id

    @property
    def instances(self) -> int:
        return len(self.offsets) - 1


class PackedDataset:
    """OLMo-core ``NumpyPackedFSLDataset`` over token files (and label-mask files)."""

    def __init__(self, paths: Sequence[str], *, sequence_length: int, vocab_size: int, eos_token_id: int,
                 pad_token_id: int, bos_token_id: int | None = None, dtype: str = "uint32",
                 label_mask_paths: Sequence[str] = (), long_doc_strategy: LongDocStrategy = "truncate",
                 mix_root: str | None = None, mix_tokenizer: str | None = None, validate: Validate = "sample",
                 remote_cache_dir: str | None = None):
        if not paths:
            raise DataError("data.paths is empty: give token files, mix files or `olmax tokenize` folders")
        if sequence_length <= 0:
            raise DataError(f"data.sequence_length must be positive, got {sequence_length}")
        if long_doc_strategy not in ("truncate", "fragment"):
            raise DataError(f"data.long_doc_strategy must be 'truncate' or 'fragment', got {long_doc_strategy!r}")
        self.sequence_length, self.vocab_size = sequence_length, vocab_size
        self.eos_token_id, self.pad_token_id, self.bos_token_id = eos_token_id, pad_token_id, bos_token_id
        self.dtype, self.long_doc_strategy = np.dtype(dtype), long_doc_strategy
        self.remote_cache_dir = remote_cache_dir
        resolved = [p for p, _ in resolve_paths(paths, mix_root, dtype=self.dtype.name,
                                                eos_token_id=eos_token_id, vocab_size=vocab_size,
                                                mix_tokenizer=mix_tokenizer)]
        sizes = file_sizes(resolved)
        masks: list[str | None] = [None] * len(resolved)
        label_mask_paths = label_mask_paths or chat_label_masks(expand_globs(paths))
        if label_mask_paths:
            masks = list(label_mask_files(resolved, label_mask_paths))
            check_mask_sizes([(t, m, s) for t, m, s in zip(resolved, masks, sizes)], self.dtype.itemsize)
        files, start = [], 0
        for path, mask, size in zip(resolved, masks, sizes):
            if size % self.dtype.itemsize:
                raise DataError(f"{path}: size {size} bytes is not a multiple of {self.dtype.itemsize} "
                                f"({self.dtype.name}, data.dtype); wrong dtype or a truncated file")
            if validate != "none":
                validate_tokens(path, self.dtype, vocab_size, full=validate == "full", nbytes=size,
                                cache_dir=remote_cache_dir)
            toks = open_tokens(path, self.dtype, size, remote_cache_dir)
            spans = document_spans(np.asarray(toks[:len(toks)]), eos_token_id, sequence_length,
                                   long_doc_strategy, bos_token_id)
            spans, bins = best_fit_decreasing(spans, sequence_length)
            offsets = np.zeros(len(bins) + 1, dtype=np.int64)
            offsets[1:] = np.cumsum([len(b) for b in bins])
            docs = np.fromiter((d for b in bins for d in b), dtype=np.int64, count=int(offsets[-1]))
            files.append(PackedFile(path, mask, size, size // self.dtype.itemsize, spans, offsets, docs, start))
            start += len(bins)
        if start == 0:
            raise DataError(f"no documents in {', '.join(resolved[:3])}: no EOS token "
                            f"(data.eos_token_id={eos_token_id}) in the token files")
        if start >= np.iinfo(np.uint32).max:
            raise DataError(f"{start} instances do not fit the uint32 global order")
        self.files: tuple[PackedFile, ...] = tuple(files)
        self.num_instances = start
        self._starts = np.array([f.start for f in files] + [start], dtype=np.int64)
        self._maps: dict[tuple[int, bool], np.ndarray] = {}

    @classmethod
    def from_config(cls, cfg: Config, *, validate: Validate = "sample") -> PackedDataset:
        d = cfg.data
        return cls(d.paths, sequence_length=d.sequence_length, vocab_size=cfg.model.vocab_size,
                   eos_token_id=d.eos_token_id, pad_token_id=d.pad_token_id, bos_token_id=d.bos_token_id,
                   dtype=d.dtype, label_mask_paths=d.label_mask_paths, long_doc_strategy=d.long_doc_strategy,
                   mix_root=d.mix_root, mix_tokenizer=d.mix_tokenizer, validate=validate,
                   remote_cache_dir=d.remote_cache_dir)

    def __len__(self) -> int:
        return self.num_instances

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_maps": {}}

    @property
    def has_label_masks(self) -> bool:
        return self.files[0].mask_path is not None

    label_masked = True  # padding is masked whether or not label-mask files are given

    def describe(self) -> dict:
        return {"class": "NumpyPackedFSLDataset", "vocab_size": self.vocab_size, "pad_token_id": self.pad_token_id,
                "eos_token_id": self.eos_token_id, "bos_token_id": self.bos_token_id, "dtype": self.dtype.name,
                "sequence_length": self.sequence_length, "long_doc_strategy": self.long_doc_strategy,
                "files": [[os.path.basename(f.path), f.size] for f in self.files],
                **({"label_masks": [os.path.basename(f.mask_path) for f in self.files]}
                   if self.has_label_masks else {})}

    @functools.cached_property
    def fingerprint(self) -> str:
        """OLMo-core's ``NumpyPackedFSLDataset.fingerprint`` (its default fields)."""
        return olmo_core_fingerprint("NumpyPackedFSLDataset", (
            ("vocab_size", self.vocab_size), ("pad_token_id", self.pad_token_id),
            ("eos_token_id", self.eos_token_id), ("dtype", self.dtype.type),
            ("long_doc_strategy", self.long_doc_strategy), ("bos_token_id", self.bos_token_id),
            ("sequence_length", self.sequence_length)), self.files)

    @functools.cached_property
    def content_hashes(self) -> list[list[str | None]]:
        out = []
        for f in self.files:
            for p in (f.path, f.mask_path):
                if p is not None:
                    out.append([os.path.basename(p), None if io.is_remote(p) else content_hash(p)])
        return out

    def _map(self, i: int, mask: bool) -> np.ndarray:
        if (i, mask) not in self._maps:
            f = self.files[i]
            self._maps[(i, mask)] = (open_tokens(f.mask_path, np.uint8, f.tokens, self.remote_cache_dir) if mask
                                     else open_tokens(f.path, self.dtype, f.size, self.remote_cache_dir))
        return self._maps[(i, mask)]

    def _locate(self, ids: np.ndarray) -> np.ndarray:
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        if len(ids) and (ids.min() < 0 or ids.max() >= self.num_instances):
            raise IndexError(f"instance ids outside [0, {self.num_instances})")
        return np.searchsorted(self._starts, ids, side="right") - 1

    def _docs(self, i: int) -> tuple[int, np.ndarray]:
        fi = int(np.searchsorted(self._starts, i, side="right") - 1)
        f = self.files[fi]
        local = i - f.start
        return fi, f.spans[f.docs[f.offsets[local]:f.offsets[local + 1]]]

    def read(self, ids: np.ndarray, step: int | None = None) -> np.ndarray:
        """Tokens of instances ``ids`` as int32 ``[len(ids), L]``, pad-filled; an id >= vocab
        is a ``DataError`` naming the file and offset."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        self._locate(ids)
        out = np.full((len(ids), self.sequence_length), self.pad_token_id, dtype=np.int32)
        for row, i in enumerate(ids.tolist()):
            fi, spans = self._docs(i)
            toks = self._map(fi, False)
            at = 0
            for s, e in spans.tolist():
                raw = np.asarray(toks[s:e])
                if raw.max() >= self.vocab_size:
                    pos = int(np.argmax(raw >= self.vocab_size))
                    where = f" in global batch {step}" if step is not None else ""
                    raise DataError(f"{self.files[fi].path}: token id {int(raw[pos])} at token offset {s + pos} "
                                    f"(instance {i}) is >= the vocabulary size {self.vocab_size}{where}")
                out[row, at:at + e - s] = raw
                at += e - s
        return out

    def read_label_mask(self, ids: np.ndarray) -> np.ndarray:
        """Label masks of instances ``ids``, bool ``[len(ids), L]`` (False on padding)."""
        ids = np.asarray(ids, dtype=np.int64).reshape(-1)
        self._locate(ids)
        out = np.zeros((len(ids), self.sequence_length), dtype=bool)
        for row, i in enumerate(ids.tolist()):
            fi, spans = self._docs(i)
            m = self._map(fi, True) if self.has_label_masks else None
            at = 0
            for s, e in spans.tolist():
                out[row, at:at + e - s] = True if m is None else np.asarray(m[s:e]) != 0
                at += e - s
        return out

    def doc_lens(self, ids: np.ndarray) -> list[list[int]]:
        """Each instance's document lengths in packing order, padding last (as OLMo-core's
        ``doc_lens`` with ``generate_doc_lengths``)."""
        out = []
        for i in np.asarray(ids, dtype=np.int64).reshape(-1).tolist():
            _, spans = self._docs(i)
            lens = (spans[:, 1] - spans[:, 0]).tolist()
            if sum(lens) < self.sequence_length:
                lens.append(self.sequence_length - sum(lens))
            out.append(lens)
        return out
