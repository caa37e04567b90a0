"""The probe of ``olmax serve`` under hostile input, against the fake engine (tests/serve_fake.py):
strings that are not text (lone UTF-16 surrogates, at any depth, as values or field names), empty
stop strings, prompts too long for the context refused from their length before tokenizing, client
text escaped in the log, the admission deadline, the parse worker processes (a slow body killed, a
crash replaced), non-finite logits, a checkpoint without a tokenizer, draining, an empty API key.
Every answer has OpenAI's error shape and no traceback reaches a client; none reaches the log but
for a bug. The same probe on the real server, with its timings: tests/test_serve_integration.py."""

from __future__ import annotations

import json
import random
import socket
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest
from test_serve import Server, assert_error, chat_body, sse

from olmax.config import ConfigError
from olmax.serve.admission import InThread, Workers
from olmax.serve.app import create_app
from olmax.serve.protocol import APIError, ServedModel, chars_per_token
from olmax.serve.server import api_key
from olmax.serve.worker import EngineWorker
from serve_fake import EOS, FakeEngine, probe_parse, served_model, uvicorn_on_a_port

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> ServedModel:
    return served_model(tmp_path_factory.mktemp("fake_tokenizer"))


@pytest.fixture
def server(served: ServedModel):
    s = Server(served, FakeEngine())
    yield s
    s.close()


def no_traceback(s: Server) -> None:
    tb = [line for line in s.logs if "Traceback" in line]
    assert not tb, tb[0]


def msg(text: str = "hi") -> list[dict]:
    return [{"role": "user", "content": text}]


# Raw bodies: (path, body, status, param). Surrogate escapes are written out: json.dumps would
# escape the backslash.
S = "\\ud800"
PROBE = [
    (CHAT, f'{{"model": "{S}", "messages": [{{"role": "user", "content": "hi"}}]}}', 400, "model"),
    (CHAT, f'{{"{S}": 1, "messages": [{{"role": "user", "content": "hi"}}]}}', 400, S),
    (CHAT, f'{{"messages": [{{"role": "user", "content": "a{S}b"}}]}}', 400, "messages"),
    (CHAT, f'{{"messages": [{{"role": "user", "content": [{{"type": "text", "text": "{S}"}}]}}]}}', 400, "messages"),
    (CHAT, f'{{"messages": [{{"role": "{S}", "content": "hi"}}]}}', 400, "messages"),
    (CHAT, f'{{"messages": [{{"role": "user", "content": "hi", "name": "{S}"}}]}}', 400, "messages"),
    (CHAT, f'{{"messages": [{{"role": "user", "content": "hi", "{S}": 1}}]}}', 400, "messages"),
    (CHAT, f'{{"messages": [{{"role": "user", "content": "hi"}}], "user": "{S}"}}', 400, "user"),
    (CHAT, f'{{"messages": [{{"role": "user", "content": "hi"}}], "metadata": {{"k": "{S}"}}}}', 400, "metadata"),
    (CHAT, f'{{"messages": [{{"role": "user", "content": "hi"}}], "stop": ["{S}"]}}', 400, "stop"),
    (COMPLETIONS, f'{{"prompt": "{S}"}}', 400, "prompt"),
    (COMPLETIONS, '{"prompt": ["ok", "x\\udfff"]}', 400, "prompt"),
    (COMPLETIONS, '{"prompt": "\\uDC00\\uD800"}', 400, "prompt"),       # a pair the wrong way round
    (COMPLETIONS, f'{{"model": "{S}", "prompt": [1, 2]}}', 400, "model"),
    (COMPLETIONS, '{"prompt": "x", "stop": ""}', 400, "stop"),
    (COMPLETIONS, '{"prompt": "x", "stop": ["", ""]}', 400, "stop"),
    (COMPLETIONS, '{"prompt": "x", "stop": ["a", ""]}', 400, "stop"),
    (CHAT, '{"messages": [{"role": "user", "content": "hi"}], "stop": ""}', 400, "stop"),
    (COMPLETIONS, b'{"prompt": "\xed\xa0\x80"}', 400, None),               # a surrogate as UTF-8 bytes
    (COMPLETIONS, '{"prompt": "x"}'.encode("utf-16"), 400, None),         # JSON, but not UTF-8
    (COMPLETIONS, b'{"prompt": "\xff"}', 400, None),
    (COMPLETIONS, '{"model": "x\\ny\\u0000", "prompt": "x"}', 404, "model"),
]


@pytest.mark.parametrize("path,body,status,param", PROBE, ids=[f"{i}-{p}" for i, (_, _, _, p) in enumerate(PROBE)])
def test_probe_cases_name_the_field_without_a_traceback(server: Server, path: str, body, status: int,
                                                        param: str | None) -> None:
    r = server.client.post(path, content=body if isinstance(body, bytes) else body.encode())
    err = assert_error(r, status, param)
    json.dumps(err, ensure_ascii=False).encode("utf-8")  # the answer is UTF-8 text
    no_traceback(server)
    line = server.logs[-1]
    assert line.startswith(f"serve: POST {path} {status} ") and line.isprintable(), line  # one line, escaped


def test_valid_text_is_still_served(server: Server, served: ServedModel) -> None:
    """What the checks must not refuse: a surrogate pair (an emoji), a BOM, control characters
    in a prompt, an escaped backslash before a 'u', an empty stop list."""
    for body in ('{"prompt": "smile \\ud83d\\ude00", "max_tokens": 2}', '\ufeff{"prompt": "x", "max_tokens": 2}',
                 '{"prompt": "tab\\there\\u0000", "max_tokens": 2}', '{"prompt": "\\\\ud800", "max_tokens": 2}',
                 '{"prompt": "x", "stop": [], "max_tokens": 2}'):
        r = server.client.post(COMPLETIONS, content=body.encode("utf-8"))
        assert r.status_code == 200, (body, r.text)
    no_traceback(server)


def test_an_unexpected_error_is_a_500_in_openai_shape(served: ServedModel) -> None:
    def broken(kind, raw, served):
        raise KeyError("a bug")

    s = Server(served, FakeEngine())
    s.app.state.olmax.admission = InThread(served, broken)
    try:
        err = assert_error(s.client.post(CHAT, json=chat_body()), 500)
        assert err["type"] == "server_error" and "KeyError" not in err["message"]
        assert any("Traceback" in line and "KeyError: 'a bug'" in line for line in s.logs)  # a bug: logged in full
        assert s.client.get("/health").status_code == 200
    finally:
        s.close()


# --------------------------------------------------------------------------- work bounded by size


class CountingTokenizer:
    """A tokenizer that counts the characters it is asked to encode."""

    def __init__(self, inner) -> None:
        self.inner, self.chars = inner, 0

    def encode(self, text, **kw):
        self.chars += len(text)
        return self.inner.encode(text, **kw)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_a_prompt_that_cannot_fit_is_refused_from_its_length_before_tokenizing(served: ServedModel) -> None:
    counting = CountingTokenizer(served.codec.tokenizer)
    fast = replace(served, codec=replace(served.codec, tokenizer=counting))
    assert fast.chars_per_token == served.chars_per_token == 13  # the fake BPE's longest token
    s = Server(fast, FakeEngine())
    try:
        huge = "ab " * 2**20
        for path, body in ((CHAT, chat_body(messages=msg(huge))), (COMPLETIONS, {"prompt": huge}),
                           (COMPLETIONS, {"prompt": ["short", huge]}),
                           (CHAT, chat_body(messages=[*msg("x " * 2000), *msg("y " * 2000)]))):
            err = assert_error(s.client.post(path, json=body), 400, code="context_length_exceeded")
            assert "at least" in err["message"] and "told from its length" in err["message"], err
        assert counting.chars == 0  # nothing was tokenized
        # Under the bound: tokenized, and refused (or served) by the exact count.
        err = assert_error(s.client.post(COMPLETIONS, json={"prompt": "the cat " * 600}), 400,
                           code="context_length_exceeded")
        assert "at least" not in err["message"] and counting.chars == 4800
        assert s.client.post(COMPLETIONS, json={"prompt": "the cat", "max_tokens": 2}).status_code == 200
    finally:
        s.close()


def test_the_length_bound_never_exceeds_the_tokens(served: ServedModel) -> None:
    """``tokens_at_least`` is a lower bound (else a prompt that fits would be refused): texts made
    of the longest tokens, whitespace, multi-byte characters and random bytes."""
    tok = served.codec.tokenizer
    vocab = sorted(tok.get_vocab(with_added_tokens=False), key=len, reverse=True)
    rnd = random.Random(0)
    texts = [tok.decode([tok.token_to_id(vocab[0])]) * 50, " " * 3000, "é" * 500, "<|im_end|>" * 40,
             "".join(rnd.choice(" abcé\n\t.!ü<|>") for _ in range(3000)),
             bytes(rnd.randrange(256) for _ in range(2000)).decode("latin-1")]
    texts += [tok.decode([tok.token_to_id(t) for t in rnd.choices(vocab[:40], k=300)]) for _ in range(5)]
    for t in texts:
        assert 0 < served.tokens_at_least(t) <= len(tok.encode(t, add_special_tokens=False).ids) or not t.strip()


def test_a_length_bound_only_where_the_tokenizer_keeps_every_byte(tmp_path: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, normalizers, pre_tokenizers
    base = Tokenizer.from_file(str(served_model(tmp_path).codec.path))
    assert chars_per_token(base) == 13

    def variant(**kw) -> Tokenizer:
        t = Tokenizer.from_str(base.to_str())
        for k, v in kw.items():
            setattr(t, k, v)
        return t

    assert chars_per_token(variant(normalizer=normalizers.NFC())) == 4 * 13   # a composition joins <= 4
    assert chars_per_token(variant(normalizer=normalizers.Sequence([normalizers.NFKC(),
                                                                    normalizers.Lowercase()]))) == 4 * 13
    assert chars_per_token(variant(normalizer=normalizers.Strip())) is None    # may delete any amount
    assert chars_per_token(variant(normalizer=normalizers.Replace(" ", ""))) is None
    assert chars_per_token(variant(pre_tokenizer=pre_tokenizers.Whitespace())) is None  # drops whitespace
    swallowing = variant()
    swallowing.add_special_tokens([AddedToken("<|x|>", rstrip=True)])          # eats the spaces after it
    assert chars_per_token(swallowing) is None


def test_the_admission_deadline_answers_408(served: ServedModel) -> None:
    def slow(kind, raw, served):
        time.sleep(3)

    s = Server(served, FakeEngine())
    s.app.state.olmax.admission = InThread(served, slow)
    s.app.state.olmax.admission_timeout = 0.3
    try:
        t0 = time.perf_counter()
        err = assert_error(s.client.post(CHAT, json=chat_body()), 408, code="request_timeout")
        assert time.perf_counter() - t0 < 2 and "within 0.3 s" in err["message"]
        assert s.app.state.olmax.admitting == 0
    finally:
        s.close()


def test_a_body_sent_too_slowly_is_answered_408(served: ServedModel) -> None:
    engine = FakeEngine()
    worker = EngineWorker(engine).start()
    logs: list[str] = []
    app = create_app(served, worker, log=logs.append, admission_timeout=0.5)
    try:
        with uvicorn_on_a_port(app) as addr, socket.create_connection(addr, timeout=10) as c:
            c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"prompt\"")
            t0 = time.time()
            answer = c.recv(4096)
        assert answer.startswith(b"HTTP/1.1 408") and b"request_timeout" in answer, answer
        assert time.time() - t0 < 3
    finally:
        worker.close(timeout=5)


def test_parse_workers_answer_refuse_and_are_replaced(served: ServedModel) -> None:
    """The worker processes ``olmax serve`` parses in: an answer, a refusal (the APIError with its
    field), a bug (a RuntimeError carrying the worker's traceback), a body past its deadline (408;
    that worker is killed and replaced), a worker that dies (replaced); the pool serves on."""
    import anyio
    workers = Workers(served, processes=1, fn=probe_parse)
    body = json.dumps({"prompt": "the cat", "max_tokens": 3}).encode()

    async def probe() -> None:
        def run(raw: bytes, timeout: float = 20.0):
            return workers("completion", raw, time.monotonic() + timeout)

        job = await run(body)
        assert job.prompts == [served.codec.encode("the cat")] and job.max_tokens == 3
        with pytest.raises(APIError) as e:
            await run(b"refused")
        assert (e.value.status, e.value.param) == (400, "prompt")
        with pytest.raises(RuntimeError, match="KeyError: 'a bug'"):
            await run(b"bug")
        t0 = time.perf_counter()
        with pytest.raises(TimeoutError):
            await run(b"slow", 0.5)
        assert time.perf_counter() - t0 < 3
        assert (await run(body)).prompts == job.prompts  # a fresh worker
        with pytest.raises(RuntimeError, match="died"):
            await run(b"crash")
        assert (await run(body)).prompts == job.prompts

    try:
        anyio.run(probe)
    finally:
        workers.close()


# --------------------------------------------------------------------------- the engine's answers


def test_non_finite_logits_are_a_500_naming_the_checkpoint(served: ServedModel) -> None:
    s = Server(replace(served, checkpoint="runs/blown-up"), FakeEngine(nonfinite_at=2))
    try:
        # greedy: the fake's tokens before the broken step are fixed, and none is EOS (a sampled
        # request could end at EOS first, about one time in 20, and never reach the broken step)
        err = assert_error(s.client.post(COMPLETIONS, json={"prompt": [5, 6], "max_tokens": 8, "n": 2,
                                                            "temperature": 0}), 500, code="non_finite_logits")
        assert "checkpoint runs/blown-up" in err["message"] and "generation step 2" in err["message"]
        chunks = s.client.post(COMPLETIONS, json={"prompt": [5, 6], "max_tokens": 8, "stream": True,
                                                  "temperature": 0}).text
        events = [json.loads(line[6:]) for line in chunks.split("\n") if line.startswith("data: {")]
        assert events[-1]["error"]["code"] == "non_finite_logits" and "[DONE]" not in chunks
        # The tokens made before the broken step may have been streamed already (the engine thread
        # and the stream race); none after it, and no choice ends as if it had finished.
        streamed = [c for e in events[:-1] for c in e["choices"]]
        assert all(c["finish_reason"] is None for c in streamed)
        assert len(streamed) <= 2, streamed
        deadline = time.time() + 5
        while s.worker.in_flight() and time.time() < deadline:
            time.sleep(0.01)
        assert s.worker.in_flight() == 0  # the request's other choice was cancelled
        no_traceback(s)
    finally:
        s.close()


def test_without_a_tokenizer_token_ids_in_and_out(served: ServedModel) -> None:
    bare = replace(served, codec=None, chars_per_token=None)
    s = Server(bare, FakeEngine())
    try:
        want = s.engine.expected([5, 6, 7], 12, {EOS})
        out = s.client.post(COMPLETIONS, json={"prompt": [5, 6, 7], "max_tokens": 12, "temperature": 0}).json()
        assert out["choices"][0]["token_ids"] == want and out["choices"][0]["text"] == ""
        events = sse(s.client.post(COMPLETIONS, json={"prompt": [5, 6, 7], "max_tokens": 12, "temperature": 0,
                                                     "stream": True}).text)
        assert [t for e in events for c in e["choices"] for t in c["token_ids"]] == want
        assert_error(s.client.post(COMPLETIONS, json={"prompt": "text"}), 400, "prompt")
        assert_error(s.client.post(COMPLETIONS, json={"prompt": [5], "stop": "x"}), 400, "stop")
        assert_error(s.client.post(CHAT, json=chat_body()), 400, "messages")
    finally:
        s.close()


# --------------------------------------------------------------------------- draining, the API key


def test_draining_answers_new_requests_503_until_the_accepted_ones_finish(served: ServedModel) -> None:
    s = Server(served, FakeEngine(chunk=1, delay=0.01))
    state = s.app.state.olmax
    try:
        result = {}
        t = threading.Thread(target=lambda: result.update(r=s.client.post(
            COMPLETIONS, json={"prompt": [5, 6], "max_tokens": 40, "temperature": 0})))
        t.start()
        deadline = time.time() + 10
        while not s.worker.in_flight() and time.time() < deadline:
            time.sleep(0.005)
        state.draining = True
        assert not state.drained()                      # a request in flight
        err = assert_error(s.client.post(COMPLETIONS, json={"prompt": [5]}), 503)
        assert err["type"] == "server_error"
        assert s.client.get("/health").status_code == 503
        t.join(20)
        assert result["r"].status_code == 200            # the accepted request finished
        assert state.drained()
    finally:
        s.close()


def test_an_empty_or_unusable_api_key_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OLMAX_API_KEY", raising=False)
    assert api_key(None) is None and api_key("k3y") == "k3y"
    for bad, match in (("", "--api-key is empty"), (" key", "whitespace"), ("a\nb", "control")):
        with pytest.raises(ConfigError, match=match):
            api_key(bad)
    monkeypatch.setenv("OLMAX_API_KEY", "")
    with pytest.raises(ConfigError, match="OLMAX_API_KEY is empty"):
        api_key(None)
    assert api_key("flag") == "flag"                      # the flag wins
    monkeypatch.setenv("OLMAX_API_KEY", "env")
    assert api_key(None) == "env"


def test_the_command_refuses_an_empty_api_key_before_loading(tmp_path: Path, capsys) -> None:
    from olmax import cli
    rc = cli.main(["serve", "--checkpoint", str(tmp_path / "nothing"), "--api-key", "", "--port", "0"])
    assert rc == 2 and "--api-key is empty" in capsys.readouterr().err
