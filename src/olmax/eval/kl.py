"""Token-level comparison of two models on identical inputs.

At every position of every input row, both models' next-token distributions over the *real*
vocabulary (padded LM-head rows sliced off) are compared in fp32:

- ``kl_mean`` / ``kl_max``: KL(A || B) = sum_v p_A(v) (log p_A(v) - log p_B(v)) per token
  (``log_softmax``; per-token values below 0 from rounding are clamped to 0, as ``olmax parity``),
  mean and max over tokens, in nats;
- ``top1_agreement``: fraction of tokens where both argmaxes agree;
- ``top10_overlap``: mean of |top10(A) & top10(B)| / 10 (k = vocab size if smaller);
- ``max_abs_logit_diff``: max |logit_A - logit_B| over tokens and real vocabulary;
- ``tokens``: positions compared.

The same key names as ``olmax parity``. JSON of ``olmax eval kl --json``: these keys plus
``a``, ``b`` (the paths), ``batch``, ``seq_len`` and ``inputs`` (``random seed S``, a .npy
file, or token files).
"""

from __future__ import annotations

import math
from functools import lru_cache
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from olmax.config import Config, ConfigError, ModelConfig
from olmax.model.olmo3 import forward

TOPK = 10
# Logit elements per jitted call (rows of the batch are grouped up to this): bounds the fp32
# logits, log-probs and their difference for both models to a few GiB at a 100k vocabulary.
ELEMENTS_PER_CALL = 1 << 28


def _model_cfg(cfg: Config | ModelConfig) -> ModelConfig:
    return cfg.model if isinstance(cfg, Config) else cfg


@lru_cache(maxsize=8)
def _stats_fn(ma: ModelConfig, mb: ModelConfig, k: int) -> Any:
    vocab = ma.vocab_size

    def stats(pa: Any, pb: Any, ids: jax.Array) -> tuple[jax.Array, ...]:
        la = forward(pa, ids, ma)[..., :vocab]
        lb = forward(pb, ids, mb)[..., :vocab]
        lpa, lpb = jax.nn.log_softmax(la, axis=-1), jax.nn.log_softmax(lb, axis=-1)
        kl_tok = jnp.maximum(jnp.sum(jnp.exp(lpa) * (lpa - lpb), axis=-1), 0.0)
        top1 = jnp.argmax(la, axis=-1) == jnp.argmax(lb, axis=-1)
        _, ia = jax.lax.top_k(la, k)
        _, ib = jax.lax.top_k(lb, k)
        overlap = jnp.sum(jnp.any(ia[..., :, None] == ib[..., None, :], axis=-1), axis=-1) / k
        return (jnp.sum(kl_tok), jnp.max(kl_tok), jnp.sum(top1.astype(jnp.float32)),
                jnp.sum(overlap.astype(jnp.float32)), jnp.max(jnp.abs(la - lb)))

    return jax.jit(stats)


def kl(params_a: Any, cfg_a: Config | ModelConfig, params_b: Any, cfg_b: Config | ModelConfig,
       tokens: np.ndarray) -> dict[str, float | int]:
    """Compare models A and B on ``tokens`` ([B, T] or [T] token ids); keys in the module docstring."""
    ma, mb = _model_cfg(cfg_a), _model_cfg(cfg_b)
    if ma.vocab_size != mb.vocab_size:
        raise ConfigError(f"the models have different vocabularies ({ma.vocab_size} vs {mb.vocab_size} tokens); "
                          "KL needs the same tokenizer")
    toks = np.asarray(tokens)
    if toks.ndim == 1:
        toks = toks[None]
    if toks.ndim != 2 or toks.size == 0 or not np.issubdtype(toks.dtype, np.integer):
        raise ConfigError(f"tokens must be non-empty integer ids of shape [T] or [B, T], got {toks.dtype} {toks.shape}")
    if toks.min() < 0 or toks.max() >= ma.vocab_size:
        raise ConfigError(f"token ids must lie in [0, {ma.vocab_size}), got [{toks.min()}, {toks.max()}]")
    toks = toks.astype(np.int32)
    b, t = toks.shape
    k = min(TOPK, ma.vocab_size)
    fn = _stats_fn(ma, mb, k)
    rows = max(1, min(b, ELEMENTS_PER_CALL // (t * ma.vocab_size)))
    kl_sum = top1 = overlap = 0.0
    kl_max = diff_max = 0.0
    for i in range(0, b, rows):
        s = [float(x) for x in fn(params_a, params_b, jnp.asarray(toks[i:i + rows]))]
        kl_sum += s[0]
        kl_max = max(kl_max, s[1])
        top1 += s[2]
        overlap += s[3]
        diff_max = max(diff_max, s[4])
    n = b * t
    if not all(math.isfinite(x) for x in (kl_sum, diff_max)):
        raise ValueError("non-finite logits: one of the models produced NaN or Inf")
    return {"kl_mean": kl_sum / n, "kl_max": kl_max, "top1_agreement": top1 / n, "top10_overlap": overlap / n,
            "max_abs_logit_diff": diff_max, "tokens": n}


def random_tokens(vocab_size: int, batch: int, seq_len: int, seed: int) -> np.ndarray:
    """Uniform random ids, as ``olmax parity`` draws them (a seeded numpy generator)."""
    if batch <= 0 or seq_len <= 0:
        raise ConfigError(f"--batch and --seq-len must be positive, got {batch}, {seq_len}")
    return np.random.default_rng(seed).integers(0, vocab_size, (batch, seq_len), dtype=np.int64)


def load_token_array(path: str, vocab_size: int) -> np.ndarray:
    """Ids from a ``.npy`` file *with* a header (``numpy.save``), shape [T] or [B, T]."""
    from pathlib import Path
    if not Path(path).is_file():
        raise FileNotFoundError(f"--tokens {path} does not exist")
    try:
        toks = np.load(path, allow_pickle=False)
    except (ValueError, OSError) as e:
        raise ConfigError(f"--tokens {path}: not a .npy array with a header ({e}); save one with numpy.save, "
                          "or pass raw token files with --data") from None
    return check_tokens(toks, vocab_size, f"--tokens {path}")


def check_tokens(toks: np.ndarray, vocab_size: int, what: str = "tokens") -> np.ndarray:
    """Integer ids in [0, vocab_size) of shape [T] or [B, T], as int64 [B, T]."""
    toks = toks[None] if toks.ndim == 1 else toks
    if toks.ndim != 2 or not np.issubdtype(toks.dtype, np.integer) or toks.size == 0:
        raise ConfigError(f"{what}: expected integer ids of shape [T] or [B, T], got {toks.dtype} {toks.shape}")
    if toks.min() < 0 or toks.max() >= vocab_size:
        raise ConfigError(f"{what}: token ids must lie in [0, {vocab_size})")
    return toks.astype(np.int64)
