"""The LM loss, one rule for every caller: the train step (each micro-batch), held-out evaluation
(``olmax.eval.heldout``, in the loop and offline) and the parity checks that run them.

A batch is a dict: ``input_ids`` int [b, t], ``label_mask`` bool [b, t] and, with document
masking, ``positions`` and ``segment_ids`` [b, t], which go to the forward pass.

Rule (OLMo-core ``train_module.train_batch`` + ``cross_entropy_loss``): labels are the inputs
shifted left, the last position has none, EOS is an ordinary target; position i's label counts
where ``label_mask[:, i + 1]`` is True. CE in fp32 over the padded vocabulary, summed over the
counted labels, plus z-loss ``mult * logsumexp^2`` summed over the same labels; both divided by
``loss_denominator``: the counted labels, plus the full length L of every row whose label mask is
all False. That is OLMo-core's rule for instances the repetition filter drops ("they count as
tokens with a zero loss"), and it holds for evaluation too; with label-mask files or packed
documents (SFT) a fully masked row counts nothing, as in OLMo-core's SFT. OLMo-core divides per
data-parallel rank and averages ranks; by default (``train.loss_ranks=1``) we divide once by the
global count so the loss does not depend on the topology. The two agree whenever ranks see equal
label counts (always in pre-training without the filter); ``train.loss_ranks=R`` reproduces the
per-rank rule with R ranks (``per_rank_weights``), as the SFT recipes do.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from olmax.config import Config, ModelConfig
from olmax.model.dispatch import exact_fp32, log_softmax, reproducing_decode_bits
from olmax.model.olmo3 import document_segments, hidden_states, lm_head
from olmax.sharding import constrain

Batch = dict[str, jax.Array]
DOCUMENT_KEYS = ("positions", "segment_ids")


def with_documents(batch: Batch, cfg: Config) -> Batch:
    """``batch`` plus ``positions`` and ``segment_ids`` when ``data.document_masking`` is on
    (documents end at EOS; OLMo-core's ``generate_doc_lengths``), computed on the device."""
    if not cfg.data.document_masking or "segment_ids" in batch:
        return batch
    positions, segment_ids = document_segments(batch["input_ids"], cfg.data.eos_token_id)
    return {**batch, "positions": positions, "segment_ids": segment_ids}


def _hidden(params: Any, batch: Batch, cfg: Config) -> jax.Array:
    docs = {k: batch[k] for k in DOCUMENT_KEYS if k in batch}  # only when given: today's program otherwise
    return hidden_states(params, batch["input_ids"], cfg.model, **docs)


def loss_denominator(label_mask: jax.Array, whole_rows: bool = True) -> jax.Array:
    """Counted labels (the shifted mask) plus, with ``whole_rows``, L for each row whose labels
    are all masked (OLMo-core counts the rows its instance filter drops; a row that label-mask
    files mask entirely counts nothing, as in OLMo-core's SFT)."""
    L = label_mask.shape[1]
    valid = jnp.sum(label_mask[:, 1:].astype(jnp.float32))
    if not whole_rows:
        return valid
    masked_instances = jnp.sum((~jnp.any(label_mask, axis=1)).astype(jnp.float32))
    return valid + masked_instances * L


def whole_rows_count(cfg: Config) -> bool:
    """Whether a fully masked row counts L labels: only where the instance filter masks rows (the
    pre-training data path), never with label-mask files or packed documents."""
    return not cfg.data.label_mask_paths and cfg.data.packing == "none"


def rank_of_rows(batch_rows: int, process_count: int, ranks: int) -> np.ndarray:
    """OLMo-core's data-parallel rank of each row of a global batch as the train step sees it.
    Process p's share (columns p::P of the global batch, ``olmax.data.order``) sits in rows
    p*B/P .. (p+1)*B/P; OLMo-core's rank r of R holds columns r::R."""
    j = np.arange(batch_rows)
    per = batch_rows // process_count
    column = j // per + (j % per) * process_count
    return column % ranks


def per_rank_weights(label_mask: jax.Array, ranks: int, process_count: int) -> jax.Array:
    """Label weights [b, t] (fp32) for ``train.loss_ranks`` R > 1: a counted label of a row on
    rank r weighs 1 / (R * rank r's counted labels), so the weighted CE sum is OLMo-core's SFT loss
    (each rank's token mean, averaged over ranks). A rank without counted labels weighs 0."""
    b = label_mask.shape[0]
    groups = jnp.asarray(rank_of_rows(b, process_count, ranks))
    per_row = jnp.sum(label_mask[:, 1:].astype(jnp.float32), axis=1)
    per_rank = jax.ops.segment_sum(per_row, groups, num_segments=ranks)
    w = jnp.where(per_rank > 0, 1.0 / (ranks * jnp.maximum(per_rank, 1.0)), 0.0)[groups]
    return label_mask.astype(jnp.float32) * w[:, None]


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


@exact_fp32
def _head_sums(head: jax.Array, x: jax.Array, input_ids: jax.Array, label_mask: jax.Array, cfg: ModelConfig,
               z_mult: float = 0.0, grad: bool = False) -> tuple[tuple[jax.Array, jax.Array], Any]:
    """``((CE sum, lse^2 sum), grads)`` over the counted labels of hidden states ``x`` [b, t, d].
    With ``model.logits_chunk`` the fp32 logits exist for one chunk of positions at a time (the
    7B's [b, 8192, 100352] fp32 logits would be 3.3 GB per sequence). With ``grad``, ``grads =
    (d head, d x)`` of ``CE + z_mult * lse^2``, computed chunk by chunk from d/dlogits = ``p (1 +
    2 z_mult lse) - onehot(target)`` on counted positions (p the softmax): the backward pass then
    needs neither the logits nor a second LM-head matmul to recompute them."""
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


def loss_sums(params: Any, batch: Batch, cfg: Config) -> tuple[jax.Array, jax.Array]:
    """(sum of CE, sum of logsumexp^2) over the counted labels of a (micro-)batch, fp32
    (evaluation; training differentiates ``head_loss``, which returns the same sums)."""
    x = _hidden(params, batch, cfg)
    return _head_sums(params["lm_head"], x, batch["input_ids"], batch["label_mask"], cfg.model)[0]


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


def head_loss(params: Any, batch: Batch, cfg: Config) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """``(CE sum + z_mult * z sum, (CE sum, z sum))`` as ``loss_sums``, for training: the first is
    differentiable, its LM-head gradient computed with the forward pass (no recomputed logits)."""
    return head_loss_of_hidden(params["lm_head"], _hidden(params, batch, cfg), batch, cfg)


def head_loss_of_hidden(head: jax.Array, x: jax.Array, batch: Batch, cfg: Config
                        ) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """``head_loss`` from the final hidden states ``x`` [b, t, d] (the LM head and the loss alone:
    the accelerator check times them apart from the layers)."""
    total, sums = _head_loss(head, x, batch["input_ids"], batch["label_mask"], cfg.model,
                             float(cfg.optim.z_loss or 0.0))
    return total, jax.lax.stop_gradient(sums)


# --------------------------------------------------------------------------- per-token log-probs
# (DPO and RL: the log-prob of each trained token, not a mean loss)


def _chunks(x: jax.Array, targets: jax.Array, valid: jax.Array, chunk: int | None):
    """Positions in chunks of ``chunk``: ``(unchunk, (x, targets, valid) as [n, b, c, ...])``;
    padded positions carry no label, ``unchunk`` maps [n, b, c] back to [b, t]."""
    b, t = targets.shape
    chunk = t if chunk is None or chunk >= t else chunk
    n = -(-t // chunk)
    pad = ((0, 0), (0, n * chunk - t))
    x, targets, valid = jnp.pad(x, pad + ((0, 0),)), jnp.pad(targets, pad), jnp.pad(valid, pad)

    def split(a: jax.Array) -> jax.Array:
        return a.reshape(b, n, chunk, *a.shape[2:]).swapaxes(0, 1)

    def unchunk(a: jax.Array) -> jax.Array:
        return a.swapaxes(0, 1).reshape(b, n * chunk)[:, :t]

    return unchunk, (split(x), split(targets), split(valid))


def token_logps(params: Any, tokens: jax.Array, label_mask: jax.Array, cfg: Any, *,
                sampled_vocab: bool = False, positions: jax.Array | None = None,
                segment_ids: jax.Array | None = None) -> jax.Array:
    """Log-prob of each counted target, fp32 [n, L] (0 where not counted): position i holds
    log p(tokens[i + 1] | tokens[:i + 1]) when ``label_mask[i + 1]``. Logits exist for
    ``model.logits_chunk`` positions at a time and are recomputed in the backward pass.
    ``positions`` and ``segment_ids`` [n, L]: packed documents (``hidden_states``), each seen alone.

    The softmax runs over every embedding row, as the LM loss and OLMo-core / open-instruct's DPO
    do; ``sampled_vocab`` leaves out the padding rows past ``model.vocab_size``, as the sampler
    does (RL: the policy whose log-probs are trained is the one that sampled)."""
    m = cfg.model
    docs = {k: v for k, v in (("positions", positions), ("segment_ids", segment_ids)) if v is not None}
    x = hidden_states(params, tokens, m, **docs)
    n = tokens.shape[0]
    targets = jnp.concatenate([tokens[:, 1:], jnp.zeros((n, 1), tokens.dtype)], axis=1)
    valid = jnp.concatenate([label_mask[:, 1:], jnp.zeros((n, 1), label_mask.dtype)], axis=1).astype(jnp.float32)
    unchunk, xs = _chunks(x, targets, valid, m.logits_chunk)
    head = params["lm_head"]

    @jax.checkpoint
    def chunk(head, xc, tc):
        logits = lm_head({"lm_head": head}, xc, m)
        if sampled_vocab and m.embedding_rows > m.vocab_size:
            logits = jnp.where(jnp.arange(logits.shape[-1]) < m.vocab_size, logits, -jnp.inf)
        if reproducing_decode_bits():  # the sampler's formula (``olmax.engine.sample``), bit for bit
            return jnp.take_along_axis(log_softmax(logits), tc[..., None], axis=-1)[..., 0]
        lse = jax.nn.logsumexp(logits, axis=-1)
        return jnp.take_along_axis(logits, tc[..., None], axis=-1)[..., 0] - lse

    def body(carry, xs):
        xc, tc, vc = xs
        return carry, chunk(head, xc, tc) * vc

    _, lp = jax.lax.scan(body, None, xs)
    return unchunk(lp)
