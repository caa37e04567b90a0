"""Sampling loop over the KV cache (``olmax.model.decode``): greedy or temperature / top-k /
top-p sampling, EOS and caller-defined stops, per-token log-probabilities.

Shapes are bucketed so a run compiles once per (batch rows, prompt bucket, cache length):
prompts are right-padded to a power of two (at least 16; 128 for splash attention) that fits the longest prompt of the
whole call, the cache holds that plus ``max_new_tokens`` rounded up to 64, and a short last
batch is padded with copies of its first prompt. A prompt that several rows of a batch share
(GRPO samples a group of completions of each prompt) is prefilled once per data-parallel shard,
in a block of the shard's distinct prompts (a power of two as well), and its cache copied to each
of its rows.
Sampling draws from a key per prompt (the seed folded with the prompt's index, then with the
step), so a prompt's tokens do not depend on the batch it ran in: one uniform per row and step,
turned into a token by the inverse of the distribution function (``_inverse_cdf``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from olmax.config import ModelConfig
from olmax.model.decode import decode_step, expand_rows, layout_of, prefill, prepare, relayout
from olmax.model.dispatch import decode_layout, log_softmax, reproduce_decode_bits, resolve_attention
from olmax.model.params import logical_axes
from olmax.sharding import activation_mesh, batch_sharding, data_parallel_size, param_shardings


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
        if self.temperature is not None and not 0 <= self.temperature < math.inf:
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature}")
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
    ``finish_reason``: "stop" (EOS or a stop condition) or "length"."""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "length"


def _bucket(n: int, lo: int = 16) -> int:
    return max(lo, 1 << (n - 1).bit_length())


def prompt_bucket(longest: int, cfg: ModelConfig, mesh: Mesh | None = None) -> int:
    """The padded prompt length of a call whose longest prompt has ``longest`` tokens: a power of
    two, at least 16, or 128 where ``cfg``'s attention resolves to splash under ``mesh`` (TPU:
    it tiles the prompt in blocks of 128)."""
    with activation_mesh(mesh):
        splash = resolve_attention(cfg.attention_impl, jnp.dtype(cfg.compute_dtype)) == "splash"
    return _bucket(longest, lo=128 if splash else 16)


def batch_rows(prompts: int, batch_size: int, data_parallel: int = 1) -> int:
    """The rows every batch of a call of ``prompts`` prompts runs with: ``batch_size`` at most,
    fewer (a power of two) for a smaller call, whole rows per data-parallel shard."""
    rows = min(batch_size, _bucket(prompts, lo=1))
    return -(-rows // data_parallel) * data_parallel


def _data_parallel(mesh: Mesh | None) -> int:
    return data_parallel_size(dict(mesh.shape)) if mesh is not None else 1


def call_rows(prompts: int, batch_size: int, mesh: Mesh | None = None) -> int:
    """``batch_rows`` of a ``generate`` call of ``prompts`` prompts on ``mesh`` (None: one device):
    the ``rows`` to build its ``Generator`` with."""
    return batch_rows(prompts, batch_size, _data_parallel(mesh))


def _share(keys: Sequence[tuple], data_parallel: int) -> tuple[list[int], np.ndarray] | None:
    """``prefill_rows``' plan for the padded batch's rows (as hashable ``keys``): the rows to
    prefill (each shard's distinct prompts, every shard's block padded with its first to one
    power-of-two width) and, per shard, the block row each of its rows copies; None where that
    saves no row."""
    per = len(keys) // data_parallel
    blocks, source = [], np.zeros((data_parallel, per), np.int32)
    for d in range(data_parallel):
        first: dict[tuple, int] = {}  # a prompt -> its row in the shard's block
        block: list[int] = []
        for j in range(per):
            key = keys[d * per + j]
            if key not in first:
                first[key] = len(block)
                block.append(d * per + j)
            source[d, j] = first[key]
        blocks.append(block)
    width = _bucket(max(map(len, blocks)), lo=1)
    if width * data_parallel >= len(keys):
        return None
    return [r for b in blocks for r in [*b, *[b[0]] * (width - len(b))]], source


def prefill_rows(prompts: Sequence[Sequence[int]], rows: int,
                 data_parallel: int = 1) -> tuple[list[Sequence[int]], np.ndarray | None]:
    """What one batch prefills: ``prompts`` padded to ``rows`` with copies of the first. Where
    real rows repeat a prompt (a GRPO group), each of the ``data_parallel`` shards (consecutive
    rows) prefills its distinct prompts once and ``decode.expand_rows`` copies their cache to its
    rows: then the prefilled prompts and, per shard, the block row each row copies
    ([data_parallel, rows / data_parallel]); otherwise the padded rows and None. Padding alone
    never shares, so a batch of distinct prompts keeps its one program."""
    filled = [*prompts, *[prompts[0]] * (rows - len(prompts))]
    keys = [tuple(int(t) for t in p) for p in filled]
    if len(set(keys[:len(prompts)])) == len(prompts):
        return filled, None
    shared = _share(keys, data_parallel)
    if shared is None:
        return filled, None
    return [filled[r] for r in shared[0]], shared[1]


def cache_length(prompt_len: int, max_new_tokens: int) -> int:
    """The cache a call holds: its prompt bucket plus the new tokens, rounded up to 64."""
    return -(-(prompt_len + max_new_tokens) // 64) * 64


def sample(logits: jax.Array, keys: jax.Array, step: jax.Array, knobs: dict[str, jax.Array], greedy: bool,
           vocab_size: int) -> tuple[jax.Array, jax.Array]:
    """Next tokens [b] and their log-probabilities [b] from fp32 logits [b, V] (padded vocabulary
    rows never drawn); row i draws with ``fold_in(keys[i], step)``. ``knobs`` (traced, so a new
    setting compiles nothing): ``temperature``, ``top_k`` (0: off), ``top_p`` (1: off)."""
    logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_size, logits, -jnp.inf)
    logp = log_softmax(logits)  # in the kernel's order under ``reproduce_decode_bits`` (RL's training forward's)
    if greedy:
        tok = _first_max(logits)
    else:
        z = logits / knobs["temperature"]

        def truncate(z: jax.Array) -> jax.Array:
            desc = -jnp.sort(-z, axis=-1)
            k = jnp.where(knobs["top_k"] > 0, jnp.minimum(knobs["top_k"], vocab_size), vocab_size)
            kth = jax.lax.dynamic_index_in_dim(desc, k - 1, axis=1)            # the k-th largest
            desc = jnp.where(desc < kth, -jnp.inf, desc)
            p = jax.nn.softmax(desc, axis=-1)
            before = jnp.cumsum(p, axis=-1) - p                                  # mass of the more likely tokens
            keep = (before < knobs["top_p"]) | (knobs["top_p"] >= 1)             # the smallest set reaching top_p
            smallest = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
            return jnp.where(z < jnp.maximum(kth, smallest), -jnp.inf, z)

        # Without top-k or top-p (RL's setting) the sort is skipped: it was most of a sampled step
        # on the CPU (180 of 230 ms at 32 rows x 16,384 tokens). Exact: with both off it keeps all.
        z = jax.lax.cond((knobs["top_k"] > 0) | (knobs["top_p"] < 1), truncate, lambda z: z, z)
        u = jax.vmap(lambda key: jax.random.uniform(jax.random.fold_in(key, step), (), z.dtype))(keys)
        tok = _inverse_cdf(z, u)
    tok = tok.astype(jnp.int32)
    return tok, jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]


def _inverse_cdf(z: jax.Array, u: jax.Array, block: int = 128) -> jax.Array:
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


def _first_max(s: jax.Array) -> jax.Array:
    """[b]: the first index of each row's maximum, as ``jnp.argmax``, but NaNs count as -inf
    (never chosen; a row of NaNs gives 0), found in two passes: on the CPU ``jnp.argmax`` took
    1.2 ms over 32 rows x 16,384 logits, the two passes 0.3 ms."""
    s = jnp.where(jnp.isnan(s), -jnp.inf, s)
    first = jnp.where(s == jnp.max(s, axis=-1, keepdims=True), jnp.arange(s.shape[-1]), s.shape[-1])
    return jnp.min(first, axis=-1)


def _knobs(s: Sampling) -> dict[str, jax.Array]:
    return {"temperature": jnp.float32(s.temperature or 1.0), "top_k": jnp.int32(s.top_k or 0),
            "top_p": jnp.float32(1.0 if s.top_p is None else s.top_p)}


def _on_mesh(fn: Callable, mesh: Mesh | None) -> Callable:
    """``fn`` traced with its activations (and the cache) pinned to ``mesh`` by logical axes."""
    def traced(*args, **kwargs):
        with activation_mesh(mesh):
            return fn(*args, **kwargs)
    return traced


class Generator:
    """The compiled prefill and decode-and-sample step of one model, and its prepared weights
    (``decode.prepare``). Sampling settings and seeds are runtime values: one program serves
    them all (greedy and sampled are two). With ``mesh``, the parameters are sharded as in
    training and the batch and cache as the training activations (rows over the data-parallel
    axes, kv heads over ``tensor``). ``sampling`` is the default for ``generate``. ``rows``: the
    batch rows it will mostly run, where known: the weights are then prepared in that batch's
    layout from the start, so the first batch relayouts nothing and a ``load`` (RL reloads the
    weights every step) runs a program already compiled."""

    def __init__(self, params: Any, cfg: ModelConfig, sampling: Sampling = Sampling(), mesh: Mesh | None = None,
                 rows: int | None = None):
        sampling.check()
        self.cfg, self.sampling, self.mesh = cfg, sampling, mesh
        self._prepare = jax.jit(_on_mesh(partial(prepare, cfg=cfg), mesh), static_argnames=("layout",))
        self._relayout = jax.jit(_on_mesh(partial(relayout, cfg=cfg), mesh), static_argnames=("layout",))
        self.prepared: dict | None = None
        self.load(params, layout="plain" if rows is None else self._wanted(rows))
        self._prefill = jax.jit(_on_mesh(self._prefill_and_sample, mesh), static_argnames=("max_length", "greedy"))
        self._decode = jax.jit(_on_mesh(self._decode_and_sample, mesh), static_argnames=("max_length", "greedy"),
                               donate_argnums=(2,))

    def load(self, params: Any, layout: str | None = None) -> None:
        """Decode with these weights from now on (RL: the trainer's, after each update); the
        compiled programs are kept, and so is the layout of the weights (``weights``) unless
        ``layout`` names another."""
        if self.mesh is not None:
            params = jax.device_put(params, param_shardings(logical_axes(self.cfg), self.mesh))
        layout = layout or layout_of(self.prepared)
        self.prepared = None  # the previous weights' prepared copy goes before the next is made
        self.prepared = self._prepare(params, layout=layout)

    def _wanted(self, rows: int) -> str:
        return decode_layout(rows, self.cfg)

    def weights(self, rows: int) -> dict:
        """The prepared weights in the layout a batch of ``rows`` decodes fastest with
        (``dispatch.decode_layout``): one copy is kept, turned over when the batch size calls for another
        layout."""
        wanted = self._wanted(rows)
        if wanted != layout_of(self.prepared):
            self.prepared = self._relayout(self.prepared, layout=wanted)
        return self.prepared

    def _host_readable(self, tok: jax.Array, lp: jax.Array) -> tuple[jax.Array, jax.Array]:
        """The sampled tokens and their log-probs, which the host loop reads every step. On a
        mesh that spans processes each process holds only its own rows: the two [b] vectors are
        gathered onto every device (a few bytes per row), so that every process reads the whole
        batch and takes the same stop decisions. Elsewhere they are left as they are."""
        if self.mesh is None or jax.process_count() == 1:
            return tok, lp
        everywhere = NamedSharding(self.mesh, PartitionSpec())
        return tuple(jax.lax.with_sharding_constraint(a, everywhere) for a in (tok, lp))

    def _prefill_and_sample(self, prepared, tokens, lengths, seed, indices, knobs, max_length, greedy, source=None):
        logits, cache = prefill(prepared, tokens, lengths, self.cfg, max_length)
        if source is not None:  # the distinct prompts were prefilled: each row takes its prompt's cache
            logits, cache = expand_rows(logits, cache, source)
        keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(seed), i))(indices)
        with reproduce_decode_bits(layout_of(prepared) == "packed"):
            tok, lp = sample(logits, keys, jnp.int32(0), knobs, greedy, self.cfg.vocab_size)
        return (*self._host_readable(tok, lp), cache, keys)

    def _decode_and_sample(self, prepared, tok, cache, keys, step, knobs, max_length, greedy):
        logits, cache = decode_step(prepared, tok, cache, self.cfg, max_length)
        with reproduce_decode_bits(layout_of(prepared) == "packed"):
            tok, lp = sample(logits, keys, step, knobs, greedy, self.cfg.vocab_size)
        return (*self._host_readable(tok, lp), cache)

    def run(self, prompts: Sequence[Sequence[int]], indices: Sequence[int], rows: int, prompt_len: int,
            max_length: int, max_new_tokens: int, eos_ids: set[int], stop: Callable | None,
            on_token: Callable | None, sampling: Sampling | None = None) -> list[Completion]:
        """One batch: ``prompts`` (global ``indices``), padded to ``rows`` x ``prompt_len``."""
        sampling = sampling or self.sampling
        n = len(prompts)
        # Rows that repeat a prompt (a GRPO group) share its prefill (``prefill_rows``).
        filled, source = prefill_rows(prompts, rows, _data_parallel(self.mesh))
        tokens = np.zeros((len(filled), prompt_len), np.int32)
        lengths = np.zeros(len(filled), np.int32)
        for r, p in enumerate(filled):
            tokens[r, :len(p)], lengths[r] = p, len(p)
        idx = np.asarray([*indices, *[indices[0]] * (rows - n)], np.int32)
        if self.mesh is not None:  # from the host arrays, which every process holds whole
            tokens_d = jax.device_put(tokens, batch_sharding(self.mesh, 2))
            lengths_d, idx_d = (jax.device_put(a, batch_sharding(self.mesh, 1)) for a in (lengths, idx))
            source_d = None if source is None else jax.device_put(source, batch_sharding(self.mesh, 2))
        else:
            tokens_d, lengths_d, idx_d = jnp.asarray(tokens), jnp.asarray(lengths), jnp.asarray(idx)
            source_d = None if source is None else jnp.asarray(source)
        knobs, greedy = _knobs(sampling), sampling.greedy
        prepared = self.weights(rows)
        tok, lp, cache, keys = self._prefill(prepared, tokens_d, lengths_d, jnp.uint32(sampling.seed), idx_d,
                                             knobs, max_length=max_length, greedy=greedy, source=source_d)
        out = [Completion() for _ in range(n)]
        live = set(range(n))
        for step in range(max_new_tokens):
            # The next step is dispatched before this one's tokens are read, so the host's work
            # (copying tokens out, stop checks, streaming, the next dispatch) overlaps the device's
            # step instead of adding to it; when every row has stopped, that one step is wasted.
            ahead = None
            if step < max_new_tokens - 1:
                ahead = self._decode(prepared, tok, cache, keys, np.int32(step + 1), knobs,
                                     max_length=max_length, greedy=greedy)
            tok_h, lp_h = np.asarray(tok), np.asarray(lp)
            for r in sorted(live):
                c = out[r]
                c.token_ids.append(int(tok_h[r]))
                c.logprobs.append(float(lp_h[r]))
                if on_token is not None:
                    on_token(indices[r], int(tok_h[r]))
                if int(tok_h[r]) in eos_ids or (stop is not None and stop(indices[r], c.token_ids)):
                    c.finish_reason = "stop"
                    live.discard(r)
            if not live or ahead is None:
                break
            tok, lp, cache = ahead
        return out


def generate(params: Any, cfg: ModelConfig, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
             sampling: Sampling | None = None, eos_ids: Iterable[int] = (), batch_size: int = 8,
             stop: Callable[[int, list[int]], bool] | None = None,
             on_token: Callable[[int, int], None] | None = None,
             generator: Generator | None = None, mesh: Mesh | None = None) -> list[Completion]:
    """Complete each prompt (a list of token ids) with up to ``max_new_tokens`` tokens, in
    batches of ``batch_size``; results in prompt order. ``stop(prompt_index, generated_ids)``
    is asked after each token (stop strings); ``on_token(prompt_index, token_id)`` sees each
    token as it is made (streaming). ``sampling`` defaults to the generator's (greedy). Pass a
    ``Generator`` to reuse its compiled functions and prepared weights (its mesh then applies),
    or ``mesh`` to shard the run (``Generator``)."""
    prompts = [list(p) for p in prompts]
    if max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    for i, p in enumerate(prompts):
        if not p:
            raise ValueError(f"prompt {i} is empty: decoding needs at least one token")
        bad = [t for t in p if not 0 <= int(t) < cfg.vocab_size]
        if bad:
            raise ValueError(f"prompt {i} has token ids outside the vocabulary [0, {cfg.vocab_size}): {bad[:5]}")
    if not prompts:
        return []
    if sampling is not None:
        sampling.check()
    mesh = generator.mesh if generator is not None else mesh
    rows = call_rows(len(prompts), batch_size, mesh)
    gen = generator or Generator(params, cfg, sampling or Sampling(), mesh, rows=rows)
    sampling = sampling or gen.sampling
    prompt_len = prompt_bucket(max(len(p) for p in prompts), cfg, gen.mesh)
    max_length = cache_length(prompt_len, max_new_tokens)
    eos = {int(e) for e in eos_ids}
    results: list[Completion] = []
    for start in range(0, len(prompts), rows):
        chunk = prompts[start:start + rows]
        results += gen.run(chunk, list(range(start, start + len(chunk))), rows, prompt_len, max_length,
                           max_new_tokens, eos, stop, on_token, sampling)
    return results
