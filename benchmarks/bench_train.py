"""Train-step throughput on this machine, for the tiny recipe and a ~100M configuration.

MFU needs a peak; CPUs have no datasheet number in our table, so the peak is measured in the
same run: the best of a few large fp32 matmuls (jnp.dot) on this machine. Printed: tokens/s,
model FLOP/s (OLMo-core formula) and their ratio to the measured matmul peak.

    .venv/bin/python benchmarks/bench_train.py [--steps 5]
"""

from __future__ import annotations

import argparse
import time
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

import olmax  # first: keeps JAX off a TPU runtime that has no TPU here
from olmax.metrics.flops import flops_per_token
from olmax.model.params import count_params, init_params
from olmax.objectives.lm import make_lm_step
from olmax.optim import apply_update, init_opt_state
from olmax.recipes import get_recipe


def matmul_peak(n: int = 2048, reps: int = 5) -> float:
    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda x: x @ x)
    f(a).block_until_ready()
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        f(a).block_until_ready()
        best = min(best, time.perf_counter() - t)
    return 2 * n ** 3 / best


def bench(name: str, overrides: list[str], steps: int) -> dict:
    cfg = get_recipe("tiny", overrides)
    params = init_params(cfg.model, jax.random.key(0))
    opt = init_opt_state(params, cfg.optim)
    B, L = cfg.train.global_batch_size, cfg.data.sequence_length
    rng = np.random.default_rng(0)
    batch = {"input_ids": jnp.asarray(rng.integers(0, cfg.model.vocab_size, (B, L)), jnp.int32),
             "label_mask": jnp.ones((B, L), bool)}
    step = jax.jit(make_lm_step(cfg, 1, partial(apply_update, optim_cfg=cfg.optim, total_steps=cfg.train.steps)),
                   donate_argnums=(0, 1))
    params, opt, m = step(params, opt, batch)
    jax.block_until_ready(m)
    t = time.perf_counter()
    for _ in range(steps):
        params, opt, m = step(params, opt, batch)
    jax.block_until_ready(m)
    dt = (time.perf_counter() - t) / steps
    tps = B * L / dt
    return {"name": name, "params": count_params(cfg.model)["total"], "step_s": dt, "tokens_per_s": tps,
            "model_flops_per_s": tps * flops_per_token(cfg.model, L)["total"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    olmax.keep_freed_memory()  # as `olmax train` does
    peak = matmul_peak()
    print(f"measured fp32 matmul peak: {peak / 1e9:.1f} GFLOP/s on {jax.devices()[0].device_kind}")
    configs = [
        ("tiny", []),
        ("~100M", ["model.d_model=768", "model.n_layers=8", "model.n_heads=12", "model.n_kv_heads=12",
                   "model.head_dim=64", "model.mlp_hidden=2048", "model.vocab_size=50304",
                   "model.padded_vocab_size=50304", "data.sequence_length=256", "model.sliding_window=128",
                   "train.global_batch_size=4"]),
    ]
    for name, ov in configs:
        r = bench(name, ov, args.steps)
        print(f"{r['name']:>6}: {r['params'] / 1e6:7.1f}M params  {r['step_s'] * 1e3:8.1f} ms/step  "
              f"{r['tokens_per_s']:9.0f} tokens/s  MFU vs measured peak {r['model_flops_per_s'] / peak:.3f}")


if __name__ == "__main__":
    main()
