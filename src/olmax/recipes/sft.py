"""OLMo 3 SFT recipes, as AI2 ran them in OLMo-core, and a tiny one for the CPU.

Sources (allenai/OLMo-core; ``../shared/spec/olmo3_post_training.md`` §1 and §3):
- Think SFT: commit 38f6652, ``src/scripts/train/sft/OLMo2-7B-sft.py``: from the stage-3 long-context
  checkpoint (YaRN factor 8, beta_fast 32, beta_slow 1, original context 8,192);
  ``NumpyPackedFSLDatasetConfig`` (best-fit-decreasing packing into 32,768-token instances,
  ``LongDocStrategy.truncate``, ``generate_doc_lengths=True``) over ``token_ids_part_*.npy`` +
  ``labels_mask_*.npy``; ``SkipStepAdamW`` betas (0.9, 0.95), weight decay 0, clip 1.0, no z-loss;
  ``LinearWithWarmup(warmup_fraction=0.03, alpha_f=0)``; 1,048,576 tokens a step; 2 epochs; lr 5e-5;
  bf16 compute with fp32 gradient reduction; activation checkpointing of the feed-forward modules.
- Instruct SFT: commit 9e97471, ``OLMo-sft.py``: the same with lr 8e-5.
- The loss (``TransformerTrainModule.train_batch``): CE summed over the unmasked labels of a rank's
  batch, divided by that rank's count, averaged over ranks: ``train.loss_ranks``. 1,048,576 tokens
  are 32 instances; with one instance per rank that is 32 ranks [derived: the scripts' GPU counts
  (64 Think, 32 Instruct) and sharding are not confirmed to put one instance on each rank].

Set ``data.paths`` to the folder ``olmax tokenize --chat`` wrote (its label masks are found from its
manifest) or to the token files with ``data.label_mask_paths``, and ``train.init_from`` to the
stage-3 (or HF) checkpoint.
"""

from __future__ import annotations

from dataclasses import replace

from olmax.config import (
    CheckpointConfig,
    Config,
    DataConfig,
    EvalConfig,
    MeshConfig,
    OptimConfig,
    ScheduleConfig,
    SkipStepConfig,
    TrainConfig,
)
from olmax.recipes.tiny import tiny

SFT_SEQ_LEN = 32768               # sequence_length 32,768
SFT_BATCH = 1_048_576 // SFT_SEQ_LEN   # 1,048,576 tokens a step = 32 instances
SFT_EPOCHS = 2


def _sft_optim(lr: float) -> OptimConfig:
    # SkipStepAdamW(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0), max_grad_norm 1.0, no z-loss;
    # LinearWithWarmup(warmup_fraction=0.03, alpha_f=0.0).
    return OptimConfig(lr=lr, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.0, decay_embeddings=False,
                       max_grad_norm=1.0, z_loss=None, skip_step=SkipStepConfig(enabled=True),
                       schedule=ScheduleConfig(name="linear", warmup=0, warmup_fraction=0.03, alpha_f=0.0))


def _olmo3_7b_sft(name: str, lr: float) -> Config:
    from olmax.recipes.olmo3 import olmo3_7b_stage3
    base = olmo3_7b_stage3()
    return Config(
        name=name,
        # Stage 3's model (YaRN on the full-attention layers). OLMo-core checkpoints the feed-forward
        # modules; olmax's save_attn_out keeps the attention output and recomputes the rest of a layer.
        model=replace(base.model, remat="save_attn_out"),
        data=DataConfig(sequence_length=SFT_SEQ_LEN, seed=34521, dtype="uint32", eos_token_id=100257,
                        pad_token_id=100277, bos_token_id=None, workers=4, packing="obfd",
                        long_doc_strategy="truncate", document_masking=True),
        optim=_sft_optim(lr),
        train=TrainConfig(steps=1, epochs=SFT_EPOCHS, global_batch_size=SFT_BATCH, max_micro_batch_size=1,
                          loss_ranks=SFT_BATCH, log_interval=1),
        checkpoint=CheckpointConfig(interval=500),
        eval=EvalConfig(interval=500, batches=4, batch_size=32),
        # One 32K instance per data-parallel shard: at most 32 FSDP shards, the rest of a larger slice
        # splits heads and MLP (v5p-128: 32 x 2, 35.7 GiB of 95.7 per chip; v6e-256: 32 x 8).
        mesh=MeshConfig(data=1, fsdp=-1, tensor=1, fsdp_max=SFT_BATCH),
    )


def olmo3_7b_think_sft() -> Config:
    return _olmo3_7b_sft("olmo3_7b_think_sft", 5e-5)


def olmo3_7b_instruct_sft() -> Config:
    return _olmo3_7b_sft("olmo3_7b_instruct_sft", 8e-5)


def tiny_sft() -> Config:
    """The tiny model on packed chat data (``olmax demo sft``, tests): the 7B SFT recipe's rules at
    the tiny size (set data.paths, and train.init_from to a pre-trained tiny run)."""
    base = tiny()
    return replace(
        base, name="tiny_sft",
        data=replace(base.data, sequence_length=256, packing="obfd", long_doc_strategy="truncate",
                     document_masking=True),
        optim=replace(_sft_optim(1e-3), skip_step=SkipStepConfig(enabled=False)),
        train=TrainConfig(steps=1, epochs=2, global_batch_size=16, seed=0, log_interval=10),
        checkpoint=CheckpointConfig(interval=100, keep_last=2, async_save=True),
        eval=EvalConfig(interval=100, batches=2, batch_size=16),
    )


__all__ = ["olmo3_7b_think_sft", "olmo3_7b_instruct_sft", "tiny_sft"]
