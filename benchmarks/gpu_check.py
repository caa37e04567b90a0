"""GPU checks for one NVIDIA GPU (run by gpu_check.sh): bf16 logit parity through cuDNN flash
attention, and train-step MFU of a 7B-width slice against the GPU's datasheet bf16 peak.

1. Parity: a random tiny OLMo 3 (sequence longer than its window). With transformers and torch
   installed, `olmax parity --dtype bfloat16 --attention cudnn` against transformers' fp32 eager
   model; otherwise olmax bf16 + cuDNN against olmax fp32 + the exact reference kernel. Reports
   KL mean/max and top-1 agreement; the published bf16 noise floor is KL mean 1.5e-3.
2. MFU: 8 layers of the 7B (d 4096, 32 heads x 128, MLP 11008, window 4096 on 3 of 4 layers) at
   8192 context with the full 100,352-row vocabulary, bf16 compute, fp32 master weights and Adam,
   the production step (scanned layers, chunked loss); tokens/s after warm-up, FLOPs by the
   OLMo-core formula, MFU against the datasheet peak.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np


def parity(out: dict) -> None:
    from olmax.model.olmo3 import forward
    from olmax.model.params import init_params
    from olmax.recipes import get_recipe
    cfg = get_recipe("tiny").model
    try:
        import tempfile

        from olmax.compat.hf import random_hf_model
        from olmax.verify.parity import run_parity
        with tempfile.TemporaryDirectory() as d:
            hf_dir = random_hf_model(d + "/hf", vocab_size=1024, hidden_size=256, intermediate_size=512,
                                     num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                     sliding_window=128, max_position_embeddings=1024, rms_norm_eps=1e-6,
                                     eos_token_id=0, pad_token_id=1)
            r = run_parity(hf_dir, dtype="bfloat16", attention_impl="cudnn", seq_len=512, batch=2)
        out["parity"] = {"reference": r["reference"], "kl_mean": r["kl_mean"], "kl_max": r["kl_max"],
                         "top1_agreement": r["top1_agreement"], "attention_impl": r["attention_impl"]}
        return
    except ImportError as e:
        out["parity_note"] = f"transformers/torch unavailable ({e}); olmax fp32 reference kernel is the reference"
    params = init_params(cfg, jax.random.key(0))
    toks = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 512)), jnp.int32)
    ref = jax.jit(lambda p, t: forward(p, t, replace(cfg, compute_dtype="float32", attention_impl="reference")))(params, toks)
    got = jax.jit(lambda p, t: forward(p, t, replace(cfg, compute_dtype="bfloat16", attention_impl="cudnn")))(params, toks)
    lp, lq = jax.nn.log_softmax(ref, -1), jax.nn.log_softmax(got, -1)
    kl = jnp.sum(jnp.exp(lp) * (lp - lq), -1)
    out["parity"] = {"reference": "olmax fp32 reference attention", "kl_mean": float(kl.mean()),
                     "kl_max": float(kl.max()), "top1_agreement": float((ref.argmax(-1) == got.argmax(-1)).mean()),
                     "attention_impl": "cudnn"}


def mfu(out: dict, steps: int, batch: int) -> None:
    from olmax.metrics.flops import device_peak_flops, flops_per_token
    from olmax.model.params import init_params
    from olmax.optim import init_opt_state
    from olmax.recipes import get_recipe
    from olmax.sharding import make_mesh, plan_batch
    from olmax.checkpoint.state import abstract_train_state, shardings
    from olmax.train.step import jit_train_step
    cfg = get_recipe("olmo3_7b_stage1", ["model.n_layers=8", f"train.global_batch_size={batch}",
                                         "train.max_micro_batch_size=null", "mesh.fsdp=-1"])
    mesh = make_mesh(cfg.mesh)
    plan = plan_batch(batch, dict(mesh.shape), None)
    abstract = abstract_train_state(cfg, mesh)
    pshard, oshard = shardings(abstract["params"]), shardings(abstract["opt_state"])
    params = jax.jit(lambda k: init_params(cfg.model, k), out_shardings=pshard)(jax.random.key(0))
    opt = jax.jit(lambda p: init_opt_state(p, optim_cfg=cfg.optim), out_shardings=oshard)(params)
    step = jit_train_step(cfg, mesh, plan, pshard, oshard)
    L = cfg.data.sequence_length
    rng = np.random.default_rng(0)
    data = {"input_ids": jnp.asarray(rng.integers(0, cfg.model.vocab_size, (batch, L)), jnp.int32),
            "label_mask": jnp.ones((batch, L), bool)}
    t0 = time.perf_counter()
    params, opt, m = step(params, opt, data)
    jax.block_until_ready(m)
    compile_s = time.perf_counter() - t0
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        params, opt, m = step(params, opt, data)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t)
    dt = float(np.median(times))
    tps = batch * L / dt / jax.device_count()
    fl = flops_per_token(cfg.model, L)["total"]
    kind = jax.devices()[0].device_kind
    peak = device_peak_flops(kind)
    out["mfu"] = {"device": kind, "layers": cfg.model.n_layers, "seq_len": L, "batch": batch,
                  "attention": cfg.model.attention_impl, "remat": cfg.model.remat,
                  "step_seconds_median": dt, "tokens_per_second": tps, "flops_per_token": fl,
                  "tflops_per_second": fl * tps / 1e12, "peak_tflops": peak and peak / 1e12,
                  "mfu": (fl * tps / peak) if peak else None, "first_step_seconds": compile_s,
                  "ce_loss_last": float(m["ce_loss"]),
                  "memory_peak_gib": (jax.devices()[0].memory_stats() or {}).get("peak_bytes_in_use", 0) / 2 ** 30}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if jax.default_backend() != "gpu":
        print(f"no GPU: JAX runs on {jax.default_backend()}", file=sys.stderr)
        return 2
    out: dict = {"jax": jax.__version__, "devices": [d.device_kind for d in jax.devices()]}
    parity(out)
    print(json.dumps(out, indent=2), flush=True)
    mfu(out, args.steps, args.batch)
    print(json.dumps(out, indent=2), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
