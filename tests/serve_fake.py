"""A fake generation engine with ``olmax.engine.Engine``'s request interface (submit, cancel, step,
busy), for testing ``olmax serve``'s HTTP layer without a model: deterministic tokens that depend
only on (prompt, sampling, index, position), as the real engine's do, and a small tokenizer."""

from __future__ import annotations

import contextlib
import hashlib
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from olmax.chat.codec import TextCodec
from olmax.engine.sampling import nonfinite_error
from olmax.serve.protocol import APIError, Job, ServedModel
from olmax.serve.worker import Completion, Request

SPECIALS = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]
EOS, IM_END = 0, 3


def tokenizer(folder: Path) -> Path:
    """A byte-level BPE (vocabulary 320) with OLMo 3's special tokens, trained here in ~0.1 s."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    rnd = random.Random(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "fast", "blue", "sky", "is", "and", "we", "see",
             "hello", "world", "what", "color", "grass", "green", "answer", "question", "model", "token", "é", "ü"]
    corpus = [" ".join(rnd.choices(words, k=rnd.randint(4, 12))) + rnd.choice([".", "?", "!"]) for _ in range(400)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(corpus, trainer)
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    return folder / "tokenizer.json"


def served_model(folder: Path, max_length: int = 512, name: str = "fake") -> ServedModel:
    from tokenizers import Tokenizer
    path = tokenizer(folder)
    codec = TextCodec(Tokenizer.from_file(str(path)), path, None, {"eos_token": SPECIALS[0]})
    return ServedModel(name=name, codec=codec, max_length=max_length, vocab_size=320, eos_ids=(EOS,),
                       chat_eos_ids=(EOS, IM_END), chat_stops=(), blank_id=EOS)


def fake_token(prompt: list[int], seed: int | None, index: int, position: int, vocab: int) -> tuple[int, float]:
    """The fake model's token at ``position`` (and its logprob): a hash of what the real engine's
    completion depends on. EOS about once in 40 tokens; the specials otherwise never."""
    h = hashlib.sha256(repr((prompt, seed, index, position)).encode()).digest()
    x = int.from_bytes(h[:8], "little")
    tok = EOS if x % 40 == 0 else 4 + x % (vocab - 4)
    return tok, -((x >> 8) % 1000) / 250.0


class FakeEngine:
    """``slots`` requests decode together; each ``step`` makes up to ``chunk`` tokens per request
    (after an optional ``delay``, to keep requests in flight)."""

    def __init__(self, vocab: int = 320, slots: int = 4, max_length: int = 512, chunk: int = 4,
                 delay: float = 0.0, fail_after: int | None = None, nonfinite_at: int | None = None) -> None:
        self.vocab, self.slots, self.max_length, self.chunk, self.delay = vocab, slots, max_length, chunk, delay
        self.fail_after = fail_after
        self.nonfinite_at = nonfinite_at  # every request's logits are NaN at this generation step
        self._lock = threading.Lock()
        self._next = 0
        self.waiting: list[tuple[int, Request]] = []
        self.running: dict[int, tuple[Request, Completion]] = {}
        self.cancelled: list[int] = []
        self.steps = 0
        self.max_running = 0

    def submit(self, request: Request) -> int:
        p = request.prompt
        if not p:
            raise ValueError("empty prompt")
        if any(not 0 <= t < self.vocab for t in p):
            raise ValueError("token id out of vocabulary")
        if len(p) + request.max_new_tokens > self.max_length:
            raise ValueError("prompt + max_new_tokens > max_length")
        request.sampling.check()
        with self._lock:
            rid = self._next
            self._next += 1
            self.waiting.append((rid, request))
        return rid

    def cancel(self, rid: int) -> None:
        with self._lock:
            self.cancelled.append(rid)

    def busy(self) -> bool:
        with self._lock:
            return bool(self.waiting or self.running)

    def step(self) -> list[tuple[int, Completion]]:
        if self.delay:
            time.sleep(self.delay)
        self.steps += 1
        if self.fail_after is not None and self.steps > self.fail_after:
            raise RuntimeError("fake engine failure")
        done: list[tuple[int, Completion]] = []
        with self._lock:
            while self.waiting and len(self.running) < self.slots:
                rid, r = self.waiting.pop(0)
                self.running[rid] = (r, Completion())
            cancelled, self.cancelled = set(self.cancelled), []
            self.max_running = max(self.max_running, len(self.running))
        for rid in list(self.running):
            r, c = self.running[rid]
            reason = "cancelled" if rid in cancelled else None
            for _ in range(self.chunk):
                if reason:
                    break
                if len(c.token_ids) == self.nonfinite_at:
                    reason, c.error = "error", nonfinite_error(len(c.token_ids))
                    break
                seed = None if r.sampling.greedy else r.sampling.seed
                tok, lp = fake_token(r.prompt, seed, r.index, len(c.token_ids), self.vocab)
                c.token_ids.append(tok)
                c.logprobs.append(lp)
                if r.top_logprobs:
                    tops = [(tok, lp)] + [((tok + k) % self.vocab, lp - k) for k in range(1, r.top_logprobs)]
                    c.top_logprobs = (c.top_logprobs or []) + [tops]
                if r.on_token:
                    r.on_token(tok, lp)
                if tok in r.eos_ids or (r.stop is not None and r.stop(c.token_ids)):
                    reason = "stop"
                elif len(c.token_ids) >= r.max_new_tokens:
                    reason = "length"
            if reason:
                c.finish_reason = reason
                with self._lock:
                    del self.running[rid]
                if r.on_finish:
                    r.on_finish(c)
                done.append((rid, c))
        with self._lock:  # a cancel of a request still waiting
            for rid in cancelled - {d for d, _ in done}:
                for i, (w, r) in enumerate(self.waiting):
                    if w == rid:
                        del self.waiting[i]
                        c = Completion(finish_reason="cancelled")
                        if r.on_finish:
                            r.on_finish(c)
                        done.append((rid, c))
                        break
        return done

    def expected(self, prompt: list[int], max_new: int, eos: set[int], seed: int | None = None,
                 index: int = 0) -> list[int]:
        """The tokens a request gets when nothing else stops it (no stop strings)."""
        out: list[int] = []
        while len(out) < max_new:
            tok, _ = fake_token(prompt, seed, index, len(out), self.vocab)
            out.append(tok)
            if tok in eos:
                break
        return out


def probe_parse(kind: str, raw: bytes, served: ServedModel) -> Job:
    """``olmax.serve.admission.parse`` for a worker process under test: the body ``slow`` takes
    10 s, ``crash`` kills the worker, ``bug`` raises a bug; anything else is parsed."""
    from olmax.serve.admission import parse
    if raw == b"slow":
        time.sleep(10)
    elif raw == b"crash":
        import os
        os._exit(3)
    elif raw == b"bug":
        raise KeyError("a bug")
    elif raw == b"refused":
        raise APIError(400, "refused", param="prompt")
    return parse(kind, raw, served)


@contextlib.contextmanager
def uvicorn_on_a_port(app: Any) -> Iterator[tuple[str, int]]:
    """``app`` served by uvicorn on a thread at a free local port (the raw-socket tests); yields
    ``(host, port)`` once it is up, and stops the server after."""
    import socket

    import uvicorn
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="off"))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.time() + 10
        while not server.started and time.time() < deadline:
            time.sleep(0.02)
        yield sock.getsockname()
    finally:
        server.should_exit = True
        thread.join(10)
