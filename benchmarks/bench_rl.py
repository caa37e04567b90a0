"""RL step speed: the share of a GRPO step spent generating vs training, and olmax's sampling speed
inside RL against transformers' ``model.generate`` on the same model, same rows, same lengths, in
the same run.

Model: ``bench_generate``'s random OLMo 3 (d_model 512, 8 layers, 6 sliding with a 128-token
window, vocabulary 16,384, fp32), written as a HF directory and loaded by the RL run with
``train.init_from=hf:DIR`` (recipe ``tiny_rl`` with the model's shape). A small byte-level BPE
made here is the tokenizer. Each step: 4 prompts x 8 completions of up to 64 tokens at temperature
1.0 (a random model rarely samples EOS, so rows run to the length), reward ``operator:contains``
(the letter "e"; the rewards only need to vary), 2 mini-batches, one epoch.

Reported: per step, the generation time, the training time (log-probs + updates) and the share of
generation; olmax's generated tokens/s inside RL (rollout wall time: prefill, sampling,
detokenising, scoring, and the weights' reload) in the steps after the first (which compiles)
(the process keeps the memory it frees, as ``olmax train`` does: ``olmax.keep_freed_memory``)
against transformers' ``generate`` on the same 32 prompts (``do_sample=True``,
``temperature=1.0``, ``top_k=0``, 64 new tokens forced) in the same rows per call: the best of
olmax's steps against the best of as many transformers runs (``--repeats``, by default the steps
after the first), and the means. transformers runs in processes of its own, once with glibc's
allocator defaults and once keeping freed memory as olmax does; the ratio is against the faster
of the two (both printed). Twice: with all 32 completions in one batch (RL's default), and
in batches of 8 (``rl.generation_batch=8``; transformers in 4 calls of 8 rows), the batch size
``make bench-generate`` compares at. The step's log-prob gap is printed as well.

    .venv/bin/python benchmarks/bench_rl.py [--steps 4] [--repeats N] [--batches 32,8]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench_generate import HF

import olmax  # noqa: F401  (first: keeps JAX off a TPU runtime that has no TPU here)

WORDS = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "fast", "blue", "sky", "is", "and", "we", "see"]
PROMPTS, GROUP, NEW = 4, 8, 64


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=None, help="transformers runs per batch size (default: steps - 1)")
    ap.add_argument("--batches", default="32,8", help="rows per generation call, comma-separated")
    ap.add_argument("--transformers", metavar="DIR", help=argparse.SUPPRESS)  # the reference's own process
    ap.add_argument("--rows", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--allocator", choices=ALLOCATORS, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.transformers:
        return _transformers(Path(args.transformers), args.rows, args.repeats, args.allocator)
    if args.steps < 2:
        ap.error("--steps must be >= 2 (the first step compiles and is not counted)")
    repeats = args.repeats or args.steps - 1
    batches = [int(b) for b in args.batches.split(",")]
    # As `olmax train` runs RL: glibc keeps the memory it frees (``OLMAX_MALLOC=system`` keeps
    # glibc's defaults). transformers runs in processes of its own, with either allocator.
    olmax.keep_freed_memory()

    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from olmax.compat.hf import random_hf_model
    from olmax.recipes import get_recipe
    from olmax.train.loop import train

    tmp = Path(tempfile.mkdtemp(prefix="bench_rl_"))
    random_hf_model(tmp / "hf", seed=0, **HF)
    rnd = random.Random(0)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = [" ".join(rnd.choices(WORDS, k=rnd.randint(4, 12))) + "." for _ in range(300)]
    tok.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|pad|>"],
                                                        show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp / "tokenizer.json"))
    lines = [{"prompt": " ".join(rnd.choices(WORDS, k=8)), "ground_truth": "e"} for _ in range(64)]
    (tmp / "prompts.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))

    overrides = [
        f"train.init_from=hf:{tmp / 'hf'}", f"rl.tokenizer={tmp}", f"rl.prompts_path={tmp / 'prompts.jsonl'}",
        "rl.reward=operator:contains", f"rl.prompts_per_step={PROMPTS}", f"rl.group_size={GROUP}",
        f"train.global_batch_size={PROMPTS * GROUP}", f"rl.max_response_length={NEW}", "rl.max_prompt_length=64",
        "data.sequence_length=128", "rl.num_mini_batches=2", f"train.steps={args.steps}",
        "checkpoint.interval=1000", "model.d_model=512", "model.n_layers=8", "model.n_heads=8",
        "model.n_kv_heads=8", "model.head_dim=64", "model.mlp_hidden=1536", "model.vocab_size=16384",
        "model.padded_vocab_size=16384", "model.sliding_window=128", "model.max_position_embeddings=1024",
        "model.norm_eps=1e-6", "model.param_dtype=float32", "model.compute_dtype=float32", "data.eos_token_id=0",
        "data.pad_token_id=1"]
    print(f"[rl] random OLMo 3 d_model 512 x 8 layers, fp32; {PROMPTS} prompts x {GROUP} completions of {NEW} "
          f"tokens, 2 mini-batches; torch {torch.__version__} ({torch.get_num_threads()} threads)", flush=True)
    # the same rows, left-padded (transformers' batch generation), prompts masked where padded
    enc = [tok.encode(x["prompt"]).ids for x in lines[:PROMPTS] for _ in range(GROUP)]
    width = max(map(len, enc))
    torch.save({"ids": torch.tensor([[1] * (width - len(e)) + e for e in enc]),
                "mask": torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in enc])}, tmp / "rows.pt")

    summary = []
    for batch in batches:
        run = tmp / f"run_{batch}"
        print(f"\n  {batch} rows per generation call (rl.generation_batch={batch})", flush=True)
        train(get_recipe("tiny_rl", [*overrides, f"rl.generation_batch={batch}"]), run, progress=False)
        rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        for r in rows:
            print(f"  step {r['step']}: generation {r['rl/time_generation_s']:6.2f} s  training "
                  f"{r['rl/time_training_s']:6.2f} s  generation share {r['rl/generation_share']:.1%}  "
                  f"{r['rl/generation_tokens_per_sec']:7.1f} tok/s  max log-prob gap {r['rl/max_logprob_gap']:.1e}",
                  flush=True)
        warm = rows[1:]
        ox_best = max(r["rl/tokens_generated"] / r["rl/time_generation_s"] for r in warm)
        ox_mean = sum(r["rl/tokens_generated"] for r in warm) / sum(r["rl/time_generation_s"] for r in warm)
        share = sum(r["rl/time_generation_s"] for r in warm) / sum(
            r["rl/time_generation_s"] + r["rl/time_training_s"] for r in warm)

        hf = {a: _reference(tmp, batch, repeats, a) for a in ALLOCATORS}
        alloc = max(ALLOCATORS, key=lambda a: hf[a][0])        # the faster transformers, by its best run
        hf_best, hf_mean = hf[alloc]
        print(f"  olmax inside RL (steps 2..{args.steps}): best {ox_best:7.1f}, mean {ox_mean:7.1f} generated tok/s; "
              f"generation {share:.1%} of the step\n  transformers generate ({batch} rows per call, {NEW} new tokens, "
              f"sampled, {repeats} runs each): " + ", ".join(f"{a} allocator best {b:7.1f}, mean {m:7.1f}"
                                                             for a, (b, m) in hf.items()) + " tok/s\n"
              f"  ratio olmax / transformers ({alloc}): {ox_best / hf_best:.2f}x (best), {ox_mean / hf_mean:.2f}x "
              f"(means)", flush=True)
        summary.append(f"{batch} rows: {ox_best / hf_best:.2f}x (best), {ox_mean / hf_mean:.2f}x (means)")
    print("\n  ratios (olmax / transformers, generated tokens/s): " + "; ".join(summary))


ALLOCATORS = ("glibc", "kept")


def _reference(tmp: Path, rows: int, repeats: int, allocator: str) -> tuple[float, float]:
    """transformers' best and mean tokens/s, in a process of its own with ``allocator``: glibc's
    defaults, or the memory kept as ``olmax.keep_freed_memory`` keeps it (set before torch runs)."""
    cmd = [sys.executable, __file__, "--transformers", str(tmp), "--rows", str(rows), "--repeats", str(repeats),
           "--allocator", allocator]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OLMAX_MALLOC": ""})
    if done.returncode != 0:
        raise SystemExit(f"the transformers run failed: {done.stderr.strip()[-2000:]}")
    got = json.loads(done.stdout.strip().splitlines()[-1])
    return got["best"], got["mean"]


def _transformers(tmp: Path, rows: int, repeats: int, allocator: str) -> None:
    if allocator == "kept":
        olmax.keep_freed_memory()
    import torch
    from transformers import Olmo3ForCausalLM

    hf = Olmo3ForCausalLM.from_pretrained(tmp / "hf", torch_dtype=torch.float32).eval()
    data = torch.load(tmp / "rows.pt")
    ids, mask = data["ids"], data["mask"]

    def ref() -> None:
        with torch.no_grad():
            for i in range(0, len(ids), rows):
                hf.generate(input_ids=ids[i:i + rows], attention_mask=mask[i:i + rows], max_new_tokens=NEW,
                            min_new_tokens=NEW, do_sample=True, temperature=1.0, top_k=0, pad_token_id=1)

    ref()  # warm-up
    times = [_seconds(ref) for _ in range(repeats)]
    tokens = len(ids) * NEW
    print(json.dumps({"best": tokens / min(times), "mean": tokens * len(times) / sum(times)}))


def _seconds(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


if __name__ == "__main__":
    main()
