"""GPU check for one NVIDIA GPU (run through gpu_check.sh, which puts ``src`` on the path: olmax
is not installed on the lent machine). Everything goes to one JSON file, rewritten after each
section, so a run cut short still leaves what it measured.

Sections, in order (each timed; an exception is recorded in the JSON and the exit code is 1):

1. ``env``: Python, jax/jaxlib/optax/orbax/numpy/torch/transformers versions, backend, device.
2. ``matmul``: measured bf16 matmul rate (N x N x N, N = 8192), the denominator of the measured MFU.
3. ``bandwidth``: measured device copy bandwidth (bytes read + written by ``x + 1`` on 2 GiB),
   the roofline of the decode section.
4. ``parity``: a random tiny OLMo 3 built by transformers (sequence 512, longer than its window
   128), ``olmax.verify.parity.run_parity`` in bf16 through cuDNN attention against transformers'
   fp32 eager model: KL mean/max, top-1; and olmax fp32 (XLA's attention, float32 products)
   against the same reference (``float32``). Without torch/transformers installed at all, olmax
   fp32 (reference kernel) is the reference instead.
5. ``train``: 8 layers of the 7B (d 4096, 32 heads x 128, MLP 11008, window 4096 on 3 of 4
   layers), 8192 context, the full vocabulary, the production step (fp32 master weights and
   Adam, bf16 compute, cuDNN, scanned layers, chunked loss): step time, tokens/s, MFU against
   the measured matmul rate and against the datasheet's 989 TFLOP/s, peak memory; beside it XLA's
   view of the same compiled program: its memory analysis and its cost (FLOPs, bytes,
   ``optimal_seconds`` where the GPU compiler gives one; ``olmax.compile.train_step_cost``).
6. ``train_remat``: the same step under each ``--remat`` policy (default ``minimal,save_proj``, the
   two the 7B stage-1 sweep on v5p-128 ranked best), each against full remat: measured speed-up
   beside the one XLA's compiled FLOPs (and ``optimal_seconds``) predicted, and the memory.
7. ``decode``: the same 7B-width slice through olmax's KV-cache generation
   (``olmax.engine.Generator``: its prefill and decode step, the host loop that reads each
   token), greedy, prompts of 128 tokens, at batch 1 and 32: decode tokens/s, and the HBM
   roofline: bytes of the prepared weights one step reads / step time, against the measured copy
   bandwidth (and the same with the KV cache's bytes added); then the continuous engine
   (``olmax.engine.Engine``, the same prepared weights) at 1, 8 and 32 decode steps per host
   round trip (``chunk``): its decode step time, from a run of the new tokens less a run of one
   (prefill and admission), over the decode steps run, against the same roofline.
8. ``logprob_gap``: RL's rollout fidelity (``benchmarks/bench_logprob_gap.py``'s model and
   measure) on this device, fp32 and bf16, with the bf16 floors.
9. ``generate_peer``: the decode section's model and prompts through olmax and through
   transformers' ``generate`` on the same device (bf16 both; transformers' dynamic cache, and its
   static cache compiled by torch.compile while the deadline allows): decode step times, ratios.

``--rehearse``: the same code on the CPU at tiny shapes (4 layers x d 128, sequence 256), olmax
told it compiles for a GPU (``trace_as_gpu``), cuDNN replaced by the ``xla`` implementation of the
same ``jax.nn.dot_product_attention`` call; ``make rehearse-gpu`` runs it in a venv built like the
lent machine's image (``benchmarks/rehearse_gpu.sh``).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

import olmax  # noqa: F401  (first: keeps JAX off a TPU runtime that has no TPU)

DATASHEET_BF16_TFLOPS = 989.0  # H100/H200 SXM dense bf16

# The 7B-width slice: 8 layers (two scan groups of 3 sliding + 1 full) of OLMo 3 7B.
FULL = {"layers": 8, "seq_len": 8192, "train_batch": 2, "train_steps": 8, "matmul_n": 8192,
        "copy_bytes": 2 << 30, "parity_seq": 512, "prompt": 128, "new_tokens": 64, "decode_batches": (1, 32)}
# --rehearse: the same sections at shapes a 2-core CPU runs in seconds.
TINY = {"layers": 4, "seq_len": 256, "train_batch": 2, "train_steps": 3, "matmul_n": 256,
        "copy_bytes": 16 << 20, "parity_seq": 192, "prompt": 16, "new_tokens": 8, "decode_batches": (1, 4)}
TINY_MODEL = ["model.d_model=128", "model.n_heads=4", "model.n_kv_heads=4", "model.head_dim=32",
              "model.mlp_hidden=256", "model.vocab_size=1000", "model.padded_vocab_size=1024",
              "model.sliding_window=64", "model.logits_chunk=128",
              "data.eos_token_id=0", "data.pad_token_id=1"]


def timed(fn: Callable[[], Any], reps: int) -> float:
    """Mean seconds per call of ``fn`` over ``reps`` calls dispatched back to back (one warm-up
    call first, synchronised)."""
    jax.block_until_ready(fn())
    t = time.perf_counter()
    r = None
    for _ in range(reps):
        r = fn()
    jax.block_until_ready(r)
    return (time.perf_counter() - t) / reps


def version(pkg: str) -> str | None:
    try:
        from importlib.metadata import version as v
        return v(pkg)
    except Exception:
        return None


class Check:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.shape = TINY if args.rehearse else FULL
        self.attention = args.attention or ("xla" if args.rehearse else "cudnn")
        self.out: dict[str, Any] = {"rehearsal": args.rehearse, "errors": {}, "seconds": {}}
        self.t0 = time.perf_counter()

    def save(self) -> None:
        self.out["seconds"]["total"] = round(time.perf_counter() - self.t0, 2)
        os.makedirs(os.path.dirname(os.path.abspath(self.args.out)), exist_ok=True)
        with open(self.args.out, "w") as f:
            json.dump(self.out, f, indent=2)

    def section(self, name: str, fn: Callable[[], dict]) -> None:
        t = time.perf_counter()
        if t - self.t0 > self.args.deadline_s:  # leave the lease's time for a second try
            print(f"[gpu_check] {name}: skipped, past --deadline-s {self.args.deadline_s}", flush=True)
            self.out["errors"][name] = f"skipped: {t - self.t0:.0f} s gone, past --deadline-s {self.args.deadline_s}"
            return
        print(f"[gpu_check] {name} ...", flush=True)
        try:
            self.out[name] = fn()
        except Exception as e:  # recorded; the later sections still run
            traceback.print_exc()
            self.out["errors"][name] = f"{type(e).__name__}: {e}"
        self.out["seconds"][name] = round(time.perf_counter() - t, 2)
        print(f"[gpu_check] {name}: {self.out['seconds'][name]} s "
              f"{json.dumps(self.out.get(name), default=str) if name not in self.out['errors'] else 'FAILED'}",
              flush=True)
        gc.collect()
        self.save()

    # ----------------------------------------------------------------- sections

    def env(self) -> dict:
        d = jax.devices()[0]
        return {"python": platform.python_version(), "jax": jax.__version__, "jaxlib": version("jaxlib"),
                "jax_cuda_plugin": version("jax-cuda13-plugin") or version("jax-cuda12-plugin"),
                "backend": jax.default_backend(), "device": d.device_kind, "device_count": jax.device_count(),
                "packages": {p: version(p) for p in ("numpy", "optax", "orbax-checkpoint", "ml-dtypes", "torch",
                                                     "transformers", "safetensors", "tokenizers")},
                "olmax_from": os.path.dirname(olmax.__file__),
                "traced_for": "gpu" if self.args.rehearse else jax.default_backend(),
                "attention": self.attention}

    def matmul(self) -> dict:
        n = self.shape["matmul_n"]
        ka, kb = jax.random.split(jax.random.key(1))
        a = jax.random.normal(ka, (n, n), jnp.bfloat16)
        b = jax.random.normal(kb, (n, n), jnp.bfloat16)
        f = jax.jit(lambda x, y: x @ y)
        s = timed(lambda: f(a, b), 20)
        rate = 2 * n ** 3 / s
        self.matmul_flops = rate
        return {"n": n, "seconds": s, "tflops": rate / 1e12}

    def bandwidth(self) -> dict:
        nbytes = self.shape["copy_bytes"]
        x = jnp.zeros((nbytes // 4,), jnp.float32)
        f = jax.jit(lambda v: v + 1)
        s = timed(lambda: f(x), 20)
        bw = 2 * nbytes / s  # read and written
        self.copy_bw = bw
        return {"bytes": nbytes, "seconds": s, "gb_per_s": bw / 1e9, "counts": "bytes read + bytes written"}

    def parity(self) -> dict:
        if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
            return self._parity_olmax_only()
        import tempfile

        from olmax.compat.hf import random_hf_model
        from olmax.verify.parity import run_parity
        with tempfile.TemporaryDirectory() as d:
            hf_dir = random_hf_model(d + "/hf", vocab_size=1024, hidden_size=256, intermediate_size=512,
                                     num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                                     sliding_window=128 if not self.args.rehearse else 64,
                                     max_position_embeddings=1024, rms_norm_eps=1e-6, eos_token_id=0, pad_token_id=1)
            r = run_parity(hf_dir, dtype="bfloat16", attention_impl=self.attention,
                           seq_len=self.shape["parity_seq"], batch=2)
            # fp32 through XLA's attention ("auto" on a GPU in fp32), float32 products
            # (``olmax.model.dispatch.fp32_products``)
            r32 = run_parity(hf_dir, dtype="float32", attention_impl="xla", seq_len=self.shape["parity_seq"], batch=2)
        out = {k: r[k] for k in ("reference", "attention_impl", "dtype", "batch", "seq_len", "kl_mean", "kl_max",
                                 "top1_agreement", "top10_overlap", "max_abs_logit_diff", "first_divergent",
                                 "noise_floor_kl")}
        out["float32"] = {k: r32[k] for k in ("attention_impl", "kl_mean", "kl_max", "top1_agreement",
                                              "max_abs_logit_diff", "first_divergent")}
        return out

    def _parity_olmax_only(self) -> dict:
        from olmax.model.olmo3 import forward
        from olmax.model.params import init_params
        from olmax.recipes import get_recipe
        cfg = get_recipe("tiny").model
        params = init_params(cfg, jax.random.key(0))
        toks = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, self.shape["parity_seq"])),
                           jnp.int32)
        ref = jax.jit(lambda p, t: forward(p, t, replace(cfg, compute_dtype="float32",
                                                         attention_impl="reference")))(params, toks)
        got = jax.jit(lambda p, t: forward(p, t, replace(cfg, compute_dtype="bfloat16",
                                                         attention_impl=self.attention)))(params, toks)
        lp, lq = jax.nn.log_softmax(ref, -1), jax.nn.log_softmax(got, -1)
        kl = jnp.sum(jnp.exp(lp) * (lp - lq), -1)
        return {"reference": "olmax fp32, reference attention (torch/transformers not installed)",
                "attention_impl": self.attention, "dtype": "bfloat16", "kl_mean": float(kl.mean()),
                "kl_max": float(kl.max()), "top1_agreement": float((ref.argmax(-1) == got.argmax(-1)).mean())}

    def config(self, batch: int, remat: str | None = None):
        from olmax.recipes import get_recipe
        sets = [f"model.n_layers={self.shape['layers']}", f"model.attention_impl={self.attention}",
                f"data.sequence_length={self.shape['seq_len']}", f"train.global_batch_size={batch}",
                "train.max_micro_batch_size=null", "mesh.fsdp=-1"] + ([f"model.remat={remat}"] if remat else [])
        return get_recipe("olmo3_7b_stage1", sets + (TINY_MODEL if self.args.rehearse else []))

    def train(self) -> dict:
        """The recipe's remat (full): the row every earlier H200 run measured."""
        return self._train_one(None)

    def train_remat(self) -> dict:
        """The ``--remat`` policies (default: the two the v5p-128 sweep ranked best), each against
        the recipe's full remat measured by ``train`` (run in this process before it, or here)."""
        base = self.out.get("train") or self._train_one(None)
        rows = {}
        for remat in self.args.remat.split(","):
            try:
                rows[remat] = self._train_one(remat)
            except Exception as e:  # one policy's failure (out of memory at run time) keeps the others' rows
                traceback.print_exc()
                self.out["errors"][f"train_remat.{remat}"] = rows[remat] = f"{type(e).__name__}: {e}"[:2000]
                continue
            rows[remat]["against_full"] = against(rows[remat], base)
            print(f"[gpu_check] train_remat {remat}: {json.dumps(rows[remat], default=str)}", flush=True)
            gc.collect()
        return {"full": {k: base.get(k) for k in ("step_seconds_median", "mfu_vs_989_tflops", "compiled_gib",
                                                   "xla")}, "policies": rows}

    def _train_one(self, remat: str | None) -> dict:
        """The production step (fp32 master weights and Adam, bf16 compute, the attention kernel,
        scanned layers, chunked loss) under ``remat`` (None: the recipe's): measured step time and
        MFU beside XLA's view of the same compiled program, its memory (``memory_analysis``) and
        its cost (``olmax.compile.train_step_cost``: FLOPs, bytes, ``optimal_seconds`` where the
        GPU compiler gives one), so that the estimate's error is a figure of its own."""
        from olmax.checkpoint.state import abstract_train_state, shardings
        from olmax.compile import compiled_memory, cost_summary, train_step_cost
        from olmax.metrics.flops import device_peak_flops, flops_per_token
        from olmax.model.params import init_params
        from olmax.objectives.lm import jit_lm_step
        from olmax.optim import init_opt_state
        from olmax.sharding import make_mesh, plan_batch
        batch, steps = self.shape["train_batch"], self.shape["train_steps"]
        cfg = self.config(batch, remat)
        mesh = make_mesh(cfg.mesh)
        plan = plan_batch(batch, dict(mesh.shape), None)
        abstract = abstract_train_state(cfg, mesh)
        pshard, oshard = shardings(abstract["params"]), shardings(abstract["opt_state"])
        params = jax.jit(lambda k: init_params(cfg.model, k), out_shardings=pshard)(jax.random.key(0))
        opt = jax.jit(lambda p: init_opt_state(p, optim_cfg=cfg.optim), out_shardings=oshard)(params)
        L = cfg.data.sequence_length
        rng = np.random.default_rng(0)
        data = {"input_ids": jnp.asarray(rng.integers(0, cfg.model.vocab_size, (batch, L)), jnp.int32),
                "label_mask": jnp.ones((batch, L), bool)}
        peak_before = memory()["memory_peak_gib"]
        t0 = time.perf_counter()
        lowered = jit_lm_step(cfg, mesh, plan, pshard, oshard).lower(params, opt, data)
        mem = compiled_memory(lowered)
        if "oom" in mem:
            return {"remat": cfg.model.remat, "compiled_gib": {"need": mem["need"]}, "oom": mem["oom"]}
        step = mem["compiled"]
        params, opt, m = step(params, opt, data)
        jax.block_until_ready(m)
        first = time.perf_counter() - t0
        times = []
        for _ in range(steps):
            t = time.perf_counter()
            params, opt, m = step(params, opt, data)
            jax.block_until_ready(m)
            times.append(time.perf_counter() - t)
        dt = float(np.median(times))
        tps = batch * L / dt / jax.device_count()
        fl = flops_per_token(cfg.model, L)
        achieved = fl["total"] * tps
        kind = jax.devices()[0].device_kind
        ce = float(m["ce_loss"])
        del params, opt, m
        peak_after = memory()["memory_peak_gib"]
        t1 = time.perf_counter()
        xla = cost_summary(train_step_cost(cfg, mesh, lowered, plan.accum_steps),
                           batch * L * fl["total"] / jax.device_count(), device_peak_flops(kind))
        xla["seconds_to_cost"] = time.perf_counter() - t1
        xla["optimal_seconds_over_measured"] = xla["optimal_seconds"] / dt if xla["optimal_seconds"] else None
        # Attention runs in a fused kernel (cuDNN) whose FLOPs XLA's count may not hold.
        xla["attention_share_of_model_flops"] = fl["attention"] / fl["total"]
        return {"layers": cfg.model.n_layers, "d_model": cfg.model.d_model, "seq_len": L, "batch": batch,
                "attention": cfg.model.attention_impl, "remat": cfg.model.remat, "steps_timed": steps,
                "first_step_seconds": first, "step_seconds_median": dt, "step_seconds": times,
                "tokens_per_second": tps, "flops_per_token": fl["total"], "tflops_per_second": achieved / 1e12,
                "mfu_vs_measured_matmul": achieved / self.matmul_flops if getattr(self, "matmul_flops", None) else None,
                "mfu_vs_989_tflops": achieved / (DATASHEET_BF16_TFLOPS * 1e12),
                "olmax_peak_tflops_for_device": (device_peak_flops(kind) or 0) / 1e12 or None,
                "ce_loss_last": ce, "finite": bool(np.isfinite(ce)),
                "compiled_gib": {k: mem[k] for k in ("argument", "output", "alias", "temp", "need")},
                # The device's peak is the process's: it is this program's only where it rose here.
                "peak_rose_here": bool(peak_after and peak_before is not None and peak_after > peak_before),
                "xla": xla, **memory()}

    def decode(self) -> dict:
        from olmax.engine import Generator, Sampling, cache_length
        from olmax.model.decode import cache_bytes, step_weight_bytes
        from olmax.model.params import init_params
        cfg = self.config(1).model
        params = jax.jit(lambda k: init_params(cfg, k))(jax.random.key(0))
        gen = Generator(params, cfg, Sampling())
        del params
        # Every step reads these whole (the embedding only b rows), in the dtype prepare left them.
        parts = {k: jax.tree.leaves(v) for k, v in gen.weights.prepared.items() if k != "embed"}
        weight_bytes = step_weight_bytes(gen.weights.prepared)
        P, N = self.shape["prompt"], self.shape["new_tokens"]
        max_length = cache_length(P, N)
        rng = np.random.default_rng(0)
        res: dict[str, Any] = {"layers": cfg.n_layers, "d_model": cfg.d_model, "prompt": P, "new_tokens": N,
                               "max_length": max_length, "weight_bytes_per_step": weight_bytes,
                               "layers_scanned": sum(jax.tree.leaves(g)[0].shape[0]
                                                     for g in gen.weights.prepared["layers"]["groups"]),
                               "weight_bytes_by_part": {k: {"bytes": sum(x.nbytes for x in xs),
                                                            "dtypes": sorted({str(x.dtype) for x in xs})}
                                                        for k, xs in parts.items()},
                               "batches": {}}
        for b in self.shape["decode_batches"]:
            prompts = [list(map(int, rng.integers(2, cfg.vocab_size, P))) for _ in range(b)]
            t0 = time.perf_counter()
            gen.run(prompts, list(range(b)), b, P, max_length, 3, set(), None, None)  # compiles both programs
            compile_s = time.perf_counter() - t0
            stamps: list[float] = []
            t0 = time.perf_counter()
            outs = gen.run(prompts, list(range(b)), b, P, max_length, N, set(), None,
                           lambda i, tok: stamps.append(time.perf_counter()) if i == 0 else None)
            total = time.perf_counter() - t0
            gaps = np.diff(stamps)  # one per decode step (the first stamp is the prefill's token)
            step = float(np.median(gaps))
            cache = cache_bytes(cfg, b, max_length)
            bw = getattr(self, "copy_bw", None)
            res["batches"][str(b)] = {
                "warmup_seconds_incl_compile": compile_s, "prefill_seconds": stamps[0] - t0,
                "decode_step_seconds_median": step, "decode_tokens_per_second": b / step,
                "end_to_end_tokens_per_second": b * N / total, "tokens_generated": sum(len(o.token_ids) for o in outs),
                "cache_bytes": cache, "weight_gb_per_s": weight_bytes / step / 1e9,
                "weights_fraction_of_copy_bw": weight_bytes / step / bw if bw else None,
                "weights_plus_cache_fraction_of_copy_bw": (weight_bytes + cache) / step / bw if bw else None,
                "roofline_step_seconds": weight_bytes / bw if bw else None}
            res["batches"][str(b)]["continuous"] = self._continuous(gen.weights, cfg, prompts, max_length,
                                                                     weight_bytes, cache, bw)
        del gen
        return res

    def _continuous(self, weights: Any, cfg: Any, prompts: list[list[int]], max_length: int, weight_bytes: int,
                    cache: int, bw: float | None) -> dict:
        """The continuous engine on the decode section's prompts, per ``chunk``: the time of a
        decode step, round trips included, as (a run of the new tokens - a run of one token) /
        the decode steps the first ran, and its fraction of the copy-bandwidth roofline."""
        from olmax.engine import Engine, Request
        N, out = self.shape["new_tokens"], {}
        for chunk in (1, 8, 32):
            engine = Engine(None, cfg, slots=len(prompts), max_length=max_length, chunk=chunk, weights=weights,
                            prompt_len=len(prompts[0]))

            def run(n: int) -> float:
                reqs = [Request(p, max_new_tokens=n, index=i) for i, p in enumerate(prompts)]
                t0 = time.perf_counter()
                engine.run(reqs)
                return time.perf_counter() - t0

            run(3)  # compiles the engine's programs
            one = run(1)
            before = engine.stats.decode_steps
            whole = run(N)
            steps = engine.stats.decode_steps - before
            step = (whole - one) / steps
            out[str(chunk)] = {"decode_step_seconds": step, "decode_tokens_per_second": len(prompts) / step,
                               "decode_steps": steps, "seconds_new_tokens": whole, "seconds_one_token": one,
                               "weights_fraction_of_copy_bw": weight_bytes / step / bw if bw else None,
                               "weights_plus_cache_fraction_of_copy_bw": (weight_bytes + cache) / step / bw
                               if bw else None}
        return out

    def logprob_gap(self) -> dict:
        """RL's rollout fidelity on this device (``bench_logprob_gap.measure``: its d512 x 8 model,
        8 rows x 40 tokens sampled at temperature 1) in fp32 and bf16, and in fp32 again under
        ``jax.default_matmul_precision("float32")``: equal, since olmax computes float32 in float32
        (``olmax.model.dispatch.fp32_products``; JAX's default on a GPU is TF32, which gave 4.4e-3)."""
        from bench_logprob_gap import measure
        kw = dict(d=128, layers=2, rows=4, new=8, attention="xla") if self.args.rehearse else {}
        out = {"default_precision": measure(**kw)}
        with jax.default_matmul_precision("float32"):  # olmax's own choice for fp32 compute: the same
            out["float32_precision"] = measure(**kw, dtypes=("float32",))
        return out

    def generate_peer(self) -> dict:
        """olmax's KV-cache generation against transformers' ``generate`` on the same device and
        the same random model (the decode section's 7B-width slice, built by transformers, bf16 on
        both sides), greedy, the decode section's prompts and lengths. Per batch: each system's
        median decode step, read from the host as each token arrives (olmax's ``on_token``,
        transformers' streamer ``put``, which copies the token to the host), after a warm-up
        call; transformers with its default dynamic cache, and with ``cache_implementation=
        "static"`` (which ``generate`` compiles with torch.compile) while --deadline-s allows.
        ``identical_rows``: greedy rows both systems produced token for token (bf16 kernels
        differ, so a near-tie may flip a row; a sanity check, not parity)."""
        if importlib.util.find_spec("torch") is None or importlib.util.find_spec("transformers") is None:
            return {"skipped": "torch or transformers is not installed"}
        import tempfile

        import torch
        from transformers import Olmo3ForCausalLM
        from transformers.generation.streamers import BaseStreamer

        from olmax.checkpoint.load import load_params
        from olmax.compat.hf import olmax_to_hf_config, random_hf_model
        from olmax.engine import Generator, Sampling, cache_length
        dev = "cpu" if self.args.rehearse or not torch.cuda.is_available() else "cuda"
        sync = torch.cuda.synchronize if dev == "cuda" else (lambda: None)
        hf_cfg = olmax_to_hf_config(self.config(1), "bfloat16")
        P, N = self.shape["prompt"], self.shape["new_tokens"]
        max_length = cache_length(P, N)

        class Stamps(BaseStreamer):
            def __init__(self) -> None:
                self.t: list[float] = []

            def put(self, value: Any) -> None:  # the prompt first, then each new token (on the host)
                self.t.append(time.perf_counter())

            def end(self) -> None:
                pass

        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            random_hf_model(d, seed=0, dtype="bfloat16", **{k: v for k, v in hf_cfg.items()
                                                             if k not in ("architectures", "model_type", "dtype")})
            params, cfg = load_params(f"hf:{d}")
            m = replace(cfg.model, attention_impl=self.attention, remat="none")
            gen = Generator(jax.device_put(params), m, Sampling())
            del params
            hf = Olmo3ForCausalLM.from_pretrained(d, dtype=torch.bfloat16).to(dev).eval()
            build = time.perf_counter() - t0
        res: dict[str, Any] = {"layers": m.n_layers, "d_model": m.d_model, "vocab": m.vocab_size, "prompt": P,
                               "new_tokens": N, "dtype": "bfloat16", "torch": torch.__version__,
                               "hf_attention": hf.config._attn_implementation, "build_seconds": build, "batches": {}}
        rng = np.random.default_rng(1)

        def hf_run(ids: Any, n: int, **kw: Any) -> tuple[list[list[int]], list[float]]:
            st = Stamps()
            with torch.no_grad():
                out = hf.generate(input_ids=ids,  # noqa: F821 (``hf`` is deleted after its last use) attention_mask=torch.ones_like(ids), max_new_tokens=n,
                                  min_new_tokens=n, do_sample=False, pad_token_id=1, streamer=st, **kw)
            sync()
            return out[:, P:].tolist(), st.t

        for b in self.shape["decode_batches"]:
            prompts = [list(map(int, rng.integers(2, m.vocab_size, P))) for _ in range(b)]
            gen.run(prompts, list(range(b)), b, P, max_length, 3, set(), None, None)  # compiles
            stamps: list[float] = []
            outs = gen.run(prompts, list(range(b)), b, P, max_length, N, set(), None,
                           lambda i, tok: stamps.append(time.perf_counter()) if i == 0 else None)
            ox_step = float(np.median(np.diff(stamps)))
            ids = torch.tensor(prompts, device=dev)
            hf_run(ids, 3)  # warm-up
            toks, t = hf_run(ids, N)
            # t[0]: the prompt, t[1]: the prefill's token; from there on one stamp per decode step,
            # as olmax's stamps[0] is its prefill's token
            hf_step = float(np.median(np.diff(t[1:])))
            ox_toks = [o.token_ids for o in outs]
            row: dict[str, Any] = {
                "olmax_decode_step_seconds": ox_step, "olmax_tokens_per_second": b / ox_step,
                "transformers_decode_step_seconds": hf_step, "transformers_tokens_per_second": b / hf_step,
                "ratio_vs_transformers": hf_step / ox_step,
                "identical_rows": sum(a == c for a, c in zip(ox_toks, toks)),
                "first_token_agreement": float(np.mean([a[0] == c[0] for a, c in zip(ox_toks, toks)]))}
            if time.perf_counter() - self.t0 < self.args.deadline_s:
                try:
                    tc = time.perf_counter()
                    hf_run(ids, N, cache_implementation="static")  # compiles
                    row["transformers_static_compile_seconds"] = time.perf_counter() - tc
                    _, t = hf_run(ids, N, cache_implementation="static")
                    st_step = float(np.median(np.diff(t[1:])))
                    row.update(transformers_static_decode_step_seconds=st_step,
                               transformers_static_tokens_per_second=b / st_step,
                               ratio_vs_transformers_static=st_step / ox_step)
                except Exception as e:  # recorded; the dynamic-cache comparison stands
                    row["transformers_static_error"] = f"{type(e).__name__}: {e}"[:500]
            else:
                row["transformers_static_error"] = "skipped: past --deadline-s"
            res["batches"][str(b)] = row
            print(f"[gpu_check] generate_peer batch {b}: {json.dumps(row, default=str)}", flush=True)
        del gen, hf
        return res


def trace_as_gpu() -> None:
    """--rehearse: olmax picks a few code paths by the platform it compiles for (separate q/k/v
    and gate/up projections as einsums, decoding's layers under a scan, on TPU and GPU; joined
    2-D matmuls, unrolled decode layers on the CPU). Tell it "gpu" so the CPU rehearses the
    GPU's paths; only the kernel differs (``--attention``)."""
    from olmax.model import dispatch  # the one module that asks (every choice looks it up there)
    dispatch.target_platform = lambda: "gpu"


def memory() -> dict:
    stats = jax.devices()[0].memory_stats() or {}
    return {"memory_peak_gib": stats.get("peak_bytes_in_use", 0) / 2 ** 30 if stats else None,
            "memory_limit_gib": stats.get("bytes_limit", 0) / 2 ** 30 if stats else None}


def against(row: dict, full: dict) -> dict:
    """A remat policy's measured step against full remat's, beside what XLA predicted: the ratio
    of compiled FLOPs (as if compute-bound) and of ``optimal_seconds`` where both have one."""
    def ratio(a: Any, b: Any) -> float | None:
        return a / b if a and b else None
    fx, rx = full.get("xla") or {}, row.get("xla") or {}
    return {"measured_speedup": ratio(full.get("step_seconds_median"), row.get("step_seconds_median")),
            "speedup_by_compiled_flops": ratio(fx.get("flops_per_device"), rx.get("flops_per_device")),
            "speedup_by_optimal_seconds": ratio(fx.get("optimal_seconds"), rx.get("optimal_seconds")),
            "compiled_gib_more": (row["compiled_gib"]["need"] - full["compiled_gib"]["need"]
                                  if "compiled_gib" in row and "compiled_gib" in full else None)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rehearse", action="store_true", help="tiny shapes on the CPU, reference attention for cuDNN")
    ap.add_argument("--out", default="gpu_check.json")
    ap.add_argument("--only", default=None, help="comma-separated sections (default: all)")
    ap.add_argument("--deadline-s", type=float, default=330,
                    help="start no section after this many seconds (default 330: the whole check within 6 minutes)")
    ap.add_argument("--attention", default=None, choices=["cudnn", "xla", "reference", "blocked"],
                    help="the kernel (default: cudnn; with --rehearse, xla: the same jax.nn.dot_product_attention "
                         "call as cudnn, which the CPU lacks)")
    ap.add_argument("--remat", default="minimal,save_proj",
                    help="train_remat: the policies set against full remat (default: the two the 7B stage-1 "
                         "sweep on v5p-128 ranked best, in ascending memory so each one's peak is its own)")
    args = ap.parse_args()
    backend = jax.default_backend()
    if backend != ("cpu" if args.rehearse else "gpu"):
        print(f"gpu_check: JAX runs on {backend}, expected {'cpu (--rehearse)' if args.rehearse else 'gpu'}",
              file=sys.stderr)
        return 2
    if args.rehearse:
        # What jax, optax or numpy deprecate here is what a newer release (the image's) may have
        # removed: the rehearsal fails on a deprecation warning raised from olmax or this file.
        for mod in (r"olmax(\.|$)", r"__main__$"):
            warnings.filterwarnings("error", category=DeprecationWarning, module=mod)
        trace_as_gpu()
    c = Check(args)
    sections = ["env", "matmul", "bandwidth", "parity", "train", "train_remat", "decode", "logprob_gap",
                "generate_peer"]
    for name in args.only.split(",") if args.only else sections:
        c.section(name, getattr(c, name))
    c.out["memory_end"] = memory()
    c.save()
    print(json.dumps(c.out, indent=2, default=str), flush=True)
    print(f"[gpu_check] wrote {args.out}; "
          f"{'FAILED: ' + ', '.join(c.out['errors']) if c.out['errors'] else 'all sections ran'}",
          flush=True)
    return 1 if c.out["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
