"""A tiny OLMo 3 for CPU demos and tests: the 7B's structure (sliding/full layer pattern,
QK-norm, reordered norms, SwiGLU, untied head) at a size that trains in minutes on 2 cores."""

from __future__ import annotations

from olmax.config import (
    CheckpointConfig,
    Config,
    DataConfig,
    EvalConfig,
    MeshConfig,
    ModelConfig,
    OptimConfig,
    ScheduleConfig,
    SkipStepConfig,
    TrainConfig,
)


def tiny() -> Config:
    return Config(
        name="tiny",
        model=ModelConfig(
            vocab_size=4096, padded_vocab_size=4096, d_model=128, n_layers=4, n_heads=4, n_kv_heads=4,
            head_dim=32, mlp_hidden=352, norm_eps=1e-6, rope_theta=500000.0, sliding_window=64,
            full_attention_every=4, max_position_embeddings=4096, param_dtype="float32",
            compute_dtype="float32", attention_impl="auto",
        ),
        # Token ids follow the demo's BPE: eos 0, pad 1 (see olmax.demos.pretrain).
        data=DataConfig(sequence_length=128, seed=34521, dtype="uint16", eos_token_id=0, pad_token_id=1,
                        workers=0),
        optim=OptimConfig(lr=3e-3, weight_decay=0.1, max_grad_norm=1.0, z_loss=1e-5,
                          skip_step=SkipStepConfig(enabled=True),
                          schedule=ScheduleConfig(name="cosine", warmup=20, alpha_f=0.1)),
        mesh=MeshConfig(data=1, fsdp=-1, tensor=1),
        train=TrainConfig(steps=500, global_batch_size=16, seed=0, log_interval=10),
        checkpoint=CheckpointConfig(interval=100, keep_last=2, async_save=True),
        eval=EvalConfig(interval=100, batches=4, batch_size=16),
    )
