"""The jitted train step: gradient accumulation over micro-batches of the LM loss
(``olmax.model.loss``, whose docstring states the rule and its denominator)."""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from olmax.config import Config
from olmax.model.loss import head_loss, loss_denominator, per_rank_weights, whole_rows_count, with_documents
from olmax.optim import apply_update
from olmax.sharding import BatchPlan, activation_mesh, batch_sharding, split_micro  # noqa: F401 (re-export)


def make_train_step(cfg: Config, accum_steps: int, apply_update: Callable,
                    micro_constraint: Callable[[jax.Array], jax.Array] | None = None,
                    mesh: Mesh | None = None) -> Callable:
    """Returns ``step(params, opt_state, batch) -> (params, opt_state, metrics)`` (not jitted).

    ``apply_update(params, grads, opt_state, ce_loss)`` is the optimiser (``olmax.optim``).
    With ``mesh``, activations are pinned to it by logical axes while the step is traced."""
    z_mult = cfg.optim.z_loss or 0.0

    def step(params, opt_state, batch):
        with activation_mesh(mesh):
            return _step(params, opt_state, batch)

    def _step(params, opt_state, batch):
        batch = with_documents(batch, cfg)  # positions and segment ids, traced, when data.document_masking
        if cfg.train.loss_ranks > 1:  # OLMo-core's per-rank token mean: weights carry the denominators
            batch = {**batch, "label_mask": per_rank_weights(batch["label_mask"], cfg.train.loss_ranks,
                                                             jax.process_count())}
            denom = jnp.float32(1.0)
        else:
            denom = loss_denominator(batch["label_mask"], whole_rows_count(cfg))
        micro = jax.tree.map(lambda x: split_micro(x, accum_steps), batch)

        def micro_loss(p, mb):
            total, (ce, z) = head_loss(p, mb, cfg)
            return total / denom, (ce, z)

        grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

        def body(carry, mb):
            g_acc, ce_acc, z_acc = carry
            if micro_constraint is not None:
                mb = jax.tree.map(micro_constraint, mb)
            (_, (ce, z)), g = grad_fn(params, mb)
            g_acc = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), g_acc, g)
            return (g_acc, ce_acc + ce, z_acc + z), None

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        if accum_steps == 1:
            (grads, ce_sum, z_sum), _ = body((zeros, 0.0, 0.0), jax.tree.map(lambda x: x[0], micro))
        else:
            (grads, ce_sum, z_sum), _ = jax.lax.scan(body, (zeros, jnp.float32(0), jnp.float32(0)), micro)
        ce_loss = ce_sum / denom
        z_loss = z_mult * z_sum / denom
        new_params, new_opt, om = apply_update(params, grads, opt_state, ce_loss)
        metrics = {"ce_loss": ce_loss, "z_loss": z_loss, **om}
        return new_params, new_opt, metrics

    return step


def jit_train_step(cfg: Config, mesh: Mesh, plan: BatchPlan, pshard: Any, oshard: Any) -> Callable:
    """The production train step: jitted with the state's shardings, the batch split over the
    data-parallel axes, and the old state donated (updated in place). The loop runs it; ``olmax
    compile`` lowers it for a TPU topology."""
    bshard = batch_sharding(mesh)
    update = partial(apply_update, optim_cfg=cfg.optim, total_steps=cfg.train.steps)
    micro = (lambda x: jax.lax.with_sharding_constraint(x, batch_sharding(mesh, x.ndim)))
    return jax.jit(make_train_step(cfg, plan.accum_steps, update, micro_constraint=micro, mesh=mesh),
                   in_shardings=(pshard, oshard, {"input_ids": bshard, "label_mask": bshard}),
                   out_shardings=(pshard, oshard, None), donate_argnums=(0, 1))
