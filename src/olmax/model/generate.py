"""Sampling loop over the KV cache (``olmax.model.decode``): greedy or temperature / top-k /
top-p sampling, EOS and caller-defined stops, per-token log-probabilities.

Shapes are bucketed so a run compiles once per (batch rows, prompt bucket, cache length):
prompts are right-padded to a power of two (at least 16; 128 for splash attention) that fits the longest prompt of the
whole call, the cache holds that plus ``max_new_tokens`` rounded up to 64, and a short last
batch is padded with copies of its first prompt. Sampling draws from a key per prompt (the seed
folded with the prompt's index, then with the step), so a prompt's tokens do not depend on the
batch it ran in.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from olmax.config import ModelConfig
from olmax.model.attention import resolve_impl
from olmax.model.decode import decode_step, prefill, prepare
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
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k is not None and self.top_k < 1:
            raise ValueError(f"top_k must be >= 1, got {self.top_k}")


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


def sample(logits: jax.Array, keys: jax.Array, step: jax.Array, sampling: Sampling, vocab_size: int
           ) -> tuple[jax.Array, jax.Array]:
    """Next tokens [b] and their log-probabilities [b] from fp32 logits [b, V] (padded vocabulary
    rows never drawn); row i draws with ``fold_in(keys[i], step)``."""
    logits = jnp.where(jnp.arange(logits.shape[-1]) < vocab_size, logits, -jnp.inf)
    logp = jax.nn.log_softmax(logits, axis=-1)
    if sampling.greedy:
        tok = jnp.argmax(logits, axis=-1)
    else:
        z = logits / sampling.temperature
        if sampling.top_k is not None and sampling.top_k < vocab_size:
            kth = jax.lax.top_k(z, sampling.top_k)[0][:, -1:]
            z = jnp.where(z < kth, -jnp.inf, z)
        if sampling.top_p is not None and sampling.top_p < 1:
            desc = -jnp.sort(-z, axis=-1)
            p = jax.nn.softmax(desc, axis=-1)
            before = jnp.cumsum(p, axis=-1) - p          # mass of the more likely tokens
            keep = before < sampling.top_p               # the smallest set reaching top_p (>= 1 token)
            smallest = jnp.min(jnp.where(keep, desc, jnp.inf), axis=-1, keepdims=True)
            z = jnp.where(z < smallest, -jnp.inf, z)
        tok = jax.vmap(lambda k, zi: jax.random.categorical(jax.random.fold_in(k, step), zi))(keys, z)
    tok = tok.astype(jnp.int32)
    return tok, jnp.take_along_axis(logp, tok[:, None], axis=-1)[:, 0]


def _on_mesh(fn: Callable, mesh: Mesh | None) -> Callable:
    """``fn`` traced with its activations (and the cache) pinned to ``mesh`` by logical axes."""
    def traced(*args, **kwargs):
        with activation_mesh(mesh):
            return fn(*args, **kwargs)
    return traced


class Generator:
    """The jitted prefill, decode and sampling functions of one model and sampling setting.
    With ``mesh``, the parameters are sharded as in training and the batch and cache as the
    training activations (rows over the data-parallel axes, kv heads over ``tensor``)."""

    def __init__(self, params: Any, cfg: ModelConfig, sampling: Sampling = Sampling(), mesh: Mesh | None = None):
        sampling.check()
        self.cfg, self.sampling, self.mesh = cfg, sampling, mesh
        if mesh is not None:
            params = jax.device_put(params, param_shardings(logical_axes(cfg), mesh))
        self.prepared = jax.jit(_on_mesh(partial(prepare, cfg=cfg), mesh))(params)
        self._prefill = jax.jit(_on_mesh(partial(prefill, cfg=cfg), mesh), static_argnames=("max_length",))
        self._decode = jax.jit(_on_mesh(partial(decode_step, cfg=cfg), mesh), static_argnames=("max_length",),
                               donate_argnums=(2,))
        self._sample = jax.jit(partial(sample, sampling=sampling, vocab_size=cfg.vocab_size))

    def run(self, prompts: Sequence[Sequence[int]], indices: Sequence[int], rows: int, prompt_len: int,
            max_length: int, max_new_tokens: int, eos_ids: set[int], stop: Callable | None,
            on_token: Callable | None) -> list[Completion]:
        """One batch: ``prompts`` (global ``indices``), padded to ``rows`` x ``prompt_len``."""
        n = len(prompts)
        tokens = np.zeros((rows, prompt_len), np.int32)
        lengths = np.zeros(rows, np.int32)
        for r in range(rows):
            p = prompts[r] if r < n else prompts[0]
            tokens[r, :len(p)], lengths[r] = p, len(p)
        base = jax.random.key(self.sampling.seed)
        keys = jax.vmap(lambda i: jax.random.fold_in(base, i))(jnp.asarray([*indices, *[indices[0]] * (rows - n)]))
        tokens_d, lengths_d = jnp.asarray(tokens), jnp.asarray(lengths)
        if self.mesh is not None:
            tokens_d = jax.device_put(tokens_d, batch_sharding(self.mesh, 2))
            lengths_d = jax.device_put(lengths_d, batch_sharding(self.mesh, 1))
        logits, cache = self._prefill(self.prepared, tokens_d, lengths_d, max_length=max_length)
        out = [Completion() for _ in range(n)]
        live = set(range(n))
        for step in range(max_new_tokens):
            tok, lp = self._sample(logits, keys, jnp.int32(step))
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
            if not live or step == max_new_tokens - 1:
                break
            logits, cache = self._decode(self.prepared, tok, cache, max_length=max_length)
        return out


def generate(params: Any, cfg: ModelConfig, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
             sampling: Sampling = Sampling(), eos_ids: Iterable[int] = (), batch_size: int = 8,
             stop: Callable[[int, list[int]], bool] | None = None,
             on_token: Callable[[int, int], None] | None = None,
             generator: Generator | None = None, mesh: Mesh | None = None) -> list[Completion]:
    """Complete each prompt (a list of token ids) with up to ``max_new_tokens`` tokens, in
    batches of ``batch_size``; results in prompt order. ``stop(prompt_index, generated_ids)``
    is asked after each token (stop strings); ``on_token(prompt_index, token_id)`` sees each
    token as it is made (streaming). Pass a ``Generator`` to reuse its compiled functions (its
    sampling and mesh then apply), or ``mesh`` to shard the run (``Generator``)."""
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
    gen = generator or Generator(params, cfg, sampling, mesh)
    with activation_mesh(gen.mesh):  # splash attention (TPU) tiles the prompt in blocks of 128 or more
        splash = resolve_impl(cfg.attention_impl, jnp.dtype(cfg.compute_dtype)) == "splash"
    prompt_len = _bucket(max(len(p) for p in prompts), lo=128 if splash else 16)
    max_length = -(-(prompt_len + max_new_tokens) // 64) * 64
    rows = min(batch_size, _bucket(len(prompts), lo=1))
    if gen.mesh is not None:  # whole rows per data-parallel shard
        dp = data_parallel_size(dict(gen.mesh.shape))
        rows = -(-rows // dp) * dp
    eos = {int(e) for e in eos_ids}
    results: list[Completion] = []
    for start in range(0, len(prompts), rows):
        chunk = prompts[start:start + rows]
        results += gen.run(chunk, list(range(start, start + len(chunk))), rows, prompt_len, max_length,
                           max_new_tokens, eos, stop, on_token)
    return results
