"""The OpenAI HTTP API's JSON, without HTTP: request bodies checked and turned into engine work
(:class:`Job`), completions turned into response objects, stream chunks and error bodies.

Requests follow OpenAI's chat completions and (legacy) completions: ``max_tokens`` /
``max_completion_tokens``, ``temperature``, ``top_p``, ``top_k`` (vLLM's extension; 0 or -1:
off), ``seed``, ``stop``, ``n``, ``logprobs`` (+ ``top_logprobs`` for chat), ``stream`` with
``stream_options.include_usage``. An unknown field, a wrong type, a value out of range, a field
olmax cannot honour (``tools``, ``echo``, a penalty other than 0) is a 400 naming the field: a
client is told, not silently given something else. Defaults are OpenAI's: temperature 1 and top_p
1; chat's ``max_tokens`` up to the context, completions' 16; a sampled request without ``seed``
draws a random one.

A body is UTF-8 JSON; no string in it (a field name or a value, at any depth) may hold a lone UTF-16
surrogate (valid JSON, ``"\ud800"``, but not text: the tokenizer and the UTF-8 encoder refuse it),
and an empty stop string is refused (it would match everywhere). A text prompt that cannot fit the
context is refused from its length before it is tokenized (``ServedModel.chars_per_token``).
"""

from __future__ import annotations

import json
import math
import re
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from olmax.chat.codec import TextCodec
from olmax.chat.template import ROLES, check_messages
from olmax.config import MAX_TEMPERATURE
from olmax.serve.worker import MAX_TOP_LOGPROBS, Completion, Sampling

SEED_MAX = 2**32 - 1          # a uint32 inside the compiled decoder
MAX_N = 64                    # choices per request
MAX_STOPS = 32                # lm-eval's tasks pass more than OpenAI's 4
MAX_COMPLETION_LOGPROBS = 5   # OpenAI's limit for /v1/completions
COMPLETION_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class APIError(Exception):
    """An error answered as OpenAI answers it: ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def __reduce__(self) -> tuple:  # from a parse worker process (``olmax.serve.admission``)
        return _api_error, (self.status, self.message, self.type, self.param, self.code)


def _api_error(status: int, message: str, type: str, param: str | None, code: str | None) -> APIError:
    return APIError(status, message, type=type, param=param, code=code)


def bad(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


@dataclass
class ServedModel:
    """What the protocol needs of the served checkpoint."""
    name: str
    codec: TextCodec | None          # None: token-id prompts only, answered with their token ids
    max_length: int                  # prompt + completion tokens per request (the engine's cache)
    vocab_size: int
    eos_ids: tuple[int, ...]         # completions stop at these
    chat_eos_ids: tuple[int, ...]    # chats also at <|im_end|>
    chat_stops: tuple[str, ...]      # <|im_end|> as text where the tokenizer has no such token
    blank_id: int                    # an empty text prompt: BOS, else EOS (as ``olmax generate``)
    created: int = field(default_factory=lambda: int(time.time()))
    checkpoint: str = ""             # as given to --checkpoint (errors about the weights name it)
    chars_per_token: int | None = None  # ``chars_per_token(codec.tokenizer)``; None: no check by length

    def __post_init__(self) -> None:
        if self.codec is not None and self.chars_per_token is None:
            self.chars_per_token = chars_per_token(self.codec.tokenizer)

    @classmethod
    def from_model(cls, model: Any, name: str, max_length: int) -> ServedModel:
        """From ``olmax.infer.run.Model`` (the checkpoint as ``olmax generate`` loads it)."""
        data = model.cfg.data
        return cls(name=name, codec=model.codec, max_length=max_length, vocab_size=model.cfg.model.vocab_size,
                   eos_ids=model.eos_ids(False), chat_eos_ids=model.eos_ids(True),
                   chat_stops=tuple(model.chat_stops()),
                   blank_id=data.bos_token_id if data.bos_token_id is not None else data.eos_token_id,
                   checkpoint=model.checkpoint)

    def tokens_at_least(self, *texts: str) -> int:
        """A lower bound on the tokens ``texts`` encode to together, from their lengths alone (0
        where the tokenizer allows none; whitespace at either end not counted, which a chat
        template may trim): a prompt that cannot fit is refused before it is tokenized."""
        if self.chars_per_token is None:
            return 0
        return -(-sum(len(t.strip()) for t in texts) // self.chars_per_token)

    def card(self) -> dict:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "olmax",
                "max_model_len": self.max_length}


# Normalisers that never turn more than this many characters into one: a canonical composition
# joins at most 4 code points (a Greek vowel with three marks), Lowercase maps one to one or more,
# decompositions and Prepend only lengthen. Others (Strip, Replace, StripAccents, a compiled
# SentencePiece map) may delete any amount of text.
_NORMALISER_SHRINK = {"NFC": 4, "NFKC": 4, "NFD": 1, "NFKD": 1, "Lowercase": 1, "Prepend": 1}


def chars_per_token(tokenizer: Any) -> int | None:
    """The most characters of text one token can stand for, where a bound is known: a byte-level
    BPE (every byte reaches some token: the byte alphabet is in the vocabulary, no added token
    swallows the whitespace beside it) covers at most as many bytes as its longest token, and
    a character is at least a byte, times what the normaliser can shrink. None for any other
    tokenizer: its prompts are only bounded by tokenizing them (in a worker, under the deadline)."""
    try:
        spec = json.loads(tokenizer.to_str())
        from tokenizers import pre_tokenizers
    except (ValueError, AttributeError, ImportError):
        return None

    def parts(node: Any) -> list[dict]:
        if not node:
            return []
        return [q for n in node.get("pretokenizers", node.get("normalizers", [])) for q in parts(n)] \
            if node.get("type") == "Sequence" else [node]

    shrink = 1
    for n in parts(spec.get("normalizer")):
        if n.get("type") not in _NORMALISER_SHRINK:
            return None
        shrink *= _NORMALISER_SHRINK[n["type"]]
    pre = parts(spec.get("pre_tokenizer"))
    keeps = {"ByteLevel", "Digits", "Punctuation"}
    if not any(q.get("type") == "ByteLevel" for q in pre) or any(
            q.get("type") not in keeps and not (q.get("type") == "Split" and q.get("behavior") != "Removed")
            for q in pre):
        return None
    vocab = tokenizer.get_vocab(with_added_tokens=False)
    added = tokenizer.get_added_tokens_decoder().values()
    if spec.get("model", {}).get("type") != "BPE" or any(a.lstrip or a.rstrip for a in added) \
            or not set(pre_tokenizers.ByteLevel.alphabet()) <= set(vocab):
        return None
    longest = max([len(t) for t in vocab] + [len(a.content.encode("utf-8")) for a in added])
    return shrink * max(longest, 1)


@dataclass
class Job:
    """One HTTP request's engine work: ``n`` choices of each prompt (choice ``i * n + j`` is prompt
    ``i``, sample ``j``)."""
    chat: bool
    prompts: list[list[int]]
    n: int
    max_tokens: int
    sampling: Sampling
    eos_ids: tuple[int, ...]
    stops: list[str]
    logprobs: bool
    top_logprobs: int
    stream: bool
    include_usage: bool

    @property
    def choices(self) -> int:
        return len(self.prompts) * self.n

    def prompt_of(self, choice: int) -> list[int]:
        return self.prompts[choice // self.n]

    def prompt_tokens(self) -> int:
        return sum(map(len, self.prompts))


# --------------------------------------------------------------------------- field checks


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(body: dict, key: str, lo: int, hi: int | None = None) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if not _is_int(v) or v < lo or (hi is not None and v > hi):
        rng = f"{lo}..{hi}" if hi is not None else f">= {lo}"
        raise bad(f"'{key}' must be an integer {rng}, got {_show(v)}", key)
    return v


def _num(body: dict, key: str, lo: float, hi: float, lo_open: bool = False) -> float | None:
    v = body.get(key)
    if v is None:
        return None
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v <= hi \
        and (v > lo if lo_open else v >= lo)
    if not ok:
        raise bad(f"'{key}' must be a number in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {_show(v)}", key)
    return float(v)


def _bool(body: dict, key: str, default: bool = False) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"'{key}' must be true or false, got {_show(v)}", key)
    return v


def _show(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 60 else s[:57] + "..."


def shown(text: str, limit: int = 60) -> str:
    """Client text as a message or log line shows it: control characters (a newline that would
    forge a log line) and surrogates escaped, long text cut."""
    if not text.isprintable():
        text = text.encode("unicode_escape", "backslashreplace").decode("ascii")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def _neutral(body: dict, key: str, ok: Callable[[Any], bool], what: str) -> None:
    """A field olmax accepts only at its no-op value."""
    if key in body and body[key] is not None and not ok(body[key]):
        raise bad(f"'{key}' is not supported by olmax serve except as {what}", key)


# Fields of each endpoint: those checked below, and those accepted at their no-op value only.
_COMMON = {"model", "max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "n", "logprobs", "stream",
           "stream_options", "user", "frequency_penalty", "presence_penalty", "logit_bias"}
CHAT_FIELDS = _COMMON | {"messages", "max_completion_tokens", "top_logprobs", "response_format", "metadata", "store",
                         "service_tier", "parallel_tool_calls", "tools", "tool_choice"}
COMPLETION_FIELDS = _COMMON | {"prompt", "echo", "suffix", "best_of"}


def _check_fields(body: dict, known: set[str]) -> None:
    unknown = sorted(k for k in body if k not in known)
    if unknown:
        raise bad(f"Unrecognized request argument supplied: {shown(unknown[0])}", unknown[0])
    for key in ("frequency_penalty", "presence_penalty"):
        _neutral(body, key, lambda v: _is_num(v) and v == 0, "0")
    _neutral(body, "logit_bias", lambda v: v == {}, "{}")
    if "user" in body and body["user"] is not None and not isinstance(body["user"], str):
        raise bad(f"'user' must be a string, got {_show(body['user'])}", "user")


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def check_model(body: dict, served: ServedModel) -> None:
    """404 for another model's name (a missing ``model`` means the one served)."""
    name = body.get("model")
    if name is None:
        return
    if not isinstance(name, str):
        raise bad(f"'model' must be a string, got {_show(name)}", "model")
    if name != served.name:
        raise APIError(404, f"The model '{shown(name, 200)}' does not exist; this server serves '{served.name}'",
                       param="model", code="model_not_found")


def _stops(body: dict) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    v = [v] if isinstance(v, str) else v
    if not (isinstance(v, list) and all(isinstance(s, str) for s in v)):
        raise bad(f"'stop' must be a string or a list of strings, got {_show(body['stop'])}", "stop")
    if len(v) > MAX_STOPS:
        raise bad(f"'stop' holds {len(v)} strings; at most {MAX_STOPS}", "stop")
    if not all(v):
        where = "'stop' is" if isinstance(body["stop"], str) else f"'stop' entry {v.index('')} is"
        raise bad(f"{where} an empty string, which would match everywhere: give non-empty stop strings", "stop")
    return v


def _sampling(body: dict) -> Sampling:
    # OpenAI takes 0..2; olmax takes the bound its command line and RL take (a superset).
    temperature = _num(body, "temperature", 0.0, MAX_TEMPERATURE)
    top_p = _num(body, "top_p", 0.0, 1.0, lo_open=True)
    top_k = body.get("top_k")
    if top_k is not None and not (_is_int(top_k) and (top_k >= 1 or top_k in (0, -1))):
        raise bad(f"'top_k' must be an integer >= 1 (0 or -1: off), got {_show(top_k)}", "top_k")
    seed = _int(body, "seed", 0, SEED_MAX)
    temperature = 1.0 if temperature is None else temperature
    if temperature == 0:  # greedy: top_p and top_k change nothing (clients send top_p=1 with temperature=0)
        return Sampling(temperature=None, seed=0)
    return Sampling(temperature=temperature, top_p=None if top_p in (None, 1.0) else top_p,
                    top_k=top_k if top_k and top_k > 0 else None,
                    seed=secrets.randbelow(SEED_MAX + 1) if seed is None else seed)


def _stream(body: dict) -> tuple[bool, bool]:
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is None:
        return stream, False
    if not stream:
        raise bad("'stream_options' applies only when 'stream' is true", "stream_options")
    if not isinstance(opts, dict) or set(opts) - {"include_usage", "continuous_usage_stats"}:
        raise bad(f"'stream_options' must be an object with 'include_usage', got {_show(opts)}", "stream_options")
    return stream, _bool(opts, "include_usage")


def _max_tokens(body: dict, served: ServedModel, prompts: list[list[int]], default: int | None, param: str,
                at_least: int | None = None) -> int:
    """The completion's token budget, or 400 ``context_length_exceeded`` where the longest prompt
    and it do not fit. ``at_least``: instead of the prompts, a lower bound on the longest prompt's
    tokens (from its length, before tokenizing: ``ServedModel.tokens_at_least``)."""
    given = _int(body, "max_completion_tokens", 1) if "max_completion_tokens" in body else None
    if given is None:
        given = _int(body, "max_tokens", 1)
    longest = max(map(len, prompts)) if at_least is None else at_least
    room = served.max_length - longest
    want = given if given is not None else (default if default is not None else max(room, 1))
    if longest >= served.max_length or want > room:
        if at_least is not None:
            asked = f"at least {longest} tokens in the {param} (told from its length)" + \
                (f" and {want} in the completion" if given is not None or default is not None else "")
        elif given is not None or default is not None:
            asked = f"{longest + want} tokens ({longest} in the {param}, {want} in the completion)"
        else:
            asked = f"{longest} tokens in the {param}"
        raise bad(f"This model's maximum context length is {served.max_length} tokens. However, you requested "
                  f"{asked}. Please reduce the length of the {param} or completion.", param, "context_length_exceeded")
    return want


# --------------------------------------------------------------------------- the body


# A JSON escape of a UTF-16 surrogate: only then can a string of a UTF-8 body hold a lone one.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def read_body(raw: bytes) -> Any:
    """A request body: UTF-8 JSON (a BOM allowed) whose strings are text (``check_text``)."""
    try:
        text = raw.decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise bad(f"the request body is not UTF-8 text (byte {e.start}: {e.reason})") from None
    try:
        body = json.loads(text)
    except (ValueError, RecursionError) as e:
        raise bad(f"We could not parse the JSON body of your request ({type(e).__name__}: "
                  f"{str(e)[:80]})") from None
    if _SURROGATE_ESCAPE.search(raw):
        check_text(body)
    return body


def check_text(value: Any, path: str = "") -> None:
    """400 naming the field where a string (a value or a field name, at any depth) holds a lone
    UTF-16 surrogate: JSON's ``"\\ud800"`` escape parses, but no tokenizer or UTF-8 encoder takes it."""
    stack = [(value, path)]
    while stack:
        v, at = stack.pop()
        if isinstance(v, str):
            i = _lone_surrogate(v)
            if i is not None:
                _refuse_surrogate(at, f"'{at}' holds one ({shown(v[i])} at character {i})")
        elif isinstance(v, dict):
            for k, x in v.items():
                where = f"{at}.{shown(k)}" if at else shown(k)
                if _lone_surrogate(k) is not None:
                    _refuse_surrogate(where, f"the field name {where} holds one")
                stack.append((x, where))
        elif isinstance(v, list):
            stack.extend((x, f"{at}[{j}]") for j, x in enumerate(v) if isinstance(x, (str, dict, list)))


def _lone_surrogate(s: str) -> int | None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        return e.start
    return None


def _refuse_surrogate(at: str, what: str) -> None:
    raise bad(f"A string of the request is not valid Unicode: {what}, a lone UTF-16 surrogate (an escape such as "
              "\\ud83d is only valid as the first half of a pair)", re.split(r"[.\[]", at, maxsplit=1)[0] or None)


# --------------------------------------------------------------------------- requests


def _text(content: Any, j: int) -> Any:
    """A message's content: a string, or OpenAI's list of ``{"type": "text", "text"}`` parts joined."""
    if isinstance(content, list):
        if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                   for p in content):
            raise bad(f"message {j}: content parts must be {{\"type\": \"text\", \"text\": ...}} (olmax serves "
                      "text only)", "messages")
        return "".join(p["text"] for p in content)
    return content


def parse_chat(body: Any, served: ServedModel) -> Job:
    body = _object(body)
    _check_fields(body, CHAT_FIELDS)
    check_model(body, served)
    _neutral(body, "tools", lambda v: v == [], "[]")
    _neutral(body, "tool_choice", lambda v: v == "none", "\"none\"")
    _neutral(body, "response_format", lambda v: v == {"type": "text"}, "{\"type\": \"text\"}")
    if served.codec is None:
        raise bad("this checkpoint has no tokenizer: chat needs one (serve it with --tokenizer)", "messages")
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise bad("'messages' must be a non-empty list of {\"role\", \"content\"} objects", "messages")
    conv = []
    for j, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise bad(f"message {j} must be an object with 'role' and 'content'", "messages")
        extra = sorted(set(m) - {"role", "content", "name"})
        if extra:
            raise bad(f"message {j}: unsupported field '{extra[0]}'", "messages")
        role = "system" if m.get("role") == "developer" else m.get("role")
        conv.append({"role": role, "content": _text(m.get("content"), j)})
    try:
        conv = check_messages(conv, "request")
    except ValueError as e:
        raise bad(str(e).removeprefix("request: ") + f" (roles: {', '.join(ROLES)}, developer)", "messages") from None
    # Before rendering and tokenizing: messages that cannot fit, told from their length.
    _max_tokens(body, served, [], None, "messages", at_least=served.tokens_at_least(*(m["content"] for m in conv)))
    try:
        prompt = served.codec.encode_chat(conv)
    except ValueError as e:  # the checkpoint's jinja template raised (ConfigError names it)
        raise bad(f"the chat template cannot render these messages: {e}", "messages") from None
    logprobs = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", 0, MAX_TOP_LOGPROBS) or 0
    if top and not logprobs:
        raise bad("'top_logprobs' needs 'logprobs': true", "top_logprobs")
    stream, usage = _stream(body)
    prompts = [prompt]
    return Job(chat=True, prompts=prompts, n=_int(body, "n", 1, MAX_N) or 1,
               max_tokens=_max_tokens(body, served, prompts, None, "messages"), sampling=_sampling(body),
               eos_ids=served.chat_eos_ids, stops=_stops(body) + list(served.chat_stops), logprobs=logprobs,
               top_logprobs=top, stream=stream, include_usage=usage)


def _prompts(v: Any, served: ServedModel, body: dict) -> list[list[int]]:
    """``prompt``: a string, a list of strings, a list of token ids, or a list of such lists."""
    def ids(p: list, where: str) -> list[int]:
        if not p:
            raise bad(f"{where} is empty", "prompt")
        badid = next((t for t in p if not (_is_int(t) and 0 <= t < served.vocab_size)), None)
        if badid is not None:
            raise bad(f"{where}: token id {_show(badid)} is not an integer in 0..{served.vocab_size - 1}", "prompt")
        return list(p)

    def text(s: str) -> list[int]:
        return served.codec.encode(s) or [served.blank_id]

    if isinstance(v, str):
        v = [v]
    if isinstance(v, list) and v:
        if all(isinstance(s, str) for s in v):
            if served.codec is None:
                raise bad("this checkpoint has no tokenizer: give the prompt as token ids", "prompt")
            # Before tokenizing: a prompt that cannot fit, told from its length.
            _max_tokens(body, served, [], COMPLETION_DEFAULT_MAX_TOKENS, "prompt",
                        at_least=max(served.tokens_at_least(s) for s in v))
            return [text(s) for s in v]
        if all(_is_int(t) for t in v):
            return [ids(v, "prompt")]
        if all(isinstance(p, list) for p in v):
            return [ids(p, f"prompt {i}") for i, p in enumerate(v)]
    raise bad("'prompt' must be a string, a list of strings, a list of token ids or a list of such lists, got "
              f"{_show(v)}", "prompt")


def parse_completion(body: Any, served: ServedModel) -> Job:
    body = _object(body)
    _check_fields(body, COMPLETION_FIELDS)
    check_model(body, served)
    _neutral(body, "echo", lambda v: v is False, "false")
    _neutral(body, "suffix", lambda v: v == "", "\"\"")
    if "prompt" not in body:
        raise bad("'prompt' is required", "prompt")
    n = _int(body, "n", 1, MAX_N) or 1
    _neutral(body, "best_of", lambda v: v == n, "equal to n")
    prompts = _prompts(body["prompt"], served, body)
    if len(prompts) * n > MAX_N * 4:
        raise bad(f"{len(prompts)} prompts x n={n} is more than {MAX_N * 4} choices in one request", "prompt")
    top = _int(body, "logprobs", 0, MAX_COMPLETION_LOGPROBS)
    stream, usage = _stream(body)
    stops = _stops(body)
    if stops and served.codec is None:
        raise bad("stop strings need a tokenizer, and this checkpoint has none", "stop")
    return Job(chat=False, prompts=prompts, n=n,
               max_tokens=_max_tokens(body, served, prompts, COMPLETION_DEFAULT_MAX_TOKENS, "prompt"),
               sampling=_sampling(body), eos_ids=served.eos_ids, stops=stops, logprobs=top is not None,
               top_logprobs=top or 0, stream=stream, include_usage=usage)


def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise bad(f"the request body must be a JSON object, got {type(body).__name__}")
    return body


# --------------------------------------------------------------------------- responses


def token_text(codec: TextCodec | None, tid: int) -> str:
    """A token as the logprobs name it: its text (special tokens by their name), or its id."""
    if codec is None:
        return str(tid)
    return codec.decode([tid]) or codec.tokenizer.id_to_token(tid) or ""


def _lp(x: float) -> float:
    """A log-probability JSON can carry: -inf (a token the model rules out) as -9999.0, as vLLM does."""
    x = float(x)
    return x if math.isfinite(x) else -9999.0


def chat_logprobs(codec: TextCodec | None, ids: list[int], lps: list[float],
                  tops: list[list[tuple[int, float]]] | None) -> dict:
    def entry(tid: int, lp: float) -> dict:
        t = token_text(codec, tid)
        return {"token": t, "logprob": _lp(lp), "bytes": list(t.encode("utf-8"))}

    return {"content": [{**entry(t, lp), "top_logprobs": [entry(a, b) for a, b in (tops[i] if tops else [])]}
                        for i, (t, lp) in enumerate(zip(ids, lps))]}


def completion_logprobs(codec: TextCodec | None, ids: list[int], lps: list[float],
                        tops: list[list[tuple[int, float]]] | None, offset: int = 0) -> dict:
    tokens = [token_text(codec, t) for t in ids]
    offsets, at = [], offset
    for t in tokens:
        offsets.append(at)
        at += len(t)
    return {"tokens": tokens, "token_logprobs": [_lp(x) for x in lps], "text_offset": offsets,
            "top_logprobs": [{token_text(codec, a): _lp(b) for a, b in tops[i]} if tops else {}
                             for i in range(len(ids))]}


def usage(job: Job, completion_tokens: int) -> dict:
    p = job.prompt_tokens()
    return {"prompt_tokens": p, "completion_tokens": completion_tokens, "total_tokens": p + completion_tokens}


@dataclass
class Choice:
    """A finished choice: its text (cut before a stop string) and the engine's completion."""
    text: str
    completion: Completion


def response(job: Job, rid: str, served: ServedModel, choices: list[Choice]) -> dict:
    out = []
    for i, c in enumerate(choices):
        comp = c.completion
        tops = comp.top_logprobs
        if job.chat:
            lp = chat_logprobs(served.codec, comp.token_ids, comp.logprobs, tops) if job.logprobs else None
            out.append({"index": i, "message": {"role": "assistant", "content": c.text}, "logprobs": lp,
                        "finish_reason": comp.finish_reason})
        else:
            lp = completion_logprobs(served.codec, comp.token_ids, comp.logprobs, tops) if job.logprobs else None
            out.append({"index": i, "text": c.text, "logprobs": lp, "finish_reason": comp.finish_reason})
            if served.codec is None:  # token ids in, token ids out
                out[-1]["token_ids"] = list(comp.token_ids)
    return {"id": rid, "object": "chat.completion" if job.chat else "text_completion", "created": int(time.time()),
            "model": served.name, "choices": out,
            "usage": usage(job, sum(len(c.completion.token_ids) for c in choices))}


def chunk(job: Job, rid: str, served: ServedModel, created: int, choices: list[dict],
          use: dict | None = None) -> dict:
    out = {"id": rid, "object": "chat.completion.chunk" if job.chat else "text_completion", "created": created,
           "model": served.name, "choices": choices}
    if job.include_usage:
        out["usage"] = use
    return out


def chunk_choice(job: Job, served: ServedModel, index: int, text: str | None, ids: list[int], lps: list[float],
                 finish: str | None, first: bool = False, logprobs: bool = True) -> dict:
    """One choice of a stream chunk: new text (without a tokenizer: the new token ids), the
    logprobs of the tokens that arrived with it unless ``logprobs`` is False (top logprobs are not
    streamed: the engine reports them when a request finishes), a finish."""
    lp = None
    if job.logprobs and logprobs and ids:
        lp = (chat_logprobs if job.chat else completion_logprobs)(served.codec, ids, lps, None)
    if job.chat:
        delta: dict = {"role": "assistant", "content": ""} if first else {}
        if text:
            delta["content"] = text
        return {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
    out = {"index": index, "text": text or "", "logprobs": lp, "finish_reason": finish}
    if served.codec is None:
        out["token_ids"] = list(ids)
    return out
