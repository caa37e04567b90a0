"""The Starlette application: ``GET /health``, ``GET /v1/models``, ``POST /v1/chat/completions``,
``POST /v1/completions``.

Every answer is JSON (or server-sent events): an error is OpenAI's ``{"error": {...}}`` with its
status, never a traceback (an unexpected exception is logged to the server's stderr and answered
500). A request's body is read, checked and tokenized by the admission (``olmax.serve.admission``:
off the event loop, under a deadline); its choices are then submitted to the engine worker from a
thread and tokens come back through a queue on the event loop; a whole response is rendered in a
thread. So no request's size holds the event loop: ``/health`` and the streams in progress keep
their pace. A client that disconnects (mid-stream, or while waiting for a whole response) has its
requests cancelled, which frees their engine slots. One log line per request, client text in it
escaped. While draining (``State.draining``, after SIGTERM) new requests are answered 503.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import sys
import time
import traceback
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import anyio
from anyio import to_thread
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from olmax.chat.codec import TextCodec
from olmax.infer.run import first_stop, stop_condition, unsafe_tail
from olmax.serve import DEFAULT_ADMISSION_TIMEOUT as DEFAULT_TIMEOUT
from olmax.serve.admission import InThread
from olmax.serve.protocol import (
    APIError,
    Choice,
    Job,
    ServedModel,
    chat_logprobs,
    chunk,
    chunk_choice,
    completion_logprobs,
    response,
    shown,
    usage,
)
from olmax.serve.worker import Completion, EngineWorker, Request

MAX_BODY = 16 * 2**20  # bytes; a whole context of token ids as JSON is well under 1 MiB


@dataclass
class State:
    served: ServedModel
    worker: EngineWorker
    api_key: str | None = None
    log: Callable[[str], None] = field(default=lambda s: print(s, file=sys.stderr, flush=True))
    draining: bool = False
    requests: int = 0
    # ``await admission(kind, body, deadline) -> Job`` (``olmax.serve.admission``); the seconds a request has.
    admission: Any = None
    admission_timeout: float = DEFAULT_TIMEOUT
    admitting: int = 0   # requests accepted and not yet in the engine (reading, parsing, submitting)

    def drained(self) -> bool:
        """Draining, and nothing accepted is left to finish: the server may stop."""
        return self.draining and self.admitting == 0 and self.worker.in_flight() == 0


class TextStream:
    """One choice's text as its tokens arrive: decoded incrementally (a few tokens per step, whole
    characters only) and shown up to, never into, a stop string."""

    def __init__(self, codec: TextCodec | None, stops: list[str]) -> None:
        self.codec, self.stops = codec, stops
        self.ids: list[int] = []
        self.prefix = self.read = 0
        self.text = ""
        self.shown = 0

    def push(self, tid: int) -> None:
        self.ids.append(tid)
        if self.codec is None:
            return
        # Decode the last token with the one before it as context (a tokenizer may drop a leading
        # space of a lone token); a character split across tokens waits for its rest.
        before = self.codec.decode(self.ids[self.prefix:self.read])
        now = self.codec.decode(self.ids[self.prefix:])
        if len(now) > len(before) and not now.endswith("\ufffd"):
            self.text += now[len(before):]
            self.prefix, self.read = self.read, len(self.ids)

    def ready(self) -> str:
        """Text not yet shown that can be (no stop string starts before ``shown``)."""
        rest = self.text[self.shown:]
        cut = first_stop(rest, self.stops)
        end = cut if cut is not None else len(rest) - unsafe_tail(rest, self.stops)
        self.shown += end
        return rest[:end]

    def finish(self, final: str) -> str:
        """The rest of the final text (exactly what a non-streamed response holds)."""
        shown = self.text[:self.shown]
        rest = final[len(shown):] if final.startswith(shown) else ""
        self.shown = len(self.text)
        return rest


def final_text(codec: TextCodec | None, ids: list[int], stops: list[str]) -> str:
    """A completion's text as ``olmax generate`` gives it: decoded, cut before the first stop string."""
    if codec is None:
        return ""
    text = codec.decode(ids)
    cut = first_stop(text, stops)
    return text if cut is None else text[:cut]


class Run:
    """One HTTP request's choices in the engine; events ``(kind, choice, payload)`` arrive on
    ``queue`` from the engine thread: ("token", c, (id, logprob)), ("finish", c, Completion),
    ("error", c, exception)."""

    def __init__(self, job: Job, state: State) -> None:
        self.job, self.state = job, state
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.rids: dict[int, int] = {}
        self.finished: dict[int, Completion] = {}

    def _put(self, kind: str, c: int, *payload: Any) -> None:
        try:  # called on the engine thread
            self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, c, payload))
        except RuntimeError:  # the event loop is gone (the server stopped): nobody is waiting
            pass

    def start(self) -> None:
        job, codec = self.job, self.state.served.codec
        stop = stop_condition(codec, job.stops) if codec is not None else None
        for c in range(job.choices):
            req = Request(prompt=job.prompt_of(c), max_new_tokens=job.max_tokens, sampling=job.sampling,
                          index=c % job.n, eos_ids=frozenset(job.eos_ids), stop=stop,
                          on_token=partial(self._put, "token", c), on_finish=partial(self._put, "finish", c),
                          top_logprobs=job.top_logprobs)
            try:
                self.rids[c] = self.state.worker.submit(req, on_error=partial(self._put, "error", c))
            except ValueError as e:  # the engine refuses it (the protocol checks should have caught it)
                self.cancel()
                raise APIError(400, f"the engine refused the request: {e}") from None
            except RuntimeError as e:
                self.cancel()
                raise APIError(500, str(e), type="server_error") from None

    def cancel(self) -> None:
        for c, rid in self.rids.items():
            if c not in self.finished:
                self.state.worker.cancel(rid)

    @property
    def done(self) -> bool:
        return len(self.finished) == self.job.choices

    async def events(self) -> list[tuple[str, int, tuple]]:
        """The next events: one awaited, then whatever else is queued (the engine delivers a few
        tokens per step, so a stream chunk carries them together)."""
        out = [await self.queue.get()]
        while not self.queue.empty():
            out.append(self.queue.get_nowait())
        for kind, c, payload in out:
            if kind == "finish":
                self.finished[c] = payload[0]
                if payload[0].error is not None:  # non-finite logits: no answer from a broken model
                    served = self.state.served
                    raise APIError(500, f"checkpoint {served.checkpoint or served.name}: {payload[0].error}; its "
                                        "weights, or their forward, are broken", type="server_error",
                                   code="non_finite_logits")
            elif kind == "error":
                raise APIError(500, "the generation engine failed; see the server's log", type="server_error")
        return out


def _error(e: APIError) -> Response:
    # ASCII JSON: a message quoting client text can never fail to encode.
    return Response(json.dumps(e.body()), status_code=e.status, media_type="application/json")


async def _read_body(request: HTTPRequest) -> bytes:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY:
        raise APIError(413, f"the request body is larger than {MAX_BODY} bytes")
    size, parts = 0, []
    async for part in request.stream():
        size += len(part)
        if size > MAX_BODY:
            raise APIError(413, f"the request body is larger than {MAX_BODY} bytes")
        parts.append(part)
    return b"".join(parts)


def _authorised(state: State, request: HTTPRequest) -> None:
    if state.api_key is None:
        return
    got = request.headers.get("authorization", "")
    key = got[7:] if got[:7].lower() == "bearer " else ""
    if not hmac.compare_digest(key.encode(), state.api_key.encode()):
        raise APIError(401, "Incorrect API key provided" if key else "No API key provided (Authorization: Bearer KEY)",
                       code="invalid_api_key")


def endpoint(fn: Callable) -> Callable:
    """Authorisation, OpenAI-shaped errors, and a 500 without a traceback for anything unexpected."""
    async def wrapped(request: HTTPRequest) -> Response:
        state: State = request.app.state.olmax
        where = f"{request.method} {shown(request.url.path, 200)}"
        try:
            _authorised(state, request)
            return await fn(request, state)
        except APIError as e:
            state.log(f"serve: {where} {e.status} {shown(e.message, 1000)}")
            return _error(e)
        except ClientDisconnect:  # gone before its request was read: nobody to answer
            state.log(f"serve: {where} client disconnected before sending its request")
            return Response(status_code=499)
        except Exception:  # noqa: BLE001 - a bug: logged in full, answered without details
            state.log(f"serve: {where} 500\n{traceback.format_exc().rstrip()}")
            return _error(APIError(500, "internal server error (logged by the server)", type="server_error"))
    return wrapped


async def health(request: HTTPRequest) -> Response:
    state: State = request.app.state.olmax
    if state.worker.failed is not None:
        return JSONResponse({"status": "engine failed"}, status_code=503)
    if state.draining:
        return JSONResponse({"status": "shutting down"}, status_code=503)
    out: dict[str, Any] = {"status": "ok", "in_flight": state.worker.in_flight()}
    stats = getattr(state.worker.engine, "stats", None)  # olmax.engine's EngineStats
    if stats is not None:
        out["engine"] = {**vars(stats), "slot_utilisation": stats.slot_utilisation}
        report = getattr(state.worker.engine, "kv_report", None)  # the KV cache's peak, sharing, preemptions
        if report is not None:
            out["engine"].update(report())
    return JSONResponse(out)


@endpoint
async def models(request: HTTPRequest, state: State) -> Response:
    return JSONResponse({"object": "list", "data": [state.served.card()]})


@endpoint
async def model(request: HTTPRequest, state: State) -> Response:
    name = request.path_params["name"]
    if name != state.served.name:
        raise APIError(404, f"The model '{name}' does not exist", param="model", code="model_not_found")
    return JSONResponse(state.served.card())


@endpoint
async def chat_completions(request: HTTPRequest, state: State) -> Response:
    return await _complete(request, state, "chat", "chatcmpl")


@endpoint
async def completions(request: HTTPRequest, state: State) -> Response:
    return await _complete(request, state, "completion", "cmpl")


async def _admit(request: HTTPRequest, state: State, kind: str) -> tuple[Job, Run]:
    """Read, check and tokenize the request and submit its choices to the engine, within the
    admission deadline (408 past it); the work that grows with the request is off the event loop."""
    timeout = state.admission_timeout
    deadline = time.monotonic() + timeout
    raw = b""
    with anyio.move_on_after(timeout) as scope:
        raw = await _read_body(request)
    if scope.cancelled_caught:  # a client that sends its body too slowly holds nothing for long
        raise APIError(408, f"the request body did not arrive within {timeout:g} s", code="request_timeout")
    try:
        job = await state.admission(kind, raw, deadline)
    except TimeoutError:
        raise APIError(408, f"the request was not ready for the engine within {timeout:g} s of arriving (reading "
                            "its body, checking it and tokenizing its prompt): send a shorter prompt",
                       code="request_timeout") from None
    run = Run(job, state)
    try:
        # Submitting checks every prompt token again (the engine's own checks): a thread, for the largest requests.
        await to_thread.run_sync(run.start)
    except BaseException:  # the client went away meanwhile (or the engine refused): nothing left decoding
        run.cancel()
        raise
    return job, run


async def _complete(request: HTTPRequest, state: State, kind: str, prefix: str) -> Response:
    t0 = time.perf_counter()
    if state.draining:
        raise APIError(503, "the server is shutting down", type="server_error")
    state.admitting += 1
    try:
        job, run = await _admit(request, state, kind)
    finally:
        state.admitting -= 1
    rid = f"{prefix}-{uuid.uuid4().hex[:24]}"
    state.requests += 1
    if job.stream:
        return StreamingResponse(_stream(run, rid, t0), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    collect = asyncio.ensure_future(_collect(run))
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({collect, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
        if not collect.done():  # the client went away (or the server is stopping this handler)
            collect.cancel()
            run.cancel()
            _log_run(state, rid, job, run, t0, "client disconnected")
    if not collect.done():
        return Response(status_code=499)
    try:
        choices = collect.result()  # raises the engine's failure as an APIError
    except APIError:
        run.cancel()  # the other choices of a request that failed
        raise
    _log_run(state, rid, job, run, t0)
    # Logprobs of many long choices make a large answer: built and encoded off the event loop.
    body = await to_thread.run_sync(_render, job, rid, state.served, choices)
    return Response(body, media_type="application/json")


def _render(job: Job, rid: str, served: ServedModel, choices: list[Choice]) -> bytes:
    return json.dumps(response(job, rid, served, choices), ensure_ascii=False, allow_nan=False,
                      separators=(",", ":")).encode("utf-8")


async def _disconnected(request: HTTPRequest) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _collect(run: Run) -> list[Choice]:
    while not run.done:
        await run.events()
    codec, stops = run.state.served.codec, run.job.stops
    return [Choice(final_text(codec, run.finished[c].token_ids, stops), run.finished[c])
            for c in range(run.job.choices)]


def _log_run(state: State, rid: str, job: Job, run: Run, t0: float, note: str = "") -> None:
    out = sum(len(c.token_ids) for c in run.finished.values())
    reasons = ",".join(sorted({c.finish_reason for c in run.finished.values()})) or "-"
    state.log(f"serve: {rid} {'chat' if job.chat else 'completion'}{' stream' if job.stream else ''} "
              f"n={job.choices} tokens in={job.prompt_tokens()} out={out} {time.perf_counter() - t0:.3f} s "
              f"finish={reasons}{' (' + note + ')' if note else ''}")


def _sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, allow_nan=False)}\n\n"


async def _stream(run: Run, rid: str, t0: float) -> AsyncIterator[str]:
    job, state = run.job, run.state
    served = state.served
    created = int(time.time())
    texts = [TextStream(served.codec, job.stops) for _ in range(job.choices)]
    # Top logprobs come with a finished completion: then a choice's logprobs go in its last chunk.
    per_chunk = job.logprobs and not job.top_logprobs
    note = "client disconnected"
    try:
        if job.chat:  # the role first, as OpenAI streams it
            first = [chunk_choice(job, served, c, None, [], [], None, first=True) for c in range(job.choices)]
            yield _sse(chunk(job, rid, served, created, first))
        while not run.done:
            try:
                events = await run.events()
            except APIError as e:
                note = "engine failed"
                yield _sse(e.body())
                return
            new: dict[int, tuple[list[int], list[float]]] = {}
            finished = []
            for kind, c, payload in events:
                if kind == "token":
                    texts[c].push(payload[0])
                    ids, ls = new.setdefault(c, ([], []))
                    ids.append(payload[0])
                    ls.append(payload[1])
                elif kind == "finish":
                    finished.append(c)
            out = []
            for c in sorted(set(new) | set(finished)):  # one entry per choice: its new text, maybe its end
                ids, ls = new.get(c, ([], []))
                comp = run.finished.get(c) if c in finished else None
                text = texts[c].ready()
                if comp is not None:
                    text += texts[c].finish(final_text(served.codec, comp.token_ids, job.stops))
                elif not (text or per_chunk or (ids and served.codec is None)):
                    continue
                choice = chunk_choice(job, served, c, text, ids, ls, comp.finish_reason if comp is not None else None,
                                      logprobs=per_chunk)
                if comp is not None and job.logprobs and job.top_logprobs:
                    tops = comp.top_logprobs
                    make = chat_logprobs if job.chat else completion_logprobs
                    # A whole completion's top logprobs: built off the event loop.
                    choice["logprobs"] = await to_thread.run_sync(make, served.codec, comp.token_ids, comp.logprobs,
                                                                  tops)
                out.append(choice)
            if out:
                yield _sse(chunk(job, rid, served, created, out))
        if job.include_usage:
            yield _sse(chunk(job, rid, served, created, [],
                             usage(job, sum(len(c.token_ids) for c in run.finished.values()))))
        yield "data: [DONE]\n\n"
        note = ""
    finally:
        if not run.done:
            run.cancel()
        _log_run(state, rid, job, run, t0, note)


async def _not_found(request: HTTPRequest, exc: HTTPException) -> Response:
    if exc.status_code == 404:
        e = APIError(404, f"no such path: {request.method} {request.url.path}", code="not_found")
    elif exc.status_code == 405:
        e = APIError(405, f"{request.method} is not allowed on {request.url.path}", code="method_not_allowed")
    else:
        e = APIError(exc.status_code, str(exc.detail))
    return _error(e)


async def _internal(request: HTTPRequest, exc: Exception) -> Response:
    return _error(APIError(500, "internal server error (logged by the server)", type="server_error"))


def create_app(served: ServedModel, worker: EngineWorker, api_key: str | None = None,
               log: Callable[[str], None] | None = None, admission: Any = None,
               admission_timeout: float = DEFAULT_TIMEOUT) -> Starlette:
    """``admission``: what turns a body into engine work (``olmax.serve.admission``; default
    ``InThread``, in this process: ``olmax serve`` passes ``Workers``)."""
    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{name:path}", model, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _not_found, Exception: _internal})
    app.state.olmax = State(served, worker, api_key, **({"log": log} if log else {}),
                            admission=admission or InThread(served), admission_timeout=admission_timeout)
    return app
