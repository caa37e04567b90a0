"""``olmax serve`` (wired into the main CLI by ``register``); the server is imported when it runs."""

from __future__ import annotations

import argparse

from olmax.argtypes import int_in, nonneg_int, positive_float, positive_int
from olmax.infer.commands import kv_cache_arguments
from olmax.serve import DEFAULT_ADMISSION_TIMEOUT as DEFAULT_TIMEOUT
from olmax.serve import DEFAULT_MAX_LENGTH

DEFAULT_PORT = 8000
DEFAULT_SLOTS = 32


def _serve(args: argparse.Namespace) -> int:
    from olmax.serve.server import cmd_serve
    return cmd_serve(args)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (chat and completions) over a checkpoint")
    p.add_argument("--checkpoint", required=True, metavar="PATH",
                   help="olmax weights dir, run dir (newest checkpoint), RUN/checkpoints/N, or hf:DIR")
    p.add_argument("--tokenizer", default=None, metavar="T",
                   help="tokenizer.json or a folder holding it (default: the checkpoint's, as olmax generate finds it)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="parameters and compute in this dtype (default: as stored)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)")
    p.add_argument("--port", type=int_in(0, 65535), default=DEFAULT_PORT,
                   help=f"port (default {DEFAULT_PORT}; 0: a free one, printed on the startup line)")
    p.add_argument("--api-key", default=None, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' (default: $OLMAX_API_KEY if set, else no key; an "
                        "empty key is an error, not 'no key')")
    p.add_argument("--max-concurrency", type=positive_int, default=DEFAULT_SLOTS, metavar="N",
                   help=f"requests decoded together: the engine's slots (default {DEFAULT_SLOTS}); more wait")
    p.add_argument("--max-length", type=positive_int, default=None, metavar="L",
                   help=f"prompt + completion tokens per request, the KV cache of each slot (default: the model's "
                        f"positions, at most {DEFAULT_MAX_LENGTH})")
    p.add_argument("--prefill-tokens", type=positive_int, default=None, metavar="N",
                   help="prefill at most N prompt tokens per engine round trip (at least one prompt): long prompts "
                        "arriving together are prefilled over several round trips while the others decode "
                        "(default: every free slot's prompt at once)")
    kv_cache_arguments(p)
    p.add_argument("--warmup", type=nonneg_int, nargs="?", const=0, default=None, metavar="TOKENS",
                   help="before listening, compile the engine's prefill programs for prompts up to TOKENS long "
                        "(default: --max-length), 1 to --max-concurrency rows at a time, greedy and sampled, so "
                        "that no request waits for a compile")
    p.add_argument("--model-name", default=None, metavar="NAME",
                   help="the model id clients name (default: --checkpoint as given)")
    p.add_argument("--admission-timeout", type=positive_float, default=DEFAULT_TIMEOUT, metavar="SECONDS",
                   help=f"the most a request may take from arriving to reaching the engine's queue (reading its "
                        f"body, checking it, tokenizing its prompt); past it: 408 (default {DEFAULT_TIMEOUT:g})")
    p.set_defaults(func=_serve)
