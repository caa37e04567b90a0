"""Evaluation: held-out loss on fixed batches (heldout, in the loop and offline), per-domain
perplexity (domains), KL between checkpoints (kl), lm-eval-harness tasks (suite, lm_eval_adapter),
run comparison (runs, compare, report, alarm). Same layer as train, which runs the held-out
evaluator and the alarm in its loop, so eval never imports train: the loss comes from model.loss,
parameters from checkpoint.load. Never verify or the CLI."""
