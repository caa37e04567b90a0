"""Serving throughput and latency: ``olmax serve`` against ``transformers serve`` (continuous
batching on) on the same model and the same requests, and against offline ``olmax generate``
on the same prompts, as ratios measured in the same run.

Model: a ``random_hf_model`` (d_model 512, 8 layers, 8 heads, MLP 1536 by default; ``--layers``,
``--hidden``) with a byte-level BPE trained here (vocabulary ``--vocab``) and a ChatML template,
fp32 on both sides; the LM head's EOS row is zeroed so that greedy decoding never stops early and
every request makes ``--max-tokens`` tokens. Or ``--checkpoint hf:DIR`` for a real one (it must
hold a tokenizer).

For each level N of ``--clients`` (default 1, 8, 32), N concurrent clients stream
``/v1/completions`` (greedy, text prompts of about ``--prompt-tokens`` tokens, distinct per
request) until ``max(2N, 8)`` requests are done (``olmax serve --warmup`` compiles its prefill
programs first), after a warm-up burst at the level; the best of
``--repeats`` such runs (default 2: the engine compiles a prefill program the first time it admits
a new number of rows or prompt bucket together, and one run alone may time a compile). Per level:
aggregate output tokens/s (all tokens over the wall time), time to first token (p50, p95) and
per-token latency (a request's time from first to last token over its tokens after the first;
p50). Offline: ``olmax.infer.run.Model.generate`` (what ``olmax generate`` runs) on the same
prompts at batch size max(N), warmed up, the best of ``--repeats``, tokens/s.

Targets (the issue that asked for this): at 32 clients olmax serve >= 0.8x offline generate
and >= 3x transformers serve.

    .venv/bin/python benchmarks/bench_serve.py [--clients 1,8,32] [--max-tokens 64] [--json FILE]
    .venv/bin/python benchmarks/bench_serve.py --clients 1,2 --max-tokens 8 --skip-transformers  # smoke
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

import olmax

ROOT = Path(__file__).resolve().parents[1]
JINJA = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
         "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SPECIALS = ["<|endoftext|>", "<|pad|>", "<|im_start|>", "<|im_end|>"]


# --------------------------------------------------------------------------- the model


def make_model(folder: Path, vocab: int, hidden: int, layers: int) -> Path:
    """A random OLMo 3 with a BPE of ``vocab`` tokens over random words, HF-loadable on both sides."""
    from safetensors.numpy import load_file, save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from olmax.compat.hf import random_hf_model
    rnd = random.Random(0)
    words = ["".join(rnd.choices("abcdefghijklmnopqrstuvwxyz", k=rnd.randint(2, 9))) for _ in range(6000)]
    corpus = [" ".join(rnd.choices(words, k=30)) for _ in range(4000)]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=vocab, special_tokens=SPECIALS,
                                                        show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    n = tok.get_vocab_size()
    random_hf_model(folder, seed=0, vocab_size=n, hidden_size=hidden, intermediate_size=3 * hidden,
                    num_hidden_layers=layers, num_attention_heads=8, num_key_value_heads=8,
                    max_position_embeddings=2048, sliding_window=128, rms_norm_eps=1e-6, eos_token_id=0,
                    pad_token_id=1, bos_token_id=None)
    # EOS never wins a greedy step: every request runs to max_tokens on both servers.
    for f in folder.glob("*.safetensors"):
        t = load_file(f)
        if "lm_head.weight" in t:
            t["lm_head.weight"][0] = 0
            save_file(t, f, metadata={"format": "pt"})
    tok.save(str(folder / "tokenizer.json"))
    (folder / "chat_template.jinja").write_text(JINJA)
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "eos_token": SPECIALS[0], "pad_token": SPECIALS[1],
        "model_max_length": 2048}))
    return folder


def prompts(tokenizer: Path, count: int, tokens: int) -> list[str]:
    """``count`` distinct text prompts of about ``tokens`` tokens each."""
    from tokenizers import Tokenizer
    tok = Tokenizer.from_file(str(tokenizer))
    rnd = random.Random(1)
    vocab = [w for w in tok.get_vocab() if w.isalpha() and w.isascii()]
    out = []
    for _ in range(count):
        words: list[str] = []
        while len(tok.encode(" ".join(words), add_special_tokens=False).ids) < tokens:
            words.append(rnd.choice(vocab))
        out.append(" ".join(words))
    return out


# --------------------------------------------------------------------------- servers


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Process:
    """A server subprocess; ready when ``/health`` answers 200."""

    def __init__(self, name: str, argv: list[str], port: int, env: dict | None = None) -> None:
        self.name, self.port = name, port
        self.log = tempfile.NamedTemporaryFile("w+", prefix=f"{name}-", suffix=".log", delete=False)
        self.proc = subprocess.Popen(argv, stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})})

    def wait_ready(self, timeout: float = 900) -> None:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited {self.proc.returncode}:\n{self.tail()}")
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health", timeout=2).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"{self.name} did not start in {timeout} s:\n{self.tail()}")

    def tail(self, n: int = 30) -> str:
        self.log.flush()
        return "".join(Path(self.log.name).read_text(errors="replace").splitlines(True)[-n:])

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def olmax_serve(model: str, port: int, slots: int, max_length: int, warmup: int) -> Process:
    env = {"PYTHONPATH": os.pathsep.join([str(Path(olmax.__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
    return Process("olmax-serve", [sys.executable, "-m", "olmax.cli", "serve", "--checkpoint", model, "--port",
                                   str(port), "--max-concurrency", str(slots), "--max-length", str(max_length),
                                   "--model-name", "bench", "--warmup", str(warmup)], port, env)


def transformers_serve(hf_dir: str, port: int) -> Process:
    exe = Path(sys.executable).with_name("transformers")
    return Process("transformers-serve", [str(exe), "serve", hf_dir, "--continuous-batching", "--device", "cpu",
                                          "--dtype", "float32", "--host", "127.0.0.1", "--port", str(port)], port,
                   {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})


# --------------------------------------------------------------------------- clients


async def one(client: httpx.AsyncClient, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    first = last = None
    tokens = None
    text = ""
    async with client.stream("POST", url, json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: {r.status_code} {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                raise RuntimeError(f"{url}: {ev['error']}")
            now = time.perf_counter()
            for ch in ev.get("choices") or []:
                if ch.get("text"):
                    text += ch["text"]
                    first = first or now
                    last = now
            if ev.get("usage"):
                tokens = ev["usage"]["completion_tokens"]
    if tokens is None:
        raise RuntimeError(f"{url}: no usage in the stream")
    first = first or time.perf_counter()
    return {"ttft": first - t0, "tokens": tokens, "decode": (last or first) - first, "text": text}


async def level(url: str, model: str, texts: list[str], clients: int, requests: int, max_tokens: int,
                repeats: int) -> dict:
    """The best (highest tokens/s) of ``repeats`` timed runs after a warm-up burst: the engine
    compiles a prefill program per admission shape (rows admitted together, prompt bucket) the
    first time it meets one, and a run that meets a new one measures a compile."""
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=3600, limits=limits) as client:
        # Warm-up at this level, on its own prompts (also loads transformers' model).
        await asyncio.gather(*(one(client, url, model, texts[i % len(texts)], max_tokens) for i in range(clients)))
        best = None
        for _ in range(repeats):
            row = await timed(client, url, model, texts, clients, requests, max_tokens)
            if best is None or row["tokens_per_s"] > best["tokens_per_s"]:
                best = row
        return best


async def timed(client: httpx.AsyncClient, url: str, model: str, texts: list[str], clients: int, requests: int,
                max_tokens: int) -> dict:
    queue = list(range(requests))
    done: dict[int, dict] = {}

    async def worker() -> None:
        while queue:
            i = queue.pop(0)
            done[i] = await one(client, url, model, texts[i % len(texts)], max_tokens)

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    wall = time.perf_counter() - t0
    results = [done[i] for i in sorted(done)]
    ttft = sorted(r["ttft"] for r in results)
    per_token = sorted(r["decode"] / (r["tokens"] - 1) for r in results if r["tokens"] > 1)
    tokens = sum(r["tokens"] for r in results)
    return {"clients": clients, "requests": requests, "output_tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall, "ttft_p50_s": pct(ttft, 50), "ttft_p95_s": pct(ttft, 95),
            "per_token_p50_s": pct(per_token, 50) if per_token else None,
            "texts": [r["text"] for r in results]}


def pct(xs: list[float], q: float) -> float:
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q) - 1]


def offline(model: str, texts: list[str], batch: int, max_tokens: int, repeats: int) -> dict:
    """``olmax generate``'s code on the same prompts: warmed up, then timed."""
    from olmax.infer.run import Model
    m = Model(model)
    ids = [m.codec.encode(t) for t in texts]
    m.generate(ids, max_new_tokens=max_tokens, batch_size=batch)  # compiles every shape the timed run uses
    wall = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = m.generate(ids, max_new_tokens=max_tokens, batch_size=batch)
        wall = min(wall, time.perf_counter() - t0)
    tokens = sum(len(r["token_ids"]) for r in out)
    return {"batch_size": batch, "prompts": len(ids), "output_tokens": tokens, "wall_s": wall,
            "tokens_per_s": tokens / wall}


# --------------------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clients", default="1,8,32", help="concurrency levels (default 1,8,32)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--prompt-tokens", type=int, default=32)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--checkpoint", default=None, help="hf:DIR of a real model (default: a random one made here)")
    ap.add_argument("--repeats", type=int, default=2, help="timed runs per level; the best is kept (default 2)")
    ap.add_argument("--skip-transformers", action="store_true")
    ap.add_argument("--skip-offline", action="store_true")
    ap.add_argument("--json", default=None, metavar="FILE", help="also write the figures as JSON")
    args = ap.parse_args()
    levels = [int(x) for x in args.clients.split(",")]
    work = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    if args.checkpoint:
        hf_dir = args.checkpoint.removeprefix("hf:")
    else:
        hf_dir = str(make_model(work / "model", args.vocab, args.hidden, args.layers))
    model = f"hf:{hf_dir}"
    requests = {n: max(2 * n, 8) for n in levels}
    texts = prompts(Path(hf_dir) / "tokenizer.json", max(requests.values()) + max(levels), args.prompt_tokens)
    max_length = 64 * -(-(2 * args.prompt_tokens + args.max_tokens) // 64)
    report: dict = {"model": model if args.checkpoint else {"hidden": args.hidden, "layers": args.layers,
                                                            "vocab": args.vocab},
                    "max_tokens": args.max_tokens, "prompt_tokens": args.prompt_tokens, "levels": levels,
                    "machine": {"cpus": os.cpu_count()}, "systems": {}}

    def run_server(name: str, proc: Process, served: str) -> None:
        try:
            proc.wait_ready()
            rows = []
            for n in levels:
                row = asyncio.run(level(f"http://127.0.0.1:{proc.port}/v1/completions", served, texts, n,
                                        requests[n], args.max_tokens, args.repeats))
                print(f"  {name:19s} clients {n:3d}: {row['tokens_per_s']:8.1f} tok/s  ttft p50 "
                      f"{row['ttft_p50_s'] * 1e3:7.0f} ms p95 {row['ttft_p95_s'] * 1e3:7.0f} ms  per token p50 "
                      f"{(row['per_token_p50_s'] or 0) * 1e3:6.1f} ms  ({row['output_tokens']} tokens, "
                      f"{row['requests']} requests, {row['wall_s']:.1f} s)", flush=True)
                rows.append(row)
            report["systems"][name] = rows
        except Exception as e:  # noqa: BLE001 - one system failing is a result, not the end of the run
            print(f"  {name}: FAILED: {e}", flush=True)
            report["systems"][name] = {"error": str(e)[:2000]}
        finally:
            proc.stop()

    slots = max(levels)
    print(f"[bench-serve] model {model}, prompts ~{args.prompt_tokens} tokens, {args.max_tokens} new, greedy",
          flush=True)
    # Prompts are about --prompt-tokens long: warm the buckets they fall in.
    run_server("olmax serve", olmax_serve(model, free_port(), slots, max_length, args.prompt_tokens + 8), "bench")
    # Offline right after the server: on a shared machine the load drifts over the long reference run.
    if not args.skip_offline:
        n = max(levels)
        report["offline"] = offline(model, texts[:requests[n]], slots, args.max_tokens, args.repeats)
        print(f"  offline generate    batch {slots:3d}: {report['offline']['tokens_per_s']:8.1f} tok/s "
              f"({report['offline']['output_tokens']} tokens, {report['offline']['wall_s']:.1f} s)")
    if not args.skip_transformers:
        run_server("transformers serve", transformers_serve(hf_dir, free_port()), hf_dir)
    ox, hf = report["systems"].get("olmax serve"), report["systems"].get("transformers serve")
    ratios: dict = {}
    if isinstance(ox, list):
        top = ox[-1]
        if isinstance(hf, list):
            ratios["vs_transformers_serve"] = {r["clients"]: r["tokens_per_s"] / h["tokens_per_s"]
                                               for r, h in zip(ox, hf)}
            same = [sum(a == b for a, b in zip(r["texts"], h["texts"])) for r, h in zip(ox, hf)]
            ratios["identical_texts"] = same
        if "offline" in report:
            ratios["vs_offline_generate"] = top["tokens_per_s"] / report["offline"]["tokens_per_s"]
    for rows in report["systems"].values():
        for r in rows if isinstance(rows, list) else []:
            r.pop("texts", None)
    report["ratios"] = ratios
    print("\n  ratios: " + json.dumps(ratios))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
