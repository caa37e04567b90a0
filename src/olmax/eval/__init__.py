"""Evaluation: held-out loss on fixed batches (in-loop and offline)."""
