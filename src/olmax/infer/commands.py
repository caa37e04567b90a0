"""``olmax generate`` and ``olmax chat`` (wired into the main CLI by ``register``).

JSON (``generate --json``; stable keys): one object per prompt, in prompt order:
``{"token_ids", "text", "logprobs", "finish_reason"}``; ``text`` only when a tokenizer is known.
The commands import their implementation when they run (the CLI starts without JAX work).
"""

from __future__ import annotations

import argparse

from olmax.argtypes import int_in, positive_int

# The sampling seed is a uint32 inside the compiled decoder (``jax.random.key``).
SEED_MAX = 2**32 - 1


def _common(p: argparse.ArgumentParser, max_new_default: int) -> None:
    p.add_argument("--checkpoint", required=True, metavar="PATH",
                   help="olmax weights dir, run dir (newest checkpoint), RUN/checkpoints/N, or hf:DIR")
    p.add_argument("--tokenizer", default=None, metavar="T",
                   help="tokenizer.json or a folder holding it (default: the checkpoint's, or the one "
                        "olmax tokenize wrote beside the run's training data)")
    p.add_argument("--system", default=None, metavar="TEXT", help="a system message for chat prompts")
    p.add_argument("--max-new-tokens", type=positive_int, default=None, metavar="N",
                   help=f"tokens to generate at most per prompt (default {max_new_default}, or fewer when the "
                        "model's positions end sooner)")
    p.add_argument("--temperature", type=float, default=None, metavar="T",
                   help="sample at this temperature, 0..100 (default: greedy; 0 is greedy too)")
    p.add_argument("--top-p", type=float, default=None, metavar="P",
                   help="nucleus sampling: keep the top P of the mass")
    p.add_argument("--top-k", type=positive_int, default=None, metavar="K", help="sample from the K most likely tokens")
    p.add_argument("--seed", type=int_in(0, SEED_MAX), default=0, help=f"sampling seed, 0..{SEED_MAX} (default 0)")
    p.add_argument("--stop", action="extend", nargs="+", default=None, metavar="STR",
                   help="stop when the text contains STR, a non-empty string (repeatable); the text is cut before it")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="parameters and compute in this dtype (default: as stored and configured)")
    kv_cache_arguments(p)


def kv_cache_arguments(p: argparse.ArgumentParser) -> None:
    """``--kv-cache``, ``--page-size``, ``--kv-budget`` (generate, chat, serve)."""
    p.add_argument("--kv-cache", choices=["contiguous", "paged"], default="contiguous",
                   help="contiguous: every slot holds the whole cache length (default); paged: pages of "
                        "--page-size positions as a row grows, admission by free pages, the rows of one prompt "
                        "sharing its pages (the same completions)")
    p.add_argument("--page-size", type=positive_int, default=16, metavar="N",
                   help="positions per page of the paged cache, a power of two dividing the cache (default 16)")
    p.add_argument("--kv-budget", default=None, metavar="SIZE",
                   help="the KV cache's memory: 512MiB, 2GiB, a number of MiB, or a fraction of free device memory "
                        "in (0, 1] (default: the contiguous cache of the batch's rows)")


def _generate(args: argparse.Namespace) -> int:
    from olmax.infer.run import cmd_generate
    return cmd_generate(args)


def _chat(args: argparse.Namespace) -> int:
    from olmax.infer.chat import cmd_chat
    return cmd_chat(args)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="complete prompts with a checkpoint (greedy or sampled, KV cache)")
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", action="extend", nargs="+", default=None, metavar="TEXT",
                     help="prompt text (several: one completion each)")
    src.add_argument("--prompts", default=None, metavar="FILE.jsonl",
                     help='one prompt per line: a JSON string, {"prompt": TEXT} or {"messages": [{"role", '
                          '"content"}, ...]} (a chat); - reads stdin')
    src.add_argument("--prompt-ids", default=None, metavar="FILE.jsonl",
                     help="one JSON list of token ids per line (no tokenizer needed); - reads stdin")
    p.add_argument("--chat", action="store_true",
                   help="wrap each prompt as a user turn in the chat template (the checkpoint's, else OLMo 3 "
                        "Instruct's ChatML); also stop at <|im_end|>")
    p.add_argument("--batch-size", type=positive_int, default=8, metavar="B",
                   help="prompts decoded together: the engine's row slots (default 8)")
    p.add_argument("--batching", choices=["continuous", "static"], default="continuous",
                   help="continuous: a finished row's slot takes the next prompt at once, several decode steps "
                        "per host round trip (default); static: each batch decodes until its longest row stops "
                        "(the same completions, to compare with)")
    p.add_argument("--prefill-tokens", type=positive_int, default=None, metavar="N",
                   help="continuous batching: prefill at most N prompt tokens per host round trip (at least one "
                        "prompt), so long prompts' prefill is not held beside the whole cache at once (default: "
                        "every free slot's prompt at once)")
    p.add_argument("--json", action="store_true",
                   help="one JSON object per prompt: token_ids, text, logprobs, finish_reason")
    _common(p, 256)
    p.set_defaults(func=_generate)

    p = sub.add_parser("chat", help="an interactive conversation with a checkpoint (stdin lines; /reset, /exit)")
    _common(p, 512)
    p.set_defaults(func=_chat)
