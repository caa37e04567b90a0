"""Held-out loss on fixed batches.

The batches are the first ``eval.batches * eval.batch_size`` windows of length L of the
held-out token files, in file order, unshuffled: the same batches for any two runs, any
topology and any step, so held-out curves of two runs are directly comparable. Held-out files
come from ``olmax tokenize --heldout`` and are never part of the training index.

The loss is the training loss's CE (``olmax.train.step.loss_sums``: fp32, over the padded
vocabulary as OLMo-core computes it, z-loss excluded), summed over all labels of all batches
and divided by their count.

With ``per_batch=True`` the evaluator also returns each batch's loss as
``{prefix}/CE loss [batch i]``; ``olmax compare`` uses these for paired standard errors of
held-out deltas between two runs (the batches are identical, so per-batch differences cancel
the batch-difficulty variance).
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import jax
import numpy as np

from olmax.config import Config, ConfigError
from olmax.sharding import batch_sharding, data_parallel_size
from olmax.train.step import make_eval_step

PER_BATCH_FMT = "{metric} [batch {i}]"   # per-batch metric names (parsed back by olmax.eval.compare)


def heldout_windows(paths: tuple[str, ...] | list[str], dtype: str, seq_len: int, n: int | None) -> np.ndarray:
    """First ``n`` (all if None) windows of ``seq_len`` tokens, each file cut on its own.

    ``paths`` are what ``data.paths`` takes (token files, `olmax tokenize` folders or manifests,
    mix files), expanded by the data pipeline's own ``resolve_paths``."""
    from olmax.data.dataset import file_sizes, open_tokens, resolve_paths
    out, have = [], 0
    resolved = [p for p, _ in resolve_paths(list(paths), dtype=dtype)]
    for p, size in zip(resolved, file_sizes(resolved)):  # remote files: sizes from metadata
        item = np.dtype(dtype).itemsize
        if size % item:
            raise ConfigError(f"held-out token file {p} has {size} bytes, not a multiple of {dtype} ({item} bytes)")
        arr = open_tokens(p, dtype, size) if size else np.zeros(0, dtype)
        k = len(arr) // seq_len
        if n is not None:
            k = min(k, n - have)
        if k > 0:
            out.append(np.asarray(arr[: k * seq_len]).reshape(k, seq_len).astype(np.int32))
            have += k
        if n is not None and have >= n:
            break
    if not out:
        raise ConfigError(f"held-out files {list(paths)} hold no window of {seq_len} tokens")
    return np.concatenate(out)


def fixed_batches(windows: np.ndarray, batch_size: int, vocab_size: int, what: str = "held-out files") -> np.ndarray:
    """``[n_batches, batch_size, L]`` from whole batches of ``windows`` (a partial last batch is dropped)."""
    if batch_size <= 0:
        raise ConfigError(f"batch size must be positive, got {batch_size}")
    if windows.max() >= vocab_size:
        raise ConfigError(f"{what} hold token id {int(windows.max())} >= model.vocab_size={vocab_size}")
    nb = len(windows) // batch_size
    if nb == 0:
        raise ConfigError(f"{what} hold {len(windows)} windows, fewer than one batch of {batch_size}; "
                          "lower the batch size or add data")
    return windows[: nb * batch_size].reshape(nb, batch_size, -1)


def check_batch_divides(batch_size: int, mesh: jax.sharding.Mesh) -> None:
    """The batch is split over the data-parallel mesh axes; say so before anything compiles."""
    dp = data_parallel_size(mesh.shape)
    if batch_size % dp:
        raise ConfigError(f"eval batch size {batch_size} is not divisible by the {dp} data-parallel devices")


def put_batch(b: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """A host batch as a global array: every process holds the same windows and fills its own shards."""
    return jax.make_array_from_callback(b.shape, sharding, lambda i: b[i])


def mean_se(values: Sequence[float]) -> float | None:
    """Standard error of the mean (Bessel-corrected std / sqrt(n)); None for fewer than 2 values."""
    v = np.asarray(values, dtype=np.float64)
    return float(v.std(ddof=1) / math.sqrt(len(v))) if len(v) >= 2 else None


def safe_exp(x: float) -> float:
    return math.exp(x) if x < 700 else float("inf")


class HeldoutEvaluator:
    def __init__(self, cfg: Config, mesh: jax.sharding.Mesh, paths: tuple[str, ...] | None = None,
                 prefix: str = "eval/heldout", per_batch: bool = False):
        self.cfg = cfg
        self.prefix = prefix
        self.per_batch = per_batch
        bs = cfg.eval.batch_size
        windows = heldout_windows(paths or cfg.eval.heldout_paths, cfg.data.dtype, cfg.data.sequence_length,
                                  cfg.eval.batches * bs)
        self.batches = fixed_batches(windows, bs, cfg.model.vocab_size)
        check_batch_divides(bs, mesh)
        self.sharding = batch_sharding(mesh)
        self._eval = jax.jit(make_eval_step(cfg, mesh))
        # The batches never change: put them on the devices once, not at every evaluation.
        self._device_batches = [put_batch(b, self.sharding) for b in self.batches]
        self._mask = put_batch(np.ones(self.batches.shape[1:], bool), self.sharding)

    def evaluate_detailed(self, params: Any) -> dict[str, Any]:
        """``loss`` (nats/token), ``perplexity``, ``tokens`` (labels scored), ``batches``,
        ``per_batch_loss``, ``loss_se`` (standard error over batches, None for one batch)."""
        # Dispatch every batch, then fetch all results in one transfer.
        results = jax.device_get([self._eval(params, b, self._mask) for b in self._device_batches])
        ces = [float(ce) for ce, _ in results]
        ns = [float(n) for _, n in results]
        loss = sum(ces) / sum(ns)
        per = [c / n for c, n in zip(ces, ns)]
        return {"loss": loss, "perplexity": safe_exp(loss), "tokens": int(sum(ns)), "batches": len(ces),
                "per_batch_loss": per, "loss_se": mean_se(per)}

    def evaluate(self, params: Any) -> dict[str, float]:
        r = self.evaluate_detailed(params)
        out = {f"{self.prefix}/CE loss": r["loss"], f"{self.prefix}/PPL": r["perplexity"]}
        if self.per_batch:
            for i, v in enumerate(r["per_batch_loss"]):
                out[PER_BATCH_FMT.format(metric=f"{self.prefix}/CE loss", i=i)] = v
        return out
