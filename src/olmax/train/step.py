"""Loss and the jitted train step (gradient accumulation over micro-batches).

Loss (OLMo-core ``train_module.train_batch`` + ``cross_entropy_loss``): labels are the inputs
shifted left, the last position ignored, EOS an ordinary target; CE in fp32 summed over the
valid labels, plus z-loss ``mult * logsumexp^2`` summed over the same labels; both divided by
the number of valid labels. An instance dropped by the repetition filter has every label
ignored but, as in OLMo-core, still adds its full length L to the denominator ("they count as
tokens with a zero loss"). OLMo-core divides per data-parallel rank and averages ranks; we
divide once by the global count so the loss does not depend on the topology. The two agree
whenever ranks see equal label counts (always, without the filter).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import Mesh

from olmax.config import Config, ModelConfig
from olmax.model.olmo3 import hidden_states, lm_head
from olmax.optim import apply_update
from olmax.sharding import BatchPlan, activation_mesh, batch_sharding, constrain


def _chunked(x: jax.Array, targets: jax.Array, valid: jax.Array, chunk: int | None
             ) -> tuple[Callable[[jax.Array], jax.Array], tuple[jax.Array, jax.Array, jax.Array]]:
    """Positions in chunks: ``(unchunk, (x, targets, valid) as [n, b, c, ...])``; padded
    positions carry no label, ``unchunk`` maps [n, b, c, ...] back to [b, t, ...]."""
    b, t = targets.shape
    chunk = t if chunk is None or chunk >= t else chunk
    n = -(-t // chunk)
    pad = ((0, 0), (0, n * chunk - t))
    x, targets, valid = jnp.pad(x, pad + ((0, 0),)), jnp.pad(targets, pad), jnp.pad(valid, pad)

    def split(a: jax.Array) -> jax.Array:  # [b, n*c, ...] -> [n, b, c, ...]
        return a.reshape(b, n, chunk, *a.shape[2:]).swapaxes(0, 1)

    def unchunk(a: jax.Array) -> jax.Array:
        return a.swapaxes(0, 1).reshape(b, n * chunk, *a.shape[3:])[:, :t]

    return unchunk, (split(x), split(targets), split(valid))


def _head_sums(head: jax.Array, x: jax.Array, input_ids: jax.Array, label_mask: jax.Array, cfg: ModelConfig,
               z_mult: float = 0.0, grad: bool = False) -> tuple[tuple[jax.Array, jax.Array], Any]:
    """``((CE sum, lse^2 sum), grads)`` over the valid labels of hidden states ``x`` [b, t, d]:
    position i predicts token i+1, the last position has no label. With ``model.logits_chunk``
    the fp32 logits exist for one chunk of positions at a time (the 7B's [b, 8192, 100352] fp32
    logits would be 3.3 GB per sequence). With ``grad``, ``grads = (d head, d x)`` of
    ``CE + z_mult * lse^2``, computed chunk by chunk from d/dlogits = ``p (1 + 2 z_mult lse) -
    onehot(target)`` on valid positions (p the softmax): the backward pass then needs neither the
    logits nor a second LM-head matmul to recompute them."""
    cdt = jnp.dtype(cfg.compute_dtype)
    b = input_ids.shape[0]
    targets = jnp.concatenate([input_ids[:, 1:], jnp.zeros((b, 1), input_ids.dtype)], axis=1)
    valid = jnp.concatenate([label_mask[:, 1:], jnp.zeros((b, 1), label_mask.dtype)], axis=1).astype(jnp.float32)
    unchunk, xs = _chunked(x, targets, valid, cfg.logits_chunk)
    vocab = jnp.arange(head.shape[1])

    def body(carry, xs):
        ce, z, dhead = carry
        xc, tc, vc = xs
        logits = lm_head({"lm_head": head}, xc, cfg)
        lse = jax.nn.logsumexp(logits, axis=-1)
        target_logit = jnp.take_along_axis(logits, tc[..., None], axis=-1)[..., 0]
        ce, z = ce + jnp.sum((lse - target_logit) * vc), z + jnp.sum((lse * lse) * vc)
        if not grad:
            return (ce, z, dhead), None
        p = jnp.exp(logits - lse[..., None])
        dlogits = (p * (1 + 2 * z_mult * lse)[..., None] - (vocab == tc[..., None])) * vc[..., None]
        dlogits = constrain(dlogits, ("batch", "length", "act_vocab")).astype(cdt)
        dhead = dhead + jnp.einsum("btd,btv->dv", xc, dlogits).astype(jnp.float32)
        return (ce, z, dhead), jnp.einsum("btv,dv->btd", dlogits, head.astype(cdt))

    zero = jnp.float32(0)
    (ce, z, dhead), dx = jax.lax.scan(body, (zero, zero, jnp.zeros(head.shape, jnp.float32) if grad else zero), xs)
    return (ce, z), ((dhead, unchunk(dx)) if grad else None)


def loss_sums(params: Any, input_ids: jax.Array, label_mask: jax.Array, cfg: Config) -> tuple[jax.Array, jax.Array]:
    """(sum of CE, sum of logsumexp^2) over the valid labels of a (micro-)batch, fp32 (evaluation;
    training differentiates ``head_loss``, which returns the same sums)."""
    x = hidden_states(params, input_ids, cfg.model)
    return _head_sums(params["lm_head"], x, input_ids, label_mask, cfg.model)[0]


@partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _head_loss(head: jax.Array, x: jax.Array, input_ids: jax.Array, label_mask: jax.Array, cfg: ModelConfig,
               z_mult: float) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    return _head_loss_fwd(head, x, input_ids, label_mask, cfg, z_mult)[0]


def _head_loss_fwd(head, x, input_ids, label_mask, cfg, z_mult):
    (ce, z), grads = _head_sums(head, x, input_ids, label_mask, cfg, z_mult, grad=True)
    return (ce + z_mult * z, (ce, z)), grads


def _head_loss_bwd(cfg, z_mult, grads, ct):
    ct_total = ct[0]  # the (ce, z) outputs are reported, not differentiated (stop_gradient in head_loss)
    return tuple((ct_total * g).astype(g.dtype) for g in grads) + (None, None)


_head_loss.defvjp(_head_loss_fwd, _head_loss_bwd)


def head_loss(params: Any, input_ids: jax.Array, label_mask: jax.Array, cfg: Config
              ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """``(CE sum + z_mult * z sum, (CE sum, z sum))`` as ``loss_sums``, for training: the first is
    differentiable, its LM-head gradient computed with the forward pass (no recomputed logits)."""
    x = hidden_states(params, input_ids, cfg.model)
    total, sums = _head_loss(params["lm_head"], x, input_ids, label_mask, cfg.model, float(cfg.optim.z_loss or 0.0))
    return total, jax.lax.stop_gradient(sums)


def loss_denominator(label_mask: jax.Array) -> jax.Array:
    """Valid labels (shifted mask) plus L for each fully masked (filtered) instance."""
    L = label_mask.shape[1]
    valid = jnp.sum(label_mask[:, 1:].astype(jnp.float32))
    masked_instances = jnp.sum((~jnp.any(label_mask, axis=1)).astype(jnp.float32))
    return valid + masked_instances * L


def split_micro(x: jax.Array, accum: int) -> jax.Array:
    """[B, ...] -> [accum, B/accum, ...] with micro-batch a = rows a::accum, so every micro-batch
    is spread evenly over the data-parallel shards (rows are sharded in contiguous blocks)."""
    b = x.shape[0]
    return x.reshape(b // accum, accum, *x.shape[1:]).swapaxes(0, 1)


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
        ids, mask = batch["input_ids"], batch["label_mask"]
        denom = loss_denominator(mask)
        ids_m, mask_m = split_micro(ids, accum_steps), split_micro(mask, accum_steps)

        def micro_loss(p, mi, mm):
            total, (ce, z) = head_loss(p, mi, mm, cfg)
            return total / denom, (ce, z)

        grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

        def body(carry, xs):
            g_acc, ce_acc, z_acc = carry
            mi, mm = xs
            if micro_constraint is not None:
                mi, mm = micro_constraint(mi), micro_constraint(mm)
            (_, (ce, z)), g = grad_fn(params, mi, mm)
            g_acc = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), g_acc, g)
            return (g_acc, ce_acc + ce, z_acc + z), None

        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
        if accum_steps == 1:
            (grads, ce_sum, z_sum), _ = body((zeros, 0.0, 0.0), (ids_m[0], mask_m[0]))
        else:
            (grads, ce_sum, z_sum), _ = jax.lax.scan(body, (zeros, jnp.float32(0), jnp.float32(0)), (ids_m, mask_m))
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


def make_eval_step(cfg: Config, mesh: Mesh | None = None) -> Callable:
    """``eval(params, input_ids, label_mask) -> (ce_sum, n_labels)`` for held-out loss."""
    def ev(params, ids, mask):
        with activation_mesh(mesh):
            ce, _ = loss_sums(params, ids, mask, cfg)
        return ce, jnp.sum(mask[:, 1:].astype(jnp.float32))
    return ev
