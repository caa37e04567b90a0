"""Helpers for training tests: small structured token corpora and a test-sized tiny config."""

from __future__ import annotations

from pathlib import Path

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
