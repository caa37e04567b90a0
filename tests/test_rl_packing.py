"""Packed RL training rows (``rl.pack_length``, ``olmax.rl.packing``): the bins, the packed
arrays, the log-probs of packed documents against the padded rows', and the GRPO update's loss and
gradients packed against padded."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmax.config import ConfigError, validate
from olmax.kernels import cpu as cpu_kernels
from olmax.objectives.grpo import make_grpo_step
from olmax.recipes import get_recipe
from olmax.rl import grpo, packing

L, PACK = 40, 64


def _cfg(*extra: str):
    return get_recipe("tiny_rl", ["model.vocab_size=300", "model.padded_vocab_size=384", "model.n_layers=2",
                                  "model.compute_dtype=float32", "model.param_dtype=float32",
                                  # a sliding layer whose window the documents outrun
                                  "model.sliding_window=8", "model.full_attention_every=2",
                                  f"data.sequence_length={L}", "rl.max_prompt_length=8", "rl.max_response_length=24",
                                  "optim.max_grad_norm=null", *extra])


def _padded(n: int = 12, seed: int = 0, group: int = 4) -> dict[str, np.ndarray]:
    """A rollout batch as ``RlData._batch`` lays it out: prompt + completion from position 0,
    padding after; the last group filtered (``row_valid`` False); one valid row's completion
    masked out (``rl.mask_truncated``)."""
    rng = np.random.default_rng(seed)
    toks = np.full((n, L), 1, np.int32)
    cmask, gmask = np.zeros((n, L), bool), np.zeros((n, L), bool)
    gen = np.zeros((n, L), np.float32)
    lengths = np.zeros(n, np.int32)
    for i in range(n):
        p, t = int(rng.integers(2, 9)), int(rng.integers(1, 25))
        toks[i, :p + t] = rng.integers(2, 300, p + t)
        gmask[i, p:p + t] = cmask[i, p:p + t] = True
        gen[i, p - 1:p - 1 + t] = -rng.random(t)
        lengths[i] = p + t
    valid = np.ones(n, bool)
    valid[-group:] = False
    cmask[~valid] = False
    cmask[1] = False
    adv = grpo.group_advantages(rng.integers(0, 2, n).astype(np.float32) * 10, group)
    adv[~valid] = 0
    return {"input_ids": toks, "completion_mask": cmask, "generated_mask": gmask, "gen_logps": gen,
            "advantages": adv, "row_valid": valid, "lengths": lengths}


def _where(packed: dict[str, np.ndarray]) -> list[tuple[int, int, int]]:
    """(packed row, offset, length) of each document, in packing order."""
    out = []
    for r in range(packed["input_ids"].shape[0]):
        seg = packed["segment_ids"][r]
        for s in range(1, int(seg.max()) + 1):
            at = np.nonzero(seg == s)[0]
            out.append((r, int(at[0]), len(at)))
    return out


def _docs(padded: dict[str, np.ndarray], packed: dict[str, np.ndarray]) -> dict[int, tuple[int, int]]:
    """Padded row -> (packed row, offset), matched by tokens (the test's documents differ)."""
    out = {}
    for r, at, m in _where(packed):
        hits = [i for i in range(len(padded["lengths"])) if padded["lengths"][i] == m and
                np.array_equal(padded["input_ids"][i, :m], packed["input_ids"][r, at:at + m])]
        assert len(hits) == 1
        out[hits[0]] = (r, at)
    return out


# --------------------------------------------------------------------------- bins and rows


def test_first_fit_decreasing_is_deterministic_and_fills_rows():
    lengths = [5, 9, 3, 7, 2, 9, 4]
    bins = packing.first_fit_decreasing(lengths, 12)
    # 9 | 9 | 7+5 | then 4 -> 9's row (3 left is too small for 4? 12-9=3: no) ... worked out by hand:
    # sorted: 9(1), 9(5), 7(3), 5(0), 4(6), 3(2), 2(4): 9->A, 9->B, 7->C, 5->C(12), 4->D, 3->A, 2->B
    assert bins == [[1, 2], [4, 5], [0, 3], [6]]
    assert packing.first_fit_decreasing(lengths, 12) == bins
    assert sorted(i for b in bins for i in b) == list(range(len(lengths)))
    assert packing.first_fit_decreasing([], 8) == []
    with pytest.raises(ValueError, match="does not fit"):
        packing.first_fit_decreasing([3, 13], 12)
    # micro-batches within the unpacked per-device bound; rows per device to 5 significant bits
    assert packing.row_plan(28, 1, 64) == (1, 28)      # exact up to 32
    assert packing.row_plan(43, 1, 128) == (1, 44)
    assert packing.row_plan(0, 1, 128) == (1, 1)
    assert packing.row_plan(128, 1, 128) == (1, 128)
    assert packing.row_plan(300, 2, 128) == (2, 76)
    assert packing.row_plan(5, 4, 1) == (2, 1)        # AI2's layout: one row per device per micro-batch
    assert packing.row_plan(33, 1, 33) == (1, 33)     # never past the bound (34 by the rounding)
    for n in range(1, 5000):                          # at most 1/16 more rows, 16 counts per doubling
        r = packing.round_rows(n)
        assert n <= r <= n * (1 + 1 / 16) and packing.round_rows(r) == r
    assert len({packing.round_rows(n) for n in range(257, 513)}) == 16  # 272, 288, ..., 512


def test_packed_rows_hold_every_trained_completion_once():
    padded = _padded()
    packed, accum = packing.pack_batch(padded, PACK, mini_batches=2, data_parallel=2, micro_batch=1, pad_token_id=1)
    rows = packed["input_ids"].shape[0]
    assert rows == 2 * accum * 2 and rows < 12              # fewer rows than completions
    per = rows // 2
    docs = _docs(padded, packed)
    valid = np.nonzero(padded["row_valid"])[0]
    assert sorted(docs) == list(valid)                       # the filtered group is left out
    for i, (r, at) in docs.items():
        m = int(padded["lengths"][i])
        assert r // per == i // 6                            # each mini-batch packs its own rows
        for k in packing.TOKEN_KEYS:
            assert np.array_equal(packed[k][r, at:at + m], padded[k][i, :m]), k
        assert np.all(packed["advantages"][r, at:at + m] == padded["advantages"][i])
        assert np.array_equal(packed["positions"][r, at:at + m], np.arange(m))
    assert np.sum(packed["completion_mask"]) == np.sum(padded["completion_mask"])
    assert np.sum(packed["row_sequences"]) == len(valid)
    assert np.array_equal(packed["lengths"], np.sum(packed["segment_ids"] > 0, axis=1))
    assert np.all(packed["input_ids"][packed["segment_ids"] == 0] == 1)   # padding
    assert np.sum(packed["lengths"]) == np.sum(padded["lengths"][valid])
    pad_share = packing.padding_share(padded["lengths"], 12, L)
    assert pad_share == pytest.approx(1 - padded["lengths"].sum() / (12 * L))
    # one mini-batch, no rounding of the rows: FFD leaves less padding than a row per completion
    tight = packing.pack_batch(padded, PACK, mini_batches=1)[0]
    assert packing.padding_share(tight["lengths"], tight["input_ids"].shape[0], PACK) < pad_share


def test_pack_length_is_validated():
    with pytest.raises(ConfigError, match=r"rl.pack_length \(31\) must hold .* = 32 tokens"):
        validate(_cfg("rl.pack_length=31"))
    assert validate(_cfg("rl.pack_length=32")).rl.pack_length == 32
    assert validate(_cfg("rl.pack_length=null")).rl.pack_length is None


# --------------------------------------------------------------------------- log-probs and the update


def _params(cfg):
    from olmax.model.params import init_params
    return init_params(cfg.model, jax.random.key(0))


@pytest.mark.integration
@pytest.mark.parametrize("exact", [True, False])
def test_packed_log_probs_are_the_padded_rows(exact: bool):
    """A completion's log-probs in a packed row against its own padded row: the same bits with
    the CPU decode steps' arithmetic (RL's training forward, whose log-probs are the sampler's),
    fp32 rounding of a different summation otherwise."""
    if exact and not cpu_kernels.available():
        pytest.skip(cpu_kernels.unavailable_reason())
    cfg = _cfg()
    params = _params(cfg)
    padded = _padded(seed=1)
    packed = packing.pack_batch(padded, PACK, mini_batches=1)[0]
    fn = jax.jit(lambda p, t, m, pos=None, seg=None: grpo.policy_logps(p, t, m, cfg, exact, pos, seg))
    a = np.asarray(fn(params, padded["input_ids"], padded["generated_mask"]))
    b = np.asarray(fn(params, packed["input_ids"], packed["generated_mask"], packed["positions"],
                      packed["segment_ids"]))
    for i, (r, at) in _docs(padded, packed).items():
        m = int(padded["lengths"][i])
        if exact:
            assert np.array_equal(a[i, :m], b[r, at:at + m]), i
        else:
            np.testing.assert_allclose(b[r, at:at + m], a[i, :m], rtol=1e-5, atol=1e-6)
    assert np.any(a != 0)


def _grads_out(params, grads, opt_state, loss):
    """An ``apply_update`` stand-in that hands the accumulated gradients back as a metric."""
    norm = jnp.sqrt(sum(jnp.sum(jnp.square(g)) for g in jax.tree.leaves(grads)))
    return params, opt_state, {"grads": grads, "grad_norm": norm}


def _update(cfg, batch, accum, aggregation, exact=False):
    keys = ("input_ids", "completion_mask", "advantages", "old_logps", "gen_logps", "row_valid", "positions",
            "segment_ids", "row_sequences")
    step = jax.jit(make_grpo_step(cfg, grpo.GrpoLoss(aggregation=aggregation, tis_cap=2.0), accum, _grads_out,
                                  exact=exact))
    return step(_params(cfg), None, {k: jnp.asarray(batch[k]) for k in keys if k in batch})[2]


def _old_logps(cfg, batch, shift):
    params = _params(cfg)
    docs = (batch["positions"], batch["segment_ids"]) if "segment_ids" in batch else ()
    lp = np.asarray(grpo.policy_logps(params, batch["input_ids"], batch["generated_mask"], cfg, False, *docs))
    return lp - shift * np.asarray(grpo.token_mask(batch["completion_mask"]))


@pytest.mark.integration
@pytest.mark.parametrize("aggregation", ["token_mean", "sequence_mean"])
def test_packed_update_is_the_padded_update(aggregation: str):
    """Loss and gradient norm of one update, packed against padded, within 1e-6 relative (fp32,
    CPU); every gradient leaf within fp32 rounding."""
    cfg = _cfg()
    padded = _padded(seed=2)
    packed, accum = packing.pack_batch(padded, PACK, mini_batches=1, micro_batch=2)
    assert accum > 1                                         # micro-batches of 2 packed rows
    for b in (padded, packed):  # old log-probs off the policy's, so the ratios clip on both sides
        b["old_logps"] = _old_logps(cfg, b, 0.3)
    a = _update(cfg, padded, 4, aggregation)
    b = _update(cfg, packed, accum, aggregation)
    assert 0 < float(a["clip_fraction"]) < 1
    assert float(b["loss"]) == pytest.approx(float(a["loss"]), rel=1e-6)
    assert float(b["grad_norm"]) == pytest.approx(float(a["grad_norm"]), rel=1e-6)
    assert float(b["tokens"]) == float(a["tokens"])
    for x, y in zip(jax.tree.leaves(a["grads"]), jax.tree.leaves(b["grads"])):
        np.testing.assert_allclose(np.asarray(y), np.asarray(x), rtol=1e-4, atol=1e-7)


@pytest.mark.integration
def test_packed_microbatch_mean_is_open_instructs():
    """``microbatch_mean`` on packed rows: each packed micro-batch's token mean, over the
    micro-batches that hold a document (open-instruct's accumulation steps are its packed
    micro-batches); float64 numpy reference from the same per-token log-probs."""
    cfg = _cfg()
    padded = _padded(seed=3)
    packed = packing.pack_batch(padded, PACK, mini_batches=1)[0]
    packed["old_logps"] = _old_logps(cfg, packed, 0.3)
    rows = packed["input_ids"].shape[0]
    # two empty rows at the end: a micro-batch of padding only that must not count
    pad = {k: np.zeros((2, *v.shape[1:]), v.dtype) for k, v in packed.items()}
    pad["input_ids"][:] = 1
    packed = {k: np.concatenate([v, pad[k]]) for k, v in packed.items()}
    accum = rows + 2
    m = _update(cfg, packed, accum, "microbatch_mean")
    lp = np.asarray(grpo.policy_logps(_params(cfg), packed["input_ids"], packed["generated_mask"], cfg, False,
                                      packed["positions"], packed["segment_ids"]), np.float64)
    tm = np.asarray(grpo.token_mask(packed["completion_mask"]), np.float64)
    ratio = np.exp(lp - packed["old_logps"].astype(np.float64))
    a = packed["advantages"].astype(np.float64)
    w = np.minimum(np.exp(np.clip(packed["old_logps"] - packed["gen_logps"], -10, 10).astype(np.float64)), 2.0)
    per_tok = np.maximum(-a * ratio, -a * np.clip(ratio, 0.8, 1.272)) * w
    held = [r for r in range(accum) if packed["row_sequences"][r] > 0]
    assert len(held) == rows
    ref = sum((per_tok[r] * tm[r]).sum() / max(tm[r].sum(), 1) for r in held) / len(held)
    assert float(m["loss"]) == pytest.approx(ref, rel=1e-5, abs=1e-7)


@pytest.mark.integration
def test_exact_packed_update_has_the_padded_loss():
    """The update with the decode steps' arithmetic (RL on the CPU kernels), packed against padded."""
    if not cpu_kernels.available():
        pytest.skip(cpu_kernels.unavailable_reason())
    cfg = _cfg()
    padded = _padded(seed=4)
    packed = packing.pack_batch(padded, PACK, mini_batches=1)[0]
    for b in (padded, packed):
        b["old_logps"] = _old_logps(cfg, b, 0.2)
    a = _update(cfg, padded, 1, "token_mean", exact=True)
    b = _update(cfg, packed, packed["input_ids"].shape[0], "token_mean", exact=True)
    assert float(b["loss"]) == pytest.approx(float(a["loss"]), rel=1e-6)
    assert float(b["grad_norm"]) == pytest.approx(float(a["grad_norm"]), rel=1e-6)
