"""Evaluation: held-out loss on fixed batches (heldout, in the loop and offline), per-domain
perplexity (domains), KL between checkpoints (kl), lm-eval-harness tasks (suite, lm_eval_adapter),
run comparison (runs, compare, report, alarm). Same layer as train: imports its step and parameter
loading and the layers below; never verify or the CLI."""
