"""olmax's C++ kernels for x86-64 CPUs, built on first use, and their ``jax.ffi`` calls. The
model reaches them through ``olmax.model.dispatch``, which decides where each one runs.

The sources beside this file, one per purpose (``build.py`` compiles them into one library):

- ``decode.cc``: the decode steps' products and attention. A decode step multiplies one to a few
  dozen rows by every weight of the model: a pass over the weights, which XLA CPU's products make
  below the machine's speed for a few rows. ``skinny_matmul`` reads weights packed in panels of 16
  output columns (``pack``: [in, out] -> [panels, in, 16], itself in the kernel, as RL packs the
  weights again after every update), each panel once for all rows, and shares the panels out
  between the calling thread and XLA's own intra-op thread pool. ``cache_attention`` reads each
  row's and kv head's cached keys and values once, only the slots its query sees. The README
  (Benchmarks, decode speed) has what they gain end to end.
- ``attention.cc``: ``flash_attention``, the training attention on the CPU (forward and backward;
  the ``cpu`` attention implementation, what "auto" picks in fp32 with
  ``model.cpu_training_kernels``), and ``sequence_attention``, the decode step's attention over
  whole sequences.
- ``projections.cc``: ``swiglu`` (on the CPU in fp32: the decode steps and RL's forward, and
  training with ``model.cpu_training_kernels``) and ``qkv`` (the attention's q, k and v from its
  projection: the split, q/k RMSNorm and RoPE, for training and evaluation with that switch), the
  elementwise work around the products in one pass each way; ``rms_norm`` and
  ``row_sums`` in one fixed order.
- ``common.h``: what they share (work sharing, the fixed-order dot product and lane sums, one
  query's attention, the vectorised exponential).

``matmul``, ``sequence_attention``, ``rms_norm`` and ``row_sums`` let a training forward repeat
the decode steps' arithmetic (``olmax.model.dispatch.reproduce_decode_bits``: RL's log-probs equal
the sampler's), with XLA's gradients. Every output element is one fixed order of operations (the
products: one fused multiply-add chain over the input axis in order), so a row's result does not
depend on the other rows of the batch (tested bit for bit), and it is within fp32 rounding of
XLA's (a different order of the same sums).

Used only where it can run: an x86-64 CPU with AVX2 and FMA; where the CPU also has AVX-512F and
AVX-512VL the build may use 32 vector registers, and a block holds 12 rows instead of 6 (``isa()``;
the same multiply-add chains, so the same bits as the AVX2 build, tested). Where it cannot be built
or loaded, ``available()`` is False with the reason in ``unavailable_reason()`` (logged once), and
the dispatch keeps XLA's implementations; ``OLMAX_CPU_KERNELS=0`` turns it off. Traced for a CPU
mesh of several devices, each device runs a kernel on its block of the batch
(``_per_batch_shard``).
"""

from __future__ import annotations

import ctypes
import logging
import os
import platform
from functools import partial
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec

from olmax.kernels.cpu import build
from olmax.sharding import BATCH_AXES, current_mesh

log = logging.getLogger(__name__)

TARGET = "olmax_skinny_matmul"
ATTENTION = "olmax_cache_attention"
SEQUENCE = "olmax_sequence_attention"
NORM = "olmax_rms_norm"
SUMS = "olmax_row_sums"
FLASH_FWD = "olmax_flash_forward"
FLASH_BWD = "olmax_flash_backward"
SWIGLU_FWD = "olmax_swiglu_forward"
SWIGLU_BWD = "olmax_swiglu_backward"
QKV_FWD = "olmax_qkv_forward"
QKV_BWD = "olmax_qkv_backward"
PACK = "olmax_pack"
PANEL = 16
_STATE: dict[str, object] = {}



# Each FFI target's handler in the built library (``XLA_FFI_DEFINE_HANDLER_SYMBOL`` in the .cc files).
_SYMBOLS = {
    TARGET: "OlmaxSkinnyMatmul",
    ATTENTION: "OlmaxCacheAttention",
    PACK: "OlmaxPack",
    SEQUENCE: "OlmaxSequenceAttention",
    NORM: "OlmaxRmsNorm",
    SUMS: "OlmaxRowSums",
    FLASH_FWD: "OlmaxFlashForward",
    FLASH_BWD: "OlmaxFlashBackward",
    SWIGLU_FWD: "OlmaxSwigluForward",
    SWIGLU_BWD: "OlmaxSwigluBackward",
    QKV_FWD: "OlmaxQkvForward",
    QKV_BWD: "OlmaxQkvBackward",
}

def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


ISAS = ("avx2", "avx512")


def has_avx512() -> bool:
    """Whether this CPU has AVX-512F and AVX-512VL (the 12-row build, ``isa()``)."""
    return {"avx512f", "avx512vl"} <= _cpu_flags()


def cpu_unsupported() -> str | None:
    """Why this CPU cannot run the kernel (not x86-64, or no AVX2 and FMA), or None."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the kernel is written for x86-64 with AVX2 and FMA, not {platform.machine()}"
    missing = {"avx2", "fma"} - _cpu_flags()
    return f"this CPU lacks {', '.join(sorted(missing))}" if missing else None


def isa() -> str:
    """The instruction set the kernel is built for: ``avx512`` (AVX-512F and VL: 256-bit
    instructions with 32 registers, 12 rows per block) where the CPU has it, else ``avx2``.
    ``OLMAX_CPU_KERNEL_ISA=avx2`` builds the AVX2 kernel on any CPU (to compare the two)."""
    want = os.environ.get("OLMAX_CPU_KERNEL_ISA", "").strip().lower()
    if want and want not in ISAS:
        raise ValueError(f"OLMAX_CPU_KERNEL_ISA={want!r}: expected one of {', '.join(ISAS)}")
    if want == "avx512" and not has_avx512():
        raise ValueError("OLMAX_CPU_KERNEL_ISA=avx512: this CPU lacks AVX-512F or AVX-512VL")
    if want:
        return want
    return "avx512" if has_avx512() else "avx2"


def _build() -> Path:
    """The compiled library for this CPU's instruction set (``build.library``)."""
    return build.library(isa())


def _load() -> str | None:
    """None when the kernel is registered with XLA, else why it is not."""
    if os.environ.get("OLMAX_CPU_KERNELS", "1") == "0":
        return "turned off by OLMAX_CPU_KERNELS=0"
    why = cpu_unsupported()
    if why:
        return why
    try:
        lib = ctypes.cdll.LoadLibrary(str(_build()))
        for target, symbol in _SYMBOLS.items():
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    except (RuntimeError, OSError, AttributeError, ValueError) as e:
        return str(e)
    return None


def available() -> bool:
    """Whether the kernel is built and registered (built on the first call; cheap after)."""
    if "why" not in _STATE:
        _STATE["why"] = _load()
        if _STATE["why"] is not None and os.environ.get("OLMAX_CPU_KERNELS", "1") != "0":
            log.warning("olmax's CPU kernels are not used (decoding keeps XLA's products, training XLA's blocked "
                        "attention): %s", _STATE["why"])
    return _STATE["why"] is None


def unavailable_reason() -> str | None:
    available()
    return _STATE["why"]  # type: ignore[return-value]


def pack(w: jax.Array) -> jax.Array:
    """[in, out] fp32 -> [ceil(out / 16), in, 16], zero columns padding the last panel: in the
    kernel where it is available (XLA's transpose took about twice as long, 63 ms for the 143 MB of
    the benchmark model's weights), else by XLA. The same numbers either way (a copy)."""
    i, o = w.shape
    if w.dtype == jnp.float32 and available():
        return jax.ffi.ffi_call(PACK, jax.ShapeDtypeStruct((-(-o // PANEL), i, PANEL), jnp.float32))(w)
    return _pack_xla(w)


def _pack_xla(w: jax.Array) -> jax.Array:
    i, o = w.shape
    pad = -o % PANEL
    if pad:
        w = jnp.pad(w, ((0, 0), (0, pad)))
    return w.reshape(i, -1, PANEL).transpose(1, 0, 2)


def unpack(p: jax.Array, out: int) -> jax.Array:
    """``pack``'s inverse: [panels, in, 16] -> [in, out]."""
    return p.transpose(1, 0, 2).reshape(p.shape[1], -1)[:, :out]


def _require(*arrays: jax.Array) -> None:
    """fp32 inputs and a kernel that is built (registered with XLA on first use), or the reason."""
    if not all(a.dtype == jnp.float32 for a in arrays):
        raise TypeError(f"olmax's CPU kernels are fp32 only, got {', '.join(str(a.dtype) for a in arrays)}")
    if not available():
        raise RuntimeError(f"olmax's CPU kernels are not available: {unavailable_reason()}")


def _per_batch_shard(fn, batched: tuple, replicated: tuple = (), dims: tuple | None = None) -> jax.Array:
    """``fn(*batched, *replicated)``; traced for a mesh of several devices (``olmax.sharding.
    activation_mesh``), each device runs it on its block of the batch (``batched`` split over
    the data-parallel axes along ``dims``, default the leading axis of each; ``replicated``
    whole; the output split along its leading axis). The kernels are row by row, so a row's bits
    are those of one device; without this
    XLA would run the call on every device over the whole batch."""
    mesh = current_mesh()
    axes = () if mesh is None else tuple(a for a in BATCH_AXES if mesh.shape.get(a, 1) > 1)
    if not axes:
        return fn(*batched, *replicated)
    dims = dims or (0,) * len(batched)

    def spec(dim: int) -> PartitionSpec:
        return PartitionSpec(*([None] * dim), axes)

    return jax.shard_map(fn, mesh=mesh, in_specs=(*map(spec, dims), *(PartitionSpec(),) * len(replicated)),
                         out_specs=spec(0), check_vma=False)(*batched, *replicated)


def skinny_matmul(x: jax.Array, p: jax.Array, out: int) -> jax.Array:
    """x [rows, in] fp32 @ the packed weight -> [rows, out] fp32, in the kernel."""
    _require(x, p)
    y = _per_batch_shard(lambda x, p: jax.ffi.ffi_call(
        TARGET, jax.ShapeDtypeStruct((x.shape[0], p.shape[0] * PANEL), jnp.float32))(x, p), (x,), (p,))
    return y if y.shape[1] == out else y[:, :out]


def cache_attention(q: jax.Array, k: jax.Array, v: jax.Array, seen: jax.Array) -> jax.Array:
    """The decode step's attention in the kernel: q [b, kv_heads, g, e] over the head-major cache
    k, v [b, kv_heads, S, e] (or a layer's stack of one, [1, b, kv_heads, S, e]), ``seen`` [b, S] (bool: the
    slots each row's query sees) -> [b, kv_heads, g, e], fp32: ``olmax.model.attention.cache_attention`` for one
    query per row."""
    _require(q, k, v)
    scale = np.float32(q.shape[-1] ** -0.5)
    stacked = int(k.ndim == 5)  # a layer's stack of one: the batch is its second axis
    return _per_batch_shard(
        lambda q, k, v, seen: jax.ffi.ffi_call(ATTENTION, jax.ShapeDtypeStruct(q.shape, jnp.float32))(
            q, k, v, seen, scale=scale), (q, k, v, seen.astype(jnp.int32)), dims=(0, stacked, stacked, 0))


def sequence_attention(q: jax.Array, k: jax.Array, v: jax.Array, window: int | None,
                       starts: jax.Array | None = None) -> jax.Array:
    """Causal self-attention of whole sequences with the decode step's arithmetic: q [b, t, h, e],
    k, v [b, t, kv_heads, e] -> [b, t, h, e], fp32. Each query is computed as ``cache_attention``
    computes a decode step's, over the same keys in the order the decode cache holds them (by
    position on full layers, by position mod ``window`` on sliding ones), so a prefill and a
    training forward give the bits the decode steps give (RL's log-probs). ``starts`` [b, t]
    (int): where each query's document begins in its row (packed documents; default 0, one
    sequence per row); a query sees its document only, as if it were alone. Forward only; see
    ``olmax.model.dispatch.attention_as_decoded`` for the gradient."""
    _require(q, k, v)
    scale = np.float32(q.shape[-1] ** -0.5)
    starts = jnp.zeros(q.shape[:2], jnp.int32) if starts is None else starts.astype(jnp.int32)
    return _per_batch_shard(lambda q, k, v, s: jax.ffi.ffi_call(SEQUENCE, jax.ShapeDtypeStruct(q.shape, jnp.float32))(
        q, k, v, s, scale=scale, window=np.int64(window or 0)), (q, k, v, starts))


@jax.custom_vjp
def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [rows, in] @ w [in, out], fp32, through the decode steps' kernel (``pack`` then the
    product): each element the decode step's multiply-add chain, so a training forward gives the
    bits a decode step gives. The gradient is XLA's (dx = dy w^T, dw = x^T dy)."""
    return skinny_matmul(x, pack(w), w.shape[1])


def _matmul_fwd(x: jax.Array, w: jax.Array) -> tuple[jax.Array, tuple]:
    return matmul(x, w), (x, w)


def _matmul_bwd(res: tuple, dy: jax.Array) -> tuple[jax.Array, jax.Array]:
    x, w = res
    return dy @ w.T, x.T @ dy


matmul.defvjp(_matmul_fwd, _matmul_bwd)


def rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    """RMSNorm over the last axis, fp32, in the kernel: the same bits for a row in any batch and
    any program. Forward only: ``olmax.model.dispatch.rms_norm`` uses it (reproducing the decode
    steps' bits) and gives it XLA's RMSNorm's gradient."""
    _require(x, w)
    rows = x.reshape(-1, x.shape[-1])
    y = _per_batch_shard(lambda r, w: jax.ffi.ffi_call(NORM, jax.ShapeDtypeStruct(r.shape, jnp.float32))(
        r, w, eps=np.float32(eps)), (rows,), (w,))
    return y.reshape(x.shape)


@jax.custom_vjp
def row_sums(x: jax.Array) -> jax.Array:
    """Sums over the last axis (keepdims), fp32, in the kernel: the same bits for a row in any
    batch and any program (``olmax.model.dispatch.log_softmax``)."""
    _require(x)
    rows = x.reshape(-1, x.shape[-1])
    sums = _per_batch_shard(lambda r: jax.ffi.ffi_call(SUMS, jax.ShapeDtypeStruct(r.shape[:1], jnp.float32))(r),
                            (rows,))
    return sums.reshape(*x.shape[:-1], 1)


row_sums.defvjp(lambda x: (row_sums(x), x.shape), lambda shape, dy: (jnp.broadcast_to(dy, shape),))


def flash_supported(q: jax.Array, k: jax.Array) -> bool:
    """Whether ``flash_attention`` runs these: fp32, heads a multiple of 16 wide, a kernel built."""
    return (q.dtype == jnp.float32 and k.dtype == jnp.float32 and q.shape[-1] % PANEL == 0
            and q.shape[2] % k.shape[2] == 0 and available())


def _flash_attrs(q: jax.Array, window: int | None, block: int, segments: bool) -> dict:
    return dict(scale=np.float32(q.shape[-1] ** -0.5), window=np.int64(window or 0), block=np.int64(block),
                segments=np.int64(segments))


def _flash_forward(q, k, v, seg, window, block, segments):
    b, t, h, _ = q.shape
    attrs = _flash_attrs(q, window, block, segments)
    return _per_batch_shard(lambda q, k, v, seg: tuple(jax.ffi.ffi_call(
        FLASH_FWD, (jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct((q.shape[0], h, t), jnp.float32)))(
        q, k, v, seg, **attrs)), (q, k, v, seg))


@partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _flash(q, k, v, seg, window, block, segments):
    return _flash_forward(q, k, v, seg, window, block, segments)[0]


def _flash_fwd(q, k, v, seg, window, block, segments):
    out, lse = _flash_forward(q, k, v, seg, window, block, segments)
    return out, (q, k, v, seg, out, lse)


def _flash_bwd(window, block, segments, res, dout):
    q, k, v, seg, out, lse = res
    attrs = _flash_attrs(q, window, block, segments)
    dq, dk, dv = _per_batch_shard(lambda q, k, v, seg, out, lse, dout: tuple(jax.ffi.ffi_call(
        FLASH_BWD, (jax.ShapeDtypeStruct(q.shape, jnp.float32), jax.ShapeDtypeStruct(k.shape, jnp.float32),
                    jax.ShapeDtypeStruct(v.shape, jnp.float32)))(q, k, v, seg, out, lse, dout, **attrs)),
        (q, k, v, seg, out, lse, dout.astype(jnp.float32)))
    return dq, dk, dv, None


_flash.defvjp(_flash_fwd, _flash_bwd)


def flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, window: int | None, segment_ids: jax.Array | None = None,
                    block: int = 64) -> jax.Array:
    """Causal self-attention for training on the CPU, forward and backward in the kernel: q [b, t,
    h, e], k, v [b, t, kv_heads, e] -> [b, t, h, e], fp32 (``flash_supported``). The function
    ``olmax.model.attention.blocked_attention`` computes, block by block of ``block`` queries
    over the keys each block sees, with each block's scores, softmax and products in one piece
    of work in cache and the exponentials vectorised (within fp32 rounding of it, tested); the
    backward recomputes the probabilities from the saved log-sum-exp. ``segment_ids`` [b, t]: a
    query sees only keys of its own segment."""
    _require(q, k, v)
    if not flash_supported(q, k):
        raise ValueError(f"flash_attention: heads must be a multiple of {PANEL} wide and q's a multiple of k's, "
                         f"got q {q.shape}, k {k.shape}")
    seg = jnp.zeros(q.shape[:2], jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    return _flash(q, k, v, seg, window, block, segment_ids is not None)


def swiglu_supported(gu: jax.Array) -> bool:
    """Whether ``swiglu`` runs this: fp32, an even last axis, a kernel built."""
    return gu.dtype == jnp.float32 and gu.shape[-1] % 2 == 0 and available()


def _swiglu_call(name: str, out_cols: int, *arrays: jax.Array) -> jax.Array:
    rows = tuple(a.reshape(-1, a.shape[-1]) for a in arrays)
    y = _per_batch_shard(
        lambda *r: jax.ffi.ffi_call(name, jax.ShapeDtypeStruct((r[0].shape[0], out_cols), jnp.float32))(*r), rows)
    return y.reshape(*arrays[0].shape[:-1], out_cols)


@jax.custom_vjp
def swiglu(gu: jax.Array) -> jax.Array:
    """``silu(g) * u`` of ``gu = [g | u]`` (last axis, fp32), forward and backward in the kernel,
    one pass over the rows each: ``olmax.model.dispatch.swiglu`` on the CPU (within fp32 rounding
    of XLA's, tested). The backward keeps only ``gu``."""
    _require(gu)
    return _swiglu_call(SWIGLU_FWD, gu.shape[-1] // 2, gu)


def _swiglu_bwd(gu: jax.Array, dy: jax.Array) -> tuple[jax.Array]:
    return (_swiglu_call(SWIGLU_BWD, gu.shape[-1], gu, dy.astype(jnp.float32)),)


swiglu.defvjp(lambda gu: (swiglu(gu), gu), _swiglu_bwd)


def qkv_supported(x: jax.Array, wq: jax.Array, wk: jax.Array, cos: jax.Array, heads: int, kv_heads: int) -> bool:
    """Whether ``qkv`` runs these: fp32, cos/sin tables [t, e] (every row) or [b, t, e] (per-row
    positions: packed documents), heads a multiple of 16 wide, a kernel built."""
    width = heads + 2 * kv_heads
    if not (all(a.dtype == jnp.float32 for a in (x, wq, wk, cos)) and x.ndim == 3 and x.shape[-1] % width == 0):
        return False
    e = x.shape[-1] // width
    return (e % PANEL == 0 and cos.shape in ((x.shape[1], e), (*x.shape[:2], e)) and wq.shape == (heads * e,)
            and wk.shape == (kv_heads * e,) and available())


def _qkv_chunk(t: int) -> int:
    """Rows per partial sum of the norm weights' gradient: the largest divisor of the sequence
    length up to 64 (whole sequences split evenly, so a batch shard holds whole chunks)."""
    return max(c for c in range(1, min(t, 64) + 1) if t % c == 0)


def _tables(cos: jax.Array, sin: jax.Array) -> tuple[tuple, tuple]:
    """(batched, replicated) for ``_per_batch_shard``: per-row tables [b, t, e] go with the rows
    (the kernel reads row n's at n), one table [t, e] to every device (row n's at n mod t)."""
    if cos.ndim == 3:
        return (cos.reshape(-1, cos.shape[-1]), sin.reshape(-1, sin.shape[-1])), ()
    return (), (cos, sin)


def _qkv_forward(x, wq, wk, cos, sin, heads, kv_heads, eps):
    b, t, d = x.shape
    e = d // (heads + 2 * kv_heads)
    per_row, shared = _tables(cos, sin)

    def call(rows, *rest):
        cos, sin, wq, wk = rest  # the tables come first either way
        n = rows.shape[0]
        out = tuple(jax.ShapeDtypeStruct(shape, jnp.float32) for shape in
                    ((n, heads * e), (n, kv_heads * e), (n, kv_heads * e), (n, 2)))
        return tuple(jax.ffi.ffi_call(QKV_FWD, out)(rows, wq, wk, cos, sin, heads=np.int64(heads),
                                                     kv_heads=np.int64(kv_heads), eps=np.float32(eps)))

    q, k, v, r = _per_batch_shard(call, (x.reshape(b * t, d), *per_row), (*shared, wq, wk))
    return (q.reshape(b, t, heads, e), k.reshape(b, t, kv_heads, e), v.reshape(b, t, kv_heads, e)), r


@partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7))
def qkv(x: jax.Array, wq: jax.Array, wk: jax.Array, cos: jax.Array, sin: jax.Array, heads: int, kv_heads: int,
        eps: float) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The attention's q, k, v [b, t, heads | kv_heads, e] from its projection x = [q | k | v] [b,
    t, (heads + 2 kv_heads) e], fp32, forward and backward in the kernel: q and k RMSNormed over
    their whole width with weights ``wq`` / ``wk`` (``eps``), then RoPE with the tables cos/sin
    ([t, e], or [b, t, e] per row); v as it is (``olmax.model.dispatch.qkv`` on the CPU, within
    fp32 rounding of XLA's split, ``rms_norm`` and ``apply_rope``, tested). The backward
    gives dx in one buffer and the weights' gradients; cos and sin get none (constants)."""
    _require(x, wq, wk, cos, sin)
    return _qkv_forward(x, wq, wk, cos, sin, heads, kv_heads, eps)[0]


def _qkv_fwd(x, wq, wk, cos, sin, heads, kv_heads, eps):
    out, r = _qkv_forward(x, wq, wk, cos, sin, heads, kv_heads, eps)
    return out, (x, wq, wk, cos, sin, r)


def _qkv_bwd(heads, kv_heads, eps, res, grads):
    x, wq, wk, cos, sin, r = res
    b, t, d = x.shape
    chunk = _qkv_chunk(t)
    per_row, shared = _tables(cos, sin)
    dq, dk, dv = (g.astype(jnp.float32).reshape(b * t, -1) for g in grads)

    def call(rows, r, dq, dk, dv, *rest):
        cos, sin, wq, wk = rest  # the tables come first either way
        n = rows.shape[0]
        out = (jax.ShapeDtypeStruct(rows.shape, jnp.float32),
               jax.ShapeDtypeStruct((n // chunk, wq.shape[0]), jnp.float32),
               jax.ShapeDtypeStruct((n // chunk, wk.shape[0]), jnp.float32))
        return tuple(jax.ffi.ffi_call(QKV_BWD, out)(rows, wq, wk, cos, sin, r, dq, dk, dv, heads=np.int64(heads),
                                                     kv_heads=np.int64(kv_heads), chunk=np.int64(chunk),
                                                     eps=np.float32(eps)))

    dx, dwq, dwk = _per_batch_shard(call, (x.reshape(b * t, d), r, dq, dk, dv, *per_row), (*shared, wq, wk))
    return dx.reshape(b, t, d), jnp.sum(dwq, axis=0), jnp.sum(dwk, axis=0), jnp.zeros_like(cos), jnp.zeros_like(sin)


qkv.defvjp(_qkv_fwd, _qkv_bwd)
