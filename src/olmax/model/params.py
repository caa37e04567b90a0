"""Parameter shapes, logical axes and initialisation, declared once per parameter.

Layout (weights are ``[in, out]``, the transpose of HF's ``nn.Linear``):

    embed [V, D]; lm_head [D, V]; final_norm [D]
    layers[i].attn.{q [D, H*E], k [D, K*E], v [D, K*E], o [H*E, D], q_norm [H*E], k_norm [K*E]}
    layers[i].attn_norm [D]; layers[i].mlp.{gate [D, F], up [D, F], down [F, D]}; layers[i].mlp_norm [D]

Logical axis names are mapped to mesh axes by ``olmax.sharding.RULES``; the model never names
a mesh axis.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np

from olmax.config import ModelConfig


@dataclass(frozen=True)
class ParamSpec:
    shape: tuple[int, ...]
    axes: tuple[str, ...]            # one logical axis name per dimension
    init: Literal["normal", "ones"]


def _is_spec(x: Any) -> bool:
    return isinstance(x, ParamSpec)


def param_specs(cfg: ModelConfig) -> dict[str, Any]:
    D, H, K, E, F, V = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.mlp_hidden, cfg.embedding_rows

    def w(shape, axes):
        return ParamSpec(tuple(shape), tuple(axes), "normal")

    def norm(n, axis):
        return ParamSpec((n,), (axis,), "ones")

    layer = {
        "attn": {
            "q": w((D, H * E), ("embed", "q_heads")),
            "k": w((D, K * E), ("embed", "kv_heads")),
            "v": w((D, K * E), ("embed", "kv_heads")),
            "o": w((H * E, D), ("q_heads", "embed")),
            "q_norm": norm(H * E, "norm"),
            "k_norm": norm(K * E, "norm"),
        },
        "attn_norm": norm(D, "norm"),
        "mlp": {"gate": w((D, F), ("embed", "mlp")), "up": w((D, F), ("embed", "mlp")),
                "down": w((F, D), ("mlp", "embed"))},
        "mlp_norm": norm(D, "norm"),
    }
    return {
        "embed": w((V, D), ("vocab", "embed")),
        "layers": [layer for _ in range(cfg.n_layers)],
        "final_norm": norm(D, "norm"),
        "lm_head": w((D, V), ("embed", "vocab")),
    }


def logical_axes(cfg: ModelConfig) -> Any:
    return jax.tree.map(lambda s: s.axes, param_specs(cfg), is_leaf=_is_spec)


def count_params(cfg: ModelConfig, padded: bool = True) -> dict[str, int]:
    """Total and non-embedding parameter counts (the LM head counts as non-embedding, as OLMo-core's
    FLOP formula does)."""
    leaves = jax.tree.leaves(param_specs(cfg), is_leaf=_is_spec)
    total = sum(int(np.prod(s.shape)) for s in leaves)
    rows = cfg.embedding_rows
    if not padded:
        total -= 2 * (rows - cfg.vocab_size) * cfg.d_model
        rows = cfg.vocab_size
    embed = rows * cfg.d_model
    return {"total": total, "embedding": embed, "non_embedding": total - embed}


def init_params(cfg: ModelConfig, key: jax.Array) -> Any:
    """OLMo-core initialisation: every linear and the embedding ~ truncated normal(0, std) cut at
    +-3 std; norm weights 1. Deterministic: leaf i uses ``fold_in(key, i)`` in tree order."""
    specs = param_specs(cfg)
    leaves, treedef = jax.tree.flatten(specs, is_leaf=_is_spec)
    dt = jnp.dtype(cfg.param_dtype)
    out = []
    for i, s in enumerate(leaves):
        if s.init == "ones":
            out.append(jnp.ones(s.shape, dt))
        else:
            k = jax.random.fold_in(key, i)
            x = jax.random.truncated_normal(k, -3.0, 3.0, s.shape, jnp.float32) * cfg.init_std
            out.append(x.astype(dt))
    return jax.tree.unflatten(treedef, out)
