"""``olmax train``, ``olmax demo`` and ``olmax demo sft``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from olmax import keep_freed_memory
from olmax.argtypes import nonneg_int, positive_float, positive_int
from olmax.recipes import add_recipe_args, get_recipe
from olmax.train.distributed import initialise


def add_distributed_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("multi-process (or OLMAX_COORDINATOR / OLMAX_NUM_PROCESSES / OLMAX_PROCESS_ID, or Slurm)")
    g.add_argument("--coordinator", default=None, help="host:port of process 0")
    g.add_argument("--num-processes", type=positive_int, default=None, help="how many processes the job has")
    g.add_argument("--process-id", type=nonneg_int, default=None,
                   help="this process's index, 0..--num-processes - 1")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("train", help="train a recipe; resumes from the newest checkpoint in --run-dir")
    add_recipe_args(p)
    p.add_argument("--run-dir", default=None, help="run directory (default: runs/RECIPE)")
    p.add_argument("--init-from", default=None, metavar="hf:DIR|olmax:PATH|state:PATH",
                   help="start from other weights (same as --set train.init_from=...): hf:DIR an HF checkpoint, "
                        "olmax:PATH olmax weights or a checkpoint (fresh optimizer), state:PATH a checkpoint's "
                        "weights and optimizer state")
    p.add_argument("--allow-fingerprint-mismatch", action="store_true",
                   help="resume even though the dataset fingerprint changed (the data order may differ)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress output (by default a bar on a terminal, else a plain line every 10 steps); "
                        "metrics.jsonl is written either way")
    p.add_argument("--max-steps-this-run", type=positive_int, default=None,
                   help="stop (after a checkpoint) once this many updates ran in this process")
    add_distributed_args(p)
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("demo", help="the README's main job: a tiny OLMo 3 trained on CPU on the Python stdlib")
    p.add_argument("--run-dir", default="runs/demo",
                   help="the demo's folder: its data in RUN_DIR/data, the run in RUN_DIR/run (default runs/demo)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config value of the demo's recipe (tiny), e.g. train.steps=100 (repeatable)")
    p.add_argument("--corpus-mb", type=positive_float, default=12.0, help="megabytes of stdlib source to use")
    p.set_defaults(func=cmd_demo)
    stages = p.add_subparsers(dest="stage", metavar="STAGE")
    s = _stage(stages, "sft", "fine-tune the demo's model on a chat set built here (recipe tiny_sft); exit 1 if "
               "held-out assistant-token loss did not go down", "the chat set and the SFT run", "tiny_sft")
    s.add_argument("--synthetic", type=nonneg_int, default=3000,
                   help="'last word' and 'reverse the words' conversations to generate (half each)")
    s.add_argument("--max-doc", type=nonneg_int, default=None, help="at most this many docstring conversations")
    s.add_argument("--check", type=nonneg_int, default=200, help="held-out prompts answered to count exact answers")
    s.add_argument("--show", type=nonneg_int, default=3, help="held-out prompts whose answers are printed")
    s.set_defaults(func=cmd_demo_sft)
    s = _stage(stages, "rl", "SFT -> DPO -> RL with verifiable rewards on a counting task: a short SFT warm start, a "
               "short DPO stage, then RL (recipes tiny_sft, tiny_dpo, tiny_rl); exit 1 unless RL raised held-out "
               "accuracy by 3 standard errors", "the prompts, the warm start, the DPO and the RL runs", "tiny_rl")
    s.add_argument("--eval-prompts", type=positive_int, default=200, help="held-out prompts measured")
    s.add_argument("--samples", type=positive_int, default=8, help="samples per held-out prompt")
    s.add_argument("--prompts", type=positive_int, default=3000, help="counting prompts made (20%% held out)")
    s.add_argument("--sft-steps", type=positive_int, default=25, help="updates of the SFT warm start")
    s.add_argument("--dpo-steps", type=nonneg_int, default=10,
                   help="DPO updates between the warm start and RL (0: straight from SFT to RL)")
    s.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    s.set_defaults(func=cmd_demo_rl)


def _stage(stages: argparse._SubParsersAction, name: str, help: str, outputs: str, recipe: str
           ) -> argparse.ArgumentParser:
    """A stage of ``olmax demo`` after pre-training, with the arguments every stage takes."""
    s = stages.add_parser(name, help=help)
    s.add_argument("--run-dir", default=argparse.SUPPRESS, help="the demo's folder (default runs/demo): its "
                   "pre-trained run is RUN_DIR/run, trained first by `olmax demo` when it is not finished")
    s.add_argument("--from", dest="from_run", default=None, metavar="RUN_DIR",
                   help="start from this pre-trained tiny run instead (nothing is pre-trained)")
    s.add_argument("--out", default=None, help=f"where {outputs} go (default RUN_DIR/{name})")
    s.add_argument("--set", dest="stage_overrides", action="append", default=[], metavar="KEY=VALUE",
                   help=f"overrides of recipe {recipe} (--set before `{name}` go to the pre-training)")
    return s


def cmd_train(args: argparse.Namespace) -> int:
    keep_freed_memory()
    initialise(args.coordinator, args.num_processes, args.process_id)
    from olmax.objectives import get_objective
    from olmax.train.loop import train  # Orbax, Optax, Grain: loaded when a command needs them
    overrides = list(args.overrides)
    if args.init_from:
        overrides.append(f"train.init_from={args.init_from}")
    cfg = get_recipe(args.recipe, overrides)
    run_dir = args.run_dir or str(Path("runs") / cfg.name)
    res = train(cfg, run_dir, allow_fingerprint_mismatch=args.allow_fingerprint_mismatch,
                progress=not args.no_progress, max_steps_this_run=args.max_steps_this_run)
    last = res.losses.get(res.end_step)
    msg = f"trained steps {res.start_step}..{res.end_step} in {res.run_dir}"
    if last is not None:
        msg += f"; last {get_objective(cfg).loss_name} {last:.4f}"
    if res.stopped_early:
        msg += " (stopped early; run the same command to resume)"
    print(msg, file=sys.stderr)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from olmax.demos.pretrain import run_demo
    keep_freed_memory()
    return run_demo(args.run_dir, args.overrides, corpus_mb=args.corpus_mb)


def cmd_demo_sft(args: argparse.Namespace) -> int:
    from olmax.demos.sft import run_demo_sft
    keep_freed_memory()
    return run_demo_sft(args.run_dir, from_run=args.from_run, out=args.out, overrides=args.stage_overrides,
                        pretrain_overrides=args.overrides, corpus_mb=args.corpus_mb, synthetic=args.synthetic,
                        max_doc=args.max_doc, show=args.show, check=args.check)


def cmd_demo_rl(args: argparse.Namespace) -> int:
    from olmax.demos.rl import run_demo_rl
    keep_freed_memory()
    return run_demo_rl(args.run_dir, from_run=args.from_run, out=args.out, overrides=args.stage_overrides,
                       pretrain_overrides=args.overrides, corpus_mb=args.corpus_mb, n_eval=args.eval_prompts,
                       k=args.samples, n=args.prompts, sft_steps=args.sft_steps, dpo_steps=args.dpo_steps,
                       as_json=args.json)
