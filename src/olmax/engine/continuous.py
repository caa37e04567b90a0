"""The continuous-batching engine: a fixed number of row slots over one KV cache; a row that
finishes (EOS, its length, a stop string, a cancel) gives its slot to the next waiting request at
the next host round trip, while the other rows go on decoding.

One round trip (``Engine.step``):

1. admit waiting requests to free slots: their prompts are prefilled together (a prompt that
   several admitted rows share, a GRPO group, once), in blocks of one width (``prefill_ahead``'s
   power of two), and written into those slots' rows of the cache (``decode.write_rows``), and
   each row's first token sampled: a run compiles one prefill and one write for its admissions;
2. run up to ``chunk`` decode steps inside one compiled loop, EOS and length decided on the device
   (a finished row stops advancing); the loop returns early when every row has finished, or when
   enough slots are free for the requests waiting (``admission_size``: one where rows end rarely,
   several admitted together where they end often, so an admission pays for itself);
3. read the tokens, apply stop strings (tokens a row made past its stop are dropped), stream,
   finish rows, free their slots.

A row samples with its own key (``fold_in(key(seed), index)``) and its own step count, and every
operation of a decode step is row by row, so a completion equals, token for token and log-prob for
log-prob, what the static engine (``olmax.engine.static``) or the same request alone gives with the
same cache length and prompt bucket: it does not depend on which other requests ran beside it.

With ``kv_cache="paged"`` the full-attention layers' cache is a pool of pages (``olmax.engine.
paged``, ``decode.paged_cache``): a request is admitted while pages last (its prompt's and a
chunk's), a row is given pages as it grows and gives them back when it ends, the rows of one
prompt share its whole pages, and when the pool runs dry the youngest rows are preempted and
recomputed later from their prompts (the same tokens again: a row's tokens depend on nothing but
itself; those already streamed are not streamed twice). The completions are the contiguous
cache's, token for token and log-prob for log-prob (the same bits on the CPU).
"""

from __future__ import annotations

import math
import threading
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from itertools import islice
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from olmax.config import ModelConfig
from olmax.engine.paged import DEFAULT_PAGE_SIZE, KV_CACHES, PagePool, contiguous_rows, plan_growth, pool_pages
from olmax.engine.sampling import MAX_TOP_LOGPROBS, Completion, Sampling, finite_rows, nonfinite_error, row_keys, sample
from olmax.engine.sampling import knobs as sampling_knobs
from olmax.engine.shapes import bucket, mesh_data_parallel, prompt_bucket
from olmax.engine.weights import DecodeWeights, on_mesh
from olmax.model.decode import (
    blank_cache,
    cache_bytes,
    decode_step,
    layout_of,
    page_bytes,
    paged_cache,
    prefill,
    row_bytes,
    shard_put,
    shard_take,
    write_rows,
)
from olmax.model.dispatch import decode_layout, reproduce_decode_bits, round_trip_steps

MAX_EOS = 8          # end-of-sequence ids a request may name (a fixed-width table on the device)
# What one admission (a prefill, the rows' writes, the round trip it ends) costs, in decode steps
# of the whole batch: on the CPU workload of ``benchmarks/bench_admission.py`` a prefill of a few
# short prompts, the writes and the host's turn take about as long as 4 decode steps of 16 slots.
ADMIT_COST = 4
KNOBS = ("temperature", "top_k", "top_p", "greedy")


@dataclass
class Request:
    """One completion to make. ``index`` is folded with ``sampling.seed`` into the row's key: a
    sampled completion depends on (prompt, seed, index, weights) only. ``stop(ids)`` is asked
    after each new token (host side; True: finish "stop", later tokens dropped); ``on_token(id,
    logprob)`` sees each kept token as it is made and ``on_finish(completion)`` the end, both on
    the thread that runs ``Engine.step``. ``top_logprobs``: report that many most likely tokens
    per step (0..20)."""
    prompt: list[int]
    max_new_tokens: int
    sampling: Sampling = Sampling()
    index: int = 0
    eos_ids: frozenset[int] = frozenset()
    stop: Callable[[list[int]], bool] | None = None
    on_token: Callable[[int, float], None] | None = None
    on_finish: Callable[[Completion], None] | None = None
    top_logprobs: int = 0


@dataclass
class _Row:
    rid: int
    request: Request
    out: Completion = field(default_factory=Completion)


@dataclass
class EngineStats:
    """``decode_steps``: compiled decode steps run; ``slot_steps``: those times the slots;
    ``decoded``: tokens kept from decode steps (a row's first token comes from its prefill);
    ``prefills``: prompt rows prefilled; ``prefill_blocks``: compiled prefill calls;
    ``prefilled_tokens``: the token positions those calls ran (their padded [rows, length] blocks,
    the figure ``prefill_tokens`` bounds per round trip); ``round_trips``; with a paged cache
    ``shared_prompt_tokens`` (prompt positions a row found in pages another row holds) and
    ``preemptions`` (rows preempted for pages, recomputed later).
    All are counters: the difference of two readings is what happened between them."""
    decode_steps: int = 0
    slot_steps: int = 0
    decoded: int = 0
    prefills: int = 0
    prefill_blocks: int = 0
    prefilled_tokens: int = 0
    round_trips: int = 0
    shared_prompt_tokens: int = 0
    preemptions: int = 0

    @property
    def slot_utilisation(self) -> float:
        """Kept tokens per slot and decode step (1: no slot ever idle or wasted; also 1 when no
        decode step ran, as the RL rollout's ``rl/slot_utilisation`` counts it)."""
        return self.decoded / self.slot_steps if self.slot_steps else 1.0


def blank_state(prepared: dict, cfg: ModelConfig, slots: int, max_length: int, pages: int | None = None,
                page_size: int | None = None) -> dict:
    """The device state of ``slots`` empty slots; with ``pages``, a paged cache of that many pages."""
    z = jnp.zeros((slots,), jnp.int32)
    cache = blank_cache(cfg, prepared, slots, max_length) if pages is None else \
        paged_cache(cfg, prepared, slots, max_length, pages, page_size)
    return {"tok": z, "cache": cache,
            "keys": row_keys(z.astype(jnp.uint32), z), "step": z, "left": z,
            "live": jnp.zeros((slots,), bool), "eos": jnp.full((slots, MAX_EOS), -1, jnp.int32),
            "knobs": {k: v for k, v in zip(KNOBS, (jnp.ones((slots,), jnp.float32), z,
                                                    jnp.ones((slots,), jnp.float32), jnp.ones((slots,), bool)))}}

def prefill_block(prepared, tokens, lengths, *, cfg):
    """The last-token logits and cache rows of a block of distinct prompts (``decode.prefill``),
    a cache as long as the prompts' bucket T, not the slots': ``admit`` writes a row's T slots
    into its slot's row in place. Its rows are dp consecutive parts, one per data-parallel shard,
    each holding the prompts of rows admitted to that shard's slots."""
    return prefill(prepared, tokens, lengths, cfg, tokens.shape[1])


def admit(prepared, state, logits, rows, source, dest, seeds, indices, knobs, left, eos, pages=None, *, cfg, greedy,
          top_n, readable=lambda *a: a):
    """In each data-parallel shard d, write row ``source[d, j]`` of the shard's part of a
    prefilled block (``prefill_block``'s ``logits`` and cache ``rows``) into the shard's slot
    ``dest[d, j]`` ([dp, n] each; a ``dest`` past the shard's slots writes nothing) and sample
    that row's first token; the per-row arguments are [dp * n], shard by shard. No row crosses
    devices and the slots' cache is written in place (``decode.write_rows``). ``readable``: makes
    the outputs the host reads readable on every process (``DecodeWeights.host_readable``).
    ``pages`` [1, n, pages of the block]: where a paged cache's rows take their prompts
    (``decode.write_rows``)."""
    keys = row_keys(seeds, indices)
    logits = shard_take(logits, source, 0)
    with reproduce_decode_bits(layout_of(prepared) == "packed"):
        tok, lp, logp = sample(logits, keys, jnp.int32(0), knobs, greedy, cfg.vocab_size)
    ok = finite_rows(logits, cfg.vocab_size)
    live = ~jnp.any(tok[:, None] == eos, axis=-1) & (left > 0) & ok

    def put(a, v):
        return shard_put(a, dest, v)
    state = {"tok": put(state["tok"], tok), "cache": write_rows(state["cache"], rows, source, dest, pages),
             "keys": put(state["keys"], keys), "step": put(state["step"], jnp.ones_like(tok)),
             "left": put(state["left"], left), "live": put(state["live"], live), "eos": put(state["eos"], eos),
             "knobs": {k: put(state["knobs"][k], knobs[k]) for k in KNOBS}}
    out = (tok, lp, live, ok) + (tuple(jax.lax.top_k(logp, top_n)) if top_n else ())
    return state, readable(*out)


def decode_chunk(prepared, state, kill, need, steps, *, cfg, chunk, max_length, greedy, top_n,
                 readable=lambda *a: a):
    """Up to ``steps`` (at most ``chunk``) decode steps of every live row (``kill``: rows the
    host finished); returns early when no row is live or ``need`` rows are not. Out: the
    state, the tokens, log-probs, which were made and whether their logits were finite
    ([chunk, slots] each; a row whose were not stops there), the steps run, the rows still
    live, and with ``top_n`` the top log-probabilities [chunk, slots, top_n]."""
    b = state["tok"].shape[0]
    kernel = layout_of(prepared) == "packed"
    state = {**state, "live": state["live"] & ~kill}
    outs = {"tok": jnp.zeros((chunk, b), jnp.int32), "lp": jnp.zeros((chunk, b), jnp.float32),
            "made": jnp.zeros((chunk, b), bool), "ok": jnp.zeros((chunk, b), bool)}
    if top_n:
        outs["top_lp"] = jnp.zeros((chunk, b, top_n), jnp.float32)
        outs["top_id"] = jnp.zeros((chunk, b, top_n), jnp.int32)

    def go(carry):
        i, st, _ = carry
        return (i < steps) & jnp.any(st["live"]) & (jnp.sum(~st["live"]) < need)

    def one(carry):
        i, st, out = carry
        live = st["live"]
        logits, cache = decode_step(prepared, st["tok"], st["cache"], cfg, max_length)
        cache["length"] = jnp.where(live, cache["length"], st["cache"]["length"])  # a finished row stays put
        with reproduce_decode_bits(kernel):
            tok, lp, logp = sample(logits, st["keys"], st["step"], st["knobs"], greedy, cfg.vocab_size)
        made = live
        ok = finite_rows(logits, cfg.vocab_size)
        left = st["left"] - made
        now = live & ok & ~jnp.any(tok[:, None] == st["eos"], axis=-1) & (left > 0)
        st = {**st, "tok": jnp.where(made, tok, st["tok"]), "cache": cache, "step": st["step"] + made,
              "left": left, "live": now}
        new = {"tok": tok, "lp": lp, "made": made, "ok": ok}
        if top_n:
            new["top_lp"], new["top_id"] = jax.lax.top_k(logp, top_n)
        out = {k: jax.lax.dynamic_update_index_in_dim(out[k], new[k], i, 0) for k in out}
        return i + 1, st, out

    n, state, outs = jax.lax.while_loop(go, one, (jnp.int32(0), state, outs))
    read = readable(n, state["live"], *outs.values())
    return state, dict(zip(("steps", "live", *outs), read))


def programs(cfg: ModelConfig, mesh: Mesh | None, readable: Callable = lambda *a: a) -> tuple[Callable, ...]:
    """The engine's four compiled programs, as ``Engine`` runs them and ``olmax compile`` lowers
    them: ``blank_state`` (static ``slots``, ``max_length``), ``prefill_block``, ``admit`` (static
    ``greedy``, ``top_n``; the state donated) and ``decode_chunk`` (static ``chunk``,
    ``max_length``, ``greedy``, ``top_n``; the state donated)."""
    return (jax.jit(on_mesh(partial(blank_state, cfg=cfg), mesh),
                    static_argnames=("slots", "max_length", "pages", "page_size")),
            jax.jit(on_mesh(partial(prefill_block, cfg=cfg), mesh)),
            jax.jit(on_mesh(partial(admit, cfg=cfg, readable=readable), mesh),
                    static_argnames=("greedy", "top_n"), donate_argnums=(1,)),
            jax.jit(on_mesh(partial(decode_chunk, cfg=cfg, readable=readable), mesh),
                    static_argnames=("chunk", "max_length", "greedy", "top_n"), donate_argnums=(1,)))


def prefill_cost(per_shard: int, dp: int, prompt_len: int) -> int:
    """Prompt tokens a block costs whose largest shard part holds ``per_shard`` prompts: every
    shard computes a power of two of rows of ``prompt_len`` tokens."""
    return dp * bucket(per_shard, lo=1) * prompt_len


def bounded_rows(prefill_tokens: int | None, dp: int, prompt_len: int) -> int | None:
    """The most prompts a shard's part of one block holds under ``prefill_tokens`` (a power of
    two, at least 1: a round trip always prefills one prompt); None without a bound."""
    if prefill_tokens is None:
        return None
    fit = prefill_tokens // (dp * prompt_len)
    return 1 << (fit.bit_length() - 1) if fit >= 1 else 1


class Engine:
    """``slots`` rows decoded together over a cache of ``max_length`` positions per row; ``chunk``
    decode steps per host round trip at most. ``prompt_len``: the padded length every prompt is
    prefilled at (a ``generate`` call's bucket, so its completions equal the static engine's);
    None: each prompt's own bucket (the server: a request's completion then depends on nothing
    but itself). ``refill``: return from a chunk early once this many slots are free and that
    many requests wait; None (the default): a number that adapts to the rows' lengths
    (``admission_size``): an admission costs about ``ADMIT_COST`` decode steps, so where rows end
    often (short completions) the engine waits for several free slots and admits them together,
    and where they end rarely it refills one slot at a time, as a fixed 1 did. ``prefill_ahead``:
    a prefill also takes the next waiting prompts of its bucket, up to this many prompts in all
    (default 4: on 256 Think-shaped rows, 61 prefills of one prompt became 16 of four; 0: only
    the admitted rows' prompts, one a block). Its power of two a shard is the admission width: a
    prefill block holds at most that many prompts a shard (the first fill of every slot is several
    blocks), a write at least that many rows, and an adaptive admission waits for no more, so one
    prefill and one write program serve a run. ``prefill_tokens``: the most prompt tokens one round
    trip prefills (``prefill_cost``: every row of its blocks, each shard's padding included, times
    their prompt bucket), at least one prompt whatever the bound; the requests past it wait for
    the next round trip. The slots' cache and a prefilled block are held together, so where prompts
    are nearly as long as the cache a bound keeps the block small (v5p-8, 32 slots of 32,768
    tokens: 118 GiB a chip unbounded). None: every admitted prompt at once. ``kv_cache``:
    "contiguous" (every slot holds ``max_length`` positions) or "paged" (pages of ``page_size``
    positions, as many as ``kv_budget`` bytes hold, else the contiguous cache's bytes; one
    data-parallel shard); ``kv_budget`` of a contiguous cache must hold its slots.
    ``prefix_cache`` (paged): prompts that begin alike share whole pages, kept after their rows
    end until the pool needs them. Submit and cancel from any thread; ``step`` from one."""

    def __init__(self, params: Any, cfg: ModelConfig, *, slots: int, max_length: int, mesh: Mesh | None = None,
                 chunk: int | None = None, prompt_len: int | None = None, refill: int | None = None,
                 weights: DecodeWeights | None = None, prefill_ahead: int = 4, prefill_tokens: int | None = None,
                 kv_cache: str = "contiguous", page_size: int = DEFAULT_PAGE_SIZE, kv_budget: int | None = None,
                 prefix_cache: bool = False):
        self.cfg, self.mesh = cfg, mesh
        if kv_cache not in KV_CACHES:
            raise ValueError(f"kv_cache must be one of {', '.join(KV_CACHES)}, got {kv_cache!r}")
        if kv_cache == "paged" and mesh_data_parallel(mesh) > 1:
            raise ValueError(f"the paged KV cache runs on one data-parallel shard; this mesh has "
                             f"{mesh_data_parallel(mesh)}: use kv_cache='contiguous'")
        self.kv_cache, self.page_size, self.kv_budget, self.prefix_cache = kv_cache, page_size, kv_budget, prefix_cache
        self.weights = weights if weights is not None else DecodeWeights(params, cfg, mesh, rows=slots)
        self._lock = threading.Lock()
        self._waiting: deque[tuple[int, Request]] = deque()
        self._waiting_prompts: Counter = Counter()  # prompt key -> requests waiting with it
        self._cancelled: set[int] = set()
        self._next_id = 0
        self._init, self._prefill, self._insert, self._chunk = programs(cfg, mesh, self.weights.host_readable)
        if prefill_ahead < 0:
            raise ValueError(f"prefill_ahead must be >= 0, got {prefill_ahead}")
        self.prefill_ahead, self.prefill_tokens = prefill_ahead, prefill_tokens
        self.stats = EngineStats()
        self._widths: dict[tuple, set[int]] = {}  # program kind -> the widths it ran at (its compiled shapes)
        self.reset(slots=slots, max_length=max_length, chunk=chunk, prompt_len=prompt_len, refill=refill)

    # -- set-up ---------------------------------------------------------------------------------

    @property
    def prefill_tokens(self) -> int | None:
        return self._prefill_tokens

    @prefill_tokens.setter
    def prefill_tokens(self, value: int | None) -> None:
        """The bound may change between runs (``olmax generate`` reuses an engine across calls)."""
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ValueError(f"prefill_tokens must be an int >= 1 (or None: no bound), got {value!r}")
        self._prefill_tokens = value

    def reset(self, *, slots: int, max_length: int, chunk: int | None = None, prompt_len: int | None = None,
              refill: int | None = None) -> None:
        """New shapes (only while idle): the compiled programs of earlier shapes are kept. ``chunk``:
        None, the platform's (``dispatch.round_trip_steps``)."""
        if self.busy():
            raise RuntimeError("the engine is busy: reset it only between runs")
        dp = mesh_data_parallel(self.mesh)
        if slots < 1 or slots % dp:
            raise ValueError(f"slots must be a positive multiple of the {dp} data-parallel shards, got {slots}")
        chunk = round_trip_steps() if chunk is None else chunk
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        if prompt_len is not None and prompt_len > max_length:
            raise ValueError(f"prompt_len {prompt_len} is longer than the cache ({max_length})")
        self.slots, self.max_length, self.chunk, self.prompt_len = slots, max_length, chunk, prompt_len
        self.refill = None if refill is None else max(1, refill)
        self._run_steps = self._run_ended = 0  # decode steps, and rows they ended, since this reset
        self._rows: list[_Row | None] = [None] * slots
        self._device_live = np.zeros(slots, bool)   # the device's view: still decoding
        self._state = None                          # made at the first step (after any load)
        packed = decode_layout(slots, self.cfg) == "packed"
        self._kv_dtype = jnp.float32 if packed else jnp.dtype(self.cfg.compute_dtype)
        self._pager: PagePool | None = None
        if self.kv_cache == "paged":
            pages = pool_pages(self.cfg, slots, max_length, self.page_size, self.kv_budget, self._kv_dtype)
            self._pager = PagePool(pages, self.page_size, slots, max_length, self.prefix_cache)
        elif self.kv_budget is not None:
            fit = contiguous_rows(self.cfg, max_length, self.kv_budget, self._kv_dtype)
            if slots > fit:
                raise ValueError(f"a kv budget of {self.kv_budget / 2**20:.1f} MiB holds {fit} contiguous rows "
                                 f"of {max_length} positions, not {slots}: lower the batch size, or use the paged "
                                 "cache")
        self._order: list[int] = []                 # occupied slots, the oldest admitted first
        self._page_bound = False                    # paged: a request waits for pages (not for a slot)
        self._write: dict[int, np.ndarray] = {}     # paged: the pages an admitted slot's prompt goes to
        self._emitted: dict[int, int] = {}          # a preempted request's tokens already streamed
        self.sequences_peak = 0
        self._forget_prefills()

    def _forget_prefills(self) -> None:
        # Prefilled blocks kept while rows of their prompts wait (a GRPO group admitted over
        # several round trips is prefilled once per shard it lands on): (prompt key, data-parallel
        # shard) -> (block, row within the shard's part), block -> arrays.
        self._prefilled: dict[tuple[tuple, int], tuple[int, int]] = {}
        self._blocks: dict[int, tuple[Any, Any]] = {}
        self._block_rows: dict[int, tuple[int, int]] = {}  # block -> (rows a shard, prompt bucket)
        self._next_block = 0

    def load(self, params: Any) -> None:
        """Decode with these weights from now on (between steps)."""
        self.weights.load(params)
        self._forget_prefills()

    # -- requests -------------------------------------------------------------------------------

    def check(self, request: Request) -> None:
        """Raise ValueError where ``request`` could never run."""
        p = request.prompt
        if not p:
            raise ValueError("the prompt is empty: decoding needs at least one token")
        bad = [t for t in p if not 0 <= int(t) < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"the prompt has token ids outside the vocabulary [0, {self.cfg.vocab_size}): {bad[:5]}")
        if request.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {request.max_new_tokens}")
        if len(p) + request.max_new_tokens > self.max_length:
            raise ValueError(f"the prompt has {len(p)} tokens; with {request.max_new_tokens} new tokens that is "
                             f"past the engine's {self.max_length} positions per row")
        if self.prompt_len is not None and len(p) > self.prompt_len:
            raise ValueError(f"the prompt has {len(p)} tokens, more than this call's prompt bucket ({self.prompt_len})")
        if len(request.eos_ids) > MAX_EOS:
            raise ValueError(f"at most {MAX_EOS} end-of-sequence ids, got {len(request.eos_ids)}")
        if not 0 <= request.top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {request.top_logprobs}")
        if not 0 <= request.index < 2**31:
            raise ValueError(f"index must be in 0..{2**31 - 1}, got {request.index}")
        request.sampling.check()

    def submit(self, request: Request) -> int:
        """Queue ``request``; its id."""
        self.check(request)
        with self._lock:
            rid = self._next_id
            self._next_id += 1
            self._waiting.append((rid, request))
            self._waiting_prompts[self._key(request.prompt)] += 1
        return rid

    def cancel(self, rid: int) -> None:
        """Finish request ``rid`` ("cancelled") at the next step; its slot is freed."""
        with self._lock:
            self._cancelled.add(rid)

    def busy(self) -> bool:
        return bool(getattr(self, "_waiting", None)) or any(r is not None for r in getattr(self, "_rows", ()))

    def kv_report(self) -> dict[str, int]:
        """The KV cache since the last ``reset``: ``kv_bytes_peak`` (used at the peak: the pages rows
        held, with every slot's sliding rings and positions; a contiguous cache uses all it
        reserves), ``kv_bytes_reserved``, ``kv_contiguous_bytes`` (what a contiguous cache would
        reserve for the most rows that decoded at once), ``kv_shared_prompt_tokens``,
        ``preemptions`` (counters of the engine's life, ``EngineStats``) and ``sequences_peak``."""
        one = cache_bytes(self.cfg, 1, self.max_length, self._kv_dtype)
        out = {"kv_bytes_reserved": self.slots * one, "kv_bytes_peak": self.slots * one,
               "kv_contiguous_bytes": self.sequences_peak * one, "sequences_peak": self.sequences_peak,
               "kv_shared_prompt_tokens": self.stats.shared_prompt_tokens, "preemptions": self.stats.preemptions}
        if self._pager is not None:
            rings = self.slots * row_bytes(self.cfg, self.max_length, self._kv_dtype)
            page = page_bytes(self.cfg, self.page_size, self._kv_dtype)
            out["kv_bytes_reserved"] = rings + self._pager.pages * page
            out["kv_bytes_peak"] = rings + self._pager.stats.pages_peak * page
        return out

    def run(self, requests: Sequence[Request]) -> list[Completion]:
        """Every request's completion, in order."""
        ids = [self.submit(r) for r in requests]
        done: dict[int, Completion] = {}
        while len(done) < len(ids):
            done.update(self.step())
        return [done[i] for i in ids]

    # -- one round trip -------------------------------------------------------------------------

    def admission_size(self) -> int:
        """How many free slots a decode chunk waits for (while that many requests wait) before it
        returns to admit them: ``refill`` if set, else the k that costs least per admitted row.
        Rows end at a rate of ``rate`` per decode step (measured since the last ``reset``); waiting
        for k free slots idles about k^2 / (2 rate) slot-steps, k / (2 rate slots) decode steps per
        row admitted, and an admission costs ``ADMIT_COST`` steps, ADMIT_COST / k per row: their sum
        is least at k = sqrt(2 ADMIT_COST rate slots), taken at most the admission width
        (``prefill_ahead``'s power of two) and half the slots. Geometric lengths of mean 48 on 16
        slots: 6, so 4; Think-shaped rows of mean 14,600 on 64 slots: 1. Whatever k, a chunk still
        returns after ``chunk`` steps, which bounds how long a free slot idles."""
        if self.refill is not None:
            return self.refill
        if not self._run_steps:
            return 1
        k = round(math.sqrt(2 * ADMIT_COST * self._run_ended / self._run_steps * self.slots))
        return max(1, min(k, self._admission_width() * mesh_data_parallel(self.mesh), self.slots // 2))

    def _admission_width(self) -> int:
        """The rows a shard's part of a prefill block and of a write holds at least (a power of two
        for ``prefill_ahead`` prompts), and the most an adaptive admission waits for: one width for
        every admission after the first fill, so a run compiles one prefill and one write for them
        however many rows each admits."""
        return bucket(max(1, -(-self.prefill_ahead // mesh_data_parallel(self.mesh))), lo=1)

    def _compiled_width(self, kind: tuple, rows: int, pad: bool = True) -> int:
        """``rows`` (a power of two), or with ``pad`` the narrowest width at least as wide that a
        program of ``kind`` already ran at: padding rows cost less than compiling another program."""
        seen = self._widths.setdefault(kind, set())
        rows = min((w for w in seen if w >= rows), default=rows) if pad else rows
        seen.add(rows)
        return rows

    def _shard(self, slot: int) -> int:
        """The data-parallel shard that holds ``slot``'s row (slots are dp consecutive parts)."""
        return slot // (self.slots // mesh_data_parallel(self.mesh))

    def _admissions(self) -> list[tuple[int, int, Request]]:
        """(slot, id, request) of the waiting requests that take the free slots, in order. A
        request takes a free slot on a shard that holds (or is about to prefill) its prompt,
        else the first free slot of the shard with the most free slots: a GRPO group's rows
        gather on one shard, whose prefill serves them all (rows copy only within a shard)."""
        free = [s for s, r in enumerate(self._rows) if r is None]
        held = set(self._prefilled)  # (prompt key, shard)
        dp = mesh_data_parallel(self.mesh)
        fresh: dict[int, Counter] = {}  # with a prefill bound: bucket -> prompts to prefill per shard
        out = []
        pager = self._pager
        self._page_bound = False
        # Paged: pages the running rows take in the next round trip are not given to a new row.
        # A watermark of a tenth of the pool is kept for growth: filled to the last page, every round
        # trip that takes a row across a page boundary would preempt one (recomputed from its prompt).
        room = None if pager is None else pager.available() - (pager.pages - 1) // 10 - sum(
            pager.pages_to_reach(s, self._positions_ahead(s)) for s in self._order)
        with self._lock:
            while free and self._waiting:
                rid, req = self._waiting.popleft()
                key = self._key(req.prompt)
                self._waiting_prompts[key] -= 1
                if rid in self._cancelled:
                    self._cancelled.discard(rid)
                    self._finish_unstarted(rid, req)
                    continue
                slot = next((s for s in free if (key, self._shard(s)) in held), None)
                if slot is None:
                    spare = Counter(self._shard(s) for s in free)
                    most = max(spare.values())
                    slot = next(s for s in free if spare[self._shard(s)] == most)
                    if self.prefill_tokens is not None:
                        more = {T: Counter(c) for T, c in fresh.items()}
                        more.setdefault(key[0], Counter())[self._shard(slot)] += 1
                        if fresh and sum(prefill_cost(max(c.values()), dp, T)
                                         for T, c in more.items()) > self.prefill_tokens:
                            # Past the bound: this request and those after it wait for the next round trip.
                            self._waiting.appendleft((rid, req))
                            self._waiting_prompts[key] += 1
                            break
                        fresh = more
                if pager is not None:
                    need = pager.pages_to_admit(req.prompt, key[0], ahead=self.chunk)
                    if need > room and (self._order or out):  # no pages for it yet: it waits (an empty pool admits one)
                        self._page_bound = True
                        self._waiting.appendleft((rid, req))
                        self._waiting_prompts[key] += 1
                        break
                    shared = pager.stats.shared_prompt_tokens
                    self._write[slot] = pager.admit(slot, req.prompt, key[0])
                    self.stats.shared_prompt_tokens += pager.stats.shared_prompt_tokens - shared
                    pager.grow(slot, min(len(req.prompt) + self.chunk, self.max_length))
                    room -= need
                free.remove(slot)
                held.add((key, self._shard(slot)))
                out.append((slot, rid, req))
        return out

    def _positions_ahead(self, slot: int) -> int:
        """Positions row ``slot`` holds after the next round trip's decode steps (paged)."""
        row = self._rows[slot]
        req = row.request
        length = len(req.prompt) + max(len(row.out.token_ids) - 1, 0)  # the device's: the first token has no key yet
        return max(length + 1, min(length + self.chunk, len(req.prompt) + req.max_new_tokens - 1))

    def _release(self, slot: int) -> None:
        if slot in self._order:
            self._order.remove(slot)
        if self._pager is not None:
            self._pager.release(slot)

    def _grow_or_preempt(self, fresh: set[int]) -> None:
        """Paged: give every running row the pages its next decode steps need, preempting the
        youngest (back to the front of the queue, recomputed from its prompt) while they do not
        fit; not the rows admitted in this round trip (``fresh``), whose pages admission set aside."""
        pager = self._pager
        needs = {s: self._positions_ahead(s) for s in self._order}
        gone = plan_growth(pager, needs, [s for s in self._order if s not in fresh])
        requeue = []
        for s in gone:
            row = self._rows[s]
            self._emitted[row.rid] = max(self._emitted.get(row.rid, 0), len(row.out.token_ids))
            self._rows[s] = None
            self._release(s)
            self.stats.preemptions += 1
            pager.stats.preemptions += 1
            requeue.append((row.rid, row.request))
        with self._lock:
            for rid, req in sorted(requeue, reverse=True):  # the oldest request first again
                self._waiting.appendleft((rid, req))
                self._waiting_prompts[self._key(req.prompt)] += 1
        for s in self._order:
            if pager.pages_to_reach(s, needs[s]) > pager.available():
                raise RuntimeError(f"the page pool ran dry growing row {s}: a bug in the paged cache's admission")
            pager.grow(s, needs[s])

    def _finish_unstarted(self, rid: int, req: Request) -> None:
        c = Completion(finish_reason="cancelled")
        self._finished.append((rid, c))
        if req.on_finish is not None:
            req.on_finish(c)

    def _bucket_of(self, prompt: list[int]) -> int:
        if self.prompt_len is not None:
            return self.prompt_len
        return min(prompt_bucket(len(prompt), self.cfg, self.mesh), self.max_length)

    def _key(self, prompt: list[int]) -> tuple:
        return (self._bucket_of(prompt), *(int(t) for t in prompt))

    def _dispatch_admit(self, prepared: dict, admitted: list[tuple[int, int, Request]]
                        ) -> list[tuple[list[tuple[int, int]], Any]]:
        """Prefill the admitted requests' prompts that no kept block holds on their slot's shard
        (one block per prompt bucket, each shard's prompts in its part), write every admitted row
        from its block and sample its first token; forget the blocks no waiting request needs.
        The ((row of the write's outputs, slot) of each admitted row, device outputs) of each write."""
        dp = mesh_data_parallel(self.mesh)
        per = self.slots // dp
        fresh: dict[int, list[list[tuple]]] = {}  # bucket -> each shard's prompts to prefill
        for slot, _, req in admitted:
            key, d = self._key(req.prompt), self._shard(slot)
            if (key, d) not in self._prefilled:
                part = fresh.setdefault(key[0], [[] for _ in range(dp)])[d]
                if key not in part:
                    part.append(key)
        if fresh and self.prefill_ahead:
            # A block that runs anyway also prefills the next waiting prompts of its bucket, into its
            # padding rows and up to ``prefill_ahead`` prompts (over the shards, the emptiest part
            # first): a small prefill costs about what a one-prompt one does (it reads every weight
            # once), and their rows find them kept where they land on that shard.
            room = {T: bucket(max(map(len, parts)), lo=1) for T, parts in fresh.items()}
            spare = None if self.prefill_tokens is None else \
                self.prefill_tokens - sum(prefill_cost(q, dp, T) for T, q in room.items())
            for T in sorted(room):
                # As many more rows as ``prefill_ahead`` asks, a power of two a shard within the bound.
                want = max(room[T], self._admission_width())
                while spare is not None and want > room[T] and \
                        prefill_cost(want, dp, T) - prefill_cost(room[T], dp, T) > spare:
                    want = max(room[T], bucket(want, lo=1) // 2)
                if spare is not None:
                    spare -= prefill_cost(want, dp, T) - prefill_cost(room[T], dp, T)
                room[T] = want
            held = {key for key, _ in self._prefilled}
            with self._lock:
                upcoming = [self._key(q.prompt) for _, q in islice(self._waiting, 4 * dp * max(room.values()))]
            for key in upcoming:
                parts = fresh.get(key[0])
                if parts is None or key in held or any(key in part for part in parts):
                    continue
                part = min(parts, key=len)
                if len(part) < room[key[0]]:
                    part.append(key)
        width = self._admission_width()
        blocks, block_rows = [], self._block_rows
        for T, whole in sorted(fresh.items()):
            # Blocks of at most ``width`` prompts a shard (the first fill of every slot too): one
            # prefill program, called as often as needed, instead of one per power of two.
            for i in range(max(-(-len(part) // width) for part in whole)):
                blocks.append((T, [part[i * width:(i + 1) * width] for part in whole]))
        for T, parts in blocks:
            q = self._compiled_width(("prefill", T), bucket(max(map(len, parts)), lo=1),
                                     pad=self.prefill_tokens is None)
            tokens = np.zeros((dp * q, T), np.int32)
            lengths = np.ones(dp * q, np.int32)
            first = next(key for part in parts for key in part)
            for d, part in enumerate(parts):
                for r, key in enumerate(part + [part[0] if part else first] * (q - len(part))):  # padding: copies
                    tokens[d * q + r, :len(key) - 1], lengths[d * q + r] = key[1:], len(key) - 1
            block = self._next_block
            self._next_block += 1
            self._blocks[block] = self._prefill(prepared, self.weights.put(tokens), self.weights.put(lengths))
            block_rows[block] = (q, T)
            self.stats.prefills += sum(map(len, parts))
            self.stats.prefill_blocks += 1
            self.stats.prefilled_tokens += tokens.size
            for d, part in enumerate(parts):
                for r, key in enumerate(part):
                    self._prefilled[(key, d)] = (block, r)
        by_block: dict[int, list[list[tuple[int, int, Request]]]] = {}
        for a in admitted:
            d = self._shard(a[0])
            block = self._prefilled[(self._key(a[2].prompt), d)][0]
            by_block.setdefault(block, [[] for _ in range(dp)])[d].append(a)
        pending = []
        put = self.weights.put
        for block, parts in by_block.items():
            # Rows written at once: a power of two per shard, the padding rows writing nothing (a
            # slot past the shard's), and at least the admission size's (one program for the
            # admissions of a run, whatever each admits). Not every slot: each written row copies
            # a prompt's cache rows.
            n = self._compiled_width(("write", block_rows[block]), min(per, max(bucket(max(map(len, parts)), lo=1),
                                                                          self._admission_width())))
            some = next(a for part in parts for a in part)
            rows = [(part + [(per, -1, some[2])] * (n - len(part))) for part in parts]
            reqs = [q for part in rows for _, _, q in part]
            source = np.asarray([[self._prefilled.get((self._key(q.prompt), d), (0, 0))[1] for _, _, q in part]
                                 for d, part in enumerate(rows)], np.int32)
            dest = np.asarray([[slot % per if rid >= 0 else per for slot, rid, _ in part] for part in rows], np.int32)
            eos = np.full((len(reqs), MAX_EOS), -1, np.int32)
            for i, q in enumerate(reqs):
                eos[i, :len(q.eos_ids)] = sorted(q.eos_ids)
            kn = sampling_knobs([q.sampling for q in reqs])
            logits, cache_rows = self._blocks[block]
            pages = None
            if self._pager is not None:
                T = cache_rows["pos"]["full"].shape[1] if "full" in cache_rows["pos"] else 1
                width = -(-T // self.page_size)
                pages = np.full((1, len(reqs), width), self._pager.pages, np.int32)
                for j, (slot, rid, _) in enumerate(rows[0]):
                    if rid >= 0:
                        pages[0, j] = self._write.pop(slot)[:width]
                pages = put(pages)
                self._push_table()
            self._state, out = self._insert(
                prepared, self._state, logits, cache_rows, put(source), put(dest),
                put(np.asarray([q.sampling.seed for q in reqs], np.uint32)),
                put(np.asarray([q.index for q in reqs], np.int32)), {k: put(v) for k, v in kn.items()},
                put(np.asarray([q.max_new_tokens - 1 for q in reqs], np.int32)), put(eos), pages,
                greedy=all(q.sampling.greedy for q in reqs),
                top_n=MAX_TOP_LOGPROBS if any(q.top_logprobs for q in reqs) else 0)
            written = []
            for d, part in enumerate(parts):
                for j, (slot, rid, req) in enumerate(part):
                    written.append((d * n + j, slot))
                    self._rows[slot] = _Row(rid, req, Completion(top_logprobs=[] if req.top_logprobs else None))
                    self._order.append(slot)
            pending.append((written, out))
        with self._lock:
            needed = {k for k, n in self._waiting_prompts.items() if n > 0}
            self._waiting_prompts = Counter({k: n for k, n in self._waiting_prompts.items() if n > 0})
        for kept in [k for k in self._prefilled if k[0] not in needed]:
            del self._prefilled[kept]
        live_blocks = {b for b, _ in self._prefilled.values()}
        for block in [b for b in self._blocks if b not in live_blocks]:
            del self._blocks[block], self._block_rows[block]
        return pending

    def _keep(self, slot: int, tok: int, lp: float, top: tuple | None, ok: bool = True) -> bool:
        """Append a made token to slot ``slot``'s row; True where the row finished with it. A
        token made from logits that were not finite (``ok`` False) is not kept: the row ends
        there with finish reason "error"."""
        row = self._rows[slot]
        req, c = row.request, row.out
        if not ok:
            c.finish_reason, c.error = "error", nonfinite_error(len(c.token_ids))
        else:
            c.token_ids.append(tok)
            c.logprobs.append(lp)
            if c.top_logprobs is not None and top is not None:
                c.top_logprobs.append([(int(i), float(v)) for v, i in zip(*top)][:req.top_logprobs])
            if req.on_token is not None and len(c.token_ids) > self._emitted.get(row.rid, 0):
                req.on_token(tok, lp)  # a preempted row's recomputed tokens were streamed the first time
            if tok in req.eos_ids or (req.stop is not None and req.stop(c.token_ids)):
                c.finish_reason = "stop"
            elif len(c.token_ids) >= req.max_new_tokens:
                c.finish_reason = "length"
            else:
                return False
        self._rows[slot] = None
        self._release(slot)
        self._emitted.pop(row.rid, None)
        self._finished.append((row.rid, c))
        if req.on_finish is not None:
            req.on_finish(c)
        return True

    def _push_table(self) -> None:
        """The page table to the device where the host changed it (paged)."""
        if self._pager.dirty:
            self._state["cache"]["table"] = self.weights.put(self._pager.table)
            self._pager.dirty = False

    def step(self) -> list[tuple[int, Completion]]:
        """One host round trip; the (id, completion) of the requests that finished in it."""
        self._finished: list[tuple[int, Completion]] = []
        prepared = self.weights(self.slots)
        if self._state is None:
            paged = {} if self._pager is None else {"pages": self._pager.pages, "page_size": self.page_size}
            self._state = self._init(prepared, slots=self.slots, max_length=self.max_length, **paged)
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()
        for s, row in enumerate(self._rows):
            if row is not None and row.rid in cancelled:
                row.out.finish_reason = "cancelled"
                self._rows[s] = None
                self._release(s)
                self._emitted.pop(row.rid, None)
                self._finished.append((row.rid, row.out))
                if row.request.on_finish is not None:
                    row.request.on_finish(row.out)
                cancelled.discard(row.rid)
        with self._lock:
            self._cancelled |= cancelled  # those still waiting
        pending = self._dispatch_admit(prepared, self._admissions())
        if self._pager is not None:
            fresh = {slot for written, _ in pending for _, slot in written}
            self._grow_or_preempt(fresh)
            self._push_table()
        occupied = [r is not None for r in self._rows]
        self.sequences_peak = max(self.sequences_peak, sum(occupied))
        # Rows the host finished (a stop string, a cancel) that the device still decodes.
        kill = self._device_live & ~np.asarray(occupied)
        for written, _ in pending:
            kill[[slot for _, slot in written]] = False
        chunk = None
        if any(occupied):
            with self._lock:
                waiting = len(self._waiting)
            need = min(self.admission_size(), waiting) if waiting else self.slots + 1
            if waiting and self._page_bound:  # requests wait for pages, not slots: return once a row ends
                need = self.slots - sum(occupied) + 1
            # A stop string is seen only here, on the host: while requests wait, rows that have one
            # come back sooner, so a stopped row's slot idles (or decodes past its stop) for fewer steps.
            host_stops = any(r is not None and r.request.stop is not None for r in self._rows)
            steps = max(1, self.chunk // 4) if waiting and host_stops else self.chunk
            top_n = MAX_TOP_LOGPROBS if any(r is not None and r.request.top_logprobs for r in self._rows) else 0
            greedy = all(r is None or r.request.sampling.greedy for r in self._rows)
            self._state, chunk = self._chunk(prepared, self._state, self.weights.put(kill), jnp.int32(need),
                                             jnp.int32(steps), chunk=self.chunk, max_length=self.max_length,
                                             greedy=greedy, top_n=top_n)
        # Read: the first tokens of the admitted rows, then the chunk's steps.
        for written, out in pending:
            host = [np.asarray(a) for a in out]
            for i, slot in written:
                top = (host[4][i], host[5][i]) if len(host) > 4 else None
                self._keep(slot, int(host[0][i]), float(host[1][i]), top, bool(host[3][i]))
        if chunk is None:
            self._device_live[:] = False
        else:
            n = int(np.asarray(chunk["steps"]))
            tok, lp, made, ok = (np.asarray(chunk[k])[:n] for k in ("tok", "lp", "made", "ok"))
            tops = (np.asarray(chunk["top_lp"])[:n], np.asarray(chunk["top_id"])[:n]) if "top_lp" in chunk else None
            self.stats.decode_steps += n
            self.stats.slot_steps += n * self.slots
            self._run_steps += n
            for i in range(n):
                for s in np.flatnonzero(made[i]):
                    s = int(s)
                    if self._rows[s] is None:  # finished by the host earlier in this chunk: dropped
                        continue
                    self.stats.decoded += 1
                    self._run_ended += self._keep(s, int(tok[i, s]), float(lp[i, s]),
                                                  None if tops is None else (tops[0][i, s], tops[1][i, s]),
                                                  bool(ok[i, s]))
            self._device_live = np.asarray(chunk["live"]).copy()
        self.stats.round_trips += 1
        return self._finished
