"""The paged KV cache: the model's paged decode step against the contiguous one (the same bits on the
CPU), the page allocator (growth, freeing, shared prompt pages, preemption of the youngest, the
prefix cache) and bad settings. The engine's paged runs against its contiguous ones are
tests/test_engine_paged.py."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmax.config import ConfigError, ModelConfig
from olmax.engine.paged import PagePool, check_page_size, contiguous_rows, parse_budget, plan_growth, pool_pages
from olmax.model import dispatch
from olmax.model.decode import blank_cache, decode_step, paged_cache, prefill, prepare, write_rows
from olmax.model.params import init_params

# Two sliding layers and a full one (the last): both kinds of stack, the full one paged.
TINY = ModelConfig(vocab_size=100, padded_vocab_size=128, d_model=64, n_layers=3, n_heads=4, n_kv_heads=2,
                   head_dim=16, mlp_hidden=96, norm_eps=1e-6, rope_theta=10000.0, sliding_window=8,
                   max_position_embeddings=256, compute_dtype="float32", attention_impl="reference")


@pytest.fixture(scope="module")
def model():
    params = init_params(TINY, jax.random.key(0))
    return prepare(params, TINY, dispatch.decode_layout(4, TINY))


def _decode_both(prepared, cfg: ModelConfig, page_size: int, steps: int):
    """Three prompts (two rows share the first) prefilled once and written into a contiguous cache
    and a paged one (the shared prompt's whole pages written once), then ``steps`` greedy decode
    steps of each: their logits per step."""
    max_length, T = 32, 16
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 3, 4, 2, 9], [7, 3, 9, 4], [1, 2, 3]]
    prompts[0] = prompts[0][:T]
    lengths = np.asarray([len(p) for p in prompts], np.int32)
    tokens = np.zeros((len(prompts), T), np.int32)
    for r, p in enumerate(prompts):
        tokens[r, :len(p)] = p
    logits0, block = jax.jit(partial(prefill, cfg=cfg, max_length=T))(prepared, tokens, lengths)
    # Rows: 0 and 1 both take prompt 0, row 2 prompt 1, row 3 prompt 2.
    source = np.asarray([[0, 0, 1, 2]], np.int32)
    dest = np.asarray([[0, 1, 2, 3]], np.int32)
    n = max_length // page_size
    pool = 1 + 4 * n
    table = np.zeros((4, n), np.int32)
    nxt = 1
    for r in range(4):
        for i in range(n):
            table[r, i] = nxt
            nxt += 1
    whole = len(prompts[0]) // page_size  # prompt 0's whole pages: row 1 shares row 0's
    table[1, :whole] = table[0, :whole]
    tp = -(-T // page_size)
    pages = table[:, :tp].copy()
    pages[1, :whole] = pool  # written once, by row 0
    contiguous = write_rows(blank_cache(cfg, prepared, 4, max_length), block, source, dest)
    paged = write_rows({**paged_cache(cfg, prepared, 4, max_length, pool, page_size), "table": jnp.asarray(table)},
                       block, source, dest, jnp.asarray(pages)[None])
    step = jax.jit(partial(decode_step, cfg=cfg, max_length=max_length))
    tok = jnp.argmax(logits0[source[0]], axis=-1).astype(jnp.int32)
    out = []
    for _ in range(steps):
        a, contiguous = step(prepared, tok, contiguous)
        b, paged = step(prepared, tok, paged)
        out.append((np.asarray(a), np.asarray(b)))
        tok = jnp.argmax(a, axis=-1).astype(jnp.int32)
    return out


@pytest.mark.parametrize("page_size", [4, 16])
def test_paged_decode_steps_equal_contiguous_ones_bit_for_bit(model, page_size: int) -> None:
    """Past the sliding window (8) and across page boundaries, with a prompt's whole pages shared by
    two rows: every step's logits are the contiguous cache's, to the bit (CPU, olmax's kernel)."""
    for a, b in _decode_both(model, TINY, page_size, steps=12):
        np.testing.assert_array_equal(a, b)


def test_paged_steps_equal_contiguous_ones_in_xla_too() -> None:
    """The plain weight layout (no CPU kernel: XLA's ``cache_attention`` over the gathered pages)."""
    prepared = prepare(init_params(TINY, jax.random.key(0)), TINY, "plain")
    for a, b in _decode_both(prepared, TINY, 8, steps=10):
        np.testing.assert_array_equal(a, b)


def test_gather_pages_is_the_rows_in_page_order() -> None:
    pool = jnp.arange(2 * 5 * 4 * 3, dtype=jnp.float32).reshape(2, 5, 4, 3)  # kv 2, 5 pages of 4, e 3
    table = jnp.asarray([[3, 1], [0, 4]], jnp.int32)
    rows = np.asarray(dispatch.gather_pages(pool, table))
    want = np.stack([np.concatenate([np.asarray(pool)[:, p] for p in t], axis=1) for t in np.asarray(table)])
    if not dispatch.head_major_cache():
        want = want.transpose(0, 2, 1, 3)
    np.testing.assert_array_equal(rows, want)


def test_the_pallas_kernel_is_chosen_only_on_one_tpu_with_a_bf16_cache() -> None:
    assert dispatch.paged_attention_impl(jnp.bfloat16, "tpu") == "pallas"
    assert dispatch.paged_attention_impl(jnp.float32, "tpu") == "gather"
    assert dispatch.paged_attention_impl(jnp.bfloat16, "cpu") == "gather"
    assert dispatch.paged_attention_impl(jnp.bfloat16, "gpu") == "gather"
    assert dispatch.pages_per_block(1024, 16) == 32 and dispatch.pages_per_block(6, 128) == 3
    assert dispatch.pages_per_block(3, 1024) == 1


def test_a_page_size_that_does_not_divide_the_cache_is_refused(model) -> None:
    with pytest.raises(ValueError, match="page_size 24 does not divide the cache's 64 positions"):
        paged_cache(TINY, model, 2, 64, 9, 24)


def test_bf16_paged_steps_equal_contiguous_ones() -> None:
    cfg = replace(TINY, compute_dtype="bfloat16")
    prepared = prepare(init_params(cfg, jax.random.key(0)), cfg, dispatch.decode_layout(4, cfg))
    for a, b in _decode_both(prepared, cfg, 8, steps=4):
        np.testing.assert_array_equal(a, b)


def test_the_pallas_kernel_call_matches_the_gather(monkeypatch) -> None:
    """JAX's TPU paged-attention kernel as olmax calls it (scaled queries, lengths, the page table),
    run in Pallas' TPU interpret mode on the CPU with its pages read in fp32 (the kernel reads them
    in bf16, which XLA CPU's dot does not take): the gather's attention to fp32 rounding."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import tpu as pltpu
    try:
        import jax.experimental.pallas.ops.tpu.paged_attention.paged_attention_kernel as kernel
        load = kernel.MultiPageAsyncCopyDescriptor._maybe_dequantize
    except (ImportError, AttributeError):
        pytest.skip("this JAX's paged-attention kernel is laid out otherwise")
    interpreted = type("pl", (), {k: getattr(pl, k) for k in dir(pl) if not k.startswith("__")})
    interpreted.pallas_call = partial(pl.pallas_call, interpret=pltpu.InterpretParams())
    monkeypatch.setattr(kernel, "pl", interpreted)
    monkeypatch.setattr(kernel.MultiPageAsyncCopyDescriptor, "_maybe_dequantize",
                        lambda self, x, s, dtype=None: load(self, x, s, jnp.float32))
    b, h, kv, e, pool, ps, n = 3, 4, 2, 128, 13, 16, 4
    r = np.random.default_rng(0)
    q = jnp.asarray(r.normal(size=(b, 1, h, e)), jnp.float32)
    k, v = (jnp.asarray(r.normal(size=(kv, pool, ps, e)), jnp.float32) for _ in range(2))
    table = jnp.asarray(r.permutation(np.arange(1, pool))[:b * n].reshape(b, n), jnp.int32)
    q_pos = jnp.asarray([[5], [33], [63]], jnp.int32)
    k_pos = jnp.where(jnp.arange(n * ps)[None] <= q_pos, jnp.arange(n * ps)[None], -1)
    gathered = dispatch.paged_cache_attention(q, k, v, table, q_pos, k_pos, False)
    monkeypatch.setattr(dispatch, "paged_attention_impl", lambda *a, **kw: "pallas")
    pallas = dispatch.paged_cache_attention(q, k, v, table, q_pos, k_pos, False)
    np.testing.assert_allclose(np.asarray(pallas), np.asarray(gathered), atol=2e-6)


# --------------------------------------------------------------------------- the page allocator



def test_a_row_takes_pages_as_it_grows_and_gives_them_back() -> None:
    pool = PagePool(pages=1 + 8, page_size=4, slots=2, max_length=16)
    write = pool.admit(0, [1, 2, 3, 4, 5], bucket=16)  # positions 0..5: two pages
    assert pool.held[0] == 2 and pool.used == 2 and list(pool.table[0, :2]) == [1, 2]
    assert list(write) == [1, 2, 9, 9]  # the bucket's other pages are not the row's: written by no one
    assert pool.pages_to_reach(0, 9) == 1
    pool.grow(0, 9)
    assert pool.held[0] == 3 and pool.used == 3
    pool.release(0)
    assert pool.used == 0 and pool.held[0] == 0 and not pool.table[0].any()
    assert pool.stats.pages_peak == 3


def test_rows_of_one_prompt_share_its_whole_pages_written_once() -> None:
    pool = PagePool(pages=1 + 12, page_size=4, slots=3, max_length=16)
    prompt = list(range(1, 11))  # 10 tokens: 2 whole pages and a partial one
    first = pool.admit(0, prompt, bucket=16)
    assert pool.pages_to_admit(prompt, 16) == 1  # the partial page (positions 8..10) only
    second = pool.admit(1, prompt, bucket=16)
    assert list(pool.table[1, :2]) == list(pool.table[0, :2]) and pool.table[1, 2] != pool.table[0, 2]
    assert list(first[:3]) == list(pool.table[0, :3]) and list(second[:2]) == [13, 13]  # not written again
    assert pool.stats.shared_prompt_tokens == 8 and pool.used == 4
    other = pool.admit(2, prompt, bucket=32)  # another bucket: another prefill, its own pages
    assert pool.stats.shared_prompt_tokens == 8 and other[0] != 13
    pool.release(0)
    assert pool.used == 3 + 3  # the shared pages stay while row 1 holds them
    pool.release(1)
    pool.release(2)
    assert pool.used == 0


def test_the_prefix_cache_shares_a_common_beginning_and_evicts_the_least_recent() -> None:
    pool = PagePool(pages=1 + 6, page_size=2, slots=2, max_length=6, prefix_cache=True)
    system = [7, 7, 8, 8]
    pool.admit(0, system + [1], bucket=16)  # pages: [7 7] [8 8] [1 .]
    pool.release(0)
    assert pool.used == 2 and pool.available() == 6  # two cached prefix pages, still available
    pool.admit(1, system + [2, 3], bucket=32)  # shares both, writes [2 3] and one more
    assert pool.stats.shared_prompt_tokens == 4
    pool.release(1)
    pool.admit(0, [9, 9, 9, 9, 9], bucket=16)  # the three free pages
    assert pool.available() == 3
    pool.admit(1, [5, 5, 5], bucket=16)  # two pages: evicts the two least recently used, the deepest first
    pool.release(1)
    before = pool.stats.shared_prompt_tokens
    pool.admit(1, system + [1], bucket=16)
    assert pool.stats.shared_prompt_tokens == before + 2  # [7 7] was still cached; [8 8] was evicted


def test_preemption_takes_the_youngest_rows_and_never_the_oldest() -> None:
    pool = PagePool(pages=1 + 6, page_size=4, slots=3, max_length=16)
    for s in range(3):
        pool.admit(s, [s + 1] * 6, bucket=16)  # two pages each: the pool is full
    assert pool.available() == 0
    assert plan_growth(pool, {0: 8, 1: 8, 2: 8}, order=[1, 0, 2]) == []
    assert plan_growth(pool, {0: 9, 1: 9, 2: 9}, order=[1, 0, 2]) == [2]
    assert plan_growth(pool, {0: 13, 1: 13, 2: 13}, order=[1, 0, 2]) == [2, 0]
    assert plan_growth(pool, {0: 16, 1: 16, 2: 16}, order=[2, 1, 0]) == [0, 1]  # the oldest (2) runs on


def test_bad_page_settings_and_budgets_are_refused_naming_them() -> None:
    with pytest.raises(ConfigError, match="page size 24 must be a positive power of two"):
        check_page_size(24, 64)
    with pytest.raises(ConfigError, match="page size 128 does not divide the cache's 64 positions"):
        check_page_size(128, 64)
    with pytest.raises(ConfigError, match="cannot hold one row of 64 positions"):
        PagePool(pages=4, page_size=16, slots=2, max_length=64)
    with pytest.raises(ConfigError, match=r"kv budget of 0.0 MiB cannot hold one sequence of 64 positions"):
        pool_pages(TINY, 4, 64, 16, budget=1000)
    with pytest.raises(ConfigError, match="cannot hold one sequence of 64 positions"):
        contiguous_rows(TINY, 64, 1000)
    with pytest.raises(ConfigError, match="neither a size"):
        parse_budget("lots")
    with pytest.raises(ConfigError, match=r"must be in \(0, 1\]"):
        parse_budget("1.5")
    assert parse_budget("512MiB") == 512 * 2**20 and parse_budget("2GiB") == 2 * 2**30
    assert parse_budget("64") == 64 * 2**20 and parse_budget("0.9") == 0.9 and parse_budget(None) is None


def test_a_budget_buys_pages_and_contiguous_rows() -> None:
    from olmax.model.decode import cache_bytes, page_bytes, row_bytes
    budget = 4 * cache_bytes(TINY, 1, 64)
    assert contiguous_rows(TINY, 64, budget) == 4
    pages = pool_pages(TINY, 8, 64, 16, budget)
    assert pages == (budget - 8 * row_bytes(TINY, 64)) // page_bytes(TINY, 16)
    assert pool_pages(TINY, 8, 64, 16, None) == 1 + 8 * 4
