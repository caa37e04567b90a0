"""Training: the state's shapes and shardings (state), the step (step), the loop (loop), what a run
sets up before it (init), checkpoints (checkpoint, remote), parameters from any source (load),
multi-process start (distributed). Imports the layers below, eval's held-out evaluator and alarm
(run inside the loop) and compat.hf (``hf:`` warm starts); never verify or the CLI."""
