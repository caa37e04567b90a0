"""``olmax generate``: prompts in, completions out, through the KV-cache decoder.

A checkpoint is anything ``load_params`` reads (weights dir, run or checkpoint dir, ``hf:DIR``).
Decoding is greedy unless a temperature above 0 is given; it stops at EOS (``data.eos_token_id``,
plus ``<|im_end|>`` for chat prompts when the tokenizer has that token), at a stop string, or
after ``max_new_tokens``. A completion's text is cut before the first stop string; its
``token_ids`` are every generated token (EOS included when it stopped there), ``logprobs``
each token's log-probability under the model before temperature, top-p and top-k.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any, TextIO

from olmax import jsonout
from olmax.chat.codec import TextCodec, find_tokenizer, prompt_record, tokenizer_places
from olmax.chat.template import IM_END
from olmax.config import MAX_TEMPERATURE, ConfigError

DTYPES = ("float32", "bfloat16")
DEFAULT_MAX_NEW_TOKENS = 256


def first_stop(text: str, stops: list[str]) -> int | None:
    """Where the earliest stop string starts in ``text``, or None."""
    hits = [i for s in stops if s and (i := text.find(s)) >= 0]
    return min(hits) if hits else None


def unsafe_tail(text: str, stops: list[str]) -> int:
    """Characters at the end of ``text`` that may be the start of a stop string (held back
    when streaming, so a stop string is never half printed)."""
    n = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), n, -1):
            if text.endswith(s[:k]):
                n = k
                break
    return n


def stop_condition(codec: TextCodec, stops: list[str]) -> Callable[[list[int]], bool] | None:
    """Whether generated ids have reached a stop string (None without stop strings): decodes only a
    tail of the ids, since a stop string ends within the last len(s) characters, each at most 4
    UTF-8 bytes, and every token is at least one byte."""
    if not stops:
        return None
    tail = 4 * max(len(s) for s in stops) + 4
    return lambda ids: first_stop(codec.decode(ids[-tail:]), stops) is not None


def validate_sampling(temperature: float | None, top_p: float | None, top_k: int | None,
                      stops: list[str] | None = None) -> None:
    if temperature is not None and not 0 <= temperature <= MAX_TEMPERATURE:
        raise ValueError(f"--temperature must be a number in 0..{MAX_TEMPERATURE:g} (0 or none: greedy), "
                         f"got {temperature}")
    if stops is not None and any(not s for s in stops):
        raise ValueError("--stop \"\": an empty stop string would match everywhere; give a non-empty one")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"--top-p must be in (0, 1], got {top_p}")
    if (top_p is not None or top_k is not None) and not temperature:
        raise ValueError("--top-p and --top-k apply to sampling: give a --temperature above 0 as well "
                         "(without one, decoding is greedy)")


class Streamer:
    """Writes one completion's text to ``out`` as its tokens arrive: whole characters only, never
    a possible start of a stop string, nothing after one."""

    def __init__(self, codec: TextCodec, stops: list[str], out: TextIO) -> None:
        self.codec, self.stops, self.out = codec, stops, out
        self.ids: list[int] = []
        self.shown = ""

    def _show(self, text: str) -> None:
        if len(text) > len(self.shown) and text.startswith(self.shown):
            self.out.write(text[len(self.shown):])
            self.out.flush()
            self.shown = text

    def on_token(self, index: int, token: int) -> None:
        self.ids.append(int(token))
        text = self.codec.decode(self.ids)
        if text.endswith("\ufffd"):  # a character split across tokens: wait for the rest
            return
        cut = first_stop(text, self.stops)
        self._show(text[:cut] if cut is not None else text[:len(text) - unsafe_tail(text, self.stops)])

    def finish(self, text: str) -> None:
        self._show(text)


class Model:
    """A checkpoint loaded for decoding, with its tokenizer (when one is known), its EOS ids and
    the compiled decoder of each sampling setting used so far (a chat compiles once)."""

    def __init__(self, checkpoint: str, tokenizer: str | None = None, dtype: str | None = None,
                 need_tokenizer: str | None = None) -> None:
        from olmax.checkpoint.load import load_params
        checkpoint = str(checkpoint)
        local = checkpoint[3:] if checkpoint.startswith("hf:") else checkpoint
        if "://" not in local and not Path(local).exists():
            raise ConfigError(f"checkpoint {local} does not exist")
        if dtype is not None and dtype not in DTYPES:
            raise ValueError(f"--dtype {dtype!r}: choose one of {', '.join(DTYPES)}")
        if tokenizer is not None:
            from olmax.chat.codec import tokenizer_file
            tokenizer_file(tokenizer)  # a wrong --tokenizer fails before the weights load
        params, cfg = load_params(checkpoint, dtype=dtype)
        # Decoding: no gradients (no rematerialisation). Parameters and compute in --dtype, by
        # default in the dtype the parameters are stored in (an hf: checkpoint's config says
        # nothing about compute; a training run's bf16 compute would not match its fp32 weights).
        import jax
        dtype = dtype or str(jax.tree.leaves(params)[0].dtype)
        m = replace(cfg.model, remat="none", param_dtype=dtype, compute_dtype=dtype)
        self.cfg = replace(cfg, model=m)
        self.checkpoint = checkpoint
        self.params = params
        tok_path = tokenizer or find_tokenizer(checkpoint, cfg)
        if tok_path is None and need_tokenizer:
            raise ConfigError(f"checkpoint {checkpoint} ships no tokenizer and {need_tokenizer} need one (looked in "
                              f"{tokenizer_places(checkpoint, cfg)}): pass --tokenizer (a tokenizer.json file or a "
                              "folder holding one)")
        self.codec = TextCodec.load(tok_path, cfg) if tok_path is not None else None
        self._decoders: dict[tuple, Any] = {}  # one engine of each kind for every call (sampling is a runtime value)
        self.last_stats: Any = None  # the engine's counters for the last ``generate`` call
        self.last_kv: dict | None = None  # the continuous engine's KV report (``Engine.kv_report``) for that call

    def eos_ids(self, chat: bool) -> tuple[int, ...]:
        ids = [self.cfg.data.eos_token_id]
        if chat and self.codec is not None and (im_end := self.codec.token_id(IM_END)) is not None:
            ids.append(im_end)
        return tuple(dict.fromkeys(ids))

    def chat_stops(self) -> list[str]:
        """``<|im_end|>`` as a stop string when the tokenizer has no such token (a model trained
        without ChatML tokens that learned to write it as text)."""
        return [IM_END] if self.codec is None or self.codec.token_id(IM_END) is None else []

    def check_prompts(self, prompts: list[list[int]], max_new_tokens: int, what: Callable[[int], str]) -> None:
        m = self.cfg.model
        limit = m.max_position_embeddings
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"{what(i)} is empty")
            if len(p) + max_new_tokens > limit:
                raise ValueError(f"{what(i)} has {len(p)} tokens; with --max-new-tokens {max_new_tokens} that is "
                                 f"past the model's {limit} positions (max_position_embeddings)")
            bad = [t for t in p if not 0 <= t < m.vocab_size]
            if bad:
                raise ValueError(f"{what(i)}: token id {bad[0]} is outside the vocabulary (0..{m.vocab_size - 1})")

    def generate(self, prompts: list[list[int]], *, max_new_tokens: int, temperature: float | None = None,
                 top_p: float | None = None, top_k: int | None = None, seed: int = 0, batch_size: int = 8,
                 stops: list[str] = (), chat: bool = False, stream: TextIO | None = None,
                 batching: str = "continuous", prefill_tokens: int | None = None, kv_cache: str = "contiguous",
                 page_size: int = 16, kv_budget: str | None = None) -> list[dict[str, Any]]:
        """One dict per prompt, in prompt order: ``token_ids``, ``text`` (with a tokenizer),
        ``logprobs``, ``finish_reason`` ("stop": EOS or a stop string; "length")."""
        from olmax.engine import (
            Engine,
            EngineStats,
            NonFiniteLogits,
            Sampling,
            call_rows,
            check_kv_cache,
            check_prefill_bound,
            decoder,
            generate,
            parse_budget,
        )
        from olmax.engine.paged import budget_bytes
        check_prefill_bound(batching, prefill_tokens)
        check_kv_cache(batching, kv_cache)
        budget = parse_budget(kv_budget)
        budget = None if budget is None else budget_bytes(budget)
        stops = [s for s in stops if s] + (self.chat_stops() if chat else [])
        if stops and self.codec is None:
            raise ConfigError("stop strings need a tokenizer: pass --tokenizer")
        codec = self.codec
        stopped = stop_condition(codec, stops)
        stop_fn = (lambda i, ids: stopped(ids)) if stopped is not None else None

        streamer = Streamer(codec, stops, stream) if stream is not None and codec is not None else None
        sampling = Sampling(temperature=temperature, top_p=top_p, top_k=top_k, seed=seed)
        kind = (batching, kv_cache, page_size, budget)
        if kind not in self._decoders:
            self._decoders[kind] = decoder(self.params, self.cfg.model, batching,
                                           rows=call_rows(len(prompts), batch_size), kv_cache=kv_cache,
                                           page_size=page_size, kv_budget=budget)
        engine = self._decoders[kind]
        if isinstance(engine, Engine):
            engine.prefill_tokens = prefill_tokens
        before = EngineStats(**vars(engine.stats))
        try:
            out = generate(self.params, self.cfg.model, prompts, max_new_tokens=max_new_tokens, sampling=sampling,
                           eos_ids=self.eos_ids(chat), batch_size=batch_size, stop=stop_fn,
                           on_token=streamer.on_token if streamer else None, generator=engine)
        except NonFiniteLogits as e:  # never an answer (or a NaN log-prob) from a broken model
            raise ValueError(f"checkpoint {self.checkpoint}, prompt {e.prompt + 1}: {e.error}; its weights, or "
                             "their forward, are broken") from None
        self.last_stats = EngineStats(**{k: v - getattr(before, k) for k, v in vars(engine.stats).items()})
        self.last_kv = engine.kv_report() if isinstance(engine, Engine) else None
        results = []
        for c in out:
            r: dict[str, Any] = {"token_ids": [int(t) for t in c.token_ids]}
            if codec is not None:
                text = codec.decode(r["token_ids"])
                cut = first_stop(text, stops)
                r["text"] = text if cut is None else text[:cut]
            r["logprobs"] = [float(x) for x in c.logprobs]
            r["finish_reason"] = c.finish_reason
            results.append(r)
        if streamer is not None:
            streamer.finish(results[0]["text"])
        return results


# --------------------------------------------------------------------------- prompt files


def _lines(path: str, flag: str) -> list[tuple[int, str]]:
    """(1-based line number, text) of the non-blank lines of a file, or of stdin for ``-``;
    errors name ``flag`` (``--prompts``, ``--prompt-ids``) and the file."""
    try:
        if path == "-":
            text = sys.stdin.read()
        else:
            p = Path(path)
            if not p.is_file():
                raise ConfigError(f"prompt file {p} does not exist")
            text = p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        where = "stdin" if path == "-" else path
        raise ConfigError(f"{flag} {where}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    return [(n, line) for n, line in enumerate(text.splitlines(), 1) if line.strip()]


def _json_line(path: str, n: int, line: str) -> Any:
    try:
        return json.loads(line)
    except ValueError as e:
        raise ValueError(f"{path} line {n}: not valid JSON ({e.msg})") from None


def read_prompt_ids(path: str) -> list[list[int]]:
    """``--prompt-ids``: one JSON list of token ids per line."""
    out = []
    for n, line in _lines(path, "--prompt-ids"):
        v = _json_line(path, n, line)
        if not (isinstance(v, list) and v and all(isinstance(t, int) and not isinstance(t, bool) for t in v)):
            raise ValueError(f"{path} line {n}: expected a non-empty JSON list of token ids (integers), "
                             f"got {line.strip()[:60]}")
        out.append(v)
    if not out:
        raise ValueError(f"{path} holds no prompts")
    return out


def read_prompts(path: str) -> list[str | list[dict]]:
    """``--prompts``: one JSON value per line: a string, ``{"prompt": TEXT}`` or
    ``{"messages": [{"role", "content"}, ...]}`` (a conversation, rendered with the chat template)."""
    out: list[str | list[dict]] = []
    for n, line in _lines(path, "--prompts"):
        v = _json_line(path, n, line)
        prompt = v if isinstance(v, str) else prompt_record(v, f"{path} line {n}")
        if prompt is not None:
            out.append(prompt)
        else:
            raise ValueError(f"{path} line {n}: expected a JSON string, {{\"prompt\": TEXT}} or "
                             f"{{\"messages\": [...]}}, got {line.strip()[:60]}")
    if not out:
        raise ValueError(f"{path} holds no prompts")
    return out


# --------------------------------------------------------------------------- the command


def cmd_generate(args: Any, stdout: TextIO | None = None, stderr: TextIO | None = None) -> int:
    stdout, stderr = stdout or sys.stdout, stderr or sys.stderr
    validate_sampling(args.temperature, args.top_p, args.top_k, args.stop)
    if args.prompt_ids is not None and (args.chat or args.system is not None):
        raise ValueError("--chat and --system need text prompts (--prompt or --prompts), not --prompt-ids")
    if args.system is not None and not args.chat:
        raise ValueError("--system applies to chat prompts: add --chat")
    # Parse the prompt files before loading the weights, so a bad line fails fast.
    if args.prompt_ids is not None:
        sources: list[Any] = read_prompt_ids(args.prompt_ids)
    elif args.prompts is not None:
        sources = read_prompts(args.prompts)
    else:
        sources = list(args.prompt)
    need = ("stop strings" if args.stop else None) if args.prompt_ids is not None else \
        "text prompts (--prompt-ids need none)"
    gen = Model(args.checkpoint, args.tokenizer, args.dtype, need_tokenizer=need)
    codec = gen.codec
    chat = args.chat or (args.prompts is not None and any(isinstance(s, list) for s in sources))
    system = [{"role": "system", "content": args.system}] if args.system is not None else []
    if args.prompt_ids is not None:
        prompts = sources
        what = lambda i: f"{args.prompt_ids} prompt {i + 1}"  # noqa: E731
    else:
        prompts = []
        for s in sources:
            if isinstance(s, list):
                ids = codec.encode_chat(s)
            elif args.chat:
                ids = codec.encode_chat(system + [{"role": "user", "content": s}])
            else:
                ids = codec.encode(s)
            # An empty prompt starts a new document: the token between documents (BOS, else EOS).
            prompts.append(ids or [gen.cfg.data.bos_token_id if gen.cfg.data.bos_token_id is not None
                                   else gen.cfg.data.eos_token_id])
        what = lambda i: f"prompt {i + 1}"  # noqa: E731
    max_new = args.max_new_tokens
    if max_new is None:  # the default, or what fits in the model's positions after the longest prompt
        max_new = max(1, min(DEFAULT_MAX_NEW_TOKENS, gen.cfg.model.max_position_embeddings - max(map(len, prompts))))
    gen.check_prompts(prompts, max_new, what)
    if chat:
        print(f"chat template: {codec.template_source}", file=stderr)
    stream = len(prompts) == 1 and not args.json and codec is not None
    t0 = time.perf_counter()
    results = gen.generate(prompts, max_new_tokens=max_new, temperature=args.temperature,
                           top_p=args.top_p, top_k=args.top_k, seed=args.seed, batch_size=args.batch_size,
                           stops=list(args.stop or []), chat=chat, stream=stdout if stream else None,
                           batching=args.batching, prefill_tokens=args.prefill_tokens, kv_cache=args.kv_cache,
                           page_size=args.page_size, kv_budget=args.kv_budget)
    dt = time.perf_counter() - t0
    if args.json:
        for r in results:
            print(jsonout.dumps(r), file=stdout)
    elif stream:
        print(file=stdout)
    else:
        for i, r in enumerate(results):
            body = r["text"] if "text" in r else " ".join(map(str, r["token_ids"]))
            if len(results) > 1:
                print(f"=== {i + 1} ({r['finish_reason']}) ===", file=stdout)
            print(body, file=stdout)
    n = sum(len(r["token_ids"]) for r in results)
    stderr.write(f"generate: {len(results)} prompt(s), {n} new tokens in {dt:.2f} s ({n / max(dt, 1e-9):.1f} "
                 f"tokens/s, compilation included); finish: "
                 f"{', '.join(sorted({r['finish_reason'] for r in results}))}; {args.batching} batching, slot "
                 f"utilisation {gen.last_stats.slot_utilisation:.2f} ({gen.last_stats.decoded} decoded tokens / "
                 f"{gen.last_stats.decode_steps} decode steps x slots)\n")
    if gen.last_kv is not None and args.kv_cache == "paged":
        kv = gen.last_kv
        stderr.write(f"generate: paged KV cache, peak {kv['kv_bytes_peak'] / 2**20:.1f} MiB used of "
                     f"{kv['kv_bytes_reserved'] / 2**20:.1f} MiB reserved (a contiguous cache: "
                     f"{kv['kv_contiguous_bytes'] / 2**20:.1f} MiB for the {kv['sequences_peak']} rows at once), "
                     f"{gen.last_stats.shared_prompt_tokens} prompt tokens from shared pages, "
                     f"{gen.last_stats.preemptions} preemptions\n")
    return 0
