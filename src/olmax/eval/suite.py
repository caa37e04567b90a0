"""``olmax eval lm-eval``: lm-eval-harness tasks on an olmax checkpoint, and the reproduction's suite.

The ``olmo3`` suite is the 8 tasks the published reproduction checked at every milestone: MMLU
5-shot, then HellaSwag, ARC-easy, ARC-challenge, OpenBookQA, PIQA, BoolQ and WinoGrande zero-shot.
Datasets come from the local HF cache (machines here have no network); a task whose dataset is
missing fails before any weights are loaded, with its name in the error.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import sys
from pathlib import Path
from typing import Any

from olmax import jsonout
from olmax.argtypes import positive_int
from olmax.config import ConfigError
from olmax.extras import require

# (lm-eval task, num_fewshot); None keeps the task's own default.
SUITES: dict[str, tuple[tuple[str, int | None], ...]] = {
    "olmo3": (("mmlu", 5), ("hellaswag", 0), ("arc_easy", 0), ("arc_challenge", 0), ("openbookqa", 0),
              ("piqa", 0), ("boolq", 0), ("winogrande", 0)),
}
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
    built, missing = [], []
    for name, shots in entries:
        try:
            loaded = tm.load([name])
        except _dataset_errors() as e:
            missing.append(f"{name} ({e})")
            continue
        # A group is passed on whole (lm-eval aggregates it); a task or a tag as its leaf tasks.
        objs = [loaded["groups"][name]] if name in loaded.get("groups", {}) else list(loaded["tasks"].values())
        built.append((name, shots, objs))
    if missing:
        raise ConfigError("cannot load the dataset of task(s): " + "; ".join(missing) + ". Without a network, "
                          "datasets must already be in the local HF cache: download them where there is one and "
                          "copy the cache over (or point HF_HOME at it)")
    return built


def summarize(results: dict[str, dict[str, Any]], names: list[str]) -> dict[str, Any]:
    """Per-task metrics (acc and acc_norm where present, other metrics as they come) and the macro
    averages: ``macro_acc`` over acc, ``macro_acc_norm`` over acc_norm where a task has it, else acc."""
    tasks: dict[str, dict[str, float]] = {}
    for name in names:
        tasks[name] = {k.split(",")[0]: float(v) for k, v in results.get(name, {}).items()
                       if isinstance(v, (int, float)) and "," in k and "_stderr" not in k}
    accs = [t["acc"] for t in tasks.values() if "acc" in t]
    norms = [t.get("acc_norm", t["acc"]) for t in tasks.values() if "acc" in t]
    mean = lambda xs: sum(xs) / len(xs) if xs else None
    return {"tasks": tasks, "macro_acc": mean(accs), "macro_acc_norm": mean(norms), "n_tasks_with_acc": len(accs)}


def run(lm: Any, entries: list[tuple[str, int | None]], include_paths: tuple[str, ...] = (),
        limit: int | float | None = None, bootstrap_iters: int = 100000,
        built: list[tuple[str, int | None, list[Any]]] | None = None) -> dict[str, Any]:
    """Evaluate ``lm`` (an lm-eval ``LM``, e.g. ``OlmaxLM``) on ``entries`` (or on tasks already
    built by ``load_tasks``); returns the summary plus lm-eval's raw ``results``."""
    import lm_eval
    tm = task_manager(tuple(include_paths))
    built = load_tasks(entries, tm) if built is None else built
    results: dict[str, Any] = {}
    n_shot: dict[str, Any] = {}
    # simple_evaluate takes one num_fewshot for all its tasks: one call per distinct value.
    for shots in dict.fromkeys(s for _, s, _ in built):
        objs = [o for _, s, os_ in built if s == shots for o in os_]
        out = lm_eval.simple_evaluate(model=lm, tasks=objs, num_fewshot=shots, limit=limit, task_manager=tm,
                                      bootstrap_iters=bootstrap_iters, log_samples=False)
        results.update(out["results"])
        n_shot.update(out.get("n-shot", {}))
    names = []
    for name, _, objs in built:
        names += [name] if name in results else [getattr(o, "task_name", None) or o.name for o in objs]
    summary = summarize(results, names)
    summary.update({"n_shot": {k: n_shot.get(k) for k in summary["tasks"]}, "limit": limit, "results": results})
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
    which.add_argument("--suite", choices=sorted(SUITES), default=None, help="a named task suite (default: olmo3)")
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
    p.add_argument("--json", action="store_true", help="print the summary as JSON")
    p.add_argument("--out", default=None, metavar="FILE", help="also write the summary and lm-eval's results as JSON")
    p.set_defaults(func=cmd_lm_eval)


def parse_entries(args: argparse.Namespace) -> list[tuple[str, int | None]]:
    if args.tasks is None:
        return list(SUITES[args.suite or "olmo3"])
    names = [t.strip() for t in args.tasks.split(",")]
    if not all(names):
        raise ConfigError(f"--tasks {args.tasks!r}: empty task name")
    return [(n, None) for n in names]


def check_args(args: argparse.Namespace) -> int | float | None:
    """Fail on bad arguments before anything is indexed, loaded or compiled; returns the limit."""
    ckpt = args.checkpoint[3:] if args.checkpoint.startswith("hf:") else args.checkpoint
    if not Path(ckpt).exists():
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
    include = tuple(str(Path(d)) for d in args.include_path)
    # Datasets first: a missing one must fail before minutes of weight loading.
    built = load_tasks(entries, task_manager(include))
    lm = OlmaxLM(checkpoint=args.checkpoint, tokenizer=args.tokenizer, batch_size=args.batch_size,
                 max_length=args.max_length, dtype=args.dtype)
    summary = run(lm, entries, include, limit=limit, built=built)
    summary.update({"checkpoint": args.checkpoint, "suite": None if args.tasks else (args.suite or "olmo3")})
    if args.out:
        tmp = Path(f"{args.out}.tmp")
        tmp.write_text(jsonout.dumps(summary, indent=2, default=str))
        os.replace(tmp, args.out)
    if args.json:
        print(jsonout.dumps({k: v for k, v in summary.items() if k != "results"}, default=str))
    else:
        print(format_table(summary))
    sys.stdout.flush()
    return 0
