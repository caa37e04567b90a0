"""Which implementation runs each operation of the model on the platform the program targets.

The one place in ``olmax.model`` that asks which platform that is (``target_platform``,
``device_platform``), and the model's only door to the platform kernels (``olmax.kernels``). The
model files (``olmo3``, ``attention``, ``decode``, ``layers``) describe the model and call these;
none tests the platform.

- Attention (``attend``): ``reference`` and ``blocked`` (XLA, ``olmax.model.attention``), ``cpu``
  (olmax's C++ kernel), ``splash`` (TPU Pallas), ``cudnn`` / ``xla``
  (``jax.nn.dot_product_attention``); ``resolve_attention`` turns ``model.attention_impl="auto"``
  into one per platform and dtype, ``attention_impl`` names the one a call runs.
- The projections (``matmul``, ``lm_head_matmul``), SwiGLU (``swiglu``), the attention's q, k and v
  (``qkv``: the split, q/k RMSNorm and RoPE), RMSNorm (``rms_norm``) and the log-softmax: olmax's
  CPU kernels on the CPU in fp32 where they are built, else XLA, in the layout each platform runs
  fastest (``joined_projections``).
- The decode steps: the layout of their weights (``decode_layout``: ``packed`` for olmax's CPU
  kernels), the kernels' products (``packed_matmul``, ``pack``), cache attention
  (``kernel_cache_attention``) and the cache's layout (``head_major_cache``).
- Exact float32 products on TPUs and GPUs (``fp32_products``, ``exact_fp32``).
- Reproducing the decode steps' bits (``reproduce_decode_bits``): a training forward computed with
  the CPU decode kernels' arithmetic, so that RL's log-probs are the sampler's bit for bit.
- ``describe``: what a run on a platform uses (the run directory's ``run_info.json``).
"""

from __future__ import annotations

import contextlib
import contextvars
import os
from functools import partial, wraps
from typing import Any

import jax
import jax.numpy as jnp

import olmax.model.attention as attention
import olmax.model.layers as layers
from olmax.config import ModelConfig
from olmax.kernels import cpu
from olmax.model.layers import kernel_input, kernel_output
from olmax.sharding import current_mesh

KERNELS = "olmax-cpu-cc"  # olmax's C++ CPU kernels, as ``describe`` names them
XLA = "xla"


def device_platform() -> str:
    """The platform of the devices the program is compiled for: the activation mesh's (abstract
    TPU devices during an ahead-of-time compile on a CPU host), else JAX's default backend."""
    mesh = current_mesh()
    if mesh is not None:
        return mesh.devices.flat[0].platform
    return jax.default_backend()


def target_platform() -> str:
    """The platform whose program the model traces (its layouts and implementations): the
    devices' (``device_platform``). A rehearsal traces another platform's program on CPU devices
    by replacing this function (``benchmarks/chip_check.py --rehearse``, the accelerator-path
    tests); a kernel that compiles only for its own devices (splash, interpreted elsewhere)
    follows ``device_platform``."""
    return device_platform()


# --------------------------------------------------------------------------- float32 products


def fp32_precision(dtype: Any) -> str | None:
    """``"float32"``, the ``jax.default_matmul_precision`` under which a model computing in
    ``dtype`` traces its dots, where that is float32 on a TPU or GPU; None (the backend's
    default) otherwise. JAX's default precision lets an accelerator compute a float32 dot coarser
    and faster: NVIDIA GPUs since Ampere with TF32 (10-bit mantissa), TPUs in one bf16 pass.
    PyTorch (transformers, OLMo-core) multiplies float32 in float32 unless told otherwise, and so
    does olmax: measured on an H200 (2026-12-04, jax 0.11.2), RL's fp32 log-prob gap
    (``benchmarks/bench_logprob_gap.py``) was 4.4e-3 under the default and 8.6e-6 with float32
    products. bf16 compute is left as it is (its float32 dots keep the backend's default, as
    training's speed and the TPU compiles assume), and so is the CPU, whose float32 dots are
    float32 either way: its programs stay as they were."""
    if jnp.dtype(dtype) != jnp.float32 or target_platform() == "cpu":
        return None
    return "float32"


def fp32_products(dtype: Any) -> contextlib.AbstractContextManager:
    """A context in which the dots traced for a model computing in ``dtype`` are exact when that
    is float32 (``fp32_precision``). Gradients inherit the precision of the dots they transpose; a
    ``custom_vjp`` backward is traced apart and enters it itself (the blocked attention's, given
    the precision). Not covered: splash's Pallas backward kernels (TPU, fp32 compute only), which
    keep Mosaic's default."""
    precision = fp32_precision(dtype)
    return contextlib.nullcontext() if precision is None else jax.default_matmul_precision(precision)


def exact_fp32(fn: Any) -> Any:
    """``fn`` (which takes a ``ModelConfig`` among its arguments) traced inside
    ``fp32_products(cfg.compute_dtype)``."""
    @wraps(fn)
    def wrapped(*args: Any, **kwargs: Any) -> Any:
        cfg = next((a for a in (*args, *kwargs.values()) if isinstance(a, ModelConfig)), None)
        if cfg is None:
            raise TypeError(f"{fn.__name__} was called without a ModelConfig")
        with fp32_products(cfg.compute_dtype):
            return fn(*args, **kwargs)
    return wrapped


# --------------------------------------------------------------------------- layouts


def joined_projections() -> bool:
    """Whether the model multiplies by q/k/v, and by gate/up, joined into one weight each (the
    CPU): dx is then one matmul, not a sum of two or three (the sum ran as a slow transposing
    fusion on the CPU). On TPUs and GPUs the weights may be sharded along their output axis,
    where concatenating them would move data. Decoding joins them once, before its loop
    (``olmo3.join_projections``)."""
    return target_platform() == "cpu"


def host_offload_available() -> bool:
    """Whether activations can be offloaded to host memory (``model.remat=offload_proj``): TPUs
    and GPUs have a host apart from the device memory; the CPU is the host."""
    return target_platform() != "cpu"


def head_major_cache() -> bool:
    """Whether the KV cache is [.., b, kv_heads, S, e] (the CPU) rather than [.., b, S, kv_heads,
    e]. The decode step's attention contracts each head's keys; from slot-major keys XLA CPU
    first copied every layer's whole cache into head-major order, on every token (16 transposing
    copies, a quarter to a third of a batch-8 decode step of the benchmark's model)."""
    return target_platform() == "cpu"


def unrolled_decode_layers() -> bool:
    """Whether decoding runs the layers unrolled (the CPU): inside a scan XLA CPU copies each
    layer's weights out of the stack on every step (a 3.7x slower decode step at d 512 x 8
    layers); TPUs and GPUs read the slice in place, and keep the scan's small program."""
    return target_platform() == "cpu"


# --------------------------------------------------------------------------- the decode steps' bits


_DECODE_BITS = contextvars.ContextVar("olmax_reproduce_decode_bits", default=False)


@contextlib.contextmanager
def reproduce_decode_bits(on: bool = True):
    """While tracing inside it, the model computes every sum with olmax's CPU kernels (fp32), as
    the CPU decode steps do: projections and the LM head (``matmul``, ``lm_head_matmul``),
    attention (``attention_as_decoded``), RMSNorm (``rms_norm``) and log-softmax's sum
    (``log_softmax``); what is left to XLA is elementwise (RoPE, SwiGLU, the residual adds, exp and
    log). XLA CPU gives a row bits that depend on the program around it: its matmul rounds a row
    of 32 otherwise than a row of 1, and it turns a multiply and the add after it into one
    multiply-add where both land in one fusion (an RMSNorm's product into the residual add, in a
    decode step and not in the forward of a sequence). In the kernels each output is one fixed
    order of operations, so the CPU decode steps (the ``packed`` layout of ``olmax.model.decode``,
    which run inside this block) and a training forward inside it give a token the same bits:
    RL's log-probs are the sampler's. The gradients are XLA's. Only where the kernels run
    (``can_reproduce_decode_bits``: CPU, fp32 or bf16; on a mesh each device on its rows); packed
    documents (segment ids) each as if alone in a row. In bf16 the kernels compute in fp32 on bf16
    numbers, rounded explicitly at their inputs and outputs (``layers.kernel_input``,
    ``layers.kernel_output``), and RoPE's tables are rounded so that its products are exact
    (``layers.apply_rope``)."""
    token = _DECODE_BITS.set(on)
    try:
        yield
    finally:
        _DECODE_BITS.reset(token)


def reproducing_decode_bits() -> bool:
    """Whether a ``reproduce_decode_bits`` block is being traced."""
    return _DECODE_BITS.get()


def can_reproduce_decode_bits(cfg: ModelConfig, mesh: Any = None) -> bool:
    """Whether decoding on ``mesh`` (None: one device) uses olmax's CPU kernels (the ``packed``
    layout, at any batch and device count): then a training forward under
    ``reproduce_decode_bits`` gives the decode steps' bits (RL). The mesh's own devices decide (an
    ahead-of-time compile for a TPU runs on a CPU host)."""
    return decode_layout(1, cfg, None if mesh is None else mesh.devices.flat[0].platform) == "packed"


# --------------------------------------------------------------------------- projections, norms


def matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x [b, t, i] @ w [i, o]``. Reproducing the decode steps' bits, in their kernel (bf16 enters
    the fp32 kernel exactly and its output is rounded back, as ``olmo3.Packed``'s). On the CPU one
    2-D matmul over the b*t rows: contracting b and t as two axes, XLA CPU computes the weight
    gradient from a transposed copy of the output gradient, fused with the elementwise backward
    work before it (the norm's), and that fusion ran at a thirtieth of memory speed (about a tenth
    of the tiny and small steps). The parameters after training steps were the same bit for bit
    either way."""
    if reproducing_decode_bits():
        y = cpu.matmul(kernel_input(x.reshape(-1, x.shape[-1])), w.astype(jnp.float32))
        return kernel_output(y.reshape(*x.shape[:-1], w.shape[-1]), x.dtype)
    if target_platform() == "cpu":
        return (x.reshape(-1, x.shape[-1]) @ w).reshape(*x.shape[:-1], w.shape[-1])
    return jnp.einsum("bti,io->bto", x, w)


def lm_head_matmul(x: jax.Array, w: jax.Array) -> jax.Array:
    """``x [b, t, d] @ w [d, v]``, the LM head: one einsum on every platform, or reproducing the
    decode steps' bits ``matmul``'s kernel."""
    if reproducing_decode_bits():
        return matmul(x, w)
    return jnp.einsum("btd,dv->btv", x, w)


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """``layers.rms_norm``; reproducing the decode steps' bits, in the CPU kernel
    (``olmax.kernels.cpu.rms_norm``) with XLA's gradient."""
    if not reproducing_decode_bits():
        return layers.rms_norm(x, weight, eps)
    w32 = weight.astype(jnp.float32)
    return kernel_output(_kernel_rms_norm(kernel_input(x), w32, eps), x.dtype)


@partial(jax.custom_vjp, nondiff_argnums=(2,))
def _kernel_rms_norm(x: jax.Array, w: jax.Array, eps: float) -> jax.Array:
    return cpu.rms_norm(x, w, eps)


def _kernel_rms_norm_fwd(x: jax.Array, w: jax.Array, eps: float) -> tuple[jax.Array, tuple]:
    return _kernel_rms_norm(x, w, eps), (x, w)


def _kernel_rms_norm_bwd(eps: float, res: tuple, dy: jax.Array) -> tuple[jax.Array, jax.Array]:
    return jax.vjp(lambda x, w: layers.rms_norm_f32(x, w, eps), *res)[1](dy)


_kernel_rms_norm.defvjp(_kernel_rms_norm_fwd, _kernel_rms_norm_bwd)


def log_softmax(z: jax.Array) -> jax.Array:
    """``jax.nn.log_softmax`` over the last axis; reproducing the decode steps' bits, with its sum
    in the kernel's fixed order (``olmax.kernels.cpu.row_sums``: the sampler's and the training
    forward's log-probs alike)."""
    if not reproducing_decode_bits():
        return jax.nn.log_softmax(z, axis=-1)
    shifted = z - jax.lax.stop_gradient(jnp.max(z, axis=-1, keepdims=True))
    return shifted - row_log(cpu.row_sums(jnp.exp(shifted)))


def row_log(s: jax.Array) -> jax.Array:
    """``log`` of per-row values ``s [..., 1]`` with bits that do not depend on how many rows there
    are. XLA CPU's vectorised log (and exp) gives some inputs another last bit in arrays of 3, 5,
    6, 7, 11, 13, 14 or 15 elements than in arrays of 1, 2, 4, 8 or more (measured: jax 0.10,
    AVX-512), so the log of 3 rows' sums was not the log of each alone: a batch of 3 gave
    log-probs up to 2.4e-7 off a batch of 1's. Padded to 8 values a row (the pad's log is 0 and
    dropped), the log runs on a multiple of 8 elements, which computes each as it does alone
    (``tests/test_engine.py`` checks the sampler's rows at batch sizes 1, 3, 5 and 6)."""
    pad = [(0, 0)] * (s.ndim - 1) + [(0, 7)]
    return jnp.log(jnp.pad(s, pad, constant_values=1.0))[..., :1]


def swiglu_impl(gu: Any, cfg: ModelConfig, platform: str | None = None) -> str:
    """``KERNELS`` where ``swiglu`` runs in olmax's CPU kernel (the CPU, fp32, the kernels built):
    the decode steps and a forward reproducing their bits (RL's), and training and evaluation with
    ``model.cpu_training_kernels``; else ``XLA``. ``gu`` may be a ``jax.ShapeDtypeStruct``."""
    if ((platform or target_platform()) == "cpu" and (reproducing_decode_bits() or cfg.cpu_training_kernels)
            and cpu.swiglu_supported(gu)):
        return KERNELS
    return XLA


def swiglu(gu: jax.Array, cfg: ModelConfig) -> jax.Array:
    """``silu(g) * u`` of ``gu = [g | u]``: on the CPU in fp32 in olmax's kernel (one pass over
    the rows forward and one backward, where XLA made three and kept two more [b, t, f] arrays for
    the backward; ``swiglu_impl`` says where), else ``layers.swiglu``. The decode steps and RL's
    training forward both take the kernel, so they compute it alike."""
    if swiglu_impl(gu, cfg) == KERNELS:
        return cpu.swiglu(gu)
    return layers.swiglu(gu)


def qkv_impl(x: Any, wq: Any, wk: Any, cos: Any, heads: int, kv_heads: int, cached: bool = False,
             platform: str | None = None, training_kernels: bool = False) -> str:
    """``KERNELS`` where ``qkv`` runs in olmax's CPU kernel: training and evaluation on the CPU
    in fp32 with ``training_kernels`` (``model.cpu_training_kernels``; not the decode steps,
    ``cached``, nor a forward reproducing their bits, which keep the XLA arithmetic), heads a
    multiple of 16 wide, the kernels built; else ``XLA``. The arguments may be
    ``jax.ShapeDtypeStruct``s."""
    if ((platform or target_platform()) == "cpu" and training_kernels and not cached and not reproducing_decode_bits()
            and cpu.qkv_supported(x, wq, wk, cos, heads, kv_heads)):
        return KERNELS
    return XLA


def qkv(x: jax.Array, wq: jax.Array, wk: jax.Array, cos: jax.Array, sin: jax.Array, cfg: ModelConfig,
        cached: bool = False) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The attention's q, k [b, t, heads | kv_heads, e] and v from its joined projection ``x`` =
    [q | k | v]: split, q and k RMSNormed with weights ``wq`` / ``wk`` and rotated (RoPE tables
    cos/sin), in olmax's CPU kernel (one pass each way, ``qkv_impl``) or as ``qk_norm_rope``.
    ``cached``: a decode step's or prefill's."""
    H, K, E = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    if qkv_impl(x, wq, wk, cos, H, K, cached, training_kernels=cfg.cpu_training_kernels) == KERNELS:
        return cpu.qkv(x, wq, wk, cos, sin, H, K, cfg.norm_eps)
    q, k, v = jnp.split(x, [H * E, (H + K) * E], axis=-1)
    q, k = qk_norm_rope(q, k, wq, wk, cos, sin, cfg)
    return q, k, v


def qk_norm_rope(q: jax.Array, k: jax.Array, wq: jax.Array, wk: jax.Array, cos: jax.Array, sin: jax.Array,
                 cfg: ModelConfig) -> tuple[jax.Array, jax.Array]:
    """q [b, t, heads e] and k [b, t, kv_heads e] RMSNormed over their whole width (``rms_norm``),
    split into heads and rotated (``layers.apply_rope``, its products exact while reproducing the
    decode steps' bits)."""
    b, t = q.shape[:2]
    exact = reproducing_decode_bits()
    q, k = rms_norm(q, wq, cfg.norm_eps), rms_norm(k, wk, cfg.norm_eps)
    return (layers.apply_rope(q.reshape(b, t, cfg.n_heads, cfg.head_dim), cos, sin, exact),
            layers.apply_rope(k.reshape(b, t, cfg.n_kv_heads, cfg.head_dim), cos, sin, exact))


# --------------------------------------------------------------------------- attention


def resolve_attention(requested: str, dtype: Any = None, platform: str | None = None,
                      training_kernels: bool = False) -> str:
    """``model.attention_impl`` -> an implementation. "auto": on TPU splash, but the XLA ``blocked``
    one when the compute dtype is fp32 (splash's backward kernels multiply fp32 at Mosaic's default
    precision: on a v5e, 2026-12-07, its fp32 dq/dk/dv missed the reference by up to 5.6e-3 of
    their largest value while its forward held 1.1e-6; ``blocked`` runs under exact fp32 products,
    and ``attention_impl`` takes the reference itself where its scores are small enough);
    on GPU cuDNN when the compute dtype is bf16/fp16 (cuDNN has no fp32 kernel), XLA's fused path
    otherwise; on CPU the XLA ``blocked`` one, or with ``training_kernels``
    (``model.cpu_training_kernels``) olmax's kernel in fp32 where it is built."""
    platform = platform or target_platform()
    if requested != "auto":
        return requested
    if platform == "tpu":
        return "blocked" if dtype is not None and jnp.dtype(dtype) == jnp.float32 else "splash"
    if platform == "gpu":
        return "cudnn" if dtype is None or jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16) else "xla"
    if training_kernels and dtype is not None and jnp.dtype(dtype) == jnp.float32 and cpu.available():
        return "cpu"
    return "blocked"


# The most one sequence's fp32 attention scores [heads, t, s] may take for "auto" to run fp32
# attention on a TPU as ``reference`` (its gradients are autodiff's): on a v5e (2026-12-08) the
# reference's fp32 gradients there were 1.1e-6 of their largest value off the CPU's, the
# ``blocked`` kernel's 5.0e-5 (its forward 9.6e-7, as the reference's). Longer sequences take
# ``blocked``, whose memory grows with the sequence, not its square (64 MiB: 32 heads of 128
# dimensions up to 724 positions, 4 heads up to 2,048).
EXACT_SCORES_BYTES = 64 << 20


def attention_impl(cfg: ModelConfig, q: Any, k: Any, platform: str | None = None) -> str:
    """The implementation ``attend`` runs for these queries and keys (arrays or
    ``jax.ShapeDtypeStruct``s, [b, t, heads, e] and [b, s, kv heads, e]): ``resolve_attention``'s,
    where olmax's CPU kernel (``cpu``) takes them (the CPU, fp32, heads a multiple of 16 wide),
    else the XLA ``blocked`` one in its place; in fp32 on a TPU "auto" is ``reference`` where a
    sequence's scores fit ``EXACT_SCORES_BYTES``."""
    platform = platform or target_platform()
    impl = resolve_attention(cfg.attention_impl, q.dtype, platform, cfg.cpu_training_kernels)
    if impl == "cpu" and not (platform == "cpu" and cpu.flash_supported(q, k)):
        return "blocked"
    if cfg.attention_impl == "auto" and platform == "tpu" and impl == "blocked":
        _, t, h, _ = q.shape
        if h * t * k.shape[1] * 4 <= EXACT_SCORES_BYTES:
            return "reference"
    return impl


def attend(q: jax.Array, k: jax.Array, v: jax.Array, window: int | None, cfg: ModelConfig,
           segment_ids: jax.Array | None = None) -> jax.Array:
    """Self-attention of a sequence through the configured implementation (``attention_impl``;
    the contract they share is ``olmax.model.attention``'s docstring)."""
    impl = attention_impl(cfg, q, k)
    if impl == "reference":
        return attention.reference_attention(q, k, v, window, segment_ids)
    if impl == "cpu":
        return cpu.flash_attention(q, k, v, window, segment_ids)
    if impl == "blocked":
        return attention.blocked_attention(q, k, v, window, segment_ids=segment_ids,
                                           precision=fp32_precision(q.dtype))
    if impl == "splash":
        return attention.splash_attention(q, k, v, window, cfg, interpret=device_platform() != "tpu",
                                          segment_ids=segment_ids)
    return attention.fused_attention(q, k, v, window, impl, segment_ids)


def attention_as_decoded(q: jax.Array, k: jax.Array, v: jax.Array, window: int | None,
                         cfg: ModelConfig, segment_ids: jax.Array | None = None) -> jax.Array:
    """Causal self-attention with the CPU decode step's arithmetic (``olmax.kernels.cpu.
    sequence_attention``, fp32): the prefill and, in RL, the training forward whose log-probs must
    be the sampler's bit for bit. The gradient is ``attend``'s (the same function; only the
    rounding of the forward differs). Without ``segment_ids`` every row is one sequence from
    position 0 (padding at its end is never seen by a query before it); with them (contiguous
    documents, RL's packed rows) each document is computed as if it were alone in its row."""
    if segment_ids is None:
        @jax.custom_vjp
        def f(q, k, v):  # bf16 enters the fp32 kernel exactly; the output is rounded back to q's dtype
            return kernel_output(cpu.sequence_attention(kernel_input(q), kernel_input(k), kernel_input(v), window),
                                 q.dtype)

        def fwd(q, k, v):
            return f(q, k, v), (q, k, v)

        def bwd(res, do):
            return jax.vjp(lambda q, k, v: attend(q, k, v, window, cfg), *res)[1](do)

        f.defvjp(fwd, bwd)
        return f(q, k, v)

    @jax.custom_vjp
    def g(q, k, v, seg):  # the segment ids are an argument: a traced value may not be closed over
        return kernel_output(cpu.sequence_attention(kernel_input(q), kernel_input(k), kernel_input(v), window,
                                                    segment_starts(seg)), q.dtype)

    def gfwd(q, k, v, seg):
        return g(q, k, v, seg), (q, k, v, seg)

    def gbwd(res, do):
        q, k, v, seg = res
        return (*jax.vjp(lambda q, k, v: attend(q, k, v, window, cfg, seg), q, k, v)[1](do), None)  # int: none

    g.defvjp(gfwd, gbwd)
    return g(q, k, v, segment_ids)


def segment_starts(segment_ids: jax.Array) -> jax.Array:
    """int32 [b, t]: the position where each token's document begins in its row (documents are
    runs of equal segment ids)."""
    b, t = segment_ids.shape
    idx = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t))
    new = jnp.concatenate([jnp.ones((b, 1), bool), segment_ids[:, 1:] != segment_ids[:, :-1]], axis=1)
    return jax.lax.cummax(jnp.where(new, idx, 0), axis=1)


def self_attention(q: jax.Array, k: jax.Array, v: jax.Array, window: int | None, cfg: ModelConfig,
                   segment_ids: jax.Array | None = None) -> jax.Array:
    """The model's self-attention of a sequence: ``attention_as_decoded`` while reproducing the
    decode steps' bits (packed documents each as if alone), else ``attend``."""
    if reproducing_decode_bits():
        return attention_as_decoded(q, k, v, window, cfg, segment_ids)
    return attend(q, k, v, window, cfg, segment_ids)


# --------------------------------------------------------------------------- decode steps


LAYOUTS = ("plain", "streamed", "packed")
# The compute dtypes the CPU kernel decodes: it computes in fp32, so bf16 weights and activations
# enter it exactly (bf16 -> fp32) and its outputs are rounded to bf16 where XLA's would be.
KERNEL_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16))


def round_trip_steps(platform: str | None = None) -> int:
    """Decode steps the continuous engine runs per host round trip unless told otherwise: 32 on a
    TPU, 8 elsewhere. On a TPU v5e (2026-12-07, the 7B's width, 8 layers, bf16) a round trip cost
    as much as a step: at batch 1 a step took 13.8 ms at 1 step a round trip, 6.82 at 8 and 6.02 at
    32, against the static engine's 5.92; at batch 32, 9.23 at 8 and 8.31 at 32, against 7.89. On
    the CPU a step is long next to a round trip, and 8 keeps streaming and a finished row's slot
    prompt."""
    return 32 if (platform or target_platform()) == "tpu" else 8


def decode_layout(rows: int, cfg: ModelConfig, platform: str | None = None) -> str:
    """The layout of the ``decode.prepare``d weights a batch of ``rows`` decodes fastest with:

    - ``packed`` (CPU, fp32 or bf16): olmax's CPU kernel (``olmax.kernels.cpu``,
      ``olmax.model.olmo3.Packed``) at every row count, where it could be built; on a mesh of
      several devices each runs it on its rows (the kernels split the batch);
    - ``streamed`` (CPU, 2 rows and up): ``[out, in]`` (``olmax.model.olmo3.OutIn``), whose speed is
      YNNPACK's: XLA CPU hands the multiply-and-reduce to it under jax's default fusion settings
      (``tests/test_decode.py`` checks that it does); where ``XLA_FLAGS`` sets the YNNPACK fusion
      types, XLA's own reduction loop ran it 13x to 72x slower, so the plain layout is kept;
    - ``plain`` ([in, out]) otherwise."""
    if (platform or target_platform()) != "cpu":
        return "plain"
    if jnp.dtype(cfg.compute_dtype) in KERNEL_DTYPES and cpu.available():
        return "packed"
    if rows >= 2 and "ynn_fusion_type" not in os.environ.get("XLA_FLAGS", ""):
        return "streamed"
    return "plain"


def decode_layouts() -> tuple[str, ...]:
    """The weight layouts the target platform decodes with: all of ``LAYOUTS`` on the CPU, else
    ``plain``."""
    return LAYOUTS if target_platform() == "cpu" else ("plain",)


def pack(w: jax.Array) -> jax.Array:
    """An [in, out] fp32 weight in the panels ``packed_matmul`` reads (``olmax.kernels.cpu.pack``)."""
    return cpu.pack(w)


def unpack(p: jax.Array, out: int) -> jax.Array:
    """``pack``'s inverse."""
    return cpu.unpack(p, out)


def packed_matmul(x: jax.Array, p: jax.Array, out: int) -> jax.Array:
    """``x [..., in]`` times a ``pack``ed weight of ``out`` columns, in olmax's CPU kernel: ``[...,
    out]`` in ``x``'s dtype (computed in fp32, rounded to it)."""
    y = cpu.skinny_matmul(kernel_input(x.reshape(-1, x.shape[-1])), p, out)
    return kernel_output(y.reshape(*x.shape[:-1], out), x.dtype)


def kernel_cache_attention(q: jax.Array, k: jax.Array, v: jax.Array, seen: jax.Array) -> jax.Array:
    """The decode step's attention in olmax's CPU kernel: q [b, 1, h, e] over the fp32 head-major
    cache k, v [(1,) b, kv_heads, S, e], ``seen`` [b, S] -> [b, 1, h, e] in q's dtype."""
    b, _, h, e = q.shape
    kv = k.shape[-3]
    o = cpu.cache_attention(kernel_input(q.reshape(b, kv, h // kv, e)), k, v, seen)
    return kernel_output(o.reshape(b, 1, h, e), q.dtype)


def paged_attention_impl(dtype: Any, platform: str | None = None) -> str:
    """What reads a paged KV cache in a decode step: ``pallas`` (JAX's TPU paged-attention kernel,
    ``jax.experimental.pallas.ops.tpu.paged_attention``) on one TPU device with a bf16 cache (the
    kernel computes in bf16: an fp32 cache keeps the exact reference), else ``gather``: each row's
    pages gathered into the contiguous cache's layout and read by the contiguous cache's own
    attention (olmax's CPU kernel or ``attention.cache_attention``), so the result is the
    contiguous cache's bit for bit."""
    platform = platform or target_platform()
    mesh = current_mesh()
    one_device = mesh is None or mesh.size == 1
    if platform == "tpu" and one_device and jnp.dtype(dtype) == jnp.bfloat16:
        return "pallas"
    return "gather"


def gather_pages(pages: jax.Array, table: jax.Array) -> jax.Array:
    """A pool [kv_heads, P, page, e] read through ``table`` [b, n]: each row's n pages in order,
    [b, kv_heads, n * page, e] where the cache is head-major (``head_major_cache``), else
    [b, n * page, kv_heads, e]: the contiguous cache's row layout."""
    kv, _, ps, e = pages.shape
    b, n = table.shape
    rows = jnp.take(pages, table, axis=1)  # [kv, b, n, ps, e]
    if head_major_cache():
        return rows.transpose(1, 0, 2, 3, 4).reshape(b, kv, n * ps, e)
    return rows.transpose(1, 2, 3, 0, 4).reshape(b, n * ps, kv, e)


def pages_per_block(pages_per_row: int, page_size: int, target: int = 512) -> int:
    """The Pallas kernel's ``pages_per_compute_block``: the most pages, dividing a row's, that hold
    at most ``target`` positions (at least one page)."""
    best = 1
    for d in range(1, pages_per_row + 1):
        if pages_per_row % d == 0 and d * page_size <= target:
            best = d
    return best


def paged_cache_attention(q: jax.Array, k_pages: jax.Array, v_pages: jax.Array, table: jax.Array,
                          q_pos: jax.Array, k_pos: jax.Array, kernel: bool) -> jax.Array:
    """A full-attention layer's decode-step attention over a paged cache (``olmax.model.decode``):
    q [b, 1, h, e] at ``q_pos`` [b, 1], the layer's pools [kv_heads, P, page, e], the rows' page
    ``table`` [b, n] and the positions of their slots ``k_pos`` [b, n * page] -> [b, 1, h, e].
    ``kernel``: the contiguous cache would be read by olmax's CPU kernel (the packed layout)."""
    if paged_attention_impl(k_pages.dtype) == "pallas":
        from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention
        b, _, h, e = q.shape
        # The kernel does not scale the scores, and sees a row's first ``lengths`` positions: a
        # full layer's row holds exactly positions 0..q_pos (slot = position).
        qs = (q[:, 0].astype(jnp.float32) * (e ** -0.5)).astype(q.dtype)
        o = paged_attention(qs, k_pages, v_pages, (q_pos[:, 0] + 1).astype(jnp.int32), table,
                            pages_per_compute_block=pages_per_block(table.shape[1], k_pages.shape[2]))
        return o[:, None].astype(q.dtype)
    keys, values = gather_pages(k_pages, table), gather_pages(v_pages, table)
    if kernel:
        return kernel_cache_attention(q, keys[None], values[None], layers.position_mask(q_pos, k_pos, None)[:, 0])
    return attention.cache_attention(q, keys, values, q_pos, k_pos, None, head_major_cache())


# --------------------------------------------------------------------------- what a run uses


def describe(cfg: ModelConfig, platform: str, length: int = 1) -> dict[str, Any]:
    """What runs the model's operations on ``platform`` in ``cfg``'s compute dtype, for sequences
    of ``length`` positions (a run directory's ``run_info.json``): ``attention``
    (``attention_impl``: reference, blocked, cpu, splash, cudnn or xla), ``swiglu`` and ``qkv``
    (``olmax-cpu-cc`` or ``xla``), ``decode_layout`` (``decode_layout`` at one row),
    ``reproduces_decode_bits`` (whether RL's training forward can
    repeat the decode steps' arithmetic), and ``kernels``: ``olmax-cpu-cc`` where olmax's C++
    kernels are built and loaded (with their ``kernel_isa``), else ``xla`` (on a CPU with the
    reason in ``kernels_unavailable``)."""
    dt = jnp.dtype(cfg.compute_dtype)
    H, K, E = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    q, k = (jax.ShapeDtypeStruct((1, length, n, E), dt) for n in (H, K))
    x = jax.ShapeDtypeStruct((1, 1, (H + 2 * K) * E), dt)
    wq, wk = jax.ShapeDtypeStruct((H * E,), dt), jax.ShapeDtypeStruct((K * E,), dt)
    cos = jax.ShapeDtypeStruct((1, E), jnp.float32)  # RoPE's tables are fp32 constants
    layout = decode_layout(1, cfg, platform)
    out: dict[str, Any] = {
        "attention": attention_impl(cfg, q, k, platform),
        "swiglu": swiglu_impl(jax.ShapeDtypeStruct((1, 2 * cfg.mlp_hidden), dt), cfg, platform),
        "qkv": qkv_impl(x, wq, wk, cos, H, K, platform=platform, training_kernels=cfg.cpu_training_kernels),
        "decode_layout": layout,
        "reproduces_decode_bits": layout == "packed",
        "kernels": KERNELS if platform == "cpu" and cpu.available() else XLA,
    }
    if out["kernels"] == KERNELS:
        out["kernel_isa"] = cpu.isa()
    elif platform == "cpu":
        out["kernels_unavailable"] = cpu.unavailable_reason()
    return out
