"""The Starlette application: ``GET /health``, ``GET /v1/models``, ``POST /v1/chat/completions``,
``POST /v1/completions``.

Every answer is JSON (or server-sent events): an error is OpenAI's ``{"error": {...}}`` with its
status, never a traceback (an unexpected exception is logged to the server's stderr and answered
500). A request's choices are submitted to the engine worker; tokens come back through a queue on
the event loop. A client that disconnects (mid-stream, or while waiting for a whole response) has
its requests cancelled, which frees their engine slots. One log line per request.
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

from anyio import to_thread
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from olmax.chat.codec import TextCodec
from olmax.infer.run import first_stop, stop_condition, unsafe_tail
from olmax.serve.protocol import (
    APIError,
    Choice,
    Job,
    ServedModel,
    chat_logprobs,
    chunk,
    chunk_choice,
    completion_logprobs,
    parse_chat,
    parse_completion,
    response,
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
            elif kind == "error":
                raise APIError(500, "the generation engine failed; see the server's log", type="server_error")
        return out


def _error(e: APIError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.status)


async def _read_json(request: HTTPRequest) -> Any:
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > MAX_BODY:
        raise APIError(413, f"the request body is larger than {MAX_BODY} bytes")
    size, parts = 0, []
    async for part in request.stream():
        size += len(part)
        if size > MAX_BODY:
            raise APIError(413, f"the request body is larger than {MAX_BODY} bytes")
        parts.append(part)
    try:
        return json.loads(b"".join(parts))
    except (ValueError, RecursionError) as e:
        raise APIError(400, f"We could not parse the JSON body of your request ({type(e).__name__}: "
                            f"{str(e)[:80]})") from None


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
        try:
            _authorised(state, request)
            return await fn(request, state)
        except APIError as e:
            state.log(f"serve: {request.method} {request.url.path} {e.status} {e.message}")
            return _error(e)
        except ClientDisconnect:  # gone before its request was read: nobody to answer
            state.log(f"serve: {request.method} {request.url.path} client disconnected before sending its request")
            return Response(status_code=499)
        except Exception:  # noqa: BLE001 - a bug: logged in full, answered without details
            state.log(f"serve: {request.method} {request.url.path} 500\n{traceback.format_exc().rstrip()}")
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
    return await _complete(request, state, parse_chat, "chatcmpl")


@endpoint
async def completions(request: HTTPRequest, state: State) -> Response:
    return await _complete(request, state, parse_completion, "cmpl")


async def _complete(request: HTTPRequest, state: State, parse: Callable[[Any, ServedModel], Job],
                    prefix: str) -> Response:
    t0 = time.perf_counter()
    if state.draining:
        raise APIError(503, "the server is shutting down", type="server_error")
    body = await _read_json(request)
    # Rendering and tokenising a long prompt take a while: off the event loop, which streams the others.
    job = await to_thread.run_sync(parse, body, state.served)
    rid = f"{prefix}-{uuid.uuid4().hex[:24]}"
    state.requests += 1
    run = Run(job, state)
    run.start()
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
    choices = collect.result()  # raises the engine's failure as an APIError
    _log_run(state, rid, job, run, t0)
    return JSONResponse(response(job, rid, state.served, choices))


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
                elif not (text or per_chunk):
                    continue
                choice = chunk_choice(job, served, c, text, ids if per_chunk else [], ls,
                                      comp.finish_reason if comp is not None else None)
                if comp is not None and job.logprobs and job.top_logprobs:
                    tops = comp.top_logprobs
                    make = chat_logprobs if job.chat else completion_logprobs
                    choice["logprobs"] = make(served.codec, comp.token_ids, comp.logprobs, tops)
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
               log: Callable[[str], None] | None = None) -> Starlette:
    routes = [
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/models/{name:path}", model, methods=["GET"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
    ]
    app = Starlette(routes=routes, exception_handlers={HTTPException: _not_found, Exception: _internal})
    app.state.olmax = State(served, worker, api_key, **({"log": log} if log else {}))
    return app
