"""RL's rollout fidelity: the largest |log-prob the sampler reported - log-prob of RL's training
forward| over the sampled tokens of a batch, in fp32 and in bf16, with the bf16 noise floor beside
it. One sampled batch of ``--rows`` prompts (5 to 19 tokens) x ``--new`` tokens at temperature 1
on a random OLMo 3 (``--d-model``, ``--layers``, heads of d/8, MLP 3d, vocabulary 16,384, sliding
window 16 on three layers of four, so the decode cache's ring wraps); weights 3x the
initialisation, for peaked distributions like a trained model's.

- fp32: the training forward as RL runs it (``grpo.policy_logps``; on one CPU device with olmax's
  kernels it repeats the decode steps' arithmetic, ``dispatch.reproduce_decode_bits``), and XLA's own
  forward for comparison.
- bf16 (compute bf16, parameters fp32; on one CPU device with olmax's kernels the decode
  arithmetic too, in fp32 on bf16 numbers): the gap, XLA's forward's, and two floors of
  the training forward itself: the same rows computed in two micro-batches instead of one, and
  the bf16 forward against the fp32 one.

    .venv/bin/python benchmarks/bench_logprob_gap.py [--d-model 512] [--layers 8] [--rows 8] [--new 40]
"""

from __future__ import annotations

import argparse
import dataclasses

import jax
import numpy as np

import olmax  # noqa: F401  (first: keeps JAX off a TPU runtime that has no TPU here)
from olmax.config import Config, ModelConfig
from olmax.engine import Sampling, generate
from olmax.model.dispatch import can_reproduce_decode_bits
from olmax.model.params import init_params
from olmax.rl import grpo


def measure(d: int = 512, layers: int = 8, rows: int = 8, new: int = 40, seed: int = 0,
            dtypes: tuple[str, ...] = ("float32", "bfloat16"), attention: str = "auto") -> dict:
    """The gaps of one sampled batch per compute dtype, as a dict (``main`` prints it; the GPU
    check records it): ``gap`` (the training forward as RL runs it), ``forward`` (which one),
    ``gap_xla_forward`` (where that is the decode arithmetic), and in bf16 the two floors
    ``floor_two_micro_batches`` and ``floor_bf16_vs_fp32`` and ``mean_abs_logprob``. ``attention``:
    ``model.attention_impl``."""
    base = ModelConfig(d_model=d, n_layers=layers, n_heads=8, n_kv_heads=8, head_dim=d // 8, mlp_hidden=3 * d,
                       vocab_size=16384, padded_vocab_size=16384, sliding_window=16, max_position_embeddings=1024,
                       param_dtype="float32", attention_impl=attention)
    params = jax.tree.map(lambda a: a * 3 if a.ndim == 2 else a, init_params(base, jax.random.key(seed)))
    rng = np.random.default_rng(seed)
    prompts = [list(map(int, rng.integers(0, base.vocab_size, rng.integers(5, 20)))) for _ in range(rows)]
    length = 20 + new
    res: dict = {"d_model": d, "layers": layers, "rows": rows, "new_tokens": new, "backend": jax.default_backend()}
    for dtype in dtypes:
        m = dataclasses.replace(base, compute_dtype=dtype)
        out = generate(params, m, prompts, max_new_tokens=new, sampling=Sampling(temperature=1.0, seed=seed),
                       batch_size=rows)
        toks = np.zeros((rows, length), np.int32)
        mask = np.zeros((rows, length), bool)
        gen = np.zeros((rows, length), np.float32)
        sel = np.zeros((rows, length), bool)
        for i, (p, c) in enumerate(zip(prompts, out)):
            seq = p + c.token_ids
            toks[i, :len(seq)], mask[i, len(p):len(seq)] = seq, True
            at = slice(len(p) - 1, len(p) - 1 + len(c.token_ids))  # token_logps' layout
            gen[i, at], sel[i, at] = c.logprobs, True

        def logps(model: ModelConfig, part: slice, exact: bool) -> np.ndarray:
            cfg = Config(model=model)
            return np.asarray(jax.jit(lambda p, t, k: grpo.policy_logps(p, t, k, cfg, exact))(
                params, toks[part], mask[part]))

        def worst(a: np.ndarray) -> float:
            return float(np.abs(a[sel]).max())

        exact = can_reproduce_decode_bits(m)
        train = logps(m, slice(None), exact)
        r: dict = {"gap": worst(gen - train), "forward": "the decode arithmetic" if exact else "XLA"}
        if exact:
            r["gap_xla_forward"] = worst(gen - logps(m, slice(None), False))
        if dtype == "bfloat16":
            half = rows // 2
            split = np.concatenate([logps(m, slice(0, half), False), logps(m, slice(half, None), False)])
            fp32 = logps(dataclasses.replace(m, compute_dtype="float32"), slice(None), False)
            r.update(floor_two_micro_batches=worst(split - train), floor_bf16_vs_fp32=worst(fp32 - train),
                     mean_abs_logprob=float(np.abs(train[sel]).mean()))
        res[dtype] = r
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--new", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(f"[gap] random OLMo 3 d_model {args.d_model} x {args.layers} layers, {args.rows} rows x "
          f"{args.new} sampled tokens")
    res = measure(args.d_model, args.layers, args.rows, args.new, args.seed)
    for dtype in ("float32", "bfloat16"):
        r = res[dtype]
        line = f"  {dtype}: gap {r['gap']:.3g} (training forward as RL runs it: {r['forward']})"
        if "gap_xla_forward" in r:
            line += f"; XLA's forward instead: {r['gap_xla_forward']:.3g}"
        if dtype == "bfloat16":
            line += (f"; floor: 2 micro-batches vs 1 {r['floor_two_micro_batches']:.3g}, bf16 vs fp32 "
                     f"{r['floor_bf16_vs_fp32']:.3g}; mean |log-prob| {r['mean_abs_logprob']:.2f}")
        print(line, flush=True)


if __name__ == "__main__":
    main()
