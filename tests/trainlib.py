"""Helpers for training tests: small structured token corpora and a test-sized tiny config."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np

SMALL = [
    "model.vocab_size=256", "model.padded_vocab_size=256", "model.d_model=32", "model.n_layers=4",
    "model.n_heads=4", "model.n_kv_heads=2", "model.head_dim=8", "model.mlp_hidden=64",
    "model.sliding_window=8", "data.sequence_length=16", "data.dtype=uint16", "data.workers=0",
    "train.global_batch_size=8", "train.steps=6", "train.log_interval=1", "checkpoint.interval=2",
    "checkpoint.async_save=false", "optim.schedule.warmup=2", "eval.interval=1000",
]


def write_corpus(root: Path, n_files: int = 2, tokens_per_file: int = 4000, vocab: int = 256, seed: int = 0,
                 dtype: str = "uint16") -> list[str]:
    """Token files with learnable structure: a noisy Markov chain (next = prev * 7 + 3 mod vocab)."""
    rng = np.random.default_rng(seed)
    root.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n_files):
        x = np.empty(tokens_per_file, np.int64)
        x[0] = rng.integers(vocab)
        noise = rng.random(tokens_per_file) < 0.2
        rand = rng.integers(0, vocab, tokens_per_file)
        for t in range(1, tokens_per_file):
            x[t] = rand[t] if noise[t] else (x[t - 1] * 7 + 3) % vocab
        p = root / f"part-{i:03d}.npy"
        x.astype(np.dtype(dtype).newbyteorder("<")).tofile(p)
        paths.append(str(p))
    return paths


def small_overrides(paths: list[str], *extra: str) -> list[str]:
    return SMALL + [f"data.paths={','.join(paths)}", *extra]


RL_WORDS = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "fast", "blue", "sky", "is", "and", "we", "see"]


def write_rl_data(d: Path) -> Path:
    """A small BPE (``tokenizer.json``, 300 tokens) and 12 prompts whose gold answer is the letter
    "a", in ``d`` (made if missing)."""
    import json
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    d.mkdir(parents=True, exist_ok=True)
    rnd = random.Random(0)
    corpus = [" ".join(rnd.choices(RL_WORDS, k=rnd.randint(4, 12))) + "." for _ in range(300)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|pad|>"],
                                                        show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(d / "tokenizer.json"))
    with open(d / "prompts.jsonl", "w") as f:
        for _ in range(12):
            f.write(json.dumps({"prompt": " ".join(rnd.choices(RL_WORDS, k=4)), "ground_truth": "a"}) + "\n")
    return d


def rl_overrides(data: Path, *extra: str) -> list[str]:
    """``tiny_rl`` on ``write_rl_data``'s prompts: operator.contains(completion, "a") (8 random
    tokens of this BPE hold an "a" 39% of the time); the model's vocabulary is the BPE's, padded to
    384 rows (the sampler and the loss leave the padding out). Training rows are packed to the
    unpacked row's 56 tokens (a mini-batch's 4 completions of these short prompts fit one)."""
    return ["model.vocab_size=300", "model.padded_vocab_size=384", f"rl.prompts_path={data / 'prompts.jsonl'}",
            f"rl.tokenizer={data}", "rl.reward=operator:contains", "rl.group_size=4", "rl.prompts_per_step=2",
            "train.global_batch_size=8", "rl.max_response_length=8", "data.sequence_length=56", "rl.pack_length=56",
            "model.compute_dtype=float32", "model.param_dtype=float32", "checkpoint.interval=2", *extra]


def rl_cfg(data: Path, *extra: str):
    from olmax.recipes import get_recipe
    return get_recipe("tiny_rl", rl_overrides(data, *extra))


def run_on_cpu_devices(code: str, devices: int = 4) -> Any:
    """Runs ``code`` (a script that prints JSON last) in a fresh Python with ``devices`` CPU
    devices and this folder on the path; returns that JSON."""
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.path.dirname(os.path.abspath(__file__))}
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def normal(key: Any, shape: tuple[int, ...], dtype: Any = None) -> Any:
    """``jax.random.normal(key, shape, dtype)``, the same numbers, from one compiled draw per power
    of two: XLA CPU takes 0.2 s to compile a draw (0.5 to 1.8 s for a small shape of rank 4 or 5),
    and the kernel tests draw ~100 shapes. With JAX's partitionable threefry (its default) an
    element's number depends on the key and its flat index alone, so the first ``prod(shape)``
    numbers of a longer flat draw are those of the shape."""
    import math

    import jax
    import jax.numpy as jnp
    dtype = dtype or jnp.float32
    if not jax.config.jax_threefry_partitionable:
        return jax.random.normal(key, shape, dtype)
    n = math.prod(shape)
    flat = jax.random.normal(key, (1 << max(n - 1, 0).bit_length(),), dtype)
    return jnp.asarray(np.asarray(flat)[:n].reshape(shape))
