"""KV-cache decoding through the training model's own layers (``olmax.model.olmo3.run_layers``).

The cache is data, a pytree that ``prefill`` returns and ``decode_step`` takes and returns:

    {"kv":  {"groups": [{"k", "v"} stacked over groups, per layer of a group],  # [G, b, S, kv_heads, e]
             "rest":   [{"k", "v"} per layer after the last whole group]},    # [1, b, S, kv_heads, e]
     "pos": {"full": [b, S_full], "sliding": [b, S_sliding]},                # position in each slot, -1 empty
     "length": [b]}                                                           # next position per row

On the CPU every layer is in "rest" (``prepare`` unrolls them there: ``dispatch.unrolled_decode_layers``).

A full-attention layer keeps ``S_full = max_length`` slots (slot = position). A sliding layer
keeps a ring of ``min(window, max_length)`` slots (slot = position mod S): the window's keys and
nothing older (transformers keeps window - 1 per sliding layer). Slots are not in position
order, so the keys carry their positions and attention masks by position (``cache_attention``).
Prompts are right-padded to one length with ``lengths`` per row; padding never enters a slot
that a query can see. The cache is in the compute dtype (fp32 where the CPU kernel reads it,
``cache_dtype``) and sharded like the activations
(batch over the data axes, kv heads over ``tensor``). On the CPU the stacks are head-major,
[.., b, kv_heads, S, e] (``dispatch.head_major_cache``).

A paged cache (``paged_cache``; the continuous engine's ``kv_cache="paged"``) keeps each
full-attention layer's keys and values in a pool of fixed-size pages instead of S slots per row:
``{"k_pages", "v_pages"}`` [G, kv_heads, P, page, e] (the layout of JAX's TPU paged-attention
kernel), and ``cache["table"]`` [b, S / page] names the page that holds each row's positions
``i * page .. (i + 1) * page - 1`` (page 0 is a null page no row owns: unallocated entries point
there). A row's slot j is still position j, its positions are still ``pos["full"]``, so the mask,
and on the CPU every bit of the attention, is the contiguous cache's. Sliding layers keep their
ring of ``window`` slots per row (bounded by the window, not the sequence).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

import olmax.model.dispatch as dispatch
from olmax.config import ModelConfig
from olmax.model.attention import cache_attention, opaque_one
from olmax.model.dispatch import LAYOUTS, attend, attention_as_decoded, head_major_cache, reproduce_decode_bits
from olmax.model.layers import kernel_input, position_mask
from olmax.model.olmo3 import OutIn, Packed, embed, join_projections, lm_head, rope_tables, run_layers, stack_layers
from olmax.sharding import constrain, single_device

STACK_AXES = ("cache_stack", "batch", "length", "act_kv_heads", "head_dim")
HEAD_MAJOR_AXES = ("cache_stack", "batch", "act_kv_heads", "length", "head_dim")


def _axes() -> tuple[str, ...]:
    return HEAD_MAJOR_AXES if head_major_cache() else STACK_AXES


def _kind(cfg: ModelConfig, full: bool) -> str:
    return "full" if full else "sliding"


def slots(cfg: ModelConfig, max_length: int) -> dict[str, int]:
    """Cache slots per layer kind."""
    out = {}
    for i in range(cfg.n_layers):
        w = cfg.layer_window(i)
        out[_kind(cfg, w is None)] = max_length if w is None else min(w, max_length)
    return out


def cache_bytes(cfg: ModelConfig, batch: int, max_length: int, dtype: Any = None) -> int:
    """Bytes of the cache: per layer 2 (k, v) x batch x its slots x kv heads x head dim x the
    dtype's size, plus an int32 position per slot of each kind and the int32 lengths."""
    item = jnp.dtype(dtype or cfg.compute_dtype).itemsize
    s = slots(cfg, max_length)
    kv = sum(2 * batch * s[_kind(cfg, cfg.layer_window(i) is None)] * cfg.n_kv_heads * cfg.head_dim * item
             for i in range(cfg.n_layers))
    return kv + 4 * batch * (sum(s.values()) + 1)


def layout_of(prepared: dict) -> str:
    head = prepared["lm_head"]
    return "packed" if isinstance(head, Packed) else "streamed" if isinstance(head, OutIn) else "plain"


def prepare(params: Any, cfg: ModelConfig, layout: str = "plain") -> dict[str, Any]:
    """The parameters as the decode loop reads them: layers stacked for the scan and cast to the
    compute dtype once, and on the CPU q/k/v and gate/up joined (``join_projections``): the
    training forward does both inside every step, which in a decode step would copy every weight
    once per token. ``layout`` (``dispatch.decode_layout``; other than ``plain``, CPU only): every
    projection and the LM head as the layout's weight class."""
    layers = stack_layers(params, cfg, unrolled=dispatch.unrolled_decode_layers())
    if dispatch.joined_projections():
        layers = {part: [join_projections(layer) for layer in ls] for part, ls in layers.items()}
    # The LM head in the compute dtype once, as every step would cast it (the same numbers): a
    # bf16 step reads half its bytes (on an H200, 1.6 of the 4.9 GB a step of the 7B-width
    # 8-layer slice read in fp32).
    out = {"embed": params["embed"], "final_norm": params["final_norm"],
           "lm_head": params["lm_head"].astype(jnp.dtype(cfg.compute_dtype)), "layers": layers}
    return relayout(out, cfg, layout) if layout != "plain" else out


def relayout(prepared: dict, cfg: ModelConfig, layout: str) -> dict:
    """CPU ``prepare``d weights in another layout (``dispatch.decode_layout``): every 2-D
    projection of the (joined, unrolled) layers and the LM head as ``OutIn`` (``streamed``),
    ``Packed`` (``packed``) or ``[in, out]`` (``plain``). Exact either way (the same numbers moved); the LM
    head goes to the compute dtype, as every step casts it."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown decode weight layout {layout!r} (known: {', '.join(LAYOUTS)})")
    if layout not in dispatch.decode_layouts():
        raise ValueError(f"the {layout} decode weights are a CPU layout")

    def one(w: Any) -> Any:
        if isinstance(w, OutIn):
            w = w.t.T
        elif isinstance(w, Packed):  # fp32 panels of compute-dtype values
            w = dispatch.unpack(w.p, w.out).astype(jnp.dtype(cfg.compute_dtype))
        elif w.ndim != 2:
            return w
        if layout == "streamed":
            return OutIn(w.T)
        if layout == "packed":
            return Packed(dispatch.pack(w.astype(jnp.float32)), w.shape[1])
        return w

    layers = {part: [{**layer, **{block: {n: one(w) for n, w in layer[block].items()} for block in ("attn", "mlp")}}
                     for layer in ls] for part, ls in prepared["layers"].items()}
    head = prepared["lm_head"]
    if not isinstance(head, (OutIn, Packed)):
        head = head.astype(jnp.dtype(cfg.compute_dtype))
    return {**prepared, "lm_head": one(head), "layers": layers}


def step_weight_bytes(prepared: dict) -> int:
    """Bytes of the ``prepare``d weights one decode step reads whole: all but the embedding (of
    which it reads one row per token)."""
    return sum(x.nbytes for name, part in prepared.items() if name != "embed" for x in jax.tree.leaves(part))


def slot_positions(lengths: jax.Array, n_slots: int) -> jax.Array:
    """[b, S]: the position each slot holds after ``lengths`` tokens were written (slot j holds
    the latest position p < length with p = j mod S), -1 when none."""
    j = jnp.arange(n_slots, dtype=jnp.int32)[None, :]
    last = lengths[:, None].astype(jnp.int32) - 1
    return jnp.where(j <= last, j + n_slots * ((last - j) // n_slots), -1)


def _update(stack: dict, index: jax.Array, entry: dict) -> dict:
    """``stack`` with layer ``index`` set to ``entry`` (in place inside the scan's carry)."""
    return {name: constrain(jax.lax.dynamic_update_index_in_dim(stack[name], entry[name], index, 0), _axes())
            for name in ("k", "v")}


def cache_dtype(cfg: ModelConfig, prepared: dict) -> jnp.dtype:
    """The compute dtype, or fp32 where the CPU kernel reads the cache (the packed layout): a bf16
    model's keys and values are bf16 numbers held in fp32."""
    return jnp.dtype(jnp.float32) if layout_of(prepared) == "packed" else jnp.dtype(cfg.compute_dtype)


def _to_cache(a: jax.Array, stack: jax.Array) -> jax.Array:
    """Keys or values in the cache's dtype: for the kernel's fp32 cache as the kernels read them
    (``layers.kernel_input``)."""
    return kernel_input(a) if stack.dtype == jnp.float32 else a.astype(stack.dtype)


def empty_cache(cfg: ModelConfig, prepared: dict, batch: int, max_length: int) -> dict:
    """Zeroed key/value stacks in the layout ``run_layers`` carries (``prepared["layers"]``')."""
    n, dt = slots(cfg, max_length), cache_dtype(cfg, prepared)
    period = len(prepared["layers"]["groups"])
    groups = jax.tree.leaves(prepared["layers"]["groups"])[0].shape[0] if period else 0

    def stack(count: int, layer: int) -> dict:
        s = n[_kind(cfg, cfg.layer_window(layer) is None)]
        shape = (count, batch, cfg.n_kv_heads, s, cfg.head_dim) if head_major_cache() else \
            (count, batch, s, cfg.n_kv_heads, cfg.head_dim)
        return {name: constrain(jnp.zeros(shape, dt), _axes()) for name in ("k", "v")}

    return {"groups": [stack(groups, j) for j in range(period)],
            "rest": [stack(1, groups * period + i) for i in range(len(prepared["layers"]["rest"]))]}


def prefill(prepared: dict, tokens: jax.Array, lengths: jax.Array, cfg: ModelConfig, max_length: int
            ) -> tuple[jax.Array, dict]:
    """Run right-padded prompts ``tokens`` [b, T] (``lengths`` [b] real tokens each, T <=
    max_length) through the model: ``(logits [b, V] at each row's last prompt token, cache)``."""
    b, t = tokens.shape
    n = slots(cfg, max_length)
    lengths = lengths.astype(jnp.int32)
    pos = {kind: slot_positions(lengths, s) for kind, s in n.items()}
    segment_ids = (jnp.arange(t)[None, :] < lengths[:, None]).astype(jnp.int32)  # padding: segment 0

    # With the kernel (the packed layout) the prompt is computed with the decode steps' arithmetic
    # (``dispatch.reproduce_decode_bits``), as RL's training forward is: each prompt query's
    # attention as a decode step would compute it. Padding sits after each row's prompt, where no
    # query before it looks.
    kernel = layout_of(prepared) == "packed"

    def op(full: bool, window: int | None):
        kind = _kind(cfg, full)

        def fill(q, k, v, cache):
            stack, index = cache
            o = attention_as_decoded(q, k, v, window, cfg) if kernel else attend(q, k, v, window, cfg, segment_ids)
            where = jnp.clip(pos[kind], 0, t - 1)[:, :, None, None]
            entry = {name: _to_cache(jnp.take_along_axis(a, where, axis=1), stack[name])
                     for name, a in (("k", k), ("v", v))}
            if head_major_cache():
                entry = {name: a.transpose(0, 2, 1, 3) for name, a in entry.items()}
            return o, _update(stack, index, entry)
        return fill

    ops = {full: op(full, None if full else cfg.sliding_window)
           for full in {cfg.is_full_attention(i) for i in range(cfg.n_layers)}}
    with reproduce_decode_bits(kernel):
        x, kv = run_layers(cfg, prepared["layers"], embed(prepared, tokens, cfg), rope_tables(cfg, t),
                           segment_ids=segment_ids, caches=empty_cache(cfg, prepared, b, max_length), cache_ops=ops)
        last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)
        logits = lm_head(prepared, dispatch.rms_norm(last, prepared["final_norm"], cfg.norm_eps), cfg)[:, 0]
    return logits, {"kv": kv, "pos": pos, "length": lengths}


def shard_take(a: jax.Array, source: jax.Array, axis: int) -> jax.Array:
    """Rows of ``a`` along ``axis`` (its batch axis), taken within each data-parallel shard:
    ``a``'s rows are dp consecutive blocks, one per shard, and row j of shard d of the result is
    row ``source[d, j]`` of block d ([dp, n] -> dp * n rows). On a mesh no row crosses devices (a
    gather from the whole batch would first bring every row to every device)."""
    dp, n = source.shape
    shape = a.shape
    blocks = a.reshape(*shape[:axis], dp, shape[axis] // dp, *shape[axis + 1:])
    out = jax.vmap(lambda block, idx: jnp.take(block, idx, axis=axis), in_axes=(axis, 0), out_axes=axis)(
        blocks, source)
    return out.reshape(*shape[:axis], dp * n, *shape[axis + 1:])


def shard_put(a: jax.Array, dest: jax.Array, rows: jax.Array, axis: int = 0,
              width: tuple[int, int] | None = None) -> jax.Array:
    """``a`` with, within each data-parallel shard d, row ``dest[d, j]`` (along ``axis``) set to
    row ``d * n + j`` of ``rows`` ([dp, n]; a ``dest`` past the shard's rows writes nothing),
    in place where ``a`` is donated and without moving a row across devices. ``width`` (axis,
    w): only the first w entries of that axis are written (``rows`` holds that many)."""
    dp, n = dest.shape
    shape, rs = a.shape, rows.shape
    blocks = a.reshape(*shape[:axis], dp, shape[axis] // dp, *shape[axis + 1:])
    new = rows.reshape(*rs[:axis], dp, n, *rs[axis + 1:])

    def one(block: jax.Array, idx: jax.Array, vals: jax.Array) -> jax.Array:
        at: list[Any] = [slice(None)] * block.ndim
        at[axis] = idx
        if width is not None:
            at[width[0]] = slice(0, width[1])
        return block.at[tuple(at)].set(vals.astype(block.dtype), mode="drop")

    out = jax.vmap(one, in_axes=(axis, 0, axis), out_axes=axis)(blocks, dest, new)
    return out.reshape(shape)


def expand_rows(logits: jax.Array, cache: dict, source: jax.Array) -> tuple[jax.Array, dict]:
    """A ``prefill``'s last-token logits and cache copied to the rows of a larger batch: a prompt
    that several rows share (GRPO's group of completions of one prompt) is prefilled once and its
    keys, values and positions copied to each of its rows. ``source`` [dp, per]: the prefill's
    rows are dp blocks, one per data-parallel shard, and row j of shard d takes row
    ``source[d, j]`` of block d (``shard_take``: no row crosses devices)."""
    kv = jax.tree.map(lambda a: constrain(shard_take(a, source, 1), _axes()), cache["kv"])
    pos = {kind: constrain(shard_take(p, source, 0), ("batch", "length")) for kind, p in cache["pos"].items()}
    return (constrain(shard_take(logits, source, 0), ("batch", "act_vocab")),
            {"kv": kv, "pos": pos, "length": constrain(shard_take(cache["length"], source, 0), ("batch",))})


def blank_cache(cfg: ModelConfig, prepared: dict, batch: int, max_length: int) -> dict:
    """A cache of ``batch`` empty rows (no position written, length 0): the continuous engine's
    slots before their first prompt."""
    n = slots(cfg, max_length)
    lengths = jnp.zeros((batch,), jnp.int32)
    return {"kv": empty_cache(cfg, prepared, batch, max_length),
            "pos": {kind: constrain(slot_positions(lengths, s), ("batch", "length")) for kind, s in n.items()},
            "length": constrain(lengths, ("batch",))}


PAGE_AXES = ("cache_stack", "act_kv_heads", "length", "length", "head_dim")
NULL_PAGE = 0  # the page unallocated table entries name: never handed to a row, never read unmasked


def is_paged(stack: dict) -> bool:
    """Whether a layer's cache stack is a page pool (``paged_cache``) rather than slots per row."""
    return "k_pages" in stack


def page_bytes(cfg: ModelConfig, page_size: int, dtype: Any = None) -> int:
    """Bytes of one page: the keys and values of ``page_size`` positions in every full-attention layer."""
    item = jnp.dtype(dtype or cfg.compute_dtype).itemsize
    full = sum(cfg.is_full_attention(i) for i in range(cfg.n_layers))
    return 2 * full * page_size * cfg.n_kv_heads * cfg.head_dim * item


def row_bytes(cfg: ModelConfig, max_length: int, dtype: Any = None) -> int:
    """Bytes a row holds whatever its length in a paged cache: its sliding layers' rings, its
    positions and length (``cache_bytes`` of one row less its full layers' keys and values)."""
    full = sum(cfg.is_full_attention(i) for i in range(cfg.n_layers))
    item = jnp.dtype(dtype or cfg.compute_dtype).itemsize
    return cache_bytes(cfg, 1, max_length, dtype) - 2 * full * max_length * cfg.n_kv_heads * cfg.head_dim * item


def paged_cache(cfg: ModelConfig, prepared: dict, batch: int, max_length: int, pages: int, page_size: int) -> dict:
    """``blank_cache`` with every full-attention layer's keys and values in a pool of ``pages``
    pages of ``page_size`` positions (page 0 the null page), every table entry the null page."""
    if max_length % page_size:
        raise ValueError(f"page_size {page_size} does not divide the cache's {max_length} positions")
    cache = blank_cache(cfg, prepared, batch, max_length)
    dt = cache_dtype(cfg, prepared)
    period = len(prepared["layers"]["groups"])
    groups = jax.tree.leaves(prepared["layers"]["groups"])[0].shape[0] if period else 0

    def pool(stack: dict, layer: int) -> dict:
        if not cfg.is_full_attention(layer):
            return stack
        count = stack["k"].shape[0]
        shape = (count, cfg.n_kv_heads, pages, page_size, cfg.head_dim)
        return {name: constrain(jnp.zeros(shape, dt), PAGE_AXES) for name in ("k_pages", "v_pages")}

    kv = cache["kv"]
    kv = {"groups": [pool(s, j) for j, s in enumerate(kv["groups"])],
          "rest": [pool(s, groups * period + i) for i, s in enumerate(kv["rest"])]}
    table = jnp.full((batch, max_length // page_size), NULL_PAGE, jnp.int32)
    return {**cache, "kv": kv, "table": table}


def _write_pages(stack: dict, block: dict, src: jax.Array, pages: jax.Array) -> dict:
    """Pool ``stack`` with block row ``src`` of a prefill's full-layer ``block`` (T slots: position
    = slot) written to ``pages`` [ceil(T / page)] (a page past the pool's writes nothing: a shared
    prompt page already written, or one the row has not been given)."""
    ps = stack["k_pages"].shape[3]
    out = {}
    for name in ("k", "v"):
        a = jax.lax.dynamic_index_in_dim(block[name], src, 1, keepdims=False)  # [G, kv, T, e] or [G, T, kv, e]
        if not head_major_cache():
            a = a.transpose(0, 2, 1, 3)
        t = jnp.arange(a.shape[2])
        pool = stack[f"{name}_pages"]
        out[f"{name}_pages"] = constrain(pool.at[:, :, pages[t // ps], t % ps].set(a.astype(pool.dtype), mode="drop"),
                                         PAGE_AXES)
    return out


def write_rows(cache: dict, rows: dict, source: jax.Array, dest: jax.Array, pages: jax.Array | None = None) -> dict:
    """``cache`` with, in each data-parallel shard d, row ``dest[d, j]`` given row ``source[d, j]``
    of the shard's part of ``rows`` (a ``prefill`` of prompts padded to T <= the cache's
    length, ``prefill_block``), in place and within the shard (``shard_put``). Only the row's first
    T slots of each layer kind take keys and values (a prompt's slots: position = slot on full
    layers, and on sliding layers too unless T exceeds the window, when both rings are the
    window's); every slot's position is set, the rest to -1, so nothing the row's previous occupant
    wrote is ever attended to (its keys and values stay behind, masked: finite numbers, as a
    model's keys and values are, weigh exactly 0).
    A ``dest`` past the shard's rows writes nothing (the padding of a bucketed admission). The
    keys and values go one row per shard at a time (a loop over j): a copy of one prompt's rows
    is the only temporary, where all n at once would be n rows of every layer beside the cache.
    A paged cache (one data-parallel shard) takes ``pages`` [1, n, ceil(T / page)]: the pages each
    written row's prompt slots go to (its table's first entries, or past the pool for a page
    another row of the same prompt writes: a shared prompt page is written once)."""
    slot_axis = 3 if head_major_cache() else 2  # [G, b, kv, S, e] or [G, b, S, kv, e]

    def write_stack(stack: dict, block: dict, src: jax.Array, dst: jax.Array, j: jax.Array | int) -> dict:
        if is_paged(stack):
            return _write_pages(stack, block, src[0, 0], jax.lax.dynamic_index_in_dim(pages[0], j, 0, keepdims=False))
        return jax.tree.map(lambda a, r: constrain(shard_put(a, dst, shard_take(r, src, 1), 1,
                                                             (slot_axis, r.shape[slot_axis])), _axes()), stack, block)

    def write_kv(j: jax.Array | int, kv_cache: dict) -> dict:
        src, dst = (jax.lax.dynamic_slice_in_dim(a, j, 1, axis=1) for a in (source, dest))
        return {part: [write_stack(s, r, src, dst, j) for s, r in zip(kv_cache[part], rows["kv"][part])]
                for part in ("groups", "rest")}

    n = source.shape[1]
    kv = write_kv(0, cache["kv"]) if n == 1 else jax.lax.fori_loop(0, n, write_kv, cache["kv"])

    def pos(p: jax.Array, r: jax.Array) -> jax.Array:
        taken = shard_take(r, source, 0)
        full = jnp.pad(taken, ((0, 0), (0, p.shape[1] - taken.shape[1])), constant_values=-1)
        return constrain(shard_put(p, dest, full), ("batch", "length"))

    return {**cache, "kv": kv,
            "pos": {kind: pos(p, rows["pos"][kind]) for kind, p in cache["pos"].items()},
            "length": constrain(shard_put(cache["length"], dest, shard_take(rows["length"], source, 0)), ("batch",))}


def decode_step(prepared: dict, tokens: jax.Array, cache: dict, cfg: ModelConfig, max_length: int
                ) -> tuple[jax.Array, dict]:
    """One new token per row (``tokens`` [b]) at position ``cache["length"]`` (below
    ``max_length``, the ``prefill``'s): ``(logits [b, V], cache)`` with the token's keys and
    values written to its slot in every layer."""
    b = tokens.shape[0]
    length = cache["length"]
    rows = jnp.arange(b)
    pos, where = {}, {}
    for kind, p in cache["pos"].items():
        where[kind] = length % p.shape[1]
        pos[kind] = p.at[rows, where[kind]].set(length)
    q_pos = length[:, None]
    cache_table = cache.get("table")
    if cache_table is not None:  # a paged cache: the page and offset of each row's new position
        ps = max_length // cache_table.shape[1]
        page, offset = cache_table[rows, length // ps], length % ps
    # The packed layout means olmax's CPU kernel is in use (CPU): its attention too.
    kernel = layout_of(prepared) == "packed"

    def op(full: bool, window: int | None):
        kind = _kind(cfg, full)

        def step(q, k, v, cache):
            stack, index = cache
            if is_paged(stack):  # the token's keys and values into its page, attention over the row's pages
                at = (index, slice(None), page, offset)
                stack = {name: constrain(stack[name].at[at].set(_to_cache(a[:, 0], stack[name])), PAGE_AXES)
                         for name, a in (("k_pages", k), ("v_pages", v))}
                pools = [jax.lax.dynamic_index_in_dim(stack[name], index, 0, keepdims=False)
                         for name in ("k_pages", "v_pages")]
                return dispatch.paged_cache_attention(q, *pools, cache_table, q_pos, pos[kind], kernel), stack
            # Only the new token's b x kv_heads x e values are written, into the carried stack.
            # Row r's slot in every head: [b, kv_heads, e] written, whichever layout.
            at = (index, rows, slice(None), where[kind]) if head_major_cache() else (index, rows, where[kind])
            stack = {name: constrain(stack[name].at[at].set(_to_cache(a[:, 0], stack[name])), _axes())
                     for name, a in (("k", k), ("v", v))}
            if kernel:  # olmax's CPU kernel: the same attention, at memory speed
                seen = position_mask(q_pos, pos[kind], window)[:, 0]
                # On the CPU every layer is a stack of its own (``prepare``): the kernel reads the
                # whole [1, ...] stack where the write left it (a slice would be a fused second
                # copy of the write, at one row).
                return dispatch.kernel_cache_attention(q, stack["k"], stack["v"], seen), stack
            keys, values = (jax.lax.dynamic_index_in_dim(stack[name], index, 0, keepdims=False) for name in ("k", "v"))
            if b == 1 and head_major_cache() and single_device():
                # One row: XLA CPU writes the new key with a dynamic-update-slice and fuses a second
                # copy of that write into the attention's read of the keys (a bitcast to its dot),
                # and then copies the layer's key cache four times to give each write its own
                # buffer (1 of 7 ms per step of the decode benchmark's model). Times an opaque one,
                # the read is its own fusion over the written cache: the same keys, no copies.
                keys = keys * opaque_one(q[0, 0, 0, 0])
            return cache_attention(q, keys, values, q_pos, pos[kind], window, head_major_cache()), stack
        return step

    kinds = {cfg.is_full_attention(i) for i in range(cfg.n_layers)}
    ops = {full: op(full, None if full else cfg.sliding_window) for full in kinds}
    tables = rope_tables(cfg, 1, q_pos, bound=max_length)
    with reproduce_decode_bits(kernel):  # the norms' sums too: RL's training forward repeats them
        x, kv = run_layers(cfg, prepared["layers"], embed(prepared, tokens[:, None], cfg), tables,
                           caches=cache["kv"], cache_ops=ops)
        logits = lm_head(prepared, dispatch.rms_norm(x, prepared["final_norm"], cfg.norm_eps), cfg)[:, 0]
    return logits, {**cache, "kv": kv, "pos": pos, "length": length + 1}
