"""Per-device memory estimate from shapes alone (nothing is allocated).

Counts: master weights (param dtype), gradients (fp32), two Adam moments (fp32), each divided by
how the rules table shards that parameter on the given mesh; plus activations kept for the
backward pass per micro-batch. The activation terms are estimates (documented below), the
state terms are exact for the chosen sharding; `olmax compile` gives XLA's exact figure for TPUs.
"""

from __future__ import annotations

import math

import jax
import numpy as np

from olmax.config import Config
from olmax.model.params import ParamSpec, param_specs
from olmax.sharding import RULES, mesh_shape, plan_batch

GiB = 1024 ** 3


def _shard_factor(spec: ParamSpec, sizes: dict[str, int]) -> int:
    f, used = 1, set()
    for dim, axis in zip(spec.shape, spec.axes):
        m = RULES.get(axis)
        if m and m not in used and dim % sizes[m] == 0:
            f *= sizes[m]
            used.add(m)
    return f


def memory_estimate(cfg: Config, n_devices: int) -> dict[str, float]:
    sizes = mesh_shape(cfg.mesh, n_devices)
    plan = plan_batch(cfg.train.global_batch_size, sizes, cfg.train.micro_batch_size,
                      cfg.train.max_micro_batch_size)
    m = cfg.model
    pbytes = np.dtype(m.param_dtype).itemsize
    cbytes = 2 if m.compute_dtype == "bfloat16" else 4
    per_dev_params = sum(math.prod(s.shape) / _shard_factor(s, sizes)
                         for s in jax.tree.leaves(param_specs(m), is_leaf=lambda x: isinstance(x, ParamSpec)))
    L = cfg.data.sequence_length
    tokens = plan.micro_batch * L / sizes["tensor"]
    d, F, HE, KE = m.d_model, m.mlp_hidden, m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
    # Activations saved per token per layer for the backward pass (compute dtype), by remat
    # policy (olmax.model.olmo3.remat_policy): without remat the layer input, q/k/v, attention
    # output, o-projection, two norm inputs, gate/up/activation product; "full" keeps the layer
    # input only; the save_* policies keep the layer input plus the named tensors; offload_proj
    # moves those to host memory.
    per_tok_layer = {
        "none": 10 * d + 3 * F + 2 * HE,
        "minimal": 6 * d + 2 * F,
        "full": d,
        "save_attn_out": d + HE,
        "save_proj": 3 * d + 2 * HE + 2 * KE + 2 * F,
        "save_proj_except_out": d + 2 * HE + 2 * KE + 2 * F,
        "offload_proj": d,
    }[m.remat]
    act = tokens * m.n_layers * per_tok_layer * cbytes
    # One layer's forward/backward working set while it is recomputed (remat) or differentiated.
    workspace = tokens * (4 * d + 2 * HE + 2 * KE + 4 * F) * cbytes
    # Logits in fp32 plus their gradient, for one chunk of positions of one micro-batch.
    positions = min(L, m.logits_chunk or L)
    logits = 2 * plan.micro_batch * positions * m.embedding_rows * 4 / sizes["tensor"]
    # Attention scores are materialised by the reference implementation ([L, L] per head) and,
    # per block of queries over the keys they see (at most all L), by the CPU's blocked one.
    attn_scores = 0.0
    if m.attention_impl in ("reference", "blocked"):
        attn_scores = plan.micro_batch * m.n_heads / sizes["tensor"] * L * L * 4 * 2
    out = {
        "params_per_device": per_dev_params,
        "weights_gib": per_dev_params * pbytes / GiB,
        "grads_gib": per_dev_params * 4 / GiB,
        "adam_moments_gib": per_dev_params * 8 / GiB,
        "activations_gib": act / GiB,
        "layer_workspace_gib": workspace / GiB,
        "logits_gib": logits / GiB,
        "attention_scores_gib": attn_scores / GiB,
    }
    out["total_gib"] = sum(v for k, v in out.items() if k.endswith("_gib"))
    return out
