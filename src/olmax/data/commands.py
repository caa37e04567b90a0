"""CLI: ``olmax tokenize`` and ``olmax data {batches,audit}``. Errors are raised (DataError /
ConfigError) and printed by the main CLI as one line."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import numpy as np

from olmax import io, jsonout
from olmax.argtypes import int_in, nonneg_float, nonneg_int, positive_int
from olmax.data import DataError
from olmax.data.audit import audit
from olmax.data.loader import DataLoader
from olmax.data.tokenize import tokenize
from olmax.recipes import add_recipe_args, get_recipe


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``tokenize`` and ``data`` to the ``olmax`` sub-commands; each sets ``func(args) -> int``."""
    p = subparsers.add_parser("tokenize", help="text / JSONL(.gz/.zst) -> raw token files + manifest.json")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--tokenizer", metavar="FILE.json", help="any HF tokenizer.json (dolma2 included)")
    src.add_argument("--train-bpe", type=positive_int, metavar="VOCAB_SIZE",
                     help="train a byte-level BPE on the inputs first (<|endoftext|>=0 eos, <|pad|>=1)")
    p.add_argument("--out", required=True, metavar="DIR", help="new or empty output folder")
    p.add_argument("--heldout", type=nonneg_float, default=0.0, metavar="FRACTION",
                   help="documents split off by a hash of their text into DIR/heldout (rest: DIR/train)")
    p.add_argument("--shard-tokens", type=positive_int, default=None, metavar="N",
                   help="tokens per output file (default 2**28; --chat: 1 GiB of token ids, as open-instruct)")
    p.add_argument("--processes", type=positive_int, default=os.cpu_count() or 1, metavar="P",
                   help="tokenizer processes (default: one per core; the output is the same for any P)")
    p.add_argument("--text-field", default="text", help="JSONL field holding the text (Dolma: text)")
    p.add_argument("--text-unit", choices=("paragraph", "line", "file"), default="paragraph",
                   help="document unit of plain-text inputs (default: blank-line separated blocks)")
    p.add_argument("--eos-token-id", type=nonneg_int, help="EOS id (default: the tokenizer's <|endoftext|>)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    c = p.add_argument_group("chat data (olmax.data.chat)")
    c.add_argument("--chat", action="store_true",
                   help="JSONL conversations ({messages, tools?}) -> token_ids_part_*.npy + labels_mask_part_*.npy "
                        "(OLMo-core / open-instruct layout); labels on assistant turns only")
    c.add_argument("--preference", action="store_true",
                   help="with --chat: chosen/rejected pairs -> pairs_{token_ids,labels_mask,index}.npy (for DPO)")
    c.add_argument("--template", default="olmo3", metavar="NAME|PATH",
                   help="olmo3 (default), olmo3-think, tokenizer (the jinja template beside --tokenizer), "
                        "a tokenizer folder or a .jinja file")
    c.add_argument("--max-length", type=positive_int, metavar="N", help="keep the first N tokens of each sequence")
    c.add_argument("--skip-bad", action="store_true", help="skip and count bad conversations instead of failing")
    c.add_argument("--labels", choices=("turns", "open-instruct-counts"), default="turns",
                   help="turns: assistant content + <|im_end|>\\n / final EOS (default); open-instruct-counts: "
                        "open-instruct's rule before its PR #1746, which tokenized OLMo 3's SFT data (masks the \\n "
                        "after a non-final <|im_end|>)")
    p.add_argument("inputs", nargs="+", metavar="INPUT",
                   help="text or JSONL files, optionally .gz/.zst, to tokenize (with --chat: chat JSONL); not folders")
    p.set_defaults(func=_tokenize)

    d = subparsers.add_parser("data", help="inspect and audit the data order")
    dsub = d.add_subparsers(dest="data_command", required=True)
    b = dsub.add_parser("batches", help="write the global instance ids a process reads for steps A..B-1")
    add_recipe_args(b)
    b.add_argument("--steps", required=True, metavar="A:B", help="global steps A..B-1 (0-based)")
    b.add_argument("--process-index", type=nonneg_int, default=0, metavar="r",
                   help="the process whose share is written, 0..R-1 (default 0)")
    b.add_argument("--process-count", type=positive_int, default=1, metavar="R",
                   help="data processes the global batch is split over (default 1)")
    b.add_argument("--out", required=True, metavar="FILE.npy", help="int64 [B-A, global_batch / R]")
    b.add_argument("--filter-out", metavar="FILE.npy", help="bool, same shape: True where the instance is dirty")
    b.add_argument("--dump-instances", metavar="FILE.npz",
                   help="also the instances themselves, in read order: instance_ids int64 [n], input_ids int32 "
                        "[n, L], label_mask bool [n, L] and doc_lens int32 [n, max docs] (each instance's document "
                        "lengths as OLMo-core's generate_doc_lengths gives them, zero-padded), to compare with "
                        "OLMo-core's dataset")
    b.set_defaults(func=_batches)

    a = dsub.add_parser("audit", help="prove each instance of an epoch is read exactly once for R x W")
    add_recipe_args(a)
    a.add_argument("--processes", type=positive_int, default=1, metavar="R",
                   help="data processes to check the assignment for (default 1)")
    a.add_argument("--workers", type=nonneg_int, default=None, metavar="W", help="default: data.workers")
    a.add_argument("--epoch", type=int_in(1, 2**32 - 1), default=1, help="the epoch to audit (default 1)")
    a.add_argument("--json", action="store_true", help="print the result as one JSON object (stable keys: docs/cli.md)")
    a.set_defaults(func=_audit)


def _tokenize(args: argparse.Namespace) -> int:
    if args.chat or args.preference:
        return _tokenize_chat(args)
    manifests = tokenize(args.inputs, args.out, tokenizer=args.tokenizer, train_bpe_vocab=args.train_bpe,
                         heldout=args.heldout, shard_tokens=args.shard_tokens or 1 << 28, processes=args.processes,
                         text_field=args.text_field, text_unit=args.text_unit, eos_token_id=args.eos_token_id,
                         progress=not args.no_progress)
    for split, m in manifests.items():
        where = args.out if split == "all" else os.path.join(args.out, split)
        print(f"{where}: {m['total_documents']} documents, {m['total_tokens']} tokens ({m['dtype']}, "
              f"eos {m['eos_token_id']}) in {len(m['files'])} files")
    return 0


def _tokenize_chat(args: argparse.Namespace) -> int:
    from olmax.data.chat import summary, tokenize_chat
    if not args.chat:
        raise DataError("--preference goes with --chat")
    if args.tokenizer is None:
        raise DataError("--chat needs --tokenizer FILE.json (a chat template's special tokens must be in it)")
    if args.heldout:
        raise DataError("--heldout is for plain text; split chat JSONL before tokenizing")
    m = tokenize_chat(args.inputs, args.out, tokenizer=args.tokenizer, template=args.template,
                      preference=args.preference, max_length=args.max_length, skip_bad=args.skip_bad,
                      processes=args.processes, part_tokens=args.shard_tokens, eos_token_id=args.eos_token_id,
                      labels=args.labels, progress=not args.no_progress)
    print(summary(m, args.out))
    return 0


def _loader(args: argparse.Namespace, process_index: int = 0, process_count: int = 1):
    """The training loader itself (its dataset, order and checks), for introspection."""
    cfg = get_recipe(args.recipe, args.overrides)
    return cfg, DataLoader(cfg, process_index=process_index, process_count=process_count)


def _check_target(path: str, flag: str) -> Path:
    """``path`` as an output file of ``flag``: refused when it is a folder or its folder is missing."""
    io.check_local_output(path, flag, DataError)
    return Path(path)


def _write_atomic(path: str, flag: str, write: Callable[[BinaryIO], None]) -> None:
    """``write(file)`` into a temporary sibling renamed to ``path``: a failure never leaves a
    half-written file in place, nor the temporary file."""
    out = _check_target(path, flag)
    try:
        io.write_local_atomically(out, write)
    except OSError as e:
        raise DataError(f"{flag} {path}: cannot write it ({e.strerror or e})") from None


def _save(path: str, array: np.ndarray, flag: str = "--out") -> None:
    """``np.save`` atomically (see :func:`_write_atomic`)."""
    _write_atomic(path, flag, lambda f: np.save(f, array))


def _batches(args: argparse.Namespace) -> int:
    try:
        a, b = (int(x) for x in args.steps.split(":"))
    except ValueError:
        raise DataError(f"--steps must be A:B with integers, got {args.steps!r}") from None
    if not 0 <= a < b:
        raise DataError(f"--steps A:B needs 0 <= A < B, got {args.steps}")
    r, R = args.process_index, args.process_count
    if not 0 <= r < R:
        raise DataError(f"--process-index {r} is outside 0..{R - 1}")
    targets = (("--out", args.out), ("--filter-out", args.filter_out), ("--dump-instances", args.dump_instances))
    for flag, path in targets:
        if path:
            _check_target(path, flag)  # before the work, not after it
    cfg, loader = _loader(args, r, R)
    source = loader.source  # the loader's own code path
    ids = np.stack([source.ids(k) for k in range(a, b)]).astype(np.int64)
    if args.filter_out:
        if not cfg.data.repetition_filter:
            print("note: data.repetition_filter is off, so no instance is dirty", file=sys.stderr)
            dirty = np.zeros(ids.shape, dtype=bool)
        else:
            dirty = np.stack([~source(k)["label_mask"].any(axis=1) for k in range(a, b)])
        _save(args.filter_out, dirty, "--filter-out")
    if args.dump_instances:
        _dump_instances(args.dump_instances, loader, ids.reshape(-1), cfg)
    _save(args.out, ids)
    print(f"{args.out}: instance ids {list(ids.shape)} for steps {a}..{b - 1}, process {r} of {R}")
    return 0


def doc_lengths(tokens: np.ndarray, eos_token_id: int) -> list[int]:
    """OLMo-core's ``get_document_lengths`` of one instance: split after every EOS, the rest one more."""
    ends = (np.flatnonzero(tokens == eos_token_id) + 1).tolist()
    if not ends or ends[-1] != len(tokens):
        ends.append(len(tokens))
    return np.diff([0, *ends]).tolist()


def _dump_instances(path: str, loader: DataLoader, ids: np.ndarray, cfg) -> None:
    ds = loader.dataset
    toks = ds.read(ids)
    mask = ds.read_label_mask(ids) if ds.label_masked else np.ones(toks.shape, bool)
    lens = [doc_lengths(t, cfg.data.eos_token_id) for t in toks]
    doc_lens = np.zeros((len(ids), max(map(len, lens))), dtype=np.int32)
    for i, ln in enumerate(lens):
        doc_lens[i, :len(ln)] = ln
    _write_atomic(path, "--dump-instances", lambda f: np.savez(
        f, instance_ids=ids.astype(np.int64), input_ids=toks, label_mask=mask, doc_lens=doc_lens))
    print(f"{path}: {len(ids)} instances of {toks.shape[1]} tokens (input_ids, label_mask, doc_lens)")


def _audit(args: argparse.Namespace) -> int:
    cfg, loader = _loader(args)
    workers = cfg.data.workers if args.workers is None else args.workers
    res = audit(loader.order, args.processes, workers, epoch=args.epoch)
    print(jsonout.dumps(res.to_dict(), indent=1) if args.json else res.summary())
    return 0 if res.ok else 1
