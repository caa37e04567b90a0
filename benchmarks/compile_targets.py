"""Ahead-of-time compile every production recipe for the TPU slices it targets (needs only the
libtpu wheel, no TPU) and print per-device memory against the chip's HBM and MaxText's figure.

    python benchmarks/compile_targets.py [--only RECIPE@TOPOLOGY ...] [--eval] [--out FILE.json]

Each compile runs `olmax compile` in its own process (one compile takes minutes on 2 cores).
MaxText 0.2.5's figure for the 7B on v5p-128 at per-device batch 8 x 8192 (remat full, scanned,
bf16) is 51.5 GB = 47.9 GiB per chip (`train_compile`, see the scale issue); the other rows have
no MaxText figure here.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

TARGETS = [
    ("olmo3_7b_stage1", "v5p-128"), ("olmo3_7b_stage1", "v6e-256"), ("olmo3_7b_stage1", "tpu7x-128"),
    ("olmo3_7b_stage2", "v5p-128"), ("olmo3_7b_stage2", "v6e-256"), ("olmo3_7b_stage2", "tpu7x-128"),
    ("olmo3_7b_stage3", "v5p-512"), ("olmo3_32b", "v5p-512"),
    ("olmo3_7b_think_rl", "v5p-128"), ("olmo3_7b_instruct_rl", "v5p-128"),
]
MAXTEXT_GIB = {("olmo3_7b_stage1", "v5p-128"): 47.9}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", action="append", default=[], metavar="RECIPE@TOPOLOGY")
    ap.add_argument("--eval", action="store_true", help="compile the eval step too")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    targets = [tuple(t.split("@")) for t in args.only] or TARGETS
    rows, rc = [], 0
    for recipe, topo in targets:
        cmd = [sys.executable, "-m", "olmax.cli", "compile", recipe, "--topology", topo, "--json"]
        if not args.eval:
            cmd.append("--no-eval")
        t0 = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        try:
            out = json.loads(r.stdout)
        except ValueError:
            print(f"{recipe} on {topo}: compile failed (exit {r.returncode})\n{r.stderr[-3000:]}", flush=True)
            rc = 1
            continue
        ref = MAXTEXT_GIB.get((recipe, topo))
        out["maxtext_gib"] = ref
        out["wall_seconds"] = wall
        rows.append(out)
        rc |= 0 if out.get("fits") else 1
        ratio = f"{out['per_device_gib'] / ref:.2f}x MaxText ({ref} GiB)" if ref else "no MaxText figure"
        print(f"{recipe:17s} {topo:10s} {out['per_device_gib']:7.2f} GiB of {out['hbm_gib']:6.2f} "
              f"(mesh {out['mesh']}, {out['plan']['accum_steps']} x {out['plan']['micro_batch']} per device) "
              f"{out['verdict']}; {ratio}; compile {out['compile_seconds']:.0f} s", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=2)
    return rc


if __name__ == "__main__":
    sys.exit(main())
