"""Packed documents (positions restarting per document, segment ids) against transformers'
``Olmo3ForCausalLM`` given ``position_ids`` that restart per document, run live.

How transformers 5.24 masks packed documents (``transformers/masking_utils.py``): when a forward
gets ``position_ids`` and *no* 2-D ``attention_mask`` and *no* cache, ``_preprocess_mask_arguments``
calls ``find_packed_sequence_indices``: a new sequence starts wherever consecutive position ids
do not increase by exactly 1 (``(diff(position_ids, prepend=p0 - 1) != 1).cumsum(-1)``). If any
row has more than one sequence, ``create_causal_mask`` / ``create_sliding_window_causal_mask``
evaluate the causal (and ``kv > q - W`` window) rule on the *per-document positions*
(``remap_positions_for_packed_sequence``) AND-ed with "same sequence index"
(``packed_sequence_mask_function``), materialised as a boolean [b, 1, t, t] mask (sdpa) and as
0 / finfo.min added to the scores (eager). This is the same on every attention implementation,
CPU included (checked here for eager; sdpa gives the same documents-alone logits to 8e-6). Two traps,
both checked below: ``use_cache`` defaults to the config's ``True`` for ``Olmo3ForCausalLM``, and
with a cache (or with any 2-D ``attention_mask``) the packed detection is skipped silently: documents
then attend to each other. The reference here always passes ``use_cache=False`` and no attention mask.

Criteria (fp32, as ``olmax parity``'s): per-token KL(HF || olmax) max <= 1e-7 and top-1 agreement 100%
over the real vocabulary at every non-padding position, through the reference, blocked and
splash (Pallas interpret mode) kernels; gradients of a packed log-likelihood through blocked and
splash equal the reference kernel's to 1e-5 of each leaf's largest magnitude.
"""

from __future__ import annotations

import functools
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import Olmo3ForCausalLM

from olmax.compat.hf import load_hf_params, random_hf_model
from olmax.model.olmo3 import document_segments, forward

VOCAB, EOS, PAD = 100, 0, 1
T, WINDOW = 256, 16
# Document lengths per row (0 = padding to the row's end). Row 0: a long document, one shorter
# than the window, one exactly the window, one a token longer, and a last one that runs to the
# end of the row (no EOS). Row 1: a one-token document, a mid-sized one, a three-token one, one
# much longer than the window, then 62 padding tokens. Row 2: one document filling the row.
ROWS = [[90, 7, WINDOW, WINDOW + 1, 126], [1, 40, 3, 150, 0], [T]]
KERNELS = ["reference", "blocked", "cpu", "splash"]  # cpu: heads of 16 take olmax's kernel


def _layout(lengths: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(positions, segment ids, hf position ids) of one row, written by hand: documents numbered
    from 1, padding (a final 0 in ``lengths``) is segment 0. HF sees padding as one more
    document (its positions restart at 0), which no real token can attend to either way."""
    pos, seg = [], []
    used = 0
    for i, n in enumerate(lengths):
        n = n or T - used
        pos.append(np.arange(n))
        seg.append(np.full(n, 0 if lengths[i] == 0 else i + 1))
        used += n
    assert used == T
    p = np.concatenate(pos)
    return p, np.concatenate(seg), p


def _tokens(rng: np.random.Generator) -> np.ndarray:
    """Random ids in [2, VOCAB) with EOS closing every document but a row's last one, PAD in padding."""
    rows = []
    for lengths in ROWS:
        row = []
        docs = [n for n in lengths if n]
        for j, n in enumerate(docs):
            doc = rng.integers(2, VOCAB, n)
            if j < len(docs) - 1:
                doc[-1] = EOS
            row.append(doc)
        if lengths[-1] == 0:
            row.append(np.full(T - sum(docs), PAD))
        rows.append(np.concatenate(row))
    return np.stack(rows).astype(np.int32)


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> dict:
    d = random_hf_model(tmp_path_factory.mktemp("packed") / "hf", seed=7, vocab_size=VOCAB, hidden_size=64,
                        intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=16, sliding_window=WINDOW, max_position_embeddings=512, rms_norm_eps=1e-6,
                        layer_types=["sliding_attention", "full_attention"], eos_token_id=EOS, pad_token_id=PAD)
    hf = Olmo3ForCausalLM.from_pretrained(str(d), dtype=torch.float32, attn_implementation="eager").eval()
    assert hf.config.layer_types == ["sliding_attention", "full_attention"]
    assert hf.config.use_cache is True  # the default that would silently turn packing off
    params, cfg = load_hf_params(d)
    m = replace(cfg.model, compute_dtype="float32", attention_block_q=128, attention_block_kv=128)
    assert m.sliding_window == WINDOW and [m.layer_window(i) for i in range(2)] == [WINDOW, None]
    assert (m.n_heads, m.n_kv_heads) == (4, 2)
    tokens = _tokens(np.random.default_rng(11))
    layouts = [_layout(r) for r in ROWS]
    positions = np.stack([p for p, _, _ in layouts]).astype(np.int32)
    segments = np.stack([s for _, s, _ in layouts]).astype(np.int32)
    hf_pos = np.stack([h for _, _, h in layouts])
    with torch.no_grad():
        ref = hf(input_ids=torch.as_tensor(tokens, dtype=torch.long), position_ids=torch.as_tensor(hf_pos),
                 use_cache=False).logits.numpy()
    return dict(hf=hf, params=params, m=m, tokens=tokens, positions=positions, segments=segments,
                ref=ref, valid=segments > 0)


def _kl_top1(ref: np.ndarray, got: np.ndarray) -> tuple[float, float, float]:
    """KL(ref || got) max, top-1 agreement and max |logit diff| over [n, V] rows (float64)."""
    a, b = ref.astype(np.float64), got.astype(np.float64)
    la = a - a.max(-1, keepdims=True)
    la -= np.log(np.exp(la).sum(-1, keepdims=True))
    lb = b - b.max(-1, keepdims=True)
    lb -= np.log(np.exp(lb).sum(-1, keepdims=True))
    kl = (np.exp(la) * (la - lb)).sum(-1)
    return float(kl.max()), float((a.argmax(-1) == b.argmax(-1)).mean()), float(np.abs(a - b).max())


@functools.cache
def _forward_fn(m):
    """One jitted forward per model config, shared by the tests (None arguments trace separately)."""
    return jax.jit(lambda p, t, pos, seg: forward(p, t, m, positions=pos, segment_ids=seg))


def _olmax_logits(s: dict, impl: str, positions=None, segments=None) -> np.ndarray:
    out = _forward_fn(replace(s["m"], attention_impl=impl))(s["params"], jnp.asarray(s["tokens"]),
                                                            None if positions is None else jnp.asarray(positions),
                                                            None if segments is None else jnp.asarray(segments))
    return np.asarray(out)[..., :VOCAB]


# --------------------------------------------------------------------------- the reference itself


def test_reference_masks_across_documents(setup: dict) -> None:
    """transformers' packed logits of every document equal that document run alone (so HF does
    mask across documents here), and the masking is what makes it so: with the default cache
    (``use_cache`` unset) or an explicit all-ones attention mask, later documents change."""
    s, hf = setup, setup["hf"]
    tokens, segments = s["tokens"], s["segments"]
    with torch.no_grad():
        for r in range(len(ROWS)):
            for doc in np.unique(segments[r][segments[r] > 0]):
                idx = np.flatnonzero(segments[r] == doc)
                alone = hf(input_ids=torch.as_tensor(tokens[r:r + 1, idx], dtype=torch.long),
                           use_cache=False).logits.numpy()[0]
                np.testing.assert_allclose(s["ref"][r, idx], alone, rtol=0, atol=1e-5)
        ids = torch.as_tensor(tokens, dtype=torch.long)
        pos = torch.as_tensor(s["positions"], dtype=torch.long)
        for kwargs in ({}, {"use_cache": False, "attention_mask": torch.ones_like(ids)}):
            leaky = hf(input_ids=ids, position_ids=pos, **kwargs).logits.numpy()
            later = s["segments"] > 1   # documents after a row's first one
            assert np.abs(leaky[later] - s["ref"][later]).max() > 1.0, kwargs
            first = s["segments"] == 1  # the first document sees nothing else either way
            np.testing.assert_allclose(leaky[first], s["ref"][first], rtol=0, atol=1e-5)


def test_document_segments() -> None:
    """EOS ends (and belongs to) its document; positions restart after it; segment ids count
    from 1; the last document runs to the end of the row, EOS or not."""
    toks = jnp.array([[5, 6, EOS, 7, EOS, EOS, 8, 9],
                      [EOS, 3, 4, 5, 6, 7, 8, EOS],
                      [3, 4, 5, 6, 7, 8, 9, 10]])
    pos, seg = document_segments(toks, EOS)
    np.testing.assert_array_equal(np.asarray(pos), [[0, 1, 2, 0, 1, 0, 0, 1],
                                                    [0, 0, 1, 2, 3, 4, 5, 6],
                                                    [0, 1, 2, 3, 4, 5, 6, 7]])
    np.testing.assert_array_equal(np.asarray(seg), [[1, 1, 1, 2, 2, 3, 4, 4],
                                                    [1, 2, 2, 2, 2, 2, 2, 2],
                                                    [1, 1, 1, 1, 1, 1, 1, 1]])
    # Another EOS id: 0 is then an ordinary token.
    pos, seg = document_segments(toks[:1], 7)
    np.testing.assert_array_equal(np.asarray(pos), [[0, 1, 2, 3, 0, 1, 2, 3]])
    np.testing.assert_array_equal(np.asarray(seg), [[1, 1, 1, 1, 2, 2, 2, 2]])


def test_document_segments_matches_the_hand_built_layout(setup: dict) -> None:
    """On the test's unpadded rows the EOS-derived layout is the one the parity tests use."""
    pos, seg = document_segments(jnp.asarray(setup["tokens"]), EOS)
    for r, lengths in enumerate(ROWS):
        if lengths[-1] != 0:
            np.testing.assert_array_equal(np.asarray(pos[r]), setup["positions"][r])
            np.testing.assert_array_equal(np.asarray(seg[r]), setup["segments"][r])


# --------------------------------------------------------------------------- logits


@pytest.mark.parametrize("impl", KERNELS)
def test_packed_logits_match_transformers(setup: dict, impl: str) -> None:
    s = setup
    got = _olmax_logits(s, impl, s["positions"], s["segments"])
    valid = s["valid"]
    kl, top1, diff = _kl_top1(s["ref"][valid], got[valid])
    print(f"\n[{impl}] packed: KL max {kl:.3e}  top-1 {100 * top1:.2f}%  max |logit diff| {diff:.3e} "
          f"over {int(valid.sum())} tokens")
    assert kl <= 1e-7 and top1 == 1.0
    assert np.isfinite(got).all()  # padding rows too: padding attends to padding, never to nothing


def test_packed_check_is_sensitive(setup: dict) -> None:
    """Negative control (reference kernel): without the segment ids (positions still restarted)
    later documents see earlier ones and the criteria fail by orders of magnitude. Dropping the
    restarted positions instead is *not* a control: RoPE scores depend only on q - k, which is
    the same within a document either way (measured KL about 3e-11, rounding), so
    ``test_positions_reach_rope`` checks the positions separately."""
    s = setup
    later = s["segments"] > 1
    got = _olmax_logits(s, "reference", s["positions"], None)
    kl, _, _ = _kl_top1(s["ref"][later], got[later])
    assert kl > 1e3 * 1e-7, kl
    got = _olmax_logits(s, "reference", None, s["segments"])
    kl, _, _ = _kl_top1(s["ref"][later], got[later])
    assert kl <= 1e-7, kl


def test_positions_reach_rope(setup: dict) -> None:
    """Restarted positions with no document masking: olmax equals transformers given the same
    ``position_ids`` and an all-ones attention mask (which turns HF's packing detection off, so
    HF masks causally by index and rotates by the given positions), and differs from the
    default positions: the positions do reach RoPE, on sliding and full layers."""
    s, hf = setup, setup["hf"]
    ids = torch.as_tensor(s["tokens"], dtype=torch.long)
    with torch.no_grad():
        want = hf(input_ids=ids, position_ids=torch.as_tensor(s["positions"], dtype=torch.long),
                  attention_mask=torch.ones_like(ids), use_cache=False).logits.numpy()
    valid = s["valid"]
    got = _olmax_logits(s, "reference", s["positions"], None)
    kl, top1, diff = _kl_top1(want[valid], got[valid])
    print(f"\n[reference] restarted positions, no segments: KL max {kl:.3e}  top-1 {100 * top1:.2f}%  "
          f"max |logit diff| {diff:.3e}")
    assert kl <= 1e-7 and top1 == 1.0
    plain = _olmax_logits(s, "reference")
    later = s["segments"] > 1
    assert _kl_top1(want[later], plain[later])[0] > 1e3 * 1e-7


@pytest.mark.parametrize("impl", KERNELS)
def test_default_positions_and_one_segment_equal_no_arguments(setup: dict, impl: str) -> None:
    """``positions=arange(t)`` with every segment id 1 computes what the default program does,
    bit for bit, through every kernel (measured on the CPU: the traced positions gather rows of
    the same host-built RoPE table the default path uses as constants, and an all-true segment
    mask selects the same scores)."""
    s = setup
    b = s["tokens"].shape[0]
    arange = np.broadcast_to(np.arange(T, dtype=np.int32), (b, T))
    ones = np.ones((b, T), np.int32)
    base = _olmax_logits(s, impl)
    got = _olmax_logits(s, impl, arange, ones)
    diff = float(np.abs(got - base).max())
    print(f"\n[{impl}] positions=arange, segment_ids=1 vs neither: max |diff| {diff:.3e} "
          f"({'bitwise equal' if diff == 0 else 'not bitwise'})")
    np.testing.assert_array_equal(got, base)


# --------------------------------------------------------------------------- gradients


def _loglik(m, tokens, positions, segments):
    """Summed log-probability of each next token within its document (real vocabulary)."""
    valid = (segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] > 0)

    def f(params):
        logits = forward(params, tokens, m, positions=positions, segment_ids=segments)[:, :-1, :VOCAB]
        logp = jax.nn.log_softmax(logits, axis=-1)
        picked = jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]
        return jnp.sum(jnp.where(valid, picked, 0.0))
    return f


@pytest.fixture(scope="module")
def reference_grads(setup: dict):
    s = setup
    args = (jnp.asarray(s["tokens"]), jnp.asarray(s["positions"]), jnp.asarray(s["segments"]))
    m = replace(s["m"], attention_impl="reference")
    return jax.jit(jax.value_and_grad(_loglik(m, *args)))(s["params"])


@pytest.mark.parametrize("impl", ["blocked", "cpu", "splash"])
def test_packed_gradients_match_reference_kernel(setup: dict, reference_grads, impl: str) -> None:
    s = setup
    args = (jnp.asarray(s["tokens"]), jnp.asarray(s["positions"]), jnp.asarray(s["segments"]))
    m = replace(s["m"], attention_impl=impl)
    value, grads = jax.jit(jax.value_and_grad(_loglik(m, *args)))(s["params"])
    ref_value, ref_grads = reference_grads
    assert abs(float(value) - float(ref_value)) <= 1e-6 * abs(float(ref_value))
    worst = 0.0
    for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(grads), jax.tree.leaves(ref_grads)):
        scale = float(jnp.abs(r).max())
        rel = float(jnp.abs(g - r).max()) / scale if scale else float(jnp.abs(g).max())
        worst = max(worst, rel)
        assert rel <= 1e-5, (jax.tree_util.keystr(path), rel)
    print(f"\n[{impl}] packed gradients vs reference kernel: worst leaf max|diff|/max|ref| {worst:.3e}")


def _leaf(params, name: str):
    node = params
    for key in name.split("."):
        node = node[int(key)] if key.isdigit() else node[key]
    return node


def test_reference_kernel_gradients_match_transformers_autograd(setup: dict, reference_grads) -> None:
    """The packed log-likelihood's gradients through the reference kernel equal torch autograd
    through transformers' packed mask (fp32), leaf by leaf, to 1e-5 of the leaf's largest
    magnitude: the kernels above are compared against a gradient that is itself right."""
    from olmax.compat.hf import hf_name_map

    s, hf = setup, setup["hf"]
    tokens, segments = s["tokens"], s["segments"]
    ids = torch.as_tensor(tokens, dtype=torch.long)
    hf.zero_grad()
    logits = hf(input_ids=ids, position_ids=torch.as_tensor(s["positions"], dtype=torch.long),
                use_cache=False).logits[:, :-1]
    logp = torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None])[..., 0]
    valid = torch.as_tensor((segments[:, 1:] == segments[:, :-1]) & (segments[:, 1:] > 0))
    value = torch.where(valid, logp, 0.0).sum()
    value.backward()
    ref_value, grads = reference_grads
    assert abs(value.item() - float(ref_value)) <= 1e-6 * abs(value.item())
    hf_params = dict(hf.named_parameters())
    worst = 0.0
    for name, (hf_name, transposed) in hf_name_map(s["m"]).items():
        g = np.asarray(_leaf(grads, name))
        if transposed:
            g = g.T
        want = hf_params[hf_name].grad.numpy()
        g = g[:want.shape[0]]  # the real vocabulary rows of embed / lm_head
        rel = float(np.abs(g - want).max()) / float(np.abs(want).max())
        worst = max(worst, rel)
        assert rel <= 1e-5, (name, rel)
    print(f"\n[reference] packed gradients vs torch autograd: worst leaf max|diff|/max|ref| {worst:.3e}")
    hf.zero_grad(set_to_none=True)
