"""Decoding (``olmax.engine``) against transformers' ``generate`` and against olmax's own
teacher-forced forward pass, on a random OLMo 3 whose prompt + generation runs past the
sliding window.

The transformers reference runs one prompt at a time (fp32, eager, its own KV cache): each HF
run is then the plain unpadded computation, so the comparison does not depend on how HF
handles padding in a batch (a left-padded batch with an attention mask shifts positions and
fills sliding-window cache slots with masked pads; it is a different program whose fp32
rounding could in principle differ; measured on this model it gives the same tokens). olmax runs
the prompts of different lengths together, padded in its own buckets, with a short last batch.
"""

from __future__ import annotations

from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import Olmo3ForCausalLM

from olmax.compat.hf import load_hf_params, random_hf_model
from olmax.engine import Generator, Sampling, generate
from olmax.engine.sampling import knobs
from olmax.model.olmo3 import forward

VOCAB, WINDOW, NEW = 256, 8, 32
PROMPT_LENGTHS = [3, 9, 17, 26, 6]   # at batch size 4: a full batch and a short one
BATCH = 4
SAMPLING = Sampling(temperature=0.8, top_k=20, top_p=0.9, seed=3)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> dict:
    d = random_hf_model(tmp_path_factory.mktemp("gen") / "hf", seed=1, vocab_size=VOCAB, hidden_size=64,
                        intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, sliding_window=WINDOW, max_position_embeddings=512, rms_norm_eps=1e-6,
                        layer_types=["sliding_attention", "full_attention"], eos_token_id=0, pad_token_id=1)
    hf = Olmo3ForCausalLM.from_pretrained(str(d), dtype=torch.float32, attn_implementation="eager").eval()
    params, cfg = load_hf_params(d)
    assert [cfg.model.layer_window(i) for i in range(2)] == [WINDOW, None]  # a ring buffer and a full cache
    hf.generation_config.eos_token_id = None  # run every prompt to max_new_tokens
    m = replace(cfg.model, compute_dtype="float32")
    rng = np.random.default_rng(4)
    prompts = [rng.integers(2, VOCAB, n).tolist() for n in PROMPT_LENGTHS]
    return dict(hf=hf, params=params, m=m, prompts=prompts, greedy_gen=Generator(params, m, Sampling()))


@pytest.fixture(scope="module")
def hf_greedy(model: dict) -> list[dict]:
    """transformers' greedy continuations, one prompt at a time, with each step's top-2 margin."""
    out = []
    with torch.no_grad():
        for p in model["prompts"]:
            r = model["hf"].generate(torch.tensor([p]), do_sample=False, max_new_tokens=NEW, use_cache=True,
                                     output_scores=True, return_dict_in_generate=True)
            scores = torch.cat(r.scores).numpy()                     # [NEW, V] (greedy: raw logits)
            top2 = np.sort(scores, axis=-1)[:, -2:]
            out.append({"tokens": r.sequences[0, len(p):].tolist(), "margin": float((top2[:, 1] - top2[:, 0]).min())})
    return out


@pytest.fixture(scope="module")
def olmax_greedy(model: dict) -> list:
    return generate(model["params"], model["m"], model["prompts"], max_new_tokens=NEW, batch_size=BATCH,
                    generator=model["greedy_gen"])


def _teacher_forced(model: dict, prompts: list[list[int]], completions: list) -> tuple[list, list]:
    """log p(generated token | prefix) from one ``forward`` over prompt + generated tokens
    (right-padded to one length: causal attention, so padding after a row changes nothing before
    it), log-softmax over the real vocabulary, exact reference attention, fp32. Also the logits
    [n, V] that chose each generated token."""
    seqs = [p + c.token_ids for p, c in zip(prompts, completions)]
    t = max(len(s) for s in seqs)
    toks = np.zeros((len(seqs), t), np.int32)
    for i, s in enumerate(seqs):
        toks[i, :len(s)] = s
    if "teacher" not in model:
        m = replace(model["m"], attention_impl="reference")
        model["teacher"] = jax.jit(lambda p, x: forward(p, x, m))
    logits = np.asarray(model["teacher"](model["params"], jnp.asarray(toks)))[..., :VOCAB]
    logp = np.asarray(jax.nn.log_softmax(jnp.asarray(logits), axis=-1))
    out, used = [], []
    for i, (p, c) in enumerate(zip(prompts, completions)):
        steps = np.arange(len(p) - 1, len(p) - 1 + len(c.token_ids))
        out.append(logp[i, steps, c.token_ids])
        used.append(logits[i, steps])
    return out, used


# --------------------------------------------------------------------------- greedy


def test_greedy_matches_transformers(model: dict, hf_greedy: list[dict], olmax_greedy: list) -> None:
    for p, want, got in zip(model["prompts"], hf_greedy, olmax_greedy):
        assert len(p) + NEW > 2 * WINDOW             # the ring buffer wraps more than once
        assert len(set(want["tokens"])) >= 8, want   # not a degenerate repetition
        assert got.token_ids == want["tokens"], (len(p), got.token_ids, want["tokens"])
        assert got.finish_reason == "length" and len(got.token_ids) == len(got.logprobs) == NEW
    print(f"\nsmallest top-1/top-2 logit margin along HF's greedy paths: {min(h['margin'] for h in hf_greedy):.3e}")


def test_greedy_logprobs_equal_teacher_forced(model: dict, olmax_greedy: list) -> None:
    want, _ = _teacher_forced(model, model["prompts"], olmax_greedy)
    worst = 0.0
    for c, w in zip(olmax_greedy, want):
        np.testing.assert_allclose(np.asarray(c.logprobs), w, rtol=0, atol=1e-5)
        worst = max(worst, float(np.abs(np.asarray(c.logprobs) - w).max()))
    print(f"\ngreedy logprobs vs teacher-forced: max |diff| {worst:.3e}")


def test_eos_stops_a_row_and_is_included(model: dict, olmax_greedy: list) -> None:
    """EOS = a token the second prompt's greedy run makes at step >= 5: that row stops there,
    EOS included, finish_reason "stop"; every other row stops at its own first EOS, if any, and
    otherwise runs to max_new_tokens ("length"); the tokens are the greedy run's prefix."""
    ref = olmax_greedy[1].token_ids
    k = next(i for i in range(5, NEW) if ref[i] not in ref[:i])
    eos = ref[k]
    got = generate(model["params"], model["m"], model["prompts"], max_new_tokens=NEW, batch_size=BATCH,
                   eos_ids=(eos,), generator=model["greedy_gen"])
    assert got[1].token_ids == ref[:k + 1] and got[1].finish_reason == "stop" and len(got[1].logprobs) == k + 1
    np.testing.assert_allclose(got[1].logprobs, olmax_greedy[1].logprobs[:k + 1], rtol=0, atol=1e-5)
    for full, c in zip(olmax_greedy, got):
        ids = full.token_ids
        stop = ids.index(eos) + 1 if eos in ids else NEW
        assert c.token_ids == ids[:stop]
        assert c.finish_reason == ("stop" if eos in ids else "length")


def test_max_new_tokens_gives_length(model: dict, olmax_greedy: list) -> None:
    got = generate(model["params"], model["m"], model["prompts"], max_new_tokens=5, batch_size=BATCH,
                   generator=model["greedy_gen"])  # the same compiled shapes (cache length bucket)
    for full, c in zip(olmax_greedy, got):
        assert c.token_ids == full.token_ids[:5] and c.finish_reason == "length" and len(c.logprobs) == 5


# --------------------------------------------------------------------------- sampling


@pytest.fixture(scope="module")
def sampled(model: dict) -> list:
    gen = Generator(model["params"], model["m"], SAMPLING)
    model["sample_gen"] = gen
    return generate(model["params"], model["m"], model["prompts"], max_new_tokens=NEW, batch_size=BATCH, generator=gen)


def test_sampling_is_reproducible_across_runs_and_batch_sizes(model: dict, sampled: list, olmax_greedy: list) -> None:
    again = generate(model["params"], model["m"], model["prompts"], max_new_tokens=NEW, batch_size=BATCH,
                     generator=model["sample_gen"])
    one_by_one = generate(model["params"], model["m"], model["prompts"], max_new_tokens=NEW, batch_size=1,
                          generator=model["sample_gen"])
    for a, b, c in zip(sampled, again, one_by_one):
        assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
        assert a.token_ids == c.token_ids
        np.testing.assert_allclose(a.logprobs, c.logprobs, rtol=0, atol=1e-5)
    assert all(a.finish_reason == "length" and len(a.token_ids) == NEW for a in sampled)
    # It does sample: not the greedy path.
    assert sum(a.token_ids != g.token_ids for a, g in zip(sampled, olmax_greedy)) >= len(sampled) - 1


def test_sampled_logprobs_are_untempered_and_tokens_obey_top_k_top_p(model: dict, sampled: list) -> None:
    """Reported logprobs are the model's (before temperature), equal to the teacher-forced ones;
    every drawn token is among the top k of the tempered distribution and inside the top-p
    nucleus of what top-k leaves (transformers' order: temperature, top-k, top-p)."""
    want, used = _teacher_forced(model, model["prompts"], sampled)
    for c, w in zip(sampled, want):
        np.testing.assert_allclose(np.asarray(c.logprobs), w, rtol=0, atol=1e-5)
    for c, logits in zip(sampled, used):
        for z, tok in zip(logits.astype(np.float64) / SAMPLING.temperature, c.token_ids):
            order = np.argsort(-z)
            rank = int(np.flatnonzero(order == tok)[0])
            assert rank < SAMPLING.top_k
            top = z[order[:SAMPLING.top_k]]
            probs = np.exp(top - top.max())
            probs /= probs.sum()
            assert probs[:rank].sum() < SAMPLING.top_p + 1e-6, (rank, probs[:rank + 1])


def _per_row(s: Sampling, rows: int) -> dict:
    """The sampler's per-row settings of ``rows`` rows sampling with ``s``."""
    return {k: jnp.asarray(v) for k, v in knobs([s] * rows).items()}


@pytest.mark.integration
def test_sample_inverts_the_distribution_function_and_never_draws_a_nan_or_padded_token() -> None:
    """``sample`` draws by the inverse of the distribution function with one uniform per row
    (``fold_in(key, step)``): the token must be the one float64 finds for the same uniform, row
    by row, across blocks of the vocabulary; many draws must follow softmax(logits / T); padded
    vocabulary rows, NaN and -inf logits are never drawn, and an all-NaN row still gives a token
    id inside the vocabulary."""
    from olmax.engine.sampling import sample

    rows, padded, vocab = 64, 512, 500
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(rows, padded)).astype(np.float32) * 3)
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(7), i))(jnp.arange(rows))
    for step in (0, 5):
        for temperature in (1.0, 0.7):
            tok, _, _ = sample(logits, keys, jnp.int32(step), _per_row(Sampling(temperature=temperature), rows),
                               False, vocab)
            u = np.asarray(jax.vmap(lambda k: jax.random.uniform(jax.random.fold_in(k, step), ()))(keys), np.float64)
            z = np.asarray(logits, np.float64)[:, :vocab] / np.float32(temperature)
            cdf = np.cumsum(np.exp(z - z.max(-1, keepdims=True)), axis=-1)
            want = [int(np.searchsorted(c, ui * c[-1], side="right")) for c, ui in zip(cdf, u)]
            np.testing.assert_array_equal(np.asarray(tok), want)
            assert int(tok.max()) < vocab
    # The distribution: 20,000 rows with their own keys, one set of logits (a padded vocabulary,
    # a -inf and a NaN among them); every count within 5 standard deviations of n x p.
    n, probs = 20000, np.array([0.3, 0.2, 0.15, 0.1, 0.1, 0.05, 0.04, 0.03, 0.02, 0.01])
    one = np.full(padded, -np.inf, np.float32)
    one[200:210] = np.log(probs) + 1.5
    one[5], one[400] = np.nan, 40.0                                    # a NaN; 400 lies in the padding
    many = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(11), i))(jnp.arange(n))
    tok, _, _ = sample(jnp.broadcast_to(jnp.asarray(one), (n, padded)), many, jnp.int32(3),
                    _per_row(Sampling(temperature=1.0), n), False, 300)
    counts = np.bincount(np.asarray(tok), minlength=padded)
    assert counts.sum() == counts[200:210].sum() == n
    assert (np.abs(counts[200:210] - n * probs) <= 5 * np.sqrt(n * probs * (1 - probs))).all(), counts[200:210]
    # +inf: one of the +inf entries, nothing else.
    inf = np.zeros((rows, padded), np.float32)
    inf[:, [17, 300]] = np.inf
    tok, _, _ = sample(jnp.asarray(inf), keys, jnp.int32(0), _per_row(Sampling(temperature=1.0), rows), False, vocab)
    assert set(np.asarray(tok).tolist()) == {17, 300}
    # NaNs: a NaN entry is never drawn; a row of NaNs gives some id in range, not out of it.
    bad = logits.at[:, :vocab // 2].set(jnp.nan).at[0].set(jnp.nan)
    for greedy in (False, True):
        tok, _, _ = sample(bad, keys, jnp.int32(1), _per_row(Sampling(temperature=1.0), rows), greedy, vocab)
        tok = np.asarray(tok)
        assert 0 <= tok[0] < vocab
        assert (tok[1:] >= vocab // 2).all() and (tok[1:] < vocab).all()
        if greedy:
            clean = np.where(np.arange(padded) < vocab, np.asarray(bad[1:]), -np.inf)
            np.testing.assert_array_equal(tok[1:], np.argmax(np.nan_to_num(clean, nan=-np.inf), axis=-1))


def test_greedy_takes_the_first_maximum_as_argmax_does() -> None:
    """Greedy's two-pass maximum is ``jnp.argmax``'s token, ties (the first index wins) and a
    padded vocabulary (never taken, even where its logits are the largest) included."""
    from olmax.engine.sampling import sample

    rows, padded, vocab = 32, 1024, 1000
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(rows, padded)).astype(np.float32)
    logits[:, vocab:] = 50.0                                   # padding: the largest, never taken
    for r in range(0, rows, 2):                                # ties: copies of the maximum elsewhere
        top = int(np.argmax(logits[r, :vocab]))
        logits[r, rng.integers(0, vocab, 3)] = logits[r, top]
    keys = jax.vmap(lambda i: jax.random.fold_in(jax.random.key(0), i))(jnp.arange(rows))
    tok, lp, _ = sample(jnp.asarray(logits), keys, jnp.int32(0), _per_row(Sampling(), rows), True, vocab)
    want = jnp.argmax(jnp.where(jnp.arange(padded) < vocab, jnp.asarray(logits), -jnp.inf), axis=-1)
    np.testing.assert_array_equal(np.asarray(tok), np.asarray(want))
    np.testing.assert_allclose(np.asarray(lp), np.asarray(jax.nn.log_softmax(jnp.asarray(logits[:, :vocab]), axis=-1))[
        np.arange(rows), np.asarray(want)], rtol=0, atol=1e-6)
