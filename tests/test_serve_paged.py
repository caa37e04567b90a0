"""``olmax serve``'s HTTP layer over a real engine on a tiny random model, with the paged KV cache and
its prefix cache against the contiguous cache: requests with ``n > 1`` that share a system prompt
give the same choices (text, token log-probs, top log-probs: the same bits on the CPU), the later
requests find the system prompt's pages cached, and /health reports the KV cache."""

from __future__ import annotations

from dataclasses import replace

import jax
import pytest
from starlette.testclient import TestClient
from test_decode import TINY

from olmax.engine import Engine
from olmax.model.dispatch import can_reproduce_decode_bits
from olmax.model.params import init_params
from olmax.serve.app import create_app
from olmax.serve.worker import EngineWorker
from serve_fake import served_model

CFG = replace(TINY, vocab_size=320, padded_vocab_size=384)  # the fake tokenizer's vocabulary
SYSTEM = list(range(40, 56))  # 16 tokens: two whole pages of 8


def _choices(served, engine: Engine) -> tuple[list[list[dict]], dict]:
    worker = EngineWorker(engine).start()
    client = TestClient(create_app(served, worker), raise_server_exceptions=True)
    try:
        out = []
        for i, tail in enumerate(([3, 4, 5], [9, 8], [1, 2, 3, 4, 5, 6, 7])):
            r = client.post("/v1/completions", json={"prompt": SYSTEM + tail, "n": 3, "temperature": 1.0,
                                                     "seed": 11 + i, "max_tokens": 12, "logprobs": 2})
            assert r.status_code == 200, r.text
            out.append(r.json()["choices"])
        health = client.get("/health").json()
    finally:
        client.close()
        worker.close(timeout=5)
    return out, health


@pytest.mark.skipif(not can_reproduce_decode_bits(CFG), reason="a prefix cache is kept where decode bits reproduce")
def test_paged_serve_with_a_shared_system_prompt_equals_contiguous(tmp_path) -> None:
    served = served_model(tmp_path, max_length=64)
    params = init_params(CFG, jax.random.key(2))
    want, _ = _choices(served, Engine(params, CFG, slots=4, max_length=64))
    paged = Engine(params, CFG, slots=4, max_length=64, kv_cache="paged", page_size=8, prefix_cache=True)
    got, health = _choices(served, paged)
    assert got == want  # every choice's text, finish reason and log-probs, to the bit
    assert all(len(c["logprobs"]["token_logprobs"]) > 0 for cs in got for c in cs)
    # Each request's 3 rows share its whole prompt pages; the 2nd and 3rd find the system prompt cached.
    assert health["engine"]["kv_shared_prompt_tokens"] >= 3 * 2 * 16
    assert health["engine"]["kv_bytes_peak"] <= health["engine"]["kv_bytes_reserved"]
