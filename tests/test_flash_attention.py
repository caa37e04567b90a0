"""The CPU's training attention kernel (``cpu_kernels.flash_attention``, ``attention_impl=cpu``,
what "auto" picks on a CPU in fp32): forward and gradients against the exact reference and
against float64, with windows, GQA/MQA, packed segments, ragged blocks and every head width it
takes; the same bits on every run and for a row in any batch (so resume and data-parallel
meshes stay bitwise); NaN propagates; unsupported inputs fall back to the XLA ``blocked``
kernel; a CPU mesh runs it per batch shard with one device's bits."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmax.kernels import cpu as cpu_kernels
from olmax.model.attention import blocked_attention, reference_attention
from olmax.model.dispatch import attend, resolve_attention
from olmax.recipes import get_recipe
from trainlib import normal, run_on_cpu_devices

# olmax's C++ CPU kernels: skipped where JAX's backend is not the CPU (tests/conftest.py).
pytestmark = pytest.mark.cpu_only
needs_kernel = pytest.mark.skipif(not cpu_kernels.available(), reason=f"{cpu_kernels.unavailable_reason()}")


def _inputs(b, t, h, kv, e, seed=0, segments=False):
    ks = jax.random.split(jax.random.key(seed), 5)
    q = normal(ks[0], (b, t, h, e), jnp.float32)
    k = normal(ks[1], (b, t, kv, e), jnp.float32)
    v = normal(ks[2], (b, t, kv, e), jnp.float32)
    seg = None
    if segments:  # documents of random lengths, a padding run (0) at the end of row 0
        seg = jnp.cumsum(jax.random.bernoulli(ks[3], 0.03, (b, t)), axis=1).astype(jnp.int32) + 1
        seg = seg.at[0, t - t // 5:].set(0)
    return q, k, v, seg


def _loss(fn):
    return lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v))
                                   * jnp.cos(jnp.arange(q.shape[1], dtype=jnp.float32))[:, None, None])


CASES = [  # b, t, h, kv, e, window, block, segments
    (2, 256, 4, 4, 64, None, 64, False),   # the small benchmark's heads, causal
    (2, 200, 4, 2, 64, 100, 64, False),    # GQA, a window across blocks, a partial last block
    (1, 130, 2, 1, 128, None, 64, True),   # MQA, heads of 128 (the 7B's), packed documents
    (2, 333, 6, 2, 32, 7, 32, True),       # a window shorter than a block, segments, 333 = 10 x 32 + 13
    (3, 40, 4, 4, 16, 64, 64, False),      # one block for the whole sequence, window longer than it
    (1, 1, 2, 2, 16, None, 64, False),     # one token
]
# The three longest sequences run in the integration tier (`make test-integration`).
CASES = [pytest.param(*c, marks=pytest.mark.integration) if c[1] >= 200 else c for c in CASES]


@needs_kernel
@pytest.mark.parametrize("b,t,h,kv,e,window,block,segments", CASES)
def test_forward_and_gradients_equal_the_reference(b, t, h, kv, e, window, block, segments) -> None:
    """Output and the gradients of a nonlinear loss within 1e-5 of the largest magnitude of the
    exact reference (the bound the XLA kernels are held to), and the output as close to float64
    as the reference is (a few fp32 roundings)."""
    q, k, v, seg = _inputs(b, t, h, kv, e, seed=t, segments=segments)
    kernel = lambda q, k, v: cpu_kernels.flash_attention(q, k, v, window, seg, block=block)
    ref = lambda q, k, v: reference_attention(q, k, v, window, seg)
    # The reference compiled whole too: op by op, each of its ~60 operations compiles on its own.
    out, want = jax.jit(kernel)(q, k, v), jax.jit(ref)(q, k, v)
    assert float(jnp.abs(out - want).max()) <= 1e-5 * max(1.0, float(jnp.abs(want).max()))
    got = jax.jit(jax.grad(_loss(kernel), argnums=(0, 1, 2)))(q, k, v)
    exp = jax.jit(jax.grad(_loss(ref), argnums=(0, 1, 2)))(q, k, v)
    for name, a, r in zip("qkv", got, exp):
        assert float(jnp.abs(a - r).max()) <= 1e-5 * max(1.0, float(jnp.abs(r).max())), f"d{name}"
    # float64 on the host: each query's softmax over the keys it sees
    q64, k64, v64 = (np.asarray(x, np.float64) for x in (q, k, v))
    g = h // kv
    pos = np.arange(t)
    seen = (pos[None, :] <= pos[:, None]) & ((pos[None, :] > pos[:, None] - window) if window else True)
    seen = np.broadcast_to(seen, (b, t, t))
    if seg is not None:
        s = np.asarray(seg)
        seen = seen & (s[:, :, None] == s[:, None, :])
    scores = np.einsum("bthe,bshe->bhts", q64, np.repeat(k64, g, axis=2)) * e ** -0.5
    scores = np.where(seen[:, None], scores, -np.inf)
    p = np.exp(scores - scores.max(-1, keepdims=True))
    exact = np.einsum("bhts,bshe->bthe", p / p.sum(-1, keepdims=True), np.repeat(v64, g, axis=2))
    assert (np.abs(np.asarray(out, np.float64) - exact).max()
            <= 2 * np.abs(np.asarray(want, np.float64) - exact).max() + 1e-6)


@needs_kernel
def test_the_same_bits_every_run_and_for_a_row_in_any_batch() -> None:
    """Each piece of work has one thread and one order: two runs give the same bits (a resumed run
    repeats them), and a row alone gives the bits it gives among others (a data-parallel mesh,
    which runs the kernel per batch shard, gives one device's bits)."""
    q, k, v, seg = _inputs(4, 192, 4, 2, 64, seed=1, segments=True)
    f = jax.jit(lambda q, k, v, seg: jax.value_and_grad(_loss(lambda q, k, v: cpu_kernels.flash_attention(
        q, k, v, 64, seg)), argnums=(0, 1, 2))(q, k, v))
    (l1, g1), (l2, g2) = f(q, k, v, seg), f(q, k, v, seg)
    assert float(l1) == float(l2) and all(np.array_equal(a, b) for a, b in zip(g1, g2))
    fwd = jax.jit(lambda q, k, v, seg: cpu_kernels.flash_attention(q, k, v, 64, seg))
    bwd = jax.jit(lambda q, k, v, seg, do: jax.vjp(lambda q, k, v: cpu_kernels.flash_attention(q, k, v, 64, seg),
                                                   q, k, v)[1](do))
    do = normal(jax.random.key(9), q.shape)
    whole, grads = fwd(q, k, v, seg), bwd(q, k, v, seg, do)
    one = lambda x: x[2:3]
    assert np.array_equal(fwd(one(q), one(k), one(v), one(seg)), one(whole))
    for a, b in zip(bwd(one(q), one(k), one(v), one(seg), one(do)), grads):
        assert np.array_equal(a, one(b))


@needs_kernel
def test_nan_in_a_query_reaches_its_output_and_no_other_row() -> None:
    """A non-finite input is not hidden by the vectorised exponential: the row that reads it is
    NaN (the training loop's non-finite check sees it), the other rows are untouched."""
    q, k, v, _ = _inputs(2, 96, 2, 2, 16, seed=2)
    out = np.asarray(jax.jit(lambda q: cpu_kernels.flash_attention(q, k, v, None))(q.at[1, 50, 0, 3].set(jnp.nan)))
    clean = np.asarray(cpu_kernels.flash_attention(q, k, v, None))
    assert np.isnan(out[1, 50, 0]).all() and not np.isnan(np.delete(out.reshape(-1, 16), 1 * 96 * 2 + 50 * 2, 0)).any()
    assert np.array_equal(out[0], clean[0])


@needs_kernel
def test_auto_picks_the_kernel_on_a_cpu_in_fp32_and_falls_back_where_it_cannot_run() -> None:
    """"auto" on a CPU: ``blocked`` by default (XLA's arithmetic, the more faithful to OLMo-core);
    with the training kernels on, ``cpu`` in fp32 (where the kernel is built) and ``blocked`` in
    bf16; ``cpu`` with heads it cannot take (not a multiple of 16 wide) computes with ``blocked``
    instead, the same function."""
    assert resolve_attention("auto", jnp.float32, "cpu") == "blocked"
    assert resolve_attention("auto", jnp.float32, "cpu", training_kernels=True) == "cpu"
    assert resolve_attention("auto", jnp.bfloat16, "cpu", training_kernels=True) == "blocked"
    cfg = get_recipe("tiny", ["model.attention_impl=cpu"]).model
    q, k, v, _ = _inputs(1, 70, 2, 1, 20, seed=3)
    assert not cpu_kernels.flash_supported(q, k)
    assert np.array_equal(jax.jit(lambda q, k, v: attend(q, k, v, 16, cfg))(q, k, v),
                          jax.jit(lambda q, k, v: blocked_attention(q, k, v, 16))(q, k, v))
    q, k, v, _ = _inputs(1, 70, 2, 1, 32, seed=3)
    assert np.array_equal(jax.jit(lambda q, k, v: attend(q, k, v, 16, cfg))(q, k, v),
                          jax.jit(lambda q, k, v: cpu_kernels.flash_attention(q, k, v, 16))(q, k, v))
    with pytest.raises(ValueError, match="multiple of 16"):
        cpu_kernels.flash_attention(*_inputs(1, 8, 2, 1, 20)[:3], None)


def test_unavailable_kernel_leaves_auto_on_blocked(monkeypatch) -> None:
    """Where the kernel cannot be built (or ``OLMAX_CPU_KERNELS=0``), "auto" is the XLA kernel."""
    monkeypatch.setattr(cpu_kernels, "_STATE", {"why": "turned off by OLMAX_CPU_KERNELS=0"})
    assert resolve_attention("auto", jnp.float32, "cpu", training_kernels=True) == "blocked"


@needs_kernel
def test_a_cpu_mesh_runs_the_kernel_per_batch_shard_with_one_devices_bits() -> None:
    """On 4 CPU devices (batch over fsdp 2 x data 2, and fsdp 2 x tensor 2) the training step's
    attention gives the single device's output and gradients bit for bit."""
    assert run_on_cpu_devices("""
        import json
        import jax, jax.numpy as jnp, numpy as np
        from jax.sharding import NamedSharding, PartitionSpec as P
        from olmax.config import MeshConfig
        from olmax.kernels import cpu as cpu_kernels
        from olmax.sharding import activation_mesh, make_mesh
        from test_flash_attention import _inputs, _loss
        q, k, v, seg = _inputs(4, 160, 4, 2, 32, seed=4, segments=True)
        f = lambda q, k, v: cpu_kernels.flash_attention(q, k, v, 48, seg)
        step = lambda q, k, v: jax.value_and_grad(_loss(f), argnums=(0, 1, 2))(q, k, v)
        l0, g0 = jax.jit(step)(q, k, v)
        out = []
        for shape in (dict(data=2, fsdp=2), dict(fsdp=2, tensor=2)):
            mesh = make_mesh(MeshConfig(**shape))
            with activation_mesh(mesh):
                l1, g1 = jax.jit(step)(q, k, v)
            out.append(bool(float(l0) == float(l1) and all(np.array_equal(a, b) for a, b in zip(g0, g1))))
        print(json.dumps(out))
    """) == [True, True]


@needs_kernel
def test_the_training_step_of_the_tiny_recipe_runs_the_kernel() -> None:
    """Not a silent fallback: with ``model.cpu_training_kernels`` the compiled forward and backward
    of the tiny recipe's CPU training step call the kernel's two entry points; by default (XLA's
    arithmetic, the more faithful to OLMo-core) neither."""
    from olmax.model.olmo3 import forward
    from olmax.model.params import init_params

    def hlo(overrides):
        m = get_recipe("tiny", overrides).model
        params = jax.eval_shape(lambda: init_params(m, jax.random.key(0)))  # lowered, never run
        ids = jnp.zeros((2, 64), jnp.int32)
        return jax.jit(jax.grad(lambda p: jnp.sum(forward(p, ids, m)))).lower(params).as_text()

    text = hlo(["model.cpu_training_kernels=true"])
    assert cpu_kernels.FLASH_FWD in text and cpu_kernels.FLASH_BWD in text
    assert cpu_kernels.FLASH_FWD not in hlo([])
