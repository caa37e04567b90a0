"""``olmax chat``: an interactive conversation over ``olmax generate``'s code.

Each line read from stdin is a user turn; the reply streams to stdout. The conversation is kept
and re-rendered with the chat template every turn (when it no longer fits in the model's
positions, the oldest turns are dropped, with a note on stderr). ``/reset`` starts over,
``/exit`` or end of input ends it. Every turn reuses one compiled decoder; sampled turn n draws
with seed ``--seed + n``, so turns differ and a replayed conversation samples the same replies.
"""

from __future__ import annotations

import sys
from typing import Any, TextIO

from olmax.infer.run import Model, validate_sampling

DEFAULT_MAX_NEW_TOKENS = 512

HELP = "/reset: start a new conversation; /exit (or end of input): quit; /help: this line"


def _fit(gen: Model, messages: list[dict], max_new_tokens: int, err: TextIO) -> tuple[list[dict], list[int]]:
    """The conversation (oldest user/assistant turns dropped as needed) and its prompt tokens."""
    limit = gen.cfg.model.max_position_embeddings - max_new_tokens
    checked = False
    while True:
        ids = gen.codec.encode_chat(messages)
        turns = [i for i, m in enumerate(messages) if m["role"] != "system"]
        if len(ids) > limit and not checked:
            # The new message alone (with the system messages) must fit, or no dropping of old turns helps.
            alone = ids if len(turns) <= 1 else \
                gen.codec.encode_chat([m for m in messages[:-1] if m["role"] == "system"] + messages[-1:])
            if len(alone) > limit:
                raise ValueError(f"the message is {len(alone)} tokens with its template; with --max-new-tokens "
                                 f"{max_new_tokens} the model's {gen.cfg.model.max_position_embeddings} positions "
                                 f"leave room for at most {limit}")
            checked = True
        if len(ids) <= limit or len(turns) <= 1:
            return messages, ids
        # Drop the oldest turn (and the assistant reply that follows it), keeping system messages.
        drop = {turns[0]} | ({turns[1]} if messages[turns[1]]["role"] == "assistant" else set())
        messages = [m for i, m in enumerate(messages) if i not in drop]
        err.write("(the conversation is longer than the model's context: dropped its oldest turn)\n")


def _read_line(stdin: TextIO) -> str | None:
    """The next line of ``stdin`` ("" at the end), or None when it is not valid UTF-8: read as bytes
    where the stream has them, so that one bad line is refused and the next one still read."""
    raw = getattr(stdin, "buffer", None)
    if raw is not None:
        data = raw.readline()
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            return None
    try:
        line = stdin.readline()
        line.encode("utf-8")  # a stream decoded with surrogateescape carries bad bytes as lone surrogates
    except UnicodeError:
        return None
    return line


def run_chat(gen: Model, *, system: str | None = None, max_new_tokens: int = 512,
             temperature: float | None = None, top_p: float | None = None, top_k: int | None = None,
             seed: int = 0, stops: list[str] = (), stdin: TextIO | None = None, stdout: TextIO | None = None,
             stderr: TextIO | None = None, kv: dict | None = None) -> int:
    stdin, stdout, stderr = stdin or sys.stdin, stdout or sys.stdout, stderr or sys.stderr
    base = [{"role": "system", "content": system}] if system is not None else []
    messages = list(base)
    turn = -1  # the first reply draws with --seed itself, as olmax generate does
    interactive = stdin.isatty()
    stderr.write(f"olmax chat: {gen.checkpoint} ({gen.codec.template_source}). {HELP}\n")
    while True:
        if interactive:
            stderr.write("> ")
            stderr.flush()
        line = _read_line(stdin)
        if line is None:
            stderr.write("(that line is not valid UTF-8 text: refused; type it again)\n")
            continue
        if not line:
            break
        text = line.rstrip("\r\n")
        cmd = text.strip()
        if not cmd:
            continue
        if cmd in ("/exit", "/quit"):
            break
        if cmd == "/reset":
            messages = list(base)
            stderr.write("(new conversation)\n")
            continue
        if cmd == "/help" or (cmd.startswith("/") and " " not in cmd):
            stderr.write(("" if cmd == "/help" else f"unknown command {cmd}; ") + HELP + "\n")
            continue
        try:
            messages, ids = _fit(gen, messages + [{"role": "user", "content": text}], max_new_tokens, stderr)
        except ValueError as e:  # one message too long for the context: refuse the turn, keep the session
            stderr.write(f"({e}: refused; the conversation goes on without it)\n")
            continue
        turn += 1
        (reply,) = gen.generate([ids], max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p,
                                top_k=top_k, seed=(seed + turn) % 2**32, batch_size=1, stops=list(stops), chat=True,
                                stream=stdout, **(kv or {}))
        stdout.write("\n")
        stdout.flush()
        if reply["finish_reason"] == "length":
            stderr.write(f"(reply cut at --max-new-tokens {max_new_tokens})\n")
        messages.append({"role": "assistant", "content": reply["text"]})
    return 0


def cmd_chat(args: Any) -> int:
    validate_sampling(args.temperature, args.top_p, args.top_k, args.stop)
    gen = Model(args.checkpoint, args.tokenizer, args.dtype, need_tokenizer="chats")
    max_new = args.max_new_tokens
    if max_new is None:  # a reply may use up to half the model's positions by default
        max_new = max(1, min(DEFAULT_MAX_NEW_TOKENS, gen.cfg.model.max_position_embeddings // 2))
    return run_chat(gen, system=args.system, max_new_tokens=max_new, temperature=args.temperature,
                    top_p=args.top_p, top_k=args.top_k, seed=args.seed, stops=list(args.stop or []),
                    kv={"kv_cache": args.kv_cache, "page_size": args.page_size, "kv_budget": args.kv_budget})
