"""The server's one seam to the generation engine: the engine's types, building the engine for
a loaded checkpoint, and :class:`EngineWorker`, the thread that steps it.

HTTP handlers call :meth:`EngineWorker.submit` and :meth:`EngineWorker.cancel` (both thread-safe,
as ``Engine.submit``/``cancel`` are); one thread runs ``Engine.step`` while anything is waiting or
running and sleeps otherwise, so the requests in flight decode in the same batch. Tests give the
worker a fake engine with the same four methods (``submit``, ``cancel``, ``step``, ``busy``).
"""

from __future__ import annotations

import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any, Protocol

from olmax.engine import MAX_TOP_LOGPROBS, Completion, Engine, Request, Sampling, prompt_bucket

__all__ = ["MAX_TOP_LOGPROBS", "Completion", "Request", "Sampling", "EngineLike", "EngineWorker", "build_engine"]


class EngineLike(Protocol):
    def submit(self, request: Request) -> int: ...
    def cancel(self, rid: int) -> None: ...
    def step(self) -> list[tuple[int, Completion]]: ...
    def busy(self) -> bool: ...


def build_engine(model: Any, slots: int, max_length: int, prefill_tokens: int | None = None,
                 kv_cache: str = "contiguous", page_size: int = 16, kv_budget: str | None = None) -> Engine:
    """The continuous-batching engine over a checkpoint loaded by ``olmax.infer.run.Model``. A paged
    cache keeps a prefix cache (requests that begin alike share pages, least recently used evicted)
    where a prompt's keys and values are the same bits whatever was prefilled beside it
    (``dispatch.can_reproduce_decode_bits``: the CPU kernels), so a reused prefix is exact."""
    from olmax.engine.paged import budget_bytes, parse_budget
    from olmax.model.dispatch import can_reproduce_decode_bits
    budget = parse_budget(kv_budget)
    return Engine(model.params, model.cfg.model, slots=slots, max_length=max_length, prefill_tokens=prefill_tokens,
                  kv_cache=kv_cache, page_size=page_size, kv_budget=None if budget is None else budget_bytes(budget),
                  prefix_cache=kv_cache == "paged" and can_reproduce_decode_bits(model.cfg.model))


def warm_up(engine: Engine, cfg: Any, upto: int, log: Callable[[str], None]) -> int:
    """Compile the engine's prefill programs before serving, so that no request waits for one: the
    engine compiles a program per (rows admitted together, a power of two; prompt bucket; greedy
    or sampled) the first time it admits such a group. Runs one-token requests of every bucket up
    to ``upto`` prompt tokens, admitted 1, 2, 4, ... ``engine.slots`` at a time, greedy and
    sampled (not with top logprobs). The number of groups run."""
    lengths, n = [], 1
    while n <= min(upto, engine.max_length - 1):
        lengths.append(n)
        n = prompt_bucket(n, cfg, engine.mesh) + 1
    sizes = [1 << k for k in range(engine.slots.bit_length()) if 1 << k <= engine.slots]
    runs = 0
    t0 = time.perf_counter()
    for length in lengths:
        for rows in sizes:
            for sampling in (Sampling(), Sampling(temperature=1.0)):
                # Distinct prompts (rows sharing a prompt are prefilled once).
                engine.run([Request(prompt=[(i + 1) % cfg.vocab_size] * length, max_new_tokens=1,
                                    sampling=sampling, index=i) for i in range(rows)])
                runs += 1
    log(f"olmax serve: warmed up {runs} prefill groups (prompts up to {lengths[-1] if lengths else 0} tokens, "
        f"up to {engine.slots} rows at a time) in {time.perf_counter() - t0:.1f} s")
    return runs


class EngineWorker:
    """Runs ``engine.step()`` on one thread while the engine is busy. A step that raises is a bug:
    its traceback goes to stderr, every request in flight is failed through its ``on_error``,
    and later submissions are refused (the server answers 500 and stays up for /health)."""

    def __init__(self, engine: EngineLike, log: Callable[[str], None] | None = None) -> None:
        self.engine = engine
        self.log = log or (lambda s: print(s, file=sys.stderr, flush=True))
        self.failed: BaseException | None = None
        self._cond = threading.Condition()
        self._live: dict[int, Callable[[BaseException], None]] = {}
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="olmax-engine", daemon=True)

    def start(self) -> EngineWorker:
        self._thread.start()
        return self

    def submit(self, request: Request, on_error: Callable[[BaseException], None]) -> int:
        """The engine's id for ``request``; ValueError when the engine refuses it, RuntimeError
        once the engine has failed."""
        with self._cond:
            if self.failed is not None:
                raise RuntimeError("the generation engine failed; see the server's log")
            rid = self.engine.submit(request)
            self._live[rid] = on_error
            self._cond.notify()
        return rid

    def cancel(self, rid: int) -> None:
        with self._cond:
            if self._live.pop(rid, None) is not None and self.failed is None:
                self.engine.cancel(rid)
                self._cond.notify()

    def in_flight(self) -> int:
        with self._cond:
            return len(self._live)

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closing and not self.engine.busy():
                    self._cond.wait()
                if self._closing and not self.engine.busy():
                    return
            try:
                finished = self.engine.step()
            except BaseException as e:  # noqa: BLE001 - logged here, reported to every waiting request
                self.log("serve: the generation engine failed:\n" + traceback.format_exc().rstrip())
                with self._cond:
                    self.failed = e
                    live, self._live = list(self._live.values()), {}
                for on_error in live:
                    on_error(e)
                return
            if finished:
                with self._cond:
                    for rid, _ in finished:
                        self._live.pop(rid, None)

    def close(self, timeout: float | None = None) -> None:
        """Stop once nothing is waiting or running (the server drains its requests first)."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join(timeout)
