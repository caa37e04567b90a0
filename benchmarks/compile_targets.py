"""Ahead-of-time compile every production recipe for the TPU slices it targets (needs only the
libtpu wheel, no TPU) and print per-device memory against the chip's HBM, like for like against
MaxText's own step where MaxText is installed.

    python benchmarks/compile_targets.py [--only RECIPE@TOPOLOGY ...] [--no-eval] [--out FILE.json]
                                         [--maxtext-venv DIR | --no-maxtext]

Each compile runs in its own process (one compile takes minutes on 2 cores), the eval step with
the train step unless ``--no-eval``. For the rows in ``MAXTEXT_ROWS``, MaxText 0.2.5's
``train_compile`` compiles its step for the same model, slice and sequence length at the same
per-chip micro-batch and accumulation as olmax's plan (``per_device_batch_size`` = olmax's
micro-batch, ``gradient_accumulation_steps`` = its accumulation steps), and, for the rows in
``UNBATCHED_ROWS``, both systems compile again with every sequence of a chip in one pass. Both
sides count memory the same way, from XLA's memory analysis: arguments + outputs - aliased
+ temporaries + generated code. MaxText comes from ``--maxtext-venv`` (default
``.peers/maxtext-venv``, which ``make bench-peers`` installs); without it the MaxText columns
are left out and named as missing.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from peers import maxtext_env

from olmax.compile import COST_COMPILER_OPTIONS

REPO = Path(__file__).resolve().parents[1]
GiB = 1024**3
TARGETS = [
    ("olmo3_7b_stage1", "v5p-128"), ("olmo3_7b_stage1", "v6e-256"), ("olmo3_7b_stage1", "tpu7x-128"),
    ("olmo3_7b_stage2", "v5p-128"), ("olmo3_7b_stage2", "v6e-256"), ("olmo3_7b_stage2", "tpu7x-128"),
    ("olmo3_7b_stage3", "v5p-512"), ("olmo3_32b", "v5p-512"),
    ("olmo3_7b_think_rl", "v5p-128"), ("olmo3_7b_instruct_rl", "v5p-128"),
]
# MaxText's model configs for our recipes' models, and the rows compared with MaxText's step.
MAXTEXT_MODEL = {"olmo3_7b_stage1": "olmo3-7b-pt", "olmo3_32b": "olmo3-32b"}
MAXTEXT_ROWS = [("olmo3_7b_stage1", "v5p-128"), ("olmo3_32b", "v5p-512")]
UNBATCHED_ROWS = [("olmo3_7b_stage1", "v5p-128")]
UNBATCHED = ["--set", "train.micro_batch_size=null", "--set", "train.max_micro_batch_size=null"]
_STATS = re.compile(r"Memory analysis: CompiledMemoryStats\((.*?)\)")
_COST = re.compile(r"Cost analysis: (\{.*\})")  # one line; its keys hold braces


def olmax_compile(recipe: str, topology: str, *extra: str, eval_step: bool = True, cost: bool = False) -> dict:
    """`olmax compile RECIPE --topology T --json` in its own process; its report, with the wall time.
    Memory only unless ``cost`` (XLA's cost estimate takes extra compiles)."""
    cmd = [sys.executable, "-m", "olmax.cli", "compile", recipe, "--topology", topology, "--json", *extra]
    if not eval_step:
        cmd.append("--no-eval")
    if not cost:
        cmd.append("--no-cost")
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True)
    try:
        out = json.loads(r.stdout)
    except ValueError:
        raise RuntimeError(f"olmax compile {recipe} --topology {topology} {' '.join(extra)} failed "
                           f"(exit {r.returncode})\n{r.stderr[-3000:]}") from None
    out["wall_seconds"] = time.perf_counter() - t0
    return out


def maxtext_compile(venv: Path, model: str, topology: str, micro_batch: int, accum_steps: int,
                    seq: int, *extra: str, for_cost: bool = False) -> dict:
    """MaxText's own ``train_compile`` for ``model`` on ``topology`` at ``micro_batch`` sequences of
    ``seq`` tokens per chip in ``accum_steps`` micro-batches, with MaxText's defaults (remat full,
    scanned layers, bf16 compute) unless ``extra`` overrides them (``key=value`` as its command
    line takes them). Per-chip GiB from XLA's memory analysis, counted as olmax's; XLA's cost
    analysis of the step as MaxText prints it (per device: ``flops``, ``bytes``, ``seconds``).
    ``for_cost``: compiled as olmax compiles a program for its cost
    (``olmax.compile.COST_COMPILER_OPTIONS``, given to libtpu as flags)."""
    env = maxtext_env()
    if for_cost:
        flags = " ".join(f"--{k}={str(v).lower()}" for k, v in COST_COMPILER_OPTIONS["tpu"].items())
        env["LIBTPU_INIT_ARGS"] = f"{env.get('LIBTPU_INIT_ARGS', '')} {flags}".strip()
    with tempfile.TemporaryDirectory() as out:
        # MaxText runs in a scratch directory: a venv named relative to ours is resolved first.
        cmd = [str(venv.resolve() / "bin" / "python"), "-m", "maxtext.trainers.pre_train.train_compile", "run_name=aot",
               f"base_output_directory={out}", f"compile_topology={topology}", "compile_topology_num_slices=1",
               f"model_name={model}", f"per_device_batch_size={micro_batch}",
               f"gradient_accumulation_steps={accum_steps}", f"max_target_length={seq}", "dataset_type=synthetic",
               *extra]
        t0 = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=out)
    text = r.stdout + r.stderr
    m, c = _STATS.search(text), _COST.search(text)
    if r.returncode != 0 or m is None:
        raise RuntimeError(f"MaxText train_compile {' '.join(cmd[3:])} failed (exit {r.returncode})\n{text[-3000:]}")
    b = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m.group(1))}
    need = (b["argument_size_in_bytes"] + b["output_size_in_bytes"] - b["alias_size_in_bytes"]
            + b["temp_size_in_bytes"] + b.get("generated_code_size_in_bytes", 0))
    cost = ast.literal_eval(c.group(1)) if c else {}
    return {"per_device_gib": need / GiB, "argument_gib": b["argument_size_in_bytes"] / GiB,
            "temp_gib": b["temp_size_in_bytes"] / GiB, "micro_batch": micro_batch, "accum_steps": accum_steps,
            "flops": float(cost["flops"]) if "flops" in cost else None,
            "bytes": float(cost["bytes accessed"]) if "bytes accessed" in cost else None,
            "seconds": float(cost["optimal_seconds"]) if "optimal_seconds" in cost else None,
            "wall_seconds": time.perf_counter() - t0}


def maxtext_available(venv: Path) -> str | None:
    """None when ``venv`` has MaxText, else why not."""
    py = venv / "bin" / "python"
    if not py.exists():
        return f"no MaxText venv at {venv} (make bench-peers installs one)"
    r = subprocess.run([str(py), "-c", "import maxtext.trainers.pre_train.train_compile"], capture_output=True,
                       text=True, env=maxtext_env())
    return None if r.returncode == 0 else f"MaxText does not import from {venv}: {r.stderr.strip()[-300:]}"


def _line(label: str, gib: float, ref: dict | None) -> str:
    return f"    {label:44s} {gib:7.2f} GiB" + (f"   MaxText {ref['per_device_gib']:7.2f} GiB   "
                                                 f"olmax / MaxText {gib / ref['per_device_gib']:.2f}x" if ref else "")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", action="append", default=[], metavar="RECIPE@TOPOLOGY")
    ap.add_argument("--no-eval", action="store_true", help="compile the train step only")
    ap.add_argument("--maxtext-venv", default=str(REPO / ".peers" / "maxtext-venv"))
    ap.add_argument("--no-maxtext", action="store_true", help="olmax's rows only")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    targets = [tuple(t.split("@")) for t in args.only] or TARGETS
    venv = Path(args.maxtext_venv)
    missing = "--no-maxtext" if args.no_maxtext else maxtext_available(venv)
    if missing and any(t in MAXTEXT_ROWS for t in targets):
        print(f"MaxText left out: {missing}", flush=True)
    rows, rc = [], 0
    for recipe, topo in targets:
        try:
            # A row set against MaxText's step compiles the recipe as written (full remat, as MaxText's
            # default), not the slice's measured choice (olmax.recipes.slices).
            written = ["--no-slice-choice"] if (recipe, topo) in MAXTEXT_ROWS and not missing else []
            out = olmax_compile(recipe, topo, *written, eval_step=not args.no_eval)
        except RuntimeError as e:
            print(f"{recipe} on {topo}: {e}", flush=True)
            rc = 1
            continue
        rows.append(out)
        rc |= 0 if out.get("fits") else 1
        plan = out["plan"]
        print(f"{recipe:20s} {topo:10s} {out['per_device_gib']:7.2f} GiB of {out['hbm_gib']:6.2f} "
              f"(mesh {out['mesh']}, {plan['accum_steps']} x {plan['micro_batch']} per device) {out['verdict']}; "
              f"compile {out['compile_seconds']:.0f} s", flush=True)
        if "eval" in out:
            print(f"    eval step at batch {out['eval']['batch_size']}: {out['eval']['per_device_gib']:.2f} GiB with "
                  f"the optimizer state that stays resident ({out['eval']['step_gib']:.2f} for the step)", flush=True)
        if "generate" in out:
            print(f"    generation at {out['generate']['batch']} x {out['generate']['max_length']}: "
                  f"{out['generate']['per_device_gib']:.2f} GiB with the optimizer state", flush=True)
        if missing or (recipe, topo) not in MAXTEXT_ROWS:
            continue
        seq = out["sequence_length"]
        try:
            ref = maxtext_compile(venv, MAXTEXT_MODEL[recipe], topo, plan["micro_batch"], plan["accum_steps"], seq)
            out["maxtext"] = ref
            print(_line(f"{plan['accum_steps']} micro-batch(es) of {plan['micro_batch']} (the recipe's plan)",
                        out["per_device_gib"], ref), flush=True)
            if (recipe, topo) in UNBATCHED_ROWS and plan["accum_steps"] > 1:
                whole = olmax_compile(recipe, topo, *UNBATCHED, *written, eval_step=False)
                wref = maxtext_compile(venv, MAXTEXT_MODEL[recipe], topo, plan["per_device"], 1, seq)
                out["unbatched"] = {"per_device_gib": whole["per_device_gib"], "maxtext": wref,
                                    "plan": whole["plan"]}
                print(_line(f"all {plan['per_device']} sequences in one pass", whole["per_device_gib"], wref),
                      flush=True)
        except RuntimeError as e:
            print(f"    MaxText: {e}", flush=True)
            rc = 1
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)
    return rc


if __name__ == "__main__":
    sys.exit(main())
