"""The static engine: batches of rows over the KV cache (``olmax.model.decode``), each stepped until
its last row stops, one host round trip per token. Shapes as ``olmax.engine.shapes`` buckets them;
a short last batch is padded with copies of its first prompt. Sampling as ``olmax.engine.sampling``
draws (a completion does not depend on the batch it ran in).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from olmax.config import ModelConfig
from olmax.engine.continuous import EngineStats
from olmax.engine.sampling import Completion, Sampling, finite_rows, nonfinite_error, row_keys, sample
from olmax.engine.sampling import knobs as sampling_knobs
from olmax.engine.shapes import mesh_data_parallel, prefill_rows
from olmax.engine.weights import DecodeWeights, on_mesh
from olmax.model.decode import decode_step, expand_rows, layout_of, prefill
from olmax.model.dispatch import reproduce_decode_bits


class Generator:
    """The static engine: a batch of rows prefilled together and stepped, one decode step per
    host round trip, until its last row stops (kept to compare the continuous engine with, and as
    a fallback). The compiled prefill and decode-and-sample step of one model and its prepared
    weights (``DecodeWeights``). Sampling settings and seeds are runtime values: one program
    serves them all (greedy and sampled are two). With ``mesh``, the parameters are sharded as in
    training and the batch and cache as the training activations (rows over the data-parallel
    axes, kv heads over ``tensor``). ``sampling`` is the default for ``generate``; ``rows`` as
    ``DecodeWeights`` takes it."""

    def __init__(self, params: Any, cfg: ModelConfig, sampling: Sampling = Sampling(), mesh: Mesh | None = None,
                 rows: int | None = None):
        sampling.check()
        self.cfg, self.sampling, self.mesh = cfg, sampling, mesh
        self.weights = DecodeWeights(params, cfg, mesh, rows)
        self.stats = EngineStats()
        self._prefill = jax.jit(on_mesh(self._prefill_and_sample, mesh), static_argnames=("max_length", "greedy"))
        self._decode = jax.jit(on_mesh(self._decode_and_sample, mesh), static_argnames=("max_length", "greedy"),
                               donate_argnums=(2,))

    def load(self, params: Any) -> None:
        """Decode with these weights from now on (``DecodeWeights.load``)."""
        self.weights.load(params)

    def _prefill_and_sample(self, prepared, tokens, lengths, seed, indices, knobs, max_length, greedy, source=None):
        logits, cache = prefill(prepared, tokens, lengths, self.cfg, max_length)
        if source is not None:  # the distinct prompts were prefilled: each row takes its prompt's cache
            logits, cache = expand_rows(logits, cache, source)
        keys = row_keys(jnp.broadcast_to(seed, indices.shape), indices)
        with reproduce_decode_bits(layout_of(prepared) == "packed"):
            tok, lp, _ = sample(logits, keys, jnp.int32(0), knobs, greedy, self.cfg.vocab_size)
        return (*self.weights.host_readable(tok, lp, finite_rows(logits, self.cfg.vocab_size)), cache, keys)

    def _decode_and_sample(self, prepared, tok, cache, keys, step, knobs, max_length, greedy):
        logits, cache = decode_step(prepared, tok, cache, self.cfg, max_length)
        with reproduce_decode_bits(layout_of(prepared) == "packed"):
            tok, lp, _ = sample(logits, keys, step, knobs, greedy, self.cfg.vocab_size)
        return (*self.weights.host_readable(tok, lp, finite_rows(logits, self.cfg.vocab_size)), cache)

    def run(self, prompts: Sequence[Sequence[int]], indices: Sequence[int], rows: int, prompt_len: int,
            max_length: int, max_new_tokens: int, eos_ids: set[int], stop: Callable | None,
            on_token: Callable | None, sampling: Sampling | None = None) -> list[Completion]:
        """One batch: ``prompts`` (global ``indices``), padded to ``rows`` x ``prompt_len``."""
        sampling = sampling or self.sampling
        n = len(prompts)
        # Rows that repeat a prompt (a GRPO group) share its prefill (``prefill_rows``).
        filled, source = prefill_rows(prompts, rows, mesh_data_parallel(self.mesh))
        tokens = np.zeros((len(filled), prompt_len), np.int32)
        lengths = np.zeros(len(filled), np.int32)
        for r, p in enumerate(filled):
            tokens[r, :len(p)], lengths[r] = p, len(p)
        idx = np.asarray([*indices, *[indices[0]] * (rows - n)], np.int32)
        put = self.weights.put
        tokens_d, lengths_d, idx_d = put(tokens), put(lengths), put(idx)
        source_d = None if source is None else put(source)
        knobs, greedy = {k: put(v) for k, v in sampling_knobs([sampling] * rows).items()}, sampling.greedy
        prepared = self.weights(rows)
        self.stats.prefills += len(filled)
        self.stats.prefill_blocks += 1
        self.stats.prefilled_tokens += tokens.size
        tok, lp, ok, cache, keys = self._prefill(prepared, tokens_d, lengths_d, jnp.uint32(sampling.seed), idx_d,
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
                self.stats.decode_steps += 1
                self.stats.slot_steps += rows
            tok_h, lp_h, ok_h = np.asarray(tok), np.asarray(lp), np.asarray(ok)
            for r in sorted(live):
                c = out[r]
                if not ok_h[r]:  # non-finite logits: the row ends here, with no token from them
                    c.finish_reason, c.error = "error", nonfinite_error(step)
                    live.discard(r)
                    continue
                c.token_ids.append(int(tok_h[r]))
                c.logprobs.append(float(lp_h[r]))
                self.stats.decoded += step > 0  # the first token comes from the prefill
                if on_token is not None:
                    on_token(indices[r], int(tok_h[r]))
                if int(tok_h[r]) in eos_ids or (stop is not None and stop(indices[r], c.token_ids)):
                    c.finish_reason = "stop"
                    live.discard(r)
            self.stats.round_trips += 1
            if not live or ahead is None:
                break
            tok, lp, ok, cache = ahead
        return out

