"""Short completions of geometric length: ``olmax generate --batching continuous`` against
``--batching static`` as a user runs them, in process wall time, side by side in one run.

The workload: 256 ``--prompt-ids`` prompts of 2-19 token ids, ``--temperature 1 --seed 23
--max-new-tokens 240 --batch-size 16``, on a randomly initialised OLMo 3 of 6 layers, d_model 256
(4 heads of 64, MLP 704, the tiny recipe's 4,096-token vocabulary), fp32, on the CPU. Its
completions end at EOS with a probability near 1/48 a token (the embedding's first dimension is a
constant 100 and only the EOS column of the LM head reads it: a fixed EOS bias over near-uniform
logits), so lengths are close to geometric (mean about 50), capped at 240. Here many short rows free
their slots often: each host round trip of the continuous engine admits new rows, and admission
(prefill, writing the rows into the cache, the compiled programs it needs) is what it spends beside
the decode steps it saves.

Each engine runs ``--repeats`` processes, interleaved, after one that fills a persistent XLA
compilation cache in a temporary folder (JAX's defaults otherwise: what a user with a cache dir
gets); reported: the best process wall time of each (start to exit: imports, weights, tracing,
the cache's programs and the run), the ``generate`` line's decode steps and slot utilisation,
whether the two engines' completions are identical (token ids and log-probs, to the bit), and the
ratio static / continuous. The first (cache-filling) processes are reported too, as "cold".

    .venv/bin/python benchmarks/bench_admission.py [--repeats 3] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

EOS_BIAS = 0.32     # the EOS logit's lift: exp(0.32 * ~14) / 4096 ~ 1/48 a token
FLAGS = ["--temperature", "1", "--seed", "23", "--max-new-tokens", "240", "--batch-size", "16", "--json"]


def make_model(out: Path) -> None:
    """The 6-layer d256 OLMo 3 (the tiny recipe's shape otherwise) with an EOS bias, saved as an
    olmax weights directory."""
    from dataclasses import replace

    import jax

    from olmax.model.params import init_params
    from olmax.model.weights_io import flatten_tree, save_weights
    from olmax.recipes.tiny import tiny
    c = tiny()
    m = replace(c.model, d_model=256, n_layers=6, n_heads=4, n_kv_heads=4, head_dim=64, mlp_hidden=704,
                max_position_embeddings=1024)
    params = jax.tree.map(np.array, init_params(m, jax.random.key(0)))
    params["embed"][:, 0] = 100.0            # a constant first dimension in the residual stream...
    params["lm_head"][0, :] = 0.0
    params["lm_head"][0, c.data.eos_token_id] = EOS_BIAS   # ...that only EOS's logit reads
    save_weights(out, flatten_tree(params), replace(c, model=m))


def run(batching: str, weights: Path, prompts: Path, env: dict) -> dict:
    cmd = [sys.executable, "-m", "olmax.cli", "generate", "--checkpoint", str(weights), "--prompt-ids", str(prompts),
           *FLAGS, "--batching", batching]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    dt = time.perf_counter() - t0
    if r.returncode:
        raise SystemExit(f"{batching}: olmax generate failed:\n{r.stderr[-3000:]}")
    line = r.stderr.strip().splitlines()[-1]
    util, steps = re.search(r"slot utilisation ([0-9.]+) \((\d+) decoded tokens / (\d+) decode steps", line).group(1, 3)
    out = [json.loads(x) for x in r.stdout.splitlines() if x.strip()]
    return {"seconds": dt, "slot_utilisation": float(util), "decode_steps": int(steps),
            "generate_seconds": float(re.search(r"new tokens in ([0-9.]+) s", line).group(1)),
            "completions": [(c["token_ids"], c["logprobs"]) for c in out]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", metavar="FILE", help="also write the results here")
    args = ap.parse_args()
    import jax

    tmp = Path(tempfile.mkdtemp(prefix="bench_admission_"))
    make_model(tmp / "weights")
    rng = np.random.default_rng(0)
    prompts = [[int(t) for t in rng.integers(2, 4096, size=rng.integers(2, 20))] for _ in range(256)]
    (tmp / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    env = {**os.environ, "JAX_PLATFORMS": "cpu", "JAX_COMPILATION_CACHE_DIR": str(tmp / "xla")}
    src = Path(__file__).resolve().parents[1] / "src"
    env["PYTHONPATH"] = os.pathsep.join([str(src), *filter(None, [os.environ.get("PYTHONPATH")])])
    engines = ("static", "continuous")
    runs: dict[str, list[dict]] = {b: [] for b in engines}
    for rep in range(args.repeats + 1):
        for b in engines:
            r = run(b, tmp / "weights", tmp / "prompts.jsonl", env)
            runs[b].append(r)
            print(f"{b:10s} process {rep}{' (fills the compile cache)' if rep == 0 else ''}: {r['seconds']:6.2f} s "
                  f"(generate {r['generate_seconds']:.2f} s), {r['decode_steps']} decode steps, slot utilisation "
                  f"{r['slot_utilisation']:.2f}", file=sys.stderr, flush=True)
    lengths = [len(ids) for ids, _ in runs["static"][0]["completions"]]
    results: dict = {
        "workload": {"prompts": len(prompts), "prompt_tokens": [2, 19], "flags": " ".join(FLAGS),
                     "model": "OLMo 3, 6 layers, d_model 256, 4 heads x 64, MLP 704, vocabulary 4096, fp32",
                     "mean_length": float(np.mean(lengths)), "at_cap": int(sum(n >= 240 for n in lengths))},
        "machine": {"platform": platform.platform(), "cpus": os.cpu_count(), "jax": jax.__version__},
        "repeats": args.repeats}
    for b in engines:
        warm = runs[b][1:]
        best = min(warm, key=lambda r: r["seconds"])
        results[b] = {"seconds": best["seconds"], "generate_seconds": best["generate_seconds"],
                      "seconds_all": [round(r["seconds"], 2) for r in warm], "cold_seconds": runs[b][0]["seconds"],
                      "decode_steps": best["decode_steps"], "slot_utilisation": best["slot_utilisation"]}
    results["identical"] = all(r["completions"] == runs["static"][0]["completions"] for b in engines for r in runs[b])
    results["ratios"] = {"continuous_speedup": results["static"]["seconds"] / results["continuous"]["seconds"],
                         "continuous_speedup_cold": results["static"]["cold_seconds"]
                         / results["continuous"]["cold_seconds"]}
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
