"""The attention implementations in XLA (and Pallas), which ``olmax.model.dispatch`` picks from.

Every kernel computes the same function: softmax(q k^T / sqrt(e)) v with query i seeing keys
``i - W < k <= i`` (sliding layers, W = window) or ``k <= i`` (full layers), GQA by sharing each
kv head between ``h / k`` query heads. Shapes: q [b, t, h, e], k/v [b, s, k, e] -> [b, t, h, e].

``segment_ids`` [b, t] (optional, every kernel): a query sees only keys of its own segment
(packed documents; 0 marks padding, which forms a segment of its own). Without them each
kernel's program is the one it always was. Decoding against a KV cache, where keys carry their
own positions (a ring buffer's slots are not in order), goes through ``cache_attention``; the
mask rule is ``layers.position_mask`` in both cases.

- ``reference``: exact einsum that materialises fp32 [t, s] scores (tests, short sequences).
- ``blocked``: the same arithmetic per block of queries, over only the keys that block can see
  (its window, or the causal prefix): fewer FLOPs and a much smaller score matrix. The CPU's
  kernel; it agrees with ``reference`` to fp32 rounding (keys outside a row's window add an
  exact zero in ``reference``), with a hand-written backward pass (see ``blocked_attention``).
- ``cpu``: the same blocks in olmax's C++ kernel (``olmax.kernels.cpu.flash_attention``, through
  the dispatch), forward and backward: each block's scores, softmax and products in one piece of
  work in cache, the exponentials vectorised, q, k and v read in place. What "auto" picks on a CPU
  in fp32 with ``model.cpu_training_kernels`` where the kernel is built; otherwise (the default,
  bf16, heads not a multiple of 16 wide, no kernel) ``blocked``.
- ``splash``: TPU Pallas flash attention (``jax.experimental.pallas.ops.tpu.splash_attention``);
  the mask is lazy (causal, or local with ``window_size=(W-1, 0)``), so blocks outside the window
  are never computed. Runs per device under ``shard_map`` (batch over the data-parallel axes,
  heads over ``tensor``); on CPU it runs in Pallas interpret mode for numerical tests. Sequences
  shorter than 128 positions, or not a multiple of 128, are padded at the end (``splash_length``).
- ``cudnn`` / ``xla``: ``jax.nn.dot_product_attention`` with ``is_causal=True`` and
  ``local_window_size=(W-1, 0)`` (cuDNN flash attention on GPU; it has no fp32 kernel).
"""

from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp

from olmax.config import ConfigError, ModelConfig
from olmax.model.layers import attention_mask, position_mask, segment_mask
from olmax.sharding import activation_spec, current_mesh, single_device


def _masked_softmax_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array,
                              head_major: bool = False) -> jax.Array:
    """softmax(q k^T / sqrt(e)) v in fp32 over the keys ``mask`` [t, s] or [b, t, s] allows.
    Keys and values are [b, s, kv_heads, e], or [b, kv_heads, s, e] when ``head_major``."""
    b, t, h, e = q.shape
    kv = k.shape[1 if head_major else 2]
    g = h // kv
    qg = q.reshape(b, t, kv, g, e)
    keys = "bkse" if head_major else "bske"
    scores = jnp.einsum(f"btkge,{keys}->bkgts", qg, k, preferred_element_type=jnp.float32)
    scores = scores * (e ** -0.5)
    mask = mask[None, None, None] if mask.ndim == 2 else mask[:, None, None]
    scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(v.dtype)
    out = jnp.einsum(f"bkgts,{keys}->btkge", probs, v, preferred_element_type=jnp.float32)
    return out.reshape(b, t, h, e).astype(q.dtype)


def reference_attention(q: jax.Array, k: jax.Array, v: jax.Array, window: int | None,
                        segment_ids: jax.Array | None = None) -> jax.Array:
    """Exact attention; softmax in fp32 over masked [t, s] scores."""
    mask = attention_mask(q.shape[1], k.shape[1], window)
    if segment_ids is not None:
        mask = mask[None] & segment_mask(segment_ids, segment_ids)
    return _masked_softmax_attention(q, k, v, mask)


def cache_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_pos: jax.Array, k_pos: jax.Array,
                    window: int | None, head_major: bool = False) -> jax.Array:
    """Queries at positions ``q_pos`` [b, t] over cached keys at ``k_pos`` [b, s] (slots in any
    order, -1 for empty ones): the decode step's attention. Exact, as ``reference_attention``;
    the [t, s] scores are small (t is 1 while decoding). ``head_major``: keys and values are
    [b, kv_heads, s, e] (the CPU's cache layout, ``olmax.model.decode``)."""
    return _masked_softmax_attention(q, k, v, position_mask(q_pos, k_pos, window), head_major)


def cpu_block_size(t: int) -> int:
    """Query block of ``blocked``: 64 positions (the fastest on 2-core CPUs from 256 to 1,024
    tokens), grown so a sequence has at most 32 blocks (the loop over blocks is unrolled)."""
    block = max(64, -(-t // 32))
    return t if block >= t else block


def _query_blocks(t: int, window: int | None, block: int) -> list[tuple[int, int, int]]:
    """``(q0, q1, k0)`` per block of queries: keys ``k0:q1`` from the first key in its first
    query's window, rounded down to a block boundary (so key blocks share the query grid)."""
    return [(q0, min(q0 + block, t), 0 if window is None else max(0, (q0 - (window - 1)) // block * block))
            for q0 in range(0, t, block)]


def _head_major(x: jax.Array, groups: int) -> jax.Array:
    """[b, t, h, e] -> [b, k, g, t, e] (h = k*g), written once to its own buffer.

    Left to itself, XLA CPU fuses this transpose, and the QK-norm and RoPE before it, into every
    block's slice of q, k and v (one transposing copy per block, each key copied once per block
    that sees it, at a small fraction of memory speed: about a tenth of the small benchmark's
    step). It does not duplicate a division into several consumers, so the transposed array is
    divided by a one that XLA cannot prove constant: ``x / 1 == x`` exactly for every value,
    infs, NaNs and signed zeros included (subnormals read as zero, as in every XLA CPU
    arithmetic operation, the matmuls that read the copy included), and the one carries no
    gradient. On one device the one comes from the array's first element; on a mesh from the
    first element of each row and head, [b, k, g, 1, 1], so that every device reads only its own
    shard (one element of the whole array lives on one device: every other one would receive it,
    a collective per layer on a batch-sharded mesh)."""
    b, t, h, e = x.shape
    if single_device():
        corner = x[0, 0, 0, 0]
    else:
        corner = x[:, 0, :, 0].reshape(b, h // groups, groups, 1, 1)
    return x.reshape(b, t, h // groups, groups, e).transpose(0, 2, 3, 1, 4) / opaque_one(corner)


def opaque_one(x: jax.Array) -> jax.Array:
    """Ones shaped as ``x``, in its dtype, that XLA cannot prove constant: made from ``x``'s
    values, without a gradient. ``y / opaque_one(..)`` or ``y * opaque_one(..)`` is ``y``
    exactly (subnormals read as zero, as in every XLA CPU operation) but an operation XLA keeps,
    which stops it fusing ``y``'s producer into several consumers (``_head_major``,
    ``olmax.model.decode.decode_step``)."""
    x = jax.lax.stop_gradient(x)
    return jnp.where(jnp.isfinite(x), 1 + 0 * x, 1).astype(x.dtype)


def _block_scores(qh: jax.Array, kh: jax.Array, span: tuple[int, int, int], window: int | None,
                  seg: jax.Array | None) -> tuple[jax.Array, jax.Array]:
    """One block's scaled fp32 scores [b, k, g, q, s] and the mask of the keys each query sees
    ([q, s], or [b, 1, 1, q, s] with segment ids)."""
    q0, q1, k0 = span
    scores = jnp.einsum("bkgte,bkse->bkgts", qh[:, :, :, q0:q1], kh[:, :, 0, k0:q1], preferred_element_type=jnp.float32)
    qpos, kpos = jnp.arange(q0, q1)[:, None], jnp.arange(k0, q1)[None, :]
    mask = (kpos <= qpos) if window is None else (kpos <= qpos) & (kpos > qpos - window)
    if seg is not None:
        mask = (mask[None] & segment_mask(seg[:, q0:q1], seg[:, k0:q1]))[:, None, None]
    return scores * (qh.shape[-1] ** -0.5), mask


def _blocked_forward(qh: jax.Array, kh: jax.Array, vh: jax.Array, seg: jax.Array | None, window: int | None,
                     block: int):
    """The head-major output [b, k, g, t, e] and ``_blocked_backward``'s residuals, among them each
    block's log-sum-exp."""
    outs, lses = [], []
    for span in _query_blocks(qh.shape[3], window, block):
        scores, mask = _block_scores(qh, kh, span, window, seg)
        scores = jnp.where(mask, scores, jnp.finfo(jnp.float32).min)
        top = jnp.max(scores, axis=-1, keepdims=True)
        p = jnp.exp(scores - top)
        total = jnp.sum(p, axis=-1, keepdims=True)
        lses.append(top + jnp.log(total))
        outs.append(jnp.einsum("bkgts,bkse->bkgte", (p / total).astype(vh.dtype), vh[:, :, 0, span[2]:span[1]],
                               preferred_element_type=jnp.float32))
    out = jnp.concatenate(outs, axis=3).astype(qh.dtype)
    return out, (qh, kh, vh, seg, out, lses)


def _blocked_backward(window: int | None, block: int, precision: str | None, res: tuple,
                      dout: jax.Array) -> tuple[jax.Array, ...]:
    # A custom_vjp backward is traced apart from its forward: under the forward's dot precision.
    with contextlib.nullcontext() if precision is None else jax.default_matmul_precision(precision):
        return _blocked_grads(window, block, res, dout)


def _blocked_grads(window: int | None, block: int, res: tuple, dout: jax.Array) -> tuple[jax.Array, ...]:
    """Per query block: probabilities recomputed from the saved log-sum-exp, then dq. Per key
    block: dk and dv from the query blocks that see it, their rows of ds and p side by side."""
    qh, kh, vh, seg, out, lses = res
    e = qh.shape[-1]
    rowsum = jnp.einsum("bkgte,bkgte->bkgt", dout.astype(jnp.float32), out.astype(jnp.float32))
    spans = _query_blocks(qh.shape[3], window, block)
    dq, ds, probs = [], [], []
    for (q0, q1, k0), lse in zip(spans, lses):
        scores, mask = _block_scores(qh, kh, (q0, q1, k0), window, seg)
        p = jnp.where(mask, jnp.exp(scores - lse), 0.0)  # exactly zero outside the mask
        dp = jnp.einsum("bkgte,bkse->bkgts", dout[:, :, :, q0:q1], vh[:, :, 0, k0:q1],
                        preferred_element_type=jnp.float32)
        ds.append((p * (dp - rowsum[..., q0:q1, None]) * e ** -0.5).astype(qh.dtype))
        probs.append(p.astype(dout.dtype))
        dq.append(jnp.einsum("bkgts,bkse->bkgte", ds[-1], kh[:, :, 0, k0:q1], preferred_element_type=jnp.float32))
    dk, dv = [], []
    for j0, j1, _ in spans:
        users = [i for i, (q0, q1, k0) in enumerate(spans) if k0 <= j0 < q1]  # consecutive blocks
        rows = slice(spans[users[0]][0], spans[users[-1]][1])
        side = lambda xs: jnp.concatenate([xs[i][..., j0 - spans[i][2]:j1 - spans[i][2]] for i in users], axis=3)
        dk.append(jnp.einsum("bkgts,bkgte->bkse", side(ds), qh[:, :, :, rows], preferred_element_type=jnp.float32))
        dv.append(jnp.einsum("bkgts,bkgte->bkse", side(probs), dout[:, :, :, rows], preferred_element_type=jnp.float32))
    return (jnp.concatenate(dq, axis=3).astype(qh.dtype),
            jnp.concatenate(dk, axis=2)[:, :, None].astype(kh.dtype),
            jnp.concatenate(dv, axis=2)[:, :, None].astype(vh.dtype),
            None)  # integer segment ids: no cotangent


def _blocked_fwd(qh, kh, vh, seg, window, block, precision):  # the precision matters to the backward only
    return _blocked_forward(qh, kh, vh, seg, window, block)


_blocked_vjp = jax.custom_vjp(lambda *args: _blocked_fwd(*args)[0], nondiff_argnums=(4, 5, 6))
_blocked_vjp.defvjp(_blocked_fwd, _blocked_backward)


def blocked_attention(q: jax.Array, k: jax.Array, v: jax.Array, window: int | None,
                      block: int | None = None, segment_ids: jax.Array | None = None,
                      precision: str | None = None) -> jax.Array:
    """``reference_attention`` one block of queries at a time, each over the keys it can see
    (``_query_blocks``), on head-major copies of q, k and v (``_head_major``), with a
    hand-written backward pass: autodiff would turn each block's slice of k and v into a
    full-length padded gradient, summed over blocks (work that grows with the square of the block
    count: a tenth of the ~100M step at 1,024 tokens), and keep every block's probabilities; this
    one recomputes them from the saved log-sum-exp and writes dk and dv once. (It is also the
    faster one at four blocks, the tiny benchmark's 256 tokens.) ``precision``: the
    ``jax.default_matmul_precision`` to trace the backward under, as the forward was
    (``olmax.model.dispatch.fp32_precision``; None: the backend's default)."""
    b, t, h, e = q.shape
    qh = _head_major(q, h // k.shape[2])
    kh, vh = _head_major(k, 1), _head_major(v, 1)
    out = _blocked_vjp(qh, kh, vh, segment_ids, window, block or cpu_block_size(t), precision)
    return out.transpose(0, 3, 1, 2, 4).reshape(b, t, h, e)


def fused_attention(q: jax.Array, k: jax.Array, v: jax.Array, window: int | None, implementation: str,
                    segment_ids: jax.Array | None = None) -> jax.Array:
    """``jax.nn.dot_product_attention``: no [t, s] matrix per head. ``local_window_size=(W-1, 0)``
    because query i sees W keys *including itself*; (W, 0) would be one key too many. Segments
    go in as its boolean ``mask`` [b, 1, t, s] (cuDNN takes it as a bias), beside the causal and
    window flags."""
    local = None if window is None else (window - 1, 0)
    mask = None if segment_ids is None else segment_mask(segment_ids, segment_ids)[:, None]
    return jax.nn.dot_product_attention(q, k, v, mask=mask, is_causal=True, local_window_size=local,
                                        implementation=implementation)


SPLASH_MIN_BLOCK = 128  # splash tiles sequences in blocks of a multiple of 128 positions


def _block(requested: int, t: int, what: str) -> int:
    size = min(requested, t)
    if t % size or size % SPLASH_MIN_BLOCK:
        raise ConfigError(f"model.{what}={requested} does not tile the sequence length {t} (splash attention "
                          "needs blocks of a multiple of 128 positions that divide the sequence)")
    return size


def splash_length(t: int, block_q: int, block_kv: int) -> int:
    """The length splash runs a sequence of ``t`` positions at: ``t`` itself when it is a multiple
    of 128, else the shortest longer multiple of 128 that both blocks (capped at the length) tile.
    Short and ragged sequences (lm-eval's buckets from 16, an eval or a prompt of any length) are
    padded at the end; a causal mask keeps every real query off the padded keys, so the real rows
    are exact and the padded ones are dropped. A multiple of 128 that the configured blocks do not
    tile stays an error (a training shape: padding would hide the waste)."""
    if t % SPLASH_MIN_BLOCK == 0:
        return t
    n = -(-t // SPLASH_MIN_BLOCK) * SPLASH_MIN_BLOCK
    while n % min(block_q, n) or n % min(block_kv, n):
        n += SPLASH_MIN_BLOCK
    return n


def _splash_kernel(heads: int, t: int, window: int | None, block_q: int, block_kv: int, interpret: bool):
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as sm
    if window is None:
        mask = sm.CausalMask(shape=(t, t))
    else:
        # Keys q-(W-1)..q: W keys including the query itself, as OLMo-core and HF.
        mask = sm.LocalMask(shape=(t, t), window_size=(window - 1, 0), offset=0)
    # Separate dq and dkv backward kernels: the fused one writes dq once per key block, an array
    # (s / block_kv) times the size of q (64 GiB per sequence at 65,536 tokens).
    blocks = sk.BlockSizes(block_q=block_q, block_kv=block_kv, block_kv_compute=block_kv,
                           block_q_dkv=block_q, block_kv_dkv=block_kv, block_kv_dkv_compute=block_kv,
                           block_q_dq=block_q, block_kv_dq=block_kv, use_fused_bwd_kernel=False)
    return sk.make_splash_mha(sm.MultiHeadMask([mask] * heads), block_sizes=blocks, head_shards=1,
                              q_seq_shards=1, interpret=interpret)


def splash_attention(q: jax.Array, k: jax.Array, v: jax.Array, window: int | None, cfg: ModelConfig,
                     interpret: bool = True, segment_ids: jax.Array | None = None) -> jax.Array:
    """TPU splash attention (fp32 accumulation and softmax inside the kernel); segment ids go in
    as the kernel's own ``SegmentIds`` (blocks are still skipped by the causal/local mask).
    ``interpret``: in Pallas interpret mode, which runs off a TPU (numerical tests on the CPU);
    the dispatch turns it off where the target is a TPU."""
    b, t0, h, e = q.shape
    t = splash_length(t0, cfg.attention_block_q, cfg.attention_block_kv)
    if t != t0:  # padded at the end (``splash_length``); padding is segment 0, its rows are dropped
        pad = lambda x: jnp.pad(x, [(0, 0), (0, t - t0)] + [(0, 0)] * (x.ndim - 2))
        q, k, v = pad(q), pad(k), pad(v)
        segment_ids = None if segment_ids is None else pad(segment_ids)
    bq = _block(cfg.attention_block_q, t, "attention_block_q")
    bkv = _block(cfg.attention_block_kv, t, "attention_block_kv")
    # The kernel takes [heads, seq, head_dim] per example and does not scale the scores.
    qh = (q.astype(jnp.float32) * (e ** -0.5)).astype(q.dtype).transpose(0, 2, 1, 3)
    kh, vh = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)

    def local(qh, kh, vh, *seg):
        kernel = _splash_kernel(qh.shape[1], t, window, bq, bkv, bool(interpret))
        if not seg:
            return jax.vmap(kernel)(qh, kh, vh)
        from jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel import SegmentIds
        return jax.vmap(lambda q_, k_, v_, s_: kernel(q_, k_, v_, segment_ids=SegmentIds(q=s_, kv=s_)))(
            qh, kh, vh, seg[0])

    seg = () if segment_ids is None else (segment_ids.astype(jnp.int32),)
    mesh = current_mesh()
    if mesh is not None and mesh.size > 1:
        spec = activation_spec(("batch", "act_heads", "length", "head_dim"), mesh)
        kv_spec = activation_spec(("batch", "act_kv_heads", "length", "head_dim"), mesh)
        seg_spec = (activation_spec(("batch", "length"), mesh),) * len(seg)
        local = jax.shard_map(local, mesh=mesh, in_specs=(spec, kv_spec, kv_spec, *seg_spec), out_specs=spec,
                              check_vma=False)
    out = local(qh, kh, vh, *seg)
    return out.transpose(0, 2, 1, 3)[:, :t0].astype(q.dtype)
