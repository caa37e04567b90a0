"""Chat templates: a conversation rendered to the text a model is trained on and prompted with.

A checkpoint's own template (``chat_template.jinja``, else ``tokenizer_config.json``'s
``chat_template``) is rendered with jinja2 the way transformers renders it (sandboxed,
``trim_blocks``, ``lstrip_blocks``). The OLMo 3 Instruct template is also rendered in Python:
ChatML turns ``<|im_start|>role\\n...<|im_end|>\\n``, the Instruct model's default system message
when the conversation has none, a final assistant turn closed by the EOS token, and the
generation prompt ``<|im_start|>assistant\\n``; tools go in the system turn as a JSON list inside
``<functions>...</functions>``. ``render_olmo3_chat(..., think=True)`` is the Think variant, whose
generation prompt adds ``<think>`` (``olmax tokenize --chat`` keeps that ``<think>`` out of the
masked prompt: see ``olmax.data.chat``).

:class:`ChatTemplate` is one template (built in or jinja) with its special tokens;
:func:`load_template` picks one by name (``olmo3``, ``olmo3-think``, ``tokenizer``), folder or file.
"""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from olmax import io
from olmax.config import ConfigError

TEMPLATE_FILE = "chat_template.jinja"
TOKENIZER_CONFIG = "tokenizer_config.json"
IM_START, IM_END = "<|im_start|>", "<|im_end|>"
# The system message OLMo 3 Instruct's template inserts when a conversation has none.
OLMO3_SYSTEM_PREFIX = "You are a helpful function-calling AI assistant. "
OLMO3_DEFAULT_SYSTEM = (OLMO3_SYSTEM_PREFIX
                        + "You do not currently have access to any functions. <functions></functions>")
# With tools and no system message, this preamble and the tools' JSON replace the "no functions" text.
OLMO3_FUNCTIONS_PREAMBLE = ("You are provided with function signatures within <functions></functions> XML tags. "
                            "You may call one or more functions to assist with the user query. Output any function "
                            "calls within <function_calls></function_calls> XML tags. Do not make assumptions about "
                            "what values to plug into functions.")
# OLMo 3 7B Think's SFT template (open-instruct ``olmo_thinker_no_think_7b``): default system message, and
# the suffix a given system message gets when there are no tools.
OLMO3_THINK_DEFAULT_SYSTEM = ("You are Olmo, a helpful AI assistant built by Ai2. Your date cutoff is December 2024, "
                              "and your model weights are available at https://huggingface.co/allenai.")
OLMO3_THINK_NO_FUNCTIONS = " You do not currently have access to any functions. <functions></functions>"
THINK_OPEN = "<think>"
DEFAULT_EOS = "<|endoftext|>"
ROLES = ("system", "user", "assistant", "environment", "tool")
# Special-token roles a template may read (``{{ eos_token }}``), as tokenizer_config.json names them.
SPECIAL_ROLES = ("bos_token", "eos_token", "pad_token", "unk_token")
# Marks where a continued final message ends (transformers' marker for ``continue_final_message``).
CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
# The templates rendered in Python, by the name ``--template`` takes.
BUILTIN_TEMPLATES = ("olmo3", "olmo3-think")


# --------------------------------------------------------------------------- tokenizer folders


def _token_text(v: Any) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken dict."""
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def special_tokens(conf: dict) -> dict[str, str | None]:
    """The special tokens (``SPECIAL_ROLES``) a tokenizer_config.json names; None where it names none."""
    return {r: _token_text(conf.get(r)) for r in SPECIAL_ROLES}


def _read_text(path: Path, what: str = "") -> str:
    """A template or tokenizer_config.json as text; a file that is not UTF-8 is named."""
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"{what}{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def _tokenizer_config(folder: Path) -> dict:
    """The JSON object of a tokenizer folder's tokenizer_config.json; {} when it has none."""
    cpath = folder / TOKENIZER_CONFIG
    if not cpath.is_file():
        return {}
    return io.read_json_object(cpath, "a tokenizer config", ConfigError)


def read_template(folder: Path) -> tuple[str | None, str | None, dict]:
    """(template source, where it came from, tokenizer_config.json) of a tokenizer folder: its
    ``chat_template.jinja``, else tokenizer_config.json's ``chat_template``; (None, None, conf)
    when it has neither."""
    conf = _tokenizer_config(folder)
    cpath = folder / TOKENIZER_CONFIG
    if (folder / TEMPLATE_FILE).is_file():
        return _read_text(folder / TEMPLATE_FILE, "chat template "), str(folder / TEMPLATE_FILE), conf
    t = conf.get("chat_template")
    if t is not None and not isinstance(t, (str, list)):
        raise ConfigError(f"{cpath}: chat_template must be a string (or a list of {{\"name\", \"template\"}} "
                          f"objects), got {type(t).__name__}")
    if isinstance(t, list):  # named templates: [{"name": "default", "template": "..."}, ...]
        t = next((x.get("template") for x in t if isinstance(x, dict) and x.get("name") == "default"), None)
    return (t, str(cpath), conf) if isinstance(t, str) and t else (None, None, conf)


# --------------------------------------------------------------------------- conversations


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


# --------------------------------------------------------------------------- rendering


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


def render_olmo3_chat(messages: list[dict], add_generation_prompt: bool = True, eos_token: str = DEFAULT_EOS,
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


def render_jinja(source: str, where: str, messages: list[dict], add_generation_prompt: bool,
                 special: dict[str, str | None], tools: Any = None) -> str:
    """Render a transformers-style chat template with the special tokens ``special``; errors name ``where``."""
    import jinja2
    try:
        return _jinja_template(source).render(messages=messages, add_generation_prompt=add_generation_prompt,
                                              tools=tools, documents=None, **special)
    except jinja2.exceptions.TemplateError as e:
        raise ConfigError(f"chat template {where}: {e}") from None


# --------------------------------------------------------------------------- templates


@dataclass(frozen=True)
class ChatTemplate:
    """A chat template: the built-in OLMo 3 Instruct (``olmo3``) or Think (``olmo3-think``)
    renderer, or a jinja source (a tokenizer folder's ``chat_template.jinja`` or
    ``tokenizer_config.json`` template) rendered as transformers renders it."""

    name: str
    source: str | None = None
    special: tuple[tuple[str, str], ...] = (("eos_token", DEFAULT_EOS),)

    @property
    def eos_token(self) -> str:
        return dict(self.special).get("eos_token") or DEFAULT_EOS

    @property
    def sha256(self) -> str | None:
        return None if self.source is None else hashlib.sha256(self.source.encode()).hexdigest()

    def render(self, messages: list[dict], add_generation_prompt: bool, tools: Any = None) -> str:
        if self.source is None:
            return render_olmo3_chat(messages, add_generation_prompt, self.eos_token, tools=tools,
                                     think=self.name == "olmo3-think")
        return render_jinja(self.source, self.name, messages, add_generation_prompt,
                            {"bos_token": None, "pad_token": None, "unk_token": None, **dict(self.special)}, tools)

    def continue_final(self, messages: list[dict], tools: Any = None) -> str:
        """The conversation up to the end of its final message's content, left open for the model to
        continue (a prefilled reply): transformers' ``continue_final_message``, whose marker and cut
        this repeats so that both render the same prompt."""
        final = messages[-1].get("content") if messages else None
        if not isinstance(final, str):
            raise ConfigError(f"chat template {self.name}: the final message has no string content to continue")
        text = self.render(messages[:-1] + [{**messages[-1], "content": final + CONTINUE_TAG}], False, tools)
        at = text.rfind(CONTINUE_TAG.strip())
        if at < 0 or final.strip() not in text:
            raise ConfigError(f"chat template {self.name} drops part of the final message, so it cannot be continued")
        # a template that strips the message's trailing space also strips the tag's
        return text[:at] if text.startswith(CONTINUE_TAG, at) else text[:at].rstrip()

    def describe(self) -> dict:
        return {"name": self.name, "sha256": self.sha256, "eos_token": self.eos_token}


def load_template(spec: str | ChatTemplate = "olmo3", tokenizer_file: str | Path | None = None,
                  eos_token: str | None = None) -> ChatTemplate:
    """``olmo3`` / ``olmo3-think`` (built in), ``tokenizer`` (the jinja template in the folder of
    ``tokenizer_file``), a folder holding ``chat_template.jinja`` or ``tokenizer_config.json``
    with a ``chat_template``, or a ``.jinja`` file. ``eos_token`` is the EOS text when the
    template's folder names none."""
    if isinstance(spec, ChatTemplate):
        return spec
    if spec in BUILTIN_TEMPLATES:
        return ChatTemplate(spec, None, (("eos_token", eos_token or DEFAULT_EOS),))
    if spec == "tokenizer":
        if tokenizer_file is None:
            raise ConfigError("--template tokenizer needs a tokenizer file")
        p = Path(tokenizer_file).parent
    else:
        p = Path(spec)
    conf: dict = {}
    if p.is_file():
        source, where = _read_text(p, "chat template "), str(p)
        conf = _tokenizer_config(p.parent)
    elif p.is_dir():
        source, where, conf = read_template(p)
        if source is None:
            raise ConfigError(f"chat template {p}: no {TEMPLATE_FILE} and no chat_template in {TOKENIZER_CONFIG}")
    else:
        raise ConfigError(f"chat template {spec!r}: use {', '.join(BUILTIN_TEMPLATES)}, 'tokenizer', a folder "
                          f"or a .jinja file")
    special = special_tokens(conf)
    if eos_token is not None and not special.get("eos_token"):
        special["eos_token"] = eos_token
    return ChatTemplate(where, source, tuple(sorted((k, v) for k, v in special.items() if v)))


def tokenizer_template(path: str | Path, eos_token: str | None = None) -> ChatTemplate:
    """The chat template that goes with a tokenizer (a folder, or a ``tokenizer.json`` whose folder
    is read): its own jinja template, else the built-in OLMo 3 Instruct one; ``eos_token`` is the
    EOS text when the folder names none."""
    p = Path(path)
    folder = p if p.is_dir() else p.parent
    source, _, conf = read_template(folder)
    if source is None:
        return load_template("olmo3", eos_token=special_tokens(conf)["eos_token"] or eos_token)
    return load_template(str(folder), eos_token=eos_token)
