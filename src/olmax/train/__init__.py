"""Training: state, step, loop, checkpoints."""
