"""Admission: a request's body turned into engine work (``protocol.Job``) off the event loop,
under a deadline.

The work that grows with a body (parsing its JSON, checking every string, rendering the chat
template, tokenizing) is done where it cannot stall anyone else. Python's JSON parser and the
tokenizer's ``encode`` hold the GIL for a whole call (a 15 MB body of small JSON values took
seconds, a 4 MiB prompt's encode held a stream in progress for 7.5 s), so a thread alone does not
keep the event loop answering: ``olmax serve`` parses in worker processes (``Workers``), each
holding the served model. A request waits for a free worker and its answer until its deadline;
past it the worker is killed and replaced (the server answers 408). ``InThread`` does the
same work in a thread of this process (the unit tests' fake server).
"""

from __future__ import annotations

import multiprocessing
import queue
import signal
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

import anyio
from anyio import to_thread

from olmax.serve.protocol import APIError, Job, ServedModel, parse_chat, parse_completion, read_body

WORKERS = 2             # processes that parse: a slow request holds one, the other serves the rest
STARTUP_TIMEOUT = 120.0  # seconds for a worker process to start (it imports olmax.serve and JAX)


def parse(kind: str, raw: bytes, served: ServedModel) -> Job:
    """A body (``kind``: "chat" or "completion") as engine work, or ``APIError``."""
    body = read_body(raw)
    return (parse_chat if kind == "chat" else parse_completion)(body, served)


class InThread:
    """``parse`` in a thread of this process (GIL-bound work stalls the event loop meanwhile).
    Called as ``await admission(kind, body, deadline)`` (``time.monotonic()``), as ``Workers``:
    the job, its ``APIError``, or TimeoutError past the deadline."""

    def __init__(self, served: ServedModel, fn: Callable[[str, bytes, ServedModel], Job] = parse) -> None:
        self.served, self.fn = served, fn

    async def __call__(self, kind: str, raw: bytes, deadline: float) -> Job:
        with anyio.move_on_after(deadline - time.monotonic()):
            return await to_thread.run_sync(self.fn, kind, raw, self.served, abandon_on_cancel=True)
        raise TimeoutError

    def close(self) -> None:
        pass


def _serve(conn: Any, served: ServedModel, fn: Callable[[str, bytes, ServedModel], Job]) -> None:
    """A worker process: "ready", then (kind, body) in, (True, Job) or (False, APIError or a
    traceback) out, until the server closes the pipe."""
    for sig in (signal.SIGINT, signal.SIGTERM):  # the server's to act on: it drains, then closes the pipe
        signal.signal(sig, signal.SIG_IGN)
    conn.send("ready")
    while True:
        try:
            kind, raw = conn.recv()
        except (EOFError, OSError):
            return
        try:
            out = (True, fn(kind, raw, served))
        except APIError as e:
            out = (False, e)
        except Exception:  # noqa: BLE001 - a bug: its traceback goes to the server's log
            out = (False, traceback.format_exc())
        conn.send(out)


class _Worker:
    def __init__(self, ctx: Any, served: ServedModel, fn: Callable) -> None:
        self.conn, theirs = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(theirs, served, fn), name="olmax-serve-parse", daemon=True)
        self.proc.start()
        theirs.close()
        self.ready = False

    def wait_ready(self, timeout: float) -> bool:
        """Whether the worker has started (imported, holding the model) within ``timeout``."""
        if not self.ready and self.conn.poll(timeout):
            self.ready = self.conn.recv() == "ready"
        return self.ready

    def kill(self) -> None:
        self.proc.kill()
        self.proc.join(5)
        self.conn.close()


class Workers:
    """``processes`` worker processes that ``parse`` bodies (started from a fork server: no copy of
    this process's threads or accelerator state). A request takes a free worker, or waits for one,
    until its deadline; a worker past the deadline, or one that died, is replaced."""

    def __init__(self, served: ServedModel, processes: int = WORKERS,
                 fn: Callable[[str, bytes, ServedModel], Job] = parse) -> None:
        if "forkserver" in multiprocessing.get_all_start_methods():
            self._ctx = multiprocessing.get_context("forkserver")
            # Imported once in the fork server: a worker (a replacement too) starts in milliseconds.
            self._ctx.set_forkserver_preload(["olmax.serve.admission"])
        else:
            self._ctx = multiprocessing.get_context("spawn")
        self.served, self.fn = served, fn
        self._idle: queue.SimpleQueue[_Worker] = queue.SimpleQueue()
        self._all: set[_Worker] = set()
        self._lock = threading.Lock()
        self._closed = False
        # Threads waiting on workers: their own pool, so that requests queued here never hold the
        # threads that start engine work or render responses.
        self._limiter = anyio.CapacityLimiter(64)
        started = [self._start() for _ in range(processes)]
        for w in started:
            if not w.wait_ready(STARTUP_TIMEOUT):
                self.close()
                raise RuntimeError(f"olmax serve: a parse worker did not start within {STARTUP_TIMEOUT:g} s "
                                   f"(exit code {w.proc.exitcode})")
            self._idle.put(w)

    def _start(self) -> _Worker:
        w = _Worker(self._ctx, self.served, self.fn)
        with self._lock:
            self._all.add(w)
        return w

    def _replace(self, w: _Worker) -> None:
        with self._lock:
            self._all.discard(w)
        w.kill()
        if not self._closed:
            self._idle.put(self._start())

    def _call(self, kind: str, raw: bytes, deadline: float) -> tuple[bool, Any] | None:
        """(ok, result) from a worker; None past the deadline."""
        try:
            w = self._idle.get(timeout=max(deadline - time.monotonic(), 0.001))
        except queue.Empty:
            return None
        try:
            if not w.wait_ready(max(deadline - time.monotonic(), 0)):  # one started after a kill
                self._idle.put(w)
                return None
            w.conn.send((kind, raw))
            if not w.conn.poll(max(deadline - time.monotonic(), 0)):
                self._replace(w)
                return None
            out = w.conn.recv()
        except (EOFError, OSError) as e:  # the worker died (killed by the system, say)
            code = w.proc.exitcode
            self._replace(w)
            return False, f"the parse worker died (exit code {code}): {type(e).__name__}"
        self._idle.put(w)
        return out

    async def __call__(self, kind: str, raw: bytes, deadline: float) -> Job:
        out = await to_thread.run_sync(self._call, kind, raw, deadline, limiter=self._limiter)
        if out is None:
            raise TimeoutError
        ok, value = out
        if ok:
            return value
        if isinstance(value, APIError):
            raise value
        raise RuntimeError(f"parsing a request failed in a worker process:\n{value}")

    def close(self) -> None:
        self._closed = True
        with self._lock:
            workers, self._all = list(self._all), set()
        for w in workers:
            w.conn.close()  # the worker's recv ends: it exits
        for w in workers:
            w.proc.join(2)
            if w.proc.is_alive():
                w.proc.kill()
