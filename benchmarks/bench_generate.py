"""Decoding speed: ``olmax.engine.generate`` (KV cache, jitted prefill and one-token
steps) against transformers' ``model.generate`` on the same random OLMo 3, on this CPU, as ratios
measured in the same run.

Model: a ``random_hf_model`` with d_model 512, 8 layers (6 sliding with a 128-token window, 2
full), 8 heads (MHA as the 7B), MLP 1536, vocabulary 16384, fp32 on both sides. Prompts of 64
tokens, batch 1 and 8, greedy, no EOS (every row runs to the length).

Decode tokens/s = batch x (N2 - N1) / (t(N2) - t(N1)) with N1 = 65 and N2 = 128 new tokens: both
runs do the same prefill and use the same cache length (olmax rounds prompt + new tokens up to a
multiple of 64), so the difference is 63 decode steps. Each t is the best of ``--repeats`` runs
after a warm-up, the two systems' runs interleaved; olmax's compile time (its first call minus
its best warm call) is reported apart.
End to end tokens/s (prefill included) at N2 are printed too. The greedy tokens of both systems
are compared (the decoding parity tests check them exactly; here it is a sanity check).

Against the memory bound: the bytes one decode step reads (every prepared weight but the
embedding, and the whole cache) over olmax's step time, as a share of the read bandwidth of a
jitted sum on this machine in the same run (a small model's decode step is a pass over memory).

Also: the KV cache's bytes as ``olmax.model.decode.cache_bytes`` reports them, as the arrays a
prefill returns hold them (their shapes and dtypes, traced), and by the formula (per layer 2 x batch
x slots x kv heads x head dim x 4 bytes, slots = the cache length for full layers and min(window,
length) for sliding ones, plus an int32 position per slot of each kind and the lengths); and for the
7B at 32,768 tokens the saving over a cache that keeps every position in every layer.

    .venv/bin/python benchmarks/bench_generate.py [--repeats 2]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import replace
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np

import olmax  # noqa: F401  (first: keeps JAX off a TPU runtime that has no TPU here)

HF = dict(vocab_size=16384, hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
          num_key_value_heads=8, max_position_embeddings=1024, sliding_window=128, rms_norm_eps=1e-6,
          eos_token_id=0, pad_token_id=1, bos_token_id=None)
PROMPT, N1, N2 = 64, 65, 128


def seconds(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def read_bandwidth() -> float:
    """GB/s of one pass over 256 MB by XLA on this CPU (a jitted sum, both cores; numpy's
    one-threaded sum reads about half as fast): the memory bound a decode step of a small model
    runs against."""
    a = jnp.ones(64 * 2**20, jnp.float32)
    total = jax.jit(jnp.sum)
    total(a).block_until_ready()
    return a.nbytes / min(seconds(lambda: total(a).block_until_ready()) for _ in range(5)) / 1e9


def formula_bytes(m, batch: int, length: int, itemsize: int = 4) -> int:
    full = sum(m.is_full_attention(i) for i in range(m.n_layers))
    sliding = m.n_layers - full
    ring = min(m.sliding_window or length, length)
    kv = 2 * batch * m.n_kv_heads * m.head_dim * itemsize * (full * length + sliding * ring)
    return kv + 4 * batch * ((length if full else 0) + (ring if sliding else 0) + 1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=2)
    args = ap.parse_args()

    import torch
    from transformers import Olmo3ForCausalLM

    from olmax.checkpoint.load import load_params
    from olmax.compat.hf import random_hf_model
    from olmax.engine import Generator, Sampling, cache_length, generate
    from olmax.model.decode import cache_bytes, prefill, step_weight_bytes

    tmp = tempfile.mkdtemp(prefix="bench_generate_")
    random_hf_model(tmp, seed=0, **HF)
    hf = Olmo3ForCausalLM.from_pretrained(tmp, torch_dtype=torch.float32).eval()
    params, cfg = load_params(f"hf:{tmp}")
    m = replace(cfg.model, param_dtype="float32", compute_dtype="float32", remat="none")
    params = jax.device_put(params)
    gen = Generator(params, m, Sampling())
    rng = np.random.default_rng(0)
    print(f"[generate] random OLMo 3: d_model {m.d_model}, {m.n_layers} layers (window {m.sliding_window}), "
          f"{m.n_heads} heads / {m.n_kv_heads} kv, MLP {m.mlp_hidden}, vocab {m.vocab_size}, fp32; prompts of "
          f"{PROMPT} tokens, greedy; torch {torch.__version__} ({torch.get_num_threads()} threads), "
          f"jax {jax.__version__}",
          flush=True)
    bandwidth = read_bandwidth()
    print(f"  memory read bandwidth (XLA's sum of 256 MB, best of 5): {bandwidth:.1f} GB/s", flush=True)
    rows = []
    for batch in (1, 8):
        prompts = rng.integers(2, m.vocab_size, (batch, PROMPT)).tolist()

        def ox(n: int) -> list[list[int]]:
            out = generate(params, m, prompts, max_new_tokens=n, batch_size=batch, generator=gen)
            return [c.token_ids for c in out]

        ids = torch.tensor(prompts)
        mask = torch.ones_like(ids)

        def ref(n: int) -> list[list[int]]:
            with torch.no_grad():
                out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                                  do_sample=False, pad_token_id=1)
            return out[:, PROMPT:].tolist()

        t = time.perf_counter()
        toks_ox = ox(N2)
        first = time.perf_counter() - t
        toks_hf = ref(N2)  # warm-up
        # Interleaved, so a change in the machine's load hits both systems alike.
        t_ox, t_hf = {N1: [], N2: []}, {N1: [], N2: []}
        for _ in range(args.repeats):
            for n in (N1, N2):
                t_ox[n].append(seconds(lambda: ox(n)))
                t_hf[n].append(seconds(lambda: ref(n)))
        t_ox, t_hf = {n: min(v) for n, v in t_ox.items()}, {n: min(v) for n, v in t_hf.items()}
        dec_ox = batch * (N2 - N1) / (t_ox[N2] - t_ox[N1])
        dec_hf = batch * (N2 - N1) / (t_hf[N2] - t_hf[N1])
        same = sum(a == b for a, b in zip(toks_ox, toks_hf))
        agree = np.mean([np.mean(np.array(a) == np.array(b)) for a, b in zip(toks_ox, toks_hf)])
        rows.append((batch, dec_ox, dec_hf, batch * N2 / t_ox[N2], batch * N2 / t_hf[N2], first - t_ox[N2]))
        # What one decode step must read: every prepared weight but the embedding (one row per
        # token) and the whole cache (attention reads every slot, masked or not).
        weights = step_weight_bytes(gen.weights(batch))
        step_bytes = weights + cache_bytes(m, batch, cache_length(PROMPT, N2))
        gbs = step_bytes / (batch / dec_ox) / 1e9
        print(f"  batch {batch}: one olmax decode step reads {step_bytes / 1e6:.0f} MB (weights {weights / 1e6:.0f}, "
              f"cache {(step_bytes - weights) / 1e6:.0f}): {gbs:.1f} GB/s, {gbs / bandwidth:.0%} of the "
              f"{bandwidth:.1f} GB/s this machine reads", flush=True)
        print(f"  batch {batch}: decode olmax {dec_ox:8.1f} tok/s  transformers {dec_hf:8.1f} tok/s  "
              f"ratio {dec_ox / dec_hf:5.2f}x | end to end ({N2} new) olmax {batch * N2 / t_ox[N2]:8.1f}  "
              f"transformers {batch * N2 / t_hf[N2]:8.1f}  ratio {t_hf[N2] / t_ox[N2]:5.2f}x | olmax compile "
              f"{first - t_ox[N2]:5.1f} s | identical greedy rows {same}/{batch} (token agreement {agree:.1%})",
              flush=True)

    print("\n[kv cache] bytes (fp32)")
    for batch, length in ((1, 192), (8, 192), (8, 1024)):
        reported = cache_bytes(m, batch, length)
        # The arrays a prefill returns, by shape and dtype (traced, not compiled or run).
        _, cache = jax.eval_shape(partial(prefill, cfg=m, max_length=length), gen.weights(batch),
                                  jnp.zeros((batch, PROMPT), jnp.int32), jnp.full((batch,), PROMPT, jnp.int32))
        held = sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(cache))
        want = formula_bytes(m, batch, length)
        dense = 2 * batch * m.n_layers * m.n_kv_heads * m.head_dim * 4 * length
        print(f"  batch {batch}, length {length:5d}: cache_bytes {reported:>11,}  arrays {held:>11,}  formula "
              f"{want:>11,}  {'equal' if reported == held == want else 'DIFFERENT'}; every-position cache {dense:>11,} "
              f"({dense / reported:.2f}x)")
    from olmax.recipes import get_recipe
    m7 = get_recipe("olmo3_7b_stage1").model
    for dt, item in (("bfloat16", 2),):
        got = cache_bytes(m7, 1, 32768, dtype=dt)
        dense = 2 * m7.n_layers * m7.n_kv_heads * m7.head_dim * item * 32768
        print(f"  7B, batch 1, 32,768 tokens, {dt}: {got / 2**30:.2f} GiB "
              f"(formula {formula_bytes(m7, 1, 32768, item) / 2**30:.2f}); "
              f"every position in every layer {dense / 2**30:.2f} GiB ({dense / got:.2f}x)")
    print("\n  ratios (olmax / transformers, decode tokens/s): "
          + ", ".join(f"batch {b}: {o / h:.2f}x" for b, o, h, *_ in rows))


if __name__ == "__main__":
    main()
