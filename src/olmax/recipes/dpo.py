"""OLMo 3 DPO recipes, as AI2 ran them in open-instruct (``dpo_tune_cache.py``), and a tiny one for the CPU.

Sources (allenai/open-instruct; see ``../shared/spec/olmo3_post_training.md`` §1 and §3):
- Think DPO: commit 68da0a1, ``scripts/train/olmo3/7b_think_dpo.sh``: lr 8e-8, ``--lr_scheduler_type
  linear``, per-device batch 1 x gradient accumulation 4 x 4 nodes x 8 GPUs = 128 pairs,
  ``--max_seq_length 16384``, ``--max_train_samples 150000``, weight decay 0; loss ``dpo_norm``,
  beta 5, 1 epoch and warmup ratio 0.1 are ``dpo_tune_cache.py``'s defaults at that commit.
- Instruct DPO: commit 2fd104e, ``scripts/train/olmo3/7b_instruct_dpo.sh``: the same with lr 1e-6.
- ``open_instruct/dpo_utils.py``: the loss (mean log-prob over response tokens, label smoothing 0).

open-instruct's optimizer is torch AdamW (betas 0.9/0.999, eps 1e-8, not set by the scripts) with no
gradient clipping (``--clip_grad_norm`` not passed; default -1 = off) and no skip-step. The schedule
is HF's ``get_scheduler("linear")`` with ``int(warmup_ratio * steps)`` warmup steps, stepped once per
update on the 0-based update index (open-instruct multiplies both horizons by the process count
and accelerate steps the scheduler once per process, which cancels): ``optim.schedule.hf_linear``.
"""

from __future__ import annotations

from dataclasses import replace

from olmax.config import (
    CheckpointConfig,
    Config,
    DataConfig,
    DpoConfig,
    EvalConfig,
    MeshConfig,
    OptimConfig,
    ScheduleConfig,
    SkipStepConfig,
    TrainConfig,
)
from olmax.recipes.olmo3 import olmo3_7b_model
from olmax.recipes.tiny import tiny

DPO_SEQ_LEN = 16384                 # --max_seq_length 16384
DPO_PAIRS_PER_STEP = 128            # 1 per device x 4 accumulation x 32 GPUs
THINK_PAIRS = 150_000               # --max_train_samples 150000 (1 epoch)
WARMUP_RATIO = 0.1                  # --warmup_ratio 0.1


def _steps(pairs: int) -> int:
    return pairs // DPO_PAIRS_PER_STEP


def _dpo_optim(lr: float, steps: int) -> OptimConfig:
    # torch AdamW defaults (betas 0.9/0.999, eps 1e-8), weight decay 0, no clipping, no z-loss,
    # no skip-step; linear decay to 0 after 10% warmup.
    return OptimConfig(lr=lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decay_embeddings=True,
                       max_grad_norm=None, z_loss=None, skip_step=SkipStepConfig(enabled=False),
                       schedule=ScheduleConfig(name="hf_linear", warmup=int(WARMUP_RATIO * steps), alpha_f=0.0))


def _olmo3_7b_dpo(name: str, lr: float, pairs: int) -> Config:
    steps = _steps(pairs)
    # The SFT checkpoint is long-context (YaRN on the full-attention layers, as stage 3).
    from olmax.recipes.olmo3 import olmo3_7b_stage3
    model = olmo3_7b_stage3().model
    return Config(
        name=name,
        model=replace(model, remat="full"),
        # dolma2 ids; the pairs come from `olmax tokenize --chat` (preference JSONL); set data.preference_path.
        data=DataConfig(sequence_length=DPO_SEQ_LEN, seed=34521, dtype="uint32", eos_token_id=100257,
                        pad_token_id=100277, bos_token_id=None, workers=0),
        optim=_dpo_optim(lr, steps),
        # At most 128 FSDP shards (one pair each); a larger slice gives the rest to tensor parallelism.
        mesh=MeshConfig(data=1, fsdp=-1, tensor=1, fsdp_max=DPO_PAIRS_PER_STEP),
        # 128 pairs = 256 sequences of 16,384 tokens per update; at most one pair per device per micro-batch.
        train=TrainConfig(steps=steps, global_batch_size=DPO_PAIRS_PER_STEP, max_micro_batch_size=1,
                          objective="dpo", log_interval=1),
        checkpoint=CheckpointConfig(interval=100),
        eval=EvalConfig(),
        # dpo_norm, beta 5, label smoothing 0; reference = the starting (SFT) weights, cached in a first pass.
        dpo=DpoConfig(loss="dpo_norm", beta=5.0, label_smoothing=0.0, reference="init"),
    )


def olmo3_7b_think_dpo() -> Config:
    # lr 8e-8; 150k pairs of Dolci-Think-DPO-7B -> 1,171 updates of 128 pairs.
    return _olmo3_7b_dpo("olmo3_7b_think_dpo", 8e-8, THINK_PAIRS)


def olmo3_7b_instruct_dpo() -> Config:
    # lr 1e-6; about 260k pairs (125k + 125k delta-learning pairs + ~10k multi-turn) -> 2,031 updates.
    # The exact pair count is not confirmed: set train.steps to (pairs // 128) for the real data.
    return _olmo3_7b_dpo("olmo3_7b_instruct_dpo", 1e-6, 260_000)


def tiny_dpo() -> Config:
    """The tiny model on preference pairs: CPU demos and tests (set data.preference_path)."""
    base = tiny()
    steps = 40
    return replace(
        base, name="tiny_dpo",
        data=replace(base.data, sequence_length=128, workers=0),
        optim=replace(_dpo_optim(1e-4, steps), schedule=ScheduleConfig(name="hf_linear", warmup=4, alpha_f=0.0)),
        train=TrainConfig(steps=steps, global_batch_size=8, seed=0, log_interval=1, objective="dpo"),
        checkpoint=CheckpointConfig(interval=10, keep_last=2, async_save=True),
        eval=EvalConfig(),
        dpo=DpoConfig(loss="dpo_norm", beta=5.0, label_smoothing=0.0, reference="init"),
    )


__all__ = ["olmo3_7b_think_dpo", "olmo3_7b_instruct_dpo", "tiny_dpo", "olmo3_7b_model"]
