"""The accelerator check: how olmax runs on one TPU or GPU chip (run through tpu_check.sh or
gpu_check.sh, which put ``src`` on the path: olmax is not installed on a lent machine). Everything
goes to one JSON file, rewritten after each section, so a run cut short still leaves what it
measured. The platform is JAX's backend (``--platform`` names the one a rehearsal traces).

Sections, in order (each timed; an exception is recorded in the JSON and the exit code is 1):

1. ``env``: Python, jax/jaxlib/optax/orbax/numpy/torch/transformers versions, backend, device.
2. ``matmul``: measured bf16 matmul rate (N x N x N, N = 8192), the denominator of the measured MFU.
3. ``bandwidth``: measured device copy bandwidth (bytes read + written by ``x + 1`` on 2 GiB),
   the roofline of the decode section.
4. ``parity``: on a GPU, a random tiny OLMo 3 built by transformers (sequence 512, longer than its
   window 128), ``olmax.verify.parity.run_parity`` in bf16 through cuDNN attention against
   transformers' fp32 eager model, and olmax fp32 against the same reference (``float32``). On a
   TPU (no torch there), the chip's kernel (splash) in bf16 and fp32 against olmax's fp32
   reference kernel under exact products, on plain, sliding-window and packed (document-masked)
   inputs: KL mean/max, top-1.
5. ``train``: the production step (fp32 master weights and Adam, bf16 compute, the chip's
   attention kernel, scanned layers, chunked loss) on each of the platform's training shapes
   (GPU: 8 layers of the 7B at 8192 tokens; TPU: ``TPU_SHAPES``, among them the 7B stage 1's
   tokens per chip per step), under every ``--remat`` policy that fits (compiled memory against
   the device's): step time, tokens/s, MFU against the measured matmul rate and against the
   datasheet, peak memory; beside it XLA's view of the same compiled program: its memory analysis
   and its cost (FLOPs, bytes, ``optimal_seconds`` where the compiler gives one). ``train.best``:
   the fastest policy per shape.
6. ``train_remat`` (GPU): the same step under each ``--remat`` policy against full remat:
   measured speed-up beside the one XLA's compiled FLOPs predicted (on a TPU the train section
   sweeps the policies itself).
7. ``profile`` (TPU): where the step's time goes on the 7B-width slice at its fastest policy: the
   forward, the gradient, the optimizer update, the attention kernel (forward and backward) and
   the LM head with the loss, each timed alone, against the time their FLOPs take at the measured
   matmul rate; and, where the runtime writes one, a trace's busiest operations.
8. ``decode``: the same 7B-width slice through olmax's KV-cache generation
   (``olmax.engine.Generator``: its prefill and decode step, the host loop that reads each
   token), greedy, prompts of 128 tokens, at batch 1 and 32: decode tokens/s, and the HBM
   roofline: bytes of the prepared weights one step reads / step time, against the measured copy
   bandwidth (and the same with the KV cache's bytes added); then the continuous engine
   (``olmax.engine.Engine``, the same prepared weights) at 1, 8 and 32 decode steps per host
   round trip (``chunk``): its decode step time, from a run of the new tokens less a run of one
   (prefill and admission), over the decode steps run, against the same roofline.
9. ``logprob_gap``: RL's rollout fidelity (``benchmarks/bench_logprob_gap.py``'s model and
   measure) on this device, fp32 and bf16, with the bf16 floors.
10. ``generate_peer`` (GPU): the decode section's model and prompts through olmax and through
   transformers' ``generate`` on the same device (bf16 both; transformers' dynamic cache, and its
   static cache compiled by torch.compile while the deadline allows): decode step times, ratios.

``peers`` (TPU, only with ``--only``): MaxText 0.2.5 beside olmax on the 7B-width slice, the same
shape and tokens per step (``benchmarks/tpu/maxtext_peer.py``: MaxText installed under $TMPDIR
from the VM's index and the carried ``.whl-maxtext/``, its trainer run once per ``--peer-remat``
policy for a dozen steps, each in a process of its own *before* this process opens the chip; its
printed step time and TFLOP/s), then olmax's step at ``--peer-olmax-remat`` (rows the ``train``
section measured in this run are reused): tokens/s, TFLOP/s and MFU of each, and olmax / MaxText
at each side's fastest policy and at full remat on both.

``--rehearse``: the same code on the CPU at tiny shapes (4 layers x d 128, sequence 256), olmax
told it compiles for the ``--platform`` (``trace_as``): for a GPU, cuDNN replaced by the ``xla``
implementation of the same ``jax.nn.dot_product_attention`` call; for a TPU, splash in Pallas's
interpret mode. ``make rehearse-gpu`` runs the GPU's in a venv built like the lent machine's
image (``benchmarks/rehearse_gpu.sh``); the unit tier rehearses the TPU's
(tests/test_chip_check.py).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import platform
import shutil
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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # paths in the JSON are relative to it

# Each platform's datasheet bf16 rate where the device's own kind is not in olmax's table
# (``olmax.metrics.flops``), and a rehearsal's stand-in for it.
DATASHEET_BF16_TFLOPS = {"gpu": 989.0, "tpu": 197.0}  # H100/H200 SXM dense bf16; TPU v5e

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

# The TPU's training shapes (one chip: the 7B does not fit, so slices of it and a smaller width).
# ``sets``: overrides of the olmo3_7b_stage1 recipe; ``batch`` sequences of ``seq_len`` a step.
SLICE_7B = ["model.n_layers=2", "model.vocab_size=32768", "model.padded_vocab_size=32768", "data.eos_token_id=0",
            "data.pad_token_id=1"]
TPU_SHAPES = {
    # The 7B's width (d 4096, 32 x 128 heads, MLP 11008), 2 layers, a 32k vocabulary, 8,192 tokens.
    "slice7b": {"sets": SLICE_7B, "seq_len": 4096, "batch": 2},
    # d 2048 (16 x 128 heads, MLP 8192), 4 layers, the full 100k vocabulary, 16,384 tokens.
    "d2048": {"sets": ["model.n_layers=4", "model.d_model=2048", "model.n_heads=16", "model.n_kv_heads=16",
                       "model.mlp_hidden=8192"], "seq_len": 4096, "batch": 4},
    # The slice at the 7B stage 1's tokens per chip per step on v5p-128 (512 x 8192 / 128 = 32,768)
    # and its sequence (8192: the sliding window of 4096 skips blocks).
    "stage1_per_chip": {"sets": SLICE_7B, "seq_len": 8192, "batch": 4},
}
TPU_TINY = {"tiny": {"sets": ["model.n_layers=2"], "seq_len": 128, "batch": 2}}
# The policies the TPU's train section tries per shape, in order (``policy@n``: micro-batches of n
# sequences; a row that does not fit the device is recorded as such and not run).
TPU_REMAT = "save_proj,minimal,none,save_proj_except_out,full,save_proj@2,minimal@2,none@2"


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
        self.platform = args.platform
        self.shape = TINY if args.rehearse else FULL
        default_kernel = {"gpu": "xla" if args.rehearse else "cudnn", "tpu": "splash"}[self.platform]
        self.attention = args.attention or default_kernel
        self.out: dict[str, Any] = {"rehearsal": args.rehearse, "platform": self.platform, "errors": {},
                                    "seconds": {}}
        self.t0 = time.perf_counter()

    def save(self) -> None:
        self.out["seconds"]["total"] = round(time.perf_counter() - self.t0, 2)
        os.makedirs(os.path.dirname(os.path.abspath(self.args.out)), exist_ok=True)
        with open(self.args.out, "w") as f:
            json.dump(self.out, f, indent=2)

    def section(self, name: str, fn: Callable[[], dict]) -> None:
        t = time.perf_counter()
        # leave the lease's time for a second try (MaxText's rows, run first, have a budget of their own)
        if t - self.t0 - self.out["seconds"].get("peers_maxtext", 0) > self.args.deadline_s:
            print(f"[chip_check] {name}: skipped, past --deadline-s {self.args.deadline_s}", flush=True)
            self.out["errors"][name] = f"skipped: {t - self.t0:.0f} s gone, past --deadline-s {self.args.deadline_s}"
            return
        print(f"[chip_check] {name} ...", flush=True)
        try:
            self.out[name] = fn()
        except Exception as e:  # recorded; the later sections still run
            traceback.print_exc()
            self.out["errors"][name] = f"{type(e).__name__}: {e}"
        self.out["seconds"][name] = round(time.perf_counter() - t, 2)
        print(f"[chip_check] {name}: {self.out['seconds'][name]} s "
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
                "olmax_from": os.path.relpath(os.path.dirname(olmax.__file__), ROOT),  # the tree it ran from
                "traced_for": self.platform, "datasheet_bf16_tflops": self.datasheet() / 1e12,
                "attention": self.attention}

    def datasheet(self) -> float:
        """The device's datasheet bf16 rate (olmax's table by device kind, else the platform's)."""
        from olmax.metrics.flops import device_peak_flops
        peak = None if self.args.rehearse else device_peak_flops(jax.devices()[0].device_kind)
        return peak or DATASHEET_BF16_TFLOPS[self.platform] * 1e12

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
        if self.platform == "tpu":
            return self._parity_kernel()
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

    def _parity_kernel(self) -> dict:
        """The chip's kernel (``self.attention``) in bf16 and fp32 against olmax's fp32 reference
        kernel under exact products (``olmax.model.dispatch.fp32_products``), on the 7B-width
        slice's layers (random weights, d 4096, 32 x 128 heads) at 2,048 tokens with a window of 512,
        plain and with packed documents (segment ids from EOS tokens): KL mean/max, top-1."""
        from olmax.model.loss import with_documents
        from olmax.model.olmo3 import forward
        from olmax.model.params import init_params
        seq = self.shape["parity_seq"] if self.args.rehearse else 2048
        cfg = self.config(2, shape=None if self.args.rehearse else TPU_SHAPES["slice7b"])
        m = replace(cfg.model, sliding_window=64 if self.args.rehearse else 512, remat="none")
        params = jax.jit(lambda k: init_params(m, k))(jax.random.key(0))
        rng = np.random.default_rng(0)
        toks = rng.integers(2, m.vocab_size, (2, seq))
        packed = toks.copy()
        packed[:, rng.integers(0, seq, 12)] = cfg.data.eos_token_id  # documents end at EOS
        out: dict[str, Any] = {"seq_len": seq, "window": m.sliding_window, "layers": m.n_layers,
                               "d_model": m.d_model, "kernel": self.attention}
        for case, t in (("plain", toks), ("packed", packed)):
            batch = {"input_ids": jnp.asarray(t, jnp.int32)}
            docs = {} if case == "plain" else {
                k: v for k, v in with_documents(batch, replace(cfg, data=replace(cfg.data, document_masking=True)))
                .items() if k in ("positions", "segment_ids")}
            logits = {}
            for name, dtype, impl in (("reference_fp32", "float32", "reference"),
                                      ("bfloat16", "bfloat16", self.attention), ("float32", "float32", self.attention)):
                mc = replace(m, compute_dtype=dtype, attention_impl=impl)
                logits[name] = jax.jit(lambda p, x, d, mc=mc: forward(p, x, mc, **d))(params, batch["input_ids"], docs)
            lp = jax.nn.log_softmax(logits.pop("reference_fp32").astype(jnp.float32), -1)
            for name, got in logits.items():
                lq = jax.nn.log_softmax(got.astype(jnp.float32), -1)
                kl = jnp.sum(jnp.exp(lp) * (lp - lq), -1)
                out[f"{case}.{name}"] = {"kl_mean": float(kl.mean()), "kl_max": float(kl.max()),
                                         "top1_agreement": float((lp.argmax(-1) == lq.argmax(-1)).mean())}
        return out

    def config(self, batch: int, remat: str | None = None, shape: dict | None = None):
        """The olmo3_7b_stage1 recipe at a training shape (default: the GPU's 7B slice) under
        ``remat`` (``policy@n``: micro-batches of n sequences; None: the recipe's own remat and
        micro-batches)."""
        from olmax.recipes import get_recipe
        spec, *extra = (remat or "").split("+")  # policy@n+key=value+...: a variant of the policy's row
        policy, _, micro = spec.partition("@")
        if shape is None:
            sets = [f"model.n_layers={self.shape['layers']}", f"data.sequence_length={self.shape['seq_len']}"]
        else:
            sets = [*shape["sets"], f"data.sequence_length={shape['seq_len']}"]
        sets += [f"model.attention_impl={self.attention}", f"train.global_batch_size={batch}", "mesh.fsdp=-1"]
        if remat is not None:
            if policy != "recipe":
                sets += [f"model.remat={policy}", f"train.max_micro_batch_size={micro or 'null'}"]
            sets += extra
        return get_recipe("olmo3_7b_stage1", sets + (TINY_MODEL if self.args.rehearse else []))

    def tpu_shapes(self) -> dict[str, dict]:
        if self.args.rehearse:
            return TPU_TINY
        names = self.args.shapes.split(",") if self.args.shapes else list(TPU_SHAPES)
        return {n: TPU_SHAPES[n] for n in names}

    def train(self) -> dict:
        """GPU: the recipe's remat (full), the row every earlier H200 run measured. TPU: every
        shape under every policy of ``--remat`` (default ``TPU_REMAT``), the recipe's own
        settings first; ``best``: the fastest row per shape that ran."""
        if self.platform != "tpu":
            return self._train_one(None)
        from olmax.sharding import plan_batch
        rows: dict[str, dict] = {}
        t0 = time.perf_counter()
        for name, shape in self.tpu_shapes().items():
            rows[name] = {}
            seen = set()
            for remat in ["recipe"] + (self.args.remat or TPU_REMAT).split(","):
                c = self.config(shape["batch"], None if remat == "recipe" else remat, shape)
                key = (c.model.remat, plan_batch(shape["batch"], {"data": 1}, c.train.micro_batch_size,
                                                 c.train.max_micro_batch_size).accum_steps, remat.partition("+")[2])
                if key in seen:  # the same program as a row already run (the recipe's own, one pass)
                    continue
                seen.add(key)
                if self.args.train_budget_s and time.perf_counter() - t0 > self.args.train_budget_s:
                    rows[name][remat] = {"skipped": f"past --train-budget-s {self.args.train_budget_s}"}
                    continue
                try:
                    row = self._train_one(None if remat == "recipe" else remat, shape)
                except Exception as e:  # one row's failure (out of memory at run time) keeps the others'
                    traceback.print_exc()
                    row = {"error": f"{type(e).__name__}: {e}"[:2000]}
                    self.out["errors"][f"train.{name}.{remat}"] = row["error"]
                rows[name][remat] = row
                brief = {k: row.get(k) for k in ("step_seconds_median", "mfu_vs_datasheet", "oom", "error")}
                print(f"[chip_check] train {name} {remat}: {json.dumps(brief, default=str)}", flush=True)
                gc.collect()
                self.out["train"] = {"shapes": rows}
                self.save()
        best = {}
        for name, by in rows.items():
            ran = {k: r for k, r in by.items() if r.get("step_seconds_median")}
            if ran:
                k = min(ran, key=lambda k: ran[k]["step_seconds_median"])
                best[name] = {"remat": k, "mfu_vs_datasheet": ran[k]["mfu_vs_datasheet"],
                              "over_recipe": (by["recipe"]["step_seconds_median"] / ran[k]["step_seconds_median"]
                                              if by.get("recipe", {}).get("step_seconds_median") else None)}
        return {"shapes": rows, "best": best}

    def peer_shape(self) -> tuple[str, dict]:
        return ("tiny", TPU_TINY["tiny"]) if self.args.rehearse else ("slice7b", TPU_SHAPES["slice7b"])

    def maxtext_first(self) -> None:
        """``peers``, MaxText's half: its trainer at the slice's shape under each ``--peer-remat``
        policy, each in a process of its own, run before this process opens the chip (one process
        at a time holds it); the JSON is written after each row. A rehearsal parses canned log
        lines instead."""
        from jax._src import xla_bridge
        mp = _maxtext_peer()
        name, shape = self.peer_shape()
        ms = mp.shape_of(self.config(shape["batch"], None, shape))
        policies = (self.args.peer_remat or mp.REMAT).split(",")
        peak = DATASHEET_BF16_TFLOPS["tpu"]  # the device's kind would open the chip here
        t = time.perf_counter()

        def keep(res: dict) -> None:
            self.out["peers"] = {"shape": name, "datasheet_bf16_tflops": peak, "maxtext": res}
            self.save()

        if self.args.rehearse:
            row = mp.summarize(mp.parse_maxtext_steps(mp.CANNED_LOG.splitlines()), ms["seq"] * ms["batch"], peak)
            keep({"version": mp.VERSION, "shape": ms, "tokens_per_step": ms["seq"] * ms["batch"],
                  "rehearsal": "MaxText not run: canned log lines parsed", "wheels": mp.check_wheels(),
                  "rows": {p: {"remat": p, "args": mp.train_args(ms, p, mp.STEPS, "OUT"), **row} for p in policies}})
        elif xla_bridge.backends_are_initialized():
            keep({"error": "this process opened the chip before MaxText ran"})
        else:
            mp.run_rows(ms, policies, peak, keep, budget_s=self.args.peer_budget_s)
        self.out["seconds"]["peers_maxtext"] = round(time.perf_counter() - t, 2)
        self.save()

    def peers(self) -> dict:
        """``peers``, olmax's half and the ratios: olmax's step at the same shape under each
        ``--peer-olmax-remat`` policy (``recipe``: the recipe's own, full remat), reusing the rows
        the ``train`` section measured in this run, XLA's cost left out; olmax / MaxText tokens/s
        at each side's fastest row and at full remat on both (``maxtext_peer.ratios``)."""
        mp = _maxtext_peer()
        res = dict(self.out.get("peers") or {})
        name, shape = self.peer_shape()
        measured = ((self.out.get("train") or {}).get("shapes") or {}).get(name, {})
        default = "recipe" if self.args.rehearse else "recipe,minimal,none,save_proj"
        rows = res.setdefault("olmax", {})
        no_cost, self.args.no_xla_cost = self.args.no_xla_cost, True
        try:
            for remat in (self.args.peer_olmax_remat or default).split(","):
                row = measured.get(remat) or {}
                reused = bool(row.get("step_seconds_median"))
                if not reused:
                    try:
                        row = self._train_one(None if remat == "recipe" else remat, shape)
                    except Exception as e:  # one row's failure keeps the others'
                        traceback.print_exc()
                        row = {"error": f"{type(e).__name__}: {e}"[:2000]}
                        self.out["errors"][f"peers.olmax.{remat}"] = row["error"]
                rows[remat] = {"reused_from_train": reused, **{k: row.get(k) for k in (
                    "remat", "micro_batches", "step_seconds_median", "tokens_per_second", "tflops_per_second",
                    "mfu_vs_datasheet", "ce_loss_last", "finite", "oom", "error")}}
                print(f"[chip_check] peers olmax {remat}: {json.dumps(rows[remat], default=str)}", flush=True)
                self.out["peers"] = res
                self.save()
                gc.collect()
        finally:
            self.args.no_xla_cost = no_cost
        res["ratios"] = mp.ratios(rows, (res.get("maxtext") or {}).get("rows") or {})
        return res

    def train_remat(self) -> dict:
        """The ``--remat`` policies (default: the two the v5p-128 sweep ranked best), each against
        the recipe's full remat measured by ``train`` (run in this process before it, or here)."""
        base = self.out.get("train") or self._train_one(None)
        rows = {}
        for remat in (self.args.remat or "minimal,save_proj").split(","):
            try:
                rows[remat] = self._train_one(remat)
            except Exception as e:  # one policy's failure (out of memory at run time) keeps the others' rows
                traceback.print_exc()
                self.out["errors"][f"train_remat.{remat}"] = rows[remat] = f"{type(e).__name__}: {e}"[:2000]
                continue
            rows[remat]["against_full"] = against(rows[remat], base)
            print(f"[chip_check] train_remat {remat}: {json.dumps(rows[remat], default=str)}", flush=True)
            gc.collect()
        return {"full": {k: base.get(k) for k in ("step_seconds_median", "mfu_vs_datasheet", "compiled_gib",
                                                   "xla")}, "policies": rows}

    def _train_one(self, remat: str | None, shape: dict | None = None) -> dict:
        """The production step (fp32 master weights and Adam, bf16 compute, the attention kernel,
        scanned layers, chunked loss) under ``remat`` (None: the recipe's), built, compiled, run
        and timed as ``olmax compile --sweep --measure`` times a candidate (``olmax.measure``):
        measured step time and MFU beside XLA's view of the same compiled program, its memory
        (``memory_analysis``) and its cost (``olmax.compile.step_estimate``: FLOPs, bytes,
        ``optimal_seconds`` where the compiler gives one, else the larger of FLOPs and bytes at the
        datasheet's rates), so that the estimate's error is a figure of its own. Out of memory (at
        compile or at run time): a row with ``oom``."""
        from olmax.compile import step_estimate
        from olmax.measure import device_rates, time_step, train_state
        from olmax.metrics.flops import device_peak_flops, flops_per_token
        batch = self.shape["train_batch"] if shape is None else shape["batch"]
        steps = self.shape["train_steps"]
        cfg = self.config(batch, remat, shape)
        state = train_state(cfg, batch)
        plan = state.plan
        L = cfg.data.sequence_length
        peak_before = memory()["memory_peak_gib"]
        run = time_step(cfg, state, steps)
        if "oom" in run:
            return {"remat": cfg.model.remat, "micro_batches": plan.accum_steps,
                    "compiled_gib": {"need": run["compiled_gib"]["need"]}, "oom": run["oom"], "oom_at": run["oom_at"]}
        dt, times = run["step_seconds_median"], run["step_seconds"]
        tps = batch * L / dt / jax.device_count()
        fl = flops_per_token(cfg.model, L)
        achieved = fl["total"] * tps
        kind = jax.devices()[0].device_kind
        ce = run["loss_last"]  # the LM objective's loss: the CE
        state.params = state.opt = None
        peak_after = memory()["memory_peak_gib"]
        xla: dict[str, Any] = {}
        if not self.args.no_xla_cost:
            if not hasattr(self, "rates"):
                self.rates = device_rates()
            xla = step_estimate(cfg, state, run, self.rates)
            xla["optimal_seconds_over_measured"] = xla["optimal_seconds"] / dt if xla["optimal_seconds"] else None
            # Attention runs in a fused kernel (cuDNN, splash) whose FLOPs XLA's count may not hold.
            xla["attention_share_of_model_flops"] = fl["attention"] / fl["total"]
        return {"layers": cfg.model.n_layers, "d_model": cfg.model.d_model, "vocab": cfg.model.embedding_rows,
                "seq_len": L, "batch": batch, "micro_batches": plan.accum_steps,
                "attention": cfg.model.attention_impl, "remat": cfg.model.remat, "steps_timed": steps,
                "first_step_seconds": run["first_step_seconds"], "step_seconds_median": dt, "step_seconds": times,
                "tokens_per_second": tps, "flops_per_token": fl["total"], "tflops_per_second": achieved / 1e12,
                "mfu_vs_measured_matmul": achieved / self.matmul_flops if getattr(self, "matmul_flops", None) else None,
                "mfu_vs_datasheet": achieved / self.datasheet(),
                "olmax_peak_tflops_for_device": (device_peak_flops(kind) or 0) / 1e12 or None,
                "ce_loss_last": ce, "finite": bool(np.isfinite(ce)),
                "compiled_gib": run["compiled_gib"],
                # The device's peak is the process's: it is this program's only where it rose here.
                "peak_rose_here": bool(peak_after and peak_before is not None and peak_after > peak_before),
                "xla": xla, **memory()}

    def profile(self) -> dict:
        """``_profile`` for each policy of ``--profile-remat`` (comma-separated)."""
        policies = (self.args.profile_remat or "").split(",") if self.args.profile_remat else [None]
        if len(policies) == 1:
            return self._profile(policies[0])
        return {"policies": {p: self._profile(p) for p in policies}}

    def _profile(self, policy: str | None) -> dict:
        """Where the step's time goes (TPU), on the 7B-width slice under ``--profile-remat``
        (default: the train section's fastest policy for it, else save_proj): the whole step, the
        gradient alone (no update), the forward alone, the optimizer update alone, the attention
        kernel's forward and backward for every layer, the LM head with the loss (forward and
        backward), and the matmuls' share at the measured matmul rate; then a trace of a few steps
        (``jax.profiler``), summarised as the operations that took the most device time."""
        from olmax.measure import train_state
        from olmax.metrics.flops import flops_per_token
        from olmax.model import dispatch
        from olmax.model.loss import head_loss
        from olmax.objectives.accumulate import optimizer_update
        from olmax.objectives.lm import jit_lm_step
        from olmax.sharding import activation_mesh
        shape = next(iter(self.tpu_shapes().values())) if self.args.rehearse else TPU_SHAPES["slice7b"]
        best = (self.out.get("train") or {}).get("best", {}).get("tiny" if self.args.rehearse else "slice7b", {})
        remat = policy or (best.get("remat") if best.get("remat") not in (None, "recipe") else "save_proj")
        batch, L = shape["batch"], shape["seq_len"]
        cfg = self.config(batch, remat, shape)
        m = cfg.model
        mesh, plan, pshard, oshard, params, opt, data = train_state(cfg, batch)
        reps = 3 if self.args.rehearse else 10
        res: dict[str, Any] = {"shape": {"layers": m.n_layers, "d_model": m.d_model, "vocab": m.embedding_rows,
                                         "seq_len": L, "batch": batch}, "remat": remat, "seconds": {}, "errors": {}}
        sec = res["seconds"]

        def part(name: str, fn: Callable[[], float]) -> None:  # one part's failure keeps the others'
            try:
                sec[name] = fn()
            except Exception as e:
                res["errors"][name] = f"{type(e).__name__}: {e}"[:500]
            gc.collect()

        # The whole step first (its state donated and carried), traced, then freed.
        step = jit_lm_step(cfg, mesh, plan, pshard, oshard)
        state = [params, opt]
        params = opt = None

        def one_step() -> Any:
            state[0], state[1], met = step(state[0], state[1], data)
            return met

        part("step", lambda: timed(one_step, reps))
        try:
            res["trace"] = self._trace(one_step)
        except Exception as e:  # the numbers below stand without a trace
            res["trace"] = {"error": f"{type(e).__name__}: {e}"[:500]}
        params = state[0]

        def loss(p, b):
            with activation_mesh(mesh):
                return head_loss(p, b, cfg)[0]

        part("forward", lambda: timed(lambda f=jax.jit(loss): f(params, data), reps))
        grad = jax.jit(jax.grad(loss))
        part("gradient", lambda: timed(lambda: grad(params, data), reps))

        def attention() -> float:  # the kernel alone, forward and backward, for each layer's window
            q = jax.random.normal(jax.random.key(1), (batch, L, m.n_heads, m.head_dim), jnp.bfloat16)
            kv = jax.random.normal(jax.random.key(2), (batch, L, m.n_kv_heads, m.head_dim), jnp.bfloat16)
            total = 0.0
            for layer in range(m.n_layers):
                w = m.layer_window(layer)
                f = jax.jit(jax.grad(lambda q, k, v, w=w: jnp.sum(dispatch.attend(q, k, v, w, m).astype(jnp.float32)),
                                     argnums=(0, 1, 2)))
                total += timed(lambda f=f: f(q, kv, kv), reps)
            return total

        part("attention_fwd_bwd_all_layers", attention)

        def head() -> float:  # the LM head with the loss, forward and backward
            x = jax.random.normal(jax.random.key(3), (batch, L, m.d_model), jnp.bfloat16)
            f = jax.jit(jax.grad(lambda h, x: _head_only(h, x, data, cfg), argnums=(0, 1)))
            return timed(lambda: f(params["lm_head"], x), reps)

        part("lm_head_and_loss_fwd_bwd", head)

        def update() -> float:  # params, moments and gradients alone, the old state donated
            grads = grad(params, data)
            upd = jax.jit(lambda p, g, o: optimizer_update(cfg)(p, g, o, jnp.float32(2.0))[:2], donate_argnums=(0, 2))
            st = [params, state[1]]  # the last user: donated

            def run() -> Any:
                st[0], st[1] = upd(st[0], grads, st[1])
                return st[0]
            return timed(run, reps)

        part("optimizer_update", update)
        params = state = None

        fl = flops_per_token(m, L)
        rate = getattr(self, "matmul_flops", None) or self.datasheet()
        tokens = batch * L
        res["at_matmul_rate_seconds"] = {
            "model_flops": fl["total"] * tokens / rate, "attention_flops": fl["attention"] * tokens / rate,
            "note": "6ND + attention at the measured matmul rate; full remat adds a forward's third"}
        if sec.get("step"):
            res["shares_of_step"] = {k: v / sec["step"] for k, v in sec.items() if k != "step"}
        return res

    def _trace(self, run: Callable[[], Any]) -> dict:
        """Three steps under ``jax.profiler.trace`` with a Perfetto trace; the operations that took
        the most device time, summed over the steps (names as the runtime reports them)."""
        import glob
        import gzip
        import tempfile
        # Beside the JSON (--out), else under $OUT: where a device call brings files back.
        d = os.path.dirname(os.path.abspath(self.args.out)) if self.args.out else os.environ.get("OUT")
        d = d or tempfile.mkdtemp()
        log_dir = os.path.join(d, "profile")
        jax.block_until_ready(run())
        with jax.profiler.trace(log_dir, create_perfetto_trace=True):
            for _ in range(3):
                r = run()
            jax.block_until_ready(r)
        files = glob.glob(os.path.join(log_dir, "**", "*.trace.json.gz"), recursive=True)
        if not files:
            return {"error": f"no Perfetto trace under {log_dir}", "files": glob.glob(log_dir + "/**", recursive=True)}
        with gzip.open(files[0]) as f:
            events = json.load(f)
        events = events.get("traceEvents", events) if isinstance(events, dict) else events
        names = {(e["pid"], e.get("tid")): e.get("args", {}).get("name", "") for e in events
                 if e.get("ph") == "M" and e.get("name") in ("process_name", "thread_name")}
        procs = {pid: n for (pid, tid), n in names.items() if tid is None}
        device = {pid for pid, n in procs.items() if "TPU" in n or "GPU" in n} or set(procs)  # a rehearsal: the host
        by_thread: dict[str, float] = {}
        by_op: dict[str, dict[str, float]] = {}
        # The device's operations (XLA Ops) by HLO category and by olmax source line, leaf
        # operations only: a loop's event holds its body's, which are counted themselves.
        by_category: dict[str, float] = {}
        by_source: dict[str, float] = {}
        sample: dict[str, Any] = {}
        for e in events:
            if e.get("ph") != "X" or e.get("pid") not in device or "dur" not in e:
                continue
            thread = names.get((e["pid"], e.get("tid")), str(e.get("tid")))
            s = e["dur"] / 1e6 / 3
            by_thread[thread] = by_thread.get(thread, 0.0) + s
            ops = by_op.setdefault(thread, {})
            ops[e["name"]] = ops.get(e["name"], 0.0) + s
            args = e.get("args") or {}
            keys = ("tf_op", "source", "hlo_category", "long_name")
            sample.setdefault(e["name"], {k: str(args[k]).replace(ROOT + os.sep, "")[:300] for k in keys if k in args})
            if thread == "XLA Ops" and not e["name"].startswith(("while", "conditional", "call")):
                category = str(args.get("hlo_category", "?"))
                by_category[category] = by_category.get(category, 0.0) + s
                source = str(args.get("source", "?")).replace(ROOT + os.sep, "")
                by_source[source] = by_source.get(source, 0.0) + s
        top = {t: dict(sorted(ops.items(), key=lambda kv: -kv[1])[:30]) for t, ops in by_op.items()}
        where = {name: sample.get(name) for ops in top.values() for name in ops}  # what each top op computes
        kept = os.path.join(d, "trace.json.gz")  # beside the JSON: the tree jax.profiler writes is deep
        shutil.copyfile(files[0], kept)
        return {"device_processes": sorted(procs[p] for p in device), "seconds_per_step_by_thread": by_thread,
                "seconds_per_step_by_op": top, "top_ops": where,
                "seconds_per_step_by_category": dict(sorted(by_category.items(), key=lambda kv: -kv[1])),
                "seconds_per_step_by_source": dict(sorted(by_source.items(), key=lambda kv: -kv[1])[:40]),
                "file": os.path.relpath(kept, d)}

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
            print(f"[chip_check] generate_peer batch {b}: {json.dumps(row, default=str)}", flush=True)
        del gen, hf
        return res


def _head_only(head: jax.Array, x: jax.Array, batch: dict, cfg: Any) -> jax.Array:
    """The LM head and the loss of hidden states ``x`` (the profile's share of the step)."""
    from olmax.model.loss import head_loss_of_hidden
    return head_loss_of_hidden(head, x, batch, cfg)[0]


def trace_as(target: str) -> None:
    """--rehearse: olmax picks a few code paths by the platform it compiles for (separate q/k/v
    and gate/up projections as einsums, decoding's layers under a scan, on TPU and GPU; joined
    2-D matmuls, unrolled decode layers on the CPU). Tell it ``target`` so the CPU rehearses that
    platform's paths; only the kernel differs (``--attention``; splash runs interpreted, as it
    follows the devices' platform)."""
    from olmax.model import dispatch  # the one module that asks (every choice looks it up there)
    dispatch.target_platform = lambda: target


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


def _maxtext_peer() -> Any:
    """benchmarks/tpu/maxtext_peer.py (imported by path: no package is named after it)."""
    here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tpu")
    if here not in sys.path:
        sys.path.insert(0, here)
    import maxtext_peer
    return maxtext_peer


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rehearse", action="store_true",
                    help="tiny shapes on the CPU, tracing --platform's program (GPU: xla attention for cuDNN; "
                         "TPU: splash interpreted)")
    ap.add_argument("--platform", choices=["gpu", "tpu"], default=None,
                    help="the platform checked (default: JAX's backend; with --rehearse, gpu)")
    ap.add_argument("--out", default="chip_check.json")
    ap.add_argument("--only", default=None, help="comma-separated sections (default: all)")
    ap.add_argument("--deadline-s", type=float, default=330,
                    help="start no section after this many seconds (default 330: the whole check within 6 minutes)")
    ap.add_argument("--attention", default=None, choices=["cudnn", "xla", "splash", "reference", "blocked"],
                    help="the kernel (default: cudnn on a GPU, splash on a TPU; a GPU rehearsal: xla, the same "
                         "jax.nn.dot_product_attention call as cudnn, which the CPU lacks)")
    ap.add_argument("--remat", default=None,
                    help="GPU train_remat: the policies set against full remat (default minimal,save_proj: the two "
                         "the 7B stage-1 sweep on v5p-128 ranked best, in ascending memory so each one's peak is "
                         f"its own); TPU train: the policies tried per shape (default {TPU_REMAT}; policy@n: "
                         "micro-batches of n sequences; policy+key=value: with a config override, e.g. "
                         "none+model.logits_chunk=4096, recipe+model.attention_block_q=1024)")
    ap.add_argument("--no-xla-cost", action="store_true",
                    help="train: skip XLA's cost of each compiled step (a second compile per row)")
    ap.add_argument("--train-budget-s", type=float, default=None,
                    help="TPU train: start no row after this many seconds of the section")
    ap.add_argument("--shapes", default=None, help=f"TPU train: the shapes (default: all of {','.join(TPU_SHAPES)})")
    ap.add_argument("--profile-remat", default=None,
                    help="TPU profile: the policy profiled (default: the train section's fastest on slice7b)")
    ap.add_argument("--peer-remat", default=None,
                    help="peers: MaxText's policies (default full,minimal,minimal_with_context; in this order while "
                         "--peer-budget-s allows)")
    ap.add_argument("--peer-olmax-remat", default=None,
                    help="peers: olmax's policies (default recipe,minimal,none,save_proj; recipe: full remat)")
    ap.add_argument("--peer-budget-s", type=float, default=300,
                    help="peers: start no MaxText run after this many seconds of its install and runs (default 300)")
    args = ap.parse_args()
    first = None
    if "peers" in (args.only or "").split(","):
        if args.platform != "tpu":
            ap.error("--only ...,peers: MaxText beside olmax on a TPU; give --platform tpu")
        first = Check(args)
        first.maxtext_first()  # before this process opens the chip
    backend = jax.default_backend()
    if args.platform is None:
        args.platform = "gpu" if args.rehearse or backend == "cpu" else backend
    if backend != ("cpu" if args.rehearse else args.platform):
        print(f"chip_check: JAX runs on {backend}, expected {'cpu (--rehearse)' if args.rehearse else args.platform}",
              file=sys.stderr)
        return 2
    if args.rehearse:
        # What jax, optax or numpy deprecate here is what a newer release (the image's) may have
        # removed: the rehearsal fails on a deprecation warning raised from olmax or this file.
        for mod in (r"olmax(\.|$)", r"__main__$"):
            warnings.filterwarnings("error", category=DeprecationWarning, module=mod)
        trace_as(args.platform)
    c = first or Check(args)
    sections = {"gpu": ["env", "matmul", "bandwidth", "parity", "train", "train_remat", "decode", "logprob_gap",
                        "generate_peer"],
                "tpu": ["env", "matmul", "bandwidth", "parity", "train", "profile", "decode", "logprob_gap"]
                }[args.platform]
    for name in args.only.split(",") if args.only else sections:
        c.section(name, getattr(c, name))
    c.out["memory_end"] = memory()
    c.save()
    print(json.dumps(c.out, indent=2, default=str), flush=True)
    print(f"[chip_check] wrote {args.out}; "
          f"{'FAILED: ' + ', '.join(c.out['errors']) if c.out['errors'] else 'all sections ran'}",
          flush=True)
    return 1 if c.out["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
