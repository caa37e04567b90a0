"""Model pieces against transformers' own Olmo3 modules (the reference runs live), plus init statistics."""

from __future__ import annotations

import types
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import Olmo3Config
from transformers.masking_utils import sliding_window_causal_mask_function
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.olmo3 import modeling_olmo3 as hf

from olmax.config import ModelConfig, RopeScaling
from olmax.model.attention import fused_attention, reference_attention
from olmax.model.layers import apply_rope, attention_mask, rms_norm, rope_cos_sin, rope_inv_freq
from olmax.model.olmo3 import _layer
from olmax.model.params import init_params, param_specs
from olmax.recipes.olmo3 import olmo3_7b_stage3
from trainlib import normal

TINY = ModelConfig(vocab_size=100, padded_vocab_size=128, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2,
                   head_dim=32, mlp_hidden=96, norm_eps=1e-6, rope_theta=10000.0, sliding_window=8,
                   max_position_embeddings=128, compute_dtype="float32", attention_impl="reference")


def hf_config(m: ModelConfig) -> Olmo3Config:
    full = {"rope_type": "default", "rope_theta": m.rope_theta}
    if m.rope_scaling is not None:
        ys = m.rope_scaling
        full = {"rope_type": "yarn", "rope_theta": m.rope_theta, "factor": ys.factor, "beta_fast": ys.beta_fast,
                "beta_slow": ys.beta_slow, "original_max_position_embeddings": ys.original_max_position_embeddings}
        if ys.attention_factor is not None:
            full["attention_factor"] = ys.attention_factor
    return Olmo3Config(
        vocab_size=m.vocab_size, hidden_size=m.d_model, intermediate_size=m.mlp_hidden, num_hidden_layers=m.n_layers,
        num_attention_heads=m.n_heads, num_key_value_heads=m.n_kv_heads, head_dim=m.head_dim,
        rms_norm_eps=m.norm_eps, sliding_window=m.sliding_window, max_position_embeddings=m.max_position_embeddings,
        rope_parameters={"full_attention": full,
                         "sliding_attention": {"rope_type": "default", "rope_theta": m.rope_theta}},
        eos_token_id=0, pad_token_id=1)


def t2n(x: torch.Tensor) -> np.ndarray:
    return x.detach().float().numpy()


# --------------------------------------------------------------------------- RMSNorm


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_rms_norm_matches_hf(dtype: str) -> None:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 5, 64, generator=g).to(getattr(torch, dtype)) * 3
    ref = hf.Olmo3RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        ref.weight.copy_(1 + 0.3 * torch.randn(64, generator=g))
    want = ref(x)
    got = rms_norm(jnp.asarray(t2n(x), dtype), jnp.asarray(t2n(ref.weight)), 1e-6)
    assert got.dtype == jnp.dtype(dtype)
    if dtype == "float32":
        np.testing.assert_allclose(np.asarray(got), t2n(want), rtol=1e-6, atol=1e-6)
    else:  # both compute in fp32 and round once to bf16: at most one bf16 ulp apart
        np.testing.assert_allclose(np.asarray(got, np.float32), t2n(want), rtol=2 ** -7, atol=0)


# --------------------------------------------------------------------------- RoPE

YARN_CASES = [
    # OLMo 3 long context (stage 3 / released 65k checkpoints): head_dim 128, theta 5e5.
    (128, 500000.0, RopeScaling(factor=8.0, original_max_position_embeddings=8192,
                                attention_factor=1.2079441541679836)),
    (64, 500000.0, RopeScaling(factor=3.0, original_max_position_embeddings=100, beta_fast=16.0, beta_slow=2.0)),
    (16, 10000.0, RopeScaling(factor=4.0, original_max_position_embeddings=32)),
    (256, 1e6, RopeScaling(factor=2.0, original_max_position_embeddings=4096)),
]


@pytest.mark.parametrize("head_dim,theta,ys", YARN_CASES)
def test_inv_freq_matches_transformers(head_dim: int, theta: float, ys: RopeScaling) -> None:
    """Within one fp32 ulp of transformers (YaRN on full layers, plain on sliding layers).

    olmax computes ``theta**x`` correctly rounded (fp64 then fp32); torch's vectorised fp32 pow is
    not always (e.g. head_dim 256, theta 1e6, index 74: 2942.727 where 2942.7273 is nearer), and
    its last bit depends on the CPU's SIMD path, so bitwise equality cannot be a portable claim."""
    m = ModelConfig(d_model=2 * head_dim, n_heads=2, n_kv_heads=2, head_dim=head_dim, rope_theta=theta,
                    rope_scaling=ys, max_position_embeddings=int(ys.factor * ys.original_max_position_embeddings))
    c = hf_config(m)
    yarn_inv, yarn_scale = ROPE_INIT_FUNCTIONS["yarn"](c, None, layer_type="full_attention")
    plain_inv, _ = hf.Olmo3RotaryEmbedding.compute_default_rope_parameters(c, None, layer_type="sliding_attention")
    inv, scale = rope_inv_freq(m, full_attention=True)
    assert inv.dtype == np.float32
    np.testing.assert_array_max_ulp(inv, t2n(yarn_inv), maxulp=1)
    assert scale == pytest.approx(yarn_scale, rel=1e-15)
    inv, scale = rope_inv_freq(m, full_attention=False)  # sliding layers keep plain RoPE
    np.testing.assert_array_max_ulp(inv, t2n(plain_inv), maxulp=1)
    assert scale == 1.0
    exact = (1.0 / np.power(np.float64(theta), np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim),
                            dtype=np.float64).astype(np.float32)).astype(np.float32)
    np.testing.assert_array_equal(inv, exact)


def test_stage3_attention_factor() -> None:
    _, scale = rope_inv_freq(olmo3_7b_stage3().model, full_attention=True)
    assert scale == pytest.approx(1.2079441541679836, rel=1e-15)


@pytest.mark.parametrize("yarn", [False, True])
def test_rope_tables_and_rotation_match_hf(yarn: bool) -> None:
    m = replace(TINY, rope_scaling=RopeScaling(factor=4.0, original_max_position_embeddings=32) if yarn else None)
    rot = hf.Olmo3RotaryEmbedding(hf_config(m))
    t = 40
    pos = torch.arange(t)[None]
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, m.n_heads, t, m.head_dim, generator=g)
    k = torch.randn(2, m.n_kv_heads, t, m.head_dim, generator=g)
    for layer_type, full in (("full_attention", True), ("sliding_attention", False)):
        cos, sin = rot(q, pos, layer_type)
        c2, s2 = rope_cos_sin(m, jnp.arange(t), full)
        np.testing.assert_allclose(np.asarray(c2), t2n(cos[0]), rtol=0, atol=2e-6)
        np.testing.assert_allclose(np.asarray(s2), t2n(sin[0]), rtol=0, atol=2e-6)
        q_hf, k_hf = hf.apply_rotary_pos_emb(q, k, cos, sin)
        q_ox = apply_rope(jnp.asarray(t2n(q)).transpose(0, 2, 1, 3), c2, s2)   # olmax: [b, t, n, e]
        k_ox = apply_rope(jnp.asarray(t2n(k)).transpose(0, 2, 1, 3), c2, s2)
        np.testing.assert_allclose(np.asarray(q_ox).transpose(0, 2, 1, 3), t2n(q_hf), rtol=0, atol=2e-5)
        np.testing.assert_allclose(np.asarray(k_ox).transpose(0, 2, 1, 3), t2n(k_hf), rtol=0, atol=2e-5)


def test_rotate_half_layout() -> None:
    """NeoX rotate-half: pairs are (i, i + e/2), not interleaved (2i, 2i+1)."""
    x = jnp.arange(8, dtype=jnp.float32).reshape(1, 1, 1, 8)
    cos = jnp.zeros((1, 8))
    sin = jnp.ones((1, 8))
    np.testing.assert_array_equal(np.asarray(apply_rope(x, cos, sin)).ravel(), [-4, -5, -6, -7, 0, 1, 2, 3])
    np.testing.assert_array_equal(t2n(hf.rotate_half(torch.arange(8.0))), [-4, -5, -6, -7, 0, 1, 2, 3])


# --------------------------------------------------------------------------- attention


def test_sliding_window_mask_boundary_by_hand() -> None:
    """Window 3: query q sees q-2, q-1, q (W keys including itself), i.e. ``q - W < k <= q``."""
    want = np.array([[1, 0, 0, 0, 0, 0],
                     [1, 1, 0, 0, 0, 0],
                     [1, 1, 1, 0, 0, 0],
                     [0, 1, 1, 1, 0, 0],
                     [0, 0, 1, 1, 1, 0],
                     [0, 0, 0, 1, 1, 1]], dtype=bool)
    np.testing.assert_array_equal(np.asarray(attention_mask(6, 6, 3)), want)
    ref = sliding_window_causal_mask_function(3)
    z = torch.tensor(0)
    hf_mask = np.array([[bool(ref(z, z, torch.tensor(q), torch.tensor(k))) for k in range(6)] for q in range(6)])
    np.testing.assert_array_equal(hf_mask, want)
    np.testing.assert_array_equal(np.asarray(attention_mask(6, 6, None)), np.tril(np.ones((6, 6), bool)))


@pytest.mark.parametrize("window", [None, 5])
def test_attention_boundary_key_is_seen(window: int | None) -> None:
    """Changing key/value q-W+1 changes query q's output; changing q-W does not (window 5, q=12)."""
    ks = jax.random.split(jax.random.key(0), 3)
    q = normal(ks[0], (1, 16, 2, 8))
    k = normal(ks[1], (1, 16, 2, 8))
    v = normal(ks[2], (1, 16, 2, 8))
    attend = jax.jit(reference_attention, static_argnums=3)  # one compile, not one per operation
    base = attend(q, k, v, window)
    qi = 12
    for pos in (qi - 5, qi - 4):
        v2 = v.at[0, pos].add(10.0)
        changed = bool(jnp.abs(attend(q, k, v2, window)[0, qi] - base[0, qi]).max() > 1e-3)
        inside = window is None or pos > qi - window
        assert changed == inside, (pos, window)


@pytest.mark.parametrize("window", [None, 7])
def test_gqa_attention_matches_hf_eager(window: int | None) -> None:
    b, t, h, kv, e = 2, 20, 6, 2, 16
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(b, n, t, e, generator=g) for n in (h, kv, kv))
    allowed = torch.from_numpy(np.array(attention_mask(t, t, window)))
    mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[None, None]  # HF: dtype minimum, added
    module = types.SimpleNamespace(num_key_value_groups=h // kv, training=False)
    want, _ = hf.eager_attention_forward(module, q, k, v, mask, scaling=e ** -0.5)   # [b, t, h, e]
    qj, kj, vj = (jnp.asarray(t2n(x)).transpose(0, 2, 1, 3) for x in (q, k, v))
    got = jax.jit(reference_attention, static_argnums=3)(qj, kj, vj, window)  # one compile, not one an operation
    np.testing.assert_allclose(np.asarray(got), t2n(want), rtol=0, atol=1e-5)
    # The fused path (cuDNN on GPU; XLA here) uses local_window_size=(W-1, 0): same result.
    fused = jax.jit(fused_attention, static_argnums=(3, 4))(qj, kj, vj, window, "xla")
    np.testing.assert_allclose(np.asarray(fused), t2n(want), rtol=0, atol=1e-5)


@pytest.mark.parametrize("layer_idx", [0, 3])  # sliding, full
def test_decoder_layer_matches_hf(layer_idx: int) -> None:
    """A whole block (QK-norm over whole projections, reordered norms, SwiGLU) vs Olmo3DecoderLayer."""
    m = replace(TINY, rope_scaling=RopeScaling(factor=4.0, original_max_position_embeddings=32))
    c = hf_config(m)
    c._attn_implementation = "eager"
    layer = hf.Olmo3DecoderLayer(c, layer_idx).eval()
    g = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(1 + 0.3 * torch.randn(p.shape, generator=g) if p.ndim == 1
                    else torch.randn(p.shape, generator=g) / p.shape[1] ** 0.5)
    t = 24
    x = torch.randn(2, t, m.d_model, generator=g)
    layer_type = c.layer_types[layer_idx]
    cos, sin = hf.Olmo3RotaryEmbedding(c)(x, torch.arange(t)[None], layer_type)
    full = m.is_full_attention(layer_idx)
    assert full == (layer_type == "full_attention")
    allowed = torch.from_numpy(np.array(attention_mask(t, t, m.layer_window(layer_idx))))
    mask = torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[None, None]
    with torch.no_grad():
        want = layer(x, attention_mask=mask, position_embeddings=(cos, sin))
    sd = {k: t2n(v) for k, v in layer.state_dict().items()}
    p = {"attn": {"q": sd["self_attn.q_proj.weight"].T, "k": sd["self_attn.k_proj.weight"].T,
                  "v": sd["self_attn.v_proj.weight"].T, "o": sd["self_attn.o_proj.weight"].T,
                  "q_norm": sd["self_attn.q_norm.weight"], "k_norm": sd["self_attn.k_norm.weight"]},
         "attn_norm": sd["post_attention_layernorm.weight"],
         "mlp": {"gate": sd["mlp.gate_proj.weight"].T, "up": sd["mlp.up_proj.weight"].T,
                 "down": sd["mlp.down_proj.weight"].T},
         "mlp_norm": sd["post_feedforward_layernorm.weight"]}
    c2, s2 = rope_cos_sin(m, jnp.arange(t), full)
    layer_fn = jax.jit(lambda p, x: _layer(m, m.layer_window(layer_idx), p, x, c2, s2))  # compiled whole
    got = layer_fn(jax.tree.map(jnp.asarray, p), jnp.asarray(t2n(x)))
    np.testing.assert_allclose(np.asarray(got), t2n(want), rtol=0, atol=5e-5)


# --------------------------------------------------------------------------- init


def test_init_statistics_and_determinism() -> None:
    m = replace(TINY, d_model=256, mlp_hidden=512, n_heads=4, n_kv_heads=4, head_dim=64)
    params = init_params(m, jax.random.key(0))
    specs = param_specs(m)
    flat_p = jax.tree.leaves(params)
    flat_s = jax.tree.leaves(specs, is_leaf=lambda s: hasattr(s, "init"))
    assert len(flat_p) == len(flat_s)
    # A normal cut at +-3 std keeps std * 0.98658 (OLMo-core: trunc_normal_(std=0.02, a=-0.06, b=0.06)).
    trunc_std = 0.02 * 0.98658
    for a, s in zip(flat_p, flat_s):
        a = np.asarray(a)
        assert a.shape == s.shape
        if s.init == "ones":
            np.testing.assert_array_equal(a, 1.0)
        else:
            assert np.abs(a).max() <= 3 * 0.02 + 1e-7
            if a.size >= 16384:
                assert a.std() == pytest.approx(trunc_std, rel=0.03)
                assert abs(a.mean()) < 3 * trunc_std / np.sqrt(a.size) * 3
    again = init_params(m, jax.random.key(0))
    other = init_params(m, jax.random.key(1))
    for a, b in zip(flat_p, jax.tree.leaves(again)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(params["embed"]), np.asarray(other["embed"]))
    # Leaves of the same shape get different draws (fold_in per leaf).
    assert not np.array_equal(np.asarray(params["layers"][0]["attn"]["q"]),
                              np.asarray(params["layers"][1]["attn"]["q"]))
