"""The decode steps' arithmetic in a training forward (``olmax.model.dispatch.reproduce_decode_bits``):
RL's log-probs of the sampled tokens equal the log-probs the sampler reported, bit for bit, on
the CPU kernels; each piece (attention over whole sequences, RMSNorm, the product at many rows)
is checked against XLA and float64, and the gradients through it are XLA's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmax.config import Config, ModelConfig
from olmax.engine import Sampling, generate
from olmax.kernels import cpu as cpu_kernels
from olmax.model import olmo3
from olmax.model.attention import reference_attention
from olmax.model.dispatch import can_reproduce_decode_bits, reproduce_decode_bits, rms_norm
from olmax.model.layers import position_mask
from olmax.model.loss import token_logps
from olmax.model.params import init_params
from olmax.rl import grpo
from trainlib import normal

# olmax's C++ CPU kernels: skipped where JAX's backend is not the CPU (tests/conftest.py).
pytestmark = pytest.mark.cpu_only
needs_kernel = pytest.mark.skipif(not cpu_kernels.available(), reason=f"{cpu_kernels.unavailable_reason()}")

# Sliding layers with a window of 6 under 30-token sequences: the decode cache's ring wraps, so its
# slots are out of position order; grouped queries; heads of 16 (not a multiple of the kernel's 64).
TINY = ModelConfig(vocab_size=150, padded_vocab_size=192, d_model=64, n_layers=4, n_heads=4, n_kv_heads=2,
                   head_dim=16, mlp_hidden=96, norm_eps=1e-6, rope_theta=10000.0, sliding_window=6,
                   max_position_embeddings=256, compute_dtype="float32", param_dtype="float32")


def _params(cfg: ModelConfig, seed: int = 0):
    # Weights 3x init: logits spread enough that log-probs are far from uniform.
    return jax.tree.map(lambda a: a * 3 if a.ndim == 2 else a, init_params(cfg, jax.random.key(seed)))


def sampled_gaps(model: ModelConfig, mesh=None) -> dict[bool, float]:
    """Prompts of 2 to 9 tokens (right-padded in the prefill), two completions of each (the
    prompt prefilled once and copied, as GRPO's groups are), 16 sampled tokens at temperature 1:
    the largest |sampler's log-prob - training forward's| with the decode arithmetic (True) and
    with XLA's forward (False), on one device or on ``mesh`` (parameters and rows sharded as RL
    shards them). Asserts bit equality row by row with the decode arithmetic."""
    from olmax.model.params import logical_axes
    from olmax.sharding import activation_mesh, batch_sharding, param_shardings
    cfg = Config(model=model)
    params = _params(model)
    rng = np.random.default_rng(0)
    prompts = [list(map(int, rng.integers(0, model.vocab_size, n))) for n in (2, 9, 5, 7)]
    prompts = [p for p in prompts for _ in range(2)]
    out = generate(params, model, prompts, max_new_tokens=16, sampling=Sampling(temperature=1.0), batch_size=8,
                   mesh=mesh)
    L = 32
    toks = np.zeros((len(prompts), L), np.int32)
    mask = np.zeros((len(prompts), L), bool)
    for i, (p, c) in enumerate(zip(prompts, out)):
        seq = p + c.token_ids
        toks[i, :len(seq)], mask[i, len(p):len(seq)] = seq, True
    if mesh is not None:
        params = jax.device_put(params, param_shardings(logical_axes(model), mesh))
        toks, mask = (jax.device_put(a, batch_sharding(mesh, 2)) for a in (toks, mask))
    gaps = {}
    for exact in (True, False):
        def logps(p, t, m, e=exact):
            with activation_mesh(mesh):
                return grpo.policy_logps(p, t, m, cfg, e)
        lp = np.asarray(jax.jit(logps)(params, toks, mask))
        got = [lp[i, len(p) - 1:len(p) - 1 + len(c.token_ids)] for i, (p, c) in enumerate(zip(prompts, out))]
        want = [np.asarray(c.logprobs, np.float32) for c in out]
        assert all(len(c.token_ids) == 16 for c in out)
        if exact:
            for i, (g, w) in enumerate(zip(got, want)):
                assert np.array_equal(g, w), (i, np.abs(g - w).max())
        gaps[exact] = max(float(np.abs(g - w).max()) for g, w in zip(got, want))
    return gaps


@needs_kernel
@pytest.mark.parametrize("dtype,xla_bound", [("float32", 1e-5), ("bfloat16", 0.1)])
def test_rl_log_probs_are_the_samplers_bit_for_bit(dtype: str, xla_bound: float) -> None:
    """The training forward's log-prob of every sampled token is the one the sampler reported,
    to the bit (``sampled_gaps``), in fp32 and in bf16 (whose kernel inputs and outputs are
    rounded to bf16 explicitly, ``layers.kernel_input``). Without the decode arithmetic the same
    forward differs (a different order of the same sums; in bf16 by bf16's rounding), which is
    what the vLLM-free design still had to remove."""
    from dataclasses import replace
    model = replace(TINY, compute_dtype=dtype)
    assert can_reproduce_decode_bits(model)
    gaps = sampled_gaps(model)
    assert gaps[True] == 0.0 and 0 < gaps[False] <= xla_bound, gaps


@pytest.mark.integration
@needs_kernel
def test_rl_log_probs_are_the_samplers_on_a_mesh() -> None:
    """The same on 4 CPU devices, as fsdp 4 and as fsdp 2 x tensor 2 (rows over fsdp, heads over
    tensor): each device runs the kernels on its own rows (``cpu_kernels._per_batch_shard``), so
    every log-prob is the sampler's to the bit, in fp32 and bf16. (XLA's forward on the mesh
    differed by fp32 rounding, and on bench-rl's d_model 512 model by 3.0e-5.)"""
    code = textwrap.dedent("""
        import json
        from dataclasses import replace
        from olmax.config import MeshConfig
        from olmax.model.dispatch import can_reproduce_decode_bits
        from olmax.sharding import make_mesh
        from test_decode_arithmetic import TINY, sampled_gaps
        out = []
        for dtype, shape in (("float32", dict(fsdp=4)), ("float32", dict(fsdp=2, tensor=2)),
                             ("bfloat16", dict(fsdp=4))):
            mesh = make_mesh(MeshConfig(**shape))
            model = replace(TINY, compute_dtype=dtype)
            out.append([can_reproduce_decode_bits(model, mesh), sampled_gaps(model, mesh)[True]])
        print(json.dumps(out))
    """)
    env = {**os.environ, "XLA_FLAGS": "--xla_force_host_platform_device_count=4", "JAX_PLATFORMS": "cpu",
           "PYTHONPATH": os.path.dirname(__file__)}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [[True, 0.0]] * 3


@needs_kernel
@pytest.mark.parametrize("t,h,kv,e,window", [(30, 4, 2, 16, 6), (20, 2, 2, 64, None), (40, 6, 2, 20, 7),
                                             (9, 2, 1, 128, 16)])
def test_sequence_attention_is_each_decode_steps(t: int, h: int, kv: int, e: int, window: int | None) -> None:
    """``cpu_kernels.sequence_attention`` against the reference attention and float64 (fp32
    rounding), and, for every query, bit for bit against the decode step's kernel
    (``cache_attention``) over a cache of the decode's slot count (the window, a ring, or the
    whole length) holding the keys up to that query: the order of the sums is the decode cache's."""
    b = 2
    ks = jax.random.split(jax.random.key(t * 10 + e), 3)
    q = normal(ks[0], (b, t, h, e), jnp.float32)
    k = normal(ks[1], (b, t, kv, e), jnp.float32)
    v = normal(ks[2], (b, t, kv, e), jnp.float32)
    got = np.asarray(jax.jit(lambda q, k, v: cpu_kernels.sequence_attention(q, k, v, window))(q, k, v))
    ref = np.asarray(jax.jit(reference_attention, static_argnums=3)(q, k, v, window))  # one compile, not one an op
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-6)
    slots = min(window or t, t + 3)
    cache = jax.jit(cpu_kernels.cache_attention)
    for pos in range(t):
        kc = np.zeros((b, kv, slots, e), np.float32)
        vc = np.zeros_like(kc)
        held = np.full((b, slots), -1, np.int32)
        for p in range(pos + 1):  # written in order, as decode steps write them
            kc[:, :, p % slots], vc[:, :, p % slots], held[:, p % slots] = k[:, p], v[:, p], p
        seen = position_mask(jnp.full((b, 1), pos), jnp.asarray(held), window)[:, 0]
        one = np.asarray(cache(q[:, pos].reshape(b, kv, h // kv, e), kc, vc, seen)).reshape(b, h, e)
        assert np.array_equal(one, got[:, pos]), pos


@needs_kernel
def test_the_kernels_rms_norm() -> None:
    """Within fp32 rounding of XLA's RMSNorm and float64; a row alone gives the bits it gives in
    a batch of 300; ``dispatch.rms_norm`` under the decode arithmetic is the kernel, and its gradient
    is XLA's RMSNorm's."""
    x = normal(jax.random.key(0), (300, 96), jnp.float32) * 3
    w = normal(jax.random.key(1), (96,), jnp.float32)
    f = jax.jit(lambda x, w: cpu_kernels.rms_norm(x, w, 1e-6))
    got = np.asarray(f(x, w))
    x64 = np.asarray(x, np.float64)
    exact = np.asarray(w, np.float64) * x64 / np.sqrt((x64 ** 2).mean(-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(got, exact, rtol=2e-6, atol=2e-6)
    xla_norm = jax.jit(lambda x, w: rms_norm(x, w, 1e-6))  # compiled whole, not an operation at a time
    np.testing.assert_allclose(got, np.asarray(xla_norm(x, w)), rtol=2e-6, atol=2e-6)
    for r in (0, 7, 299):
        assert np.array_equal(np.asarray(f(x[r:r + 1], w))[0], got[r])
    dy = normal(jax.random.key(2), x.shape, jnp.float32)

    def kernel_norm(x, w):
        with reproduce_decode_bits():
            return rms_norm(x, w, 1e-6)

    assert np.array_equal(np.asarray(jax.jit(kernel_norm)(x, w)), got)
    g_kernel = jax.jit(jax.grad(lambda x, w: jnp.sum(kernel_norm(x, w) * dy), argnums=(0, 1)))(x, w)
    g_xla = jax.jit(jax.grad(lambda x, w: jnp.sum(rms_norm(x, w, 1e-6) * dy), argnums=(0, 1)))(x, w)
    for a, b in zip(g_kernel, g_xla):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)


@needs_kernel
def test_the_product_at_many_rows_keeps_each_rows_bits() -> None:
    """Above a chunk of rows (120 at 512 inputs) the kernel goes chunk by chunk: every row of 250
    still has the bits it has alone, within fp32 rounding of float64."""
    x = normal(jax.random.key(3), (250, 512), jnp.float32)
    w = normal(jax.random.key(4), (512, 200), jnp.float32)
    f = jax.jit(cpu_kernels.matmul)
    got = np.asarray(f(x, w))
    for r in (0, 119, 120, 121, 249):
        assert np.array_equal(np.asarray(f(x[r:r + 1], w))[0], got[r]), r
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    scale = np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64))
    assert (np.abs(got - exact) / scale).max() < 1e-6


@needs_kernel
def test_gradients_under_the_decode_arithmetic_are_xlas() -> None:
    """The RL loss's gradient through the kernels' forward (their backward passes are XLA's)
    against the plain forward's: the same function, so equal to fp32 rounding, for every
    parameter; and the log-probs themselves agree to rounding."""
    cfg = Config(model=TINY)
    params = _params(TINY, seed=1)
    rng = np.random.default_rng(1)
    toks = rng.integers(0, TINY.vocab_size, (3, 24)).astype(np.int32)
    mask = np.zeros((3, 24), bool)
    mask[:, 5:20] = True
    adv = jnp.asarray([1.0, -0.5, 0.25])

    def loss(p, exact):
        return jnp.sum(grpo.policy_logps(p, toks, mask, cfg, exact) * adv[:, None])

    (l1, g1), (l0, g0) = (jax.jit(jax.value_and_grad(lambda p, e=e: loss(p, e)))(params) for e in (True, False))
    assert abs(float(l1) - float(l0)) <= 1e-4 * abs(float(l0))
    flat1, flat0 = jax.tree.leaves(g1), jax.tree.leaves(g0)
    assert len(flat1) == len(flat0)
    for a, b in zip(flat1, flat0):
        a, b = np.asarray(a), np.asarray(b)
        assert np.abs(a - b).max() <= 1e-4 * max(np.abs(b).max(), 1e-3)


@needs_kernel
def test_packed_documents_under_the_decode_arithmetic_are_alone() -> None:
    """Packed documents (RL's packed rows) under the decode arithmetic: each document's logits
    are those of the document alone in a row, bit for bit (the sequence attention kernel starts
    each query's keys at its document's start, ring order included)."""
    params = init_params(TINY, jax.random.key(0))
    rng = np.random.default_rng(7)
    lengths = (5, 11, 9)
    docs = [rng.integers(0, TINY.vocab_size, m).astype(np.int32) for m in lengths]
    toks = np.concatenate([*docs, np.zeros(3, np.int32)])[None]
    seg = np.concatenate([np.full(m, i + 1) for i, m in enumerate(lengths)] + [np.zeros(3)]).astype(np.int32)[None]
    pos = np.concatenate([np.arange(m) for m in lengths] + [np.zeros(3)]).astype(np.int32)[None]

    def run(t, **kw):
        with reproduce_decode_bits():
            return np.asarray(jax.jit(lambda p: olmo3.forward(p, t, TINY, **kw))(params))

    packed = run(jnp.asarray(toks), positions=jnp.asarray(pos), segment_ids=jnp.asarray(seg))
    at = 0
    for d in docs:
        alone = run(jnp.asarray(d[None]))
        assert np.array_equal(packed[0, at:at + len(d)], alone[0])
        at += len(d)


def test_token_logps_outside_the_block_are_unchanged() -> None:
    """``reproduce_decode_bits(False)`` (RL off the kernels: TPUs, GPUs, no kernel built) is the plain
    forward, to the bit."""
    cfg = Config(model=TINY)
    params = init_params(TINY, jax.random.key(0))
    toks = jnp.asarray(np.random.default_rng(2).integers(0, TINY.vocab_size, (2, 12)), jnp.int32)
    mask = jnp.ones((2, 12), bool)
    plain = np.asarray(jax.jit(lambda p: token_logps(p, toks, mask, cfg, sampled_vocab=True))(params))
    off = np.asarray(jax.jit(lambda p: grpo.policy_logps(p, toks, mask, cfg, False))(params))
    assert np.array_equal(plain, off)


def test_only_the_kernels_devices_turn_it_on() -> None:
    """RL repeats the decode arithmetic only where the generator decodes with the kernels: CPU
    devices, any count, in fp32 or bf16. A one-chip TPU mesh (an ahead-of-time compile runs on a
    CPU host) keeps XLA's forward."""
    from dataclasses import replace
    from types import SimpleNamespace

    tpu = SimpleNamespace(devices=np.array([SimpleNamespace(platform="tpu")]), size=1)
    assert can_reproduce_decode_bits(TINY, tpu) is False
    assert can_reproduce_decode_bits(replace(TINY, compute_dtype="bfloat16")) is cpu_kernels.available()
    two = SimpleNamespace(devices=np.array([SimpleNamespace(platform="cpu")] * 2), size=2)
    assert can_reproduce_decode_bits(TINY, two) is cpu_kernels.available()
    one = jax.sharding.Mesh(np.array(jax.devices()[:1]), ("data",))
    assert can_reproduce_decode_bits(TINY, one) is can_reproduce_decode_bits(TINY) is cpu_kernels.available()
