"""Training: the step (step), the loop (loop), what a run sets up before it (init), multi-process
start (distributed). Imports the layers below (the loss from model.loss, checkpoints and parameter
loading from checkpoint) and eval's held-out evaluator and alarm (run inside the loop), which never
import train back; never verify or the CLI."""
