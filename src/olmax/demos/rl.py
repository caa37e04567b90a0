"""``olmax demo rl``: a verifiable task for the demo's tiny OLMo 3, an SFT warm start that leaves
it partly right, a DPO stage, RL, and held-out accuracy with a standard error after each.

The task (``count``): "How many words: w1 ... wn" -> "n", with 2 to 6 distinct Python keywords
and builtin names (``olmax.demos.sft.task_words``; 29 of the 108 are several tokens of the demo's
BPE, so the model counts words, not tokens). The answer is one token, checked exactly
(``exact_match``), and there are five of them: a model that has learned part of the rule is
right on some samples of a prompt and wrong on others, which is what GRPO needs (a group of 8
samples with mixed rewards). Chosen by measurement (2-core CPU, the demo's 500-step pre-trained
run, recipe ``tiny_sft`` at lr 1e-3; exact greedy answers on 60-200 held-out prompts of each;
first the four tasks mixed for 150 updates, then alone):

- count, "How many words: ...": 65% mixed; alone 49% after 40 updates, 61% after 80;
- first, "What is the first word: ...": 3% mixed; alone 0% after 20, 40 and 60;
- last, "What is the last word: ...": 8% mixed;
- alpha, "Which comes first in the alphabet: a or b": 15% mixed (answering either word: 50%);
- which, "Which word is a keyword: a b c d" -> "1".."4": alone 19-24% after 20-60 (chance 25%).

Copying a word out of the prompt is not learned in minutes at this size (``olmax demo sft``
finds the same), nor is finding the keyword among builtins; counting is, partly: its errors are
mostly the neighbouring counts.

Prompts are split train / held-out by a hash of the prompt (:func:`is_heldout`, the same split
for any set size), written as chat JSONL (tokenised with ``olmax tokenize --chat`` for SFT by
``olmax.demos.sft.build_chat_folder``) and as RL prompt files, one JSON object a line:
``{"messages": [{"role": "system", ...}, {"role": "user", ...}], "ground_truth": "4"}``
(``train.objective=grpo`` with ``rl.prompts_path``, reward ``exact_match``).

The warm start (:func:`warm_start`) fine-tunes ``olmax demo``'s pre-trained run with recipe
``tiny_sft`` for a fixed, short number of updates (:data:`SFT_STEPS`), which leaves held-out
accuracy partial. :func:`heldout_accuracy` measures it: k samples of each held-out prompt
through olmax's KV-cache generator, scored as the RL loop scores them, mean and standard error
over prompts (:func:`mean_se`).

Measured (2026-12-01, this 2-core CPU shared with other jobs; the demo's 500-step run; 200
held-out prompts, 8 samples each at temperature 1): the warm start (:data:`SFT_STEPS` = 25
updates) takes 58 s and leaves accuracy **0.260 +- 0.012** (greedy 0.495 +- 0.035); after 20
updates 0.205 +- 0.011 (greedy 0.440), after 40 0.359 +- 0.016 (greedy 0.520). RL with
:func:`rl_overrides` (recipe ``tiny_rl``: 16 prompts x 8 samples a step, lr 3e-4 constant, 30
steps; 292 s, about 2.5 s generating and 6 s training a step) raised it to **0.375 +- 0.026**:
+0.115, 4.0 standard errors (unpaired, sqrt(se_before^2 + se_after^2)), 4.9 paired
(:func:`paired_gain`). Greedy accuracy fell to 0.390 +- 0.035: RL at this size concentrates the
policy on what it tells apart best, the shortest and longest lists (right in 87% and 62% of the
samples after RL, 35% and 22% before), and answers the middle counts 3 and 4 with 2 and 6 more
often than before. From 20 updates: 0.205 -> 0.359 (6.0 standard errors), greedy 0.440 -> 0.390;
from 40, at lr 3e-4: 0.359 -> 0.425 (2.3), at lr 1e-3: 0.359 -> 0.404 (1.6).

The DPO stage (:func:`dpo_stage`, between the warm start and RL; ``olmax demo rl --dpo-steps``)
lowers the sampled accuracy on this task (measured 2026-12-01 from the same warm start, 0.260:
10 updates at lr 1e-4 0.226, 40 updates 0.181, a uniformly drawn wrong count rejected 0.194,
lr 1e-5 0.254): the chosen answer's log-probability falls with the rejected one while the
margin grows. RL from the DPO run still rises by more than 3 standard errors (0.226 -> 0.356).
"""

from __future__ import annotations

import hashlib
import json
import math
import random
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from olmax.demos.sft import SYSTEM, task_words

TASK = "count"
N_PROMPTS = 3000          # distinct prompts generated, before the split
HELDOUT = 0.2             # share held out (by the prompt's hash)
SEED = 0
SFT_STEPS = 25            # tiny_sft updates of the warm start (16 packed 256-token instances each)
EVAL_PROMPTS = 200        # held-out prompts measured
EVAL_K = 8                # samples per prompt (the RL group size)
# The RL stage as measured (recipe tiny_rl; see the module doc): prompts of 64-75 tokens.
DPO_STEPS = 10           # tiny_dpo updates between the warm start and RL (0: none)
# The DPO stage (recipe tiny_dpo: 8 pairs a step, lr 1e-4 with 4 warm-up steps then linear decay,
# beta 5, length-normalised): one pair a train prompt, the right count chosen and a neighbouring
# count rejected (delta learning: the warm start's usual mistake is a neighbouring count).
DPO_SETTINGS = ("data.sequence_length=96",)
RL_SETTINGS = ("rl.group_size=8", "rl.prompts_per_step=16", "train.global_batch_size=128", "train.steps=30",
               "optim.lr=3e-4", "data.sequence_length=96", "rl.max_prompt_length=88", "rl.max_response_length=8")


def _log(msg: str) -> None:
    print(f"demo rl: {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- the task


def _count(rng: random.Random, words: list[str]) -> tuple[str, str]:
    ws = rng.sample(words, rng.randint(2, 6))
    return f"How many words: {' '.join(ws)}", str(len(ws))


def _first(rng: random.Random, words: list[str]) -> tuple[str, str]:
    ws = rng.sample(words, rng.randint(3, 5))
    return f"What is the first word: {' '.join(ws)}", ws[0]


def _last(rng: random.Random, words: list[str]) -> tuple[str, str]:
    ws = rng.sample(words, rng.randint(3, 5))
    return f"What is the last word: {' '.join(ws)}", ws[-1]


def _alpha(rng: random.Random, words: list[str]) -> tuple[str, str]:
    a, b = rng.sample(words, 2)
    return f"Which comes first in the alphabet: {a} or {b}", min(a, b)


def _which(rng: random.Random, words: list[str]) -> tuple[str, str]:
    import keyword
    kws = [w for w in words if keyword.iskeyword(w)]
    ws = rng.sample([w for w in words if not keyword.iskeyword(w)], 3)
    pos = rng.randint(0, 3)
    ws.insert(pos, rng.choice(kws))
    return f"Which word is a keyword: {' '.join(ws)}", str(pos + 1)


# The demo's task and the candidates it was measured against (see the module doc).
TASKS: dict[str, Callable[[random.Random, list[str]], tuple[str, str]]] = {
    "count": _count, "first": _first, "last": _last, "alpha": _alpha, "which": _which}


def is_heldout(prompt: str, share: float = HELDOUT) -> bool:
    """Held out when the first 8 bytes of the prompt's sha256, little-endian, / 2**64 < ``share``."""
    h = int.from_bytes(hashlib.sha256(prompt.encode()).digest()[:8], "little")
    return h / 2**64 < share


def build_task_set(n: int = N_PROMPTS, tasks: Sequence[str] = (TASK,), heldout: float = HELDOUT,
                   seed: int = SEED) -> tuple[list[dict], list[dict]]:
    """``(train, heldout)`` chat records ``{"messages": [system, user, assistant], "task",
    "answer"}``: ``n`` distinct prompts (the tasks in turn), split by :func:`is_heldout`, each list
    shuffled; deterministic for the arguments (and the Python version's keyword and builtin names)."""
    unknown = [t for t in tasks if t not in TASKS]
    if unknown or not tasks:
        raise ValueError(f"tasks {list(tasks)}: choose from {', '.join(TASKS)}")
    rng = random.Random(seed)
    words = task_words()
    items: dict[str, tuple[str, str]] = {}
    tries = 0
    while len(items) < n and tries < 20 * n:
        task = tasks[tries % len(tasks)]
        tries += 1
        prompt, answer = TASKS[task](rng, words)
        items.setdefault(prompt, (task, answer))
    train, held = [], []
    for prompt, (task, answer) in items.items():
        rec = {"messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt},
                            {"role": "assistant", "content": answer}], "task": task, "answer": answer}
        (held if is_heldout(prompt, heldout) else train).append(rec)
    rng.shuffle(train)
    rng.shuffle(held)
    return train, held


# --------------------------------------------------------------------------- prompts files


def prompt_record(rec: dict) -> dict:
    """The RL prompt of a chat record: ``{"messages": [system, user], "ground_truth": answer}``."""
    return {"messages": [m for m in rec["messages"] if m["role"] != "assistant"], "ground_truth": rec["answer"]}


def write_prompts(path: Path, records: Sequence[dict]) -> None:
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(prompt_record(r)) + "\n")


def read_prompts(path: str | Path) -> list[dict]:
    """The lines of a prompts JSONL file (``messages`` and ``ground_truth``)."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


# --------------------------------------------------------------------------- held-out accuracy


def _decoder(model: Any, tokenizer: Any) -> tuple[Any, Any, Any, Any]:
    """(params, model config, data config, codec) of a run or checkpoint path, an
    ``olmax.infer.run.Model``, or a ``(params, Config)`` pair (then ``tokenizer`` is needed: a
    ``tokenizer.json`` path, a folder holding one, or a ``TextCodec``)."""
    from dataclasses import replace

    from olmax.chat.codec import TextCodec
    from olmax.infer.run import Model
    if isinstance(model, (str, Path)):
        given = None if tokenizer is None or isinstance(tokenizer, TextCodec) else str(tokenizer)
        model = Model(str(model), tokenizer=given)
        if model.codec is None and tokenizer is None:  # an RL run: its rl.tokenizer, or its init_from's
            tokenizer = _rl_tokenizer(model.cfg)
            if tokenizer is None:
                from olmax.config import ConfigError
                raise ConfigError(f"held-out accuracy: no tokenizer for {model.checkpoint}; pass tokenizer=")
            model.codec = TextCodec.load(tokenizer, model.cfg)
    if isinstance(model, Model):
        codec = tokenizer if isinstance(tokenizer, TextCodec) else model.codec
        return model.params, model.cfg.model, model.cfg.data, codec
    params, cfg = model
    import jax
    dtype = str(jax.tree.leaves(params)[0].dtype)  # decode in the parameters' dtype, as olmax generate does
    mcfg = replace(cfg.model, remat="none", param_dtype=dtype, compute_dtype=dtype)
    if tokenizer is None:
        from olmax.config import ConfigError
        raise ConfigError("held-out accuracy of (params, config) needs the tokenizer")
    codec = tokenizer if isinstance(tokenizer, TextCodec) else TextCodec.load(tokenizer, cfg)
    return params, mcfg, cfg.data, codec


def _rl_tokenizer(cfg: Any) -> str | None:
    """The tokenizer of an RL run (``rl.tokenizer``, else the one of ``train.init_from``), or None."""
    from olmax.chat.codec import find_tokenizer
    rl = getattr(cfg, "rl", None)
    if rl is not None and rl.tokenizer:
        return rl.tokenizer
    kind, _, rest = (cfg.train.init_from or "").partition(":")
    if kind in ("olmax", "state") and rest:  # the warm start's run: the tokenizer beside its data
        from olmax.recipes import get_recipe
        conf = Path(rest, "config.yaml")
        found = find_tokenizer(rest, get_recipe(str(conf)) if conf.is_file() else None)
        return str(found) if found is not None else None
    return None


def sample_rewards(model: Any, prompts: Sequence[dict], k: int = 8, seed: int = 0, *, temperature: float = 1.0,
                   max_new_tokens: int | None = None, reward: str = "exact_match", tokenizer: Any = None,
                   batch_size: int = 64, generator: Any = None) -> Any:
    """Rewards ``[len(prompts), k]`` (numpy) of ``k`` completions of each prompt (``messages`` through
    the chat template, scored against ``ground_truth`` by ``olmax.rl.rewards.get_reward(reward)``).
    Completions are drawn by olmax's KV-cache generator at ``temperature`` (0: greedy, and ``k`` is
    1), completion ``i * k + j`` with the key of ``seed`` folded with that index, so the draw
    repeats for the same arguments; decoding stops at EOS or ``<|im_end|>`` (the token, or the text
    when the tokenizer has no such token), and the text is scored as the RL loop scores it
    (``olmax.rl.rollout.completion_text``: special tokens dropped, cut at ``<|im_end|>``).
    ``max_new_tokens``: by default the longest gold answer's tokens + 4. ``generator``: an
    ``olmax.engine.decoder`` holding the same weights, to reuse its compiled programs."""
    import numpy as np

    from olmax.chat.template import IM_END
    from olmax.engine import Sampling, generate
    from olmax.infer.run import first_stop
    from olmax.rl.rewards import get_reward
    from olmax.rl.rollout import completion_text
    params, mcfg, dcfg, codec = _decoder(model, tokenizer)
    greedy = not temperature
    k = 1 if greedy else k
    if k < 1 or not prompts:
        raise ValueError(f"need k >= 1 and at least one prompt (k={k}, {len(prompts)} prompts)")
    ids = [codec.encode_chat(p["messages"]) for p in prompts]
    if max_new_tokens is None:
        max_new_tokens = max(len(codec.encode(str(p["ground_truth"]))) for p in prompts) + 4
    im_end = codec.token_id(IM_END)
    eos = [dcfg.eos_token_id] + ([im_end] if im_end is not None else [])
    stops = [] if im_end is not None else [IM_END]
    tail = 4 * len(IM_END) + 4

    def stop(i: int, toks: list[int]) -> bool:
        return bool(stops) and first_stop(codec.decode(toks[-tail:]), stops) is not None

    out = generate(params, mcfg, [p for p in ids for _ in range(k)], max_new_tokens=max_new_tokens,
                   sampling=Sampling(temperature=None if greedy else temperature, seed=seed), eos_ids=eos,
                   batch_size=batch_size, stop=stop if stops else None, generator=generator)
    fn = get_reward(reward, timeout_s=None)
    scores = np.zeros((len(prompts), k))
    for n, c in enumerate(out):  # the text the RL loop scores: special tokens dropped, cut at <|im_end|>
        scores[n // k, n % k] = fn(completion_text(codec, c.token_ids, ()), str(prompts[n // k]["ground_truth"]))
    return scores


def mean_se(scores: Any) -> tuple[float, float]:
    """Mean and standard error of rewards ``[N, k]``: p_i = the mean of prompt i's k rewards,
    mean = (1/N) sum p_i, se = sqrt(sum (p_i - mean)^2 / (N (N - 1))), the standard error of a
    mean over N independent prompts (the k samples of one prompt are not independent of each
    other; this counts each prompt once). 0 when N is 1."""
    import numpy as np
    p = np.asarray(scores, np.float64).reshape(len(scores), -1).mean(axis=1)
    n = len(p)
    return float(p.mean()), float(p.std(ddof=1) / math.sqrt(n)) if n > 1 else 0.0


def paired_gain(before: Any, after: Any) -> tuple[float, float]:
    """Mean gain and its standard error from rewards ``[N, k]`` before and after on the same
    prompts: :func:`mean_se` of the per-prompt differences (smaller than the unpaired
    sqrt(se_before^2 + se_after^2) when prompts differ in difficulty)."""
    import numpy as np
    b = np.asarray(before, np.float64).reshape(len(before), -1).mean(axis=1)
    a = np.asarray(after, np.float64).reshape(len(after), -1).mean(axis=1)
    return mean_se((a - b)[:, None])


def heldout_accuracy(model: Any, prompts: Sequence[dict] | str | Path, k: int = 8, seed: int = 0,
                     **kw: Any) -> tuple[float, float]:
    """``(mean, se)`` of the exact-match accuracy of ``k`` samples (temperature 1.0 by default,
    the RL sampling temperature; ``temperature=0`` for greedy) on each held-out prompt (a list of
    prompt records or a prompts JSONL file). ``model``: a run or checkpoint directory, an
    ``olmax.infer.run.Model``, or ``(params, Config)`` with ``tokenizer=``. See
    :func:`sample_rewards` for the other options and :func:`mean_se` for the formula."""
    if isinstance(prompts, (str, Path)):
        prompts = read_prompts(prompts)
    return mean_se(sample_rewards(model, prompts, k, seed, **kw))


# --------------------------------------------------------------------------- the warm start


def warm_start(demo_dir: str | Path, *, from_run: str | None = None, out: str | Path | None = None,
               overrides: Sequence[str] = (), pretrain_overrides: Sequence[str] = (), corpus_mb: float = 12.0,
               n: int = N_PROMPTS, steps: int = SFT_STEPS, task: str = TASK) -> dict[str, Any]:
    """The task's prompts and the SFT warm start, in ``out`` (default ``demo_dir/rl``):
    ``chat/`` (chat JSONL and its ``olmax tokenize --chat`` folders), ``prompts/train.jsonl`` and
    ``prompts/heldout.jsonl`` (RL prompt files), and the run ``sft/`` (recipe ``tiny_sft``,
    ``steps`` updates from the pre-trained run: ``--from``, or ``demo_dir/run``, made by ``olmax
    demo`` first when missing). Everything is reused when present (the run resumes or is done).
    Returns the paths (``sft``, ``pretrained``, ``tokenizer``, ``train_prompts``,
    ``heldout_prompts``, ``chat``) and ``seconds`` (the wall time of this call)."""
    from olmax.chat.codec import find_tokenizer
    from olmax.config import ConfigError
    from olmax.demos.sft import build_chat_folder, pretrained_run
    from olmax.recipes import get_recipe
    from olmax.train.loop import train

    t0 = time.perf_counter()
    demo = Path(demo_dir)
    out = Path(out) if out is not None else demo / "rl"
    pre = pretrained_run(demo, from_run, list(pretrain_overrides), corpus_mb)
    pre_cfg = get_recipe(str(pre / "config.yaml")) if (pre / "config.yaml").is_file() else None
    tok = find_tokenizer(str(pre), pre_cfg)
    if tok is None:
        raise ConfigError(f"the pre-trained run {pre} has no tokenizer beside its training data (the demo's "
                          f"`olmax tokenize` folder)")
    settings = {"task": task, "n": n, "heldout": HELDOUT, "seed": SEED}
    data = build_chat_folder(out / "chat", Path(tok), settings, lambda: build_task_set(n, (task,)), (task,), _log)
    prompts = out / "prompts"
    prompts.mkdir(parents=True, exist_ok=True)
    paths = {}
    for split in ("train", "heldout"):
        paths[split] = prompts / f"{split}.jsonl"
        write_prompts(paths[split], data[split]["records"])  # cheap, and always what the chat set holds
    cfg = get_recipe("tiny_sft", [f"data.paths={data['train']['dir']}", f"data.dtype={data['train']['dtype']}",
                                  f"train.init_from=olmax:{pre}", "train.epochs=null", f"train.steps={steps}",
                                  *overrides])
    _log(f"warm start: recipe tiny_sft, {cfg.train.steps} updates of {cfg.train.global_batch_size} packed "
         f"{cfg.data.sequence_length}-token instances, lr {cfg.optim.lr:g}, from {pre}; run directory {out / 'sft'}")
    train(cfg, out / "sft", progress=False)
    return {"sft": out / "sft", "pretrained": pre, "tokenizer": Path(tok), "chat": out / "chat",
            "train_prompts": paths["train"], "heldout_prompts": paths["heldout"],
            "seconds": time.perf_counter() - t0}


def preference_record(rec: dict, rng: random.Random) -> dict:
    """A DPO pair of a count record: the prompt, the right count chosen, a neighbouring count
    (one more or one less, within 2..6) rejected."""
    n = int(rec["answer"])
    wrong = [m for m in (n - 1, n + 1) if 2 <= m <= 6]
    return {"prompt": [m for m in rec["messages"] if m["role"] != "assistant"], "chosen": rec["answer"],
            "rejected": str(rng.choice(wrong))}


def dpo_stage(start: dict[str, Any], *, steps: int = DPO_STEPS, overrides: Sequence[str] = ()) -> Path:
    """DPO from the warm start (recipe ``tiny_dpo``, the warm start as policy and reference) on
    one :func:`preference_record` per train prompt, written to ``dpo_pairs.jsonl`` and tokenised
    with ``olmax tokenize --chat --preference`` into ``dpo_pairs/`` beside the warm start's run;
    the run is ``dpo/`` there (resumed, or reused when done). Returns the run directory."""
    from olmax.data.chat import summary, tokenize_chat
    from olmax.recipes import get_recipe
    from olmax.train.loop import train

    root = Path(start["sft"]).parent
    pairs, folder = root / "dpo_pairs.jsonl", root / "dpo_pairs"
    if not (folder / "manifest.json").is_file():
        rng = random.Random(SEED)
        records = [json.loads(line) for line in (Path(start["chat"]) / "train.jsonl").read_text().splitlines()]
        pairs.write_text("".join(json.dumps(preference_record(r, rng)) + "\n" for r in records))
        if folder.exists():  # an interrupted build
            import shutil
            shutil.rmtree(folder)
        man = tokenize_chat([pairs], folder, tokenizer=start["tokenizer"], template="olmo3", preference=True,
                            progress=False)
        _log("tokenize --chat --preference " + summary(man, folder))
    cfg = get_recipe("tiny_dpo", [f"data.preference_path={folder}", f"train.init_from=olmax:{start['sft']}",
                                  f"train.steps={steps}", *DPO_SETTINGS, *overrides])
    run = root / "dpo"
    _log(f"DPO: recipe tiny_dpo, {cfg.train.steps} updates of {cfg.train.global_batch_size} pairs, lr "
         f"{cfg.optim.lr:g}, beta {cfg.dpo.beta:g} ({cfg.dpo.loss}), from the warm start; run directory {run}")
    train(cfg, run, progress=False)
    return run


def report_accuracy(model: Any, heldout_prompts: str | Path | Sequence[dict], *, n: int = EVAL_PROMPTS,
                    k: int = EVAL_K, seed: int = SEED, label: str = "", **kw: Any) -> dict[str, float]:
    """Held-out accuracy of the first ``n`` prompts: ``k`` samples at temperature 1.0 and greedy,
    each as (mean, se); logged and returned as ``accuracy``, ``accuracy_se``, ``greedy``,
    ``greedy_se``, ``prompts``, ``k``, ``seconds``."""
    t0 = time.perf_counter()
    prompts = read_prompts(heldout_prompts) if isinstance(heldout_prompts, (str, Path)) else list(heldout_prompts)
    prompts = prompts[:n]
    m, se = heldout_accuracy(model, prompts, k, seed, **kw)
    g, gse = heldout_accuracy(model, prompts, 1, seed, temperature=0.0, **kw)
    res = {"accuracy": m, "accuracy_se": se, "greedy": g, "greedy_se": gse, "prompts": len(prompts), "k": k,
           "seconds": time.perf_counter() - t0}
    _log(f"held-out accuracy{' ' + label if label else ''}: {m:.3f} +- {se:.3f} ({k} samples at temperature 1 "
         f"of each of {len(prompts)} prompts), greedy {g:.3f} +- {gse:.3f}; {res['seconds']:.0f} s")
    return res


def rl_overrides(start: dict[str, Any], init: str | Path | None = None) -> list[str]:
    """Overrides of recipe ``tiny_rl`` for RL from :func:`warm_start`'s result: the weights of
    ``init`` (default the warm start's), its train prompts and tokenizer, and :data:`RL_SETTINGS`."""
    return [f"train.init_from=olmax:{init or start['sft']}", f"rl.prompts_path={start['train_prompts']}",
            f"rl.tokenizer={start['tokenizer']}", *RL_SETTINGS]


# --------------------------------------------------------------------------- the demo


def run_demo_rl(demo_dir: str, *, from_run: str | None = None, out: str | None = None, overrides: Sequence[str] = (),
                pretrain_overrides: Sequence[str] = (), corpus_mb: float = 12.0, n_eval: int = EVAL_PROMPTS,
                k: int = EVAL_K, n: int = N_PROMPTS, sft_steps: int = SFT_STEPS, dpo_steps: int = DPO_STEPS,
                as_json: bool = False) -> int:
    """``olmax demo rl``: SFT -> DPO -> RL. The warm start, held-out accuracy, DPO
    (:func:`dpo_stage`, ``dpo_steps`` updates; none when 0) and held-out accuracy again, RL
    (recipe ``tiny_rl`` with :func:`rl_overrides` from the DPO run, then ``overrides``), held-out
    accuracy at the end. Exit status 1 unless RL raised the accuracy at temperature 1 over its
    own start by more than 3 standard errors (unpaired); ``as_json`` prints the figures as one
    JSON object on stdout (``accuracy_before`` is the SFT start, ``accuracy_after`` the RL end)."""
    from olmax import jsonout
    from olmax.recipes import get_recipe
    from olmax.train.loop import train

    t0 = time.perf_counter()
    # The RL stage's overrides are checked before any stage runs: a bad key or value would
    # otherwise be found only after pre-training, the warm start and DPO.
    get_recipe("tiny_rl", [*RL_SETTINGS, *overrides])
    ws = warm_start(demo_dir, from_run=from_run, out=out, pretrain_overrides=pretrain_overrides, corpus_mb=corpus_mb,
                    n=n, steps=sft_steps)
    before = report_accuracy(ws["sft"], ws["heldout_prompts"], n=n_eval, k=k, label="after the SFT warm start",
                             tokenizer=ws["tokenizer"])
    init, start = ws["sft"], before
    dpo = None
    if dpo_steps:
        init = dpo_stage(ws, steps=dpo_steps)
        dpo = start = report_accuracy(str(init), ws["heldout_prompts"], n=n_eval, k=k, label="after DPO",
                                      tokenizer=ws["tokenizer"])
    cfg = get_recipe("tiny_rl", [*rl_overrides(ws, init), *overrides])
    run = Path(ws["sft"]).parent / "rl_run"
    _log(f"RL: recipe tiny_rl, {cfg.train.steps} steps of {cfg.rl.prompts_per_step} prompts x {cfg.rl.group_size} "
         f"samples, lr {cfg.optim.lr:g}, reward {cfg.rl.reward}, from {init}; run directory {run}")
    train(cfg, run)
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    gaps = [r["rl/max_logprob_gap"] for r in rows if "rl/max_logprob_gap" in r]
    after = report_accuracy(str(run), ws["heldout_prompts"], n=n_eval, k=k, label="after RL",
                            tokenizer=ws["tokenizer"])
    gain = after["accuracy"] - start["accuracy"]
    se = math.sqrt(start["accuracy_se"] ** 2 + after["accuracy_se"] ** 2)
    ok = gain > 3 * se
    res = {"accuracy_before": before["accuracy"], "accuracy_after": after["accuracy"],
           "accuracy_before_se": before["accuracy_se"], "accuracy_after_se": after["accuracy_se"],
           "accuracy_after_dpo": dpo["accuracy"] if dpo else None,
           "accuracy_after_dpo_se": dpo["accuracy_se"] if dpo else None,
           "gain": gain, "gain_se": se, "greedy_before": before["greedy"], "greedy_after": after["greedy"],
           "greedy_before_se": before["greedy_se"], "greedy_after_se": after["greedy_se"],
           "greedy_after_dpo": dpo["greedy"] if dpo else None, "dpo_steps": dpo_steps,
           "max_logprob_gap": max(gaps) if gaps else None, "rl_steps": len(rows), "prompts": before["prompts"],
           "samples_per_prompt": k, "improved": ok, "seconds": time.perf_counter() - t0}
    chain = (f"{before['accuracy']:.3f} +- {before['accuracy_se']:.3f} after SFT, "
             + (f"{dpo['accuracy']:.3f} +- {dpo['accuracy_se']:.3f} after DPO, " if dpo else "")
             + f"{after['accuracy']:.3f} +- {after['accuracy_se']:.3f} after RL")
    _log(f"held-out accuracy at temperature 1: {chain}; RL {gain:+.3f} = {gain / se if se else 0:.1f} standard errors "
         f"({'improved' if ok else 'NOT improved by 3 standard errors'}); greedy {before['greedy']:.3f} -> "
         + (f"{dpo['greedy']:.3f} -> " if dpo else "") + f"{after['greedy']:.3f}; largest |generation - training| "
         f"log-prob {res['max_logprob_gap']:.1e}; {res['seconds']:.0f} s")
    if as_json:
        print(jsonout.dumps(res, indent=2))
    return 0 if ok else 1
