"""AdamW, learning-rate schedules, clipping and skip-step, exactly as OLMo-core trains OLMo 3.

References (``ai2-olmo-core`` 3.0.0):
- ``olmo_core/optim/scheduler.py``: ``CosWithWarmup``, ``HalfCosWithWarmup``, ``LinearWithWarmup``,
  ``ConstantWithWarmup``; ``Scheduler.set_lr`` passes ``trainer.global_step``, which the trainer
  increments *before* the update, so the first update uses step 1.
- ``olmo_core/optim/adamw.py``: ``SkipStepAdamW`` / ``foreach_adamw_step`` (the default, foreach=True).
- ``olmo_core/optim/skip_step_optimizer.py``: ``SkipStepOptimizer.get_step_factor``.
- ``olmo_core/train/train_module/transformer/train_module.py``: ``optim_step`` (clip, then set the
  lr, then step) and ``_clip_grad_norm`` (torch's ``clip_grads_with_norm_``).

Everything here is a pure function of its inputs, jittable with the config static. The skip-step
history lives in :class:`OptState`, so it is checkpointed (OLMo-core keeps it in Python lists and
loses it on resume).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from olmax.config import ConfigError, OptimConfig

Schedule = Callable[[jax.Array], jax.Array]

# torch.nn.utils.clip_grads_with_norm_ divides by (total_norm + 1e-6).
_CLIP_EPS = 1e-6

_BF16_MOMENTS = (
    "Adam moments must be float32: in the published OLMo 3 reproduction, moments that silently "
    "followed bf16 weights added +0.93 loss within 1000 steps (fp32 moments shrink the gap 30x)")


# --------------------------------------------------------------------------- schedules
#
# Each schedule maps the 1-based global step (int, possibly traced) to an fp32 lr. Integer
# differences are taken before converting to float, and (1 + cos(pi x)) / 2 is evaluated as
# sin(pi (1 - x) / 2)^2, so the result stays within ~1e-7 relative of OLMo-core's float64 value
# even where the lr decays to 0.


def _f32(x: jax.Array | int) -> jax.Array:
    return jnp.asarray(x).astype(jnp.float32)


def _linear_warmup(peak: float, s: jax.Array, warmup: int) -> jax.Array:
    # OLMo-core ``_linear_warmup`` with warmup_min_lr = 0: peak * min(s, warmup) / warmup.
    return peak * (_f32(jnp.minimum(s, warmup)) / max(warmup, 1))


def cos_with_warmup(step: jax.Array, *, lr: float, warmup: int, t_max: int, alpha_f: float) -> jax.Array:
    """OLMo-core ``CosWithWarmup``: linear warmup, then cosine from lr to ``alpha_f * lr`` at t_max."""
    s = jnp.asarray(step, jnp.int32)
    eta_min = lr * alpha_f
    frac_left = _f32(t_max - s) / max(t_max - warmup, 1)           # 1 at the warmup end, 0 at t_max
    cos = eta_min + (lr - eta_min) * jnp.sin(jnp.float32(math.pi / 2) * frac_left) ** 2
    return jnp.where(s < warmup, _linear_warmup(lr, s, warmup), jnp.where(s >= t_max, eta_min, cos))


def half_cos_with_warmup(step: jax.Array, *, lr: float, warmup: int, t_max: int, alpha_f: float) -> jax.Array:
    """OLMo-core ``HalfCosWithWarmup``: warmup to the cosine's midpoint, then its second half.

    Past the warmup OLMo-core does ``current -= warmup; t_max -= warmup; current += t_max;
    t_max *= 2`` and applies the cosine formula, i.e. (t_max' - current') = (t_max - step).
    """
    s = jnp.asarray(step, jnp.int32)
    eta_min = lr * alpha_f
    mid = eta_min + (lr - eta_min) / 2
    frac_left = _f32(t_max - s) / (2 * max(t_max - warmup, 1))     # 1/2 at the warmup end
    cos = eta_min + (lr - eta_min) * jnp.sin(jnp.float32(math.pi / 2) * frac_left) ** 2
    return jnp.where(s < warmup, _linear_warmup(mid, s, warmup), jnp.where(s >= t_max, eta_min, cos))


def linear_with_warmup(step: jax.Array, *, lr: float, warmup: int, t_max: int, alpha_f: float) -> jax.Array:
    """OLMo-core ``LinearWithWarmup``: linear warmup, then linear from lr to ``alpha_f * lr``."""
    s = jnp.asarray(step, jnp.int32)
    eta_min = lr * alpha_f
    lin = eta_min + (lr - eta_min) * (_f32(t_max - s) / max(t_max - warmup, 1))
    return jnp.where(s < warmup, _linear_warmup(lr, s, warmup), jnp.where(s >= t_max, eta_min, lin))


def hf_linear_with_warmup(step: jax.Array, *, lr: float, warmup: int, t_max: int) -> jax.Array:
    """HF ``get_linear_schedule_with_warmup`` (open-instruct's and TRL's ``linear``) at the 0-based
    update index k = step - 1: lr * k / warmup during warmup, then lr * (t_max - k) / (t_max - warmup)
    down to 0. olmax's ``linear`` gives update k the lr this gives update k + 1."""
    k = jnp.asarray(step, jnp.int32) - 1
    warm = lr * (_f32(k) / max(warmup, 1))
    decay = lr * (_f32(jnp.maximum(t_max - k, 0)) / max(t_max - warmup, 1))
    return jnp.where(k < warmup, warm, decay)


def constant_with_warmup(step: jax.Array, *, lr: float, warmup: int) -> jax.Array:
    """OLMo-core ``ConstantWithWarmup`` (``ConstantScheduler`` when warmup is 0)."""
    s = jnp.asarray(step, jnp.int32)
    if warmup == 0:
        return jnp.full(s.shape, lr, jnp.float32)
    return jnp.where(s <= warmup, _linear_warmup(lr, s, warmup), jnp.float32(lr))


def two_part_cosine(step: jax.Array, *, lr: float, warmup: int, t_max: int, alpha_f: float,
                    switch_step: int, part2_warmup: int, t_max_2: int) -> jax.Array:
    """Stage 1 as AI2 ran it: ``CosWithWarmup`` for steps <= ``switch_step`` (the last update of the
    first script), then ``HalfCosWithWarmup(warmup=part2_warmup)`` over ``t_max_2``.

    With ``part2_warmup == switch_step`` (the recipe) part 2 starts just below (lr + eta_min) / 2,
    continuously with part 1. AI2's second script resumed from checkpoint step596047 while its
    half-cosine "warmup" is 597046: steps 596048..597045 then sit on HalfCosWithWarmup's linear
    ramp (lr about 0.2% lower); reproduce that with switch_step=596047, part2_warmup=597046.
    """
    p1 = cos_with_warmup(step, lr=lr, warmup=warmup, t_max=t_max, alpha_f=alpha_f)
    p2 = half_cos_with_warmup(step, lr=lr, warmup=part2_warmup, t_max=t_max_2, alpha_f=alpha_f)
    return jnp.where(jnp.asarray(step, jnp.int32) <= switch_step, p1, p2)


def make_schedule(optim_cfg: OptimConfig, total_steps: int) -> Schedule:
    """The lr as a function of the 1-based global step (``trainer.global_step`` in OLMo-core).

    ``schedule.t_max`` None means ``total_steps``, as OLMo-core uses ``trainer.max_steps``.
    """
    sc = optim_cfg.schedule
    lr = float(optim_cfg.lr)
    t_max = int(sc.t_max if sc.t_max is not None else total_steps)
    # warmup_fraction: OLMo-core's round(t_max * warmup_fraction) (Python's round).
    warmup = round(t_max * sc.warmup_fraction) if sc.warmup_fraction is not None else int(sc.warmup)
    kw = dict(lr=lr, warmup=warmup, t_max=t_max, alpha_f=float(sc.alpha_f))
    if sc.name == "cosine":
        return lambda step: cos_with_warmup(step, **kw)
    if sc.name == "half_cosine":
        return lambda step: half_cos_with_warmup(step, **kw)
    if sc.name == "linear":
        return lambda step: linear_with_warmup(step, **kw)
    if sc.name == "constant":
        return lambda step: constant_with_warmup(step, lr=lr, warmup=warmup)
    if sc.name == "hf_linear":
        return lambda step: hf_linear_with_warmup(step, lr=lr, warmup=warmup, t_max=t_max)
    if sc.name == "two_part_cosine":  # switch_step and t_max_2 are set (olmax.config.validate)
        # part2_warmup None: part 2's warmup is the switch step (see two_part_cosine).
        p2w = int(sc.part2_warmup if sc.part2_warmup is not None else sc.switch_step)
        return lambda step: two_part_cosine(step, **kw, switch_step=int(sc.switch_step),
                                            part2_warmup=p2w, t_max_2=int(sc.t_max_2))
    raise ConfigError(f"optim.schedule.name: unknown schedule {sc.name!r}")


# --------------------------------------------------------------------------- state


class OptState(NamedTuple):
    """Optimizer state (a pytree; everything in it is checkpointed)."""

    step: jax.Array            # int32: global updates done, skipped ones included; next lr uses step + 1
    adam_step: jax.Array       # int32: updates applied (OLMo-core's per-param state["step"])
    mu: Any                    # fp32 first moments, like params
    nu: Any                    # fp32 second moments, like params
    loss_history: jax.Array    # fp32 [window]: previous CE losses, oldest first, newest last
    norm_history: jax.Array    # fp32 [window]: previous pre-clip grad norms, same layout
    history_count: jax.Array   # int32: valid entries (the last history_count of each history)


def init_opt_state(params: Any, optim_cfg: OptimConfig) -> OptState:
    """Zero moments in fp32 whatever the parameter dtype (``optim.moments_dtype`` is refused
    otherwise by ``olmax.config.validate``); empty skip-step history."""
    window = optim_cfg.skip_step.window

    def zeros() -> Any:
        return optax.tree_utils.tree_zeros_like(params, dtype=jnp.float32)
    return OptState(
        step=jnp.zeros((), jnp.int32), adam_step=jnp.zeros((), jnp.int32), mu=zeros(), nu=zeros(),
        loss_history=jnp.zeros((window,), jnp.float32), norm_history=jnp.zeros((window,), jnp.float32),
        history_count=jnp.zeros((), jnp.int32),
    )


# --------------------------------------------------------------------------- pieces


def clip_by_global_norm(grads: Any, max_norm: float, norm: jax.Array) -> tuple[Any, jax.Array]:
    """torch ``clip_grads_with_norm_``: multiply by min(max_norm / (norm + 1e-6), 1), always.

    (optax.clip_by_global_norm has no 1e-6 and rescales only above the threshold; that differs by
    ~1e-6 relative whenever clipping is active.) Returns the clipped grads and the coefficient.
    """
    coef = jnp.minimum(jnp.float32(max_norm) / (norm + jnp.float32(_CLIP_EPS)), jnp.float32(1.0))
    return jax.tree.map(lambda g: g * coef, grads), coef


def _masked_std_mean(hist: jax.Array, n: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Mean and unbiased std (torch.std_mean) of the last ``n`` entries of ``hist``."""
    valid = jnp.arange(hist.shape[0]) >= hist.shape[0] - n
    mean = jnp.sum(jnp.where(valid, hist, 0.0)) / jnp.maximum(n, 1).astype(jnp.float32)
    ss = jnp.sum(jnp.where(valid, (hist - mean) ** 2, 0.0))
    # n == 1 gives 0/0 = NaN, as torch.std does for one value (then every test fails: skip).
    return jnp.sqrt(ss / (n - 1).astype(jnp.float32)), mean


def skip_decision(state: OptState, loss: jax.Array, grad_norm: jax.Array, optim_cfg: OptimConfig) -> jax.Array:
    """OLMo-core ``SkipStepOptimizer.get_step_factor``, negated: True when the update is skipped.

    The current values are *not* in ``state``'s history yet (OLMo-core appends them first and then
    excludes them with ``[:-1]``). Active once the history plus the current value holds
    ``max(2, min_history)`` values (OLMo-core: ``len(losses) >= max(2, window // 2)``). The test is
    written as OLMo-core's ``not (x - mean <= sigma * std)``, so a NaN loss or norm is a skip.
    The grad norm takes part only when clipping is on: OLMo-core sets ``latest_grad_norm`` only
    inside ``if max_grad_norm is not None`` (train_module.optim_step).
    """
    sk = optim_cfg.skip_step
    n = state.history_count
    active = (n + 1) >= max(2, sk.min_history)
    sigma = jnp.float32(sk.sigma_factor)
    loss_std, loss_mean = _masked_std_mean(state.loss_history, n)
    ok = (loss - loss_mean) <= sigma * loss_std
    if optim_cfg.max_grad_norm is not None:
        norm_std, norm_mean = _masked_std_mean(state.norm_history, n)
        ok = jnp.logical_and(ok, (grad_norm - norm_mean) <= sigma * norm_std)
    return jnp.logical_and(active, jnp.logical_not(ok)) if sk.enabled else jnp.zeros((), bool)


def _push(hist: jax.Array, x: jax.Array) -> jax.Array:
    return jnp.concatenate([hist[1:], x[None]])


def _decay_mask(params: Any, optim_cfg: OptimConfig) -> Any:
    """True where weight decay applies: everything but the top-level ``embed`` (OLMo 3 puts
    ``embeddings.weight`` in a weight_decay=0 group) unless ``decay_embeddings``."""
    def decays(path: tuple, _: Any) -> bool:
        head = path[0] if path else None
        is_embed = isinstance(head, jax.tree_util.DictKey) and head.key == "embed"
        return optim_cfg.decay_embeddings or not is_embed
    return jax.tree_util.tree_map_with_path(decays, params)


# --------------------------------------------------------------------------- the update


def apply_update(params: Any, grads: Any, opt_state: OptState, ce_loss: jax.Array, optim_cfg: OptimConfig,
                 total_steps: int) -> tuple[Any, OptState, dict[str, jax.Array]]:
    """One OLMo-core training update: clip, schedule, skip-step test, AdamW.

    ``ce_loss`` is the batch CE loss without z-loss (what OLMo-core feeds ``latest_loss``).
    Jit with ``optim_cfg`` and ``total_steps`` static. On a skip, params, moments and ``adam_step``
    are returned unchanged while ``step`` (hence the lr) advances and both values enter the history.
    """
    for leaf in jax.tree.leaves((opt_state.mu, opt_state.nu)):  # a state built by hand (configs: validate)
        if leaf.dtype != jnp.float32:
            raise ValueError(f"optimizer moment of dtype {leaf.dtype}: {_BF16_MOMENTS}")

    f32 = jnp.float32
    step = opt_state.step + 1                     # trainer.global_step += 1 before the update
    lr = make_schedule(optim_cfg, total_steps)(step)
    loss = jnp.asarray(ce_loss, f32)

    # train_module.optim_step: clip first (the pre-clip norm is what skip-step sees), then lr.
    g32 = jax.tree.map(lambda g: g.astype(f32), grads)
    grad_norm = optax.global_norm(g32)
    coef = jnp.float32(1.0)
    if optim_cfg.max_grad_norm is not None:
        g32, coef = clip_by_global_norm(g32, optim_cfg.max_grad_norm, grad_norm)

    skipped = skip_decision(opt_state, loss, grad_norm, optim_cfg)
    # A non-finite loss or grad norm (the pre-clip norm, whether or not clipping is on) never
    # becomes an update and never enters the history, unless olmo_core_nonfinite replays
    # OLMo-core (see SkipStepConfig).
    nonfinite = jnp.logical_not(jnp.logical_and(jnp.isfinite(loss), jnp.isfinite(grad_norm)))
    if not optim_cfg.skip_step.olmo_core_nonfinite:
        skipped = jnp.logical_or(skipped, nonfinite)

    # foreach_adamw_step, written for step_factor = 1; a skip then selects the old values, which is
    # what step_factor = 0 yields there for finite grads (and stays clean for non-finite ones).
    b1, b2 = optim_cfg.beta1, optim_cfg.beta2
    w1, w2 = f32(1 - b1), f32(1 - b2)
    t = (opt_state.adam_step + 1).astype(f32)     # bias correction uses state["step"] + 1
    bc1 = 1 - jnp.power(f32(b1), t)
    bc2 = 1 - jnp.power(f32(b2), t)
    step_size = lr / bc1
    sqrt_bc2 = jnp.sqrt(bc2)
    decay = 1 - lr * f32(optim_cfg.weight_decay)  # p.mul_(1 - lr * wd) happens before the moments
    mask = _decay_mask(params, optim_cfg)

    def leaf(p, g, m, v, wd):
        keep = lambda old, new: jnp.where(skipped, old, new.astype(old.dtype))
        # The new moments are selected first and the parameter update reads the selected ones
        # (equal to the new ones whenever the update is kept): the old moments are then dead once
        # read, so their buffers are updated in place instead of being copied first.
        m_new = keep(m, m * (1 - w1) + g * w1)
        v_new = keep(v, v * (1 - w2) + (g * g) * w2)
        denom = jnp.sqrt(v_new) / sqrt_bc2 + f32(optim_cfg.eps)
        p32 = p.astype(f32)
        p_new = (p32 * decay if wd else p32) + (m_new / denom) * (-step_size)
        return keep(p, p_new), m_new, v_new

    p_leaves, treedef = jax.tree.flatten(params)
    rest = [treedef.flatten_up_to(tree) for tree in (g32, opt_state.mu, opt_state.nu, mask)]
    out = [leaf(*args) for args in zip(p_leaves, *rest)]
    new_params, mu, nu = (treedef.unflatten([o[i] for o in out]) for i in range(3))

    window = optim_cfg.skip_step.window
    loss_history = _push(opt_state.loss_history, loss)
    norm_history = _push(opt_state.norm_history, grad_norm)
    history_count = jnp.minimum(opt_state.history_count + 1, window)
    if not optim_cfg.skip_step.olmo_core_nonfinite:
        loss_history = jnp.where(nonfinite, opt_state.loss_history, loss_history)
        norm_history = jnp.where(nonfinite, opt_state.norm_history, norm_history)
        history_count = jnp.where(nonfinite, opt_state.history_count, history_count)
    new_state = OptState(
        step=step,
        adam_step=opt_state.adam_step + jnp.where(skipped, 0, 1).astype(jnp.int32),
        mu=mu, nu=nu,
        loss_history=loss_history,
        norm_history=norm_history,
        history_count=history_count,
    )
    metrics = {
        "lr": lr,
        "grad_norm": grad_norm,
        "clipped_grad_norm": grad_norm * coef,
        "step_skipped": skipped.astype(f32),
        "nonfinite": nonfinite.astype(f32),
    }
    return new_params, new_state, metrics
