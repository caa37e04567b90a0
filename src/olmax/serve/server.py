"""``olmax serve``: load a checkpoint as ``olmax generate`` does, start the engine worker and the
admission's parse workers, and serve the app with uvicorn. SIGTERM (or Ctrl-C) drains: new
requests are answered 503 (``/health`` too, for a load balancer) while the requests already
accepted finish, then the server stops accepting connections and exits 0."""

from __future__ import annotations

import os
import signal
import socket
import sys
import time
from typing import Any

from olmax.config import ConfigError
from olmax.extras import require
from olmax.serve import DEFAULT_MAX_LENGTH


def _bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound here so that a port in use is a one-line user error (OSError)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise OSError(e.errno, f"cannot listen on {host}:{port}: {e.strerror}") from None
    sock.set_inheritable(True)
    return sock


def api_key(flag: str | None) -> str | None:
    """``--api-key``, else ``$OLMAX_API_KEY``, else None (no key). An empty key, or one with
    whitespace at an end (which an Authorization header cannot carry), is refused: it would turn
    authentication off, or lock every client out."""
    key, where = (flag, "--api-key") if flag is not None else (os.environ.get("OLMAX_API_KEY"), "OLMAX_API_KEY")
    if key is None:
        return None
    if not key:
        raise ConfigError(f"{where} is empty: give a key, or leave it unset to serve without one")
    if key != key.strip() or not key.isprintable():
        raise ConfigError(f"{where} has whitespace at an end or a control character, which a client's "
                          "'Authorization: Bearer KEY' header cannot carry")
    return key


def cmd_serve(args: Any) -> int:
    require("serve")
    import uvicorn

    from olmax.infer.run import Model
    from olmax.serve.admission import Workers
    from olmax.serve.app import create_app
    from olmax.serve.protocol import ServedModel
    from olmax.serve.worker import EngineWorker, build_engine, warm_up

    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    key = api_key(args.api_key)
    sock = _bind(args.host, args.port)  # before the weights load: a busy port fails fast
    model = Model(args.checkpoint, args.tokenizer, args.dtype)
    positions = model.cfg.model.max_position_embeddings
    max_length = args.max_length or min(positions, DEFAULT_MAX_LENGTH)
    if max_length > positions:
        raise ConfigError(f"--max-length {max_length} is past the model's {positions} positions "
                          "(max_position_embeddings)")
    served = ServedModel.from_model(model, args.model_name or args.checkpoint, max_length)
    engine = build_engine(model, args.max_concurrency, max_length, prefill_tokens=args.prefill_tokens,
                          kv_cache=args.kv_cache, page_size=args.page_size, kv_budget=args.kv_budget)
    if args.warmup is not None:
        warm_up(engine, model.cfg.model, args.warmup or max_length - 1, log)
    admission = Workers(served)
    worker = EngineWorker(engine, log).start()
    app = create_app(served, worker, key, log, admission=admission, admission_timeout=args.admission_timeout)
    state = app.state.olmax

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: Any) -> None:
            # Not uvicorn's own: it stops accepting connections at once (a new request then meets
            # a refused connection, not the 503 a load balancer reads) and re-raises the signal
            # after shutting down, so that the process dies of it; a drained server exits 0. A
            # second Ctrl-C stops at once.
            if state.draining:
                if sig == signal.SIGINT:
                    self.should_exit = self.force_exit = True
                return
            log(f"olmax serve: signal {sig}: finishing {worker.in_flight() + state.admitting} request(s) in "
                "flight, answering new ones 503")
            state.draining = True

        async def on_tick(self, counter: int) -> bool:
            return state.drained() or await super().on_tick(counter)

        async def startup(self, sockets: list | None = None) -> None:
            await super().startup(sockets)
            if self.started:
                host, port = sock.getsockname()[:2]
                url_host = f"[{host}]" if ":" in host else host
                log(f"olmax serve: {served.name} at http://{url_host}:{port}/v1 (slots {args.max_concurrency}, "
                    f"max length {max_length}, chat template: "
                    f"{model.codec.template_source if model.codec else 'none (no tokenizer: token ids only)'}"
                    f"{', API key required' if key else ''})")

    config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                            timeout_graceful_shutdown=None)
    t0 = time.perf_counter()
    try:
        Server(config).run(sockets=[sock])
    finally:
        admission.close()
    worker.close()
    log(f"olmax serve: stopped after {time.perf_counter() - t0:.0f} s, {state.requests} request(s)")
    return 0
