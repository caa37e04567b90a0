"""``olmax verify olmo-core``: per-step training parity with AI2's PyTorch reference, OLMo-core.

One resolved olmax config drives both sides:

1. OLMo-core builds the same tiny OLMo 3 (``TransformerConfig.llama_like`` exactly as
   ``TransformerConfig.olmo3_7B`` parameterises it: reordered-norm blocks, QK-norm over the whole
   q/k projection, RoPE theta, SwiGLU, untied head, sliding-window pattern ``[W, W, W, -1]`` with
   the last layer forced to full attention), fp32 on CPU, initialised by OLMo-core's own
   ``init_weights`` from ``init_seed``.
2. OLMo-core's *initial* weights are exported to HF with OLMo-core's own ``save_hf_model``; olmax
   starts from them (``train.init_from=hf:DIR``).
3. Both train on the same token files: OLMo-core with its real ``Trainer`` and
   ``TransformerTrainModule`` (single-process gloo group), ``NumpyFSLDataset`` +
   ``NumpyDataLoader`` (its own data order), ``SkipStepAdamW`` with the OLMo 3 embedding
   ``weight_decay=0`` group override, ``CosWithWarmup``, z-loss and grad clipping as
   ``OLMo-3-1025-7B-pretrain-1.py`` sets them; olmax with ``olmax.train.loop.train``.
4. Per step: the global instance ids (OLMo-core: the batch's ``index`` field; olmax: the ids its
   training loop consumed, ``train.trace_instance_ids``), the lr, the pre-clip grad norm, the CE
   loss, the z-loss and the skip-step decision. The first step where one is out of tolerance is
   reported.

Target: identical ids and |delta CE| <= 1e-4 at every step. The parity recipe uses lr 1e-3 rather
than the tiny recipe's 3e-3: at 3e-3 two OLMo-core runs that differ only in the micro-batch split
(same maths, another summation order) already drift 1e-2 apart by step 35, so no implementation
could meet 1e-4 there; at 1e-3 that noise floor stays ~1e-6 over 100 steps.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from olmax import jsonout
from olmax.argtypes import positive_float, positive_int
from olmax.argtypes import seed as seed_flag
from olmax.config import Config, ConfigError
from olmax.eval.runs import metric_rows, read_metrics
from olmax.extras import require

CE_TOLERANCE = 1e-4            # |delta CE| <= 1e-4 at every step (absolute): the target above
# Relative tolerances of the other quantities. They catch what a short run's CE would hide (an lr
# 10% off moves the next CE by ~1e-5) and say which quantity moved first. Observed on the parity
# run (fp32, 100 steps): lr 1e-7 (fp32 vs OLMo-core's float64), grad norm 4e-5, z-loss 1e-5.
TOLERANCES = {"lr": 1e-5, "grad_norm": 1e-3, "z_loss": 1e-3}

# The parity model: the tiny recipe's structure, shrunk so 100 steps on both sides take well under
# two minutes on 2 CPU cores. The window (16) is shorter than the sequence (64), so the sliding
# layers really slide; 4 layers = 3 sliding + 1 full. The vocabulary is a multiple of 128, i.e.
# not padded (see ``_check_supported``). lr 1e-3: see the module docstring.
# The tiny OLMo 3 every training-parity check runs (here, ``verify.trl`` for DPO, ``verify.trl_grpo``).
PARITY_MODEL: tuple[str, ...] = (
    "model.vocab_size=512", "model.padded_vocab_size=512", "model.d_model=64", "model.n_layers=4",
    "model.n_heads=4", "model.n_kv_heads=4", "model.head_dim=16", "model.mlp_hidden=176",
    "model.sliding_window=16", "model.full_attention_every=4", "model.max_position_embeddings=4096",
    "model.param_dtype=float32", "model.compute_dtype=float32", "model.attention_impl=reference",
)
PARITY_OVERRIDES: tuple[str, ...] = (
    *PARITY_MODEL,
    "data.sequence_length=64", "data.dtype=uint16", "data.workers=0",
    "train.global_batch_size=8", "train.log_interval=1",
    "optim.lr=1e-3", "optim.schedule.name=cosine", "optim.schedule.warmup=20",
    "eval.heldout_paths=",
)

# The synthetic corpus: two files whose token counts leave a remainder (dropped per file, as
# OLMo-core does) and 300 instances of 64 tokens, i.e. 37 global batches of 8 per epoch with 4
# instances dropped: 100 steps cross two epoch boundaries (reshuffle with seed + epoch).
CORPUS_TOKENS = (11_000, 8_300)


# --------------------------------------------------------------------------- config


def parity_config(steps: int = 100, seed: int | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """The tiny recipe shrunk to the parity model, then the user's overrides. ``seed`` sets the data
    seed (order) and OLMo-core's init seed (``train.seed``); None keeps the recipe's."""
    from olmax.recipes import get_recipe
    extra = [f"train.steps={steps}"]
    if seed is not None:
        extra += [f"data.seed={seed}", f"train.seed={seed}"]
    cfg = get_recipe("tiny", [*PARITY_OVERRIDES, *extra, *overrides])
    # Checkpoints are not part of the comparison: save only the final one.
    cfg = replace(cfg, checkpoint=replace(cfg.checkpoint, interval=cfg.train.steps, async_save=False))
    _check_supported(cfg)
    return cfg


# SFT parity: OLMo-core's SFT recipe on the parity model. Packed documents with label
# masks and intra-document attention (``NumpyPackedFSLDataset``, ``generate_doc_lengths``), AdamW
# (0.9, 0.95) without weight decay or z-loss, clip 1.0, linear warmup then decay to 0
# (``LinearWithWarmup``, alpha_f 0), lr 1e-4: the SFT CE target of 1e-4 is stated at that learning rate.
SFT_OVERRIDES: tuple[str, ...] = (
    "data.packing=obfd", "data.long_doc_strategy=truncate", "data.document_masking=true",
    "optim.lr=1e-4", "optim.beta1=0.9", "optim.beta2=0.95", "optim.weight_decay=0.0", "optim.z_loss=null",
    "optim.max_grad_norm=1.0", "optim.schedule.name=linear", "optim.schedule.warmup=3",
    "optim.schedule.alpha_f=0.0", "train.loss_ranks=1",
)
SFT_DOCS = (700, 500)   # conversations per file: ~300 packed instances of 64 tokens


def _check_supported(cfg: Config) -> None:
    """Refuse settings this check cannot mirror in OLMo-core, naming the field."""
    m, d, o = cfg.model, cfg.data, cfg.optim
    bad = []
    if m.param_dtype != "float32" or m.compute_dtype not in ("float32", "bfloat16"):
        bad.append("model.param_dtype must be float32 and model.compute_dtype float32 or bfloat16 (OLMo-core keeps "
                   "fp32 parameters; bf16 compute is its FSDP mixed precision)")
    if m.padded_vocab_size not in (None, m.vocab_size):
        # save_hf_model keeps every embedding row and writes vocab_size = the padded count, which
        # olmax's init_from check rejects against a padded recipe; exporting only the real rows
        # (as AI2's release does) makes the importer invent the padded rows (their mean), which
        # are not OLMo-core's.
        bad.append("model.padded_vocab_size must equal model.vocab_size (a padded vocabulary cannot travel "
                   "through the HF export unchanged)")
    if m.rope_scaling is not None:
        bad.append("model.rope_scaling (YaRN) is not mirrored")
    sk = o.skip_step
    if sk.enabled and max(2, sk.min_history) != max(2, sk.window // 2):
        bad.append("optim.skip_step.min_history must be optim.skip_step.window // 2 (OLMo-core starts skipping "
                   "once half its rolling window is filled)")
    if sk.sigma_factor != int(sk.sigma_factor):
        bad.append("optim.skip_step.sigma_factor must be a whole number (OLMo-core's is an int)")
    if o.schedule.name not in ("cosine", "linear", "half_cosine", "constant"):
        bad.append(f"optim.schedule.name={o.schedule.name!r} is not mirrored (cosine, linear, half_cosine, constant)")
    if d.repetition_filter:
        bad.append("data.repetition_filter is not mirrored")
    if d.bos_token_id is not None:
        bad.append("data.bos_token_id must be null (OLMo 3 has no bos)")
    if cfg.eval.heldout_paths:
        bad.append("eval.heldout_paths must be empty")
    if bad:
        raise ConfigError("olmax verify olmo-core: " + "; ".join(bad))


# --------------------------------------------------------------------------- data


def write_corpus(out_dir: str | os.PathLike, cfg: Config, sizes: tuple[int, ...] = CORPUS_TOKENS) -> list[str]:
    """Raw token files (no header, OLMo-core layout) with learnable structure: documents are runs of
    an arithmetic progression mod the vocabulary (next token = f(previous two)), each ended by EOS.
    Fixed content (seed 0) whatever the run's seed."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    V, eos, pad = cfg.model.vocab_size, cfg.data.eos_token_id, cfg.data.pad_token_id
    first = max(eos, pad) + 1
    span = V - first
    rng = np.random.default_rng(0)
    paths = []
    for i, n in enumerate(sizes):
        toks = np.empty(n, dtype=np.int64)
        pos = 0
        while pos < n:
            length = int(rng.integers(8, 120))
            start, step = int(rng.integers(0, span)), int(rng.integers(1, 8))
            doc = first + (start + step * np.arange(length)) % span
            doc = np.append(doc, eos)[: n - pos]
            toks[pos:pos + len(doc)] = doc
            pos += len(doc)
        path = out / f"part-{i:02d}.npy"
        toks.astype(np.dtype(cfg.data.dtype).newbyteorder("<")).tofile(path)
        paths.append(str(path))
    return paths


def write_sft_corpus(out_dir: str | os.PathLike, cfg: Config, docs: tuple[int, ...] = SFT_DOCS
                     ) -> tuple[list[str], list[str]]:
    """Token files and label-mask files as ``olmax tokenize --chat`` writes them, with learnable
    structure: each document is a "prompt" (random tokens, masked) then a "response" that repeats
    the prompt's first tokens in an arithmetic progression (trained), then EOS (trained). Some
    documents are longer than the sequence and get truncated. Fixed content (seed 0)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    V, eos, pad, L = cfg.model.vocab_size, cfg.data.eos_token_id, cfg.data.pad_token_id, cfg.data.sequence_length
    first = max(eos, pad) + 1
    span = V - first
    rng = np.random.default_rng(0)
    toks_out, masks_out = [], []
    for i, n in enumerate(docs):
        toks, masks = [], []
        for _ in range(n):
            p = int(rng.integers(2, 16))
            r = int(rng.integers(2, L + 24 if rng.random() < 0.05 else 40))
            prompt = first + rng.integers(0, span, size=p)
            step = int(rng.integers(1, 5))
            resp = first + (int(prompt[0]) - first + step * np.arange(1, r + 1)) % span
            toks.append(np.concatenate([prompt, resp, [eos]]))
            masks.append(np.concatenate([np.zeros(p, bool), np.ones(r + 1, bool)]))
        t, m = out / f"token_ids_part_{i:04d}.npy", out / f"labels_mask_part_{i:04d}.npy"
        np.concatenate(toks).astype(np.dtype(cfg.data.dtype).newbyteorder("<")).tofile(t)
        np.concatenate(masks).tofile(m)
        toks_out.append(str(t))
        masks_out.append(str(m))
    return toks_out, masks_out


def corpus(out_dir: str | os.PathLike, cfg: Config) -> list[str]:
    """The token files of the check: the SFT corpus (label masks beside it) for a packed recipe."""
    return write_sft_corpus(out_dir, cfg)[0] if cfg.data.packing == "obfd" else write_corpus(out_dir, cfg)


def sft_masks(cfg: Config, paths: list[str]) -> list[str] | None:
    """The label-mask files ``write_sft_corpus`` wrote beside ``paths`` (None unless packed SFT)."""
    if cfg.data.packing != "obfd":
        return None
    return [str(Path(p).with_name(Path(p).name.replace("token_ids_part_", "labels_mask_part_"))) for p in paths]


class intra_document_masking:
    """OLMo-core's torch (CPU) attention backend refuses ``cu_doc_lens`` (only flash-attention
    varlen kernels take it). Within this context it accepts them: the mask it builds is its own
    causal / sliding-window mask AND same-document, given to torch SDPA as a boolean mask. RoPE
    positions per document are OLMo-core's own (``RotaryEmbedding`` with ``cu_doc_lens``)."""

    def __enter__(self):
        import torch
        import torch.nn.functional as F
        from olmo_core.nn.attention import backend as B
        self._cls, self._orig = B.TorchAttentionBackend, B.TorchAttentionBackend.forward
        orig = self._orig

        def forward(be, qkv, cu_doc_lens=None, cu_doc_lens_q=None, cu_doc_lens_k=None, max_doc_len=None,
                    max_doc_len_q=None, max_doc_len_k=None, local_k_slice=None, kv_cache_manager=None, sinks=None):
            if cu_doc_lens is None:
                return orig(be, qkv, cu_doc_lens_q=cu_doc_lens_q, cu_doc_lens_k=cu_doc_lens_k,
                            max_doc_len_q=max_doc_len_q, max_doc_len_k=max_doc_len_k, local_k_slice=local_k_slice,
                            kv_cache_manager=kv_cache_manager, sinks=sinks)
            if sinks is not None or kv_cache_manager is not None or be.cp_enabled:
                raise RuntimeError("intra_document_masking: sinks, KV caches and context parallelism are not mirrored")
            q, k, v = qkv
            b, t = q.shape[0], q.shape[1]
            flat = torch.arange(b * t, dtype=cu_doc_lens.dtype)
            doc = torch.bucketize(flat, cu_doc_lens[1:], right=True).view(b, t)
            same = doc[:, :, None] == doc[:, None, :]
            base = (be._get_sliding_window_mask(seq_len_q=t, seq_len_kv=t, device=q.device, window_size=be.window_size)
                    if be.window_size != (-1, -1) else torch.ones(t, t, dtype=torch.bool).tril())
            mask = (same & base[None]).unsqueeze(1)  # [b, 1, t, t]
            rep = be.n_heads // be.n_kv_heads
            k = k.repeat_interleave(rep, dim=2) if rep > 1 else k
            v = v.repeat_interleave(rep, dim=2) if rep > 1 else v
            att = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 attn_mask=mask, dropout_p=be.dropout_p, scale=be.scale)
            return att.transpose(1, 2).contiguous()

        B.TorchAttentionBackend.forward = forward
        return self

    def __exit__(self, *exc):
        self._cls.forward = self._orig


# --------------------------------------------------------------------------- records


@dataclass
class Trace:
    """Per-step values of one side, keyed by the 1-based step."""

    ce: dict[int, float] = field(default_factory=dict)
    grad_norm: dict[int, float] = field(default_factory=dict)
    lr: dict[int, float] = field(default_factory=dict)
    z_loss: dict[int, float] = field(default_factory=dict)
    skipped: dict[int, float] = field(default_factory=dict)
    ids: dict[int, list[int]] = field(default_factory=dict)
    seconds: float = 0.0
    starts: list[float] = field(default_factory=list)  # perf_counter at each step's start, then at the end


def _metric_series(trace: Trace) -> list[tuple[str, dict[int, float]]]:
    """Metric names (OLMo-core's, which olmax's metrics.jsonl uses too) and where they go."""
    return [("train/CE loss", trace.ce), ("optim/LR (group 0)", trace.lr), ("optim/total grad norm", trace.grad_norm),
            ("train/Z loss", trace.z_loss), ("optim/step skipped", trace.skipped)]


# --------------------------------------------------------------------------- OLMo-core


def _init_single_process_group(work: Path) -> None:
    import torch.distributed as dist
    if dist.is_initialized():
        if dist.get_world_size() != 1:
            raise RuntimeError("olmax verify olmo-core runs OLMo-core in one process; a larger process group exists")
        return
    store = work / "torch_dist_store"
    store.unlink(missing_ok=True)
    dist.init_process_group("gloo", init_method=f"file://{store}", world_size=1, rank=0)


def olmo_core_model_config(cfg: Config):
    """``TransformerConfig`` for ``cfg.model``, built the way ``TransformerConfig.olmo3_7B`` builds
    the 7B (``olmo2_7B`` -> ``llama2_7B`` -> ``llama_like`` with reordered norm, qk_norm, rope
    theta, eps, and the OLMo 3 sliding-window pattern), at the given sizes, fp32, torch SDPA."""
    from olmo_core.config import DType
    from olmo_core.nn.attention import AttentionBackendName, SlidingWindowAttentionConfig
    from olmo_core.nn.feed_forward import FeedForwardConfig
    from olmo_core.nn.transformer import TransformerBlockType, TransformerConfig

    m = cfg.model
    sliding = None
    if m.sliding_window is not None:
        k = m.full_attention_every
        # olmo3_7B: pattern [4096, 4096, 4096, -1], first layer not forced full, last layer forced full.
        sliding = SlidingWindowAttentionConfig(
            pattern=[m.sliding_window] * (k - 1) + [-1],
            force_full_attention_on_first_layer=False,
            force_full_attention_on_last_layer=m.full_attention_last_layer)
    return TransformerConfig.llama_like(
        d_model=m.d_model, vocab_size=m.embedding_rows, n_layers=m.n_layers, n_heads=m.n_heads,
        n_kv_heads=m.n_kv_heads, head_dim=m.head_dim,
        block_name=TransformerBlockType.reordered_norm, qk_norm=True, rope_theta=m.rope_theta,
        layer_norm_eps=m.norm_eps, sliding_window=sliding, attn_backend=AttentionBackendName.torch,
        feed_forward=FeedForwardConfig(hidden_size=m.mlp_hidden, bias=False, dtype=DType.float32),
        dtype=DType.float32, init_std=m.init_std, init_seed=cfg.train.seed,
    )


def _olmo_core_scheduler(cfg: Config):
    from olmo_core.optim import ConstantWithWarmup, CosWithWarmup, HalfCosWithWarmup, LinearWithWarmup
    s = cfg.optim.schedule
    if s.name == "cosine":
        return CosWithWarmup(warmup=s.warmup, alpha_f=s.alpha_f, t_max=s.t_max)
    if s.name == "half_cosine":
        return HalfCosWithWarmup(warmup=s.warmup, alpha_f=s.alpha_f, t_max=s.t_max)
    if s.name == "linear":
        if s.warmup_fraction is not None:  # AI2's SFT schedule
            return LinearWithWarmup(warmup_fraction=s.warmup_fraction, alpha_f=s.alpha_f, t_max=s.t_max)
        return LinearWithWarmup(warmup=s.warmup, alpha_f=s.alpha_f, t_max=s.t_max)
    return ConstantWithWarmup(warmup=s.warmup)


def _olmo_core_processes(cfg: Config, work: Path, world_size: int):
    """Set up torch.distributed for OLMo-core; the data-parallel config (None: one process in fp32).

    ``world_size`` > 1: this process must be one rank of an initialised group of that size; one
    process gets its own group (and torchrun's variables when the wrapper casts to bf16)."""
    import olmo_core.distributed.parallel as oc_parallel
    # One world mesh per process in OLMo-core; this process may train several runs one after another.
    oc_parallel._WORLD_MESH = None
    bf16 = cfg.model.compute_dtype == "bfloat16"
    if world_size == 1:
        _init_single_process_group(work)
        if bf16:  # the data-parallel wrapper is what casts to bf16; on one process it reads torchrun's layout
            for k, v in (("RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_RANK", "0"), ("LOCAL_WORLD_SIZE", "1")):
                os.environ.setdefault(k, v)
    else:
        import torch.distributed as dist
        if not dist.is_initialized() or dist.get_world_size() != world_size:
            raise RuntimeError(f"run_olmo_core(world_size={world_size}) needs an initialised process group of "
                               "that size")
    if not (world_size > 1 or bf16):
        return None
    from olmo_core.config import DType
    from olmo_core.distributed.parallel import DataParallelType
    from olmo_core.train.train_module import TransformerDataParallelConfig, TransformerDataParallelWrappingStrategy
    # OLMo-3-1025-7B-pretrain-1.py: HSDP, bf16 parameters in compute, fp32 gradient reduction.
    return TransformerDataParallelConfig(
        name=DataParallelType.hsdp, param_dtype=DType.bfloat16 if bf16 else None, reduce_dtype=DType.float32,
        wrapping_strategy=TransformerDataParallelWrappingStrategy.blocks)


def _olmo_core_train_module(cfg: Config, dp_config: Any, world_size: int):
    """The model (built on CPU, initialised by OLMo-core) in its train module, with OLMo 3's optimizer."""
    import torch
    from olmo_core.optim import OptimGroupOverride, SkipStepAdamWConfig
    from olmo_core.train.train_module import TransformerTrainModuleConfig

    o, tr, L = cfg.optim, cfg.train, cfg.data.sequence_length
    model = olmo_core_model_config(cfg).build(init_device="cpu")
    # Per rank, as olmax's micro_batch_size is per device.
    micro = (tr.micro_batch_size or tr.global_batch_size // world_size) * L
    return TransformerTrainModuleConfig(
        dp_config=dp_config,
        rank_microbatch_size=micro,
        max_sequence_length=L,
        # OLMo-3-1025-7B-pretrain-1.py: SkipStepAdamW, embeddings excluded from weight decay.
        optim=SkipStepAdamWConfig(
            lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay,
            rolling_interval_length=o.skip_step.window if o.skip_step.enabled else 10**9,
            sigma_factor=int(o.skip_step.sigma_factor),
            group_overrides=None if o.decay_embeddings else [
                OptimGroupOverride(params=["embeddings.weight"], opts={"weight_decay": 0.0})],
        ),
        scheduler=_olmo_core_scheduler(cfg),
        z_loss_multiplier=o.z_loss,
        max_grad_norm=o.max_grad_norm,
    ).build(model, device=torch.device("cpu"))


def _olmo_core_loader(cfg: Config, paths: list[str], work: Path, label_mask_paths: list[str] | None):
    """OLMo-core's dataset over ``paths`` (packed as its SFT scripts pack with ``packing: obfd``, else
    fixed-length instances) and its data loader."""
    from olmo_core.data import NumpyDataLoaderConfig, NumpyFSLDatasetConfig, TokenizerConfig
    from olmo_core.data.types import NumpyDatasetDType

    m, d, L = cfg.model, cfg.data, cfg.data.sequence_length
    tokenizer = TokenizerConfig(vocab_size=m.vocab_size, eos_token_id=d.eos_token_id, pad_token_id=d.pad_token_id,
                                bos_token_id=d.bos_token_id)
    masks = list(label_mask_paths) if label_mask_paths else sft_masks(cfg, list(paths))
    if d.packing == "obfd":  # OLMo-core's SFT data path (its SFT scripts)
        from olmo_core.data import NumpyPackedFSLDatasetConfig
        from olmo_core.data.types import LongDocStrategy
        dataset = NumpyPackedFSLDatasetConfig(
            paths=list(paths), sequence_length=L, tokenizer=tokenizer, dtype=NumpyDatasetDType(d.dtype),
            work_dir=str(work / "dataset"), label_mask_paths=masks, generate_doc_lengths=d.document_masking,
            long_doc_strategy=LongDocStrategy(d.long_doc_strategy)).build()
    else:
        dataset = NumpyFSLDatasetConfig(paths=list(paths), sequence_length=L, tokenizer=tokenizer,
                                        dtype=NumpyDatasetDType(d.dtype), work_dir=str(work / "dataset"),
                                        label_mask_paths=masks).build()
    return NumpyDataLoaderConfig(global_batch_size=cfg.train.global_batch_size * L, seed=d.seed, num_workers=0,
                                 num_threads=1, work_dir=str(work / "dataset")).build(dataset)


def _recorder(trace: Trace):
    """A trainer callback that records into ``trace`` each step's start time, batch ids and metrics."""
    from olmo_core.train.callbacks import Callback

    class Recorder(Callback):
        def pre_step(self, batch: dict[str, Any]) -> None:
            # The trainer increments global_step before pre_step: this is the 1-based step.
            trace.starts.append(time.perf_counter())
            trace.ids[self.step] = [int(i) for i in batch["index"].tolist()]

        def post_train(self) -> None:
            trace.starts.append(time.perf_counter())

        def log_metrics(self, step: int, metrics: dict[str, float]) -> None:
            for name, into in _metric_series(trace):
                if name in metrics:
                    into[step] = float(metrics[name])

    return Recorder()


def run_olmo_core(cfg: Config, paths: list[str], work: str | os.PathLike,
                  hf_dir: str | os.PathLike | None, world_size: int = 1, metrics_interval: int = 1,
                  label_mask_paths: list[str] | None = None) -> Trace:
    """Train ``cfg`` in OLMo-core on ``paths``; write its initial weights to ``hf_dir`` (HF format)
    before the first step (None: do not export). Returns the per-step trace; metrics are collected
    every ``metrics_interval`` steps (OLMo-core's own default is 5, which syncs less often).

    ``world_size`` > 1: this process is one rank of an initialised gloo group of that size, and the
    model is wrapped for data parallelism as ``OLMo-3-1025-7B-pretrain-1.py`` configures it (HSDP,
    block-wise wrapping, fp32 gradient reduction; fp32 parameters here). The trace's ids are this
    rank's share of each batch (columns ``rank::world_size``)."""
    import torch
    from olmo_core.nn.hf.checkpoint import save_hf_model
    from olmo_core.train import Duration, TrainerConfig
    from olmo_core.train.common import LoadStrategy

    work = Path(work)
    work.mkdir(parents=True, exist_ok=True)
    dp_config = _olmo_core_processes(cfg, work, world_size)
    t0 = time.perf_counter()
    train_module = _olmo_core_train_module(cfg, dp_config, world_size)

    # OLMo-core's initial weights (init_weights ran in parallelize_model), in HF format.
    if hf_dir is not None:
        # Every rank takes part (the full tensors are gathered); rank 0 writes.
        save_hf_model(hf_dir, train_module.model.state_dict(), train_module.model, save_overwrite=True)
        if world_size == 1 or torch.distributed.get_rank() == 0:
            _patch_hf_config(Path(hf_dir), cfg)
        if world_size > 1:
            torch.distributed.barrier()

    loader = _olmo_core_loader(cfg, paths, work, label_mask_paths)
    trace = Trace()
    trainer = TrainerConfig(
        save_folder=str(work / "trainer"), work_dir=str(work / "trainer"), save_overwrite=True,
        load_strategy=LoadStrategy.never, no_checkpoints=True, no_evals=True,
        max_duration=Duration.steps(cfg.train.steps), metrics_collect_interval=metrics_interval,
        cancel_check_interval=10**9, callbacks={"olmax_recorder": _recorder(trace)},
    ).build(train_module, loader)
    if cfg.data.document_masking:
        with intra_document_masking():
            trainer.fit()
    else:
        trainer.fit()
    trace.seconds = time.perf_counter() - t0
    return trace


def _patch_hf_config(hf_dir: Path, cfg: Config) -> None:
    """``get_hf_config`` writes ``max_position_embeddings: -1`` and no token ids; fill them in (they
    do not change the numbers; olmax's importer reads them)."""
    p = hf_dir / "config.json"
    c = json.loads(p.read_text())
    c["max_position_embeddings"] = cfg.model.max_position_embeddings
    c["eos_token_id"], c["pad_token_id"], c["bos_token_id"] = (
        cfg.data.eos_token_id, cfg.data.pad_token_id, cfg.data.bos_token_id)
    p.write_text(json.dumps(c, indent=2) + "\n")


# --------------------------------------------------------------------------- olmax


def run_olmax(cfg: Config, run_dir: str | os.PathLike) -> Trace:
    """Train ``cfg`` with ``olmax.train.loop.train``; per-step values from its ``metrics.jsonl``, the
    instance ids the loop consumed from its ``instance_ids.p0.jsonl`` (``train.trace_instance_ids``)."""
    from olmax.train.loop import train
    t0 = time.perf_counter()
    res = train(cfg.override(["train.trace_instance_ids=true"]), run_dir, progress=False)
    trace = Trace(seconds=time.perf_counter() - t0)
    for s, row in read_metrics(run_dir).items():
        for name, into in _metric_series(trace):
            if name in row:
                into[s] = float(row[name])
    for s, v in res.losses.items():  # the loop's own return value is the authority for the loss
        trace.ce[s] = float(v)
    # Not recorded by OLMo-core in these cases (train_module.train_batch / optim_step).
    if cfg.optim.z_loss is None:
        trace.z_loss = {}
    if cfg.optim.max_grad_norm is None:
        trace.grad_norm = {}
    # One process reads the whole global batch; the loop's step k (0-based) is update k + 1.
    trace.ids = {r["step"] + 1: r["instance_ids"] for r in metric_rows(Path(run_dir) / "instance_ids.p0.jsonl")}
    return trace


# --------------------------------------------------------------------------- comparison


def _rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), abs(b), 1e-30)


# The compared quantities, in the order they are checked at a step: a different batch explains
# everything after it; the lr and the grad norm are inputs of the update whose result the next
# step's loss shows; the skip decision follows from this step's loss and grad norm.
QUANTITIES = ("batch", "lr", "grad_norm", "loss", "z_loss", "step_skipped")


def _series(t: Trace, quantity: str) -> dict[int, Any]:
    return {"batch": t.ids, "lr": t.lr, "grad_norm": t.grad_norm, "loss": t.ce, "z_loss": t.z_loss,
            "step_skipped": t.skipped}[quantity]


def _agrees(quantity: str, a: Any, b: Any) -> bool:
    if quantity in ("batch", "step_skipped"):
        return a == b
    if not (math.isfinite(a) and math.isfinite(b)):
        return False
    if quantity == "loss":
        return abs(a - b) <= CE_TOLERANCE
    return _rel(a, b) <= TOLERANCES[quantity]


def compare(olmax: Trace, ref: Trace, steps: int) -> dict[str, Any]:
    """Per-step comparison of two traces over steps 1..``steps``.

    ``ok``: every quantity present on both sides and within its tolerance at every step (the parity
    target is the batch and CE part; the lr, grad norm, z-loss and skip decisions are checked too, so
    that a short run cannot hide a recipe difference). ``first_difference``: the first step where
    one is not, and which (in ``QUANTITIES`` order)."""
    # A quantity neither side records (z-loss without a multiplier, grad norm without clipping in
    # OLMo-core) is not compared.
    active = [q for q in QUANTITIES if _series(olmax, q) or _series(ref, q)]
    first = None
    for s in range(1, steps + 1):
        for q in active:
            a, b = _series(olmax, q).get(s), _series(ref, q).get(s)
            if a is None or b is None or not _agrees(q, a, b):
                first = {"step": s, "quantity": q, "olmax": a, "olmo_core": b}
                break
        if first is not None:
            break

    def max_diff(q: str, rel: bool = False) -> float | None:
        x, y = _series(olmax, q), _series(ref, q)
        d = [_rel(x[s], y[s]) if rel else abs(x[s] - y[s]) for s in range(1, steps + 1) if s in x and s in y]
        return max(d) if d else None

    same_ids = all(s in olmax.ids and olmax.ids[s] == ref.ids.get(s) for s in range(1, steps + 1))
    max_ce = max_diff("loss")
    ce_all = all(s in olmax.ce and s in ref.ce for s in range(1, steps + 1))
    return {
        "steps": steps,
        "ok": first is None,
        # The parity target alone (ids and CE); ``ok`` also requires the other quantities.
        "target_met": same_ids and ce_all and max_ce is not None and max_ce <= CE_TOLERANCE,
        "max_abs_ce_diff": max_ce,
        "max_abs_grad_norm_diff": max_diff("grad_norm"),
        "max_rel_grad_norm_diff": max_diff("grad_norm", rel=True),
        "max_abs_lr_diff": max_diff("lr"),
        "max_abs_z_loss_diff": max_diff("z_loss"),
        "batches_identical": same_ids,
        "steps_skipped": {"olmax": sorted(s for s, v in olmax.skipped.items() if v),
                          "olmo_core": sorted(s for s, v in ref.skipped.items() if v)},
        "first_difference": first,
        "tolerances": {"ce_abs": CE_TOLERANCE, **{f"{q}_rel": v for q, v in TOLERANCES.items()}},
        "ce": {"olmax": {"first": olmax.ce.get(1), "last": olmax.ce.get(steps)},
               "olmo_core": {"first": ref.ce.get(1), "last": ref.ce.get(steps)}},
    }


# --------------------------------------------------------------------------- driver


def run_parity(steps: int = 100, seed: int | None = None, overrides: list[str] | tuple[str, ...] = (),
               olmax_overrides: list[str] | tuple[str, ...] = (), out: str | os.PathLike | None = None,
               log: Any = sys.stderr, sft: bool = False) -> dict[str, Any]:
    """Build, export, train both sides and compare. ``overrides`` apply to both sides (the recipe);
    ``olmax_overrides`` to olmax only (to show the check catches a difference, or to bisect one).
    ``out`` keeps the token files, the HF export, both runs and ``report.json`` / ``steps.jsonl``;
    it must be new or empty (nothing is overwritten). None: a temporary folder, removed after."""
    require("verify", "torch", "olmo_core")  # before olmax's side trains
    if steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {steps}")
    cfg = parity_config(steps, seed, [*SFT_OVERRIDES, *overrides] if sft else overrides)
    return in_out_dir(out, "olmax-verify-olmo-core-", lambda d: _run(cfg, olmax_overrides, d, log))


def in_out_dir(out: str | os.PathLike | None, prefix: str, run: Any) -> Any:
    """``run(folder)`` with ``out`` as the folder (new or empty: nothing is overwritten), or a
    temporary one (``prefix``) removed after."""
    if out is None:
        with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
            return run(Path(tmp))
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"--out {out} exists and is not an empty folder; give a new one (nothing is overwritten)")
    out.mkdir(parents=True, exist_ok=True)
    return run(out)


def write_report(out: Path, report: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """``out/steps.jsonl`` (one row a step) and ``out/report.json``."""
    with open(out / "steps.jsonl", "w", encoding="utf-8") as f:
        for row in rows:
            f.write(jsonout.dumps(row) + "\n")
    (out / "report.json").write_text(jsonout.dumps(report, indent=2) + "\n")


def run_olmo_core_here(cfg: Config, paths: list[str], work: str | os.PathLike,
                       hf_dir: str | os.PathLike | None, label_mask_paths: list[str] | None = None) -> Trace:
    """``run_olmo_core`` in this process: one torch thread, a single-process gloo group created for
    the run (and destroyed after it, unless one existed before)."""
    import torch
    import torch.distributed as dist
    # One thread: on a shared 2-core machine torch's default OpenMP pool is ~10x slower at this size.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    created_pg = not dist.is_initialized()
    try:
        return run_olmo_core(cfg, paths, work, hf_dir, label_mask_paths=label_mask_paths)
    finally:
        torch.set_num_threads(threads)
        if created_pg and dist.is_initialized():
            dist.destroy_process_group()


def olmax_config(cfg: Config, out: Path, paths: list[str], hf_dir: str | os.PathLike,
                 olmax_overrides: list[str] | tuple[str, ...] = (),
                 label_mask_paths: list[str] | None = None) -> Config:
    """The olmax side of ``cfg``: OLMo-core's initial weights, the token (and label-mask) files, then
    ``olmax_overrides``."""
    from olmax.config import validate
    label_mask_paths = label_mask_paths or sft_masks(cfg, list(paths))
    masks = ["data.label_mask_paths=" + ",".join(label_mask_paths)] if label_mask_paths else []
    return validate(cfg.override([f"train.init_from=hf:{hf_dir}", "data.paths=" + ",".join(paths), *masks,
                                  f"data.cache_dir={out / 'olmax_order_cache'}", *olmax_overrides]))


def _say(log: Any, msg: str, tag: str = "verify olmo-core") -> None:
    if log is not None:
        print(f"[{tag}] {msg}", file=log, flush=True)


def _run(cfg: Config, olmax_overrides: list[str] | tuple[str, ...], out: Path, log: Any) -> dict[str, Any]:
    t0 = time.perf_counter()
    sft = cfg.data.packing == "obfd"
    paths = corpus(out / "tokens", cfg)
    hf_dir = out / "olmo_core_init_hf"
    _say(log, f"OLMo-core: {cfg.train.steps} steps of {cfg.train.global_batch_size} x "
              f"{cfg.data.sequence_length} tokens" + (" (SFT: packed documents, label masks, intra-document "
                                                      "attention)" if sft else ""))
    ref = run_olmo_core_here(cfg, paths, out / "olmo_core", hf_dir)
    _say(log, "olmax: same recipe, from OLMo-core's initial weights" +
         (f" (olmax-only overrides: {' '.join(olmax_overrides)})" if olmax_overrides else ""))
    mine = run_olmax(olmax_config(cfg, out, paths, hf_dir, olmax_overrides), out / "olmax_run")
    report = compare(mine, ref, cfg.train.steps)
    report["seconds"] = {"olmo_core": round(ref.seconds, 2), "olmax": round(mine.seconds, 2),
                         "total": round(time.perf_counter() - t0, 2)}
    report["olmax_overrides"] = list(olmax_overrides)
    report["model"] = {k: getattr(cfg.model, k) for k in ("vocab_size", "d_model", "n_layers", "n_heads",
                                                           "n_kv_heads", "head_dim", "mlp_hidden", "sliding_window")}
    report["sft"] = sft
    report["data"] = {"seed": cfg.data.seed, "sequence_length": cfg.data.sequence_length,
                      "global_batch_size": cfg.train.global_batch_size, "files": [Path(p).name for p in paths]}
    write_report(out, report, [{"step": s, **{q: [_series(mine, q).get(s), _series(ref, q).get(s)]
                                              for q in QUANTITIES}} for s in range(1, cfg.train.steps + 1)])
    return report



def trace_from_json(d: dict[str, Any]) -> Trace:
    """A trace from ``dataclasses.asdict`` JSON (how the noise-floor worker processes hand theirs back)."""
    t = Trace(seconds=float(d.get("seconds", 0.0)))
    for name in ("ce", "grad_norm", "lr", "z_loss", "skipped", "ids"):
        setattr(t, name, {int(k): v for k, v in d.get(name, {}).items()})
    return t


# --------------------------------------------------------------------------- command line


def register(subparsers: argparse._SubParsersAction, func: Any = None) -> None:
    """Add ``olmax verify olmo-core``; ``func`` (default ``_main``) runs it (``olmax.verify.commands``
    passes one that also handles ``--noise-floor``, which builds on this module)."""
    p = subparsers.add_parser(
        "olmo-core", help="per-step training parity with OLMo-core (the PyTorch reference)",
        description="Train the same tiny OLMo 3 in OLMo-core and in olmax from OLMo-core's initial weights, on "
                    "the same token files and recipe, and compare per step: global instance ids, CE loss "
                    f"(target |delta| <= {CE_TOLERANCE:g}), lr, pre-clip grad norm, z-loss and skip-step decisions. "
                    "Exit 1 when any differs beyond its tolerance, naming the first step and quantity.")
    p.add_argument("--steps", type=positive_int, default=100, help="training steps on each side (default 100)")
    p.add_argument("--sft", action="store_true",
                   help="OLMo-core's SFT recipe: chat-like documents with label masks, packed by OLMo-core's "
                        "NumpyPackedFSLDataset (best-fit decreasing) and by olmax, intra-document attention, "
                        "AdamW (0.9, 0.95) without weight decay or z-loss, linear schedule to 0, lr 1e-4")
    p.add_argument("--seed", type=seed_flag, default=None,
                   help="data seed and OLMo-core init seed (default: the recipe's)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override the recipe on both sides, e.g. --set optim.lr=1e-3 (repeatable)")
    p.add_argument("--olmax-set", dest="olmax_overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override olmax only (shows the check catching a difference; repeatable)")
    p.add_argument("--out", default=None, help="keep tokens, HF export, both runs, report.json and steps.jsonl here "
                                               "(a new or empty folder; default: a temporary one)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--noise-floor", action="store_true",
                   help="judge the gap against OLMo-core's own noise instead of the fixed 1e-4: also run OLMo-core "
                        "with the micro-batch split into 1/2, 1/4 and 1/8 and olmax with it split in two (same "
                        "maths, other summation orders); exit 1 unless the gap stays within --noise-factor of the "
                        "reference's smoothed self-gap at every step")
    p.add_argument("--ranks", type=positive_int, default=1,
                   help="with --noise-floor: OLMo-core on this many gloo processes (HSDP, as the official script "
                        "wraps it) and olmax on this many CPU devices (default 1)")
    p.add_argument("--plots", action="store_true",
                   help="with --noise-floor and --out: also run `olmax compare` on OLMo-core, olmax and OLMo-core's "
                        "micro-batch-split run (loss overlay, gap panel, milestones) into OUT/compare")
    p.add_argument("--noise-factor", type=positive_float, default=None,
                   help="with --noise-floor: the factor of the verdict (default: noise_floor.NOISE_FACTOR)")
    p.set_defaults(func=func or _main)


def _main(args: argparse.Namespace) -> int:
    if args.noise_floor:  # olmax.verify.commands dispatches it; this module does not build on noise_floor
        raise RuntimeError("--noise-floor is run by olmax.verify.commands (register this parser through it)")
    if args.noise_factor is not None or args.ranks != 1 or args.plots:
        raise ConfigError("--noise-factor, --ranks and --plots need --noise-floor")
    report = run_parity(args.steps, args.seed, args.overrides, args.olmax_overrides, args.out, sft=args.sft)
    if args.json:
        print(jsonout.dumps(report, indent=2))
    else:
        print(format_report(report))
    return 0 if report["ok"] else 1


def _g(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.3g}"


def format_report(r: dict[str, Any]) -> str:
    lines = [
        f"olmax vs OLMo-core, {r['steps']} steps: {'OK' if r['ok'] else 'MISMATCH'}",
        f"  max |delta CE|        {_g(r['max_abs_ce_diff'])}  (target <= {r['tolerances']['ce_abs']:g})",
        f"  max |delta grad norm| {_g(r['max_abs_grad_norm_diff'])}  (relative {_g(r['max_rel_grad_norm_diff'])})",
        f"  max |delta lr|        {_g(r['max_abs_lr_diff'])}",
        f"  max |delta z-loss|    {_g(r['max_abs_z_loss_diff'])}",
        f"  batches identical     {r['batches_identical']}",
        f"  steps skipped         olmax {r['steps_skipped']['olmax']}, OLMo-core {r['steps_skipped']['olmo_core']}",
        f"  CE first/last         olmax {_g(r['ce']['olmax']['first'])}/{_g(r['ce']['olmax']['last'])}, "
        f"OLMo-core {_g(r['ce']['olmo_core']['first'])}/{_g(r['ce']['olmo_core']['last'])}",
    ]
    fd = r["first_difference"]
    if fd is not None:
        lines.append(f"  first difference      step {fd['step']}, {fd['quantity']}: olmax {fd['olmax']}, "
                     f"OLMo-core {fd['olmo_core']}")
    s = r.get("seconds", {})
    if s:
        lines.append(f"  seconds               OLMo-core {s['olmo_core']}, olmax {s['olmax']}, total {s['total']}")
    return "\n".join(lines)
