"""``olmax serve``'s HTTP layer against a fake engine (tests/serve_fake.py): routes, the OpenAI JSON
contract (responses, streaming, logprobs, stop strings, usage), errors and their statuses, the API
key, engine failure, client disconnects. Fast: no model, no compilation. The real server on a real
checkpoint through the ``openai`` client: tests/test_serve_integration.py."""

from __future__ import annotations

import json
import socket
import sys
import threading
import time

import pytest
from starlette.testclient import TestClient

from olmax.serve.app import TextStream, create_app, final_text
from olmax.serve.protocol import ServedModel
from olmax.serve.worker import EngineWorker
from serve_fake import EOS, IM_END, FakeEngine, served_model, uvicorn_on_a_port


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> ServedModel:
    return served_model(tmp_path_factory.mktemp("fake_tokenizer"))


class Server:
    def __init__(self, served: ServedModel, engine: FakeEngine, api_key: str | None = None) -> None:
        self.engine, self.served, self.logs = engine, served, []
        self.worker = EngineWorker(engine, self.logs.append).start()
        self.app = create_app(served, self.worker, api_key, self.logs.append)
        self.client = TestClient(self.app, raise_server_exceptions=True)

    def close(self) -> None:
        self.client.close()
        self.worker.close(timeout=5)


@pytest.fixture
def server(served: ServedModel):
    s = Server(served, FakeEngine())
    yield s
    s.close()


def chat_body(**kw) -> dict:
    return {"model": "fake", "messages": [{"role": "user", "content": "what color is the sky?"}], **kw}


def sse(text: str) -> list:
    events = [line[6:] for line in text.split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


def assert_error(r, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert "Traceback" not in r.text
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


# --------------------------------------------------------------------------- routes


def test_health_models_and_unknown_paths(server: Server) -> None:
    c = server.client
    assert c.get("/health").json()["status"] == "ok"
    data = c.get("/v1/models").json()
    assert data["object"] == "list" and [m["id"] for m in data["data"]] == ["fake"]
    assert data["data"][0]["max_model_len"] == 512
    assert c.get("/v1/models/fake").json()["id"] == "fake"
    assert_error(c.get("/v1/models/other"), 404, code="model_not_found")
    assert_error(c.get("/v1/nothing"), 404)
    assert_error(c.get("/v1/chat/completions"), 405)
    assert_error(c.post("/v1/chat/completions", json=chat_body(model="gpt-4")), 404, "model", "model_not_found")


def test_chat_greedy_matches_the_engine_and_the_template(server: Server, served: ServedModel) -> None:
    r = server.client.post("/v1/chat/completions", json=chat_body(temperature=0, max_tokens=30))
    assert r.status_code == 200, r.text
    out = r.json()
    prompt = served.codec.encode_chat([{"role": "user", "content": "what color is the sky?"}])
    want = server.engine.expected(prompt, 30, {EOS, IM_END})
    (choice,) = out["choices"]
    assert choice["message"] == {"role": "assistant", "content": served.codec.decode(want)}
    assert choice["finish_reason"] == ("stop" if want[-1] in (EOS, IM_END) else "length")
    assert out["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": len(want),
                            "total_tokens": len(prompt) + len(want)}
    assert out["object"] == "chat.completion" and out["id"].startswith("chatcmpl-") and out["model"] == "fake"
    assert choice["logprobs"] is None
    line = [s for s in server.logs if out["id"] in s]
    assert len(line) == 1 and f"in={len(prompt)} out={len(want)}" in line[0]


def test_stream_gives_the_same_text_and_a_final_usage_chunk(server: Server) -> None:
    body = chat_body(temperature=0.8, seed=7, max_tokens=40, n=2)
    whole = server.client.post("/v1/chat/completions", json=body).json()
    r = server.client.post("/v1/chat/completions", json={**body, "stream": True,
                                                         "stream_options": {"include_usage": True}})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    chunks = sse(r.text)
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    texts, reasons = ["", ""], [None, None]
    for c in chunks[:-1]:
        assert c["usage"] is None
        for ch in c["choices"]:
            texts[ch["index"]] += ch["delta"].get("content", "")
            reasons[ch["index"]] = ch["finish_reason"] or reasons[ch["index"]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert texts == [ch["message"]["content"] for ch in whole["choices"]]
    assert reasons == [ch["finish_reason"] for ch in whole["choices"]]
    assert texts[0] != texts[1]  # two samples of one prompt (index folded into the key)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    # Without include_usage: no usage chunk, no usage field.
    plain = sse(server.client.post("/v1/chat/completions", json={**body, "stream": True}).text)
    assert all("usage" not in c and c["choices"] for c in plain)


def test_seeded_sampling_is_reproducible_and_unseeded_is_not(server: Server, served: ServedModel) -> None:
    body = {"model": "fake", "prompt": "the cat", "temperature": 1.0, "top_p": 0.9, "seed": 123, "max_tokens": 20}
    a = server.client.post("/v1/completions", json=body).json()
    b = server.client.post("/v1/completions", json=body).json()
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    want = server.engine.expected(served.codec.encode("the cat"), 20, {EOS}, seed=123)
    assert a["choices"][0]["text"] == served.codec.decode(want)
    del body["seed"]
    texts = {server.client.post("/v1/completions", json=body).json()["choices"][0]["text"] for _ in range(4)}
    assert len(texts) > 1


def test_completions_token_prompts_batches_and_logprobs(server: Server, served: ServedModel) -> None:
    r = server.client.post("/v1/completions", json={"prompt": [[5, 6, 7], [9, 10]], "temperature": 0,
                                                    "max_tokens": 12, "logprobs": 3})
    assert r.status_code == 200, r.text
    out = r.json()
    assert [c["index"] for c in out["choices"]] == [0, 1]
    for c, p in zip(out["choices"], [[5, 6, 7], [9, 10]]):
        want = server.engine.expected(p, 12, {EOS})
        lp = c["logprobs"]
        assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(want)
        assert all(len(t) <= 3 and t for t in lp["top_logprobs"])
        assert lp["text_offset"][0] == 0
        assert c["text"] == served.codec.decode(want)
    assert out["usage"]["prompt_tokens"] == 5
    # OpenAI's default max_tokens for completions is 16.
    d = server.client.post("/v1/completions", json={"prompt": [5, 6], "temperature": 0}).json()
    assert d["usage"]["completion_tokens"] == len(server.engine.expected([5, 6], 16, {EOS}))


def test_chat_logprobs_and_top_logprobs_streamed_or_not(server: Server) -> None:
    body = chat_body(temperature=0, max_tokens=10, logprobs=True, top_logprobs=2)
    out = server.client.post("/v1/chat/completions", json=body).json()
    content = out["choices"][0]["logprobs"]["content"]
    assert len(content) == out["usage"]["completion_tokens"]
    for e in content:
        assert set(e) == {"token", "logprob", "bytes", "top_logprobs"} and len(e["top_logprobs"]) == 2
        assert e["top_logprobs"][0]["logprob"] == e["logprob"]
    streamed = [e for c in sse(server.client.post("/v1/chat/completions", json={**body, "stream": True}).text)
                for ch in c["choices"] if ch["logprobs"] for e in ch["logprobs"]["content"]]
    assert streamed == content
    # logprobs without top_logprobs stream with their tokens.
    body = chat_body(temperature=0, max_tokens=10, logprobs=True)
    whole = server.client.post("/v1/chat/completions", json=body).json()["choices"][0]["logprobs"]["content"]
    streamed = [e for c in sse(server.client.post("/v1/chat/completions", json={**body, "stream": True}).text)
                for ch in c["choices"] if ch["logprobs"] for e in ch["logprobs"]["content"]]
    assert streamed == whole


def test_stop_strings_cut_the_text_streamed_or_not(server: Server, served: ServedModel) -> None:
    for k in range(50):  # a prompt whose completion runs long enough (the fake's EOS is random)
        base = {"prompt": f"hello world {k}", "temperature": 0, "max_tokens": 60}
        full = server.client.post("/v1/completions", json=base).json()["choices"][0]["text"]
        words = full.split()
        if len(words) > 3 and all(w.isprintable() for w in words[:3]):
            break
    assert len(words) > 3, full
    stop = words[2][:3]
    cut = full[:full.index(stop)]
    out = server.client.post("/v1/completions", json={**base, "stop": [stop, "zzzz"]}).json()
    assert out["choices"][0]["text"] == cut and out["choices"][0]["finish_reason"] == "stop"
    assert out["usage"]["completion_tokens"] < len(server.engine.expected(served.codec.encode(base["prompt"]), 60,
                                                                          {EOS}))
    chunks = sse(server.client.post("/v1/completions", json={**base, "stop": stop, "stream": True}).text)
    assert "".join(ch["text"] for c in chunks for ch in c["choices"]) == cut


def test_text_stream_never_shows_a_stop_string(served: ServedModel) -> None:
    codec = served.codec
    ids = codec.encode("the cat sat on a mat and the dog ran fast é ü")
    for stops in ([], ["mat"], ["dog r"], ["ü"], ["nothing"]):
        t = TextStream(codec, stops)
        shown = ""
        for tid in ids:
            t.push(tid)
            shown += t.ready()
            assert not any(s in shown for s in stops)
        final = final_text(codec, ids, stops)
        assert shown + t.finish(final) == final


# --------------------------------------------------------------------------- errors


BAD_CHAT = [
    (chat_body(temperature="hot"), "temperature"),
    (chat_body(temperature=float("nan")), "temperature"),
    (chat_body(temperature=-1), "temperature"),
    (chat_body(temperature=1e308), "temperature"),
    (chat_body(top_p=0), "top_p"),
    (chat_body(top_p=1.5), "top_p"),
    (chat_body(top_k=-5), "top_k"),
    (chat_body(top_k=2.5), "top_k"),
    (chat_body(seed=-1), "seed"),
    (chat_body(seed=2**40), "seed"),
    (chat_body(max_tokens=0), "max_tokens"),
    (chat_body(max_tokens=True), "max_tokens"),
    (chat_body(max_completion_tokens="5"), "max_completion_tokens"),
    (chat_body(n=0), "n"),
    (chat_body(n=10**9), "n"),
    (chat_body(stop=5), "stop"),
    (chat_body(stop=["a"] * 100), "stop"),
    (chat_body(logprobs="yes"), "logprobs"),
    (chat_body(top_logprobs=3), "top_logprobs"),
    (chat_body(logprobs=True, top_logprobs=50), "top_logprobs"),
    (chat_body(stream="yes"), "stream"),
    (chat_body(stream_options={"include_usage": True}), "stream_options"),
    (chat_body(frobnicate=1), "frobnicate"),
    (chat_body(frequency_penalty=0.5), "frequency_penalty"),
    (chat_body(tools=[{"type": "function", "function": {"name": "f"}}]), "tools"),
    (chat_body(logit_bias={"5": 10}), "logit_bias"),
    (chat_body(model=5), "model"),
    ({"model": "fake", "messages": []}, "messages"),
    ({"model": "fake"}, "messages"),
    ({"model": "fake", "messages": "hi"}, "messages"),
    ({"model": "fake", "messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
    ({"model": "fake", "messages": [{"role": "user", "content": 5}]}, "messages"),
    ({"model": "fake", "messages": [{"role": "user"}]}, "messages"),
    ({"model": "fake", "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages"),
    ({"model": "fake", "messages": [{"role": "user", "content": "x", "tool_calls": []}]}, "messages"),
    ({"model": "fake", "messages": ["hi"]}, "messages"),
]


@pytest.mark.parametrize("body,param", BAD_CHAT, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD_CHAT)])
def test_bad_chat_requests_are_400_naming_the_field(server: Server, body: dict, param: str) -> None:
    assert_error(server.client.post("/v1/chat/completions", content=json.dumps(body)), 400, param)


BAD_COMPLETIONS = [
    ({}, "prompt"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": []}, "prompt"),
    ({"prompt": [[]]}, "prompt"),
    ({"prompt": [1, 2, 999]}, "prompt"),
    ({"prompt": [1, -2]}, "prompt"),
    ({"prompt": [1, "a"]}, "prompt"),
    ({"prompt": "x", "echo": True}, "echo"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "logprobs": 9}, "logprobs"),
    ({"prompt": "x", "logprobs": True}, "logprobs"),
]


@pytest.mark.parametrize("body,param", BAD_COMPLETIONS, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD_COMPLETIONS)])
def test_bad_completion_requests_are_400_naming_the_field(server: Server, body: dict, param: str) -> None:
    assert_error(server.client.post("/v1/completions", json=body), 400, param)


def test_malformed_bodies_and_context_length(server: Server) -> None:
    c = server.client
    for raw in (b"{", b"", b"[1, 2]", b"null", b"\xff\xfe", b"[" * 100000, b'"text"'):
        assert_error(c.post("/v1/chat/completions", content=raw), 400)
    assert_error(c.post("/v1/completions", content=b"x" * (17 * 2**20)), 413)
    err = assert_error(c.post("/v1/completions", json={"prompt": [5] * 600}), 400, "prompt", "context_length_exceeded")
    assert "maximum context length is 512 tokens" in err["message"]
    err = assert_error(c.post("/v1/completions", json={"prompt": [5] * 100, "max_tokens": 500}), 400,
                       code="context_length_exceeded")
    assert "600 tokens (100 in the prompt, 500 in the completion)" in err["message"]
    assert_error(c.post("/v1/chat/completions", json=chat_body(messages=[{"role": "user", "content": "cat " * 600}])),
                 400, "messages", "context_length_exceeded")
    assert c.get("/health").json()["status"] == "ok"


def test_api_key(served: ServedModel) -> None:
    s = Server(served, FakeEngine(), api_key="sekrit")
    try:
        body = chat_body(temperature=0, max_tokens=3)
        assert_error(s.client.post("/v1/chat/completions", json=body), 401, code="invalid_api_key")
        assert_error(s.client.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer nope"}),
                     401, code="invalid_api_key")
        assert_error(s.client.get("/v1/models"), 401)
        ok = {"Authorization": "Bearer sekrit"}
        assert s.client.post("/v1/chat/completions", json=body, headers=ok).status_code == 200
        assert s.client.get("/v1/models", headers=ok).status_code == 200
        assert s.client.get("/health").status_code == 200  # for load balancers: no key
    finally:
        s.close()


def test_engine_failure_is_a_500_without_traceback(served: ServedModel) -> None:
    s = Server(served, FakeEngine(fail_after=1, chunk=1))
    try:
        # Greedy: the fake's first token is then fixed and not EOS (sampled with a server-drawn seed,
        # it was EOS in about 1 run of 40, and the request finished before the engine failed).
        body = {"prompt": [5, 6], "max_tokens": 5, "temperature": 0}
        err = assert_error(s.client.post("/v1/completions", json=body), 500)
        assert err["type"] == "server_error"
        assert any("fake engine failure" in line for line in s.logs)  # the traceback goes to the log
        assert_error(s.client.post("/v1/completions", json=body), 500)
        assert s.client.get("/health").status_code == 503
    finally:
        s.close()


def test_requests_share_the_engine(served: ServedModel) -> None:
    s = Server(served, FakeEngine(slots=8, chunk=1, delay=0.002))
    try:
        results = [None] * 6

        def one(i: int) -> None:
            results[i] = s.client.post("/v1/completions", json={"prompt": [5 + i], "temperature": 0.7, "seed": 1,
                                                                "max_tokens": 30}).json()

        threads = [threading.Thread(target=one, args=(i,)) for i in range(6)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        assert s.engine.max_running > 1
        for i, r in enumerate(results):
            want = s.engine.expected([5 + i], 30, {EOS}, seed=1)
            assert r["choices"][0]["text"] == served.codec.decode(want)
    finally:
        s.close()


# --------------------------------------------------------------------------- disconnects (a real socket)


def test_a_client_that_disconnects_mid_stream_frees_its_slot(served: ServedModel) -> None:
    engine = FakeEngine(chunk=1, delay=0.01, max_length=100_000)
    s = Server(ServedModel(**{**served.__dict__, "max_length": 100_000}), engine)
    try:
        with uvicorn_on_a_port(s.app) as (_, port):
            deadline = time.time() + 10
            for stream in (True, False):
                body = json.dumps({"prompt": [5, 6], "max_tokens": 50_000, "stream": stream}).encode()
                c = socket.create_connection(("127.0.0.1", port))
                c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                          b"Content-Length: %d\r\n\r\n" % len(body) + body)
                while s.worker.in_flight() == 0 and time.time() < deadline:
                    time.sleep(0.01)
                if stream:
                    assert c.recv(100).startswith(b"HTTP/1.1 200")
                c.close()
                while (s.worker.in_flight() or engine.busy()) and time.time() < deadline:
                    time.sleep(0.01)
                assert s.worker.in_flight() == 0 and not engine.busy(), "the disconnected request still decodes"
            assert sum("client disconnected" in line for line in s.logs) == 2
    finally:
        s.close()


# --------------------------------------------------------------------------- the command's user errors


def test_serve_command_user_errors(tmp_path, capsys, monkeypatch) -> None:
    from olmax import cli
    rc = cli.main(["serve", "--checkpoint", str(tmp_path / "nothing"), "--port", "0"])
    assert rc == 2 and "does not exist" in capsys.readouterr().err
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        rc = cli.main(["serve", "--checkpoint", str(tmp_path), "--port", str(busy.getsockname()[1])])
        assert rc == 2 and "cannot listen on 127.0.0.1" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "uvicorn", None)
    rc = cli.main(["serve", "--checkpoint", str(tmp_path), "--port", "0"])
    assert rc == 2 and "pip install 'olmax[serve]'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["serve", "--checkpoint", "x", "--port", "70000"])


def test_logprobs_json_never_holds_infinity(served: ServedModel) -> None:
    from olmax.serve.protocol import chat_logprobs, completion_logprobs
    inf = float("-inf")
    c = chat_logprobs(served.codec, [5], [inf], [[(5, inf), (6, -1.0)]])["content"][0]
    assert c["logprob"] == -9999.0 and [t["logprob"] for t in c["top_logprobs"]] == [-9999.0, -1.0]
    d = completion_logprobs(served.codec, [5], [inf], [[(5, inf)]])
    assert d["token_logprobs"] == [-9999.0] and list(d["top_logprobs"][0].values()) == [-9999.0]
    json.dumps(c, allow_nan=False)
