"""The CPU's SwiGLU kernel (``olmax.kernels.cpu.swiglu``, what ``olmax.model.dispatch.swiglu`` runs
on a CPU in fp32): forward and gradient against float64 and against XLA's ``layers.swiglu``, rows whose
width is not a multiple of 8 included; each element's bits depend on its inputs alone (any row,
any batch, every run); NaN stays in its element; the model's training step, prefill and decode
steps all call it on the CPU in fp32, and bf16 and accelerator programs keep XLA's; a CPU mesh
runs it per batch shard with one device's bits."""

from __future__ import annotations

from unittest import mock

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmax.kernels import cpu as cpu_kernels
from olmax.model import dispatch, layers
from olmax.recipes import get_recipe
from trainlib import normal, run_on_cpu_devices

# olmax's C++ CPU kernels: skipped where JAX's backend is not the CPU (tests/conftest.py).
pytestmark = pytest.mark.cpu_only
needs_kernel = pytest.mark.skipif(not cpu_kernels.available(), reason=f"{cpu_kernels.unavailable_reason()}")


def _inputs(rows: int, f: int, seed: int = 0) -> tuple[jax.Array, jax.Array]:
    k1, k2 = jax.random.split(jax.random.key(seed))
    gu = 3 * normal(k1, (rows, 5, 2 * f), jnp.float32)  # gates well into both tails of the sigmoid
    return gu, normal(k2, (rows, 5, f), jnp.float32)


def _float64(gu: np.ndarray, dy: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    g, u = np.split(gu.astype(np.float64), 2, axis=-1)
    s = 1 / (1 + np.exp(-g))
    d = dy.astype(np.float64)
    return g * s * u, np.concatenate([d * u * s * (1 + g * (1 - s)), d * g * s], axis=-1)


@needs_kernel
@pytest.mark.parametrize("f", [8, 13, 64, 1536])
def test_forward_and_gradient_equal_float64_and_xla(f: int) -> None:
    """Within a few fp32 roundings of float64 (relative to the largest magnitude, the bound XLA's
    own SwiGLU meets here), and of XLA's; widths that leave a tail of 5 and of 0 lanes."""
    gu, dy = _inputs(3, f)

    def value_and_vjp(fn):  # compiled whole: op by op, each operation compiles on its own
        return jax.jit(lambda gu, dy: (lambda y, back: (y, back(dy)[0]))(*jax.vjp(fn, gu)))(gu, dy)
    y, dgu = value_and_vjp(cpu_kernels.swiglu)
    assert y.shape == dy.shape and dgu.shape == gu.shape and y.dtype == dgu.dtype == jnp.float32
    y_xla, dgu_xla = value_and_vjp(layers.swiglu)
    y64, dgu64 = _float64(np.asarray(gu), np.asarray(dy))
    for got, xla, exact in ((y, y_xla, y64), (dgu, dgu_xla, dgu64)):
        scale = np.max(np.abs(exact))
        assert np.max(np.abs(np.asarray(got) - exact)) <= 2e-6 * scale
        assert np.max(np.abs(np.asarray(xla) - exact)) <= 2e-6 * scale  # the bound is XLA's too
        assert np.max(np.abs(np.asarray(got) - np.asarray(xla))) <= 4e-6 * scale


@needs_kernel
def test_an_elements_bits_depend_on_its_inputs_alone() -> None:
    """Every run, a row alone and the same numbers at another place in a row (the last F % 8 go
    through the same eight-lane arithmetic): resume and data-parallel meshes stay bitwise."""
    gu, dy = _inputs(4, 13, seed=1)
    f = jax.jit(lambda gu, dy: jax.vjp(cpu_kernels.swiglu, gu)[1](dy)[0])
    y = jax.jit(cpu_kernels.swiglu)
    assert np.array_equal(y(gu), y(gu)) and np.array_equal(f(gu, dy), f(gu, dy))
    assert np.array_equal(y(gu[2:3]), y(gu)[2:3]) and np.array_equal(f(gu[2:3], dy[2:3]), f(gu, dy)[2:3])
    # the tail lanes (8..12) of a 13-wide row against the same numbers at lanes 0..4 of another
    g, u = gu[..., :13], gu[..., 13:]
    moved = jnp.concatenate([g[..., 8:], g[..., :8], u[..., 8:], u[..., :8]], axis=-1)
    assert np.array_equal(y(moved)[..., :5], y(gu)[..., 8:])
    dmoved = f(moved, jnp.concatenate([dy[..., 8:], dy[..., :8]], axis=-1))
    assert np.array_equal(dmoved[..., :5], f(gu, dy)[..., 8:13])


@needs_kernel
def test_nan_stays_in_its_element() -> None:
    gu, dy = _inputs(2, 24, seed=2)
    y = np.asarray(cpu_kernels.swiglu(gu.at[1, 3, 5].set(jnp.nan)))
    assert np.isnan(y[1, 3, 5]) and np.isnan(y).sum() == 1
    assert np.array_equal(np.delete(y.reshape(-1), 1 * 5 * 24 + 3 * 24 + 5),
                          np.delete(np.asarray(cpu_kernels.swiglu(gu)).reshape(-1), 1 * 5 * 24 + 3 * 24 + 5))


@needs_kernel
def test_the_model_calls_it_on_the_cpu_in_fp32_only() -> None:
    """The tiny recipe's training step with ``model.cpu_training_kernels`` calls both entry points
    (no silent fallback); by default, in bf16, and traced for a TPU, the model keeps XLA's SwiGLU,
    with the same function."""
    from olmax.model.olmo3 import forward
    from olmax.model.params import init_params

    def hlo(overrides=(), platform="cpu"):
        m = get_recipe("tiny", list(overrides)).model
        params = jax.eval_shape(lambda: init_params(m, jax.random.key(0)))  # lowered, never run
        ids = jnp.zeros((2, 64), jnp.int32)
        with mock.patch.object(dispatch, "target_platform", lambda: platform):
            return jax.jit(jax.grad(lambda p: jnp.sum(forward(p, ids, m).astype(jnp.float32)))).lower(params).as_text()

    on = "model.cpu_training_kernels=true"
    text = hlo([on])
    assert cpu_kernels.SWIGLU_FWD in text and cpu_kernels.SWIGLU_BWD in text
    assert cpu_kernels.SWIGLU_FWD not in hlo()
    assert cpu_kernels.SWIGLU_FWD not in hlo([on, "model.compute_dtype=bfloat16", "model.param_dtype=bfloat16"])
    assert cpu_kernels.SWIGLU_FWD not in hlo([on], platform="tpu")
    gu = _inputs(2, 16, seed=3)[0]
    with mock.patch.object(cpu_kernels, "_STATE", {"why": "turned off by OLMAX_CPU_KERNELS=0"}):
        assert not cpu_kernels.swiglu_supported(gu)
        assert np.array_equal(dispatch.swiglu(gu, get_recipe("tiny", [on]).model), layers.swiglu(gu))
    assert dispatch.target_platform() == "cpu"


@needs_kernel
def test_a_cpu_mesh_runs_it_per_batch_shard_with_one_devices_bits() -> None:
    """On 4 CPU devices (batch over data 2 x fsdp 2, and fsdp 2 x tensor 2) the forward and the
    gradient are the single device's bit for bit."""
    assert run_on_cpu_devices("""
        import json
        import jax, jax.numpy as jnp, numpy as np
        from olmax.config import MeshConfig
        from olmax.kernels import cpu as cpu_kernels
        from olmax.sharding import activation_mesh, make_mesh
        from test_cpu_swiglu import _inputs
        gu, dy = _inputs(4, 40, seed=4)
        step = lambda gu, dy: (jax.vjp(cpu_kernels.swiglu, gu)[1](dy)[0]
                               + jnp.pad(cpu_kernels.swiglu(gu), ((0, 0), (0, 0), (0, 40))))
        want = jax.jit(step)(gu, dy)
        out = []
        for shape in (dict(data=2, fsdp=2), dict(fsdp=2, tensor=2)):
            with activation_mesh(make_mesh(MeshConfig(**shape))):
                got = jax.jit(step)(gu, dy)
            out.append(bool(np.array_equal(want, got)))
        print(json.dumps(out))
    """) == [True, True]


def test_odd_widths_and_other_dtypes_are_refused() -> None:
    if cpu_kernels.available():
        assert not cpu_kernels.swiglu_supported(jnp.zeros((2, 7), jnp.float32))
        assert not cpu_kernels.swiglu_supported(jnp.zeros((2, 8), jnp.bfloat16))
    with pytest.raises((TypeError, RuntimeError)):
        cpu_kernels.swiglu(jnp.zeros((2, 8), jnp.bfloat16))
