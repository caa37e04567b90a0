"""``olmax demo sft``: supervised fine-tuning of the demo's tiny OLMo 3 on a chat set built here.

From the pre-trained checkpoint of ``olmax demo`` (run first when there is none; or ``--from``),
it builds a chat set from what every Python has, with answers that can be checked exactly:

- ``last``: "What is the last word: a b c d" -> "d", and ``reverse``: "Reverse the words: a b c" ->
  "c b a" (3 to 5 Python keywords and builtin names);
- ``doc``: "What does `module.function(signature)` do?" -> the first paragraph of its docstring (the
  standard library's own functions, read with ``inspect`` on this machine's Python).

Each conversation is a short system turn (:data:`SYSTEM`; the template's default one would be half
of every conversation), the prompt and the answer. They are split train / held-out by a hash of
the prompt (the same split for any set size), written as chat JSONL and tokenised with ``olmax
tokenize --chat`` (built-in OLMo 3 template) using the demo's BPE. That BPE has no
``<|im_start|>`` / ``<|im_end|>`` tokens (its 4096 tokens fill ``model.vocab_size``, so none can
be added, and reserving them would change ``olmax demo``'s tokenizer and numbers): the ChatML
markers are ordinary text, a few tokens each;
``<|endoftext|>`` (id 0, eos) ends each answer as in OLMo 3's template, and ``olmax chat`` /
``olmax generate --chat`` stop at ``<|im_end|>`` as text for such a tokenizer.

Training is recipe ``tiny_sft`` (packed documents, label masks, document masking, 2 epochs) with
``train.init_from`` the pre-trained weights. Then the SFT model answers a few held-out prompts
greedily through olmax's generator (as ``olmax chat`` would), the share of held-out answers that
are exactly right is counted per task, and the held-out loss on assistant tokens (the same packed
batches and label masks) is compared before (pre-trained weights) and after SFT: exit status 1
if SFT did not lower it.
"""

from __future__ import annotations

import builtins
import hashlib
import importlib
import inspect
import json
import keyword
import random
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

HELDOUT = 0.1
SEED = 0
TASKS = ("last", "reverse", "doc")
# A short system turn: the template's default one is 52 tokens of this BPE, half of a conversation.
SYSTEM = "You are a tiny demo model."
# Standard-library modules whose functions give the ``doc`` task (only those that import here).
DOC_MODULES = ("string", "textwrap", "json", "os.path", "math", "itertools", "functools", "collections", "re",
               "random", "statistics", "shutil", "fnmatch", "glob", "heapq", "bisect", "base64", "binascii",
               "html", "difflib", "operator", "calendar", "datetime", "copy", "keyword", "posixpath", "shlex",
               "struct", "zlib", "urllib.parse", "pathlib", "tempfile", "typing", "enum", "dataclasses",
               "inspect", "ast", "tokenize", "codecs", "locale", "gzip", "zipfile", "tarfile", "csv",
               "pprint", "reprlib", "types", "weakref", "contextlib", "abc", "numbers", "decimal",
               "fractions", "cmath", "time", "uuid", "hashlib", "hmac", "secrets", "ipaddress", "email.utils",
               "mimetypes", "platform", "sysconfig", "io", "os", "sys", "threading", "queue", "sched",
               "subprocess", "signal", "socket", "select", "logging", "warnings", "traceback", "unicodedata")


def _log(msg: str) -> None:
    print(f"demo sft: {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- the chat set


def task_words() -> list[str]:
    """The words of the synthetic tasks (and of ``olmax demo rl``'s): Python keywords and builtin names."""
    names = set(keyword.kwlist) | {n for n in dir(builtins) if n.isalpha() and n.islower()}
    return sorted(n for n in names if 2 <= len(n) <= 10)


def _doc_pairs() -> list[tuple[str, str]]:
    """(prompt, first docstring paragraph, at most 100 characters) of the public functions of
    :data:`DOC_MODULES`."""
    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for mod_name in DOC_MODULES:
            try:
                mod = importlib.import_module(mod_name)
            except Exception:  # noqa: BLE001 - a module this Python lacks (or cannot import) is skipped
                continue
            for name, fn in sorted(vars(mod).items()):
                if name.startswith("_") or not (inspect.isfunction(fn) or inspect.isbuiltin(fn)):
                    continue
                doc = inspect.getdoc(fn) or ""
                line = " ".join(doc.strip().split("\n\n")[0].split())  # the first paragraph
                if not (8 <= len(line) <= 100) or not line.isascii() or "(" in line[:len(name) + 1]:
                    continue  # no summary, or a builtin's signature line
                try:
                    sig = str(inspect.signature(fn))
                except (TypeError, ValueError):
                    sig = "(...)"
                if len(sig) > 60:
                    sig = "(...)"
                out.append((f"What does `{mod_name}.{name}{sig}` do?", line))
    return sorted(set(out))


def _is_heldout(prompt: str, share: float) -> bool:
    h = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "little")
    return h / 2**64 < share


def build_chat_set(synthetic: int, max_doc: int | None = None, heldout: float = HELDOUT, seed: int = SEED
                   ) -> tuple[list[dict], list[dict]]:
    """``(train, heldout)`` records ``{"messages", "task", "answer"}``: ``synthetic`` conversations
    of the ``last`` and ``reverse`` tasks (half each) and the ``doc`` ones (at most ``max_doc``),
    deterministic for the arguments and this Python (the docstrings are this machine's). The
    held-out list is shuffled too, so any first N of it mixes the tasks."""
    rng = random.Random(seed)
    words = task_words()
    items: dict[str, tuple[str, str]] = {}
    tries = 0
    while len(items) < synthetic and tries < 20 * synthetic:
        tries += 1
        ws = rng.sample(words, rng.randint(3, 5))
        if tries % 2:
            items.setdefault(f"What is the last word: {' '.join(ws)}", ("last", ws[-1]))
        else:
            items.setdefault(f"Reverse the words: {' '.join(ws)}", ("reverse", " ".join(reversed(ws))))
    docs = _doc_pairs()
    if max_doc is not None and len(docs) > max_doc:
        docs = sorted(rng.sample(docs, max_doc))
    for prompt, answer in docs:
        items.setdefault(prompt, ("doc", answer))
    train, held = [], []
    for prompt, (task, answer) in items.items():
        rec = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt},
                            {"role": "assistant", "content": answer}],
               "task": task, "answer": answer}
        (held if _is_heldout(prompt, heldout) else train).append(rec)
    rng.shuffle(train)   # the tasks interleaved (tiny_sft shuffles instances; this mixes documents)
    rng.shuffle(held)
    return train, held


def _write_jsonl(path: Path, records: list[dict]) -> None:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")


def prepare_chat(sft_dir: Path, tokenizer: Path, synthetic: int, max_doc: int | None) -> dict:
    """Chat JSONL and its tokenised folders under ``sft_dir/chat``; reused when built with the same
    settings and tokenizer (a different one is an error: delete the folder)."""
    return build_chat_folder(sft_dir / "chat", tokenizer, {"synthetic": synthetic, "max_doc": max_doc,
                                                             "heldout": HELDOUT, "seed": SEED},
                             lambda: build_chat_set(synthetic, max_doc), TASKS, _log)


def build_chat_folder(chat: Path, tokenizer: Path, settings: dict, build: Callable[[], tuple[list[dict], list[dict]]],
                      tasks: Sequence[str], log: Callable[[str], None] = _log) -> dict:
    """``chat/{train,heldout}.jsonl`` from ``build()`` (records with ``messages`` and ``task``),
    tokenised with ``olmax tokenize --chat`` into ``chat/{train,heldout}``; reused when ``chat``
    was built with the same ``settings`` and tokenizer (else an error: delete the folder). Returns
    per split its ``dir``, ``dtype``, token and mask files and ``records``."""
    from olmax.config import ConfigError
    from olmax.data.chat import summary, tokenize_chat
    spec = {**settings, "tokenizer_sha256": hashlib.sha256(tokenizer.read_bytes()).hexdigest(),
            "python": sys.version.split()[0]}
    spec_file = chat / "spec.json"
    if spec_file.exists():
        if json.loads(spec_file.read_text()) != spec:
            raise ConfigError(f"{chat} was built with other settings or another tokenizer ({spec_file}); delete "
                              f"{chat.parent} (or choose another --out) to build it again")
    else:
        if chat.exists():
            import shutil
            shutil.rmtree(chat)  # an interrupted build
        chat.mkdir(parents=True)
        train, held = build()
        for split, recs in (("train", train), ("heldout", held)):
            _write_jsonl(chat / f"{split}.jsonl", recs)
        parts = [f"{s} " + " + ".join(f"{sum(r['task'] == t for r in recs)} {t}" for t in tasks)
                 for s, recs in (("train", train), ("held-out", held))]
        log(f"chat set: {', '.join(parts)} conversations (held out by a hash of the prompt) in {chat}")
        for split in ("train", "heldout"):
            man = tokenize_chat([chat / f"{split}.jsonl"], chat / split, tokenizer=tokenizer, template="olmo3",
                                progress=False)
            log("tokenize --chat " + summary(man, chat / split))
        spec_file.write_text(json.dumps(spec, indent=1) + "\n")
    out: dict[str, Any] = {}
    for split in ("train", "heldout"):
        man = json.loads((chat / split / "manifest.json").read_text())
        out[split] = {"dir": str(chat / split), "dtype": man["dtype"],
                      "tokens": [str(chat / split / f["token_ids"]) for f in man["files"]],
                      "masks": [str(chat / split / f["labels_mask"]) for f in man["files"]],
                      "records": [json.loads(l) for l in (chat / f"{split}.jsonl").read_text().splitlines()]}
    return out


# --------------------------------------------------------------------------- the pre-trained run


def _newest_step(run: Path) -> int | None:
    d = run / "checkpoints"
    steps = [int(p.name) for p in d.iterdir() if p.is_dir() and p.name.isdigit()] if d.is_dir() else []
    return max(steps) if steps else None


def pretrained_run(demo_dir: Path, from_run: str | None, overrides: list[str], corpus_mb: float,
                   log: Callable[[str], None] = _log) -> Path:
    """The pre-trained tiny run: ``--from`` (a run directory, or a demo folder holding ``run``), or
    ``demo_dir/run``, trained (or finished) by ``olmax demo`` first when it has no final checkpoint.
    ``log``: the calling demo's progress line (``demo rl`` says its own name)."""
    from olmax.config import ConfigError
    if from_run is not None:
        run = Path(from_run)
        if _newest_step(run) is None and _newest_step(run / "run") is not None:
            run = run / "run"
        if _newest_step(run) is None:
            raise ConfigError(f"--from {from_run}: no checkpoint there (give a run directory of `olmax demo` or "
                              f"`olmax train tiny`)")
        log(f"starting from the pre-trained run {run} (checkpoint {_newest_step(run)})")
        return run
    run = demo_dir / "run"
    step = _newest_step(run)
    cfg_file = run / "config.yaml"
    if step is not None and cfg_file.is_file():
        from olmax.recipes import get_recipe
        if step >= get_recipe(str(cfg_file)).train.steps:
            log(f"starting from the demo's pre-trained run {run} (checkpoint {step})")
            return run
    log(f"no finished `olmax demo` run in {demo_dir}: running `olmax demo --run-dir {demo_dir}` first"
        + (f" (it resumes from checkpoint {step})" if step is not None else ""))
    from olmax.demos.pretrain import run_demo
    rc = run_demo(str(demo_dir), overrides, corpus_mb=corpus_mb)
    if _newest_step(run) is None:
        raise ConfigError(f"`olmax demo` left no checkpoint in {run}")
    if rc != 0:
        log("the pre-trained model did not beat the unigram baseline; fine-tuning it anyway")
    return run


# --------------------------------------------------------------------------- the stage


def verdict(before: float, after: float) -> int:
    """Exit status: 0 when SFT lowered the held-out assistant-token loss, 1 when it did not."""
    return 0 if after < before else 1


def _answers(model: Any, records: list[dict], max_new_tokens: int) -> list[str]:
    prompts = [model.codec.encode_chat(r["messages"][:-1]) for r in records]
    out = model.generate(prompts, max_new_tokens=max_new_tokens, chat=True, batch_size=16)
    return [r["text"].strip() for r in out]


def _show_answers(model: Any, run: Path, shown: list[dict], recs: list[dict], held: list[dict]) -> None:
    longest = max(len(model.codec.encode(r["answer"])) for r in held)
    texts = _answers(model, shown + recs, min(longest + 8, 96))
    if shown:
        _log(f"held-out prompts answered greedily by the SFT model (`olmax chat --checkpoint {run} "
             f"--system '{SYSTEM}'`):")
        for r, text in zip(shown, texts):
            ok = "right" if text == r["answer"] else "wrong"
            print(f"  user:      {r['messages'][1]['content']}\n  assistant: {text}\n  expected:  {r['answer']} "
                  f"({ok})", file=sys.stderr)
    if recs:
        got = texts[len(shown):]
        parts = []
        for t in TASKS:
            pairs = [(r, g) for r, g in zip(recs, got) if r["task"] == t]
            if pairs:
                right = sum(g == r["answer"] for r, g in pairs)
                parts.append(f"{t} {right}/{len(pairs)} ({right / len(pairs):.0%})")
        _log(f"held-out answers exactly right: {', '.join(parts)}")


def run_demo_sft(demo_dir: str, *, from_run: str | None = None, out: str | None = None,
                 overrides: list[str] = (), pretrain_overrides: list[str] = (), corpus_mb: float = 12.0,
                 synthetic: int = 3000, max_doc: int | None = None, show: int = 3, check: int = 200) -> int:
    """``olmax demo sft``; returns the exit status (see the module doc)."""
    from olmax.chat.codec import find_tokenizer
    from olmax.checkpoint.load import load_params
    from olmax.eval.heldout import HeldoutEvaluator
    from olmax.infer.run import Model
    from olmax.recipes import get_recipe
    from olmax.train.loop import train

    t0 = time.perf_counter()
    get_recipe("tiny_sft", list(overrides))  # a bad override is an error before pre-training, not after
    demo = Path(demo_dir)
    pre = pretrained_run(demo, from_run, list(pretrain_overrides), corpus_mb)
    pre_params, pre_cfg = load_params(str(pre))
    tok = find_tokenizer(str(pre), pre_cfg)
    if tok is None:
        from olmax.config import ConfigError
        raise ConfigError(f"the pre-trained run {pre} has no tokenizer beside its training data (the demo's "
                          f"`olmax tokenize` folder)")
    sft = Path(out) if out else demo / "sft"
    data = prepare_chat(sft, Path(tok), synthetic, max_doc)

    held = data["heldout"]
    base = [f"data.paths={data['train']['dir']}", f"data.dtype={data['train']['dtype']}",
            f"train.init_from=olmax:{pre}", f"eval.heldout_paths={','.join(held['tokens'])}",
            f"eval.heldout_label_mask_paths={','.join(held['masks'])}"]
    cfg = get_recipe("tiny_sft", base + list(overrides))
    if cfg.model != pre_cfg.model:
        from olmax.config import ConfigError
        raise ConfigError(f"the pre-trained run {pre} is not the tiny model tiny_sft fine-tunes")
    _log(f"recipe tiny_sft: {cfg.train.epochs or 0} epochs of packed {cfg.data.sequence_length}-token instances, "
         f"{cfg.train.global_batch_size} a step, lr {cfg.optim.lr:g}, from {pre}; run directory {sft / 'run'}")
    evaluator = HeldoutEvaluator(cfg, batches=0)  # every whole batch of the held-out conversations
    before = evaluator.evaluate_detailed(pre_params)
    _log(f"held-out loss on assistant tokens before SFT: {before['loss']:.3f} nats/token "
         f"({before['tokens']:,} tokens)")

    train(cfg, sft / "run")
    sft_params, _ = load_params(str(sft / "run"))
    after = evaluator.evaluate_detailed(sft_params)

    # Answers through olmax's generator and the chat template, greedily (as `olmax chat` answers).
    recs = held["records"][:check]
    shown: list[dict] = []
    for t in TASKS:  # one prompt of each task
        shown += [r for r in held["records"] if r["task"] == t][:1]
    shown = shown[:show]
    if shown or recs:
        _show_answers(Model(str(sft / "run")), sft / "run", shown, recs, held["records"])
    rc = verdict(before["loss"], after["loss"])
    word = "lowered" if rc == 0 else "did NOT lower"
    _log(f"held-out loss on assistant tokens: {before['loss']:.3f} before SFT, {after['loss']:.3f} after "
         f"({word}; {after['tokens']:,} tokens); {time.perf_counter() - t0:.0f} s")
    return rc
