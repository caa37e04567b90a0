"""GRPO core: group advantages, the clipped policy loss, its aggregation, the policy's log-probs,
and several optimizer steps on one rollout batch (the step itself: ``olmax.objectives.grpo``).

Layout. A batch holds ``n`` rows of prompt + completion tokens, ``input_ids`` int [n, L], and a
``completion_mask`` bool [n, L] in the label-mask convention of ``olmax.model.loss.token_logps``:
True at each completion token (the tokens that are trained). Per-token quantities (``old_logps``,
``gen_logps``, ``ref_logps``, the policy's log-probs) use ``token_logps``'s output layout: position
i holds log p(tokens[i + 1] | tokens[:i + 1]), counted where ``completion_mask[i + 1]``.

Advantages (``group_advantages``; rows of one prompt are ``group_size`` consecutive rows):

- ``centered``: A = r - mean_group(r). AI2's OLMo 3 RL runs (open-instruct
  ``advantage_normalization_type="centered"``); TRL's ``scale_rewards="none"``.
- ``standard``: A = (r - mean) / (std + 1e-8), population std over the group (open-instruct).
- ``trl_group``: (r - mean) / (std + 1e-4), std with Bessel's correction over the group (TRL's
  default ``scale_rewards="group"``).
- ``trl_batch``: (r - group mean) / (std + 1e-4), Bessel std over the whole batch (TRL
  ``scale_rewards="batch"``).

``zero_std_groups`` marks groups whose rewards are all equal (their centered advantage is 0);
``filter_zero_std`` gives the rows to keep (open-instruct ``filter_zero_std_samples``).

Per token (``per_token_terms``), with ratio = exp(logp - logp_old)::

    L = max(-A * ratio, -A * clip(ratio, 1 - eps_low, 1 + eps_high))
    L *= min(exp(clip(logp_old - logp_gen, -10, 10)), tis_cap)   # truncated IS, when tis_cap is set
    L += beta * (exp(logp_ref - logp) - (logp_ref - logp) - 1)     # k3 KL, when beta != 0

Aggregation of L over the tokens of one optimizer step's batch (``aggregation``):

- ``token_mean``: sum of L over all completion tokens of the batch / their count (a global token
  mean, whatever the micro-batching). TRL ``loss_type="dapo"`` (with ``steps_per_generation`` equal
  to the gradient accumulation steps); open-instruct after PR #1161 (``loss_denominator="token"``).
- ``sequence_mean``: per sequence, the mean of L over its tokens; then the mean over sequences
  (a sequence with no completion token counts with 0). TRL ``loss_type="grpo"``.
- ``microbatch_mean``: per micro-batch, the mean of L over its completion tokens; then the sum over
  micro-batches / the number of micro-batches. open-instruct's ``masked_mean`` then
  ``/ accumulation_steps`` as in AI2's 7B Think and Instruct RL runs: a token's weight depends on
  how many tokens share its micro-batch.

The step (``olmax.objectives.grpo.make_grpo_step``) splits the batch into ``accum_steps``
micro-batches (rows a::accum, as ``olmax.sharding.split_micro``), accumulates the gradients of each
micro-batch's share of the loss, and applies one optimizer update (``olmax.optim.apply_update``).
Several optimizer steps per rollout batch (``train_on_batch``): ``num_epochs`` passes over the
batch (TRL ``num_iterations``), each split into ``num_mini_batches`` contiguous mini-batches
(open-instruct ``num_mini_batches``), one update each; ``old_logps`` are the policy's log-probs
before the first of them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

ADVANTAGE_MODES = ("centered", "standard", "trl_group", "trl_batch")
AGGREGATIONS = ("token_mean", "sequence_mean", "microbatch_mean")


# --------------------------------------------------------------------------- advantages


def _groups(rewards: np.ndarray, group_size: int) -> np.ndarray:
    r = np.asarray(rewards, np.float32).reshape(-1)
    if group_size < 1 or r.shape[0] % group_size:
        raise ValueError(f"{r.shape[0]} rewards do not split into groups of {group_size}")
    return r.reshape(-1, group_size)


def group_advantages(rewards: np.ndarray, group_size: int, mode: str = "centered") -> np.ndarray:
    """Per-row advantages (float32 [n]) from per-row rewards, groups of ``group_size`` consecutive rows."""
    g = _groups(rewards, group_size)
    mean = g.mean(axis=1, keepdims=True, dtype=np.float32)
    if mode == "centered":
        a = g - mean
    elif mode == "standard":
        a = (g - mean) / (g.std(axis=1, keepdims=True, dtype=np.float32) + np.float32(1e-8))
    elif mode == "trl_group":
        std = g.std(axis=1, ddof=1, keepdims=True, dtype=np.float32) if group_size > 1 else np.zeros_like(mean)
        a = (g - mean) / (std + np.float32(1e-4))
    elif mode == "trl_batch":
        std = g.reshape(-1).std(ddof=1, dtype=np.float32) if g.size > 1 else np.float32(0)
        a = (g - mean) / (std + np.float32(1e-4))
    else:
        raise ValueError(f"advantage mode {mode!r}: one of {', '.join(ADVANTAGE_MODES)}")
    return a.astype(np.float32).reshape(-1)


def zero_std_groups(rewards: np.ndarray, group_size: int) -> np.ndarray:
    """bool [groups]: True where every reward of the group is the same."""
    g = _groups(rewards, group_size)
    return np.all(g == g[:, :1], axis=1)


def filter_zero_std(rewards: np.ndarray, group_size: int) -> np.ndarray:
    """Row indices (int64) of the groups whose rewards are not all equal, in order."""
    keep = ~zero_std_groups(rewards, group_size)
    return np.nonzero(np.repeat(keep, group_size))[0].astype(np.int64)


# --------------------------------------------------------------------------- the loss


@dataclasses.dataclass(frozen=True)
class GrpoLoss:
    """The policy loss's options (AI2's 7B values as defaults, KL off)."""

    eps_low: float = 0.2
    eps_high: float = 0.272
    aggregation: str = "token_mean"
    beta: float = 0.0                 # KL coefficient against the reference (k3); 0 = off
    tis_cap: float | None = None      # truncated importance sampling cap (AI2: 2.0); None = off

    def __post_init__(self):
        if self.aggregation not in AGGREGATIONS:
            raise ValueError(f"aggregation {self.aggregation!r}: one of {', '.join(AGGREGATIONS)}")
        if not (0 <= self.eps_low < 1 and self.eps_high >= 0):
            raise ValueError(f"clip range needs 0 <= eps_low < 1 and eps_high >= 0, got {self.eps_low}, "
                             f"{self.eps_high}")
        if self.beta < 0:
            raise ValueError(f"beta must be >= 0, got {self.beta}")
        if self.tis_cap is not None and not self.tis_cap > 0:
            raise ValueError(f"tis_cap must be > 0 or None, got {self.tis_cap}")


def token_mask(completion_mask: jax.Array) -> jax.Array:
    """float32 [n, L] in ``token_logps`` layout: 1 at position i when token i + 1 is trained."""
    m = completion_mask.astype(jnp.float32)
    return jnp.concatenate([m[:, 1:], jnp.zeros_like(m[:, :1])], axis=1)


def per_token_terms(logp: jax.Array, old_logp: jax.Array, adv: jax.Array, loss: GrpoLoss,
                    gen_logp: jax.Array | None = None, ref_logp: jax.Array | None = None
                    ) -> dict[str, jax.Array]:
    """Per-token loss L [n, L] and its diagnostics (unmasked). ``adv`` is [n] (a row's), or
    [n, L] in ``token_logps`` layout (packed rows: each token its document's)."""
    a = (adv[:, None] if adv.ndim == 1 else adv).astype(jnp.float32)
    ratio = jnp.exp(logp - old_logp)
    clipped = jnp.clip(ratio, 1.0 - loss.eps_low, 1.0 + loss.eps_high)
    per_tok = jnp.maximum(-a * ratio, -a * clipped)
    if loss.tis_cap is not None:
        if gen_logp is None:
            raise ValueError("tis_cap is set but the batch has no gen_logps")
        w = jnp.minimum(jnp.exp(jnp.clip(old_logp - gen_logp, -10.0, 10.0)), loss.tis_cap)
        per_tok = per_tok * jax.lax.stop_gradient(w)
    kl = jnp.zeros_like(per_tok)
    if ref_logp is not None:
        d = ref_logp - logp
        kl = jnp.exp(d) - d - 1.0
        if loss.beta:
            per_tok = per_tok + loss.beta * kl
    elif loss.beta:
        raise ValueError("beta > 0 needs ref_logps in the batch")
    low = (ratio < 1.0 - loss.eps_low) & (a < 0)
    high = (ratio > 1.0 + loss.eps_high) & (a > 0)
    return {"loss": per_tok, "clipped": (low | high).astype(jnp.float32), "kl": kl,
            "ratio": ratio}


def aggregate(per_tok: jax.Array, mask: jax.Array, aggregation: str, *, total_tokens: jax.Array | float,
              total_sequences: jax.Array | int, accum_steps: jax.Array | int,
              segment_ids: jax.Array | None = None) -> jax.Array:
    """One micro-batch's share of the batch loss (the shares add up over micro-batches).

    ``total_tokens`` and ``total_sequences`` count the whole optimizer batch; ``accum_steps`` the
    micro-batches ``microbatch_mean`` divides by. ``segment_ids`` [n, L]: packed rows, whose
    sequences are their documents (``sequence_mean`` takes each document's mean)."""
    s = per_tok * mask
    if aggregation == "token_mean":
        return jnp.sum(s) / jnp.maximum(total_tokens, 1.0)
    if aggregation == "sequence_mean":
        if segment_ids is not None:  # one bucket per (row, document)
            n, length = segment_ids.shape
            ids = (jnp.arange(n, dtype=jnp.int32)[:, None] * length + segment_ids).reshape(-1)
            sums = jax.ops.segment_sum(s.reshape(-1), ids, num_segments=n * length)
            counts = jax.ops.segment_sum(mask.reshape(-1), ids, num_segments=n * length)
            return jnp.sum(sums / jnp.maximum(counts, 1.0)) / total_sequences
        per_seq = jnp.sum(s, axis=1) / jnp.maximum(jnp.sum(mask, axis=1), 1.0)
        return jnp.sum(per_seq) / total_sequences
    if aggregation == "microbatch_mean":
        return jnp.sum(s) / jnp.maximum(jnp.sum(mask), 1.0) / accum_steps
    raise ValueError(f"aggregation {aggregation!r}: one of {', '.join(AGGREGATIONS)}")


# --------------------------------------------------------------------------- log-probs, updates on one batch


def policy_logps(params: Any, tokens: jax.Array, completion_mask: jax.Array, cfg: Any, exact: bool = False,
                 positions: jax.Array | None = None, segment_ids: jax.Array | None = None) -> jax.Array:
    """The policy's log-probs of the completion tokens. ``exact``: with the CPU decode steps'
    arithmetic (``olmax.model.dispatch.reproduce_decode_bits``), the bits the sampler reported, where the
    generator decodes with the kernels (``olmax.model.dispatch.can_reproduce_decode_bits``).
    ``positions`` and ``segment_ids``: packed rows (``olmax.rl.packing``), each completion seen alone."""
    from olmax.model.dispatch import reproduce_decode_bits
    from olmax.model.loss import token_logps
    with reproduce_decode_bits(exact):
        return token_logps(params, tokens, completion_mask, cfg, sampled_vocab=True, positions=positions,
                           segment_ids=segment_ids)


def make_logps_fn(cfg: Any) -> Callable:
    """Jitted ``logps(params, input_ids, completion_mask) -> [n, L]`` (no gradient): the old (or
    reference) log-probs of a rollout batch."""
    return jax.jit(lambda p, t, m: jax.lax.stop_gradient(policy_logps(p, t, m, cfg)))


def train_on_batch(params: Any, opt_state: Any, batch: dict[str, Any], step: Callable, *, num_mini_batches: int = 1,
                   num_epochs: int = 1) -> tuple[Any, Any, list[dict[str, float]]]:
    """``num_epochs * num_mini_batches`` optimizer steps on one rollout batch (``old_logps`` must
    be in ``batch``: the log-probs before the first step). Mini-batches are contiguous row blocks
    (keep groups whole by choosing sizes that are multiples of the group size)."""
    n = int(np.shape(batch["input_ids"])[0])
    if num_mini_batches < 1 or n % num_mini_batches:
        raise ValueError(f"{n} rows do not split into {num_mini_batches} mini-batches")
    size = n // num_mini_batches
    rows = []
    for _ in range(num_epochs):
        for k in range(num_mini_batches):
            mb = {key: v[k * size:(k + 1) * size] for key, v in batch.items()}
            params, opt_state, m = step(params, opt_state, mb)
            rows.append({key: float(v) for key, v in m.items()})
    return params, opt_state, rows
