"""OLMo 3 forward pass over the parameter pytree of ``olmax.model.params``.

Block ("reordered norm", no input norm):  h = x + norm_attn(attn(x));  out = h + norm_mlp(mlp(h)).
QK-norm is one RMSNorm over the whole q (and whole k) projection, before the head split and RoPE.

Layers run under ``jax.lax.scan`` over groups of ``full_attention_every`` layers (OLMo 3: three
sliding-window layers and one full), with the group's weights stacked on the fly from the
per-layer tree (a bf16 copy when computing in bf16): the program does not grow with depth, and
the parameter tree, checkpoints and HF conversion keep one entry per layer. Layers past the
last whole group (``full_attention_last_layer`` with a depth not divisible by the period) run
unrolled after the scan.

Packed documents: ``positions`` [b, t] (RoPE) and ``segment_ids`` [b, t] (attention stays
inside a document) are optional traced inputs; without them the program is the plain one
(constant RoPE tables, no extra mask work). Decoding (``olmax.model.decode``) runs the same
layers with a KV cache carried through the same scan.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

import olmax.model.dispatch as dispatch
from olmax.config import ConfigError, ModelConfig
from olmax.model.layers import rope_at, rope_cos_sin, rope_inv_freq
from olmax.sharding import constrain

# Tensors a remat policy may keep (names given with ``checkpoint_name`` below).
PROJECTION_NAMES = ("query", "key", "value", "attn_out", "attn_proj", "mlp_gate", "mlp_up", "mlp_gate_up", "mlp_out")
# The outputs of the two output projections (attention's o, the MLP's down): one d_model vector
# each per token, and the cheapest projections to run again from what save_proj keeps beside them.
OUTPUT_PROJECTION_NAMES = ("attn_proj", "mlp_out")
REMAT_NAMES = typing.get_args(typing.get_type_hints(ModelConfig)["remat"])  # the config's Literal, one list


def remat_recomputes_attention(name: str) -> bool:
    """Whether ``model.remat=name`` runs the attention kernel's forward again in the backward pass
    (it keeps no ``attn_out``): ``full`` and ``minimal`` (the kernel's output has batch dims)."""
    return name in ("full", "minimal")


def remat_policy(name: str) -> Callable | None:
    """``model.remat`` -> a ``jax.checkpoint`` policy (None: no rematerialisation)."""
    cp = jax.checkpoint_policies
    if name == "none":
        return None
    if name == "full":          # keep only the layer input
        return cp.nothing_saveable
    if name == "minimal":       # keep every matmul output without batch dims
        return cp.dots_with_no_batch_dims_saveable
    if name == "save_attn_out":  # skip recomputing the attention kernel, recompute the projections
        return cp.save_only_these_names("attn_out")
    if name == "save_proj":
        return cp.save_only_these_names(*PROJECTION_NAMES)
    if name == "save_proj_except_out":  # 2 d_model vectors a token and layer less, for two matmuls more
        return cp.save_only_these_names(*(n for n in PROJECTION_NAMES if n not in OUTPUT_PROJECTION_NAMES))
    if name == "offload_proj":  # the same tensors, in host memory between forward and backward
        if not dispatch.host_offload_available():
            raise ConfigError("model.remat=offload_proj offloads to host memory, which only TPUs and GPUs have; "
                              "use save_proj on the CPU")
        return cp.save_and_offload_only_these_names(
            names_which_can_be_saved=[], names_which_can_be_offloaded=list(PROJECTION_NAMES),
            offload_src="device", offload_dst="pinned_host")
    raise ConfigError(f"model.remat: unknown policy {name!r} (known: {', '.join(REMAT_NAMES)})")


# Streamed (``OutIn``) weights use the multiply-and-reduce form up to this many rows; above it
# the last axes of both are contracted (as fast as the plain matmul at 512 rows).
STREAM_ROWS = 32


@jax.tree_util.register_pytree_node_class
class OutIn:
    """A projection weight ``[in, out]`` stored transposed, ``[out, in]``, for the CPU's decode
    steps (``olmax.model.decode.prepare(streamed=True)``).

    With 2 to ``STREAM_ROWS`` rows (a batch of decode steps), XLA CPU's matmul packs the whole
    weight for a few rows and ran at 3.5 GB/s of weights: x [8, 512] @ w [512, 16384] took 12 ms
    from memory, against 1.8 ms for one row. Written as a product reduced over ``in`` with the
    output ``[out, rows]``, the loop reads each weight row once for all rows: 3.5 ms (1.5x to 3.5x
    faster from 2 to 32 rows, on every projection shape of the decode benchmark). One row keeps
    the plain layout (a matrix-vector product is fastest on ``[in, out]``); many rows (a prefill)
    contract the last axes of both (as fast as the plain matmul)."""

    def __init__(self, t: jax.Array):
        self.t = t

    def tree_flatten(self):
        return (self.t,), None

    @classmethod
    def tree_unflatten(cls, aux: None, children: tuple) -> OutIn:
        return cls(*children)

    def apply(self, x: jax.Array) -> jax.Array:
        """``x [..., in] @ w`` -> ``[..., out]`` in ``x``'s dtype (fp32 accumulation)."""
        rows = x.reshape(-1, x.shape[-1])
        if 2 <= rows.shape[0] <= STREAM_ROWS:
            acc = jnp.promote_types(x.dtype, jnp.float32)
            y = (self.t[:, None, :].astype(acc) * rows[None].astype(acc)).sum(-1).T.astype(x.dtype)
        else:
            y = jnp.einsum("mi,oi->mo", rows, self.t, preferred_element_type=x.dtype)
        return y.reshape(*x.shape[:-1], self.t.shape[0])


@jax.tree_util.register_pytree_node_class
class Packed:
    """A projection weight ``[in, out]`` packed in panels of 16 output columns, ``[panels, in,
    16]``, for olmax's CPU decode kernel (``olmax.kernels.cpu``, through ``dispatch.packed_matmul``;
    ``decode.prepare(layout="packed")``). Every row count goes through the kernel: the steps' few
    rows and the prefill's many. fp32 panels (a bf16 model's weights as fp32 numbers; ``apply``
    rounds its output to ``x``'s dtype)."""

    def __init__(self, p: jax.Array, out: int):
        self.p, self.out = p, out

    def tree_flatten(self):
        return (self.p,), self.out

    @classmethod
    def tree_unflatten(cls, out: int, children: tuple) -> Packed:
        return cls(children[0], out)

    def apply(self, x: jax.Array) -> jax.Array:
        """``x [..., in] @ w`` -> ``[..., out]`` in ``x``'s dtype (computed in fp32, rounded to it)."""
        return dispatch.packed_matmul(x, self.p, self.out)


def _dense(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x [b, t, i] @ w [i, o]`` (``dispatch.matmul``); ``w`` may be an ``OutIn`` or a ``Packed``
    (the CPU's decode steps)."""
    if isinstance(w, (OutIn, Packed)):
        return w.apply(x)
    return dispatch.matmul(x, w)


def _attention_block(cfg: ModelConfig, p: dict, x: jax.Array, cos: jax.Array, sin: jax.Array,
                     window: int | None, segment_ids: jax.Array | None = None, cache: Any = None,
                     cache_op: Callable | None = None) -> Any:
    """The attention sub-block: ``out`` or, with ``cache_op(q, k, v, cache) -> (o, cache)`` (the
    KV cache's prefill or decode step, ``olmax.model.decode``), ``(out, cache)``."""
    b, t, _ = x.shape
    H, K, E = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    heads = ("batch", "length", "act_heads", "head_dim")
    kv_heads = ("batch", "length", "act_kv_heads", "head_dim")
    if "qkv" in p or dispatch.joined_projections():
        # One [d, (h+2k)e] projection, as the MLP's gate and up: dx is one matmul, not a sum of three.
        # Decoding joins the weights once, before its loop (``join_projections``).
        qkv = _dense(x, p["qkv"] if "qkv" in p else jnp.concatenate([p["q"], p["k"], p["v"]], axis=1))
        # The split, the q/k norms and RoPE: for training and evaluation on the CPU in fp32 in one
        # pass each way in olmax's kernel (the decode steps and RL's forward keep XLA's arithmetic).
        q, k, v = dispatch.qkv(qkv, p["q_norm"], p["k_norm"], cos, sin, cfg, cached=cache_op is not None)
    else:
        q, k, v = (_dense(x, p[name]) for name in ("q", "k", "v"))
        q, k = dispatch.qk_norm_rope(q, k, p["q_norm"], p["k_norm"], cos, sin, cfg)
    q = checkpoint_name(constrain(q, heads), "query")
    k = checkpoint_name(constrain(k, kv_heads), "key")
    v = checkpoint_name(constrain(v.reshape(b, t, K, E), kv_heads), "value")
    if cache_op is not None:
        o, cache = cache_op(q, k, v, cache)
    else:
        o = checkpoint_name(dispatch.self_attention(q, k, v, window, cfg, segment_ids), "attn_out")
    out = _dense(o.reshape(b, t, H * E), p["o"])
    out = checkpoint_name(constrain(out, ("batch", "length", "act_embed")), "attn_proj")
    return out if cache_op is None else (out, cache)


def _mlp_block(m: dict, h: jax.Array, cfg: ModelConfig) -> jax.Array:
    """SwiGLU ``down(silu(gate(h)) * up(h))``."""
    hidden = ("batch", "length", "act_mlp")
    if "gate_up" in m or dispatch.joined_projections():
        # One [d, 2f] projection: one matmul for dh in the backward pass instead of two summed.
        gu = _dense(h, m["gate_up"] if "gate_up" in m else jnp.concatenate([m["gate"], m["up"]], axis=1))
        gu = checkpoint_name(constrain(gu, hidden), "mlp_gate_up")
        out = _dense(dispatch.swiglu(gu, cfg), m["down"])
        return checkpoint_name(constrain(out, ("batch", "length", "act_embed")), "mlp_out")
    g = checkpoint_name(constrain(_dense(h, m["gate"]), hidden), "mlp_gate")
    u = checkpoint_name(constrain(_dense(h, m["up"]), hidden), "mlp_up")
    out = _dense(jax.nn.silu(g) * u, m["down"])
    return checkpoint_name(constrain(out, ("batch", "length", "act_embed")), "mlp_out")


def _layer(cfg: ModelConfig, window: int | None, p: dict, x: jax.Array, cos: jax.Array, sin: jax.Array,
           segment_ids: jax.Array | None = None, cache: Any = None, cache_op: Callable | None = None) -> Any:
    """One block: ``x`` out, or ``(x, cache)`` with a ``cache_op`` (``_attention_block``)."""
    x = constrain(x, ("batch", "length", "act_embed"))
    a = _attention_block(cfg, p["attn"], x, cos, sin, window, segment_ids, cache, cache_op)
    if cache_op is not None:
        a, cache = a
    h = x + dispatch.rms_norm(a, p["attn_norm"], cfg.norm_eps)
    out = h + dispatch.rms_norm(_mlp_block(p["mlp"], h, cfg), p["mlp_norm"], cfg.norm_eps)
    return out if cache_op is None else (out, cache)


def _layer_fn(cfg: ModelConfig, window: int | None, cache_op: Callable | None = None) -> Callable:
    fn = partial(_layer, cfg, window, cache_op=cache_op)
    policy = remat_policy(cfg.remat)
    if policy is not None and cache_op is None:  # remat only matters under differentiation
        fn = jax.checkpoint(fn, policy=policy)
    return fn


def layer_groups(cfg: ModelConfig) -> tuple[int, int]:
    """``(period, groups)``: the scan runs ``groups`` groups of ``period`` layers whose attention
    pattern repeats exactly; the remaining layers run unrolled. ``groups`` is 0 when layers are
    not scanned."""
    period = cfg.full_attention_every if cfg.sliding_window is not None else 1
    groups = cfg.n_layers // period if cfg.scan_layers else 0
    windows = [cfg.layer_window(i) for i in range(groups * period)]
    if any(windows[i] != windows[i % period] for i in range(len(windows))):
        return period, 0  # an irregular pattern: unrolled
    return period, groups


def _cast(tree: Any, dtype: jnp.dtype) -> Any:
    return jax.tree.map(lambda a: a.astype(dtype), tree)


def join_projections(layer: dict) -> dict:
    """A layer (stacked or not) with q/k/v and gate/up joined into ``qkv`` and ``gate_up``, the
    CPU's one-matmul layout, made once: inside a decode step the join copied every weight on
    every token (5x the step time of a small model)."""
    attn = {n: a for n, a in layer["attn"].items() if n not in ("q", "k", "v")}
    mlp = {n: a for n, a in layer["mlp"].items() if n not in ("gate", "up")}
    attn["qkv"] = jnp.concatenate([layer["attn"][n] for n in ("q", "k", "v")], axis=-1)
    mlp["gate_up"] = jnp.concatenate([layer["mlp"]["gate"], layer["mlp"]["up"]], axis=-1)
    return {**layer, "attn": attn, "mlp": mlp}


def stack_layers(params: Any, cfg: ModelConfig, unrolled: bool = False) -> dict[str, list]:
    """The layers as the scan reads them, in the compute dtype: ``groups[j]`` stacks layer j of
    every group along a new leading axis, ``rest`` lists the layers after the last whole group.
    The training forward stacks inside its step; decoding stacks once, before its loop."""
    cdt = jnp.dtype(cfg.compute_dtype)
    layers = params["layers"]
    period, groups = (1, 0) if unrolled else layer_groups(cfg)
    stacked = [jax.tree.map(lambda *xs: jnp.stack(xs), *[_cast(layers[g * period + j], cdt) for g in range(groups)])
               for j in range(period)] if groups else []
    return {"groups": stacked, "rest": [_cast(layers[i], cdt) for i in range(groups * period, cfg.n_layers)]}


@dispatch.exact_fp32
def run_layers(cfg: ModelConfig, layers: dict[str, list], x: jax.Array, tables: dict[bool, tuple], *,
               segment_ids: jax.Array | None = None, caches: Any = None,
               cache_ops: dict[bool, Callable] | None = None, hidden: list | None = None) -> tuple[jax.Array, Any]:
    """The residual stream through every layer (``stack_layers``' layout): ``(x, caches)``.

    ``tables[full]`` are the RoPE cos/sin of full (True) or sliding (False) layers. With
    ``cache_ops[full]`` each layer's attention goes through ``op(q, k, v, (stack, i))``, which
    returns the output and ``stack`` with entry i updated (prefill or decode, ``olmax.model.
    decode``); ``caches`` is ``{"groups": [per layer of a group, stacked over groups], "rest":
    [per layer, stacked over one]}`` and rides in the scan's carry, so XLA updates it in place."""
    ops = cache_ops or {}
    period = len(layers["groups"])
    n_scanned = period * (jax.tree.leaves(layers["groups"])[0].shape[0] if period else 0)

    def call(i: int, p: Any, x: jax.Array, cache: Any, index: Any) -> tuple[jax.Array, Any]:
        full = cfg.is_full_attention(i)
        fn = _layer_fn(cfg, cfg.layer_window(i), ops.get(full))
        if not cache_ops:
            return fn(p, x, *tables[full], segment_ids), None
        return fn(p, x, *tables[full], segment_ids, (cache, index))

    new: dict[str, list] = {"groups": [], "rest": []}
    if period and cache_ops:
        def group_cached(carry, xs):
            x, stacks = carry
            stacks = list(stacks)
            for j in range(period):
                x, stacks[j] = call(j, xs[0][j], x, stacks[j], xs[1])
            return (x, stacks), None

        (x, new["groups"]), _ = jax.lax.scan(group_cached, (x, caches["groups"]),
                                             (layers["groups"], jnp.arange(n_scanned // period)))
    elif period:
        def group(x, group_params):
            for j in range(period):
                x, _ = call(j, group_params[j], x, None, None)
            return x, None

        x, _ = jax.lax.scan(group, x, layers["groups"])
    for n, p in enumerate(layers["rest"]):
        x, c = call(n_scanned + n, p, x, caches["rest"][n] if cache_ops else None, 0)
        new["rest"].append(c)
        if hidden is not None:
            hidden.append(x)
    return x, new


def rope_tables(cfg: ModelConfig, t: int, positions: jax.Array | None = None, bound: int | None = None
                ) -> dict[bool, tuple[jax.Array, jax.Array]]:
    """RoPE cos/sin per layer type: host constants for 0..t-1, or rows of the table of
    ``0..bound-1`` (default t) at the traced ``positions`` [b, t]. Built once per distinct
    frequency set: full and sliding layers share one table unless YaRN rescales the full ones
    (two identical tables were two constants in the program, 2 x 32 MiB at 65,536 tokens)."""
    kinds = sorted({cfg.is_full_attention(i) for i in range(cfg.n_layers)})
    built: dict[tuple, tuple[jax.Array, jax.Array]] = {}
    out = {}
    for full in kinds:
        inv_freq, scale = rope_inv_freq(cfg, full)
        key = (inv_freq.tobytes(), scale)
        if key not in built:
            built[key] = (rope_cos_sin(cfg, np.arange(t), full) if positions is None
                          else rope_at(cfg, positions, bound or t, full))
        out[full] = built[key]
    return out


def embed(params: Any, tokens: jax.Array, cfg: ModelConfig) -> jax.Array:
    x = jnp.take(params["embed"], tokens, axis=0).astype(jnp.dtype(cfg.compute_dtype))
    return constrain(x, ("batch", "length", "act_embed"))


def document_segments(tokens: jax.Array, eos_id: int) -> tuple[jax.Array, jax.Array]:
    """``(positions, segment_ids)`` [b, t] of packed documents: a document ends at (and includes)
    its EOS, the next starts after it (OLMo-core's ``generate_doc_lengths``), the last one runs to
    the row's end. Positions restart at 0 in each document (OLMo-core 3.0.0's intra-document
    RoPE); segment ids count the row's documents from 1."""
    b, t = tokens.shape
    idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    starts = jnp.concatenate([jnp.ones((b, 1), bool), tokens[:, :-1] == eos_id], axis=1)
    segment_ids = jnp.cumsum(starts, axis=1, dtype=jnp.int32)
    first = jax.lax.cummax(jnp.where(starts, idx, 0), axis=1)
    return idx - first, segment_ids


def hidden_states(params: Any, tokens: jax.Array, cfg: ModelConfig, *, positions: jax.Array | None = None,
                  segment_ids: jax.Array | None = None, return_hidden: bool = False) -> Any:
    """The final-normed residual stream [b, t, d] in the compute dtype (the LM head's input).

    ``positions`` [b, t] in ``[0, t)`` and ``segment_ids`` [b, t] (see ``document_segments``)
    are optional. With ``return_hidden`` (unrolled layers) also the residual stream after the
    embedding and after each layer, for locating the first diverging layer in parity checks."""
    x = embed(params, tokens, cfg)
    hidden = [x] if return_hidden else None
    tables = rope_tables(cfg, tokens.shape[1], positions)
    x, _ = run_layers(cfg, stack_layers(params, cfg, unrolled=return_hidden), x, tables,
                      segment_ids=segment_ids, hidden=hidden)
    x = dispatch.rms_norm(x, params["final_norm"], cfg.norm_eps)
    return (x, hidden) if return_hidden else x


@dispatch.exact_fp32
def lm_head(params: Any, x: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Logits in fp32 [b, t, embedding_rows] from the final hidden states (padded rows included)."""
    w = params["lm_head"]
    if isinstance(w, (OutIn, Packed)):  # prepared in the compute dtype (``decode.prepare``)
        logits = w.apply(x)
    else:
        logits = dispatch.lm_head_matmul(x, w.astype(jnp.dtype(cfg.compute_dtype)))
    return constrain(logits.astype(jnp.float32), ("batch", "length", "act_vocab"))


def forward(params: Any, tokens: jax.Array, cfg: ModelConfig, *, positions: jax.Array | None = None,
            segment_ids: jax.Array | None = None, return_hidden: bool = False) -> Any:
    """Logits in fp32, shape [b, t, embedding_rows] (padded vocabulary rows included); positions
    and segment ids as ``hidden_states``.

    With ``return_hidden`` also returns the residual stream after the embedding and after each
    layer (for locating the first diverging layer in parity checks)."""
    out = hidden_states(params, tokens, cfg, positions=positions, segment_ids=segment_ids, return_hidden=return_hidden)
    if return_hidden:
        return lm_head(params, out[0], cfg), out[1]
    return lm_head(params, out, cfg)
