"""``olmax launch``: resume-until-done supervision and cluster submission.

- ``local``: run ``olmax train`` as a child process; restart it after a crash with exponential
  backoff, reset when the run made progress (a new committed checkpoint), give up after N restarts
  without progress (:mod:`olmax.launch.local`).
- ``slurm``: an sbatch script (srun, jax.distributed from the Slurm variables, requeue on
  preemption, node failure and time limit, the same progress rule) (:mod:`olmax.launch.slurm`).
- ``tpu``: the per-host command of a TPU slice, a ``gcloud`` line and a JobSet manifest
  (:mod:`olmax.launch.tpu`).

Progress is read from the run directory without JAX (:func:`latest_checkpoint`). Above train
(whose remote checkpoints it reads); never the CLI, whose ``olmax train`` it runs as a child.
"""

from __future__ import annotations

from pathlib import Path

from olmax import io
from olmax.checkpoint.remote import RemoteCheckpoints


def latest_checkpoint(run_dir: str) -> int | None:
    """Newest committed checkpoint step of a run directory (local, s3:// or gs://), or None.

    Locally, Orbax renames ``<N>.orbax-checkpoint-tmp`` to ``<N>`` only when a save is complete,
    so a folder named by digits alone is a committed checkpoint; remotely, the commit marker.
    """
    if io.is_remote(run_dir):
        steps = RemoteCheckpoints(run_dir).committed_steps()
        return steps[-1] if steps else None
    d = Path(run_dir) / "checkpoints"
    steps = [int(p.name) for p in d.iterdir() if p.is_dir() and p.name.isdigit()] if d.is_dir() else []
    return max(steps) if steps else None


def train_command(recipe: str, run_dir: str, overrides: list[str], python: str = "python",
                  extra: list[str] | None = None) -> list[str]:
    """The ``olmax train`` command line every launcher runs. Its main process reports progress: a
    bar on a terminal (``launch local``), a plain line every 10 steps in a job's log."""
    cmd = [python, "-m", "olmax.cli", "train", recipe, "--run-dir", run_dir]
    for o in overrides:
        cmd += ["--set", o]
    return cmd + list(extra or [])

