"""``olmax convert hf-to-olmax`` / ``olmax convert olmax-to-hf`` (wired into the main CLI by ``register``)."""

from __future__ import annotations

import argparse
import sys

from olmax.model.weights_io import DEFAULT_SHARD_BYTES


def _hf_to_olmax(args: argparse.Namespace) -> int:
    from olmax.compat.hf import hf_to_olmax
    cfg = hf_to_olmax(args.hf, args.out, dtype=args.dtype, padded_vocab_size=args.pad_vocab_to,
                      shard_bytes=args.shard_bytes, progress=sys.stderr)
    m = cfg.model
    print(f"wrote {args.out}: {m.n_layers} layers, d_model {m.d_model}, vocab {m.vocab_size} padded to "
          f"{m.embedding_rows}, {m.param_dtype}")
    return 0


def _olmax_to_hf(args: argparse.Namespace) -> int:
    from olmax.compat.hf import olmax_to_hf
    olmax_to_hf(args.checkpoint, args.out, dtype=args.dtype, shard_bytes=args.shard_bytes, progress=sys.stderr)
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
    a.add_argument("--pad-vocab-to", type=int, default=None, metavar="N",
                   help="embedding/LM-head rows (default: vocab size rounded up to a multiple of 128)")
    a.add_argument("--shard-bytes", type=int, default=DEFAULT_SHARD_BYTES, help=argparse.SUPPRESS)
    a.set_defaults(func=_hf_to_olmax)

    b = sub.add_parser("olmax-to-hf", help="olmax weights directory -> HF Olmo3ForCausalLM directory")
    b.add_argument("--checkpoint", required=True, help="olmax weights directory")
    b.add_argument("--out", required=True, help="new HF model directory (must not exist or be empty)")
    b.add_argument("--dtype", choices=dtypes, default=None, help="cast weights (default: keep the stored dtype)")
    b.add_argument("--shard-bytes", type=int, default=DEFAULT_SHARD_BYTES, help=argparse.SUPPRESS)
    b.set_defaults(func=_olmax_to_hf)
