"""Sampling settings and the on-device sampler: greedy or temperature / top-k / top-p, one
uniform per row and step, and each token's log-probability under the model.

A row draws with ``fold_in(fold_in(key(seed), index), step)``: ``index`` is the prompt's (or
request's) own, ``step`` the row's own count of sampled tokens, so a completion depends on its
prompt, its seed and index and the weights, never on the batch or the slot it ran in. The
settings are traced per row (``knobs``): one compiled program serves every setting, and rows of
one batch may sample differently (the server's requests do).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

import jax
import jax.numpy as jnp
import numpy as np

from olmax.config import MAX_TEMPERATURE
from olmax.model.dispatch import log_softmax

# The most top log-probabilities a token reports (OpenAI's API allows 20).
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class Sampling:
    """Greedy when ``temperature`` is None or 0; otherwise logits / temperature, then top-k, then
    top-p (nucleus), as transformers' ``generate`` applies them."""
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return not self.temperature

    def check(self) -> None:
        if self.temperature is not None:
            check_temperature(self.temperature)
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")
        if not 0 <= self.seed < 2**32:  # a uint32 inside the compiled decoder
            raise ValueError(f"seed must be an integer in 0..{2**32 - 1}, got {self.seed}")


@dataclass
class Completion:
    """``token_ids``: generated tokens (prompt excluded, EOS included when it stopped there);
    ``logprobs``: each one's log-probability under the model (before temperature);
    ``finish_reason``: "stop" (EOS or a stop condition), "length", "cancelled" or "error" (the
    model's logits were not finite: ``error`` says at which step; the tokens before it are kept);
    ``top_logprobs``: per token, the most likely (id, log-probability) pairs, where asked for."""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "length"
    top_logprobs: list[list[tuple[int, float]]] | None = None
    error: str | None = None


class NonFiniteLogits(ValueError):
    """A completion ended because the model's logits were NaN or infinite (``Completion.error``):
    broken weights, or finite weights whose forward overflows. Raised by ``olmax.engine.generate``
    for prompt ``prompt`` (its index in the call); the callers name the checkpoint."""

    def __init__(self, prompt: int, error: str) -> None:
        super().__init__(f"prompt {prompt}: {error}")
        self.prompt, self.error = prompt, error


def nonfinite_error(step: int) -> str:
    """``Completion.error`` of a row whose logits at its generation step ``step`` (0: the
    prefill's, which gives the first token) were not all finite."""
    where = "the prefill" if step == 0 else f"decode step {step}"
    return f"the model's logits are not finite (NaN or infinite) at generation step {step} ({where})"


def finite_rows(logits: jax.Array, vocab_size: int) -> jax.Array:
    """[b]: whether each row's logits over the vocabulary (padding excluded) are all finite. A row
    that is not ends there (``nonfinite_error``) and never reports a NaN log-probability."""
    return jnp.all(jnp.isfinite(logits[:, :vocab_size]), axis=-1)


def knobs(settings: Sequence[Sampling]) -> dict[str, np.ndarray]:
    """The per-row sampler settings of rows sampling with ``settings`` (host arrays):
    ``temperature`` (1 for a greedy row, whose draw is not used), ``top_k`` (0: off), ``top_p``
    (1: off), ``greedy``."""
    return {"temperature": np.asarray([s.temperature or 1.0 for s in settings], np.float32),
            "top_k": np.asarray([s.top_k or 0 for s in settings], np.int32),
            "top_p": np.asarray([1.0 if s.top_p is None else s.top_p for s in settings], np.float32),
            "greedy": np.asarray([s.greedy for s in settings], bool)}


def row_keys(seeds: jax.Array, indices: jax.Array) -> jax.Array:
    """[b] PRNG keys: ``fold_in(key(seed), index)`` per row."""
    return jax.vmap(lambda s, i: jax.random.fold_in(jax.random.key(s), i))(seeds, indices)


def sample(logits: jax.Array, keys: jax.Array, step: jax.Array, knobs: dict[str, jax.Array], greedy: bool,
           vocab_size: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Next tokens [b], their log-probabilities [b] and the log-probabilities of every token [b, V]
    from fp32 logits [b, V] (padded vocabulary rows never drawn); row i draws with
    ``fold_in(keys[i], step[i])`` (``step``: [b] or a scalar). ``knobs`` (``knobs()``, [b] each,
    traced): ``temperature``, ``top_k``, ``top_p``, ``greedy``. ``greedy`` (static): every row is
    greedy, and the draw is not compiled."""
    logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_size, logits, -jnp.inf)
    logp = log_softmax(logits)  # in the kernel's order under ``reproduce_decode_bits`` (RL's training forward's)
    tok = first_max(logits)
    if not greedy:
        z = logits / knobs["temperature"][:, None]

        def truncate(z: jax.Array) -> jax.Array:
            desc = -jnp.sort(-z, axis=-1)
            k = jnp.where(knobs["top_k"] > 0, jnp.minimum(knobs["top_k"], vocab_size), vocab_size)
            kth = jnp.take_along_axis(desc, (k - 1)[:, None], axis=1)          # the k-th largest
            desc = jnp.where(desc < kth, -jnp.inf, desc)
            p = jax.nn.softmax(desc, axis=-1)
            before = jnp.cumsum(p, axis=-1) - p                                  # mass of the more likely tokens
            top_p = knobs["top_p"][:, None]
            keep = (before < top_p) | (top_p >= 1)                               # the smallest set reaching top_p
            smallest = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
            return jnp.where(z < jnp.maximum(kth, smallest), -jnp.inf, z)

        # Without top-k or top-p (RL's setting) the sort is skipped: it was most of a sampled step
        # on the CPU (180 of 230 ms at 32 rows x 16,384 tokens). Exact: with both off it keeps all.
        z = jax.lax.cond(jnp.any((knobs["top_k"] > 0) | (knobs["top_p"] < 1)), truncate, lambda z: z, z)
        steps = jnp.broadcast_to(step, keys.shape)
        u = jax.vmap(lambda key, s: jax.random.uniform(jax.random.fold_in(key, s), (), z.dtype))(keys, steps)
        tok = jnp.where(knobs["greedy"], tok, inverse_cdf(z, u))
    tok = tok.astype(jnp.int32)
    return tok, jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0], logp


def inverse_cdf(z: jax.Array, u: jax.Array, block: int = 128) -> jax.Array:
    """[b]: a draw from softmax(z) per row by the inverse of its distribution function, one
    uniform ``u`` in [0, 1) per row: the first index whose running sum of exp(z - max) exceeds
    u times the total. Blocks of ``block`` tokens are summed first, then the running sum is taken
    inside the one block the draw falls in. NaN and -inf logits are never drawn (a row with
    nothing else gives 0); where the largest logit is +inf, one of the +inf entries is.

    One random number per row: Gumbel-max (``jax.random.categorical``) needs one per token, and
    its Threefry bits and two logarithms were about 1.6 ms of a 21 to 24 ms decode step at 32
    rows x 16,384 tokens on the CPU (XLA profiles before and after). The distribution is the
    same; the tokens a seed gives are not."""
    z = jnp.where(jnp.isnan(z), -jnp.inf, z)
    b, V = z.shape
    top = jnp.max(z, axis=-1, keepdims=True)
    e = jnp.exp(z - jnp.where(jnp.isfinite(top), top, 0))
    e = jnp.where(top == jnp.inf, (z == jnp.inf).astype(z.dtype), e)
    nb = -(-V // block)
    e = jnp.pad(e, ((0, 0), (0, nb * block - V))).reshape(b, nb, block)
    mass = e.sum(axis=-1)                                                    # [b, nb]
    sums = jnp.cumsum(mass, axis=-1)
    total = sums[:, -1]
    t = u * total
    # The block: the first whose running sum exceeds t; rounding may leave t at the very end,
    # so never past the last block that holds any mass (and likewise inside the block).
    last = nb - 1 - jnp.argmax((mass > 0)[:, ::-1], axis=-1)
    j = jnp.minimum(jnp.sum(sums <= t[:, None], axis=-1), last)
    before = jnp.where(j > 0, jnp.take_along_axis(sums, jnp.maximum(j - 1, 0)[:, None], axis=-1)[:, 0], 0)
    inside = jnp.take_along_axis(e, j[:, None, None], axis=1)[:, 0]         # [b, block]
    last_in = block - 1 - jnp.argmax((inside > 0)[:, ::-1], axis=-1)
    i = jnp.minimum(jnp.sum(jnp.cumsum(inside, axis=-1) <= (t - before)[:, None], axis=-1), last_in)
    return jnp.where(total > 0, j * block + i, 0)


def first_max(s: jax.Array) -> jax.Array:
    """[b]: the first index of each row's maximum, as ``jnp.argmax``, but NaNs count as -inf
    (never chosen; a row of NaNs gives 0), found in two passes: on the CPU ``jnp.argmax`` took
    1.2 ms over 32 rows x 16,384 logits, the two passes 0.3 ms."""
    s = jnp.where(jnp.isnan(s), -jnp.inf, s)
    first = jnp.where(s == jnp.max(s, axis=-1, keepdims=True), jnp.arange(s.shape[-1]), s.shape[-1])
    return jnp.min(first, axis=-1)


def check_temperature(value: float, what: str = "temperature") -> None:
    """Raise ValueError where ``value`` is not a temperature the sampler takes."""
    if not (isinstance(value, (int, float)) and not math.isnan(value) and 0 <= value <= MAX_TEMPERATURE):
        raise ValueError(f"{what} must be a number in [0, {MAX_TEMPERATURE:g}] (0: greedy), got {value}")
