"""Is the pre-training step the same program as at another commit? Compiles the train step of a
recipe (default: tiny) at REV (a temporary git worktree) and in this working tree, strips
source metadata from XLA's optimised HLO, and compares instruction by instruction. Identical
programs run at the same speed and give the same bits, so a refactor of the model that prints
"identical" cannot have moved a pre-training figure.

    python benchmarks/same_program.py --against 73bb97b [--recipe tiny] [--set key=value ...]
        [--set-here key=value ...]

``--set-here`` applies to this working tree only: a field REV does not have (a switch that
restores an earlier default, for example ``model.cpu_training_kernels=true``).
"""

from __future__ import annotations

import argparse
import difflib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

DUMP = """
import sys, jax, jax.numpy as jnp
from functools import partial
from olmax.recipes import get_recipe
from olmax.model.params import init_params
from olmax.optim import init_opt_state, apply_update
try:
    from olmax.objectives.lm import make_lm_step
except ImportError:  # a revision before the objectives package
    from olmax.train.step import make_train_step as make_lm_step
cfg = get_recipe(sys.argv[1], sys.argv[2:])
params = jax.eval_shape(lambda: init_params(cfg.model, jax.random.key(0)))
opt = jax.eval_shape(lambda p: init_opt_state(p, cfg.optim), params)
B, L = cfg.train.global_batch_size, cfg.data.sequence_length
batch = {"input_ids": jax.ShapeDtypeStruct((B, L), jnp.int32), "label_mask": jax.ShapeDtypeStruct((B, L), bool)}
step = jax.jit(make_lm_step(cfg, 1, partial(apply_update, optim_cfg=cfg.optim, total_steps=cfg.train.steps)),
               donate_argnums=(0, 1))
sys.stdout.write(step.lower(params, opt, batch).compile().as_text())
"""


def program(src: Path, recipe: str, overrides: list[str]) -> list[str]:
    """The optimised HLO's instructions, without source locations (file names, lines, frames)."""
    env = {**os.environ, "PYTHONPATH": str(src), "JAX_PLATFORMS": "cpu"}
    text = subprocess.run([sys.executable, "-c", DUMP, recipe, *overrides], env=env,
                          capture_output=True, text=True, check=True).stdout
    body = text[text.index("HloModule"):]
    return [re.sub(r", metadata=\{[^}]*\}", "", line) for line in body.splitlines()
            if not re.match(r"^\d+ (\{|\")", line)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--against", required=True, help="git revision to compare with")
    ap.add_argument("--recipe", default="tiny")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--set-here", dest="here", action="append", default=[],
                    help="an override for this working tree only (a field REV lacks)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        wt = Path(tmp) / "wt"
        subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "-q", "--detach", str(wt), args.against], check=True)
        try:
            old = program(wt / "src", args.recipe, args.overrides)
        finally:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(wt)], check=True)
    new = program(ROOT / "src", args.recipe, [*args.overrides, *args.here])
    if old == new:
        print(f"identical: the {args.recipe} train step compiles to the same {len(new)} lines of optimised HLO "
              f"as at {args.against}")
        return 0
    diff = list(difflib.unified_diff(old, new, args.against, "working tree", lineterm="", n=1))
    print(f"different: {sum(1 for d in diff if d[:1] in '+-')} changed lines of optimised HLO; the first:")
    print("\n".join(diff[:40]))
    return 1


if __name__ == "__main__":
    sys.exit(main())
