"""olmax's TPU train step against MaxText's, program for program: memory and XLA's cost estimate
of each, ahead of time (the libtpu wheel, no TPU).

    python benchmarks/bench_tpu_aot.py [--recipe olmo3_7b_stage1] [--topology v5p-128]
        [--remat full,save_proj] [--maxtext-remat full,minimal] [--max-micro-batch N]
        [--maxtext-venv DIR | --no-maxtext] [--out FILE.json]

For each olmax remat policy, ``olmax compile RECIPE --topology T --no-eval --json`` (memory, and
the cost keys: compiled FLOPs, model FLOPs, overhead, bytes, ``optimal_seconds``, estimated
MFU). For each MaxText policy, MaxText 0.2.5's own ``train_compile`` for the same model
(``MAXTEXT_MODEL``), slice and sequence length at olmax's plan (``per_device_batch_size`` =
olmax's micro-batch, ``gradient_accumulation_steps`` = its accumulation; the recipe's own plan, or
the one ``--max-micro-batch`` sets for both); ``full`` is MaxText's
default, ``minimal`` (every projection output kept: attention and MLP) is the policy the published
MaxText reproduction names. MaxText prints XLA's cost analysis beside its memory analysis; as for
olmax, XLA counts a loop's body once, so MaxText's cost is taken the way ``olmax.compile.
program_cost`` takes olmax's: its program unrolled (``scan_layers=false``) at one and two layer
periods (``base_num_decoder_layers`` 4 and 8), extrapolated to the model's depth, times the
accumulation steps, and compiled without XLA's windowed einsums as olmax's are (their loops too
are counted once); its memory from the real (scanned) program. The estimated MFU of both uses the
same model FLOPs (olmax's count, ``olmax.metrics.flops``) and the same peak. XLA sees neither side's
splash attention kernel (a Pallas call declares no cost), so both are also reported with its work
priced in the same way (``olmax.compile.price_attention``: its model FLOPs at XLA's large-matmul
rate, a forward more where the remat policy runs the kernel again: MaxText's ``full`` and
``minimal`` do, ``minimal_with_context`` keeps its output).

MaxText comes from ``--maxtext-venv`` (default ``.peers/maxtext-venv``, which ``make bench-peers``
installs: Python 3.12, ``maxtext[tpu]==0.2.5``); without it only olmax's rows are written and the
reason is named. Every compile runs in its own process; a full-size one takes minutes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from compile_targets import MAXTEXT_MODEL, maxtext_available, maxtext_compile, olmax_compile

from olmax.compile import ATTENTION_KEYS, price_attention

REPO = Path(__file__).resolve().parents[1]
PERIOD = 4  # OLMo 3's layer pattern repeats every 4 layers (3 sliding, 1 full)
# Whether a MaxText remat policy runs the attention kernel's forward again in the backward pass:
# only the policies that save its output ("context") do not. MaxText's `minimal` keeps every
# projection but not the context; `minimal_with_context` keeps it too.
MAXTEXT_RECOMPUTES_ATTENTION = {"full": True, "minimal": True, "minimal_with_context": False,
                                "save_dot_with_context_except_mlp": False, "save_dot_except_mlp": True,
                                "save_dot_except_mlpwi": True, "save_qkv_proj": True, "save_out_proj": True,
                                "qkv_proj_offloaded": True, "minimal_offloaded": True, "none": False}


def maxtext_row(venv: Path, model: str, topology: str, plan: dict, seq: int, layers: int, remat: str,
                model_flops: float, peak: float | None, unseen: float = 0.0, rate: float | None = None) -> dict:
    """MaxText's memory (the real program) and cost (unrolled at one and two periods, extrapolated);
    its splash kernel's work, which XLA does not see either, priced in as olmax's is (``unseen``:
    that share of the model FLOPs, ``rate``: XLA's large-matmul FLOP/s on the chip)."""
    if remat not in MAXTEXT_RECOMPUTES_ATTENTION:
        raise ValueError(f"MaxText remat policy {remat!r}: not one this benchmark knows "
                         f"({', '.join(MAXTEXT_RECOMPUTES_ATTENTION)})")
    args = (venv, model, topology, plan["micro_batch"], plan["accum_steps"], seq, f"remat_policy={remat}")
    real = maxtext_compile(*args)
    # The depth of a named model is fixed unless override_model_config is set.
    unrolled = ("scan_layers=false", "override_model_config=true")
    one = maxtext_compile(*args, *unrolled, f"base_num_decoder_layers={PERIOD}", for_cost=True)
    two = maxtext_compile(*args, *unrolled, f"base_num_decoder_layers={2 * PERIOD}", for_cost=True)
    if any(r[k] is None for r in (one, two) for k in ("flops", "bytes", "seconds")):
        raise RuntimeError(f"MaxText train_compile ({model}, {topology}, remat {remat}) printed no cost "
                           f"analysis of its unrolled program (layers {PERIOD} and {2 * PERIOD}): {one}, {two}")
    cost = {k: plan["accum_steps"] * (one[k] + (layers - PERIOD) / PERIOD * (two[k] - one[k]))
            for k in ("flops", "bytes", "seconds")}
    row = {"system": "maxtext 0.2.5", "remat": remat, "per_device_gib": real["per_device_gib"],
           "flops_per_device": cost["flops"], "model_flops_per_device": model_flops,
           "recompute_overhead": cost["flops"] / model_flops, "bytes_accessed_per_device": cost["bytes"],
           "optimal_seconds": cost["seconds"],
           "estimated_mfu": model_flops / (cost["seconds"] * peak) if peak and cost["seconds"] else None}
    return {**row, **price_attention(row, unseen, MAXTEXT_RECOMPUTES_ATTENTION[remat], rate),
            "scanned_program_as_reported": {k: real[k] for k in ("flops", "bytes", "seconds")},
            "wall_seconds": real["wall_seconds"] + one["wall_seconds"] + two["wall_seconds"]}


def _print(row: dict, hbm: float) -> None:
    mfu = f"{row['estimated_mfu']:.1%}" if row.get("estimated_mfu") is not None else "-"
    free = 1 - row["per_device_gib"] / hbm
    priced = ""
    if row.get("seconds_with_attention") is not None:
        priced = (f"  + attention {row['seconds_with_attention']:.2f} s, "
                  f"{row['estimated_mfu_with_attention']:.1%}")
    print(f"{row['system']:14s} {row['remat']:14s} {row['per_device_gib']:7.2f} GiB ({free:.0%} "
          f"free)  {row['flops_per_device'] / 1e12:8.1f} TFLOP  overhead {row['recompute_overhead']:.2f}x  "
          f"est. {row['optimal_seconds']:.2f} s  est. MFU {mfu}{priced}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipe", default="olmo3_7b_stage1", choices=sorted(MAXTEXT_MODEL))
    ap.add_argument("--topology", default="v5p-128")
    ap.add_argument("--remat", default="full,save_proj", help="olmax's policies")
    ap.add_argument("--maxtext-remat", default="full,minimal", help="MaxText's policies")
    ap.add_argument("--max-micro-batch", type=int, default=None, metavar="N",
                    help="at most N sequences a device per micro-batch (train.max_micro_batch_size), for "
                         "both systems; default: the recipe's own plan")
    ap.add_argument("--maxtext-venv", default=str(REPO / ".peers" / "maxtext-venv"))
    ap.add_argument("--no-maxtext", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if args.max_micro_batch is not None and args.max_micro_batch < 1:
        ap.error(f"--max-micro-batch {args.max_micro_batch}: must be at least 1")
    plan = [] if args.max_micro_batch is None else ["--set", f"train.max_micro_batch_size={args.max_micro_batch}"]
    rows, rc, first = [], 0, None
    for remat in args.remat.split(","):
        # One plan for every row (the recipe's own micro-batching, or --max-micro-batch's), not the
        # slice's measured choice; MaxText's rows take the plan of olmax's first.
        out = olmax_compile(args.recipe, args.topology, "--no-slice-choice", "--set", f"model.remat={remat}",
                            *plan, eval_step=False, cost=True)
        first = first or out
        row = {"system": "olmax", "remat": remat, **{k: out.get(k) for k in (
            "per_device_gib", "flops_per_device", "model_flops_per_device", "recompute_overhead",
            "bytes_accessed_per_device", "optimal_seconds", "estimated_mfu", *ATTENTION_KEYS, "plan", "mesh",
            "wall_seconds")}}
        rows.append(row)
        if row["flops_per_device"] is None:
            print(f"olmax {remat}: {out['verdict']}", flush=True)
            rc = 1
        else:
            _print(row, out["hbm_gib"])
    venv = Path(args.maxtext_venv)
    missing = "--no-maxtext" if args.no_maxtext else maxtext_available(venv)
    if missing:
        print(f"MaxText left out: {missing}", flush=True)
    else:
        for remat in args.maxtext_remat.split(","):
            try:
                row = maxtext_row(venv, MAXTEXT_MODEL[args.recipe], args.topology, first["plan"],
                                  first["sequence_length"], 32 if args.recipe != "olmo3_32b" else 64, remat,
                                  first["model_flops_per_device"], first["peak_flops_per_device"],
                                  first["attention_unseen_fraction"], first.get("matmul_flops_per_second"))
            except RuntimeError as e:
                print(f"MaxText {remat}: {e}", flush=True)
                rc = 1
                continue
            rows.append(row)
            _print(row, first["hbm_gib"])
    result = {"recipe": args.recipe, "topology": args.topology, "hbm_gib": first["hbm_gib"],
              "device_kind": first["device_kind"], "peak_flops_per_device": first["peak_flops_per_device"],
              "plan": first["plan"], "sequence_length": first["sequence_length"], "maxtext_missing": missing,
              "attention_unseen_fraction": first["attention_unseen_fraction"],
              "matmul_flops_per_second": first.get("matmul_flops_per_second"),
              "note": "cost columns are XLA's estimate for each compiled TPU program, not a measurement; XLA "
                      "sees neither side's splash attention kernel, and *_with_attention prices its work in "
                      "for both alike (a forward more where the remat policy recomputes it)",
              "rows": rows}
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
    return rc


if __name__ == "__main__":
    sys.exit(main())
