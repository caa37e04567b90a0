"""Generation: the engines that schedule the model's prefill and decode step (``olmax.model.decode``)
over row slots, sampling, stops and streaming; used by ``olmax generate``/``chat``, RL rollouts,
the lm-eval adapter and the server.

- ``continuous`` (the default): a fixed number of slots; a finished row's slot takes the next
  waiting prompt while the others decode on; several decode steps per host round trip.
- ``static``: a batch steps until its last row stops, one round trip per token (to compare with,
  and a fallback).

Both give the same completions (token ids and log-probs) for the same call. A row whose logits are
not finite (NaN or infinite: broken weights) ends there, in either engine, with finish reason
"error" and no token or log-probability from them; ``generate`` raises ``NonFiniteLogits``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from jax.sharding import Mesh

from olmax.config import ConfigError, ModelConfig
from olmax.engine.continuous import Engine, EngineStats, Request
from olmax.engine.paged import DEFAULT_PAGE_SIZE, KV_CACHES, parse_budget
from olmax.engine.sampling import MAX_TEMPERATURE, MAX_TOP_LOGPROBS, Completion, NonFiniteLogits, Sampling
from olmax.engine.shapes import cache_length, call_rows, prompt_bucket
from olmax.engine.static import Generator

BATCHING = ("continuous", "static")

__all__ = ["BATCHING", "DEFAULT_PAGE_SIZE", "KV_CACHES", "Completion", "Engine", "EngineStats",
           "Generator", "MAX_TEMPERATURE", "MAX_TOP_LOGPROBS", "NonFiniteLogits", "Request", "Sampling",
           "check_kv_cache", "check_prefill_bound", "decoder", "generate", "parse_budget"]


def check_kv_cache(batching: str, kv_cache: str) -> None:
    """Only the continuous engine pages its cache: a paged cache asked of the static engine is
    refused rather than ignored."""
    if kv_cache not in KV_CACHES:
        raise ConfigError(f"kv cache must be one of {', '.join(KV_CACHES)}, got {kv_cache!r}")
    if kv_cache == "paged" and batching != "continuous":
        raise ConfigError(f"--kv-cache paged pages the continuous engine's cache, not the {batching} engine's: "
                          f"drop --batching {batching}, or use --kv-cache contiguous")


def check_prefill_bound(batching: str, prefill_tokens: int | None) -> None:
    """Only the continuous engine bounds the prompt tokens a round trip prefills: a bound asked of
    the static engine is refused rather than ignored (``olmax generate``, ``olmax compile``)."""
    if prefill_tokens is not None and batching != "continuous":
        raise ConfigError(f"--prefill-tokens bounds the continuous engine's prefills, not the {batching} engine's: "
                          f"drop it, or drop --batching {batching}")


def decoder(params: Any, cfg: ModelConfig, batching: str = "continuous", *, rows: int, mesh: Mesh | None = None,
            sampling: Sampling = Sampling(), prefill_tokens: int | None = None, kv_cache: str = "contiguous",
            page_size: int = DEFAULT_PAGE_SIZE, kv_budget: int | None = None) -> Engine | Generator:
    """An engine of kind ``batching`` to reuse across ``generate`` calls (its compiled programs and
    prepared weights; ``load`` new weights into it), built for batches of ``rows``.
    ``prefill_tokens``: the continuous engine's bound on the prompt tokens a round trip prefills;
    ``kv_cache``, ``page_size``, ``kv_budget`` (bytes): its KV cache (``Engine``)."""
    if batching not in BATCHING:
        raise ValueError(f"batching must be one of {', '.join(BATCHING)}, got {batching!r}")
    check_prefill_bound(batching, prefill_tokens)
    check_kv_cache(batching, kv_cache)
    if batching == "static":
        return Generator(params, cfg, sampling, mesh, rows=rows)
    # Shapes are set by each ``generate`` call (``Engine.reset``); a placeholder until then.
    return Engine(params, cfg, slots=rows, max_length=max(64, page_size) if page_size >= 1 else 64, mesh=mesh,
                  prefill_tokens=prefill_tokens, kv_cache=kv_cache, page_size=page_size,
                  kv_budget=kv_budget)


def generate(params: Any, cfg: ModelConfig, prompts: Sequence[Sequence[int]], *, max_new_tokens: int,
             sampling: Sampling | None = None, eos_ids: Iterable[int] = (), batch_size: int = 8,
             stop: Callable[[int, list[int]], bool] | None = None,
             on_token: Callable[[int, int], None] | None = None,
             generator: Engine | Generator | None = None, mesh: Mesh | None = None,
             batching: str | None = None, chunk: int | None = None) -> list[Completion]:
    """Complete each prompt (a list of token ids) with up to ``max_new_tokens`` tokens, ``batch_size``
    rows at a time; results in prompt order. ``stop(prompt_index, generated_ids)`` is asked after
    each token (stop strings); ``on_token(prompt_index, token_id)`` sees each token as it is made
    (streaming). ``sampling`` defaults to greedy. Pass ``generator`` (``decoder``) to reuse its
    compiled programs and prepared weights (its mesh and kind then apply), or ``mesh`` to shard
    the run. ``batching``: "continuous" (default) or "static"; ``chunk``: decode steps per host
    round trip of the continuous engine (default: the platform's, ``dispatch.round_trip_steps``).
    ``NonFiniteLogits`` (a ValueError naming the prompt and the generation step) where the model's
    logits for a prompt were not finite."""
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
    if generator is not None:
        batching = "static" if isinstance(generator, Generator) else "continuous"
        mesh = generator.mesh
    batching = batching or "continuous"
    if batching not in BATCHING:
        raise ValueError(f"batching must be one of {', '.join(BATCHING)}, got {batching!r}")
    if sampling is None:
        sampling = generator.sampling if isinstance(generator, Generator) else Sampling()
    sampling.check()
    rows = call_rows(len(prompts), batch_size, mesh)
    prompt_len = prompt_bucket(max(len(p) for p in prompts), cfg, mesh)
    max_length = cache_length(prompt_len, max_new_tokens)
    eos = frozenset(int(e) for e in eos_ids)
    if batching == "static":
        gen = generator or Generator(params, cfg, sampling, mesh, rows=rows)
        results: list[Completion] = []
        for start in range(0, len(prompts), rows):
            part = prompts[start:start + rows]
            results += gen.run(part, list(range(start, start + len(part))), rows, prompt_len, max_length,
                               max_new_tokens, set(eos), stop, on_token, sampling)
        return _refuse_errors(results)
    engine = generator or Engine(params, cfg, slots=rows, max_length=max_length, mesh=mesh, chunk=chunk,
                                 prompt_len=prompt_len)
    engine.reset(slots=rows, max_length=max_length, chunk=chunk, prompt_len=prompt_len)

    def request(i: int, p: list[int]) -> Request:
        return Request(p, max_new_tokens, sampling, index=i, eos_ids=eos,
                       stop=None if stop is None else (lambda ids, i=i: stop(i, ids)),
                       on_token=None if on_token is None else (lambda t, _lp, i=i: on_token(i, t)))
    return _refuse_errors(engine.run([request(i, p) for i, p in enumerate(prompts)]))


def _refuse_errors(completions: list[Completion]) -> list[Completion]:
    bad = next((i for i, c in enumerate(completions) if c.error is not None), None)
    if bad is not None:
        raise NonFiniteLogits(bad, completions[bad].error)
    return completions
