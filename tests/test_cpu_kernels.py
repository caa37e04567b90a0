"""olmax's CPU decode kernel (``olmax.kernels.cpu``): built here, it equals the product in
float64 to fp32 rounding at every row count and shape, gives each row the same bits whatever
batch it is in, decodes the same greedy tokens as XLA's products, and where it cannot be built
says why and leaves decoding to XLA."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap
from dataclasses import replace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from olmax.config import ModelConfig
from olmax.engine import Generator, Sampling, generate
from olmax.kernels import cpu as cpu_kernels
from olmax.model.decode import layout_of
from olmax.model.dispatch import decode_layout
from olmax.model.params import init_params
from trainlib import normal

TINY = ModelConfig(vocab_size=100, padded_vocab_size=128, d_model=64, n_layers=5, n_heads=4, n_kv_heads=2,
                   head_dim=16, mlp_hidden=96, norm_eps=1e-6, rope_theta=10000.0, sliding_window=8,
                   max_position_embeddings=256, compute_dtype="float32", attention_impl="reference")

# olmax's C++ CPU kernels: skipped where JAX's backend is not the CPU (tests/conftest.py).
pytestmark = pytest.mark.cpu_only
needs_kernel = pytest.mark.skipif(not cpu_kernels.available(), reason=f"{cpu_kernels.unavailable_reason()}")


def test_the_kernel_is_built_where_it_can_run() -> None:
    """Where the kernel can run (x86-64 with AVX2 and FMA, a C++ compiler, not turned off) it
    must build and register: otherwise a broken build would only skip the tests below, and the
    suite would pass without testing the kernel that decoding uses."""
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if cpu_kernels.cpu_unsupported() or not compiler or os.environ.get("OLMAX_CPU_KERNELS", "1") == "0":
        pytest.skip("the kernel cannot run here")
    assert cpu_kernels.available(), cpu_kernels.unavailable_reason()


@needs_kernel
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 7, 8, 12, 13, 32, 70])
@pytest.mark.parametrize("shape", [(64, 48), (37, 40), (512, 1000)])
def test_kernel_equals_the_float64_product(rows: int, shape: tuple[int, int]) -> None:
    """Odd input sizes (37: not a multiple of the one-row kernel's 4), output sizes that leave a
    part-filled last panel (40, 1000), one row (four panels at a time) and row blocks of every
    size: within fp32 rounding of the float64 product, and as close as XLA's own fp32 matmul."""
    i, o = shape
    kx, kw = jax.random.split(jax.random.key(rows * 1000 + i))
    x = normal(kx, (rows, i), jnp.float32)
    w = normal(kw, (i, o), jnp.float32)
    got = np.asarray(jax.jit(lambda x, p: cpu_kernels.skinny_matmul(x, p, o))(x, cpu_kernels.pack(w)))
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    assert got.shape == (rows, o) and got.dtype == np.float32
    scale = np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64))  # the sum's error bound scale
    err = np.abs(got - exact) / scale
    xla = np.abs(np.asarray(x @ w, np.float64) - exact) / scale
    assert err.max() <= i * np.finfo(np.float32).eps, err.max()
    assert err.max() <= max(4 * xla.max(), 4 * np.finfo(np.float32).eps)


def test_pack_round_trips_exactly() -> None:
    w = normal(jax.random.key(0), (37, 40))
    for p in (cpu_kernels.pack(w), cpu_kernels._pack_xla(w)):   # the kernel's (where built) and XLA's
        assert p.shape == (3, 37, 16)
        assert np.array_equal(np.asarray(cpu_kernels.unpack(p, 40)), np.asarray(w))
        assert not np.asarray(p[2, :, 8:]).any()  # the last panel's padding is zeros


@needs_kernel
@pytest.mark.parametrize("shape", [(37, 40), (512, 1000), (3, 16), (5, 1), (1536, 512)])
def test_the_kernels_pack_is_xlas(shape: tuple[int, int]) -> None:
    """The kernel's pack (RL packs the weights again after every update) moves the same numbers
    to the same places as XLA's transpose, padding included, inside a jitted program too."""
    w = normal(jax.random.key(5), shape)
    want = np.asarray(cpu_kernels._pack_xla(w))
    assert np.array_equal(np.asarray(cpu_kernels.pack(w)), want)
    assert np.array_equal(np.asarray(jax.jit(cpu_kernels.pack)(w)), want)


@needs_kernel
def test_a_row_has_the_same_bits_in_any_batch() -> None:
    """Each output element is one multiply-add chain over the input in order, whichever row
    block, thread or kernel (one row, or blocks of up to 6 or 12 rows) computes it: a row alone,
    and in batches of 2 to 40, gives the same bits. (XLA CPU's matmul does not: rows of M = 8 or 32 differ from
    M = 1 in the last bits; README, RL.)"""
    w = normal(jax.random.key(1), (512, 1024))
    x = normal(jax.random.key(2), (40, 512))
    p = cpu_kernels.pack(w)
    f = jax.jit(lambda x, p: cpu_kernels.skinny_matmul(x, p, 1024))
    alone = np.stack([np.asarray(f(x[r:r + 1], p))[0] for r in range(40)])
    for rows in (2, 5, 8, 13, 32, 40):
        assert np.array_equal(np.asarray(f(x[:rows], p)), alone[:rows]), rows


@needs_kernel
def test_kernel_registers_itself_on_first_use() -> None:
    """In a fresh process, a first call straight to the kernel (no ``available()`` before it,
    as ``decode.prepare(layout="packed")`` followed by a step does) registers it with XLA; before
    this, XLA answered "No FFI handler registered"."""
    code = textwrap.dedent("""
        import jax, numpy as np
        from olmax.kernels import cpu as cpu_kernels
        assert "why" not in cpu_kernels._STATE
        w = jax.random.normal(jax.random.key(3), (32, 48))
        x = jax.random.normal(jax.random.key(4), (3, 32))
        got = jax.jit(lambda x, p: cpu_kernels.skinny_matmul(x, p, 48))(x, cpu_kernels.pack(w))
        np.testing.assert_allclose(np.asarray(got), np.asarray(x @ w), rtol=1e-5, atol=1e-5)
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-2000:]


@needs_kernel
def test_kernel_refuses_other_dtypes() -> None:
    with pytest.raises(TypeError, match="fp32 only"):
        cpu_kernels.skinny_matmul(jnp.zeros((2, 8), jnp.bfloat16), jnp.zeros((1, 8, 16), jnp.bfloat16), 16)


@needs_kernel
def test_decoding_uses_the_kernel_and_keeps_the_tokens(monkeypatch) -> None:
    """fp32 decoding on one CPU device goes through the kernel at every batch size (prefill and
    steps) and gives the greedy tokens and log-probs of XLA's products (the kernel turned off),
    the log-probs to fp32 rounding. bf16 compute goes through it too (bf16 numbers in fp32)."""
    params = init_params(TINY, jax.random.key(0))
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12, 13], [9, 10, 11], [3, 4]]
    gen = Generator(params, TINY, Sampling())
    with_kernel = generate(params, TINY, prompts, max_new_tokens=20, generator=gen)
    assert layout_of(gen.weights.prepared) == "packed" and decode_layout(1, TINY) == "packed"
    one = generate(params, TINY, prompts[:1], max_new_tokens=20, generator=gen)[0]
    assert one.token_ids == with_kernel[0].token_ids
    np.testing.assert_allclose(one.logprobs, with_kernel[0].logprobs, atol=2e-5)
    monkeypatch.setattr(cpu_kernels, "_STATE", {"why": "off for this test"})
    gen2 = Generator(params, TINY, Sampling())
    without = generate(params, TINY, prompts, max_new_tokens=20, generator=gen2)
    assert layout_of(gen2.weights.prepared) == "streamed"
    for a, b in zip(with_kernel, without):
        assert a.token_ids == b.token_ids
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=2e-5)
    monkeypatch.setattr(cpu_kernels, "_STATE", {"why": None})
    assert decode_layout(8, replace(TINY, compute_dtype="bfloat16")) == "packed"


@pytest.mark.integration  # builds every source twice (AVX2, AVX-512): about 20 s
def test_the_kernels_build_without_a_warning(tmp_path) -> None:
    """Every C++ source and header beside the builder is compiled (and hashed into the library's
    cache key), with warnings on (-Wall -Wextra, never -w), and for both instruction sets the
    compiler prints nothing: a new warning fails here instead of scrolling past a first run."""
    import platform

    from olmax.kernels.cpu import build
    ours = {p.name for p in build.HERE.iterdir() if p.suffix in (".cc", ".h")}
    assert {p.name for p in (*build.SOURCES, *build.HEADERS)} == ours and len(ours) >= 4
    for isa in cpu_kernels.ISAS:
        assert set(build.WARNINGS) <= set(build.flags(isa)) and "-w" not in build.flags(isa)
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if platform.machine().lower() not in ("x86_64", "amd64") or not compiler:
        pytest.skip("no compiler for x86-64 here")
    for isa in cpu_kernels.ISAS:  # compiling needs no AVX-512 on this CPU, only running it
        printed = build.compile_to(tmp_path / f"{isa}.so", isa)
        assert printed == "" and (tmp_path / f"{isa}.so").stat().st_size > 0, printed


def test_unbuildable_kernel_names_the_reason_and_decoding_goes_on(monkeypatch, tmp_path, caplog) -> None:
    """No compiler that works: ``available()`` is False with the compiler's failure as the
    reason, logged once, and decoding keeps XLA's products. ``OLMAX_CPU_KERNELS=0`` turns the
    kernel off without a warning."""
    monkeypatch.setattr(cpu_kernels, "_STATE", {})
    monkeypatch.setenv("OLMAX_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("CXX", "/bin/false")
    with caplog.at_level("WARNING", logger="olmax.kernels.cpu"):
        assert cpu_kernels.available() is False
        assert cpu_kernels.available() is False
    reason = cpu_kernels.unavailable_reason()
    if "AVX2" in reason or "lacks" in reason:
        pytest.skip(reason)  # no compiler is tried on a CPU the kernel cannot run on
    assert "/bin/false" in reason, reason
    assert sum("not used" in r.message for r in caplog.records) == 1
    assert not list(tmp_path.rglob("*.so"))  # nothing half-built left in the cache
    params = init_params(TINY, jax.random.key(0))
    gen = Generator(params, TINY, Sampling())
    out = generate(params, TINY, [[5, 6, 7]], max_new_tokens=4, generator=gen)
    assert len(out[0].token_ids) == 4 and layout_of(gen.weights.prepared) == "plain"
    monkeypatch.setattr(cpu_kernels, "_STATE", {})
    monkeypatch.setenv("OLMAX_CPU_KERNELS", "0")
    caplog.clear()
    with caplog.at_level("WARNING", logger="olmax.kernels.cpu"):
        assert cpu_kernels.available() is False
    assert "OLMAX_CPU_KERNELS=0" in cpu_kernels.unavailable_reason() and not caplog.records


def _register(isa: str, monkeypatch) -> str:
    """The kernel built for ``isa`` and registered under its own FFI target name."""
    import ctypes

    monkeypatch.setenv("OLMAX_CPU_KERNEL_ISA", isa)
    lib = ctypes.cdll.LoadLibrary(str(cpu_kernels._build()))
    name = f"olmax_skinny_matmul_test_{isa}"
    jax.ffi.register_ffi_target(name, jax.ffi.pycapsule(lib.OlmaxSkinnyMatmul), platform="cpu")
    return name


@pytest.mark.integration
@needs_kernel
def test_the_avx2_and_avx512_builds_give_the_same_bits(monkeypatch) -> None:
    """Where the CPU has AVX-512VL the kernel is built with 32 vector registers and blocks of 12
    rows, else with AVX2's 16 and blocks of 6: the same multiply-add chains either way, so a
    machine of either kind decodes the same bits. Both builds, every row count from 1 to 30."""
    if not cpu_kernels.has_avx512():
        pytest.skip("this CPU has no AVX-512VL: only the AVX2 build runs here")
    assert cpu_kernels.isa() == "avx512"
    w = jax.random.normal(jax.random.key(5), (200, 72))
    x = jax.random.normal(jax.random.key(6), (30, 200))
    p = cpu_kernels.pack(w)
    out = {}
    for isa in cpu_kernels.ISAS:
        name = _register(isa, monkeypatch)
        call = jax.jit(lambda x, p, name=name: jax.ffi.ffi_call(
            name, jax.ShapeDtypeStruct((x.shape[0], 80), jnp.float32))(x, p))
        out[isa] = [np.asarray(call(x[:rows], p)) for rows in range(1, 31)]
    for rows, (a, b) in enumerate(zip(out["avx2"], out["avx512"]), start=1):
        assert np.array_equal(a, b), rows
    np.testing.assert_allclose(out["avx512"][-1][:, :72], np.asarray(x @ w), rtol=1e-4, atol=1e-4)


def test_a_bad_instruction_set_choice_is_named(monkeypatch) -> None:
    monkeypatch.setenv("OLMAX_CPU_KERNEL_ISA", "sse9")
    with pytest.raises(ValueError, match="OLMAX_CPU_KERNEL_ISA='sse9'"):
        cpu_kernels.isa()
    if cpu_kernels.cpu_unsupported() is None:
        monkeypatch.setattr(cpu_kernels, "_STATE", {})
        assert cpu_kernels.available() is False
        assert "OLMAX_CPU_KERNEL_ISA" in cpu_kernels.unavailable_reason()
    if not cpu_kernels.has_avx512():
        monkeypatch.setenv("OLMAX_CPU_KERNEL_ISA", "avx512")
        with pytest.raises(ValueError, match="lacks AVX-512"):
            cpu_kernels.isa()


@needs_kernel
@pytest.mark.parametrize("b,kv,g,s,e,window", [(1, 2, 2, 24, 16, None), (3, 4, 1, 40, 64, 8), (2, 1, 3, 17, 20, 5),
                                               (2, 2, 2, 33, 128, None)])
def test_cache_attention_equals_the_reference(b: int, kv: int, g: int, s: int, e: int, window: int | None) -> None:
    """The kernel's decode attention against ``attention.cache_attention`` (XLA) and float64:
    slots out of position order with empty ones (-1), a sliding window, grouped queries, a head
    size that is not a multiple of 8; and each row alone gives the bits it gives in the batch."""
    from olmax.model.attention import cache_attention
    from olmax.model.layers import position_mask

    keys = jax.random.split(jax.random.key(b * 100 + s), 4)
    q = normal(keys[0], (b, kv, g, e), jnp.float32)
    k = normal(keys[1], (b, kv, s, e), jnp.float32)
    v = normal(keys[2], (b, kv, s, e), jnp.float32)
    rng = np.random.default_rng(s)
    k_pos = np.stack([rng.permutation(s) - rng.integers(0, 4) for _ in range(b)]).astype(np.int32)  # some -1..-3: empty
    k_pos[k_pos < 0] = -1
    q_pos = k_pos.max(axis=1, keepdims=True)
    seen = position_mask(jnp.asarray(q_pos), jnp.asarray(k_pos), window)[:, 0]
    got = np.asarray(jax.jit(cpu_kernels.cache_attention)(q, k, v, seen))
    # XLA's, compiled whole (op by op, each of its operations compiles on its own).
    xla_attention = jax.jit(lambda q, k_pos: cache_attention(q.reshape(b, 1, kv * g, e), k, v, jnp.asarray(q_pos),
                                                             k_pos, window, head_major=True).reshape(b, kv, g, e))
    xla = np.asarray(xla_attention(q, jnp.asarray(k_pos)))
    q64, k64, v64, m = (np.asarray(a, np.float64) for a in (q, k, v, seen))
    sc = np.einsum("bkge,bkse->bkgs", q64, k64) / np.sqrt(e)
    sc = np.where(m[:, None, None] > 0, sc, -np.inf)
    p = np.exp(sc - sc.max(-1, keepdims=True))
    exact = np.einsum("bkgs,bkse->bkge", p / p.sum(-1, keepdims=True), v64)
    assert got.shape == (b, kv, g, e) and got.dtype == np.float32
    np.testing.assert_allclose(got, exact, rtol=0, atol=2e-6)
    np.testing.assert_allclose(got, xla, rtol=0, atol=2e-6)
    for r in range(b):
        alone = np.asarray(cpu_kernels.cache_attention(q[r:r + 1], k[r:r + 1], v[r:r + 1], seen[r:r + 1]))
        assert np.array_equal(alone[0], got[r]), r
    # A query that sees no slot weighs them all alike, as XLA's does (never in a decode step,
    # which sees its own token; the kernel lists the seen slots and must not come out empty).
    blind = jnp.zeros_like(seen)
    none = np.asarray(xla_attention(q, jnp.full_like(k_pos, -1)))
    np.testing.assert_allclose(np.asarray(cpu_kernels.cache_attention(q, k, v, blind)), none, rtol=0, atol=2e-6)
