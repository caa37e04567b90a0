"""Tokenizer files and chat templates for generation.

Tokenising uses the ``tokenizers`` library on ``tokenizer.json`` directly, never transformers:
transformers 5 loads the Dolma 2 tokenizer with a different pre-tokenizer and about 10% more
tokens. Text is encoded without the tokenizer's post-processor (``add_special_tokens=False``),
as ``olmax tokenize`` encodes training data; ``data.bos_token_id``, when the checkpoint's config
sets one, is put in front of every prompt.

Chat prompts follow the checkpoint's own template when its tokenizer files carry one
(``chat_template.jinja``, else ``tokenizer_config.json``'s ``chat_template``), rendered with
jinja2 the way transformers renders it (sandboxed, ``trim_blocks``, ``lstrip_blocks``). Without
one (or without jinja2) the OLMo 3 Instruct template is rendered in Python: ChatML turns
``<|im_start|>role\\n...<|im_end|>\\n``, the Instruct model's default system message when the
conversation has none, a final assistant turn closed by the EOS token, and the generation prompt
``<|im_start|>assistant\\n``; tools go in the system turn as a JSON list inside
``<functions>...</functions>``. ``render_olmo3_chat(..., think=True)`` is the Think variant,
whose generation prompt adds ``<think>`` (``olmax tokenize --chat`` keeps that ``<think>`` out of
the masked prompt: see ``olmax.data.chat``).
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from olmax.config import Config, ConfigError

TOKENIZER_FILE = "tokenizer.json"
TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# The system message OLMo 3 Instruct's template inserts when a conversation has none.
OLMO3_SYSTEM_PREFIX = "You are a helpful function-calling AI assistant. "
OLMO3_DEFAULT_SYSTEM = OLMO3_SYSTEM_PREFIX + "You do not currently have access to any functions. <functions></functions>"
# With tools and no system message, this preamble and the tools' JSON replace the "no functions" text.
OLMO3_FUNCTIONS_PREAMBLE = ("You are provided with function signatures within <functions></functions> XML tags. You may "
                            "call one or more functions to assist with the user query. Output any function calls within "
                            "<function_calls></function_calls> XML tags. Do not make assumptions about what values to "
                            "plug into functions.")
# OLMo 3 7B Think's SFT template (open-instruct ``olmo_thinker_no_think_7b``): default system message, and
# the suffix a given system message gets when there are no tools.
OLMO3_THINK_DEFAULT_SYSTEM = ("You are Olmo, a helpful AI assistant built by Ai2. Your date cutoff is December 2024, "
                              "and your model weights are available at https://huggingface.co/allenai.")
OLMO3_THINK_NO_FUNCTIONS = " You do not currently have access to any functions. <functions></functions>"
THINK_OPEN = "<think>"
ROLES = ("system", "user", "assistant", "environment", "tool")
# Special-token roles a template may read (``{{ eos_token }}``), as tokenizer_config.json names them.
SPECIAL_ROLES = ("bos_token", "eos_token", "pad_token", "unk_token")


def _checkpoint_dirs(checkpoint: str) -> list[Path]:
    """Folders that may hold a checkpoint's tokenizer: the ``hf:`` or weights directory itself, a
    run directory, and the run directory of ``RUN/checkpoints/N``."""
    d = Path(checkpoint[3:] if checkpoint.startswith("hf:") else checkpoint)
    dirs = [d]
    if d.parent.name == "checkpoints" and d.name.isdigit():
        dirs.append(d.parent.parent)
    return dirs


def _training_tokenizer(cfg: Config) -> Path | None:
    """The tokenizer an ``olmax tokenize`` folder recorded for the run's training data (the demo's
    run, for one): ``tokenizer.json`` beside the first token file, when the folder's manifest
    names it and its sha256 still matches."""
    for p in cfg.data.paths[:1]:
        if "://" in p:
            return None
        folder = Path(p) if Path(p).is_dir() else Path(p).parent
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


def find_tokenizer(checkpoint: str, cfg: Config | None = None) -> Path | None:
    """The ``tokenizer.json`` that belongs to a checkpoint, or None: in the checkpoint's folder (an
    ``hf:`` directory, a weights or run directory), else the one ``olmax tokenize`` wrote beside
    the run's training data."""
    if "://" in checkpoint:
        return None
    for d in _checkpoint_dirs(checkpoint):
        if (d / TOKENIZER_FILE).is_file():
            return d / TOKENIZER_FILE
    return _training_tokenizer(cfg) if cfg is not None else None


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


def _token_text(v: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def _template_from(folder: Path) -> tuple[str | None, str | None, dict]:
    """(template source, where it came from, tokenizer_config.json) of a tokenizer folder."""
    conf: dict = {}
    cpath = folder / TOKENIZER_CONFIG
    if cpath.is_file():
        try:
            conf = json.loads(cpath.read_text())
        except ValueError as e:
            raise ConfigError(f"{cpath} is not valid JSON: {e}") from None
    if (folder / TEMPLATE_FILE).is_file():
        return (folder / TEMPLATE_FILE).read_text(), str(folder / TEMPLATE_FILE), conf
    t = conf.get("chat_template")
    if isinstance(t, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
    return (t, str(cpath), conf) if isinstance(t, str) and t else (None, None, conf)


def _tools_json(tools: Any) -> str:
    """The tool list as the OLMo 3 templates print it inside ``<functions>``: JSON (``, `` and
    ``: `` separators, non-ASCII kept); a string is taken as already-serialised JSON."""
    return tools if isinstance(tools, str) else json.dumps(tools, ensure_ascii=False)


def _function_calls(m: dict) -> str:
    """An assistant turn's calls as ``<function_calls>...</function_calls>``: open-instruct's
    ``function_calls`` string, or HF-style ``tool_calls`` printed as ``name(key=json, ...)``, one
    call a line; empty when the turn makes none."""
    if isinstance(m.get("function_calls"), str):
        return f"<function_calls>{m['function_calls']}</function_calls>"
    calls = m.get("tool_calls")
    if not calls:
        return ""
    out = []
    for c in calls:
        f = c.get("function", c) if isinstance(c, dict) else {}
        args = f.get("arguments") or {}
        if isinstance(args, str):
            args = json.loads(args)
        out.append(f"{f.get('name')}(" + ", ".join(f"{k}={json.dumps(args[k], ensure_ascii=False)}"
                                                   for k in sorted(args)) + ")")
    return "<function_calls>" + "\n".join(out) + "</function_calls>"


def render_olmo3_chat(messages: list[dict], add_generation_prompt: bool = True, eos_token: str = "<|endoftext|>",
                      tools: Any = None, think: bool = False) -> str:
    """OLMo 3's chat template rendered in Python: Instruct, or Think with ``think=True``.

    Tools (a list, or its JSON) go inside ``<functions>...</functions>`` at the end of the system
    turn, after the function-calling preamble when the default system message is used; an
    assistant's calls follow its content as ``<function_calls>...</function_calls>``; ``tool``
    turns are ``environment`` turns. The Think variant has 7B Think's default system message, a
    given system message gets the "no functions" suffix (open-instruct's ``olmo_thinker``
    templates), and its generation prompt is ``<|im_start|>assistant\\n<think>``."""
    out = []
    if not any(m["role"] == "system" for m in messages):
        if think:
            default = OLMO3_THINK_DEFAULT_SYSTEM + (f" <functions>{_tools_json(tools)}</functions>" if tools else "")
        elif tools:
            default = OLMO3_SYSTEM_PREFIX + OLMO3_FUNCTIONS_PREAMBLE + f"<functions>{_tools_json(tools)}</functions>"
        else:
            default = OLMO3_DEFAULT_SYSTEM
        out.append(f"{IM_START}system\n{default}{IM_END}\n")
    for i, m in enumerate(messages):
        role = "environment" if m["role"] == "tool" else m["role"]
        content = m.get("content") or ""
        if role == "assistant":
            end = f"{IM_END}\n" if i < len(messages) - 1 else eos_token
            out.append(f"{IM_START}assistant\n{content}{_function_calls(m)}{end}")
        elif role == "system":
            if tools:
                content += (" " if think else "") + f"<functions>{_tools_json(tools)}</functions>"
            elif think:
                content += OLMO3_THINK_NO_FUNCTIONS
            out.append(f"{IM_START}system\n{content}{IM_END}\n")
        else:
            out.append(f"{IM_START}{role}\n{content}{IM_END}\n")
    if add_generation_prompt:
        out.append(f"{IM_START}assistant\n" + (THINK_OPEN if think else ""))
    return "".join(out)


@functools.lru_cache(maxsize=8)
def _jinja_template(source: str) -> Any:
    """A transformers-style chat template compiled once (its sandbox, filters and globals)."""
    import datetime

    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
               sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return env.from_string(source)


def _render_jinja(source: str, where: str, messages: list[dict], add_generation_prompt: bool,
                  special: dict[str, str | None], tools: Any = None) -> str:
    """Render a transformers-style chat template; errors name ``where``."""
    import jinja2
    try:
        return _jinja_template(source).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                              tools=tools, documents=None, **special)
    except jinja2.exceptions.TemplateError as e:
        raise ConfigError(f"chat template {where}: {e}") from None


def check_messages(messages: Any, where: str) -> list[dict]:
    """A conversation as a list of ``{"role", "content"}`` objects (strings); errors name ``where``."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where}: \"messages\" must be a non-empty list of {{\"role\", \"content\"}} objects")
    out = []
    for j, m in enumerate(messages):
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)):
            raise ValueError(f"{where}: message {j} must be an object with string \"role\" and \"content\"")
        if m["role"] not in ROLES:
            raise ValueError(f"{where}: message {j} has role {m['role']!r}; use one of {', '.join(ROLES)}")
        out.append(dict(m))
    return out


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
    def load(cls, path: str | Path, cfg: Config) -> "TextCodec":
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
        template, where, conf = _template_from(p.parent)
        special = {r: _token_text(conf.get(r)) for r in SPECIAL_ROLES}
        for role, tid in (("eos_token", cfg.data.eos_token_id), ("bos_token", cfg.data.bos_token_id),
                          ("pad_token", cfg.data.pad_token_id)):
            if special[role] is None and tid is not None:
                special[role] = tok.id_to_token(tid)
        codec = cls(tok, p, cfg.data.bos_token_id, special)
        if template is not None:
            try:
                import jinja2  # noqa: F401
                codec.template, codec.template_source = template, where
            except ImportError:
                codec.template_source = f"built-in OLMo 3 Instruct template (jinja2 is not installed to render {where})"
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
            return _render_jinja(self.template, self.template_source, messages, add_generation_prompt, self.special)
        return render_olmo3_chat(messages, add_generation_prompt, self.special.get("eos_token") or "<|endoftext|>")

    def encode_chat(self, messages: list[dict]) -> list[int]:
        return self.encode(self.render_chat(messages))
