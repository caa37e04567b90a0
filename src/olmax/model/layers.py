"""Building blocks of OLMo 3, as pure functions.

Einsum legend: b batch, t query position, s key position, d d_model, f MLP hidden,
h query heads, k kv heads, g query heads per kv head (h = k*g), e head dim, v vocabulary.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from olmax.config import ModelConfig


def _bf16_rounded(y: jax.Array) -> jax.Array:
    return jax.lax.reduce_precision(y, exponent_bits=8, mantissa_bits=7)


def kernel_input(x: jax.Array) -> jax.Array:
    """``x`` in fp32 for a CPU kernel (``olmax.model.dispatch``). A bf16 ``x`` is rounded to bf16
    explicitly: XLA drops a conversion to bf16 and back (excess precision, on by default) where it
    finds one, and it finds one in one program and not in another (the final residual add before
    the norm of a training forward, not before the prefill's gather of the last token), so the two
    programs' kernels would read different numbers."""
    y = x.astype(jnp.float32)
    return _bf16_rounded(y) if x.dtype == jnp.bfloat16 else y


def kernel_output(y: jax.Array, dtype: Any) -> jax.Array:
    """A CPU kernel's fp32 ``y`` in ``dtype``; a bf16 result rounded explicitly (``kernel_input``),
    so a use that converts it back to fp32 (the logits) reads the rounded number in every
    program."""
    return (_bf16_rounded(y) if jnp.dtype(dtype) == jnp.bfloat16 else y).astype(dtype)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """RMSNorm as OLMo-core/HF: fp32 compute, weight multiplied in fp32, then cast back."""
    w32 = weight.astype(jnp.float32)
    return rms_norm_f32(x.astype(jnp.float32), w32, eps).astype(x.dtype)


def rms_norm_f32(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMSNorm of fp32 ``x`` with fp32 weight ``w`` (``rms_norm`` without its casts)."""
    return w * (x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps))


@jax.custom_vjp
def swiglu(gu: jax.Array) -> jax.Array:
    """``silu(g) * u`` of ``gu = [g | u]`` (last axis), with a hand-written backward pass: it keeps
    only ``gu`` (autodiff of ``silu`` keeps four [b, t, f] arrays)."""
    g, u = jnp.split(gu, 2, axis=-1)
    return jax.nn.silu(g) * u


def _swiglu_fwd(gu: jax.Array) -> tuple[jax.Array, jax.Array]:
    return swiglu(gu), gu


def _swiglu_bwd(gu: jax.Array, dy: jax.Array) -> tuple[jax.Array]:
    g, u = jnp.split(gu, 2, axis=-1)
    s = jax.nn.sigmoid(g)
    dg = dy * u * (s * (1 + g * (1 - s)))
    return (jnp.concatenate([dg, dy * (g * s)], axis=-1),)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


# --------------------------------------------------------------------------- RoPE


def rope_inv_freq(cfg: ModelConfig, full_attention: bool) -> tuple[np.ndarray, float]:
    """Inverse frequencies (fp32) and the cos/sin scale for one layer type.

    YaRN applies to full-attention layers only, as transformers runs OLMo 3's long-context
    checkpoints; sliding layers keep plain RoPE. Computed in numpy at trace time (constants)."""
    dim, base = cfg.head_dim, cfg.rope_theta
    exponents = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    # base**x correctly rounded to fp32 (computed in fp64). numpy's fp32 power is one ulp off on
    # 13 of the 64 entries at head_dim 128 / theta 5e5 (an angle error of position * 6e-8 rad,
    # 4e-3 at 65k); torch's fp32 pow (HF's inv_freq) agrees with the rounded value there and is
    # within one ulp of it elsewhere (tests/test_model.py).
    pos_freqs = np.power(np.float64(base), exponents.astype(np.float64)).astype(np.float32)
    inv_freq = (np.float32(1.0) / pos_freqs).astype(np.float32)
    ys = cfg.rope_scaling
    if ys is None or not full_attention:
        return inv_freq, 1.0
    factor = ys.factor
    attn_factor = ys.attention_factor if ys.attention_factor is not None else (
        0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0)

    def correction_dim(rotations: float) -> float:
        return dim * math.log(ys.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(ys.beta_fast)), 0)
    high = min(math.ceil(correction_dim(ys.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = np.clip((np.arange(dim // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation = (np.float32(1) - ramp).astype(np.float32)
    interpolation = (np.float32(1.0) / (np.float32(factor) * pos_freqs)).astype(np.float32)
    inv = interpolation * (np.float32(1) - extrapolation) + inv_freq * extrapolation
    return inv.astype(np.float32), float(attn_factor)


def rope_cos_sin(cfg: ModelConfig, positions: np.ndarray, full_attention: bool) -> tuple[jax.Array, jax.Array]:
    """cos/sin tables [t, e] in fp32 (rotate-half layout: frequencies concatenated twice), built
    on the host at trace time from integer ``positions``: the fp32 angle ``position * inv_freq``
    (as torch and XLA round it), its cos and sin correctly rounded to fp32 (computed in fp64), then
    scaled. Constants rather than traced cos/sin: the same bits on every platform, and XLA CPU no
    longer recomputes the transcendentals inside every fusion that reads q or k (a twentieth of
    the tiny and small training steps)."""
    inv_freq, scale = rope_inv_freq(cfg, full_attention)
    angles = np.asarray(positions).astype(np.float32)[:, None] * inv_freq[None, :]
    angles = np.concatenate([angles, angles], axis=-1).astype(np.float64)
    scale = np.float32(scale)
    return (jnp.asarray(np.cos(angles).astype(np.float32) * scale),
            jnp.asarray(np.sin(angles).astype(np.float32) * scale))


def rope_at(cfg: ModelConfig, positions: jax.Array, bound: int, full_attention: bool) -> tuple[jax.Array, jax.Array]:
    """cos/sin [b, t, e] at traced integer ``positions`` [b, t] in ``[0, bound)``: rows of the
    host-built ``rope_cos_sin`` table of ``0..bound-1`` (the same bits as the constant tables)."""
    cos, sin = rope_cos_sin(cfg, np.arange(bound), full_attention)
    return jnp.take(cos, positions, axis=0), jnp.take(sin, positions, axis=0)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array, exact_products: bool = False) -> jax.Array:
    """x [b, t, n, e]; ``x*cos + rotate_half(x)*sin`` with ``rotate_half(x) = cat(-x2, x1)``;
    cos/sin [t, e] (one table for every row) or [b, t, e] (per-row positions). With
    ``exact_products`` (the dispatch's, reproducing the decode steps' bits) a bf16 ``x``'s
    products with the tables are exact in fp32 (below)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    rot = jnp.concatenate([-x2, x1], axis=-1)
    c, s = (cos[None, :, None, :], sin[None, :, None, :]) if cos.ndim == 2 else (cos[:, :, None, :], sin[:, :, None, :])
    if exact_products and x.dtype == jnp.bfloat16:
        # XLA CPU contracts one of the two products into the add (a multiply-add) or not,
        # depending on the fusion around it, which differs between a decode step and a training
        # forward; the 1-ulp difference decides a tie when the sum is rounded to bf16 (seen). With
        # the tables rounded to 16 significant bits, a bf16 number (8) times them is exact in
        # fp32, so every contraction gives the one correctly rounded sum. The tables move by at
        # most 2^-16 relative, far under the output's bf16 rounding (2^-9).
        c, s = (jax.lax.reduce_precision(a, exponent_bits=8, mantissa_bits=15) for a in (c, s))
    out = x.astype(jnp.float32) * c + rot.astype(jnp.float32) * s
    return out.astype(x.dtype)


# --------------------------------------------------------------------------- attention


def attention_mask(t: int, s: int, window: int | None) -> jax.Array:
    """Causal (and sliding-window) mask [t, s]: query q sees key k iff ``q - W < k <= q``."""
    return position_mask(jnp.arange(t), jnp.arange(s), window)


def position_mask(q_pos: jax.Array, k_pos: jax.Array, window: int | None) -> jax.Array:
    """The one mask rule, by position: query at ``q`` sees a key at ``k`` iff ``q - W < k <= q``
    (W keys including itself on sliding layers). q_pos [..., t], k_pos [..., s] -> [..., t, s].
    Keys at negative positions (empty cache slots) are never seen."""
    q, k = q_pos[..., :, None], k_pos[..., None, :]
    allowed = (k <= q) & (k >= 0)
    if window is not None:
        allowed &= k > q - window
    return allowed


def segment_mask(q_seg: jax.Array, k_seg: jax.Array) -> jax.Array:
    """[b, t] x [b, s] -> [b, t, s]: a query sees only keys of its own document (segment)."""
    return q_seg[:, :, None] == k_seg[:, None, :]
