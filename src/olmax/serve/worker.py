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
import traceback
from collections.abc import Callable
from typing import Any, Protocol

from olmax.engine import MAX_TOP_LOGPROBS, Completion, Engine, Request, Sampling

__all__ = ["MAX_TOP_LOGPROBS", "Completion", "Request", "Sampling", "EngineLike", "EngineWorker", "build_engine"]


class EngineLike(Protocol):
    def submit(self, request: Request) -> int: ...
    def cancel(self, rid: int) -> None: ...
    def step(self) -> list[tuple[int, Completion]]: ...
    def busy(self) -> bool: ...


def build_engine(model: Any, slots: int, max_length: int) -> Engine:
    """The continuous-batching engine over a checkpoint loaded by ``olmax.infer.run.Model``."""
    return Engine(model.params, model.cfg.model, slots=slots, max_length=max_length)


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
