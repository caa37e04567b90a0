"""OLMo 3 RL recipes (GRPO with verifiable rewards), as AI2 ran them in open-instruct's
``grpo_fast.py``, and a tiny one for the CPU.

Sources (allenai/open-instruct; ``../shared/spec/olmo3_post_training.md`` §1 and §3):
- Think RL, commit 42aa63c: from Olmo-3-7B-Think-DPO; lr 1e-6 constant; 64 prompts x 8 samples =
  512 rollouts a step; ``num_mini_batches 1`` (one optimizer step per rollout batch); prompts up to
  2,048 tokens, responses up to 32,768; temperature 1.0; beta 0 (no KL); clip 0.2 below, 0.272
  above; centered advantages; reward = 10 x verifier score; ``filter_zero_std_samples``; no active
  sampling; truncated importance sampling capped at 2.0.
- Instruct RL, commit 9ade62d: the same with 4 optimizer steps per batch (``num_mini_batches 4``),
  responses up to 8,192, active sampling, ``no_resampling_pass_rate 0.875``, stop string
  ``</answer>``.
- Loss aggregation at these commits: per micro-batch mean, then / accumulation steps
  (``rl.aggregation=microbatch_mean``; open-instruct's micro-batch is one packed sequence,
  olmax's is ``train.max_micro_batch_size`` rows: see the README).
- Training rows packed to ``--pack_length`` tokens: 35,840 (Think), 11,264 (Instruct)
  (``rl.pack_length``; ``olmax.rl.packing``).

What differs on purpose: rollouts are on-policy (open-instruct ran ``async_steps 8`` with
in-flight weight updates: rollouts up to 8 policy versions old); olmax samples from the weights
being trained, so the TIS weight is exactly 1 on the CPU (the generator's log-probs are the
training forward's bits) and 1 up to rounding elsewhere. The optimizer's settings other than the
learning rate are not in the spec: torch AdamW's defaults (betas 0.9 / 0.999, eps 1e-8), weight
decay 0, gradient clipping at 1.0, no z-loss and no skip-step (its loss-spike test is meaningless
for a policy loss around 0).
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
    RlConfig,
    ScheduleConfig,
    SkipStepConfig,
    TrainConfig,
)
from olmax.recipes.tiny import tiny

PROMPTS_PER_STEP = 64               # --num_unique_prompts_rollout 64
GROUP_SIZE = 8                      # --num_samples_per_prompt_rollout 8
MAX_PROMPT = 2048                   # --max_prompt_token_length 2048
# The rollouts run on the continuous engine (rl.batching's default). The 7B recipes sample every
# row of a step at once (512 slots), so no slot is refilled within a step, but a round trip runs 8
# decode steps instead of one and ends when every row has. Its programs fit a v5p-128 chip at 512 x
# 34,816 tokens (`olmax compile`, 2026-12-06: 50.45 GiB, the static engine's 50.85): the admission
# writes each prompt's 2,048 prefilled positions into its slot in place.


def _rl_optim(lr: float) -> OptimConfig:
    return OptimConfig(lr=lr, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decay_embeddings=True,
                       max_grad_norm=1.0, z_loss=None, skip_step=SkipStepConfig(enabled=False),
                       schedule=ScheduleConfig(name="constant", warmup=0, alpha_f=1.0))


def _olmo3_7b_rl(name: str, response: int, rl: RlConfig, steps: int) -> Config:
    from olmax.recipes.olmo3 import olmo3_7b_stage3
    model = olmo3_7b_stage3().model      # the DPO checkpoint is long-context (YaRN), as stage 3
    rows = PROMPTS_PER_STEP * GROUP_SIZE
    return Config(
        name=name,
        model=replace(model, remat="full"),
        data=DataConfig(sequence_length=MAX_PROMPT + response, seed=1, dtype="uint32", eos_token_id=100257,
                        pad_token_id=100277, bos_token_id=None, workers=0),
        optim=_rl_optim(1e-6),
        mesh=MeshConfig(data=1, fsdp=-1, tensor=1),
        # global_batch_size = the completions of one step; one sequence per device per micro-batch.
        train=TrainConfig(steps=steps, global_batch_size=rows, max_micro_batch_size=1, objective="grpo",
                          log_interval=1),
        checkpoint=CheckpointConfig(interval=50),
        eval=EvalConfig(),
        rl=rl,
    )


def olmo3_7b_think_rl() -> Config:
    # The number of RL steps is not in the spec ([U]); set train.steps for the run.
    rl = RlConfig(group_size=GROUP_SIZE, prompts_per_step=PROMPTS_PER_STEP, temperature=1.0, top_p=1.0,
                  max_prompt_length=MAX_PROMPT, max_response_length=32768, reward="math", reward_multiplier=10.0,
                  advantage="centered", clip_low=0.2, clip_high=0.272, kl_beta=0.0, aggregation="microbatch_mean",
                  filter_zero_std=True, active_sampling=False, num_mini_batches=1, num_epochs=1, tis_cap=2.0,
                  mask_truncated=False, generation_batch=None,   # all 512 at once: 50.5 GiB a v5p chip
                  pack_length=35840)                             # --pack_length 35840
    return _olmo3_7b_rl("olmo3_7b_think_rl", 32768, rl, steps=1000)


def olmo3_7b_instruct_rl() -> Config:
    rl = RlConfig(group_size=GROUP_SIZE, prompts_per_step=PROMPTS_PER_STEP, temperature=1.0, top_p=1.0,
                  max_prompt_length=MAX_PROMPT, max_response_length=8192, stop_strings=("</answer>",), reward="math",
                  reward_multiplier=10.0, advantage="centered", clip_low=0.2, clip_high=0.272, kl_beta=0.0,
                  aggregation="microbatch_mean", filter_zero_std=True, active_sampling=True, max_sampling_rounds=4,
                  retire_pass_rate=0.875, num_mini_batches=4, num_epochs=1, tis_cap=2.0, mask_truncated=False,
                  generation_batch=512, pack_length=11264)        # --pack_length 11264
    return _olmo3_7b_rl("olmo3_7b_instruct_rl", 8192, rl, steps=1000)


def tiny_rl() -> Config:
    """The tiny model with RL: CPU demos and tests (set rl.prompts_path and rl.tokenizer or
    train.init_from). Training rows of 256 tokens hold several completions (``rl.pack_length``;
    ``rl.pack_length=null`` trains one a row)."""
    base = tiny()
    rl = RlConfig(group_size=4, prompts_per_step=4, temperature=1.0, max_prompt_length=48, max_response_length=16,
                  reward="exact_match", reward_multiplier=1.0, advantage="centered", aggregation="token_mean",
                  filter_zero_std=True, tis_cap=2.0, pack_length=256)
    return replace(
        base, name="tiny_rl",
        data=replace(base.data, sequence_length=64, workers=0),
        optim=replace(_rl_optim(1e-4), schedule=ScheduleConfig(name="constant", warmup=0, alpha_f=1.0)),
        train=TrainConfig(steps=20, global_batch_size=16, seed=0, log_interval=1, objective="grpo"),
        checkpoint=CheckpointConfig(interval=10, keep_last=2, async_save=True),
        eval=EvalConfig(),
        rl=rl,
    )


__all__ = ["olmo3_7b_think_rl", "olmo3_7b_instruct_rl", "tiny_rl"]
