"""Data pipeline speed, printed as ratios (runs in about 2 minutes on 2 cores).

1. Tokenising: ``olmax.data.tokenize`` with P processes (reading, EOS, hashing for the heldout
   split, writing shards) against the ``tokenizers`` library's own ``encode_batch`` in one
   process (its own thread pool, encoding only), on the same synthetic corpus and BPE.
2. Loader: instances/s at L=8192 with 2 Grain workers, against what one host consumes in the
   OLMo 3 7B stage-1 run (512 instances per ~0.76 s step, shared by H hosts).
3. Global order: time to build one epoch's permutation (the real mix has 724M instances).

Usage: python benchmarks/bench_data.py [--corpus-mb 8] [--hosts 64] [--order-instances 100000000]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
import time
from pathlib import Path

import numpy as np


def corpus(root: Path, mb: float) -> list[Path]:
    """Zipf-distributed words in JSONL documents (Dolma style)."""
    rnd = random.Random(0)
    words = ["".join(rnd.choice("etaoinshrdlucmfwypvbgkqjxz") for _ in range(rnd.randint(1, 10)))
             for _ in range(20000)]
    weights = [1 / (i + 1) for i in range(len(words))]
    root.mkdir(parents=True, exist_ok=True)
    paths, target = [], int(mb * 1e6 / 4)
    for i in range(4):
        p, size = root / f"part{i}.jsonl", 0
        with open(p, "w") as f:
            while size < target:
                text = " ".join(rnd.choices(words, weights, k=rnd.randint(50, 1500))) + "."
                f.write(json.dumps({"text": text}) + "\n")
                size += len(text) + 12
        paths.append(p)
    return paths


def bench_tokenize(root: Path, mb: float, processes: list[int]) -> None:
    from tokenizers import Tokenizer

    from olmax.data.tokenize import iter_documents, tokenize, train_bpe
    paths = corpus(root / "corpus", mb)
    nbytes = sum(p.stat().st_size for p in paths)
    train_bpe(paths[:1], 8192, root / "tok.json")
    docs = [t for p in paths for t, _ in iter_documents(p)]
    text_mb = sum(len(d.encode()) for d in docs) / 1e6
    tok = Tokenizer.from_file(str(root / "tok.json"))
    t = time.perf_counter()
    tok.encode_batch(docs, add_special_tokens=False)
    ref = text_mb / (time.perf_counter() - t)
    print(f"\n[tokenize] {text_mb:.1f} MB of text ({nbytes / 1e6:.1f} MB JSONL), BPE vocab 8192, "
          f"{os.cpu_count()} cores")
    print(f"  tokenizers encode_batch, 1 process (its own threads, encode only): {ref:6.2f} MB/s")
    for p in processes:
        t = time.perf_counter()
        tokenize(paths, root / f"out{p}", tokenizer=root / "tok.json", processes=p, progress=False)
        ours = text_mb / (time.perf_counter() - t)
        print(f"  olmax tokenize, {p} process(es) (read+encode+write):             {ours:6.2f} MB/s  "
              f"ratio {ours / ref:.2f}x")


def bench_loader(root: Path, hosts: int, steps: int) -> None:
    from olmax.data.loader import DataLoader
    from olmax.recipes import get_recipe
    L, local = 8192, 512 // hosts
    rng = np.random.default_rng(0)
    files = []
    for i in range(2):
        p = root / f"tokens{i}.npy"
        rng.integers(0, 100278, 8192 * 1100, dtype=np.uint32).tofile(p)
        files.append(str(p))
    need = local / 0.76
    print(f"\n[loader] L={L}, global batch 512, {hosts} hosts -> {local} instances per host per step")
    print(f"  assumption: a 7B stage-1 step takes ~0.76 s (published MaxText run), so a host consumes "
          f"{need:.1f} instances/s")
    for filt in (False, True):
        cfg = get_recipe("olmo3_7b_stage1", [f"data.paths={','.join(files)}", "data.workers=2", "data.prefetch=4",
                                             f"data.cache_dir={root / 'cache'}", f"data.repetition_filter={filt}"])
        dl = DataLoader(cfg, process_index=0, process_count=hosts, stop_step=steps + 1)
        it = iter(dl)
        next(it)                       # worker start-up is paid once per run, not per step
        t = time.perf_counter()
        n = sum(len(b["instance_ids"]) for b in it)
        rate = n / (time.perf_counter() - t)
        dl.close()
        print(f"  2 workers, repetition filter {'on ' if filt else 'off'}: {rate:8.1f} instances/s = "
              f"{rate / need:6.1f}x what the step consumes")


def bench_order(n: int) -> None:
    from olmax.data.order import build_epoch_order
    t = time.perf_counter()
    perm = build_epoch_order(n, 34521, 1)
    dt = time.perf_counter() - t
    print(f"\n[global order] {n / 1e6:.0f}M instances: {dt:.1f} s, {perm.nbytes / 2**30:.2f} GiB (one uint32 copy); "
          f"724M (the real mix) scales to about {dt * 724e6 / n:.0f} s if linear "
          f"(random access makes it a lower bound)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus-mb", type=float, default=8.0)
    ap.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--hosts", type=int, default=64)
    ap.add_argument("--loader-steps", type=int, default=150)
    ap.add_argument("--order-instances", type=int, default=100_000_000)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        bench_tokenize(Path(d), args.corpus_mb, args.processes)
        bench_loader(Path(d), args.hosts, args.loader_steps)
    bench_order(args.order_instances)


if __name__ == "__main__":
    main()
