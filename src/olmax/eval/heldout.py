"""Held-out loss on fixed batches: in the training loop, ``olmax eval loss`` and ``olmax eval domains``.

The batches of a set of held-out files: each file is cut on its own into windows of L tokens,
and the first ``batches * batch_size`` windows in file order, unshuffled, are scored (every whole
batch when ``batches`` is 0): the same batches for any two runs, any topology and any step, so
held-out curves of two runs are directly comparable. Held-out files come from ``olmax tokenize
--heldout`` and are never part of the training index.

The vocabulary rule, for every held-out number olmax reports: the loss is the training loss's CE
(``olmax.model.loss``: fp32, over the padded vocabulary as OLMo-core computes it, the label mask
and denominator rule of training, z-loss excluded), summed over all batches and divided by the
summed denominators; held-out files carry no label mask, so every label of every window (positions
1..L-1) counts. A trained model puts almost no probability on the padded rows; in a model converted from HF
they are the mean of the real rows (``olmax.compat.hf``), which adds at most
log(padded / real vocabulary) nats (7e-4 for OLMo 3).

With ``per_batch=True`` the evaluator also returns each batch's loss as
``{prefix}/CE loss [batch i]``; ``olmax compare`` uses these for paired standard errors of
held-out deltas between two runs (the batches are identical, so per-batch differences cancel
the batch-difficulty variance).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from functools import lru_cache
from typing import Any

import jax
import numpy as np

from olmax.config import Config, ConfigError, MeshConfig
from olmax.data.dataset import file_sizes, open_tokens, resolve_paths
from olmax.eval.runs import mean_se
from olmax.model.loss import loss_denominator, loss_sums, whole_rows_count, with_documents
from olmax.sharding import activation_mesh, batch_sharding, data_parallel_size, make_mesh

PER_BATCH_FMT = "{metric} [batch {i}]"   # per-batch metric names (parsed back by olmax.eval.compare)


def heldout_windows(paths: tuple[str, ...] | list[str], dtype: str, seq_len: int, n: int | None,
                    field: str = "--data") -> np.ndarray:
    """First ``n`` (all if None) windows of ``seq_len`` tokens, each file cut on its own.

    ``paths`` are what ``data.paths`` takes (token files, `olmax tokenize` folders or manifests,
    mix files), expanded by the data pipeline's own ``resolve_paths``."""
    out, have = [], 0
    resolved = [p for p, _ in resolve_paths(list(paths), dtype=dtype, field=field)]
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


def sft_instances(cfg: Config, files: list[str], seq_len: int, n: int | None) -> tuple[np.ndarray, np.ndarray]:
    """The first ``n`` instances of the held-out files built as training builds its own
    (``data.packing``) with ``eval.heldout_label_mask_paths``: (tokens, label masks), so the
    held-out loss of an SFT run counts the assistant tokens only."""
    from olmax.data.dataset import TokenDataset
    from olmax.data.packed import PackedDataset
    d = cfg.data
    kw = dict(sequence_length=seq_len, vocab_size=cfg.model.vocab_size, eos_token_id=d.eos_token_id,
              pad_token_id=d.pad_token_id, bos_token_id=d.bos_token_id, dtype=d.dtype,
              label_mask_paths=cfg.eval.heldout_label_mask_paths)
    ds = (PackedDataset(files, long_doc_strategy=d.long_doc_strategy, **kw) if d.packing == "obfd"
          else TokenDataset(files, **kw))
    ids = np.arange(len(ds) if n is None else min(n, len(ds)))
    return ds.read(ids), ds.read_label_mask(ids)


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


def safe_exp(x: float) -> float:
    return math.exp(x) if x < 700 else float("inf")


def make_eval_step(cfg: Config, mesh: jax.sharding.Mesh | None = None) -> Any:
    """``eval(params, batch) -> (CE sum, loss denominator)`` of a batch dict (``olmax.model.loss``)."""
    def ev(params, batch):
        with activation_mesh(mesh):
            batch = with_documents(batch, cfg)
            ce, _ = loss_sums(params, batch, cfg)
        return ce, loss_denominator(batch["label_mask"], whole_rows_count(cfg))
    return ev


@lru_cache(maxsize=8)
def _eval_step(cfg: Config, mesh: jax.sharding.Mesh) -> Any:
    # One compiled step per (config, mesh), shared by evaluators (both are hashable).
    return jax.jit(make_eval_step(cfg, mesh))


class HeldoutEvaluator:
    """The held-out loss of the module docstring on named sets of files: one set (``paths``, by
    default ``eval.heldout_paths``) for the loop and ``olmax eval loss``, one per domain for
    ``olmax eval domains``. ``seq_len``, ``batch_size``, ``batches`` and ``dtype`` default to
    ``data.sequence_length``, ``eval.batch_size``, ``eval.batches`` and ``data.dtype``; the mesh
    to every device on one FSDP axis."""

    def __init__(self, cfg: Config, mesh: jax.sharding.Mesh | None = None, paths: Sequence[str] | None = None,
                 prefix: str = "eval/heldout", per_batch: bool = False, *, seq_len: int | None = None,
                 batch_size: int | None = None, batches: int | None = None, dtype: str | None = None,
                 sets: Mapping[str, Sequence[str]] | None = None):
        self.cfg, self.prefix, self.per_batch = cfg, prefix, per_batch
        self.seq_len = seq_len or cfg.data.sequence_length
        self.batch_size = batch_size or cfg.eval.batch_size
        self.max_batches = cfg.eval.batches if batches is None else batches
        self.dtype = dtype or cfg.data.dtype
        if self.seq_len < 2:
            raise ConfigError(f"sequence length must be >= 2 to score a label, got {self.seq_len}")
        self.files: dict[str, list[str]] = {}
        self.batches: dict[str, np.ndarray] = {}
        self.masks: dict[str, np.ndarray] = {}
        for name, p in (sets or {"": paths or cfg.eval.heldout_paths}).items():
            field = f"--domain {name}" if sets else ("--data" if paths else "eval.heldout_paths")
            # The run's own held-out files are data paths of its config, read as data.paths are
            # ({root} and {TOKENIZER} in a mix file); files named on the command line stand alone.
            own = field == "eval.heldout_paths"
            mix = {"mix_root": cfg.data.mix_root, "mix_tokenizer": cfg.data.mix_tokenizer} if own else {}
            self.files[name] = [f for f, _ in resolve_paths(list(p), dtype=self.dtype, field=field, **mix)]
            n = self.max_batches * self.batch_size or None
            what = f"held-out files of {name!r}" if name else "held-out files"
            # The run's own held-out set (not files given to `olmax eval loss --data`): built as
            # training builds its instances, with eval.heldout_label_mask_paths.
            if not sets and paths is None and (cfg.data.packing != "none" or cfg.eval.heldout_label_mask_paths):
                windows, masks = sft_instances(cfg, self.files[name], self.seq_len, n)
                self.batches[name] = fixed_batches(windows, self.batch_size, cfg.model.vocab_size, what)
                self.masks[name] = masks[: self.batches[name].size // self.seq_len].reshape(self.batches[name].shape)
                continue
            windows = heldout_windows(self.files[name], self.dtype, self.seq_len, n)
            self.batches[name] = fixed_batches(windows, self.batch_size, cfg.model.vocab_size, what)
        mesh = mesh or make_mesh(MeshConfig(data=1, fsdp=-1, tensor=1))
        check_batch_divides(self.batch_size, mesh)
        sharding = batch_sharding(mesh)
        self._eval = _eval_step(cfg, mesh)
        # The batches never change: put them on the devices once, not at every evaluation.
        self._device = {k: [put_batch(b, sharding) for b in v] for k, v in self.batches.items()}
        self._mask = put_batch(np.ones((self.batch_size, self.seq_len), bool), sharding)
        self._masks = {k: [put_batch(m, sharding) for m in v] for k, v in self.masks.items()}

    def batch_sums(self, params: Any) -> dict[str, list[tuple[float, float]]]:
        """Per set, per batch: (sum of CE, loss denominator: the labels scored)."""
        # Dispatch every batch, then fetch all results in one transfer.
        got = jax.device_get({k: [self._eval(params, {"input_ids": b, "label_mask": self._masks[k][i]
                                                      if k in self._masks else self._mask})
                                  for i, b in enumerate(v)]
                              for k, v in self._device.items()})
        return {k: [(float(ce), float(n)) for ce, n in v] for k, v in got.items()}

    def evaluate_detailed(self, params: Any) -> dict[str, Any]:
        """Over every batch of every set: ``loss`` (nats/token), ``perplexity``, ``tokens`` (labels
        scored), ``batches``, ``per_batch_loss``, ``loss_se`` (standard error over batches, None for one)."""
        sums = [x for v in self.batch_sums(params).values() for x in v]
        ce, n = (sum(x) for x in zip(*sums))
        per = [c / m for c, m in sums]
        return {"loss": ce / n, "perplexity": safe_exp(ce / n), "tokens": int(n), "batches": len(sums),
                "per_batch_loss": per, "loss_se": mean_se(per)[1]}

    def evaluate(self, params: Any) -> dict[str, float]:
        r = self.evaluate_detailed(params)
        out = {f"{self.prefix}/CE loss": r["loss"], f"{self.prefix}/PPL": r["perplexity"]}
        if self.per_batch:
            for i, v in enumerate(r["per_batch_loss"]):
                out[PER_BATCH_FMT.format(metric=f"{self.prefix}/CE loss", i=i)] = v
        return out
