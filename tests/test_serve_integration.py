"""``olmax serve`` end to end: the command on a tiny random OLMo 3 checkpoint (with a byte-level BPE
and a ChatML template), as a subprocess on a free port, talked to through the official ``openai``
client; the same greedy completions as ``olmax generate --chat`` / ``--prompt-ids``; a seeded
sampled request gives the same completion alone and among 8 concurrent others, streamed or not; a
probe of malformed requests (strings that are not text, empty stops) and abrupt disconnects leaves
it answering /health with error JSON and no traceback in any body or log line; a 15 MB body and a
body of millions of small JSON values never stall /health (under 100 ms measured, 0.5 s asserted);
SIGTERM answers new requests
503 while the request in flight finishes, then exits 0; a checkpoint whose forward overflows ends
``olmax generate`` and the served request naming the checkpoint and step, and without a tokenizer
answers token ids."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

import olmax
from olmax import cli
from olmax.compat.hf import random_hf_model
from serve_fake import SPECIALS, tokenizer

pytestmark = pytest.mark.integration
openai = pytest.importorskip("openai")

MODEL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, sliding_window=16, rms_norm_eps=1e-6, bos_token_id=None)
JINJA = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
KEY = "test-key"
QUESTION = "what color is the sky?"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("chat_model")
    tok = tokenizer(d)
    from tokenizers import Tokenizer
    vocab = Tokenizer.from_file(str(tok)).get_vocab_size()
    random_hf_model(d, seed=3, vocab_size=vocab, eos_token_id=SPECIALS.index("<|endoftext|>"),
                    pad_token_id=SPECIALS.index("<|pad|>"), **MODEL)
    (d / "chat_template.jinja").write_text(JINJA)
    return d


class ServeProcess:
    """``olmax serve`` in a subprocess; its stderr lines are collected on a thread."""

    def __init__(self, *args: str) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(olmax.__file__).parents[1]),
                                                            os.environ.get("PYTHONPATH", "")])}
        self.proc = subprocess.Popen([sys.executable, "-m", "olmax.cli", "serve", "--port", "0", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.lines: list[str] = []
        self.url: str | None = None
        threading.Thread(target=self._read, daemon=True).start()
        deadline = time.time() + 300
        while self.url is None and time.time() < deadline and self.proc.poll() is None:
            time.sleep(0.1)
        assert self.url is not None, "olmax serve did not start:\n" + "".join(self.lines[-30:])

    def _read(self) -> None:
        for line in self.proc.stderr:
            self.lines.append(line)
            m = re.search(r" at (http://\S+)/v1 ", line)
            if m:
                self.url = m.group(1)

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(120)


@pytest.fixture(scope="module")
def server(checkpoint: Path):
    s = ServeProcess("--checkpoint", f"hf:{checkpoint}", "--api-key", KEY, "--max-concurrency", "8",
                     "--max-length", "256", "--model-name", "tiny")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(server: ServeProcess):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)


def generate(argv: list[str], capsys: pytest.CaptureFixture) -> list[dict]:
    rc = cli.main(["generate", *argv, "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def test_models_and_the_startup_line(server: ServeProcess, client) -> None:
    assert [m.id for m in client.models.list().data] == ["tiny"]
    assert any(f"tiny at {server.url}/v1" in line and "chat_template.jinja" in line for line in server.lines)
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0).models.list()
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="gpt-4", messages=[{"role": "user", "content": "hi"}])


def test_greedy_chat_equals_olmax_generate_chat(checkpoint: Path, client, capsys) -> None:
    (ref,) = generate(["--checkpoint", f"hf:{checkpoint}", "--chat", "--prompt", QUESTION, "--max-new-tokens", "40"],
                      capsys)
    assert ref["text"].strip(), ref  # something to compare
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": QUESTION}],
                                       temperature=0, max_tokens=40)
    assert r.choices[0].message.content == ref["text"]
    assert r.choices[0].finish_reason == ref["finish_reason"]
    assert r.usage.completion_tokens == len(ref["token_ids"])
    # Streamed: the same text, and a final usage chunk.
    chunks = list(client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": QUESTION}],
                                                 temperature=0, max_tokens=40, stream=True,
                                                 stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref["text"]
    assert chunks[-1].usage.completion_tokens == len(ref["token_ids"]) and not chunks[-1].choices


def test_completions_from_token_ids_equal_olmax_generate(checkpoint: Path, client, tmp_path: Path, capsys) -> None:
    prompts = [[5, 6, 7, 8], [40, 41]]
    f = tmp_path / "ids.jsonl"
    f.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    ref = generate(["--checkpoint", f"hf:{checkpoint}", "--prompt-ids", str(f), "--max-new-tokens", "20"], capsys)
    r = client.completions.create(model="tiny", prompt=prompts, temperature=0, max_tokens=20, logprobs=2)
    for c, want in zip(r.choices, ref):
        assert c.text == want["text"] and c.finish_reason == want["finish_reason"]
        assert c.logprobs.token_logprobs == pytest.approx(want["logprobs"], abs=1e-5)


def test_seeded_sample_alone_equals_among_8_concurrent(server: ServeProcess, client) -> None:
    def ask(prompt: str, seed: int, stream: bool) -> str:
        kw = dict(model="tiny", prompt=prompt, temperature=0.9, top_p=0.95, seed=seed, max_tokens=32)
        if not stream:
            return client.completions.create(**kw).choices[0].text
        return "".join(c.choices[0].text for c in client.completions.create(**kw, stream=True) if c.choices)

    alone = ask("the cat sat", 11, False)
    assert alone == ask("the cat sat", 11, True)
    before = httpx.get(server.url + "/health").json()["engine"]
    with ThreadPoolExecutor(10) as pool:
        others = [pool.submit(ask, f"we see the {w}", i, i % 2 == 0) for i, w in enumerate(["sky"] * 4 + ["dog"] * 4)]
        among = [pool.submit(ask, "the cat sat", 11, stream) for stream in (False, True)]
        [f.result() for f in others]
        assert [f.result() for f in among] == [alone, alone]
    after = httpx.get(server.url + "/health").json()["engine"]
    # They decoded in one batch: more tokens kept than decode steps run.
    decoded, steps = (after[k] - before[k] for k in ("decoded", "decode_steps"))
    assert decoded > 2 * steps, (decoded, steps)


def _raw(port: int, data: bytes, read: bool = True) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=60) as s:
        s.sendall(data)
        if not read:
            return b""
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def _post(path: str, body: bytes) -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body


def test_malformed_request_probe(server: ServeProcess) -> None:
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    cases: list[tuple[str, bytes, int]] = [
        ("/v1/chat/completions", b"{", 400),
        ("/v1/chat/completions", b"", 400),
        ("/v1/chat/completions", b"[1,2]", 400),
        ("/v1/chat/completions", b"\xff\xfe\x00", 400),
        ("/v1/chat/completions", b"[" * 50000, 400),
    ]
    bad_fields = [{"temperature": "hot"}, {"temperature": float("nan")}, {"temperature": -0.5},
                  {"temperature": 1e300}, {"top_p": -1}, {"top_p": float("inf")}, {"top_k": -7},
                  {"max_tokens": -1}, {"max_tokens": 10**12}, {"n": -3}, {"n": 10**6}, {"seed": -5},
                  {"seed": 2**64}, {"stop": {"a": 1}}, {"logprobs": True, "top_logprobs": 1000},
                  {"unknown_field": 1}, {"messages": []}, {"messages": [{}]}, {"messages": None},
                  {"messages": [{"role": "user", "content": "word " * 5000}]}, {"stream": "sometimes"},
                  {"model": ["tiny"]}, {"presence_penalty": 1.5}, {"stop": ""}, {"stop": ["", ""]}]
    for extra in bad_fields:
        body = json.dumps({**chat, **extra}, allow_nan=True).encode()
        cases.append(("/v1/chat/completions", body, 400))
    # Lone UTF-16 surrogates (valid JSON escapes, not text): a model name, a field name, chat content,
    # a completion prompt (each a traceback and a 500 before).
    for raw in (b'{"model": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}',
                b'{"\\ud800": 1, "messages": [{"role": "user", "content": "hi"}]}',
                b'{"model": "tiny", "messages": [{"role": "user", "content": "a\\ud800"}]}'):
        cases.append(("/v1/chat/completions", raw, 400))
    cases += [("/v1/completions", b'{"model": "tiny", "prompt": "\\udc00"}', 400),
              ("/v1/completions", b'{"model": "tiny", "prompt": ["x", "\\ud800"]}', 400)]
    cases += [("/v1/completions", json.dumps({"prompt": [1] * 1000}).encode(), 400),
              ("/v1/completions", json.dumps({"prompt": [10**9]}).encode(), 400),
              ("/v1/completions", json.dumps({"model": "other", "prompt": "x"}).encode(), 404),
              ("/v1/nowhere", b"{}", 404)]
    # A body over the limit is refused from its Content-Length, before it is read.
    oversized = _raw(server.port, _post("/v1/completions", b"x" * 1000).replace(b"Content-Length: 1000",
                                                                                b"Content-Length: 99999999"))
    assert oversized.startswith(b"HTTP/1.1 413") and b'"error"' in oversized
    assert len(cases) + 1 >= 30
    for path, body, status in cases:
        out = _raw(server.port, _post(path, body))
        head, _, payload = out.partition(b"\r\n\r\n")
        assert head.split(b" ")[1] == str(status).encode(), (path, body[:80], out[:300])
        err = json.loads(payload)["error"]
        assert err["message"] and "Traceback" not in out.decode(errors="replace")
    # Abrupt disconnects: mid-headers, mid-body, right after the request, mid-stream.
    whole = _post("/v1/chat/completions", json.dumps({**chat, "max_tokens": 200, "stream": True}).encode())
    for cut in (10, len(whole) - 5, len(whole)):
        _raw(server.port, whole[:cut], read=False)
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as s:
        s.sendall(whole)
        assert s.recv(64).startswith(b"HTTP/1.1 200")
    # 100 concurrent connections, each a small completion.
    with ThreadPoolExecutor(100) as pool:
        body = json.dumps({"model": "tiny", "prompt": [5, 6], "max_tokens": 2, "temperature": 0}).encode()
        outs = list(pool.map(lambda _: _raw(server.port, _post("/v1/completions", body)), range(100)))
    assert all(o.startswith(b"HTTP/1.1 200") for o in outs)
    assert httpx.get(server.url + "/health").json()["status"] == "ok"
    deadline = time.time() + 60
    while httpx.get(server.url + "/health").json()["in_flight"] and time.time() < deadline:
        time.sleep(0.2)
    assert httpx.get(server.url + "/health").json()["in_flight"] == 0, "disconnected requests still decode"
    tb = next((i for i, line in enumerate(server.lines) if "Traceback" in line), None)
    assert tb is None, "".join(server.lines[max(0, tb - 3):tb + 40])


class HealthWatch:
    """GET /health every 10 ms on a thread; the slowest answer, in seconds."""

    def __init__(self, url: str) -> None:
        self.url, self.times, self._stop = url, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as c:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                assert c.get(self.url + "/health").status_code == 200
                self.times.append(time.perf_counter() - t0)
                time.sleep(0.01)

    def __enter__(self) -> HealthWatch:
        self._thread.start()
        time.sleep(0.2)
        return self

    def __exit__(self, *exc) -> None:
        time.sleep(0.2)
        self._stop.set()
        self._thread.join(30)

    @property
    def slowest(self) -> float:
        return max(self.times)


def test_no_body_stalls_health_or_a_stream(server: ServeProcess, client) -> None:
    """The probe's slow requests: a 15 MB chat body (just under the 16 MiB limit; its tokenizing
    took 70 s of CPU and held /health 58-72 s) is answered 400 from its length in under 2 s, and a
    5 MB body of a million one-element lists (seconds of JSON parsing, in a parse worker) is
    answered 400; /health answers within 100 ms all along, and a stream in progress runs on."""
    headers = {"Authorization": f"Bearer {KEY}"}
    big = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "ab " * (5 * 2**20)}],
                      "max_tokens": 4}).encode()
    dense = json.dumps({"model": "tiny", "prompt": [[1]] * 2**20}).encode()
    assert 14 * 2**20 < len(big) < 16 * 2**20
    stream = client.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=150, temperature=0, stream=True)
    first = next(iter(stream))
    with HealthWatch(server.url) as watch, httpx.Client(timeout=120, headers=headers) as c:
        t0 = time.perf_counter()
        r = c.post(server.url + "/v1/chat/completions", content=big)
        big_s = time.perf_counter() - t0
        assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded", r.text[:300]
        t0 = time.perf_counter()
        r = c.post(server.url + "/v1/completions", content=dense)
        dense_s = time.perf_counter() - t0
        assert r.status_code == 400 and "choices in one request" in r.json()["error"]["message"], r.text[:300]
    rest = list(stream)
    assert (rest or [first])[-1].choices[0].finish_reason in ("stop", "length")
    print(f"15 MB body: 400 in {big_s:.3f} s; 5 MB dense body: 400 in {dense_s:.3f} s; /health slowest "
          f"{watch.slowest * 1000:.1f} ms of {len(watch.times)}")
    # The claim is that no body stalls the event loop (before: /health held 58-72 s, the 400 after
    # about 70 s). The bounds leave room for a loaded 2-core CI host; the figures measured here
    # (0.11-0.27 s and at most 47 ms on 2026-12-07) are printed above.
    assert big_s < 2.0, big_s
    assert watch.slowest < 0.5, sorted(watch.times)[-5:]


@pytest.fixture(scope="module")
def overflowing(tmp_path_factory: pytest.TempPathFactory, checkpoint: Path) -> tuple[Path, list[int], int]:
    """A copy of the checkpoint without its tokenizer, one token's embedding 1e30 times larger:
    finite weights whose forward is not where that token is read (OLMo 3 normalises each block's
    output, not the residual its MLP reads). The token is the first greedy token of the prompt, so
    generating from the prompt meets it at decode step 1. (checkpoint, prompt, token)."""
    from safetensors.numpy import load_file, save_file

    from olmax.infer.run import Model
    prompt = [5, 6, 7, 8]
    (first,) = Model(f"hf:{checkpoint}").generate([prompt], max_new_tokens=1)
    token = first["token_ids"][0]
    d = tmp_path_factory.mktemp("overflowing")
    for f in ("config.json", "generation_config.json"):
        (d / f).write_bytes((checkpoint / f).read_bytes())
    weights = load_file(str(checkpoint / "model.safetensors"))
    weights["model.embed_tokens.weight"][token] *= 1e30
    save_file(weights, str(d / "model.safetensors"), metadata={"format": "pt"})
    return d, prompt, token


def test_a_checkpoint_whose_forward_is_not_finite(overflowing: tuple[Path, list[int], int], tmp_path: Path,
                                                  capsys: pytest.CaptureFixture) -> None:
    """``olmax generate`` exits 2 naming the checkpoint, prompt and step (it answered exit 0 with a
    null log-prob); ``olmax serve`` on it, without a tokenizer, answers token ids where the logits
    are finite and 500 ``non_finite_logits`` naming the checkpoint where they are not."""
    ckpt, prompt, token = overflowing
    f = tmp_path / "ids.jsonl"
    f.write_text(json.dumps(prompt) + "\n")
    rc = cli.main(["generate", "--checkpoint", f"hf:{ckpt}", "--prompt-ids", str(f), "--max-new-tokens", "4",
                   "--json"])
    out, err = capsys.readouterr()
    assert rc == 2 and f"checkpoint hf:{ckpt}, prompt 1:" in err and "generation step 1 (decode step 1)" in err, err
    assert json.loads(out)["error"] and "NaN" not in out.replace("(NaN or infinite)", "")
    s = ServeProcess("--checkpoint", f"hf:{ckpt}", "--max-length", "64", "--max-concurrency", "2")
    try:
        with httpx.Client(timeout=120) as c:
            r = c.post(s.url + "/v1/completions", json={"prompt": [40, 41], "max_tokens": 1, "logprobs": 1})
            assert r.status_code == 200, r.text
            choice = r.json()["choices"][0]
            assert choice["text"] == "" and len(choice["token_ids"]) == 1, choice
            assert choice["logprobs"]["tokens"] == [str(t) for t in choice["token_ids"]]
            for p in ([*prompt[:2], token], prompt):  # at the prefill; at decode step 1
                r = c.post(s.url + "/v1/completions", json={"prompt": p, "max_tokens": 4, "temperature": 0})
                e = r.json()["error"]
                assert r.status_code == 500 and e["code"] == "non_finite_logits", r.text
                assert f"checkpoint hf:{ckpt}" in e["message"] and "generation step" in e["message"]
            assert c.get(s.url + "/health").json()["status"] == "ok"  # the server serves on
        assert any("token ids only" in line for line in s.lines)
    finally:
        assert s.stop() == 0
    assert not any("Traceback" in line for line in s.lines), "".join(s.lines)


def test_sigterm_finishes_the_request_in_flight_and_exits_0(checkpoint: Path) -> None:
    """SIGTERM with a stream in flight and a request still arriving (its body half sent): new
    requests and /health are answered 503 while those two finish (the second once its body
    arrives), then the server exits 0."""
    s = ServeProcess("--checkpoint", f"hf:{checkpoint}", "--max-length", "256", "--max-concurrency", "2",
                     "--warmup", "16")
    try:
        c = openai.OpenAI(base_url=s.url + "/v1", api_key="none", max_retries=0, timeout=300)
        stream = c.completions.create(model=f"hf:{checkpoint}", prompt=[5, 6, 7], max_tokens=200, temperature=0,
                                      stream=True)
        first = next(iter(stream))
        late = _post("/v1/completions", json.dumps({"prompt": [9, 10], "max_tokens": 2}).encode())
        arriving = socket.create_connection(("127.0.0.1", s.port), timeout=60)
        arriving.sendall(late[:-5])
        time.sleep(0.5)  # its handler has started: it waits for the rest of its body
        s.proc.send_signal(signal.SIGTERM)
        deadline = time.time() + 30
        while not any("answering new ones 503" in line for line in s.lines) and time.time() < deadline:
            time.sleep(0.05)
        # Draining: a new request and /health are answered 503 (a load balancer reads it), not refused.
        r = httpx.post(s.url + "/v1/completions", json={"prompt": [5], "max_tokens": 2})
        assert r.status_code == 503 and r.json()["error"]["message"] == "the server is shutting down"
        assert httpx.get(s.url + "/health").status_code == 503
        arriving.sendall(late[-5:])
        answer = b""
        while chunk := arriving.recv(65536):
            answer += chunk
        arriving.close()
        assert answer.startswith(b"HTTP/1.1 200"), answer[:300]
        rest = list(stream)  # the request in flight runs to its end
        assert (rest or [first])[-1].choices[0].finish_reason in ("stop", "length")
        assert s.proc.wait(120) == 0
        with pytest.raises(httpx.ConnectError):
            httpx.get(s.url + "/health")
        # One bucket (prompts up to 16 tokens), 1 and 2 rows at a time, greedy and sampled.
        assert any("warmed up 4 prefill groups" in line for line in s.lines), "".join(s.lines)
    finally:
        s.stop()
