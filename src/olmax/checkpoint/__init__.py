"""Checkpoints and parameters, below both train and eval: the train state's shapes and shardings
(state), Orbax checkpoints of it (store), run directories on ``s3://`` and ``gs://`` (remote), and
parameters from any source (load: weights directories, checkpoints, ``hf:`` through compat.hf).
Imports compat.hf and the layers below; never train, eval, verify or the CLI."""
