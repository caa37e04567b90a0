"""Chat conversations -> token ids + label masks for SFT, and chosen/rejected pairs for DPO.

The label rule is open-instruct's (``dataset_transformation.py``, SFT tokenization with masking,
whose output ``scripts/data/convert_sft_data_for_olmocore.py`` writes for OLMo-core):

- the conversation is rendered through the chat template and encoded *once* with the
  ``tokenizers`` library on ``tokenizer.json`` (``add_special_tokens=False``; never transformers,
  which mis-tokenizes Dolma 2), so the ids are exactly the encoding of the rendered text;
- a token is trained (mask True) where it overlaps an assistant turn's *trainable span*: from
  the end of the prompt rendered with ``add_generation_prompt=True`` for the messages before
  that turn (so the header ``<|im_start|>assistant\\n`` is masked) to the end of the turn,
  i.e. its content, its ``<function_calls>`` and its terminator: ``<|im_end|>\\n``, or EOS after
  the final turn;
- everything else is masked (False): the system turn (default or given, with the tools), user
  and environment/tool turns, and every assistant header.

Spans are found by rendering message prefixes through the template. OLMo 3's templates are not
prefix-stable: a turn rendered last ends with EOS, the same turn followed by more messages ends
with ``<|im_end|>\\n``. That one difference is recognised (the prefix render minus its final EOS
must be a prefix of the full render, followed there by ``<|im_end|>``); any other mismatch is an
error rather than a guess. (open-instruct until its PR #1746, July 2026, hence for OLMo 3's
SFT data, counted the tokens of prefix renders instead, masking each non-assistant message from
the token count of the messages before it: with these templates that trains ``<|im_end|>`` and
masks the ``\\n`` after it. We train both by default, as the OLMo 3 recipe describes the
terminator (``<|im_end|>\\n`` ends the turn it trains); ``labels="open-instruct-counts"``
(``--labels``) reproduces the token-count rule.)

Think (``<think>``): a generation prompt that ends with ``<think>`` (the Think template's
``<|im_start|>assistant\\n<think>``) has that tag cut off the masked header, so a ``<think>`` that
opens the assistant's content is trained. ``<think>`` is several tokens in Dolma 2, and masking it
as prompt taught the model never to open its reasoning (open-instruct issue #1869, ``docs/olmo3.md``:
AI2 worked around it by tokenizing Think SFT data without ``<think>`` in the generation prompt;
this gives the same labels whichever Think template is used).

Every conversation must end with an assistant turn, so it ends with exactly one EOS (OLMo-core
finds documents by EOS). ``max_length`` keeps the first N tokens, as open-instruct's converter
does (the EOS of a truncated conversation is lost: its boundaries are in the ``.csv.gz`` files);
a conversation left without trained tokens is dropped, as ``sft_tulu_filter_v1`` does.

Output (``olmax tokenize --chat``), open-instruct's converter layout, which OLMo-core's
``NumpyFSLDataset`` / ``NumpyPackedFSLDataset`` read with ``label_mask_paths``:
``token_ids_part_NNNN.npy`` (headerless little-endian array, the smallest unsigned dtype holding
the vocabulary), ``labels_mask_part_NNNN.npy`` (headerless ``bool``, one byte a token, same
boundaries), ``token_ids_part_NNNN.csv.gz`` (``start,end`` of each conversation in that part), at
most 1 GiB of token ids a part (a conversation may cross parts, as in open-instruct), plus
``manifest.json`` and ``tokenizer.json``. Conversations keep their input order (open-instruct
shuffles with seed 42 first; OLMo-core shuffles instances anyway).

Preference pairs (``--preference``): ``pairs_token_ids.npy`` (uint32), ``pairs_labels_mask.npy``
(bool), each pair's chosen then rejected sequence, both encoded exactly like an SFT conversation,
and ``pairs_index.npy`` (int64 ``[n, 4]``: chosen offset, chosen length, rejected offset, rejected
length), all ``np.save`` files; :func:`read_pairs` reads and checks them, :func:`write_pairs` writes
tokenized pairs.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import os
import shutil
import sys
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from olmax.chat.template import IM_END, ROLES, THINK_OPEN, ChatTemplate, load_template
from olmax.data import DataError

SFT_FORMAT = "olmax-chat/1"
PAIRS_FORMAT = "olmax-pairs/1"
MANIFEST = "manifest.json"
TOKEN_IDS = "token_ids_part_{:04d}.npy"
LABELS_MASK = "labels_mask_part_{:04d}.npy"
DOC_BOUNDS = "token_ids_part_{:04d}.csv.gz"
PAIRS_TOKEN_IDS, PAIRS_LABELS_MASK, PAIRS_INDEX = "pairs_token_ids.npy", "pairs_labels_mask.npy", "pairs_index.npy"
PART_BYTES = 1 << 30   # open-instruct's converter: at most 1 GiB of token ids a part
LABEL_RULES = {
    "turns": ("trained: each assistant turn from the end of the prompt rendered with add_generation_prompt=True "
              "(a trailing <think> excluded) to the end of the turn (content, function calls, <|im_end|>\\n or the "
              "final EOS); masked: system/user/environment/tool turns and assistant headers"),
    "open-instruct-counts": ("masked: each non-assistant message from the token count of the messages before it "
                             "(rendered alone) to the token count through it (with add_generation_prompt=True when "
                             "an assistant turn follows, a trailing <think> excluded); trained: the rest"),
}
_CHUNK_LINES, _CHUNK_CHARS = 512, 1 << 22


class ChatError(DataError):
    """A conversation that cannot be encoded; the message says why (callers add file:line)."""


# --------------------------------------------------------------------------- conversations


def _calls(m: dict) -> bool:
    return bool(m.get("function_calls") or m.get("tool_calls"))


def check_conversation(messages: Any, tools: Any = None) -> tuple[list[dict], Any]:
    """A conversation's messages and tools, checked; raises :class:`ChatError` saying what is wrong."""
    if not isinstance(messages, list):
        raise ChatError(f"\"messages\" must be a list of {{\"role\", \"content\"}} objects, got "
                        f"{type(messages).__name__}")
    if not messages:
        raise ChatError("\"messages\" is empty")
    out = []
    for j, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ChatError(f"message {j} must be an object with a string \"role\"")
        if m["role"] not in ROLES:
            raise ChatError(f"message {j} has role {m['role']!r}; use one of {', '.join(ROLES)}")
        content = m.get("content")
        if content is not None and not isinstance(content, str):
            raise ChatError(f"message {j} ({m['role']}): \"content\" must be a string")
        if m["role"] == "assistant":
            if not (content or "").strip() and not _calls(m):
                raise ChatError(f"message {j} is an empty assistant turn")
        elif content is None:
            raise ChatError(f"message {j} ({m['role']}) has no string \"content\"")
        out.append(dict(m))
    if not any(m["role"] == "assistant" for m in out):
        raise ChatError("no assistant turn (nothing to train on)")
    if out[-1]["role"] != "assistant":
        raise ChatError(f"the last message is a {out[-1]['role']} turn; a conversation must end with an "
                        f"assistant turn (its EOS ends the document)")
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise ChatError(f"\"tools\" is a string but not JSON ({e.msg})") from None
    if tools is not None and not isinstance(tools, list):
        raise ChatError(f"\"tools\" must be a list of tool definitions, got {type(tools).__name__}")
    return out, tools or None


def assistant_spans(messages: list[dict], template: ChatTemplate, tools: Any = None
                    ) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans trained in it (see the module doc)."""
    full = template.render(messages, False, tools)
    eos = template.eos_token
    spans: list[tuple[int, int]] = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        head = template.render(messages[:i], True, tools)
        if head.endswith(THINK_OPEN):
            head = head[:-len(THINK_OPEN)]  # train on <think> (open-instruct #1869)
        if not full.startswith(head):
            raise ChatError(f"the chat template is not prefix-stable: the prompt before message {i} "
                            f"(add_generation_prompt=True) is not a prefix of the whole conversation")
        through = template.render(messages[:i + 1], False, tools)
        if full.startswith(through):
            end = len(through)
        elif through.endswith(eos) and full.startswith(through[:-len(eos)]) \
                and full.startswith(IM_END, len(through) - len(eos)):
            # the turn is rendered last (EOS) in the prefix and followed (<|im_end|>\n) in the whole
            end = len(through) - len(eos) + len(IM_END)
            end += full.startswith("\n", end)
        else:
            raise ChatError(f"the chat template is not prefix-stable: message {i} rendered last is not a "
                            f"prefix of the whole conversation (beyond an EOS in place of {IM_END})")
        if end <= len(head) or (spans and len(head) < spans[-1][1]):
            raise ChatError(f"message {i}: the assistant turn's span is empty or overlaps the previous one")
        spans.append((len(head), end))
    return full, spans


class ChatTokenizer:
    """A ``tokenizers.Tokenizer`` for chat encoding: ids exactly as ``encode(text,
    add_special_tokens=False)``, with character offsets the post-processor has not trimmed."""

    def __init__(self, tokenizer: Any, eos_token_id: int | None = None):
        from tokenizers import Tokenizer
        if isinstance(tokenizer, (str, Path)):
            tokenizer = Tokenizer.from_file(str(tokenizer))
        self.json = tokenizer.to_str()
        self.tok = Tokenizer.from_str(self.json)
        self.tok.post_processor = None  # ByteLevel(trim_offsets) would shrink whitespace tokens' offsets
        if eos_token_id is None:
            from olmax.data.tokenize import _find_eos
            eos_token_id = _find_eos(self.tok, None)
        self.eos_id = int(eos_token_id)
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)

    def encode_spans(self, text: str, spans: list[tuple[int, int]]) -> tuple[np.ndarray, np.ndarray]:
        enc = self.tok.encode(text, add_special_tokens=False)
        ids = np.asarray(enc.ids, dtype=np.int64)
        off = np.asarray(enc.offsets, dtype=np.int64).reshape(-1, 2)
        if not spans:
            return ids, np.zeros(len(ids), dtype=bool)
        s = np.asarray(spans, dtype=np.int64)
        # a token is trained where it overlaps a span (a token straddling the header's end and
        # the content's start, e.g. merged whitespace, is trained; as open-instruct does)
        j = np.searchsorted(s[:, 1], off[:, 0], side="right")  # first span ending after the token starts
        jj = np.minimum(j, len(s) - 1)
        mask = (j < len(s)) & (s[jj, 0] < off[:, 1]) & (off[:, 1] > off[:, 0])
        return ids, mask


_TOKENIZERS: dict[Any, tuple[Any, ChatTokenizer]] = {}


def _chat_tokenizer(tokenizer: Any, eos_token_id: int | None) -> ChatTokenizer:
    if isinstance(tokenizer, ChatTokenizer):
        return tokenizer
    key: Any = str(tokenizer) if isinstance(tokenizer, (str, Path)) else id(tokenizer)
    hit = _TOKENIZERS.get(key)
    if (hit is None or (hit[0] is not tokenizer and not isinstance(key, str))
            or (eos_token_id is not None and hit[1].eos_id != eos_token_id)):
        if len(_TOKENIZERS) > 8:
            _TOKENIZERS.clear()
        hit = _TOKENIZERS[key] = (tokenizer, ChatTokenizer(tokenizer, eos_token_id))
    return hit[1]


def _count_mask(messages: list[dict], template: ChatTemplate, tools: Any, tok: ChatTokenizer, n: int
                ) -> np.ndarray:
    """open-instruct's token-count rule (see the module doc): start everything trained, mask each
    non-assistant message between token counts of prefix renders."""

    def count(text: str) -> int:
        return len(tok.tok.encode(text, add_special_tokens=False).ids)
    mask = np.ones(n, dtype=bool)
    for j, m in enumerate(messages):
        if m["role"] == "assistant":
            continue
        start = 0 if j == 0 else count(template.render(messages[:j], False, tools))
        header = j + 1 < len(messages) and messages[j + 1]["role"] == "assistant"
        through = template.render(messages[:j + 1], header, tools)
        if header and through.endswith(THINK_OPEN):
            through = through[:-len(THINK_OPEN)]
        mask[start:count(through)] = False
    return mask


def _encode_full(messages: Any, tools: Any, tok: ChatTokenizer, template: ChatTemplate, labels: str = "turns"
                 ) -> tuple[np.ndarray, np.ndarray]:
    if labels not in LABEL_RULES:
        raise DataError(f"labels {labels!r}: use one of {', '.join(LABEL_RULES)}")
    messages, tools = check_conversation(messages, tools)
    text, spans = assistant_spans(messages, template, tools)
    ids, mask = tok.encode_spans(text, spans)
    if labels == "open-instruct-counts":
        mask = _count_mask(messages, template, tools, tok, len(ids))
    n_eos = int((ids == tok.eos_id).sum())
    if n_eos != 1 or ids[-1] != tok.eos_id:
        raise ChatError(f"the conversation must render to exactly one EOS (id {tok.eos_id}) at its end, got "
                        f"{n_eos}{'' if n_eos == 0 or ids[-1] == tok.eos_id else ' not at the end'} (EOS text "
                        f"{template.eos_token!r} in a message, or a template that does not end with EOS)")
    return ids, mask


def encode_conversation(messages: list[dict], tokenizer: Any, template: str | ChatTemplate = "olmo3",
                        tools: Any = None, *, eos_token_id: int | None = None, max_length: int | None = None,
                        labels: str = "turns") -> tuple[np.ndarray, np.ndarray]:
    """``(ids int64[n], label_mask bool[n])`` of one conversation.

    ``tokenizer``: a ``tokenizers.Tokenizer``, a ``tokenizer.json`` path or a :class:`ChatTokenizer`;
    ``template``: ``olmo3``, ``olmo3-think``, ``tokenizer``, a template folder / ``.jinja`` file, or
    a :class:`ChatTemplate`; ``tools``: a list of tool definitions (or its JSON). ``max_length``
    keeps the first N tokens. ``labels``: ``turns`` (the rule above) or ``open-instruct-counts``.
    Raises :class:`ChatError` for a bad conversation.
    """
    tok = _chat_tokenizer(tokenizer, eos_token_id)
    tfile = tokenizer if isinstance(tokenizer, (str, Path)) else None
    tpl = load_template(template, tfile, tok.tok.id_to_token(tok.eos_id))
    ids, mask = _encode_full(messages, tools, tok, tpl, labels)
    if max_length is not None:
        ids, mask = ids[:max_length], mask[:max_length]
    return ids, mask


def _message_key(m: dict) -> tuple:
    return (m.get("role"), m.get("content") or "", m.get("function_calls"), json.dumps(m.get("tool_calls"),
                                                                                       sort_keys=True))


def preference_messages(rec: Any) -> tuple[list[dict], list[dict], Any]:
    """``(chosen, rejected, tools)`` full conversations of a preference record: open-instruct's
    shape (``chosen``/``rejected`` each a whole conversation), or ``prompt`` (messages or a user
    string) with ``chosen``/``rejected`` (assistant messages or a string). They must share the
    prompt: every message before the final assistant turn."""
    if not isinstance(rec, dict) or "chosen" not in rec or "rejected" not in rec:
        raise ChatError("a preference record needs \"chosen\" and \"rejected\"")
    prompt = rec.get("prompt")
    if isinstance(prompt, str):
        prompt = [{"role": "user", "content": prompt}]
    if prompt is not None and not isinstance(prompt, list):
        raise ChatError(f"\"prompt\" must be a list of messages or a string, got {type(prompt).__name__}")
    sides = []
    for key in ("chosen", "rejected"):
        v = rec[key]
        if isinstance(v, str):
            v = [{"role": "assistant", "content": v}]
        if not isinstance(v, list):
            raise ChatError(f"\"{key}\" must be a list of messages, got {type(v).__name__}")
        sides.append((prompt or []) + v)
    tools = rec.get("tools")
    chosen, _ = check_conversation(sides[0], tools)
    rejected, _ = check_conversation(sides[1], tools)

    def last_assistant(msgs: list[dict]) -> int:
        return max(i for i, m in enumerate(msgs) if m["role"] == "assistant")
    pc, pr = chosen[:last_assistant(chosen)], rejected[:last_assistant(rejected)]
    if [_message_key(m) for m in pc] != [_message_key(m) for m in pr]:
        k = next((i for i, (a, b) in enumerate(zip(pc, pr)) if _message_key(a) != _message_key(b)),
                 min(len(pc), len(pr)))
        if k < min(len(pc), len(pr)):
            what = (f"message {k} differs: chosen has {_show(pc[k])}, rejected has {_show(pr[k])}")
        else:
            what = f"chosen has {len(pc)} prompt messages, rejected {len(pr)}"
        raise ChatError(f"chosen and rejected do not share the prompt (the messages before the final assistant "
                        f"turn): {what}")
    if [_message_key(m) for m in chosen] == [_message_key(m) for m in rejected]:
        raise ChatError("chosen and rejected are the same conversation: the pair teaches nothing (its DPO loss is "
                        "log 2 whatever the weights)")
    return chosen, rejected, tools


def _show(m: dict) -> str:
    """A message in a few words, for an error."""
    text = str(m.get("content") or "")
    return f"{m.get('role')} {text[:40]!r}" + ("..." if len(text) > 40 else "")


# --------------------------------------------------------------------------- workers

_WORKER: tuple[ChatTokenizer, ChatTemplate, str] | None = None


def _init_worker(tok_json: str, eos_id: int, template: ChatTemplate, labels: str, single_thread: bool) -> None:
    global _WORKER
    if single_thread:
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
    from tokenizers import Tokenizer
    _WORKER = (ChatTokenizer(Tokenizer.from_str(tok_json), eos_id), template, labels)


@dataclass
class _Chunk:
    """One chunk's encoded records, in input order."""

    tokens: list[np.ndarray] = field(default_factory=list)   # one per written sequence
    masks: list[np.ndarray] = field(default_factory=list)
    lines: list[int] = field(default_factory=list)           # the input line of each record written
    truncated: int = 0
    dropped: int = 0          # no trained token left after truncation
    over: int = 0             # records longer than the length limit passed in (before truncation)
    longest: tuple[int, int] = (0, 0)  # (tokens, line) of the longest record, before truncation
    bad: list[tuple[int, str, str]] = field(default_factory=list)  # (line, reason, message)


def _reason(msg: str) -> str:
    for key, words in (("bad_json", "not valid JSON"), ("unknown_role", "has role"),
                       ("empty_assistant", "empty assistant"), ("not_a_list", "must be a list"),
                       ("no_assistant", "no assistant turn"), ("not_ending_with_assistant", "the last message"),
                       ("prompt_mismatch", "do not share the prompt"), ("eos_in_text", "exactly one EOS"),
                       ("identical_pair", "are the same conversation")):
        if words in msg:
            return key
    return "other"


def _encode_chunk(task: tuple[list[tuple[int, str]], bool, int | None, int]) -> _Chunk:
    lines, preference, max_length, limit = task
    assert _WORKER is not None
    tok, template, labels = _WORKER
    out = _Chunk()
    for n, line in lines:
        try:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ChatError(f"not valid JSON ({e.msg})") from None
            if preference:
                chosen, rejected, tools = preference_messages(rec)
                seqs = [_encode_full(chosen, tools, tok, template, labels),
                        _encode_full(rejected, tools, tok, template, labels)]
            else:
                if not isinstance(rec, dict) or "messages" not in rec:
                    raise ChatError("a conversation needs \"messages\" (a list of {\"role\", \"content\"})")
                seqs = [_encode_full(rec["messages"], rec.get("tools"), tok, template, labels)]
        except ChatError as e:
            out.bad.append((n, _reason(str(e)), str(e)))
            continue
        except Exception as e:  # a template's own error, a malformed tool call
            out.bad.append((n, "other", f"{type(e).__name__}: {e}"))
            continue
        n_tok = max(len(ids) for ids, _ in seqs)
        out.over += n_tok > limit
        out.longest = max(out.longest, (n_tok, -n))  # the first of equally long ones
        if max_length is not None and any(len(ids) > max_length for ids, _ in seqs):
            out.truncated += 1
            seqs = [(ids[:max_length], m[:max_length]) for ids, m in seqs]
        if not all(m.any() for _, m in seqs):
            out.dropped += 1
            continue
        for ids, m in seqs:
            out.tokens.append(ids)
            out.masks.append(m)
        out.lines.append(n)
    return out


def _read_chunks(paths: list[Path]) -> Iterator[tuple[str, list[tuple[int, str]], int]]:
    """``(file, [(line number, text)], raw bytes advanced)``; chunks never span two files."""
    from olmax.data.tokenize import _Source
    for p in paths:
        src = _Source(p)
        lines: list[tuple[int, str]] = []
        chars = last = 0
        try:
            for n, line in enumerate(src.text, 1):
                if not line.strip():
                    continue
                lines.append((n, line))
                chars += len(line)
                if len(lines) >= _CHUNK_LINES or chars >= _CHUNK_CHARS:
                    pos = src.raw.tell()
                    yield str(p), lines, pos - last
                    lines, chars, last = [], 0, pos
        except UnicodeDecodeError as e:
            raise DataError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start})") from None
        except src.read_errors as e:
            raise DataError(f"{p}: cannot read ({e}); is the file damaged or truncated?") from None
        finally:
            src.close()
        yield str(p), lines, p.stat().st_size - last


# --------------------------------------------------------------------------- writers


def _sha(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(1 << 24), b""):
            h.update(b)
    return h.hexdigest()


class _PartWriter:
    """open-instruct's converter layout: token ids and label masks cut every ``part_tokens``
    tokens (a conversation may cross parts), and per part a ``.csv.gz`` of the conversations'
    ``start,end`` in it."""

    def __init__(self, root: Path, dtype: np.dtype, part_tokens: int):
        self.root, self.dtype, self.cap = root, dtype.newbyteorder("<"), part_tokens
        self.files: list[dict] = []
        self._n = 0            # tokens in the open part
        self._bounds: list[tuple[int, int]] = []
        self._trained = 0
        self._fh: tuple[Any, Any] | None = None

    def add(self, ids: np.ndarray, mask: np.ndarray) -> None:
        i = 0
        while i < len(ids):
            if self._fh is None:
                k = len(self.files)
                self._fh = (open(self.root / TOKEN_IDS.format(k), "wb"), open(self.root / LABELS_MASK.format(k), "wb"))
            take = min(self.cap - self._n, len(ids) - i)
            self._fh[0].write(ids[i:i + take].astype(self.dtype).tobytes())
            self._fh[1].write(mask[i:i + take].astype(np.bool_).tobytes())
            self._bounds.append((self._n, self._n + take))
            self._trained += int(mask[i:i + take].sum())
            self._n += take
            i += take
            if self._n >= self.cap:
                self._close()

    def _close(self) -> None:
        if self._fh is None:
            return
        for f in self._fh:
            f.close()
        k = len(self.files)
        meta = self.root / DOC_BOUNDS.format(k)
        with open(meta, "wb") as raw, gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as gz:
            gz.write("".join(f"{a},{b}\n" for a, b in self._bounds).encode())
        self.files.append({"token_ids": TOKEN_IDS.format(k), "labels_mask": LABELS_MASK.format(k),
                           "metadata": DOC_BOUNDS.format(k), "tokens": self._n, "trained_tokens": self._trained,
                           "documents": len(self._bounds),
                           "sha256": {"token_ids": _sha(self.root / TOKEN_IDS.format(k)),
                                      "labels_mask": _sha(self.root / LABELS_MASK.format(k)),
                                      "metadata": _sha(meta)}})
        self._fh, self._n, self._bounds, self._trained = None, 0, [], 0

    def finish(self) -> list[dict]:
        self._close()
        return self.files


class _PairWriter:
    """Chosen then rejected sequences, appended to raw temporary files; ``np.save`` files at the end."""

    def __init__(self, root: Path):
        self.root = root
        self._tok = open(root / ".pairs_tokens.raw", "wb")
        self._mask = open(root / ".pairs_mask.raw", "wb")
        self.index: list[tuple[int, int, int, int]] = []
        self.n = 0
        self.trained = 0

    def add(self, chosen: tuple[np.ndarray, np.ndarray], rejected: tuple[np.ndarray, np.ndarray]) -> None:
        row = []
        for ids, mask in (chosen, rejected):
            self._tok.write(ids.astype("<u4").tobytes())
            self._mask.write(mask.astype(np.bool_).tobytes())
            row += [self.n, len(ids)]
            self.n += len(ids)
            self.trained += int(mask.sum())
        self.index.append(tuple(row))  # type: ignore[arg-type]

    def finish(self) -> dict:
        self._tok.close()
        self._mask.close()
        for raw, name, dt in ((".pairs_tokens.raw", PAIRS_TOKEN_IDS, np.dtype("<u4")),
                              (".pairs_mask.raw", PAIRS_LABELS_MASK, np.dtype(np.bool_))):
            src = np.memmap(self.root / raw, mode="r", dtype=dt, shape=(self.n,)) if self.n else np.zeros(0, dt)
            dst = np.lib.format.open_memmap(self.root / name, mode="w+", dtype=dt, shape=(self.n,))
            step = 1 << 26
            for a in range(0, self.n, step):
                dst[a:a + step] = src[a:a + step]
            dst.flush()
            del src, dst
            (self.root / raw).unlink()
        np.save(self.root / PAIRS_INDEX, np.asarray(self.index, dtype=np.int64).reshape(-1, 4))
        return {name: _sha(self.root / name) for name in (PAIRS_TOKEN_IDS, PAIRS_LABELS_MASK, PAIRS_INDEX)}


# --------------------------------------------------------------------------- entry point


class _Tally:
    """Encoded chunks in input order into the writer, counting what was read, written, truncated,
    dropped and skipped (a bad line is an error unless ``skip_bad``)."""

    def __init__(self, writer: _PartWriter | _PairWriter, vocab: int, preference: bool, skip_bad: bool):
        self.writer, self.vocab, self.preference, self.skip_bad = writer, vocab, preference, skip_bad
        self.counts = {"records": 0, "written": 0, "truncated": 0, "dropped_no_labels": 0, "tokens": 0,
                       "trained_tokens": 0, "max_token_id": -1}
        self.skipped: Counter = Counter()
        self.over = 0
        self.longest: tuple[int, str] = (0, "")   # (tokens, file:line) of the longest record

    def consume(self, name: str, res: _Chunk) -> None:
        counts = self.counts
        # records in input order: a bad line and the next good one are ordered by line number
        bad = {n: (r, msg) for n, r, msg in res.bad}
        if bad and not self.skip_bad:
            n = min(bad)
            raise DataError(f"{name}:{n}: {bad[n][1]} (--skip-bad skips and counts such lines)")
        for r, _ in bad.values():
            self.skipped[r] += 1
        counts["records"] += len(res.lines) + len(bad) + res.dropped
        self.over += res.over
        if res.longest[0] > self.longest[0]:
            self.longest = (res.longest[0], f"{name}:{-res.longest[1]}")
        counts["truncated"] += res.truncated
        counts["dropped_no_labels"] += res.dropped
        per = 2 if self.preference else 1
        for k in range(len(res.lines)):
            seqs = [(res.tokens[per * k + j], res.masks[per * k + j]) for j in range(per)]
            for ids, m in seqs:
                counts["tokens"] += len(ids)
                counts["trained_tokens"] += int(m.sum())
                counts["max_token_id"] = max(counts["max_token_id"], int(ids.max()))
            if counts["max_token_id"] >= self.vocab:
                raise DataError(f"{name}:{res.lines[k]}: token id {counts['max_token_id']} >= vocab size {self.vocab}")
            if self.preference:
                self.writer.add(*seqs)  # type: ignore[call-arg]
            else:
                self.writer.add(*seqs[0])  # type: ignore[call-arg]
            counts["written"] += 1

    def check_written(self, paths: list[Path]) -> None:
        if self.counts["written"] == 0:
            raise DataError(f"no {'pairs' if self.preference else 'conversations'} left to write from "
                            f"{', '.join(map(str, paths))} (skipped: {dict(self.skipped) or 0}, "
                            f"dropped with no trained tokens: {self.counts['dropped_no_labels']})")

    def report(self) -> dict:
        counts, skipped = self.counts, self.skipped
        return {("pairs" if self.preference else "conversations"): counts["written"],
                "records_read": counts["records"], "tokens": counts["tokens"],
                "trained_tokens": counts["trained_tokens"],
                "trained_share": round(counts["trained_tokens"] / max(counts["tokens"], 1), 6),
                "truncated": counts["truncated"], "dropped_no_labels": counts["dropped_no_labels"],
                "skipped": sum(skipped.values()), "skipped_by_reason": dict(sorted(skipped.items()))}

    def finish(self, meta: dict, cap: int) -> dict:
        """Close the writer; the manifest: ``meta`` and the files written (SFT parts or pair arrays)."""
        counts = self.counts
        if self.preference:
            shas = self.writer.finish()  # type: ignore[union-attr]
            return {"format": PAIRS_FORMAT, **meta, "pairs": counts["written"],
                    "total_tokens": counts["tokens"],
                    "files": {PAIRS_TOKEN_IDS: {"sha256": shas[PAIRS_TOKEN_IDS], "dtype": "uint32"},
                              PAIRS_LABELS_MASK: {"sha256": shas[PAIRS_LABELS_MASK], "dtype": "bool"},
                              PAIRS_INDEX: {"sha256": shas[PAIRS_INDEX], "dtype": "int64",
                                            "columns": ["chosen_offset", "chosen_len", "rejected_offset",
                                                        "rejected_len"]}}}
        files = self.writer.finish()  # type: ignore[union-attr]
        return {"format": SFT_FORMAT, **meta, "part_tokens": cap, "total_tokens": counts["tokens"],
                "total_documents": counts["written"], "headerless": True, "labels_mask_dtype": "bool",
                "files": files}


def tokenize_chat(inputs: Sequence[str | Path], out_dir: str | Path, *, tokenizer: str | Path,
                  template: str = "olmo3", preference: bool = False, max_length: int | None = None,
                  skip_bad: bool = False, processes: int = 1, part_tokens: int | None = None,
                  eos_token_id: int | None = None, labels: str = "turns", progress: bool = True) -> dict:
    """Encode chat JSONL ``inputs`` into ``out_dir`` (SFT parts, or preference pairs); return the
    manifest (its ``report`` has the counts). Built in a temporary sibling folder and renamed
    into place; an existing non-empty ``out_dir`` is refused. Output is byte-identical for any
    ``processes``: records are read in order, encoded in chunks by workers and written in order."""
    from tqdm import tqdm

    from olmax.data.tokenize import (
        _check_inputs,
        _find_eos,
        building,
        check_out_dir,
        encode_in_order,
        load_tokenizer,
        smallest_dtype,
    )
    if processes <= 0:
        raise DataError(f"--processes must be positive, got {processes}")
    if labels not in LABEL_RULES:
        raise DataError(f"--labels {labels!r}: use one of {', '.join(LABEL_RULES)}")
    if max_length is not None and max_length <= 0:
        raise DataError(f"--max-length must be positive, got {max_length}")
    if part_tokens is not None and part_tokens <= 0:
        raise DataError(f"--shard-tokens must be positive, got {part_tokens}")
    paths = _check_inputs(inputs)
    out = Path(out_dir)
    check_out_dir(out)
    tok, tok_json = load_tokenizer(tokenizer)
    eos = _find_eos(tok, eos_token_id)
    vocab = tok.get_vocab_size(with_added_tokens=True)
    if not 0 <= eos < vocab:
        raise DataError(f"eos token id {eos} is outside the vocabulary ({vocab})")
    tpl = load_template(template, tokenizer, tok.id_to_token(eos))
    dtype = np.dtype(np.uint32) if preference else smallest_dtype(vocab)
    if preference and vocab - 1 > np.iinfo(np.uint32).max:
        raise DataError(f"vocab size {vocab} does not fit the pairs' uint32 token ids")
    cap = part_tokens or PART_BYTES // dtype.itemsize

    with building(out) as tmp:
        writer: _PartWriter | _PairWriter = _PairWriter(tmp) if preference else _PartWriter(tmp, dtype, cap)
        tally = _Tally(writer, vocab, preference, skip_bad)
        bar = tqdm(total=sum(p.stat().st_size for p in paths), unit="B", unit_scale=True, desc="tokenize --chat",
                   disable=not progress, file=sys.stderr)
        limit = max_length if max_length is not None else longest_recipe_sequence()[1]
        tasks = ((name, (lines, preference, max_length, limit), nbytes)
                 for name, lines, nbytes in _read_chunks(paths))
        try:
            encode_in_order(_encode_chunk, tasks, tally.consume, processes, _init_worker,
                            (tok.to_str(), eos, tpl, labels), bar)
        finally:
            bar.close()  # an error gets a line of its own, not the end of the bar's
        _warn_long(tally, max_length)
        tally.check_written(paths)
        shutil.copyfile(tokenizer, tmp / "tokenizer.json")
        if tpl.source is not None:
            (tmp / "chat_template.jinja").write_text(tpl.source)
        meta = {"dtype": dtype.name, "eos_token_id": eos, "vocab_size": vocab,
                "tokenizer": {"file": "tokenizer.json", "sha256": hashlib.sha256(tok_json.encode()).hexdigest(),
                              "vocab_size": vocab},
                "template": tpl.describe(), "labels": labels, "label_rule": LABEL_RULES[labels],
                "max_length": max_length, "inputs": [p.name for p in paths], "report": tally.report()}
        manifest = tally.finish(meta, cap)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
        return manifest


def longest_recipe_sequence() -> tuple[str, int]:
    """``(recipe, data.sequence_length)`` of the SFT recipe (packed chat documents) with the
    longest sequences; the DPO recipes' pairs are shorter (16,384 tokens against 32,768)."""
    from olmax.recipes import RECIPES
    cfgs = [(name, make()) for name, make in RECIPES.items()]
    packed = [(n, c.data.sequence_length) for n, c in cfgs if c.data.packing != "none"]
    return max(packed or [(n, c.data.sequence_length) for n, c in cfgs], key=lambda x: x[1])


def _warn_long(tally: _Tally, max_length: int | None) -> None:
    """A record longer than any sequence a run can hold (or than ``--max-length``) is said, not
    passed silently: training keeps only its first tokens."""
    if not tally.over:
        return
    n, where = tally.longest
    what = "pairs" if tally.preference else "conversations"
    if max_length is not None:
        msg = (f"{tally.over} {what} were longer than --max-length {max_length} and keep their first {max_length} "
               f"tokens (the longest, {where}, has {n})")
    else:
        recipe, L = longest_recipe_sequence()
        msg = (f"{tally.over} {what} are longer than any recipe's sequence (the longest, recipe {recipe}'s "
               f"data.sequence_length, is {L} tokens); the longest, {where}, has {n} tokens: training keeps only "
               "the first data.sequence_length tokens of each (--max-length truncates at tokenize time)")
    print(f"olmax: WARNING {msg}", file=sys.stderr, flush=True)


def summary(manifest: dict, where: str | Path) -> str:
    """The report as the CLI prints it."""
    r = manifest["report"]
    what = f"{r['pairs']} pairs" if "pairs" in r else f"{r['conversations']} conversations"
    s = (f"{where}: {what}, {r['tokens']} tokens ({manifest['dtype']}), trained {r['trained_tokens']} "
         f"({100 * r['trained_share']:.1f}%), truncated {r['truncated']}")
    if manifest.get("max_length"):
        s += f" at --max-length {manifest['max_length']}"
    s += f", dropped with no trained token {r['dropped_no_labels']}, skipped {r['skipped']}"
    if r["skipped_by_reason"]:
        s += " (" + ", ".join(f"{k} {v}" for k, v in r["skipped_by_reason"].items()) + ")"
    if "files" in manifest and isinstance(manifest["files"], list):
        s += f"; {len(manifest['files'])} token_ids/labels_mask parts"
    return s


# --------------------------------------------------------------------------- pair files


def read_pairs(folder: str | Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(token_ids uint32[T], labels_mask bool[T], index int64[n, 4])`` of an ``olmax tokenize
    --chat --preference`` folder (memory-mapped), checked; errors name the file. Row ``i`` of
    ``index`` is ``chosen_offset, chosen_len, rejected_offset, rejected_len``: pair ``i``'s chosen
    sequence is ``token_ids[chosen_offset : chosen_offset + chosen_len]``."""
    d = Path(folder)
    man = d / MANIFEST
    if not man.is_file():
        raise DataError(f"{man}: not found ({d} is not an `olmax tokenize --chat --preference` folder)")
    try:
        m = json.loads(man.read_text())
    except ValueError as e:
        raise DataError(f"{man}: not valid JSON ({e})") from None
    if not isinstance(m, dict) or m.get("format") != PAIRS_FORMAT:
        got = m.get("format") if isinstance(m, dict) else None
        raise DataError(f"{man}: format {got!r}, expected {PAIRS_FORMAT!r} (written by `olmax tokenize --chat "
                        f"--preference`)")
    arrays = []
    for name, dt, ndim in ((PAIRS_TOKEN_IDS, np.uint32, 1), (PAIRS_LABELS_MASK, np.bool_, 1),
                           (PAIRS_INDEX, np.int64, 2)):
        p = d / name
        if not p.is_file():
            raise DataError(f"{p}: not found")
        try:
            a = np.load(p, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as e:
            raise DataError(f"{p}: not a readable .npy file ({e})") from None
        if a.dtype != np.dtype(dt) or a.ndim != ndim or (ndim == 2 and a.shape[1] != 4):
            want = f"{np.dtype(dt).name} {'[n, 4]' if ndim == 2 else '1-D'}"
            raise DataError(f"{p}: {a.dtype.name} {list(a.shape)}, expected {want}")
        arrays.append(a)
    tokens, mask, index = arrays
    if len(mask) != len(tokens):
        raise DataError(f"{d / PAIRS_LABELS_MASK}: {len(mask)} entries but {PAIRS_TOKEN_IDS} has {len(tokens)}")
    if len(index) != m.get("pairs", len(index)):
        raise DataError(f"{d / PAIRS_INDEX}: {len(index)} pairs but {MANIFEST} says {m.get('pairs')}")
    idx = np.asarray(index)
    if len(idx):
        starts = np.concatenate([[0], (idx[:, 2] + idx[:, 3])[:-1]])
        ok = ((idx[:, 1] > 0) & (idx[:, 3] > 0) & (idx[:, 0] == starts) & (idx[:, 2] == idx[:, 0] + idx[:, 1]))
        if not ok.all():
            i = int(np.argmin(ok))
            raise DataError(f"{d / PAIRS_INDEX}: pair {i} {idx[i].tolist()} is not chosen-then-rejected, back to back "
                            f"after the previous pair, with non-empty sequences")
        if idx[-1, 2] + idx[-1, 3] != len(tokens):
            raise DataError(f"{d / PAIRS_INDEX}: the pairs cover {int(idx[-1, 2] + idx[-1, 3])} tokens but "
                            f"{PAIRS_TOKEN_IDS} has {len(tokens)}")
    elif len(tokens):
        raise DataError(f"{d / PAIRS_INDEX}: no pairs but {PAIRS_TOKEN_IDS} has {len(tokens)} tokens")
    return tokens, mask, index


def write_pairs(folder: str | Path, pairs: Sequence[tuple[Sequence[int], Sequence[bool], Sequence[int], Sequence[bool]]]
                ) -> Path:
    """Write tokenized ``(chosen_ids, chosen_mask, rejected_ids, rejected_mask)`` pairs as a folder
    :func:`read_pairs` reads, with the writer ``olmax tokenize --chat --preference`` uses (tests
    and the TRL parity harness; their pairs are token ids already)."""
    for c, cm, r, rm in pairs:
        if len(c) != len(cm) or len(r) != len(rm):
            raise DataError("a sequence and its label mask differ in length")
    root = Path(folder)
    root.mkdir(parents=True, exist_ok=True)
    writer = _PairWriter(root)
    for c, cm, r, rm in pairs:
        writer.add((np.asarray(c, np.uint32), np.asarray(cm, bool)), (np.asarray(r, np.uint32), np.asarray(rm, bool)))
    shas = writer.finish()
    manifest = {"format": PAIRS_FORMAT, "pairs": len(pairs),
                "files": {name: {"sha256": sha} for name, sha in shas.items()}}
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return root
