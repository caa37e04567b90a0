"""RL with verifiable rewards: rewards (``olmax.rl.rewards``) and the GRPO core
(``olmax.rl.grpo``: group advantages, the clipped policy loss, its aggregation modes and the
train step). The rollout loop that samples completions with the trainer's own weights is not
built yet."""
