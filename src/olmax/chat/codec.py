"""A checkpoint's tokenizer and chat template: text <-> token ids for generation.

Tokenising uses the ``tokenizers`` library on ``tokenizer.json`` directly, never transformers:
transformers 5 loads the Dolma 2 tokenizer with a different pre-tokenizer and about 10% more
tokens. Text is encoded without the tokenizer's post-processor (``add_special_tokens=False``),
as ``olmax tokenize`` encodes training data; ``data.bos_token_id``, when the checkpoint's config
sets one, is put in front of every prompt.

Chat prompts follow the checkpoint's own template when its tokenizer files carry one, else the
built-in OLMo 3 Instruct template (``olmax.chat.template``).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from olmax.chat.template import (
    DEFAULT_EOS,
    check_messages,
    read_template,
    render_jinja,
    render_olmo3_chat,
    special_tokens,
)
from olmax.config import Config, ConfigError

TOKENIZER_FILE = "tokenizer.json"


def _checkpoint_dirs(checkpoint: str) -> list[Path]:
    """Folders that may hold a checkpoint's tokenizer: the ``hf:`` or weights directory itself, a
    run directory, and the run directory of ``RUN/checkpoints/N``."""
    d = Path(checkpoint[3:] if checkpoint.startswith("hf:") else checkpoint)
    dirs = [d]
    if d.parent.name == "checkpoints" and d.name.isdigit():
        dirs.append(d.parent.parent)
    return dirs


def _data_folder(p: str, anchors: list[Path]) -> Path | None:
    """The folder of training-data path ``p``; a relative one (as the run's config recorded it,
    relative to where it trained) is looked up from the current directory, then from each folder
    above the run directory (a run trained from a project's root sits below it): never from the
    current directory alone."""
    path = Path(p)
    tries = [path] if path.is_absolute() else [path, *(a / path for a in anchors)]
    for t in tries:
        if t.exists():
            return t if t.is_dir() else t.parent
    return None


def _training_tokenizer(cfg: Config, anchors: list[Path] = ()) -> Path | None:
    """The tokenizer an ``olmax tokenize`` folder recorded for the run's training data (the demo's
    run, for one): ``tokenizer.json`` beside the first token file, when the folder's manifest
    names it and its sha256 still matches."""
    for p in cfg.data.paths[:1]:
        if "://" in p:
            return None
        folder = _data_folder(p, list(anchors))
        if folder is None:
            return None
        man, tok = folder / "manifest.json", folder / TOKENIZER_FILE
        if not (man.is_file() and tok.is_file()):
            return None
        try:
            rec = json.loads(man.read_text()).get("tokenizer") or {}
        except (OSError, ValueError):
            return None
        if rec.get("sha256") == hashlib.sha256(tok.read_bytes()).hexdigest():
            return tok
    return None


def _anchors(checkpoint: str) -> list[Path]:
    """The folders above a checkpoint's run directory, nearest first."""
    run = _checkpoint_dirs(checkpoint)[-1].resolve()
    return list(run.parents)


def find_tokenizer(checkpoint: str, cfg: Config | None = None) -> Path | None:
    """The ``tokenizer.json`` that belongs to a checkpoint, or None: in the checkpoint's folder (an
    ``hf:`` directory, a weights or run directory), else the one ``olmax tokenize`` wrote beside
    the run's training data (found from the run directory, whatever the current directory)."""
    if "://" in checkpoint:
        return None
    for d in _checkpoint_dirs(checkpoint):
        if (d / TOKENIZER_FILE).is_file():
            return d / TOKENIZER_FILE
    return _training_tokenizer(cfg, _anchors(checkpoint)) if cfg is not None else None


def tokenizer_places(checkpoint: str, cfg: Config | None = None) -> str:
    """Where ``find_tokenizer`` looked, in words (for the error when it found nothing)."""
    if "://" in checkpoint:
        return "nowhere (a remote checkpoint's tokenizer is not looked up)"
    places = [str(d / TOKENIZER_FILE) for d in _checkpoint_dirs(checkpoint)]
    if cfg is not None and cfg.data.paths:
        places.append(f"beside its training data {cfg.data.paths[0]} (from the current directory and the folders "
                      "above the run directory; with a manifest.json naming it)")
    return ", ".join(places)


def tokenizer_file(path: str | Path) -> Path:
    """``--tokenizer``: a ``tokenizer.json`` file, or a folder that holds one."""
    p = Path(path)
    if p.is_dir():
        if not (p / TOKENIZER_FILE).is_file():
            raise ConfigError(f"--tokenizer {p}: the folder has no {TOKENIZER_FILE}")
        return p / TOKENIZER_FILE
    if not p.is_file():
        raise ConfigError(f"--tokenizer {p} does not exist (give a {TOKENIZER_FILE} file or a folder holding one)")
    return p


def prompt_record(rec: Any, where: str) -> str | list[dict] | None:
    """The prompt of one JSONL record: ``{"messages": [...]}`` (a conversation, checked) or
    ``{"prompt": TEXT}``; None for any other value. ``olmax generate --prompts`` and RL's
    ``rl.prompts_path`` read records this way."""
    if isinstance(rec, dict) and "messages" in rec:
        return check_messages(rec["messages"], where)
    if isinstance(rec, dict) and isinstance(rec.get("prompt"), str):
        return rec["prompt"]
    return None


@dataclass
class TextCodec:
    """A ``tokenizers.Tokenizer`` with the special-token roles, BOS rule and chat template that
    go with a checkpoint."""

    tokenizer: Any
    path: Path
    bos_id: int | None
    special: dict[str, str | None] = field(default_factory=dict)
    template: str | None = None
    template_source: str = "built-in OLMo 3 Instruct template"

    @classmethod
    def load(cls, path: str | Path, cfg: Config) -> TextCodec:
        from tokenizers import Tokenizer
        p = tokenizer_file(path)
        try:
            tok = Tokenizer.from_file(str(p))
        except Exception as e:  # the library raises a bare Exception for a malformed file
            raise ConfigError(f"tokenizer {p} cannot be read: {e}") from None
        n = tok.get_vocab_size(with_added_tokens=True)
        if n > cfg.model.vocab_size:
            raise ConfigError(f"tokenizer {p} has {n} tokens but the checkpoint has vocab_size "
                              f"{cfg.model.vocab_size}: they do not belong together")
        template, where, conf = read_template(p.parent)
        special = special_tokens(conf)
        for role, tid in (("eos_token", cfg.data.eos_token_id), ("bos_token", cfg.data.bos_token_id),
                          ("pad_token", cfg.data.pad_token_id)):
            if special[role] is None and tid is not None:
                special[role] = tok.id_to_token(tid)
        codec = cls(tok, p, cfg.data.bos_token_id, special)
        if template is not None:
            codec.template, codec.template_source = template, where
        return codec

    def token_id(self, token: str) -> int | None:
        return self.tokenizer.token_to_id(token)

    def encode(self, text: str) -> list[int]:
        ids = self.tokenizer.encode(text, add_special_tokens=False).ids
        if self.bos_id is not None and (not ids or ids[0] != self.bos_id):
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        if self.template is not None:
            return render_jinja(self.template, self.template_source, messages, add_generation_prompt, self.special)
        return render_olmo3_chat(messages, add_generation_prompt, self.special.get("eos_token") or DEFAULT_EOS)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return self.encode(self.render_chat(messages))
