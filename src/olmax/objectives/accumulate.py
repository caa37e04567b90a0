"""Gradient accumulation, one loop for every objective, and the jit every objective's update uses.

A global batch is split into ``accum_steps`` micro-batches (rows a::accum_steps,
``olmax.sharding.split_micro``, so each is spread evenly over the data-parallel shards); the
gradient of a per-micro-batch loss is summed in float32 over them, and so are the loss's metric
sums. What an objective divides by (a token count, the pairs, a share of the batch) is its own:
its micro-batch loss is already scaled so that the sum over micro-batches is the batch's loss.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from olmax.config import Config
from olmax.optim import apply_update
from olmax.sharding import batch_sharding, split_micro

# (params, micro_batch) -> (loss share, aux): aux is a pytree of float32 scalars, summed over micro-batches
MicroLoss = Callable[[Any, dict[str, jax.Array]], tuple[jax.Array, Any]]


def accumulate(loss_fn: MicroLoss, params: Any, batch: dict[str, jax.Array], accum_steps: int,
               micro_constraint: Callable[[jax.Array], jax.Array] | None = None) -> tuple[Any, Any]:
    """``(gradients, aux sums)`` of ``loss_fn`` over the ``accum_steps`` micro-batches of ``batch``
    (traced inside the caller's step). Gradients are summed in float32, whatever the parameters'
    dtype. One micro-batch is a direct call; more are a ``lax.scan`` (one compiled body).

    ``micro_constraint`` is applied to every array of a micro-batch before the loss sees it (the
    data-parallel layout, which the split's reshape would otherwise leave to XLA)."""
    micro = jax.tree.map(lambda x: split_micro(x, accum_steps), batch)
    grad_fn = jax.value_and_grad(loss_fn, has_aux=True)

    def body(carry, mb):
        g_acc, aux_acc = carry
        if micro_constraint is not None:
            mb = jax.tree.map(micro_constraint, mb)
        (_, aux), g = grad_fn(params, mb)
        g_acc = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), g_acc, g)
        return (g_acc, jax.tree.map(jnp.add, aux_acc, aux)), None

    zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    first = jax.tree.map(lambda x: x[0], micro)
    aux_shapes = jax.eval_shape(loss_fn, params, first)[1]  # traced for its structure only
    if accum_steps == 1:
        (grads, sums), _ = body((zeros, jax.tree.map(lambda _: 0.0, aux_shapes)), first)
    else:  # the scan's carry: float32 arrays from the start
        (grads, sums), _ = jax.lax.scan(body, (zeros, jax.tree.map(lambda _: jnp.float32(0), aux_shapes)), micro)
    return grads, sums


def optimizer_update(cfg: Config, updates_per_step: int = 1) -> Callable:
    """``olmax.optim.apply_update`` with the run's optimizer settings; the schedule counts
    ``train.steps x updates_per_step`` updates."""
    return partial(apply_update, optim_cfg=cfg.optim, total_steps=cfg.train.steps * updates_per_step)


def micro_sharding(mesh: Mesh) -> Callable[[jax.Array], jax.Array]:
    """The ``micro_constraint`` of a step on ``mesh``: rows over the data-parallel axes."""
    return lambda x: jax.lax.with_sharding_constraint(x, batch_sharding(mesh, x.ndim))


def jit_update(step: Callable, pshard: Any, oshard: Any, bshard: Any) -> Callable:
    """``step(params, opt_state, batch)`` jitted as the loop runs it and ``olmax compile`` lowers
    it: the state's shardings in and out, the batch's in, and the old state donated (updated in
    place)."""
    return jax.jit(step, in_shardings=(pshard, oshard, bshard), out_shardings=(pshard, oshard, None),
                   donate_argnums=(0, 1))
