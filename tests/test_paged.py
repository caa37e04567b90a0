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

from olmax.config import ModelConfig
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
