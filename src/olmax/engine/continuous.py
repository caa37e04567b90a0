"""The continuous-batching engine: a fixed number of row slots over one KV cache; a row that
finishes (EOS, its length, a stop string, a cancel) gives its slot to the next waiting request at
the next host round trip, while the other rows go on decoding.

One round trip (``Engine.step``):

1. admit waiting requests to free slots: their prompts are prefilled together (a prompt that
   several admitted rows share, a GRPO group, once) and written into those slots' rows of the
   cache (``decode.write_rows``), and each row's first token sampled;
2. run up to ``chunk`` decode steps inside one compiled loop, EOS and length decided on the device
   (a finished row stops advancing); the loop returns early when every row has finished, or when
   enough slots are free for the requests waiting (``refill``);
3. read the tokens, apply stop strings (tokens a row made past its stop are dropped), stream,
   finish rows, free their slots.

A row samples with its own key (``fold_in(key(seed), index)``) and its own step count, and every
operation of a decode step is row by row, so a completion equals, token for token and log-prob for
log-prob, what the static engine (``olmax.engine.static``) or the same request alone gives with the
same cache length and prompt bucket: it does not depend on which other requests ran beside it.
"""

from __future__ import annotations

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
from olmax.engine.sampling import MAX_TOP_LOGPROBS, Completion, Sampling, row_keys, sample
from olmax.engine.sampling import knobs as sampling_knobs
from olmax.engine.shapes import bucket, mesh_data_parallel, prompt_bucket
from olmax.engine.weights import DecodeWeights, on_mesh
from olmax.model.decode import blank_cache, decode_step, layout_of, prefill, write_rows
from olmax.model.dispatch import reproduce_decode_bits

MAX_EOS = 8          # end-of-sequence ids a request may name (a fixed-width table on the device)
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
    ``prefills``: prompt rows prefilled; ``round_trips``."""
    decode_steps: int = 0
    slot_steps: int = 0
    decoded: int = 0
    prefills: int = 0
    round_trips: int = 0

    @property
    def slot_utilisation(self) -> float:
        """Kept tokens per slot and decode step (1: no slot ever idle or wasted)."""
        return self.decoded / self.slot_steps if self.slot_steps else 0.0


def blank_state(prepared: dict, cfg: ModelConfig, slots: int, max_length: int) -> dict:
    """The device state of ``slots`` empty slots."""
    z = jnp.zeros((slots,), jnp.int32)
    return {"tok": z, "cache": blank_cache(cfg, prepared, slots, max_length),
            "keys": row_keys(z.astype(jnp.uint32), z), "step": z, "left": z,
            "live": jnp.zeros((slots,), bool), "eos": jnp.full((slots, MAX_EOS), -1, jnp.int32),
            "knobs": {k: v for k, v in zip(KNOBS, (jnp.ones((slots,), jnp.float32), z,
                                                    jnp.ones((slots,), jnp.float32), jnp.ones((slots,), bool)))}}

def prefill_block(prepared, tokens, lengths, *, cfg, max_length):
    """The last-token logits and cache rows of a block of distinct prompts (``decode.prefill``)."""
    return prefill(prepared, tokens, lengths, cfg, max_length)


def admit(prepared, state, logits, rows, source, dest, seeds, indices, knobs, left, eos, *, cfg, greedy, top_n,
          readable=lambda *a: a):
    """Write row ``source[i]`` of a prefilled block (``prefill_block``'s ``logits`` and cache
    ``rows``) into slot ``dest[i]`` and sample that row's first token. ``readable``: makes the
    outputs the host reads readable on every process (``DecodeWeights.host_readable``)."""
    keys = row_keys(seeds, indices)
    with reproduce_decode_bits(layout_of(prepared) == "packed"):
        tok, lp, logp = sample(jnp.take(logits, source, axis=0), keys, jnp.int32(0), knobs, greedy,
                               cfg.vocab_size)
    live = ~jnp.any(tok[:, None] == eos, axis=-1) & (left > 0)

    def put(a, v):
        return a.at[dest].set(v, mode="drop")
    state = {"tok": put(state["tok"], tok), "cache": write_rows(state["cache"], rows, source, dest),
             "keys": put(state["keys"], keys), "step": put(state["step"], jnp.ones_like(tok)),
             "left": put(state["left"], left), "live": put(state["live"], live), "eos": put(state["eos"], eos),
             "knobs": {k: put(state["knobs"][k], knobs[k]) for k in KNOBS}}
    out = (tok, lp, live) + (tuple(jax.lax.top_k(logp, top_n)) if top_n else ())
    return state, readable(*out)


def decode_chunk(prepared, state, kill, need, steps, *, cfg, chunk, max_length, greedy, top_n,
                 readable=lambda *a: a):
    """Up to ``steps`` (at most ``chunk``) decode steps of every live row (``kill``: rows the
    host finished); returns early when no row is live or ``need`` rows are not. Out: the
    state, the tokens, log-probs and which were made ([chunk, slots] each), the steps run,
    the rows still live, and with ``top_n`` the top log-probabilities [chunk, slots, top_n]."""
    b = state["tok"].shape[0]
    kernel = layout_of(prepared) == "packed"
    state = {**state, "live": state["live"] & ~kill}
    outs = {"tok": jnp.zeros((chunk, b), jnp.int32), "lp": jnp.zeros((chunk, b), jnp.float32),
            "made": jnp.zeros((chunk, b), bool)}
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
        left = st["left"] - made
        now = live & ~jnp.any(tok[:, None] == st["eos"], axis=-1) & (left > 0)
        st = {**st, "tok": jnp.where(made, tok, st["tok"]), "cache": cache, "step": st["step"] + made,
              "left": left, "live": now}
        new = {"tok": tok, "lp": lp, "made": made}
        if top_n:
            new["top_lp"], new["top_id"] = jax.lax.top_k(logp, top_n)
        out = {k: jax.lax.dynamic_update_index_in_dim(out[k], new[k], i, 0) for k in out}
        return i + 1, st, out

    n, state, outs = jax.lax.while_loop(go, one, (jnp.int32(0), state, outs))
    read = readable(n, state["live"], *outs.values())
    return state, dict(zip(("steps", "live", *outs), read))


def programs(cfg: ModelConfig, mesh: Mesh | None, readable: Callable = lambda *a: a) -> tuple[Callable, ...]:
    """The engine's four compiled programs, as ``Engine`` runs them and ``olmax compile`` lowers
    them: ``blank_state`` (static ``slots``, ``max_length``), ``prefill_block`` (static
    ``max_length``), ``admit`` (static ``greedy``, ``top_n``; the state donated) and
    ``decode_chunk`` (static ``chunk``, ``max_length``, ``greedy``, ``top_n``; the state donated)."""
    return (jax.jit(on_mesh(partial(blank_state, cfg=cfg), mesh), static_argnames=("slots", "max_length")),
            jax.jit(on_mesh(partial(prefill_block, cfg=cfg), mesh), static_argnames=("max_length",)),
            jax.jit(on_mesh(partial(admit, cfg=cfg, readable=readable), mesh),
                    static_argnames=("greedy", "top_n"), donate_argnums=(1,)),
            jax.jit(on_mesh(partial(decode_chunk, cfg=cfg, readable=readable), mesh),
                    static_argnames=("chunk", "max_length", "greedy", "top_n"), donate_argnums=(1,)))


def block_rows(prompts: int, dp: int) -> int:
    """The rows of a prefilled block of ``prompts`` distinct prompts: a power of two, whole rows
    per data-parallel shard (the padding rows copy the first prompt)."""
    return -(-bucket(prompts, lo=1) // dp) * dp


class Engine:
    """``slots`` rows decoded together over a cache of ``max_length`` positions per row; ``chunk``
    decode steps per host round trip at most. ``prompt_len``: the padded length every prompt is
    prefilled at (a ``generate`` call's bucket, so its completions equal the static engine's);
    None: each prompt's own bucket (the server: a request's completion then depends on nothing
    but itself). ``refill``: return from a chunk early once this many slots are free and that
    many requests wait (default 1: on 256 Think-shaped rows over 16 slots, slot utilisation 0.94
    against 0.92 at 2, ``benchmarks/bench_engine.py``). ``prefill_ahead``: a prefill also takes the
    next waiting prompts of its bucket, up to this many prompts in all (default 4: on those rows,
    61 prefills of one prompt became 16 of four; 0: only the admitted rows' prompts, the rest of
    a power-of-two block padded with copies). Submit and cancel from any thread; ``step`` from one."""

    def __init__(self, params: Any, cfg: ModelConfig, *, slots: int, max_length: int, mesh: Mesh | None = None,
                 chunk: int = 8, prompt_len: int | None = None, refill: int | None = None,
                 weights: DecodeWeights | None = None, prefill_ahead: int = 4):
        self.cfg, self.mesh = cfg, mesh
        self.weights = weights if weights is not None else DecodeWeights(params, cfg, mesh, rows=slots)
        self._lock = threading.Lock()
        self._waiting: deque[tuple[int, Request]] = deque()
        self._waiting_prompts: Counter = Counter()  # prompt key -> requests waiting with it
        self._cancelled: set[int] = set()
        self._next_id = 0
        self._init, self._prefill, self._insert, self._chunk = programs(cfg, mesh, self.weights.host_readable)
        if prefill_ahead < 0:
            raise ValueError(f"prefill_ahead must be >= 0, got {prefill_ahead}")
        self.prefill_ahead = prefill_ahead
        self.stats = EngineStats()
        self.reset(slots=slots, max_length=max_length, chunk=chunk, prompt_len=prompt_len, refill=refill)

    # -- set-up ---------------------------------------------------------------------------------

    def reset(self, *, slots: int, max_length: int, chunk: int = 8, prompt_len: int | None = None,
              refill: int | None = None) -> None:
        """New shapes (only while idle): the compiled programs of earlier shapes are kept."""
        if self.busy():
            raise RuntimeError("the engine is busy: reset it only between runs")
        dp = mesh_data_parallel(self.mesh)
        if slots < 1 or slots % dp:
            raise ValueError(f"slots must be a positive multiple of the {dp} data-parallel shards, got {slots}")
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1, got {chunk}")
        if prompt_len is not None and prompt_len > max_length:
            raise ValueError(f"prompt_len {prompt_len} is longer than the cache ({max_length})")
        self.slots, self.max_length, self.chunk, self.prompt_len = slots, max_length, chunk, prompt_len
        self.refill = 1 if refill is None else max(1, refill)
        self._rows: list[_Row | None] = [None] * slots
        self._device_live = np.zeros(slots, bool)   # the device's view: still decoding
        self._state = None                          # made at the first step (after any load)
        self._forget_prefills()

    def _forget_prefills(self) -> None:
        # Prefilled blocks kept while rows of their prompts wait (a GRPO group admitted over
        # several round trips is prefilled once): prompt key -> (block, row), block -> arrays.
        self._prefilled: dict[tuple, tuple[int, int]] = {}
        self._blocks: dict[int, tuple[Any, Any]] = {}
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

    def run(self, requests: Sequence[Request]) -> list[Completion]:
        """Every request's completion, in order."""
        ids = [self.submit(r) for r in requests]
        done: dict[int, Completion] = {}
        while len(done) < len(ids):
            done.update(self.step())
        return [done[i] for i in ids]

    # -- one round trip -------------------------------------------------------------------------

    def _admissions(self) -> list[tuple[int, int, Request]]:
        """(slot, id, request) of the waiting requests that take the free slots, in order."""
        free = [s for s, r in enumerate(self._rows) if r is None]
        out = []
        with self._lock:
            while free and self._waiting:
                rid, req = self._waiting.popleft()
                self._waiting_prompts[self._key(req.prompt)] -= 1
                if rid in self._cancelled:
                    self._cancelled.discard(rid)
                    self._finish_unstarted(rid, req)
                    continue
                out.append((free.pop(0), rid, req))
        return out

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

    def _dispatch_admit(self, prepared: dict, admitted: list[tuple[int, int, Request]]) -> list[tuple[list, Any]]:
        """Prefill the admitted requests' prompts that no kept block holds (one block per prompt
        bucket), write every admitted row from its block and sample its first token; forget the
        blocks no waiting request needs. The (admitted rows, device outputs) of each write."""
        dp = mesh_data_parallel(self.mesh)
        fresh: dict[int, list[tuple]] = {}
        for _, _, req in admitted:
            key = self._key(req.prompt)
            if key not in self._prefilled and key not in fresh.get(key[0], []):
                fresh.setdefault(key[0], []).append(key)
        if fresh and self.prefill_ahead:
            # A block that runs anyway also prefills the next waiting prompts of its bucket, into its
            # padding rows and up to ``prefill_ahead`` prompts: a small prefill costs about what a
            # one-prompt one does (it reads every weight once), and their rows find them kept.
            want = {T: max(block_rows(len(keys), dp), self.prefill_ahead) for T, keys in fresh.items()}
            with self._lock:
                upcoming = [self._key(q.prompt) for _, q in islice(self._waiting, 4 * max(want.values()))]
            for key in upcoming:
                keys = fresh.get(key[0])
                if keys is not None and len(keys) < want[key[0]] and key not in self._prefilled and key not in keys:
                    keys.append(key)
        for T, keys in sorted(fresh.items()):
            P = block_rows(len(keys), dp)
            tokens = np.zeros((P, T), np.int32)
            lengths = np.ones(P, np.int32)
            for r, key in enumerate(keys):
                tokens[r, :len(key) - 1], lengths[r] = key[1:], len(key) - 1
            tokens[len(keys):], lengths[len(keys):] = tokens[0], lengths[0]  # padding rows: copies of the first
            block = self._next_block
            self._next_block += 1
            self._blocks[block] = self._prefill(prepared, self.weights.put(tokens), self.weights.put(lengths),
                                                max_length=self.max_length)
            self.stats.prefills += len(keys)
            for r, key in enumerate(keys):
                self._prefilled[key] = (block, r)
        by_block: dict[int, list[tuple[int, int, Request]]] = {}
        for a in admitted:
            by_block.setdefault(self._prefilled[self._key(a[2].prompt)][0], []).append(a)
        pending = []
        put = self.weights.put
        for block, group in by_block.items():
            # Rows written at once: a power of two (whole rows per data-parallel shard); the padding
            # rows write nothing. Not every slot: each written row gathers a whole cache row.
            pad = block_rows(len(group), dp) - len(group)
            reqs = [g[2] for g in group] + [group[0][2]] * pad
            source = np.asarray([self._prefilled[self._key(q.prompt)][1] for q in reqs], np.int32)
            dest = np.asarray([g[0] for g in group] + [self.slots] * pad, np.int32)  # past the end: dropped
            eos = np.full((len(reqs), MAX_EOS), -1, np.int32)
            for i, q in enumerate(reqs):
                eos[i, :len(q.eos_ids)] = sorted(q.eos_ids)
            kn = sampling_knobs([q.sampling for q in reqs])
            logits, rows = self._blocks[block]
            self._state, out = self._insert(
                prepared, self._state, logits, rows, put(source), put(dest),
                put(np.asarray([q.sampling.seed for q in reqs], np.uint32)),
                put(np.asarray([q.index for q in reqs], np.int32)), {k: put(v) for k, v in kn.items()},
                put(np.asarray([q.max_new_tokens - 1 for q in reqs], np.int32)), put(eos),
                greedy=all(q.sampling.greedy for q in reqs),
                top_n=MAX_TOP_LOGPROBS if any(q.top_logprobs for q in reqs) else 0)
            pending.append((group, out))
            for slot, rid, req in group:
                self._rows[slot] = _Row(rid, req, Completion(top_logprobs=[] if req.top_logprobs else None))
        with self._lock:
            needed = {k for k, n in self._waiting_prompts.items() if n > 0}
            self._waiting_prompts = Counter({k: n for k, n in self._waiting_prompts.items() if n > 0})
        for key in [k for k in self._prefilled if k not in needed]:
            del self._prefilled[key]
        live_blocks = {b for b, _ in self._prefilled.values()}
        for block in [b for b in self._blocks if b not in live_blocks]:
            del self._blocks[block]
        return pending

    def _keep(self, slot: int, tok: int, lp: float, top: tuple | None) -> bool:
        """Append a made token to slot ``slot``'s row; True where the row finished with it."""
        row = self._rows[slot]
        req, c = row.request, row.out
        c.token_ids.append(tok)
        c.logprobs.append(lp)
        if c.top_logprobs is not None and top is not None:
            c.top_logprobs.append([(int(i), float(v)) for v, i in zip(*top)][:req.top_logprobs])
        if req.on_token is not None:
            req.on_token(tok, lp)
        if tok in req.eos_ids or (req.stop is not None and req.stop(c.token_ids)):
            c.finish_reason = "stop"
        elif len(c.token_ids) >= req.max_new_tokens:
            c.finish_reason = "length"
        else:
            return False
        self._rows[slot] = None
        self._finished.append((row.rid, c))
        if req.on_finish is not None:
            req.on_finish(c)
        return True

    def step(self) -> list[tuple[int, Completion]]:
        """One host round trip; the (id, completion) of the requests that finished in it."""
        self._finished: list[tuple[int, Completion]] = []
        prepared = self.weights(self.slots)
        if self._state is None:
            self._state = self._init(prepared, slots=self.slots, max_length=self.max_length)
        with self._lock:
            cancelled, self._cancelled = self._cancelled, set()
        for s, row in enumerate(self._rows):
            if row is not None and row.rid in cancelled:
                row.out.finish_reason = "cancelled"
                self._rows[s] = None
                self._finished.append((row.rid, row.out))
                if row.request.on_finish is not None:
                    row.request.on_finish(row.out)
                cancelled.discard(row.rid)
        with self._lock:
            self._cancelled |= cancelled  # those still waiting
        pending = self._dispatch_admit(prepared, self._admissions())
        occupied = [r is not None for r in self._rows]
        # Rows the host finished (a stop string, a cancel) that the device still decodes.
        kill = self._device_live & ~np.asarray(occupied)
        for group, _ in pending:
            kill[[g[0] for g in group]] = False
        chunk = None
        if any(occupied):
            with self._lock:
                waiting = len(self._waiting)
            need = min(self.refill, waiting) if waiting else self.slots + 1
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
        for group, out in pending:
            host = [np.asarray(a) for a in out]
            for i, (slot, _, _) in enumerate(group):
                top = (host[3][i], host[4][i]) if len(host) > 3 else None
                self._keep(slot, int(host[0][i]), float(host[1][i]), top)
        if chunk is None:
            self._device_live[:] = False
        else:
            n = int(np.asarray(chunk["steps"]))
            tok, lp, made = (np.asarray(chunk[k])[:n] for k in ("tok", "lp", "made"))
            tops = (np.asarray(chunk["top_lp"])[:n], np.asarray(chunk["top_id"])[:n]) if "top_lp" in chunk else None
            self.stats.decode_steps += n
            self.stats.slot_steps += n * self.slots
            for i in range(n):
                for s in np.flatnonzero(made[i]):
                    s = int(s)
                    if self._rows[s] is None:  # finished by the host earlier in this chunk: dropped
                        continue
                    self.stats.decoded += 1
                    self._keep(s, int(tok[i, s]), float(lp[i, s]),
                               None if tops is None else (tops[0][i, s], tops[1][i, s]))
            self._device_live = np.asarray(chunk["live"]).copy()
        self.stats.round_trips += 1
        return self._finished
