"""The noise-floor verdict (``olmax verify olmo-core --noise-floor``) over many seeds, with olmax's C++
CPU kernels on and off, against the same OLMo-core runs.

Which CPU training path is the default is a fidelity question before a speed one: the default must
pass the verdict at least as often as XLA's own arithmetic. Per seed, OLMo-core is trained four
times (as configured and with three micro-batch splits: its own noise), then olmax twice in child
processes from OLMo-core's initial weights, once with the kernels (``OLMAX_CPU_KERNELS=1``) and once
without (``OLMAX_CPU_KERNELS=0``), and each is judged against the same reference noise.

    python benchmarks/noise_floor_seeds.py --seeds 6-15 [--steps 100] [--lr 3e-3] --out DIR

Writes ``DIR/noise_floor_seeds.json`` and prints a table. Takes about 3-6 minutes a seed on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")

from olmax.verify import noise_floor as nf  # noqa: E402


def seed_list(text: str) -> list[int]:
    seeds: list[int] = []
    for part in text.split(","):
        a, _, b = part.partition("-")
        seeds.extend(range(int(a), int(b) + 1) if b else [int(a)])
    return seeds


def olmax_run(floor: nf.NoiseFloor, kernels: bool, name: str):
    """olmax in a child process with the kernels switched by the environment it inherits."""
    old = os.environ.get("OLMAX_CPU_KERNELS")
    os.environ["OLMAX_CPU_KERNELS"] = "1" if kernels else "0"
    try:
        return nf.run_olmax_devices(floor.recipe, [], floor.out, floor.paths, floor.hf_dir, floor.out / name, 1)
    finally:
        if old is None:
            os.environ.pop("OLMAX_CPU_KERNELS", None)
        else:
            os.environ["OLMAX_CPU_KERNELS"] = old


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", default="6-15", help="seeds, e.g. 6-15 or 1,3,7 (default 6-15: not the tests' seeds)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", default="3e-3", help="peak lr (default: the tiny recipe's 3e-3)")
    p.add_argument("--out", required=True, help="folder for the runs and noise_floor_seeds.json")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    t_all = time.perf_counter()
    for seed in seed_list(a.seeds):
        t0 = time.perf_counter()
        floor = nf.measure(nf.Recipe(a.steps, seed, (f"optim.lr={a.lr}",)), out / f"seed{seed}", log=None)
        row = {"seed": seed}
        for kernels in (True, False):
            trace = olmax_run(floor, kernels, f"olmax_kernels_{'on' if kernels else 'off'}")
            r, _ = floor.judge(trace)
            key = "kernels_on" if kernels else "kernels_off"
            row[key] = {"max_gap_ratio": r["max_gap_ratio"], "max_gap_ratio_step": r["max_gap_ratio_step"],
                        "within_noise": r["within_noise"], "divergence_step": r["divergence_step"]}
        row["seconds"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        on, off = row["kernels_on"], row["kernels_off"]
        print(f"seed {seed:3d}: kernels on {on['max_gap_ratio']:8.2f} {'pass' if on['within_noise'] else 'FAIL'}"
              f" | off {off['max_gap_ratio']:8.2f} {'pass' if off['within_noise'] else 'FAIL'}  ({row['seconds']} s)",
              flush=True)
        (out / "noise_floor_seeds.json").write_text(json.dumps(summary(a, rows, t_all), indent=2))
    s = summary(a, rows, t_all)
    print(f"within noise: kernels on {s['passes']['kernels_on']}/{len(rows)}, "
          f"off {s['passes']['kernels_off']}/{len(rows)} (factor {nf.NOISE_FACTOR:g})")


def summary(a: argparse.Namespace, rows: list[dict], t_all: float) -> dict:
    return {"command": " ".join(["python", *sys.argv]), "steps": a.steps, "lr": float(a.lr),
            "noise_factor": nf.NOISE_FACTOR, "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "passes": {k: sum(bool(r[k]["within_noise"]) for r in rows) for k in ("kernels_on", "kernels_off")},
            "seconds": round(time.perf_counter() - t_all, 1), "rows": rows}


if __name__ == "__main__":
    main()
