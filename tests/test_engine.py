"""The continuous-batching engine (``olmax.engine.continuous``) against the static one: the same
completions (token ids and log-probs, bit for bit) whatever the slots, the chunk of decode steps
per round trip or the other requests in flight; per-request settings, cancels, top log-probs,
bad requests, and the slot utilisation it is for."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_decode import TINY

from olmax.engine import Engine, Request, Sampling, decoder, generate
from olmax.model.params import init_params

SETTINGS = [Sampling(), Sampling(temperature=1.0, seed=5), Sampling(temperature=0.8, top_k=20, top_p=0.9, seed=1)]


@pytest.fixture(scope="module")
def params():
    return init_params(TINY, jax.random.key(0))


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(1, 100, size=int(rng.integers(3, 30)))] for _ in range(n)]


def _same(a, b) -> None:
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert [c.logprobs for c in a] == [c.logprobs for c in b]   # to the bit
    assert [c.finish_reason for c in a] == [c.finish_reason for c in b]


@pytest.mark.parametrize("window", [8, pytest.param(64, marks=pytest.mark.integration)])
@pytest.mark.parametrize("sampling", [SETTINGS[0], pytest.param(SETTINGS[1], marks=pytest.mark.integration)],
                         ids=["greedy", "sampled"])
def test_continuous_equals_static(params, sampling: Sampling, window: int) -> None:
    """13 prompts of mixed lengths on 4 slots, EOS ids and a stop rule that ends rows at
    different lengths (slots reused by shorter prompts): every completion of the continuous
    engine is the static engine's. Sliding windows shorter (8) and longer (64) than the prompt
    buckets: an admitted prompt's ring of keys is either the window's or the prompt's first slots."""
    cfg = replace(TINY, sliding_window=window)
    prompts = _prompts(13)
    targets = [5 + (7 * i) % 31 for i in range(len(prompts))]

    def stop(i: int, ids: list[int]) -> bool:
        return len(ids) >= targets[i]

    kw = dict(max_new_tokens=32, sampling=sampling, eos_ids=[7, 11], batch_size=4, stop=stop)
    static = generate(params, cfg, prompts, batching="static", **kw)
    continuous = generate(params, cfg, prompts, batching="continuous", chunk=5, **kw)
    _same(static, continuous)
    assert {c.finish_reason for c in static} >= {"stop"}


@pytest.mark.integration
def test_prefilling_ahead_changes_no_completion(params) -> None:
    """With 2 slots and 10 waiting prompts, a prefill also takes the next waiting prompts (up to
    ``prefill_ahead``): fewer prefill calls, the same completions, to the bit."""
    prompts = [p[:12] for p in _prompts(10, seed=2) if len(p) >= 12][:6] * 2   # one bucket, each twice
    got, calls = {}, {}
    for ahead in (0, 4):
        engine = decoder(params, TINY, "continuous", rows=2)
        engine.prefill_ahead = ahead
        got[ahead] = generate(params, TINY, prompts, max_new_tokens=6, batch_size=2, generator=engine,
                              sampling=SETTINGS[1], stop=lambda i, ids: len(ids) >= 2 + i % 5)
        calls[ahead] = engine.stats.prefill_blocks
    _same(got[0], got[4])
    assert calls[4] < calls[0], calls


@pytest.mark.integration
@pytest.mark.parametrize("chunk", [1, 3, 16])
@pytest.mark.parametrize("sampling", SETTINGS, ids=["greedy", "sampled", "top-k-p"])
def test_continuous_equals_static_at_every_chunk(params, sampling: Sampling, chunk: int) -> None:
    prompts = _prompts(11, seed=1)
    kw = dict(max_new_tokens=24, sampling=sampling, eos_ids=[3, 9, 27], batch_size=4)
    _same(generate(params, TINY, prompts, batching="static", **kw),
          generate(params, TINY, prompts, batching="continuous", chunk=chunk, **kw))


@pytest.mark.integration
def test_a_request_does_not_depend_on_the_others(params) -> None:
    """Requests with their own settings (greedy, sampled, top-k/top-p, seeds, budgets, EOS) share
    slots; each completion equals the same request run alone on the same engine, and a
    stream's tokens (``on_token``) are its completion's, in order."""
    engine = Engine(params, TINY, slots=4, max_length=128, chunk=4)
    prompts = _prompts(7, seed=2)
    seen: dict[int, list[int]] = {}

    def request(i: int, stream: bool = False) -> Request:
        return Request(prompts[i], max_new_tokens=6 + 5 * i, sampling=SETTINGS[i % 3], index=i,
                       eos_ids=frozenset({i + 10}),
                       on_token=(lambda t, lp, i=i: seen.setdefault(i, []).append(t)) if stream else None)
    together = engine.run([request(i, stream=True) for i in range(len(prompts))])
    for i in range(len(prompts)):
        (alone,) = engine.run([request(i)])
        _same([alone], [together[i]])
        assert seen[i] == together[i].token_ids
    assert not engine.busy()


@pytest.mark.integration
def test_cancel_frees_the_slot_and_leaves_the_others(params) -> None:
    engine = Engine(params, TINY, slots=2, max_length=128, chunk=2)
    prompts = _prompts(3, seed=3)
    finished = {}
    reqs = [Request(p, max_new_tokens=40, index=i, on_finish=lambda c, i=i: finished.setdefault(i, c))
            for i, p in enumerate(prompts)]
    ids = [engine.submit(r) for r in reqs]
    engine.step()
    engine.cancel(ids[0])
    engine.cancel(ids[2])   # still waiting: never runs
    done = {}
    while engine.busy():
        done.update(engine.step())
    assert done[ids[0]].finish_reason == finished[0].finish_reason == "cancelled"
    assert done[ids[2]].finish_reason == "cancelled" and done[ids[2]].token_ids == []
    (alone,) = Engine(params, TINY, slots=2, max_length=128, chunk=2).run([reqs[1]])
    _same([done[ids[1]]], [alone])
    assert 0 < len(done[ids[0]].token_ids) < 40


def test_top_logprobs_hold_the_sampled_token_and_are_sorted(params) -> None:
    engine = Engine(params, TINY, slots=2, max_length=64, chunk=3)
    (c,) = engine.run([Request(_prompts(1)[0], max_new_tokens=7, top_logprobs=5)])
    assert len(c.top_logprobs) == len(c.token_ids) == 7
    for tok, lp, top in zip(c.token_ids, c.logprobs, c.top_logprobs):
        assert len(top) == 5 and top[0] == (tok, lp)          # greedy: the most likely token
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)


def test_bad_requests_are_refused_before_they_run(params) -> None:
    engine = Engine(params, TINY, slots=2, max_length=64)
    for req, match in [(Request([], 4), "empty"), (Request([1, 100], 4), "outside the vocabulary"),
                       (Request([1], 0), "max_new_tokens"), (Request([1] * 60, 8), "past the engine's 64"),
                       (Request([1], 4, Sampling(temperature=1e9)), "temperature"),
                       (Request([1], 4, Sampling(temperature=1.0, top_p=0.0)), "top_p"),
                       (Request([1], 4, top_logprobs=21), "top_logprobs"),
                       (Request([1], 4, eos_ids=frozenset(range(9))), "end-of-sequence")]:
        with pytest.raises(ValueError, match=match):
            engine.submit(req)
    assert not engine.busy()
    with pytest.raises(ValueError, match="slots"):
        Engine(params, TINY, slots=0, max_length=64)
    with pytest.raises(ValueError, match="prefill_tokens"):
        Engine(params, TINY, slots=2, max_length=64, prefill_tokens=0)
    engine = Engine(params, TINY, slots=2, max_length=64, prefill_tokens=64)
    for bad in (0, -5, 2.5, True, "64"):  # the bound may change between runs, never to nonsense
        with pytest.raises(ValueError, match="prefill_tokens"):
            engine.prefill_tokens = bad
    assert engine.prefill_tokens == 64
    engine.prefill_tokens = None
    assert engine.prefill_tokens is None
    from olmax.config import ConfigError
    from olmax.engine import decoder
    with pytest.raises(ConfigError, match="not the static engine's"):  # no such bound: refused, not ignored
        decoder(params, TINY, "static", rows=2, prefill_tokens=64)


@pytest.mark.integration
def test_a_prefill_bound_spreads_prompts_over_round_trips(params) -> None:
    """``prefill_tokens``: no round trip prefills more prompt tokens than the bound (one prompt of
    32 tokens, or two of 16, at 32), the prompts past it waiting while admitted rows decode; every
    completion is the unbounded engine's, to the bit."""
    prompts = _prompts(10, seed=5)
    reqs = [Request(p, max_new_tokens=6 + i, index=i, sampling=SETTINGS[1], eos_ids=frozenset({7}))
            for i, p in enumerate(prompts)]
    got, trips = {}, {}
    for bound in (None, 32):
        engine = Engine(params, TINY, slots=4, max_length=96, chunk=4, prefill_tokens=bound)
        ids = [engine.submit(r) for r in reqs]
        done, trips[bound] = {}, []   # per round trip: the token positions it prefilled
        while engine.busy():
            before = engine.stats.prefilled_tokens
            done.update(engine.step())
            trips[bound].append(engine.stats.prefilled_tokens - before)
        got[bound] = [done[i] for i in ids]
    _same(got[None], got[32])
    assert max(trips[None]) > 32 >= max(trips[32]), trips
    assert sum(t > 0 for t in trips[32]) > sum(t > 0 for t in trips[None])


@pytest.mark.integration
def test_continuous_batching_keeps_the_slots_busy(params) -> None:
    """Rows that end at very different lengths (a stop rule): the static engine's slots idle while
    its batches' longest rows finish, the continuous engine's are refilled."""
    prompts = _prompts(24, seed=4)
    targets = [4 if i % 4 else 40 for i in range(len(prompts))]
    stats = {}
    for batching in ("static", "continuous"):
        engine = decoder(params, TINY, batching, rows=4)
        generate(params, TINY, prompts, max_new_tokens=40, batch_size=4, generator=engine,
                 stop=lambda i, ids: len(ids) >= targets[i])
        stats[batching] = engine.stats.slot_utilisation
    assert stats["static"] < 0.5 < 0.75 < stats["continuous"], stats


@pytest.mark.integration
def test_continuous_engine_on_a_mesh_equals_one_device() -> None:
    """On 4 CPU devices (slots over fsdp, 2 per shard) with more requests than slots, GRPO-like
    groups that share a prompt and rows of different lengths (slots refilled on every shard):
    the completions equal the one-device engine's (tokens; log-probs to the bit where olmax's
    CPU kernels decode, else to fp32 rounding), with and without prefilling ahead, and a group's
    prompt is prefilled once per shard its rows land on, not once per row."""
    code = textwrap.dedent("""
        import json, jax
        from olmax.config import MeshConfig
        from olmax.engine import Engine, Request, Sampling
        from olmax.kernels import cpu as cpu_kernels
        from olmax.model.params import init_params
        from olmax.sharding import make_mesh
        from test_decode import TINY
        params = init_params(TINY, jax.random.key(0))
        prompts = [[5, 6, 7, 8, 9, 10, 11], [3, 4], list(range(2, 30)), [9] * 20]
        reqs = lambda: [Request(prompts[i % 4], max_new_tokens=4 + (5 * i) % 17, index=i,
                                sampling=Sampling(temperature=1.0, seed=3), eos_ids=frozenset({17}))
                        for i in range(14)]
        one = Engine(params, TINY, slots=8, max_length=64, chunk=3).run(reqs())
        mesh = make_mesh(MeshConfig(fsdp=4))
        out = {"kernel": cpu_kernels.available()}
        for ahead in (0, 4):
            engine = Engine(params, TINY, slots=8, max_length=64, chunk=3, mesh=mesh, prefill_ahead=ahead)
            got = engine.run(reqs())
            out[ahead] = {"same": [a.token_ids == b.token_ids for a, b in zip(one, got)],
                          "lp": max(abs(p - q) for a, b in zip(one, got) for p, q in zip(a.logprobs, b.logprobs)),
                          "prefills": engine.stats.prefills}
        print(json.dumps(out))
    """)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.path.dirname(__file__)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    for ahead in ("0", "4"):
        assert out[ahead]["same"] == [True] * 14, out
        assert out[ahead]["lp"] == 0.0 if out["kernel"] else out[ahead]["lp"] <= 1e-5, out
    assert out["0"]["prefills"] < 14, out   # 4 prompts, each on at most a few shards


def test_slot_utilisation_counts_kept_tokens_per_slot_step_and_is_1_before_any_step() -> None:
    """The engine's figure and the RL rollout's agree where nothing was decoded (a call of
    --max-new-tokens 1 ends at prefill): no slot idled, so 1, not 0."""
    from olmax.engine.continuous import EngineStats
    assert EngineStats().slot_utilisation == 1.0
    assert EngineStats(decode_steps=10, slot_steps=40, decoded=30).slot_utilisation == 0.75


def test_a_rows_log_probs_do_not_depend_on_the_batch_size() -> None:
    """The sampler's log-probabilities of a row, in the CPU kernels' arithmetic (the decode steps'),
    are the same bits at every batch size: XLA CPU's log gave some rows of a batch of 3 (or 5, 6,
    7) another last bit than alone, so ``olmax generate --batch-size 3`` reported log-probs up to
    2.4e-7 off ``--batch-size 1``'s (``dispatch.row_log``; 15 of these 60 rows differed)."""
    from olmax.engine.sampling import knobs, row_keys, sample
    from olmax.kernels import cpu
    from olmax.model.dispatch import reproduce_decode_bits
    if not cpu.available():
        pytest.skip("olmax's CPU kernels are not built here: the decode steps' bits are XLA's")
    vocab, padded, n = 100, 128, 60
    logits = np.random.default_rng(0).normal(size=(n, padded)).astype(np.float32) * 4

    @jax.jit
    def run(x, index):  # row r draws with index[r]
        b = x.shape[0]
        with reproduce_decode_bits(True):
            return sample(x, row_keys(jnp.full((b,), 5, jnp.uint32), index), jnp.int32(0),
                          {k: jnp.asarray(v) for k, v in knobs([SETTINGS[2]] * b).items()}, False, vocab)

    def rows(b: int) -> list[np.ndarray]:
        parts = [run(jnp.asarray(logits[i:i + b]), jnp.arange(i, i + b)) for i in range(0, n, b)]
        return [np.concatenate([np.asarray(p[k]) for p in parts]) for k in range(3)]

    alone = rows(1)
    for b in (3, 5, 6):
        tok, lp, logp = rows(b)
        assert np.array_equal(tok, alone[0]) and np.array_equal(lp, alone[1]), b
        assert np.array_equal(logp[:, :vocab], alone[2][:, :vocab]), b


@pytest.mark.integration
def test_log_probs_are_the_same_bits_at_batch_sizes_1_3_8_in_both_engines(params) -> None:
    """The probe's case: 8 prompts sampled with top-k, top-p and a temperature give the same
    tokens and log-probs, to the bit, at batch sizes 1, 3 and 8 in either engine (on the CPU
    with olmax's kernels: elsewhere the decode steps' arithmetic is XLA's)."""
    from olmax.kernels import cpu
    if not cpu.available():
        pytest.skip("olmax's CPU kernels are not built here")
    prompts = _prompts(8, seed=6)
    kw = dict(max_new_tokens=24, sampling=SETTINGS[2], eos_ids=[3])
    ref = generate(params, TINY, prompts, batching="static", batch_size=1, **kw)
    for batching in ("static", "continuous"):
        for batch in (1, 3, 8):
            _same(ref, generate(params, TINY, prompts, batching=batching, batch_size=batch, **kw))


@pytest.mark.parametrize("batching", ["static", "continuous"])
def test_non_finite_logits_end_the_completion_naming_the_step(params, batching: str) -> None:
    """Finite weights whose forward is not: one token's embedding 1e30 times larger (OLMo 3
    normalises each block's output, not the residual its MLP reads, so the MLP's product overflows
    wherever that token is read). The token is the first greedy token of a prompt: generating from
    that prompt stops at decode step 1, a prompt holding the token at the prefill (step 0). Neither
    gives a token or a log-probability from non-finite logits, the other prompts' completions are
    untouched, and ``generate`` raises naming the prompt and the step. One engine (one compile):
    its weights are swapped as RL swaps them."""
    from olmax.engine import NonFiniteLogits
    engine = decoder(params, TINY, batching, rows=4)
    fine, other, overflow = [9, 10, 11], [12, 13], [5, 6, 7, 8]
    kw = dict(max_new_tokens=4, generator=engine)
    good = generate(params, TINY, [fine, other, overflow], **kw)
    token = good[2].token_ids[0]
    bad = {**params, "embed": params["embed"].at[token].multiply(1e30)}
    assert all(bool(jnp.isfinite(a).all()) for a in jax.tree.leaves(bad))
    engine.load(bad)
    with pytest.raises(NonFiniteLogits, match=r"prompt 2: .* not finite .* generation step 1 \(decode step 1\)"):
        generate(bad, TINY, [fine, other, overflow], **kw)
    with pytest.raises(NonFiniteLogits, match=r"prompt 1: .* generation step 0 \(the prefill\)") as e:
        generate(bad, TINY, [fine, [*other, token], other], **kw)
    assert e.value.prompt == 1
    # Prompts whose completions never read the token: the same bits as from the unbroken weights.
    assert token not in fine + other and token not in {t for c in good[:2] for t in c.token_ids[:-1]}
    ok = generate(bad, TINY, [fine, other, other], **kw)
    assert [(c.token_ids, c.logprobs) for c in ok[:2]] == [(c.token_ids, c.logprobs) for c in good[:2]]
    if batching == "continuous":  # the server's path: per request, with top log-probs
        got = engine.run([Request(overflow, 4, top_logprobs=3), Request([*other, token], 4), Request(fine, 4)])
        assert [(c.token_ids, c.finish_reason) for c in got[:2]] == [([token], "error"), ([], "error")]
        assert "step 1" in got[0].error and "step 0" in got[1].error and len(got[0].top_logprobs) == 1
        assert got[2].error is None and all(np.isfinite(got[2].logprobs))
