"""``olmax eval lm-eval``: lm-eval-harness tasks on an olmax checkpoint, and the reproduction's suites.

The ``olmo3`` suite is the 8 tasks the published reproduction checked at every milestone: MMLU
5-shot, then HellaSwag, ARC-easy, ARC-challenge, OpenBookQA, PIQA, BoolQ and WinoGrande zero-shot.
The ``olmo3-adapt`` suite is the post-training evaluation, modelled on OLMES ``olmo3:adapt`` with the
tasks lm-eval has (GSM8K CoT, Minerva MATH, IFEval, BBH CoT, MMLU CoT, HumanEval+, AIME 2024/2025),
every prompt rendered through the chat template (docs/evaluation.md lists each task's settings).
Datasets come from the local HF cache (machines here have no network); a task whose dataset or
scoring package is missing fails before any weights are loaded, with its name in the error.

Chat format (``--apply-chat-template [TEMPLATE]``, ``--system-instruction``,
``--fewshot-as-multiturn``) is passed to lm-eval's ``simple_evaluate`` as its own CLI passes it for
``--model hf``: few-shot examples become turns of the conversation unless
``--no-fewshot-as-multiturn``.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from olmax import jsonout
from olmax.argtypes import positive_int
from olmax.chat.template import BUILTIN_TEMPLATES
from olmax.config import ConfigError
from olmax.extras import require
from olmax.io import is_remote


@dataclass(frozen=True)
class Suite:
    """A named task list: (lm-eval task, num_fewshot) pairs, None keeping the task's own default;
    ``chat``: prompts go through the chat template; ``max_gen_toks``: the generation budget of tasks
    that set none themselves (None: the adapter's default); ``local``: some tasks are olmax's own
    YAMLs (``LOCAL_TASKS_DIR``, indexed without ``--include-path``)."""

    tasks: tuple[tuple[str, int | None], ...]
    chat: bool = False
    max_gen_toks: int | None = None
    local: bool = False


SUITES: dict[str, Suite] = {
    "olmo3": Suite((("mmlu", 5), ("hellaswag", 0), ("arc_easy", 0), ("arc_challenge", 0), ("openbookqa", 0),
                    ("piqa", 0), ("boolq", 0), ("winogrande", 0))),
    # OLMES olmo3:adapt's tasks that lm-eval 0.4.13 has; docs/evaluation.md gives each one's settings
    # and where they differ from OLMES's.
    "olmo3-adapt": Suite((("mmlu_flan_cot_zeroshot", None), ("bbh_cot_fewshot", None), ("gpqa_main_cot_zeroshot", None),
                          ("minerva_math", None), ("gsm8k_cot_llama", 0), ("aime24", None), ("aime25", None),
                          ("olmax_humaneval_plus_instruct", None), ("mbpp_plus_instruct", None), ("ifeval", None)),
                         chat=True, max_gen_toks=4096, local=True),
}
DEFAULT_SUITE = "olmo3"
# The local test tasks (``--include-path`` this directory; tag ``olmax_local``).
LOCAL_TASKS_DIR = Path(__file__).resolve().parent / "tasks"
ACC_KEYS = ("acc", "acc_norm")


@functools.lru_cache(maxsize=4)
def task_manager(include_paths: tuple[str, ...] = ()) -> Any:
    """A TaskManager over lm-eval's tasks plus ``include_paths`` (cached: indexing lm-eval's ~15k
    task files takes tens of seconds, and the index does not change within a process)."""
    from lm_eval.tasks import TaskManager
    return TaskManager(include_path=list(include_paths) or None)


def _dataset_errors() -> tuple[type[BaseException], ...]:
    from datasets.exceptions import DatasetNotFoundError
    # Offline (HF_HUB_OFFLINE / HF_DATASETS_OFFLINE) a missing dataset raises ConnectionError;
    # without a network at all it is a ConnectionError or a timeout (OSError).
    return ConnectionError, DatasetNotFoundError, OSError


def load_tasks(entries: list[tuple[str, int | None]], tm: Any) -> list[tuple[str, int | None, list[Any]]]:
    """Build every task (this loads its dataset); report all unknown tasks and all missing datasets
    at once, each by task name."""
    known = set(tm.all_tasks)
    unknown = [name for name, _ in entries if name not in known]
    if unknown:
        raise ConfigError(f"unknown lm-eval task(s): {', '.join(unknown)}; local task YAMLs need --include-path DIR")
    built, missing, imports = [], [], []
    for name, shots in entries:
        try:
            loaded = tm.load([name])
        except ImportError as e:
            # A task's scoring module needs a package (ifeval: langdetect, immutabledict).
            imports.append(f"{name} ({type(e).__name__}: {e})")
            continue
        except (AssertionError, ValueError) as e:
            # minerva_math asserts its antlr4 version at import; HF evaluate's code_eval (HumanEval,
            # MBPP) refuses to load without HF_ALLOW_CODE_EVAL=1.
            hint = ": pass --confirm-run-unsafe-code" if "HF_ALLOW_CODE_EVAL" in str(e) else ""
            imports.append(f"{name} ({e}{hint})")
            continue
        except _dataset_errors() as e:
            # HumanEval and MBPP score with HF evaluate's code_eval, itself fetched from the Hub.
            what = "HF evaluate's code_eval metric is not cached: " if "code_eval" in str(e) else ""
            missing.append(f"{name} ({what}{e})")
            continue
        # A group is passed on whole (lm-eval aggregates it); a task or a tag as its leaf tasks.
        objs = [loaded["groups"][name]] if name in loaded.get("groups", {}) else list(loaded["tasks"].values())
        built.append((name, shots, objs))
    if imports:
        raise ConfigError("cannot load the scoring code of task(s): " + "; ".join(imports) + ". Install the "
                          "packages they name in this environment")
    if missing:
        raise ConfigError("cannot load the dataset of task(s): " + "; ".join(missing) + ". Without a network, "
                          "datasets must already be in the local HF cache: download them where there is one and "
                          "copy the cache over (or point HF_HOME at it)")
    return built


def summarize(results: dict[str, dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """Per-task metrics (acc and acc_norm where present, other metrics as they come, a metric
    under a named filter as ``metric,filter``) and the macro
    averages: ``macro_acc`` over acc, ``macro_acc_norm`` over acc_norm where a task has it, else acc."""
    tasks: dict[str, dict[str, float]] = {}
    for name in names:
        # "metric,none" as "metric"; a filtered metric keeps lm-eval's key ("exact_match,strict-match").
        tasks[name] = {k.removesuffix(",none"): float(v) for k, v in results.get(name, {}).items()
                       if isinstance(v, (int, float)) and "," in k and "_stderr" not in k}
    accs = [t["acc"] for t in tasks.values() if "acc" in t]
    norms = [t.get("acc_norm", t["acc"]) for t in tasks.values() if "acc" in t]
    mean = lambda xs: sum(xs) / len(xs) if xs else None
    return {"tasks": tasks, "macro_acc": mean(accs), "macro_acc_norm": mean(norms), "n_tasks_with_acc": len(accs)}


def unsafe_tasks(built: list[tuple[str, int | None, list[Any]]]) -> list[str]:
    """Names of the built tasks that execute model-written code (lm-eval's ``unsafe_code``)."""
    leaves = [t for _, _, objs in built for o in objs
              for t in (o.get_all_tasks() if hasattr(o, "get_all_tasks") else [o])]
    return sorted({getattr(t, "task_name", None) or t.config.task for t in leaves if getattr(t, "UNSAFE_CODE", False)})


@dataclass(frozen=True)
class ChatOptions:
    """lm-eval's chat-format arguments, as its CLI resolves them: ``fewshot_as_multiturn`` is True
    with a chat template unless turned off, and needs one."""

    apply_chat_template: bool = False
    system_instruction: str | None = None
    fewshot_as_multiturn: bool | None = None

    def resolved(self) -> dict[str, Any]:
        multiturn = self.fewshot_as_multiturn
        if multiturn and not self.apply_chat_template:
            raise ConfigError("--fewshot-as-multiturn needs --apply-chat-template (few-shot turns are chat turns)")
        if multiturn is None:
            multiturn = self.apply_chat_template
        return {"apply_chat_template": self.apply_chat_template, "system_instruction": self.system_instruction,
                "fewshot_as_multiturn": multiturn}


def run(lm: Any, entries: list[tuple[str, int | None]], include_paths: tuple[str, ...] = (),
        limit: int | float | None = None, bootstrap_iters: int = 100000,
        built: list[tuple[str, int | None, list[Any]]] | None = None, chat: ChatOptions = ChatOptions(),
        log_samples: bool = False, confirm_run_unsafe_code: bool = False,
        gen_kwargs: dict[str, Any] | None = None) -> dict[str, Any]:
    """Evaluate ``lm`` (an lm-eval ``LM``, e.g. ``OlmaxLM``) on ``entries`` (or on tasks already
    built by ``load_tasks``); returns the summary plus lm-eval's raw ``results`` (and its per-sample
    records under ``samples`` with ``log_samples``). ``gen_kwargs`` override every generation
    task's own (lm-eval's ``--gen_kwargs``)."""
    import lm_eval
    tm = task_manager(tuple(include_paths))
    built = load_tasks(entries, tm) if built is None else built
    chat_kw = chat.resolved()
    results: dict[str, Any] = {}
    n_shot: dict[str, Any] = {}
    samples: dict[str, Any] = {}
    # simple_evaluate takes one num_fewshot for all its tasks: one call per distinct value.
    for shots in dict.fromkeys(s for _, s, _ in built):
        objs = [o for _, s, os_ in built if s == shots for o in os_]
        out = lm_eval.simple_evaluate(model=lm, tasks=objs, num_fewshot=shots, limit=limit, task_manager=tm,
                                      bootstrap_iters=bootstrap_iters, log_samples=log_samples,
                                      confirm_run_unsafe_code=confirm_run_unsafe_code, gen_kwargs=gen_kwargs,
                                      **chat_kw)
        results.update(out["results"])
        n_shot.update(out.get("n-shot", {}))
        samples.update(out.get("samples", {}))
    names = []
    for name, _, objs in built:
        names += [name] if name in results else [getattr(o, "task_name", None) or o.name for o in objs]
    summary = summarize(results, names)
    summary.update({"n_shot": {k: n_shot.get(k) for k in summary["tasks"]}, "limit": limit, **chat_kw,
                    "results": results})
    if log_samples:
        summary["samples"] = samples
    return summary


def format_table(summary: dict[str, Any]) -> str:
    lines = [f"{'task':<24} {'shots':>5} {'acc':>8} {'acc_norm':>9}  other"]
    for name, m in summary["tasks"].items():
        fmt = lambda k: f"{m[k]:.4f}" if k in m else "-"
        other = ", ".join(f"{k} {v:.4g}" for k, v in m.items() if k not in ACC_KEYS)
        shots = summary["n_shot"].get(name)
        lines.append(f"{name:<24} {'-' if shots is None else shots:>5} {fmt('acc'):>8} {fmt('acc_norm'):>9}  {other}")
    if summary["macro_acc"] is not None:
        lines.append(f"macro average over {summary['n_tasks_with_acc']} tasks: acc {summary['macro_acc']:.4f}, "
                     f"acc_norm (acc where absent) {summary['macro_acc_norm']:.4f}")
    return "\n".join(lines)


# --------------------------------------------------------------------------- command line


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("lm-eval",
                       help="lm-eval-harness tasks on an olmax checkpoint (default: the OLMo 3 8-task suite)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--checkpoint", required=True,
                   help="olmax weights dir, run dir, RUN/checkpoints/N, or hf:DIR")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer.json or HF tokenizer dir (default: the hf: dir or the checkpoint dir's tokenizer)")
    which = p.add_mutually_exclusive_group()
    which.add_argument("--suite", choices=sorted(SUITES), default=None,
                       help="a named task suite (default: olmo3; olmo3-adapt: the post-training suite, in chat format)")
    which.add_argument("--tasks", default=None,
                       help="comma-separated lm-eval task, group or tag names (exact, no globs)")
    p.add_argument("--include-path", action="append", default=[], metavar="DIR",
                   help=f"extra directory of task YAMLs (repeatable); the local test tasks are in "
                        f"{LOCAL_TASKS_DIR.name}/ beside this module")
    p.add_argument("--limit", type=float, default=None,
                   help="documents per task (an integer), or a fraction of each task below 1")
    p.add_argument("--batch-size", type=positive_int, default=8, help="requests scored together (default 8)")
    p.add_argument("--max-length", type=positive_int, default=None, help="default: the model's max_position_embeddings")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="parameters and compute in this dtype (default float32)")
    p.add_argument("--max-gen-toks", type=positive_int, default=None,
                   help="generation budget of every generation task, overriding the task's own (default: the "
                        "task's own, else the suite's, else 256)")
    chat = p.add_argument_group("chat format (as lm-eval's --apply_chat_template for --model hf)")
    chat.add_argument("--apply-chat-template", nargs="?", const=True, default=None, metavar="TEMPLATE",
                      help="render prompts through a chat template: the checkpoint's own, else OLMo 3 Instruct's; "
                           "or TEMPLATE: olmo3, olmo3-think, a tokenizer folder or a .jinja file "
                           "(on by default for chat suites)")
    chat.add_argument("--system-instruction", default=None, metavar="TEXT", help="a system message for every prompt")
    chat.add_argument("--fewshot-as-multiturn", action=argparse.BooleanOptionalAction, default=None,
                      help="few-shot examples as chat turns (default: on with a chat template; needs one)")
    chat.add_argument("--think-end-token", default=None, metavar="TEXT",
                      help="reasoning models: score only what follows the last TEXT of a generation (e.g. </think>)")
    p.add_argument("--confirm-run-unsafe-code", action="store_true",
                   help="allow tasks that execute model-written code (HumanEval+)")
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--out", default=None, metavar="FILE", help="also write the summary and lm-eval's results as JSON")
    p.add_argument("--log-samples", action="store_true",
                   help="with --out: also write lm-eval's per-sample records (prompts, responses, metrics)")
    p.set_defaults(func=cmd_lm_eval)


def chosen_suite(args: argparse.Namespace) -> Suite | None:
    """The suite the arguments run (None with ``--tasks``)."""
    return None if args.tasks is not None else SUITES[args.suite or DEFAULT_SUITE]


def chat_options(args: argparse.Namespace) -> ChatOptions:
    """The chat-format arguments: a chat suite applies the template unless told which."""
    s = chosen_suite(args)
    apply = args.apply_chat_template is not None or bool(s and s.chat)
    return ChatOptions(apply, args.system_instruction, args.fewshot_as_multiturn)


def parse_entries(args: argparse.Namespace) -> list[tuple[str, int | None]]:
    if args.tasks is None:
        return list(SUITES[args.suite or DEFAULT_SUITE].tasks)
    names = [t.strip() for t in args.tasks.split(",")]
    if not all(names):
        raise ConfigError(f"--tasks {args.tasks!r}: empty task name")
    return [(n, None) for n in names]


def check_args(args: argparse.Namespace) -> int | float | None:
    """Fail on bad arguments before anything is indexed, loaded or compiled; returns the limit."""
    ckpt = args.checkpoint[3:] if args.checkpoint.startswith("hf:") else args.checkpoint
    if is_remote(ckpt):  # read where it lies; its tokenizer is not looked up there
        if args.tokenizer is None:
            raise ConfigError(f"--checkpoint {args.checkpoint}: a remote checkpoint's tokenizer is not looked up; "
                              "pass --tokenizer")
    elif not Path(ckpt).exists():
        raise ConfigError(f"--checkpoint {args.checkpoint}: {ckpt} does not exist")
    if args.tokenizer is not None and not Path(args.tokenizer).exists():
        raise ConfigError(f"--tokenizer {args.tokenizer} does not exist")
    for d in args.include_path:
        if not Path(d).is_dir():
            raise ConfigError(f"--include-path {d} is not a directory")
    if args.batch_size < 1:
        raise ConfigError(f"--batch-size {args.batch_size}: must be >= 1")
    if args.max_length is not None and args.max_length < 2:
        raise ConfigError(f"--max-length {args.max_length}: must be >= 2")
    if args.out is not None and not Path(args.out).parent.is_dir():
        raise ConfigError(f"--out {args.out}: directory {Path(args.out).parent} does not exist")
    if args.log_samples and args.out is None:
        raise ConfigError("--log-samples writes the samples to --out FILE; give --out")
    tpl = args.apply_chat_template
    if isinstance(tpl, str) and tpl not in BUILTIN_TEMPLATES and not Path(tpl).exists():
        raise ConfigError(f"--apply-chat-template {tpl}: use {', '.join(BUILTIN_TEMPLATES)}, a tokenizer folder or "
                          "a .jinja file (or no value: the checkpoint's own template)")
    if args.think_end_token == "":
        raise ConfigError("--think-end-token is empty")
    chat_options(args).resolved()
    limit = args.limit
    if limit is not None:
        if not (limit > 0 and math.isfinite(limit)) or (limit >= 1 and limit != int(limit)):
            raise ConfigError(f"--limit {args.limit}: give a positive integer, or a fraction below 1")
        limit = int(limit) if limit >= 1 else limit
    return limit


def cmd_lm_eval(args: argparse.Namespace) -> int:
    require("eval", "lm_eval", "transformers")
    from olmax.eval.lm_eval_adapter import OlmaxLM, default_tokenizer_path  # lm-eval: not at CLI start
    entries = parse_entries(args)
    limit = check_args(args)
    if args.tokenizer is None and default_tokenizer_path(args.checkpoint) is None:
        raise ConfigError(f"--checkpoint {args.checkpoint} ships no tokenizer; pass --tokenizer")
    s = chosen_suite(args)
    include = tuple(str(Path(d)) for d in args.include_path)
    if s and s.local and str(LOCAL_TASKS_DIR) not in include:
        include += (str(LOCAL_TASKS_DIR),)
    chat = chat_options(args)
    if args.confirm_run_unsafe_code:
        # HF evaluate's code_eval refuses to load without it; the flag is the user's consent.
        os.environ.setdefault("HF_ALLOW_CODE_EVAL", "1")
    # Datasets first: a missing one must fail before minutes of weight loading.
    built = load_tasks(entries, task_manager(include))
    unsafe = unsafe_tasks(built)
    if unsafe and not args.confirm_run_unsafe_code:
        raise ConfigError(f"task(s) {', '.join(unsafe)} execute the code the model writes; pass "
                          "--confirm-run-unsafe-code to run them (ideally in a sandbox)")
    max_gen = args.max_gen_toks or (s.max_gen_toks if s else None)
    template = args.apply_chat_template if isinstance(args.apply_chat_template, str) else None
    lm = OlmaxLM(checkpoint=args.checkpoint, tokenizer=args.tokenizer, batch_size=args.batch_size,
                 max_length=args.max_length, dtype=args.dtype, chat_template=template,
                 think_end_token=args.think_end_token, **({"max_gen_toks": max_gen} if max_gen else {}))
    if chat.apply_chat_template and template is None and lm.builtin_chat_template:
        print(f"note: the tokenizer of {args.checkpoint} has no chat template (no chat_template.jinja, no "
              "chat_template in tokenizer_config.json): prompts use OLMo 3 Instruct's, built into olmax "
              "(olmax.chat); --apply-chat-template olmo3-think|FOLDER|FILE.jinja picks another", file=sys.stderr)
    summary = run(lm, entries, include, limit=limit, built=built, chat=chat, log_samples=args.log_samples,
                  confirm_run_unsafe_code=bool(unsafe),
                  gen_kwargs={"max_gen_toks": args.max_gen_toks} if args.max_gen_toks else None)
    summary.update({"checkpoint": args.checkpoint, "suite": None if args.tasks else (args.suite or DEFAULT_SUITE),
                    "chat_template": lm.chat.name if chat.apply_chat_template else None})
    if args.out:
        tmp = Path(f"{args.out}.tmp")
        tmp.write_text(jsonout.dumps(summary, indent=2, default=str))
        os.replace(tmp, args.out)
    if args.json:
        print(jsonout.dumps({k: v for k, v in summary.items() if k not in ("results", "samples")}, default=str))
    else:
        print(format_table(summary))
    sys.stdout.flush()
    return 0
