"""Token-level comparison of two models on identical inputs, and the logit metrics that
``olmax parity`` reports too (``logit_metrics``: one implementation, in fp32 here, float64 there).

At every position of every input row, both models' next-token distributions over the *real*
vocabulary (padded LM-head rows sliced off) are compared:

- ``kl_mean`` / ``kl_max``: KL(A || B) = sum_v p_A(v) (log p_A(v) - log p_B(v)) per token
  (log-softmax; per-token values below 0 from rounding are clamped to 0), mean and max over
  tokens, in nats;
- ``top1_agreement``: fraction of tokens where both argmaxes agree;
- ``top10_overlap``: mean of |top10(A) & top10(B)| / 10 (k = vocab size if smaller);
- ``max_abs_logit_diff``: max |logit_A - logit_B| over tokens and real vocabulary;
- ``tokens``: positions compared.

JSON of ``olmax eval kl --json``: these keys plus ``a``, ``b`` (the paths), ``batch``,
``seq_len`` and ``inputs`` (``random seed S``, a .npy file, or token files).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
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


def logit_metrics(la: Any, lb: Any, k: int = TOPK, xp: Any = jnp) -> tuple[Any, ...]:
    """(sum of KL, max KL, top-1 agreements, summed top-k overlap, max |la - lb|) over the positions
    of logits [..., V] of one vocabulary, in their dtype, with ``xp`` = ``jax.numpy`` or numpy."""
    def log_softmax(x: Any) -> Any:
        x = x - x.max(-1, keepdims=True)
        return x - xp.log(xp.exp(x).sum(-1, keepdims=True))

    lpa, lpb = log_softmax(la), log_softmax(lb)
    kl_tok = xp.maximum((xp.exp(lpa) * (lpa - lpb)).sum(-1), 0.0)
    k = min(k, la.shape[-1])
    top = ((lambda x: jax.lax.top_k(x, k)[1]) if xp is jnp
           else (lambda x: np.argpartition(-x, k - 1, axis=-1)[..., :k]))
    ia, ib = top(la), top(lb)
    overlap = (ia[..., :, None] == ib[..., None, :]).any(-1).sum() / k
    return kl_tok.sum(), kl_tok.max(), (la.argmax(-1) == lb.argmax(-1)).sum(), overlap, xp.abs(la - lb).max()


def summarize(chunks: Iterable[tuple[Any, ...]], tokens: int) -> dict[str, float | int]:
    """The keys of the module docstring from ``logit_metrics`` of chunks covering ``tokens`` positions."""
    kl_sum = top1 = overlap = kl_max = diff_max = 0.0
    for c in chunks:
        s = [float(x) for x in c]
        kl_sum, top1, overlap = kl_sum + s[0], top1 + s[2], overlap + s[3]
        kl_max, diff_max = float(np.maximum(kl_max, s[1])), float(np.maximum(diff_max, s[4]))  # NaN stays
    return {"kl_mean": kl_sum / tokens, "kl_max": kl_max, "top1_agreement": top1 / tokens,
            "top10_overlap": overlap / tokens, "max_abs_logit_diff": diff_max, "tokens": tokens}


@lru_cache(maxsize=8)
def _stats_fn(ma: ModelConfig, mb: ModelConfig) -> Any:
    return jax.jit(lambda pa, pb, ids: logit_metrics(forward(pa, ids, ma)[..., :ma.vocab_size],
                                                      forward(pb, ids, mb)[..., :mb.vocab_size]))


def kl(params_a: Any, cfg_a: Config | ModelConfig, params_b: Any, cfg_b: Config | ModelConfig,
       tokens: np.ndarray) -> dict[str, float | int]:
    """Compare models A and B on ``tokens`` ([B, T] or [T] token ids); keys in the module docstring."""
    ma, mb = _model_cfg(cfg_a), _model_cfg(cfg_b)
    if ma.vocab_size != mb.vocab_size:
        raise ConfigError(f"the models have different vocabularies ({ma.vocab_size} vs {mb.vocab_size} tokens); "
                          "KL needs the same tokenizer")
    toks = check_tokens(tokens, ma.vocab_size).astype(np.int32)
    b, t = toks.shape
    rows = max(1, min(b, ELEMENTS_PER_CALL // (t * ma.vocab_size)))
    fn = _stats_fn(ma, mb)
    r = summarize((fn(params_a, params_b, jnp.asarray(toks[i:i + rows])) for i in range(0, b, rows)), b * t)
    if not all(math.isfinite(r[x]) for x in ("kl_mean", "max_abs_logit_diff")):
        raise ValueError("non-finite logits: one of the models produced NaN or Inf")
    return r


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
    toks = np.asarray(toks)
    toks = toks[None] if toks.ndim == 1 else toks
    if toks.ndim != 2 or not np.issubdtype(toks.dtype, np.integer) or toks.size == 0:
        raise ConfigError(f"{what}: expected integer ids of shape [T] or [B, T], got {toks.dtype} {toks.shape}")
    if toks.min() < 0 or toks.max() >= vocab_size:
        raise ConfigError(f"{what}: token ids must lie in [0, {vocab_size}), got [{toks.min()}, {toks.max()}]")
    return toks.astype(np.int64)
