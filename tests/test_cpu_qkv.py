"""The CPU kernel that makes the attention's q, k and v from its projection (``cpu_kernels.qkv``:
the split, OLMo 3's q/k RMSNorm over the whole width, RoPE; what the model runs on a CPU in fp32
for training and evaluation): outputs and gradients against the XLA functions it replaces and
against float64, with one RoPE table for every row and per-row tables (packed documents), GQA
and MHA, sequence lengths whose chunk of rows is not 64; each row's bits alone; the model's
training step calls it, and the decode steps, RL's forward and bf16 keep XLA's arithmetic; a CPU
mesh runs it per batch shard with one device's bits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmax.kernels import cpu as cpu_kernels
from olmax.model.layers import apply_rope, rms_norm
from olmax.recipes import get_recipe
from trainlib import normal, run_on_cpu_devices

# olmax's C++ CPU kernels: skipped where JAX's backend is not the CPU (tests/conftest.py).
pytestmark = pytest.mark.cpu_only
needs_kernel = pytest.mark.skipif(not cpu_kernels.available(), reason=f"{cpu_kernels.unavailable_reason()}")
EPS = 1e-6


def _inputs(b, t, h, kv, e, seed=0, per_row=False):
    ks = jax.random.split(jax.random.key(seed), 4)
    x = 2 * normal(ks[0], (b, t, (h + 2 * kv) * e), jnp.float32)
    wq = 1 + 0.3 * normal(ks[1], (h * e,), jnp.float32)
    wk = 1 + 0.3 * normal(ks[2], (kv * e,), jnp.float32)
    pos = np.asarray(jax.random.randint(ks[3], (b, t), 0, 4 * t)) if per_row else np.arange(t)
    ang = pos[..., None].astype(np.float32) * (10000.0 ** (-np.arange(0, e, 2) / e)).astype(np.float32)
    ang = np.concatenate([ang, ang], axis=-1).astype(np.float64)
    return x, wq, wk, jnp.asarray(np.cos(ang), jnp.float32), jnp.asarray(np.sin(ang), jnp.float32)


def _xla(x, wq, wk, cos, sin, h, kv):
    """What the model computes without the kernel (``olmo3._attention_block``)."""
    b, t, d = x.shape
    e = d // (h + 2 * kv)
    q, k, v = jnp.split(x, [h * e, (h + kv) * e], axis=-1)
    q, k = rms_norm(q, wq, EPS), rms_norm(k, wk, EPS)
    return (apply_rope(q.reshape(b, t, h, e), cos, sin), apply_rope(k.reshape(b, t, kv, e), cos, sin),
            v.reshape(b, t, kv, e))


def _math(x, wq, wk, cos, sin, h, kv):
    """The same function in the inputs' own precision (float64 under ``jax.enable_x64``)."""
    b, t, d = x.shape
    e = d // (h + 2 * kv)
    c, s = (a[None, :, None] if a.ndim == 2 else a[:, :, None] for a in (cos, sin))

    def norm_rope(y, w, n):
        y = w * (y * jax.lax.rsqrt(jnp.mean(y * y, axis=-1, keepdims=True) + EPS))
        y = y.reshape(b, t, n, e)
        return y * c + jnp.concatenate([-y[..., e // 2:], y[..., :e // 2]], axis=-1) * s

    q, k, v = jnp.split(x, [h * e, (h + kv) * e], axis=-1)
    return norm_rope(q, wq, h), norm_rope(k, wk, kv), v.reshape(b, t, kv, e)


def _loss(fn):
    def loss(x, wq, wk):
        q, k, v = fn(x, wq, wk)
        return jnp.sum(jnp.sin(q)) + jnp.sum(jnp.cos(k) * jnp.arange(k.shape[1], dtype=jnp.float32)[:, None, None]) \
            + jnp.sum(v * v)
    return loss


CASES = [  # b, t, heads, kv heads, head width, per-row tables
    (2, 64, 8, 8, 64, False),   # the small benchmark's heads
    (3, 40, 4, 2, 16, False),   # GQA, chunks of 40 rows
    (1, 33, 2, 1, 128, True),   # MQA, heads of 128, per-row positions, chunks of 11
    (2, 7, 4, 4, 32, True),     # chunks of 7
]
# The two longest run in the integration tier (`make test-integration`).
CASES = [pytest.param(*c, marks=pytest.mark.integration) if c[1] >= 40 else c for c in CASES]


@needs_kernel
@pytest.mark.parametrize("b,t,h,kv,e,per_row", CASES)
def test_outputs_and_gradients_equal_xla_and_float64(b, t, h, kv, e, per_row) -> None:
    """q, k, v and the gradients of a nonlinear loss (x and both norm weights) within 1e-5 of the
    largest magnitude of XLA's, and no further from float64 than XLA's own (plus that bound)."""
    x, wq, wk, cos, sin = _inputs(b, t, h, kv, e, seed=b + t, per_row=per_row)
    kern = lambda x, wq, wk: cpu_kernels.qkv(x, wq, wk, cos, sin, h, kv, EPS)
    xla = lambda x, wq, wk: _xla(x, wq, wk, cos, sin, h, kv)
    got, want = jax.jit(kern)(x, wq, wk), jax.jit(xla)(x, wq, wk)
    assert [a.shape for a in got] == [(b, t, h, e), (b, t, kv, e), (b, t, kv, e)]
    assert np.array_equal(got[2], want[2])  # v is a copy
    g = jax.jit(jax.grad(_loss(kern), argnums=(0, 1, 2)))(x, wq, wk)
    gx = jax.jit(jax.grad(_loss(xla), argnums=(0, 1, 2)))(x, wq, wk)
    with jax.enable_x64(True):
        c64, s64 = (jnp.asarray(np.asarray(a), jnp.float64) for a in (cos, sin))
        args64 = tuple(jnp.asarray(np.asarray(a), jnp.float64) for a in (x, wq, wk))
        x64 = lambda x, wq, wk: _math(x, wq, wk, c64, s64, h, kv)
        # Compiled whole: op by op, each of the ~100 float64 operations compiles on its own.
        want64 = [np.asarray(a) for a in jax.jit(x64)(*args64)]
        g64 = [np.asarray(a) for a in jax.jit(jax.grad(_loss(x64), argnums=(0, 1, 2)))(*args64)]
    for a, ref, exact in zip((*got, *g), (*want, *gx), (*want64, *g64)):
        scale = float(np.max(np.abs(exact)))
        assert np.max(np.abs(np.asarray(a) - np.asarray(ref))) <= 1e-5 * scale
        assert np.max(np.abs(np.asarray(a) - exact)) <= np.max(np.abs(np.asarray(ref) - exact)) + 1e-5 * scale


@needs_kernel
def test_a_rows_bits_are_its_own() -> None:
    """Two runs give the same bits, and a row alone the bits it gets among others (q, k, v and
    dx; the weights' gradient is a sum over the batch)."""
    h, kv = 4, 2
    x, wq, wk, cos, sin = _inputs(4, 48, h, kv, 32, seed=5)
    fwd = jax.jit(lambda x: cpu_kernels.qkv(x, wq, wk, cos, sin, h, kv, EPS))
    grad = jax.jit(jax.grad(_loss(lambda x, wq, wk: cpu_kernels.qkv(x, wq, wk, cos, sin, h, kv, EPS)),
                            argnums=(0, 1, 2)))
    a, b = grad(x, wq, wk), grad(x, wq, wk)
    assert all(np.array_equal(u, w) for u, w in zip(a, b))
    assert all(np.array_equal(u, w[2:3]) for u, w in zip(fwd(x[2:3]), fwd(x)))
    assert np.array_equal(grad(x[2:3], wq, wk)[0], a[0][2:3])


@needs_kernel
def test_nan_stays_in_its_row() -> None:
    h, kv = 2, 1
    x, wq, wk, cos, sin = _inputs(2, 16, h, kv, 16, seed=6)
    q, k, v = cpu_kernels.qkv(x.at[1, 3, 5].set(jnp.nan), wq, wk, cos, sin, h, kv, EPS)
    clean = cpu_kernels.qkv(x, wq, wk, cos, sin, h, kv, EPS)
    assert np.isnan(q[1, 3]).all() and np.isnan(q).sum() == q[1, 3].size
    assert np.array_equal(np.delete(np.asarray(q).reshape(32, -1), 19, 0),
                          np.delete(np.asarray(clean[0]).reshape(32, -1), 19, 0))
    assert np.array_equal(k, clean[1]) and np.array_equal(v, clean[2])


@needs_kernel
def test_the_model_uses_it_for_training_and_keeps_xla_elsewhere() -> None:
    """The tiny recipe's training step with ``model.cpu_training_kernels`` calls both entry points;
    by default, in bf16, under the decode arithmetic (RL's forward, which must give the decode steps'
    bits) and with heads not a multiple of 16 wide the model keeps the XLA arithmetic, the same
    function."""
    from olmax.model.dispatch import reproduce_decode_bits
    from olmax.model.olmo3 import forward
    from olmax.model.params import init_params

    def hlo(overrides=(), arithmetic=False, kernels=True):
        m = get_recipe("tiny", [*overrides, f"model.cpu_training_kernels={str(kernels).lower()}"]).model
        params = jax.eval_shape(lambda: init_params(m, jax.random.key(0)))  # lowered, never run
        ids = jnp.zeros((2, 64), jnp.int32)
        f = lambda p: jnp.sum(forward(p, ids, m).astype(jnp.float32))
        if arithmetic:
            with reproduce_decode_bits():
                return jax.jit(f).lower(params).as_text()
        return jax.jit(jax.grad(f)).lower(params).as_text()

    text = hlo()
    assert cpu_kernels.QKV_FWD in text and cpu_kernels.QKV_BWD in text
    assert cpu_kernels.QKV_FWD not in hlo(kernels=False)
    assert cpu_kernels.QKV_FWD not in hlo(["model.compute_dtype=bfloat16", "model.param_dtype=bfloat16"])
    assert cpu_kernels.QKV_FWD not in hlo(arithmetic=True)
    assert cpu_kernels.QKV_FWD not in hlo(["model.head_dim=24", "model.d_model=96", "model.n_heads=4",
                                           "model.n_kv_heads=4"])
    x, wq, wk, cos, sin = _inputs(1, 8, 2, 2, 24)
    assert not cpu_kernels.qkv_supported(x, wq, wk, cos, 2, 2)


@needs_kernel
def test_a_cpu_mesh_runs_it_per_batch_shard_with_one_devices_bits() -> None:
    """On 4 CPU devices (batch over data 2 x fsdp 2, and fsdp 2 x tensor 2): q, k, v and dx bit for
    bit the single device's, with one table and with per-row tables; the weights' gradients (a sum
    over the batch, reduced across devices) within fp32 rounding."""
    assert run_on_cpu_devices("""
        import json
        import jax, jax.numpy as jnp, numpy as np
        from olmax.config import MeshConfig
        from olmax.kernels import cpu as cpu_kernels
        from olmax.sharding import activation_mesh, make_mesh
        from test_cpu_qkv import _inputs, _loss, EPS
        out = []
        for per_row in (False, True):
            x, wq, wk, cos, sin = _inputs(4, 40, 4, 2, 32, seed=7, per_row=per_row)
            f = lambda x, wq, wk: cpu_kernels.qkv(x, wq, wk, cos, sin, 4, 2, EPS)
            step = lambda x, wq, wk: (f(x, wq, wk), jax.grad(_loss(f), argnums=(0, 1, 2))(x, wq, wk))
            (o0, g0) = jax.jit(step)(x, wq, wk)
            for shape in (dict(data=2, fsdp=2), dict(fsdp=2, tensor=2)):
                with activation_mesh(make_mesh(MeshConfig(**shape))):
                    o1, g1 = jax.jit(step)(x, wq, wk)
                exact = all(np.array_equal(a, b) for a, b in zip((*o0, g0[0]), (*o1, g1[0])))
                close = all(np.allclose(a, b, rtol=1e-5, atol=1e-5 * float(np.max(np.abs(a))))
                            for a, b in zip(g0[1:], g1[1:]))
                out.append(bool(exact and close))
        print(json.dumps(out))
    """) == [True] * 4


def test_other_dtypes_are_refused() -> None:
    x, wq, wk, cos, sin = _inputs(1, 8, 2, 2, 16)
    if cpu_kernels.available():
        assert cpu_kernels.qkv_supported(x, wq, wk, cos, 2, 2)
        assert not cpu_kernels.qkv_supported(x.astype(jnp.bfloat16), wq, wk, cos, 2, 2)
    with pytest.raises((TypeError, RuntimeError)):
        cpu_kernels.qkv(x.astype(jnp.bfloat16), wq, wk, cos, sin, 2, 2, EPS)
