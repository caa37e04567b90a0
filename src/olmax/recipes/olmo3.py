"""OLMo 3 recipes, as AI2 ran them in OLMo-core.

Sources (allenai/OLMo-core, ``src/scripts/official/OLMo3/``):
- ``OLMo-3-1025-7B-pretrain-1.py`` / ``-pretrain-2.py``: stage 1.
- ``OLMo-3-1025-7B-midtrain.py``: stage 2 (anneal).
- ``olmo_core.nn.transformer.config.TransformerConfig.olmo3_7B`` / ``olmo3_32B``: the models.
"""

from __future__ import annotations

import math
from dataclasses import replace

from olmax.config import (
    CheckpointConfig,
    Config,
    DataConfig,
    EvalConfig,
    ModelConfig,
    OptimConfig,
    RopeScaling,
    ScheduleConfig,
    TrainConfig,
)

SEQ_LEN = 8192                      # pretrain scripts: sequence_length = 8192
STAGE1_BATCH = 512                  # global_batch_size = 512 * 8192 tokens
STAGE1_TOKENS_PER_STEP = STAGE1_BATCH * SEQ_LEN  # 4,194,304
# Part 1: CosWithWarmup over the 5T-token horizon (ceil(5e12 / 4194304) steps).
STAGE1_T_MAX_1 = math.ceil(5e12 / STAGE1_TOKENS_PER_STEP)           # 1,192,093
# Part 2: HalfCosWithWarmup whose "warmup" is the point where part 1 stopped.
STAGE1_SWITCH = 1192092 // 2 + 2000 // 2                            # 597,046
STAGE1_T_MAX_2 = math.ceil(7e12 / STAGE1_TOKENS_PER_STEP)           # 1,668,931
# Stage 1 ended at the end of the epoch of the 6T mix.
STAGE1_STEPS = 1_413_814
# Largest micro-batch per device (instances of 8192 tokens); memory only, the step is the same.
MAX_MICRO_BATCH = 4


def olmo3_7b_model() -> ModelConfig:
    # TransformerConfig.olmo3_7B: d_model 4096, 32 layers, 32 heads, SwiGLU hidden 11008,
    # RMSNorm eps 1e-6, rope theta 500000, sliding window 4096 on 3 of every 4 layers,
    # vocab padded from 100278 (dolma2) to a multiple of 128.
    return ModelConfig(
        vocab_size=100278, padded_vocab_size=100352, d_model=4096, n_layers=32, n_heads=32,
        n_kv_heads=32, head_dim=128, mlp_hidden=11008, norm_eps=1e-6, rope_theta=500000.0,
        sliding_window=4096, full_attention_every=4, max_position_embeddings=65536,
        # The production path (not part of AI2's recipe; it changes memory and speed, never the
        # result): fp32 master weights, bf16 compute, the per-platform attention kernel (splash
        # on TPU, cuDNN on GPU), layers scanned in groups of four, every layer rematerialised
        # from its input, logits 1024 positions at a time. `olmax compile` checks a topology.
        param_dtype="float32", compute_dtype="bfloat16", attention_impl="auto", scan_layers=True,
        remat="full", logits_chunk=1024,
    )


def olmo3_32b_model() -> ModelConfig:
    # TransformerConfig.olmo3_32B: d_model 5120, 64 layers, 40 heads with 8 kv heads (GQA),
    # MLP hidden 27648.
    return replace(olmo3_7b_model(), d_model=5120, n_layers=64, n_heads=40, n_kv_heads=8, head_dim=128,
                   mlp_hidden=27648)


def _olmo3_optim(lr: float, schedule: ScheduleConfig) -> OptimConfig:
    # SkipStepAdamW(lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1), embeddings excluded from
    # weight decay; z-loss 1e-5; max_grad_norm 1.0.
    return OptimConfig(lr=lr, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1, decay_embeddings=False,
                       max_grad_norm=1.0, z_loss=1e-5, schedule=schedule)


def olmo3_7b_stage1() -> Config:
    return Config(
        name="olmo3_7b_stage1",
        model=olmo3_7b_model(),
        # dolma2 tokenizer: eos 100257, pad 100277, no bos; data seed 34521; no n-gram filter at 7B.
        data=DataConfig(sequence_length=SEQ_LEN, seed=34521, dtype="uint32", eos_token_id=100257,
                        pad_token_id=100277, bos_token_id=None, workers=4, repetition_filter=False,
                        mix_tokenizer="dolma2-tokenizer"),
        optim=_olmo3_optim(3e-4, ScheduleConfig(
            name="two_part_cosine", warmup=2000, t_max=STAGE1_T_MAX_1, alpha_f=0.1,
            switch_step=STAGE1_SWITCH, t_max_2=STAGE1_T_MAX_2)),
        # At most 4 x 8192 tokens per device per micro-batch (2 micro-batches of 4 on v5p-128):
        # within MaxText's per-chip memory for the same slice and batch.
        # Remat by measurement (`olmax compile --sweep`, XLA's estimate, not a chip's clock:
        # benchmarks/results/compile-sweep-stage1_tpu-aot_2026-12-06.md): on v5p-128, save_proj
        # in 4 micro-batches of 2 needs 64.07 GiB a chip (33% free) for an estimated 8.80 s a step
        # with the splash kernel priced in (est. MFU 75.6%) against full remat's 10.91 s (60.9%,
        # 25.35 GiB); save_proj at 4 a micro-batch does not fit (111.22 GiB: about 24 GiB of
        # activations per sequence, 2026-12-05).
        # The recipe keeps full remat, which fits every slice it serves; save_proj does not fit
        # v6e-256 even at one sequence a pass (31.50 of 31.25 GiB, 2026-12-06). On v5p-128 and
        # v5p-256 `olmax compile` and `olmax launch tpu` apply save_proj in micro-batches of 2, on
        # v6e-256 save_proj_except_out one sequence a pass, on tpu7x-128 minimal in micro-batches of 2
        # (olmax.recipes.slices).
        train=TrainConfig(steps=STAGE1_STEPS, global_batch_size=STAGE1_BATCH, max_micro_batch_size=MAX_MICRO_BATCH),
        checkpoint=CheckpointConfig(interval=1000),        # save_interval=1000
        # In-loop evaluation every 10k steps; 8 batches of 256 x 8192 tokens = 16.8M held-out tokens
        # (the published reproduction's 16M-token C4 set), a batch every slice size up to 256 devices divides.
        eval=EvalConfig(interval=10000, batches=8, batch_size=256),
    )


def olmo3_7b_stage2() -> Config:
    # Midtrain: lr 2.0712352850360292e-4 linearly to 0 with no warmup over 47,684 steps of
    # 256 x 8192 tokens (100B tokens of Dolmino); seed 1337; 4 data workers.
    steps = 47684
    base = olmo3_7b_stage1()
    return replace(
        base, name="olmo3_7b_stage2",
        data=replace(base.data, seed=1337, workers=4),
        optim=_olmo3_optim(2.0712352850360292e-4, ScheduleConfig(name="linear", warmup=0, t_max=steps, alpha_f=0.0)),
        train=TrainConfig(steps=steps, global_batch_size=256, max_micro_batch_size=MAX_MICRO_BATCH),
    )


def olmo3_7b_stage3() -> Config:
    # Planned long-context stage: 65,536 tokens with YaRN on full-attention layers (as HF runs
    # the released long-context checkpoints).
    base = olmo3_7b_stage2()
    yarn = RopeScaling(factor=8.0, original_max_position_embeddings=8192, beta_fast=32.0, beta_slow=1.0,
                       attention_factor=1.2079441541679836)
    return replace(base, name="olmo3_7b_stage3", model=replace(base.model, rope_scaling=yarn),
                   data=replace(base.data, sequence_length=65536))


def olmo3_32b() -> Config:
    base = olmo3_7b_stage1()
    # The 32B scripts enable the periodic-sequence filter (max period 13, min 1, max count 32).
    return replace(base, name="olmo3_32b", model=olmo3_32b_model(),
                   data=replace(base.data, repetition_filter=True, repetition_min_period=1,
                                repetition_max_period=13, repetition_max_count=32))
