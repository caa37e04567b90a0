"""``olmax convert hf-to-olmax`` / ``olmax convert olmax-to-hf`` (wired into the main CLI by ``register``)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import numpy as np

from olmax.argtypes import positive_int
from olmax.compat.hf import ConversionError, hf_to_olmax, olmax_to_hf, write_hf
from olmax.config import ConfigError
from olmax.model.weights_io import DEFAULT_SHARD_BYTES, flatten_tree, is_weights_dir


def _hf_to_olmax(args: argparse.Namespace) -> int:
    cfg = hf_to_olmax(args.hf, args.out, dtype=args.dtype, padded_vocab_size=args.pad_vocab_to,
                      shard_bytes=args.shard_bytes, progress=sys.stderr)
    m = cfg.model
    print(f"wrote {args.out}: {m.n_layers} layers, d_model {m.d_model}, vocab {m.vocab_size} padded to "
          f"{m.embedding_rows}, {m.param_dtype}")
    return 0


def export_checkpoint(weights_dir: str | os.PathLike, out_dir: str | os.PathLike, dtype: str | None = None,
                      shard_bytes: int = DEFAULT_SHARD_BYTES, progress: Any = None) -> Path:
    """``olmax_to_hf`` for an olmax weights directory, a training run directory or
    ``RUN/checkpoints/N`` (whose parameters alone are restored and streamed into the HF files)."""
    from olmax.checkpoint.load import load_params, resolve_checkpoint  # Orbax: only when exporting
    weights_dir = Path(weights_dir)
    if not weights_dir.is_dir() or is_weights_dir(weights_dir):
        return olmax_to_hf(weights_dir, out_dir, dtype=dtype, shard_bytes=shard_bytes, progress=progress)
    if Path(out_dir).exists() and any(Path(out_dir).iterdir()):  # before any restore work
        raise ConversionError(f"output directory {str(out_dir)!r} already exists and is not empty")
    try:
        resolve_checkpoint(weights_dir)
    except ConfigError:
        raise ConversionError(f"{str(weights_dir)!r} is not an olmax weights directory (config.yaml + "
                              "safetensors) nor a run or checkpoint directory") from None
    params, cfg = load_params(weights_dir)
    return write_hf(((n, np.asarray(a)) for n, a in flatten_tree(params)), cfg, out_dir, cfg.model.param_dtype,
                    dtype=dtype, shard_bytes=shard_bytes, progress=progress)


def _olmax_to_hf(args: argparse.Namespace) -> int:
    export_checkpoint(args.checkpoint, args.out, dtype=args.dtype, shard_bytes=args.shard_bytes, progress=sys.stderr)
    print(f"wrote {args.out} (loads with transformers.AutoModelForCausalLM.from_pretrained)")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``convert hf-to-olmax`` and ``convert olmax-to-hf``; each sets ``func(args) -> int``."""
    conv = subparsers.add_parser("convert", help="convert weights between HF transformers and olmax")
    sub = conv.add_subparsers(dest="convert_command", required=True)
    dtypes = ["float32", "bfloat16"]

    a = sub.add_parser("hf-to-olmax", help="HF Olmo3ForCausalLM directory -> olmax weights directory")
    a.add_argument("--hf", required=True, help="HF model directory (config.json + safetensors)")
    a.add_argument("--out", required=True, help="new olmax weights directory (must not exist or be empty)")
    a.add_argument("--dtype", choices=dtypes, default=None, help="cast weights (default: keep the stored dtype)")
    a.add_argument("--pad-vocab-to", type=positive_int, default=None, metavar="N",
                   help="embedding/LM-head rows (default: vocab size rounded up to a multiple of 128)")
    a.add_argument("--shard-bytes", type=positive_int, default=DEFAULT_SHARD_BYTES, help=argparse.SUPPRESS)
    a.set_defaults(func=_hf_to_olmax)

    b = sub.add_parser("olmax-to-hf", help="olmax weights directory -> HF Olmo3ForCausalLM directory")
    b.add_argument("--checkpoint", required=True, help="olmax weights directory")
    b.add_argument("--out", required=True, help="new HF model directory (must not exist or be empty)")
    b.add_argument("--dtype", choices=dtypes, default=None, help="cast weights (default: keep the stored dtype)")
    b.add_argument("--shard-bytes", type=positive_int, default=DEFAULT_SHARD_BYTES, help=argparse.SUPPRESS)
    b.set_defaults(func=_olmax_to_hf)
