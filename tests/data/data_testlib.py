"""Helpers shared by the data tests: small random token files and a tiny config on them."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from olmax.config import Config
from olmax.recipes import get_recipe

VOCAB = 1000
SIZES = (1000, 2500, 31, 4000, 777)   # tokens per file; L=32 gives 31+78+0+125+24 = 258 instances


def write_tokens(path: Path, tokens: np.ndarray, dtype: str = "uint16") -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    np.asarray(tokens).astype(np.dtype(dtype).newbyteorder("<")).tofile(path)
    return str(path)


def random_files(root: Path, sizes=SIZES, dtype: str = "uint16", vocab: int = VOCAB, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [write_tokens(root / f"part-{i:05d}.npy", rng.integers(0, vocab, n), dtype) for i, n in enumerate(sizes)]


def make_cfg(paths: list[str], cache: Path, *extra: str) -> Config:
    return get_recipe("tiny", [f"data.paths={','.join(paths)}", f"model.vocab_size={VOCAB}",
                               "data.sequence_length=32", "train.global_batch_size=12", "data.workers=0",
                               "data.prefetch=2", "train.steps=1000", f"data.cache_dir={cache}", *extra])
