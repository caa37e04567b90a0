"""The global order of instances, and THE ONE PLACE WHERE INDICES ARE SPLIT.

Global order (OLMo-core ``NumpyFSLDataLoader._build_global_indices``): for epoch e (from 1),
``idx = arange(N, uint32)`` shuffled in place by ``Generator(PCG64(seed + e))``, truncated to whole
global batches and reshaped to ``(batches_per_epoch, global_batch)``. Global step k (0-based,
across epochs) is row ``k % batches_per_epoch`` of epoch ``1 + k // batches_per_epoch``. Nothing
here depends on how many hosts, devices or loader workers exist.

Splitting, done here and nowhere else (``process_share`` and ``worker_steps``):

- process r of R reads columns ``r::R`` of global batch row k (OLMo-core:
  ``indices[:, dp_rank::dp_world_size]``);
- loader worker w of W reads steps ``start + w, start + w + W, ...`` (rows ``w::W``; OLMo-core
  slices batches by worker the same way, and Grain's ``mp_prefetch`` gives worker w the
  elements ``w::W`` and interleaves them back in order).

Downstream code receives a process's share and must never shard it again: a second sharding
(sampler per host *and* loader ``ShardOptions``) turned one epoch into resampling with
replacement in the published OLMo 3 reproduction. ``olmax.data.audit`` proves the split.
"""

from __future__ import annotations

import fcntl
import os
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np

from olmax.data import DataError


def build_epoch_order(num_instances: int, seed: int, epoch: int) -> np.ndarray:
    """The full permutation of epoch ``epoch``: one uint32 array, shuffled in place (no copies)."""
    if epoch < 1:
        raise DataError(f"epochs start at 1, got {epoch}")
    idx = np.arange(num_instances, dtype=np.uint32)
    np.random.Generator(np.random.PCG64(seed + epoch)).shuffle(idx)
    return idx


def _cache_problem(path: Path, num_instances: int) -> str | None:
    """Why the cached permutation at ``path`` cannot be used (None when it can). Besides the size, one
    pass over the values checks what a permutation of ``0..N-1`` must satisfy: every id below N and the
    ids summing to N(N-1)/2, so a damaged file is rebuilt instead of crashing the loader later."""
    if not path.is_file():
        return "is not a file" if path.exists() else "is missing"
    size = path.stat().st_size
    if size != num_instances * 4:
        return f"has {size} bytes, not {num_instances * 4}"
    perm = np.memmap(path, dtype="<u4", mode="r", shape=(num_instances,))
    try:
        top = int(perm.max())
        if top >= num_instances:
            return f"holds instance id {top} outside [0, {num_instances})"
        if int(perm.sum(dtype=np.uint64)) != num_instances * (num_instances - 1) // 2:
            return f"is not a permutation of 0..{num_instances - 1}"
    finally:
        del perm
    return None


class GlobalOrder:
    """Global batches per step, with each epoch's permutation cached memory-mapped on disk.

    A cache file holds the whole permutation (like OLMo-core's ``global_indices`` file), keyed by
    the dataset fingerprint, instance count, seed and epoch; a restart checks its values (one
    pass, :func:`_cache_problem`) and maps it instead of recomputing it; a damaged one is rebuilt,
    with a note on stderr. ``cache_dir=None`` keeps the order in memory (tests, small data).
    """

    def __init__(self, num_instances: int, global_batch_size: int, seed: int, *,
                 cache_dir: str | Path | None = None, key: str = ""):
        if global_batch_size <= 0:
            raise DataError(f"train.global_batch_size must be positive, got {global_batch_size}")
        if global_batch_size > num_instances:
            raise DataError(f"train.global_batch_size={global_batch_size} is larger than the epoch "
                            f"({num_instances} instances): not one whole batch")
        self.num_instances, self.global_batch_size, self.seed = num_instances, global_batch_size, seed
        self.batches_per_epoch = num_instances // global_batch_size
        self.cache_dir = Path(cache_dir) if cache_dir is not None else None
        self.key = key
        self._epochs: dict[int, np.ndarray] = {}

    def __getstate__(self) -> dict:
        # Workers reopen the memory map (or, without a cache dir, rebuild) lazily.
        return {**self.__dict__, "_epochs": {}}

    def locate(self, step: int) -> tuple[int, int]:
        """``(epoch, row)`` of global step ``step``."""
        if step < 0:
            raise DataError(f"steps start at 0, got {step}")
        return 1 + step // self.batches_per_epoch, step % self.batches_per_epoch

    def cache_path(self, epoch: int) -> Path | None:
        if self.cache_dir is None:
            return None
        return self.cache_dir / (f"order-{self.key[:16] or 'nokey'}-n{self.num_instances}-seed{self.seed}"
                                 f"-epoch{epoch}.npy")

    def epoch(self, epoch: int) -> np.ndarray:
        """Epoch ``epoch`` as ``(batches_per_epoch, global_batch)`` uint32 (read-only)."""
        if epoch not in self._epochs:
            if len(self._epochs) >= 2:  # keep at most two epochs mapped (boundary crossing)
                self._epochs.pop(min(self._epochs))
            perm = self._load_or_build(epoch)
            n = self.batches_per_epoch * self.global_batch_size
            self._epochs[epoch] = perm[:n].reshape(self.batches_per_epoch, self.global_batch_size)
        return self._epochs[epoch]

    def _load_or_build(self, epoch: int) -> np.ndarray:
        path = self.cache_path(epoch)
        if path is None:
            perm = build_epoch_order(self.num_instances, self.seed, epoch)
            perm.flags.writeable = False
            return perm
        if _cache_problem(path, self.num_instances) is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            # One builder at a time (processes and Grain workers share the cache); write to a
            # temporary file and rename, so a reader never sees a partial file.
            with open(path.with_suffix(".lock"), "w") as lock:
                fcntl.flock(lock, fcntl.LOCK_EX)
                problem = _cache_problem(path, self.num_instances)  # another process may have built it
                if problem is not None:
                    if path.exists():
                        # The order is a pure function of (seed, epoch): rebuilding it is safe.
                        print(f"note: order cache {path} {problem}; rebuilding it", file=sys.stderr)
                    perm = build_epoch_order(self.num_instances, self.seed, epoch)
                    tmp = path.with_suffix(f".tmp{os.getpid()}")
                    try:
                        with open(tmp, "wb") as f:
                            perm.tofile(f)
                        os.replace(tmp, path)
                    except BaseException:
                        tmp.unlink(missing_ok=True)
                        raise
                    del perm
        return np.memmap(path, dtype="<u4", mode="r", shape=(self.num_instances,))

    def batches(self, steps: np.ndarray | range | list[int]) -> np.ndarray:
        """Global batches ``[len(steps), global_batch]`` for global steps ``steps``."""
        steps = np.asarray(steps, dtype=np.int64).reshape(-1)
        out = np.empty((len(steps), self.global_batch_size), dtype=np.uint32)
        epochs = 1 + steps // self.batches_per_epoch
        for e in np.unique(epochs):
            sel = epochs == e
            out[sel] = self.epoch(int(e))[steps[sel] % self.batches_per_epoch]
        return out


# A share function maps (order, global steps, process index, process count) to the instance
# ids that process reads, ``[len(steps), global_batch // process_count]``. It is injectable so the
# audit can be shown to catch a wrong one.
ShareFn = Callable[[GlobalOrder, np.ndarray, int, int], np.ndarray]


def process_share(order: GlobalOrder, steps: np.ndarray, process_index: int, process_count: int) -> np.ndarray:
    """THE split across processes: process r of R takes columns ``r::R`` of each global batch."""
    if order.global_batch_size % process_count:
        raise DataError(f"train.global_batch_size={order.global_batch_size} is not divisible by the "
                        f"{process_count} data processes")
    return order.batches(steps)[:, process_index::process_count]


def worker_steps(start: int, stop: int, worker: int, workers: int) -> range:
    """THE split across loader workers: worker w of W reads steps ``start + w :: W`` (W=0: in-process)."""
    return range(start + worker, stop, max(workers, 1))
