"""The README's main job: a tiny OLMo 3 trained on CPU on a corpus every machine has.

Corpus: the Python standard library's own ``.py`` files (one document per file), a byte-level
BPE trained on them, 5% of the files held out by a hash of their text. The run evaluates
held-out loss at intervals, checkpoints, and ends by comparing held-out loss with the unigram
entropy of the training tokens (the loss of the best model that ignores context).
"""

from __future__ import annotations

import json
import sys
import sysconfig
from pathlib import Path

import numpy as np

from olmax.data.tokenize import tokenize
from olmax.recipes import get_recipe
from olmax.train.loop import train

DEMO_VOCAB = 4096
HELDOUT = 0.05


def stdlib_files(max_mb: float) -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files, total = [], 0
    for p in sorted(root.rglob("*.py")):
        if "site-packages" in p.parts or "test" in p.parts or "tests" in p.parts:
            continue
        try:
            size = p.stat().st_size
        except OSError:
            continue
        if size == 0:
            continue
        files.append(p)
        total += size
        if total >= max_mb * 1e6:
            break
    if not files:
        raise FileNotFoundError(f"no .py files under the standard library at {root}")
    return files


def unigram_entropy(paths: list[str], dtype: str, vocab: int) -> float:
    counts = np.zeros(vocab, np.int64)
    for p in paths:
        counts += np.bincount(np.fromfile(p, dtype=dtype), minlength=vocab)[:vocab]
    prob = counts[counts > 0] / counts.sum()
    return float(-(prob * np.log(prob)).sum())


def prepare_data(run_dir: Path, corpus_mb: float) -> dict:
    data_dir = run_dir / "data"
    if not (data_dir / "train" / "manifest.json").exists():
        files = stdlib_files(corpus_mb)
        print(f"demo: tokenising {len(files)} stdlib files (~{corpus_mb:g} MB) with a {DEMO_VOCAB}-token BPE "
              f"trained on them; {HELDOUT:.0%} held out", file=sys.stderr)
        tokenize(files, data_dir, train_bpe_vocab=DEMO_VOCAB, heldout=HELDOUT, text_unit="file", processes=2)
    out = {}
    for split in ("train", "heldout"):
        man = json.loads((data_dir / split / "manifest.json").read_text())
        out[split] = {"paths": [str(data_dir / split / f["path"]) for f in man["files"]], "dtype": man["dtype"],
                      "tokens": sum(f["tokens"] for f in man["files"])}
    return out


def run_demo(run_dir: str, overrides: list[str], corpus_mb: float = 12.0) -> int:
    run = Path(run_dir)
    run.mkdir(parents=True, exist_ok=True)
    data = prepare_data(run, corpus_mb)
    base = [f"data.paths={','.join(data['train']['paths'])}", f"data.dtype={data['train']['dtype']}",
            f"eval.heldout_paths={','.join(data['heldout']['paths'])}"]
    cfg = get_recipe("tiny", base + list(overrides))
    print(f"demo: {data['train']['tokens']:,} training tokens, {data['heldout']['tokens']:,} held-out tokens; "
          f"training {cfg.train.steps} steps of {cfg.train.global_batch_size} x {cfg.data.sequence_length} tokens",
          file=sys.stderr)
    train(cfg, run / "run")
    h_uni = unigram_entropy(data["train"]["paths"], data["train"]["dtype"], cfg.model.vocab_size)
    evals = [json.loads(l) for l in (run / "run" / "metrics.jsonl").read_text().splitlines()]
    evals = [e for e in evals if "eval/heldout/CE loss" in e]
    if not evals:
        print("demo: no held-out evaluation was logged", file=sys.stderr)
        return 1
    final = evals[-1]["eval/heldout/CE loss"]
    verdict = "below" if final < h_uni else "NOT below"
    print(f"demo: held-out CE loss {final:.3f} nats/token at step {evals[-1]['step']} vs unigram entropy "
          f"{h_uni:.3f} ({verdict}; ratio {final / h_uni:.2f}); run directory {run / 'run'}", file=sys.stderr)
    return 0 if final < h_uni else 1
