"""Evaluation: held-out loss and domains on fixed batches (in the loop and offline), KL between
models, lm-eval tasks, and run comparison (readers, statistics, report, memorisation alarm)."""
