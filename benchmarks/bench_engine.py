"""Rollouts on OLMo 3 Think's length profile, scaled to the CPU: olmax's static engine against its
continuous-batching engine on the same model, prompts, seeds and lengths, in one run, and
transformers' own continuous batching (``generate_batch``, paged cache) on the same model.

Lengths: the Think RL recipe samples up to 32,768 tokens with a mean of 14,628 (0.45 of the cap;
Olmo 3 report). Here the cap is ``--cap`` tokens and each completion's length is drawn from a gamma
distribution (shape 2) scaled so that the mean of min(length, cap) is 0.45 x cap; the share that
reaches the cap (the truncated completions) follows from that and is printed (the report gives
the mean, not the truncated share: this profile's is about 8%). The lengths are forced by a stop
rule (a row stops when it holds its drawn length), so a random model's randomness does not matter.
Rows: ``--prompts`` prompts x ``--group`` completions each (GRPO's groups, prefilled once),
sampled at temperature 1.0, ``--slots`` rows decoded together.

Reported for each engine (the best of ``--repeats`` timed runs after one that compiles): rollout
wall time, decode steps, time per decode step (refills and prefills included), slot utilisation
(kept tokens / (decode steps x slots)); that both gave the same completions (token ids and
log-probs, to the bit); the ratios. transformers: ``generate_batch`` (transformers 5.x) on the
HF export of the same weights, ``do_sample``, temperature 1.0, the same prompts with ``--cap`` new
tokens (its rows cannot be stopped at drawn lengths, so the comparison is tokens per second).

    .venv/bin/python benchmarks/bench_engine.py [--slots 16] [--cap 128] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from bench_generate import HF

import olmax  # noqa: F401  (first: keeps JAX off a TPU runtime that has no TPU here)

MEAN_SHARE = 14628 / 32768   # OLMo 3 Think RL: mean response / cap


def think_lengths(n: int, cap: int, seed: int = 0) -> tuple[np.ndarray, float]:
    """``n`` completion lengths in 1..cap whose capped mean is 0.45 x cap, and the share at the cap."""
    rng = np.random.default_rng(seed)
    draws = rng.gamma(2.0, 1.0, size=200_000)
    lo, hi = 0.01, 10.0
    for _ in range(60):  # the scale whose capped mean is the profile's (bisection)
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if np.minimum(draws * mid * cap, cap).mean() < MEAN_SHARE * cap else (lo, mid)
    scale = (lo + hi) / 2
    lengths = np.clip(np.ceil(rng.gamma(2.0, scale * cap, size=n)), 1, cap).astype(int)
    return lengths, float((np.minimum(draws * scale * cap, cap) >= cap).mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--cap", type=int, default=128)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=None, help="decode steps per round trip (default: the engine's)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--transformers-prompts", type=int, default=16,
                    help="prompts given to transformers' generate_batch (0: skip it)")
    ap.add_argument("--rl-prompts", type=int, default=16, help="prompts per RL step (x --group rows)")
    ap.add_argument("--rl-steps", type=int, default=4,
                    help="RL steps of each configuration (static + padded, continuous + packed; 0: skip)")
    ap.add_argument("--no-rollouts", action="store_true", help="skip the static-vs-continuous rollouts")
    ap.add_argument("--json", metavar="FILE", help="also write the results here")
    args = ap.parse_args()
    olmax.keep_freed_memory()

    import jax

    from olmax.checkpoint.load import load_params
    from olmax.compat.hf import random_hf_model
    from olmax.engine import Sampling, decoder, generate
    from olmax.model.dispatch import round_trip_steps

    chunk = args.chunk or round_trip_steps()
    tmp = Path(tempfile.mkdtemp(prefix="bench_engine_"))
    random_hf_model(tmp / "hf", seed=0, **HF)
    params, cfg = load_params(f"hf:{tmp / 'hf'}")
    m = cfg.model
    rng = np.random.default_rng(1)
    prompts = [[int(t) for t in rng.integers(2, HF["vocab_size"], size=args.prompt_len)] for _ in range(args.prompts)]
    rows = [p for p in prompts for _ in range(args.group)]
    lengths, truncated = think_lengths(len(rows), args.cap)
    sampling = Sampling(temperature=1.0, seed=3)

    def stop(i: int, ids: list[int]) -> bool:
        return len(ids) >= lengths[i]

    results: dict = {"workload": {"rows": len(rows), "prompts": args.prompts, "group": args.group,
                                  "slots": args.slots, "cap": args.cap, "chunk": chunk,
                                  "mean_length": float(lengths.mean()), "mean_share": float(lengths.mean() / args.cap),
                                  "profile_truncated_share": truncated,
                                  "truncated_share": float((lengths >= args.cap).mean())},
                     "machine": {"platform": platform.platform(), "cpus": jax.device_count(),
                                 "jax": jax.__version__}}
    completions = {}
    for batching in () if args.no_rollouts else ("static", "continuous"):
        engine = decoder(params, m, batching, rows=args.slots)
        best = None
        for rep in range(args.repeats + 1):
            before = dict(vars(engine.stats))
            t0 = time.perf_counter()
            out = generate(params, m, rows, max_new_tokens=args.cap, sampling=sampling, batch_size=args.slots,
                           stop=stop, generator=engine, chunk=chunk)
            dt = time.perf_counter() - t0
            d = {k: v - before[k] for k, v in vars(engine.stats).items()}
            run = {"seconds": dt, "decode_steps": d["decode_steps"], "round_trips": d["round_trips"],
                   "slot_utilisation": d["decoded"] / d["slot_steps"],
                   "ms_per_decode_step": 1e3 * dt / d["decode_steps"],
                   "tokens": sum(len(c.token_ids) for c in out)}
            print(f"{batching:10s} run {rep}{' (compiles)' if rep == 0 else ''}: {dt:6.2f} s, "
                  f"{run['decode_steps']} decode steps, {run['ms_per_decode_step']:.2f} ms/step, slot utilisation "
                  f"{run['slot_utilisation']:.3f}", file=sys.stderr, flush=True)
            if rep and (best is None or dt < best["seconds"]):
                best = run
        completions[batching] = out
        results[batching] = best
    results["ratios"] = {}
    if not args.no_rollouts:
        s, c = results["static"], results["continuous"]
        st, co = completions["static"], completions["continuous"]
        results["identical"] = ([x.token_ids for x in st] == [x.token_ids for x in co]
                                and [x.logprobs for x in st] == [x.logprobs for x in co])
        results["ratios"] = {"rollout_speedup": s["seconds"] / c["seconds"],
                             "step_time_continuous_over_static": c["ms_per_decode_step"] / s["ms_per_decode_step"]}
    if args.rl_steps:
        results["rl"] = _rl(tmp, args, lengths)
    if args.transformers_prompts:
        results["transformers"] = _transformers(tmp / "hf", prompts[:args.transformers_prompts], args.cap)
        if not args.no_rollouts:
            results["ratios"]["tokens_per_s_over_transformers"] = (
                c["tokens"] / c["seconds"]) / results["transformers"]["tokens_per_s"]
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


RL_PROMPT = 32


def _rl(tmp: Path, args: argparse.Namespace, lengths: np.ndarray) -> dict:
    """GRPO steps on the same model and length profile: today's configuration (static rollouts,
    one completion per padded training row) against continuous rollouts with packed rows
    (``rl.pack_length`` = the longest prompt + completion, as AI2's 35,840 is for 2,048 + 32,768
    plus slack). Lengths are forced by the same stop rule, row by row."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    import olmax.engine as engine_pkg
    from olmax.recipes import get_recipe
    from olmax.train.loop import train

    rnd = random.Random(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "fast", "blue", "sky", "is", "and", "we", "see"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([" ".join(rnd.choices(words, k=rnd.randint(4, 12))) for _ in range(300)],
                            trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>", "<|pad|>"],
                                                show_progress=False,
                                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok.save(str(tmp / "tokenizer.json"))
    lines = [{"prompt": " ".join(rnd.choices(words, k=8)), "ground_truth": "e"} for _ in range(64)]
    (tmp / "prompts.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    rows = args.rl_prompts * args.group
    real = engine_pkg.generate

    def forced(*a, stop=None, **kw):  # every row stops at its drawn length (the randomness of a random model aside)
        return real(*a, stop=lambda i, ids: len(ids) >= lengths[i % len(lengths)], **kw)
    engine_pkg.generate = forced
    base = [f"train.init_from=hf:{tmp / 'hf'}", f"rl.tokenizer={tmp}", f"rl.prompts_path={tmp / 'prompts.jsonl'}",
            "rl.reward=operator:contains", f"rl.prompts_per_step={args.rl_prompts}", f"rl.group_size={args.group}",
            f"train.global_batch_size={rows}", f"rl.max_response_length={args.cap}",
            f"rl.max_prompt_length={RL_PROMPT}", f"data.sequence_length={RL_PROMPT + args.cap}",
            "rl.num_mini_batches=1", f"train.steps={args.rl_steps}", "checkpoint.interval=1000",
            # every group trains (a random model's rewards are often all equal, and a filtered group
            # would leave its rows out of the packed batch but in the padded one: no like for like)
            "rl.filter_zero_std=false",
            f"rl.generation_batch={args.slots}", "model.d_model=512", "model.n_layers=8", "model.n_heads=8",
            "model.n_kv_heads=8", "model.head_dim=64", "model.mlp_hidden=1536", "model.vocab_size=16384",
            "model.padded_vocab_size=16384", "model.sliding_window=128", "model.max_position_embeddings=1024",
            "model.norm_eps=1e-6", "model.param_dtype=float32", "model.compute_dtype=float32",
            "data.eos_token_id=0", "data.pad_token_id=1"]
    configs = {"static_padded": ["rl.batching=static", "rl.pack_length=null"],
               "continuous_packed": ["rl.batching=continuous", f"rl.pack_length={RL_PROMPT + args.cap}"]}
    out = {}
    try:
        for name, extra in configs.items():
            run = tmp / f"rl_{name}"
            train(get_recipe("tiny_rl", [*base, *extra]), run, progress=False)
            got = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()][1:]  # the first compiles
            step = [r["rl/time_generation_s"] + r["rl/time_training_s"] for r in got]
            out[name] = {"step_seconds_best": min(step), "step_seconds_mean": float(np.mean(step)),
                         "generation_seconds_mean": float(np.mean([r["rl/time_generation_s"] for r in got])),
                         "training_seconds_mean": float(np.mean([r["rl/time_training_s"] for r in got])),
                         "slot_utilisation": float(np.mean([r["rl/slot_utilisation"] for r in got])),
                         # over the steps' training tokens (rows of the same length in both configurations)
                         "padding_share": float(sum(r["rl/padding_share"] * r["rl/training_rows"] for r in got)
                                                / sum(r["rl/training_rows"] for r in got)),
                         "training_rows": [r["rl/training_rows"] for r in got],
                         "max_logprob_gap": max(r["rl/max_logprob_gap"] for r in got),
                         "loss": [r["rl/loss"] for r in got]}
            print(f"rl {name}: step {out[name]['step_seconds_mean']:.2f} s (generation "
                  f"{out[name]['generation_seconds_mean']:.2f}, training {out[name]['training_seconds_mean']:.2f}), "
                  f"padding share {out[name]['padding_share']:.3f}, slot utilisation "
                  f"{out[name]['slot_utilisation']:.3f}, gap {out[name]['max_logprob_gap']:.1e}", file=sys.stderr)
    finally:
        engine_pkg.generate = real
    out["step_speedup"] = out["static_padded"]["step_seconds_mean"] / out["continuous_packed"]["step_seconds_mean"]
    return out


def _transformers(hf: Path, prompts: list[list[int]], cap: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32, attn_implementation="sdpa")
    model.eval()
    cfg = GenerationConfig(max_new_tokens=cap, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                           eos_token_id=-1, pad_token_id=HF["pad_token_id"])
    with torch.no_grad():
        model.generate_batch(inputs=prompts[:2], generation_config=cfg, max_new_tokens=4)  # warm-up
        t0 = time.perf_counter()
        out = model.generate_batch(inputs=prompts, generation_config=cfg)
        dt = time.perf_counter() - t0
    tokens = sum(len(o.generated_tokens) for o in out.values())
    print(f"transformers generate_batch: {tokens} tokens for {len(prompts)} prompts in {dt:.2f} s", file=sys.stderr)
    return {"prompts": len(prompts), "tokens": tokens, "seconds": dt, "tokens_per_s": tokens / dt,
            "torch_threads": torch.get_num_threads()}


if __name__ == "__main__":
    main()
