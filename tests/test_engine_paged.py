"""The continuous engine over a paged KV cache against the contiguous one: the same completions
(token ids and log-probs, to the bit on the CPU), greedy and sampled, with shared prompt pages,
with preemption, with a prefix cache; streaming that never repeats a token; bad settings."""

from __future__ import annotations

import jax
import pytest
from test_decode import TINY
from test_engine import _prompts, _same

from olmax.config import ConfigError
from olmax.engine import Engine, Request, Sampling, generate
from olmax.model.decode import cache_bytes, page_bytes, row_bytes
from olmax.model.params import init_params


@pytest.fixture(scope="module")
def params():
    return init_params(TINY, jax.random.key(0))


def _run(params, engine: Engine, rows, sampling: Sampling, streamed=None):
    targets = [4 + (11 * i) % 30 for i in range(len(rows))]

    def stop(i: int, ids: list[int]) -> bool:
        return len(ids) >= targets[i]

    def on_token(i: int, t: int) -> None:
        streamed.setdefault(i, []).append(t)
    return generate(params, TINY, rows, max_new_tokens=32, sampling=sampling, eos_ids=[7], batch_size=engine.slots,
                    stop=stop, generator=engine, chunk=4, on_token=None if streamed is None else on_token)


SAMPLED = pytest.param(Sampling(temperature=1.0, seed=5), marks=pytest.mark.integration)


@pytest.mark.parametrize("sampling", [Sampling(), SAMPLED], ids=["greedy", "sampled"])
def test_paged_equals_contiguous_with_shared_prompts_and_preemption(params, sampling: Sampling) -> None:
    """Four prompts x a group of three on 8 slots: the contiguous cache, and a paged one whose
    budget holds one row at full length and a few pages more (so rows wait for pages and the
    youngest are preempted and recomputed). The same completions to the bit; each group's whole prompt pages
    stored once; streamed tokens each once, in order."""
    rows = [p for p in _prompts(4, seed=3) for _ in range(3)]
    contiguous = _run(params, Engine(params, TINY, slots=8, max_length=64), rows, sampling)
    # The call's cache is 64 positions (a prompt bucket of 32 and 32 new tokens).
    budget = 8 * row_bytes(TINY, 64, "float32") + (1 + 64 // 8 + 3) * page_bytes(TINY, 8, "float32")
    engine = Engine(params, TINY, slots=8, max_length=64, kv_cache="paged", page_size=8, kv_budget=budget)
    streamed: dict[int, list[int]] = {}
    paged = _run(params, engine, rows, sampling, streamed)
    _same(contiguous, paged)
    assert streamed == {i: c.token_ids for i, c in enumerate(paged)}
    assert engine.stats.preemptions > 0
    assert engine.stats.shared_prompt_tokens > 0
    report = engine.kv_report()
    assert report["kv_bytes_peak"] <= report["kv_bytes_reserved"] <= budget
    assert report["preemptions"] == engine.stats.preemptions


def test_a_group_stores_its_prompt_once(params) -> None:
    """Eight rows of one 20-token prompt (pages of 4): the other seven rows find its five whole pages."""
    prompt = _prompts(1, seed=9)[0][:3] * 7
    prompt = prompt[:20]
    engine = Engine(params, TINY, slots=8, max_length=64, kv_cache="paged", page_size=4)
    out = generate(params, TINY, [prompt] * 8, max_new_tokens=6, sampling=Sampling(temperature=1.0, seed=1),
                   batch_size=8, generator=engine)
    assert engine.stats.shared_prompt_tokens == 7 * 20
    contiguous = generate(params, TINY, [prompt] * 8, max_new_tokens=6, sampling=Sampling(temperature=1.0, seed=1),
                          batch_size=8)
    _same(contiguous, out)


def test_a_prefix_cache_reuses_a_system_prompt_exactly(params) -> None:
    """The server's engine (each prompt at its own bucket): requests that begin with the same 16
    tokens, one after the other; the later ones find the first's pages cached and complete as a
    contiguous engine does, to the bit."""
    system = list(range(40, 56))
    prompts = [system + tail for tail in ([3, 4, 5], [9, 8], [1, 2, 3, 4, 5, 6, 7])]
    want = [Engine(params, TINY, slots=2, max_length=64).run([Request(p, 8, index=i)])[0]
            for i, p in enumerate(prompts)]
    engine = Engine(params, TINY, slots=2, max_length=64, kv_cache="paged", page_size=8, prefix_cache=True)
    got = [engine.run([Request(p, 8, index=i)])[0] for i, p in enumerate(prompts)]
    _same(want, got)
    assert engine.stats.shared_prompt_tokens == 2 * 16


def test_bad_paged_settings_are_refused_naming_them(params) -> None:
    with pytest.raises(ValueError, match="kv_cache must be one of contiguous, paged, got 'ring'"):
        Engine(params, TINY, slots=2, max_length=64, kv_cache="ring")
    with pytest.raises(ConfigError, match="page size 48 must be a positive power of two"):
        Engine(params, TINY, slots=2, max_length=64, kv_cache="paged", page_size=48)
    with pytest.raises(ConfigError, match="page size 128 does not divide the cache's 64 positions"):
        Engine(params, TINY, slots=2, max_length=64, kv_cache="paged", page_size=128)
    with pytest.raises(ConfigError, match="cannot hold one sequence of 64 positions"):
        Engine(params, TINY, slots=2, max_length=64, kv_cache="paged", kv_budget=1000)
    with pytest.raises(ValueError, match="holds 1 contiguous rows of 64 positions, not 2"):
        Engine(params, TINY, slots=2, max_length=64, kv_budget=cache_bytes(TINY, 1, 64, "float32") + 10)


def test_bad_rl_kv_settings_are_refused_naming_the_key() -> None:
    from olmax.recipes import get_recipe
    for override, msg in (("rl.kv_cache=ring", "rl.kv_cache must be 'contiguous' or 'paged'"),
                          ("rl.page_size=12", "rl.page_size must be a positive power of two"),
                          ("rl.kv_budget=lots", "rl.kv_budget: kv budget 'lots' is neither a size"),
                          ("rl.kv_budget=1.5", "rl.kv_budget: kv budget 1.5 as a fraction")):
        with pytest.raises(ConfigError, match=msg):
            get_recipe("tiny_rl", [override])
    with pytest.raises(ConfigError, match="rl.kv_cache=paged pages the continuous engine's cache"):
        get_recipe("tiny_rl", ["rl.kv_cache=paged", "rl.batching=static"])
