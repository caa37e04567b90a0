"""RL's rollout fidelity: the largest |log-prob the sampler reported - log-prob of RL's training
forward| over the sampled tokens of a batch, in fp32 and in bf16, with the bf16 noise floor beside
it. One sampled batch of ``--rows`` prompts (5 to 19 tokens) x ``--new`` tokens at temperature 1
on a random OLMo 3 (``--d-model``, ``--layers``, heads of d/8, MLP 3d, vocabulary 16,384, sliding
window 16 on three layers of four, so the decode cache's ring wraps); weights 3x the
initialisation, for peaked distributions like a trained model's.

- fp32: the training forward as RL runs it (``grpo._logps``; on one CPU device with olmax's
  kernels it repeats the decode steps' arithmetic, ``layers.decode_arithmetic``), and XLA's own
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

import olmax  # noqa: F401  (first: keeps JAX off a TPU runtime that has no TPU here)
import jax
import numpy as np

from olmax.config import Config, ModelConfig
from olmax.model.decode import kernel_arithmetic
from olmax.model.generate import Sampling, generate
from olmax.model.params import init_params
from olmax.rl import grpo


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--new", type=int, default=40)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    d = args.d_model
    base = ModelConfig(d_model=d, n_layers=args.layers, n_heads=8, n_kv_heads=8, head_dim=d // 8, mlp_hidden=3 * d,
                       vocab_size=16384, padded_vocab_size=16384, sliding_window=16, max_position_embeddings=1024,
                       param_dtype="float32")
    params = jax.tree.map(lambda a: a * 3 if a.ndim == 2 else a, init_params(base, jax.random.key(args.seed)))
    rng = np.random.default_rng(args.seed)
    prompts = [list(map(int, rng.integers(0, base.vocab_size, rng.integers(5, 20)))) for _ in range(args.rows)]
    length = 20 + args.new
    print(f"[gap] random OLMo 3 d_model {d} x {args.layers} layers, {args.rows} rows x {args.new} sampled tokens")
    for dtype in ("float32", "bfloat16"):
        m = dataclasses.replace(base, compute_dtype=dtype)
        out = generate(params, m, prompts, max_new_tokens=args.new, sampling=Sampling(temperature=1.0, seed=args.seed),
                       batch_size=args.rows)
        toks = np.zeros((args.rows, length), np.int32)
        mask = np.zeros((args.rows, length), bool)
        gen = np.zeros((args.rows, length), np.float32)
        sel = np.zeros((args.rows, length), bool)
        for i, (p, c) in enumerate(zip(prompts, out)):
            seq = p + c.token_ids
            toks[i, :len(seq)], mask[i, len(p):len(seq)] = seq, True
            at = slice(len(p) - 1, len(p) - 1 + len(c.token_ids))  # token_logps' layout
            gen[i, at], sel[i, at] = c.logprobs, True

        def logps(model: ModelConfig, rows: slice, exact: bool) -> np.ndarray:
            cfg = Config(model=model)
            return np.asarray(jax.jit(lambda p, t, k: grpo._logps(p, t, k, cfg, exact))(params, toks[rows], mask[rows]))

        def worst(a: np.ndarray) -> float:
            return float(np.abs(a[sel]).max())

        exact = kernel_arithmetic(m)
        train = logps(m, slice(None), exact)
        line = f"  {dtype}: gap {worst(gen - train):.3g} (training forward as RL runs it: " \
               f"{'the decode arithmetic' if exact else 'XLA'})"
        if exact:
            line += f"; XLA's forward instead: {worst(gen - logps(m, slice(None), False)):.3g}"
        if dtype == "bfloat16":
            half = args.rows // 2
            split = np.concatenate([logps(m, slice(0, half), False), logps(m, slice(half, None), False)])
            fp32 = logps(dataclasses.replace(m, compute_dtype="float32"), slice(None), False)
            line += (f"; floor: 2 micro-batches vs 1 {worst(split - train):.3g}, bf16 vs fp32 {worst(fp32 - train):.3g}"
                     f"; mean |log-prob| {float(np.abs(train[sel]).mean()):.2f}")
        print(line, flush=True)


if __name__ == "__main__":
    main()
