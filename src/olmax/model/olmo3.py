"""OLMo 3 forward pass over the parameter pytree of ``olmax.model.params``.

Block ("reordered norm", no input norm):  h = x + norm_attn(attn(x));  out = h + norm_mlp(mlp(h)).
QK-norm is one RMSNorm over the whole q (and whole k) projection, before the head split and RoPE.
"""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp

from olmax.config import ModelConfig
from olmax.model.layers import (apply_rope, attention_impl, fused_attention, reference_attention, rms_norm,
                                rope_cos_sin, swiglu)

REMAT_POLICIES = {
    "full": jax.checkpoint_policies.nothing_saveable,
    # Keep the projection matmul outputs; recompute attention and element-wise work.
    "minimal": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _attention_block(cfg: ModelConfig, p: dict, x: jax.Array, cos: jax.Array, sin: jax.Array,
                     window: int | None) -> jax.Array:
    b, t, _ = x.shape
    H, K, E = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    q = rms_norm(jnp.einsum("btd,dq->btq", x, p["q"]), p["q_norm"], cfg.norm_eps)
    k = rms_norm(jnp.einsum("btd,dq->btq", x, p["k"]), p["k_norm"], cfg.norm_eps)
    v = jnp.einsum("btd,dq->btq", x, p["v"])
    q = apply_rope(q.reshape(b, t, H, E), cos, sin)
    k = apply_rope(k.reshape(b, t, K, E), cos, sin)
    v = v.reshape(b, t, K, E)
    impl = attention_impl(cfg.attention_impl, q.dtype)
    if impl == "reference":
        o = reference_attention(q, k, v, window)
    else:
        o = fused_attention(q, k, v, window, impl)
    return jnp.einsum("btq,qd->btd", o.reshape(b, t, H * E), p["o"])


def _layer(cfg: ModelConfig, window: int | None, p: dict, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    h = x + rms_norm(_attention_block(cfg, p["attn"], x, cos, sin, window), p["attn_norm"], cfg.norm_eps)
    m = p["mlp"]
    return h + rms_norm(swiglu(h, m["gate"], m["up"], m["down"]), p["mlp_norm"], cfg.norm_eps)


def forward(params: Any, tokens: jax.Array, cfg: ModelConfig, *, return_hidden: bool = False,
            positions: jax.Array | None = None) -> Any:
    """Logits in fp32, shape [b, t, embedding_rows] (padded vocabulary rows included).

    With ``return_hidden`` also returns the residual stream after the embedding and after each
    layer (for locating the first diverging layer in parity checks)."""
    cdt = jnp.dtype(cfg.compute_dtype)
    t = tokens.shape[1]
    if positions is None:
        positions = jnp.arange(t)
    tables = {full: rope_cos_sin(cfg, positions, full) for full in {cfg.is_full_attention(i) for i in range(cfg.n_layers)}}
    x = jnp.take(params["embed"], tokens, axis=0).astype(cdt)
    hidden = [x]
    for i, lp in enumerate(params["layers"]):
        lp = jax.tree.map(lambda a: a.astype(cdt), lp)
        cos, sin = tables[cfg.is_full_attention(i)]
        fn = partial(_layer, cfg, cfg.layer_window(i))
        if cfg.remat != "none":
            fn = jax.checkpoint(fn, policy=REMAT_POLICIES[cfg.remat])
        x = fn(lp, x, cos, sin)
        if return_hidden:
            hidden.append(x)
    x = rms_norm(x, params["final_norm"], cfg.norm_eps)
    logits = jnp.einsum("btd,dv->btv", x, params["lm_head"].astype(cdt)).astype(jnp.float32)
    if return_hidden:
        return logits, hidden
    return logits
