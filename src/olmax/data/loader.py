"""Grain loader of this process's share of each global batch, data state, global jax.Array.

Why Grain: its ``MapDataset`` is random access by index, so the pipeline is indexed by the
global step and resuming is "start at step k" (no iterator replay). ``mp_prefetch`` gives worker
w the steps ``w::W`` and interleaves their outputs back in order, which is exactly
``order.worker_steps``: batches are identical for any worker count. We never pass Grain
``ShardOptions``: the per-process split happens once, in ``order.process_share``.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from olmax.config import Config
from olmax.data import DataError
from olmax.data.dataset import TokenDataset, Validate, dirty_instances
from olmax.data.order import GlobalOrder, ShareFn, process_share
from olmax.data.packed import PackedDataset

if TYPE_CHECKING:
    import jax


@dataclass
class DataState:
    """Where the data stream stands; saved atomically with the model state.

    ``batches_processed`` counts global batches over all epochs (resume = start at that step);
    ``epoch`` is the epoch of the next batch; ``tokens_processed`` counts global tokens.
    ``dataset`` holds the fingerprint's inputs, so a mismatch can say what changed.
    """

    seed: int
    epoch: int
    batches_processed: int
    tokens_processed: int
    fingerprint: str
    global_batch_size: int
    dataset: dict = field(default_factory=dict)
    # [basename, sha256 of sampled byte ranges] per file (data.content_fingerprint); empty when off.
    content: list = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> DataState:
        names = {f.name for f in dataclasses.fields(cls)}
        required = {f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING
                    and f.default_factory is dataclasses.MISSING}
        if set(d) - names or required - set(d):
            raise DataError(f"not a data state: unknown keys {sorted(set(d) - names)}, "
                            f"missing keys {sorted(required - set(d))}")
        return cls(**d)


def build_dataset(cfg: Config, *, validate: Validate = "sample") -> TokenDataset | PackedDataset:
    """The training dataset ``data.packing`` asks for (both with ``data.label_mask_paths``)."""
    if cfg.data.packing == "obfd":
        return PackedDataset.from_config(cfg, validate=validate)
    return TokenDataset.from_config(cfg, validate=validate)


def state_mismatches(saved: DataState, dataset: TokenDataset) -> list[str]:
    """What differs between a saved state's dataset and ``dataset``, in words."""
    now = dataset.describe()
    old = saved.dataset
    out = []
    for k in ("class", "vocab_size", "eos_token_id", "pad_token_id", "bos_token_id", "dtype", "sequence_length",
              "long_doc_strategy", "label_masks"):
        if old.get(k) != now.get(k) and (k in old or k in now):
            out.append(f"{k} changed: {old[k]} -> {now[k]}")
    if "files" in old:
        # Align the file lists (mixes repeat basenames such as 000000.npy) to name what changed.
        a, b = old["files"], now["files"]
        ops = difflib.SequenceMatcher(a=[n for n, _ in a], b=[n for n, _ in b], autojunk=False).get_opcodes()
        added = [n for tag, _, _, j1, j2 in ops if tag in ("insert", "replace") for n, _ in b[j1:j2]]
        removed = [n for tag, i1, i2, _, _ in ops if tag in ("delete", "replace") for n, _ in a[i1:i2]]
        resized = [f"{x[0]} ({x[1]} -> {y[1]} bytes)" for tag, i1, i2, j1, j2 in ops if tag == "equal"
                   for x, y in zip(a[i1:i2], b[j1:j2]) if x[1] != y[1]]
        for what, names in (("files added", added), ("files removed", removed), ("files resized", resized)):
            if names:
                out.append(f"{what}: {', '.join(names[:5])}"
                           + (f" and {len(names) - 5} more" if len(names) > 5 else ""))
    if not out and saved.fingerprint != dataset.fingerprint:
        out.append(f"fingerprint changed: {saved.fingerprint[:12]} -> {dataset.fingerprint[:12]}")
    return out


class StepSource:
    """Random access by global step k: this process's share of global batch k (picklable)."""

    def __init__(self, dataset: TokenDataset, order: GlobalOrder, process_index: int, process_count: int, *,
                 share_fn: ShareFn = process_share, repetition_filter: tuple[int, int, int] | None = None):
        self.dataset, self.order = dataset, order
        self.process_index, self.process_count = process_index, process_count
        self.share_fn, self.repetition_filter = share_fn, repetition_filter

    def ids(self, step: int) -> np.ndarray:
        return np.asarray(self.share_fn(self.order, np.array([step]), self.process_index, self.process_count))[0]

    def __call__(self, step: int) -> dict[str, np.ndarray]:
        ids = self.ids(int(step))
        tokens = self.dataset.read(ids, step=int(step))
        if self.dataset.label_masked:
            mask = self.dataset.read_label_mask(ids)  # label-mask files; False on packing's padding
        else:
            mask = np.ones(tokens.shape, dtype=bool)
        if self.repetition_filter is not None:
            lo, hi, count = self.repetition_filter
            # OLMo-core keeps dirty instances but ignores all their labels (instance_mask).
            mask[dirty_instances(tokens, min_period=lo, max_period=hi, max_count=count)] = False
        return {"input_ids": tokens, "instance_ids": ids.astype(np.int64), "label_mask": mask,
                "step": np.int64(step)}


def die_with_parent(worker_index: int = 0, worker_count: int = 0, *, parent: int | None = None) -> None:
    """Grain worker init: exit when the trainer that started this worker is gone (``kill -9``
    leaves no chance to stop its workers, which otherwise live on under PID 1 holding their
    memory, and keep multiprocessing's resource tracker alive with them). A daemon thread watches
    the parent pid, once a second.

    ``parent`` is the trainer's pid, taken in the trainer when the pipeline is built: a spawned
    worker still importing when the trainer is killed runs this hook already orphaned, and
    ``os.getppid()`` read then would name PID 1 (or a subreaper) and never change."""
    import signal
    import threading
    import time
    parent = os.getppid() if parent is None else parent

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os.kill(os.getpid(), signal.SIGKILL)

    if os.getppid() != parent:
        watch()  # orphaned before this hook ran
    threading.Thread(target=watch, name="olmax-die-with-parent", daemon=True).start()


class DataLoader:
    """Iterates this process's batches for global steps ``start_step .. stop_step - 1``.

    Each batch is a dict: ``input_ids`` int32 ``[local_batch, L]``, ``instance_ids`` int64
    ``[local_batch]``, ``label_mask`` bool ``[local_batch, L]`` (False on every token of an instance
    the repetition filter marks dirty; labels are the inputs shifted left, which the trainer
    does), and ``step`` (the global step, to assert against the trainer's step).

    Resume: pass ``resume=state`` (a saved :class:`DataState`); the loader starts at
    ``state.batches_processed`` and refuses a changed dataset unless
    ``allow_fingerprint_mismatch``. Pass ``process_index=jax.process_index()`` and
    ``process_count=jax.process_count()`` on multi-host runs.
    """

    def __init__(self, cfg: Config, *, process_index: int = 0, process_count: int = 1, start_step: int = 0,
                 stop_step: int | None = None, resume: DataState | None = None,
                 allow_fingerprint_mismatch: bool = False, cache_dir: str | Path | None = None,
                 dataset: TokenDataset | None = None, share_fn: ShareFn = process_share,
                 validate: Validate = "sample"):
        if not 0 <= process_index < process_count:
            raise DataError(f"process index {process_index} is outside 0..{process_count - 1}")
        self.cfg = cfg
        self.dataset = dataset or build_dataset(cfg, validate=validate)
        B = cfg.train.global_batch_size
        if B % process_count:
            raise DataError(f"train.global_batch_size={B} is not divisible by the {process_count} data processes")
        # the system temp dir, as OLMo-core's default work_dir
        cache = cache_dir or cfg.data.cache_dir or Path(tempfile.gettempdir()) / "olmax-order-cache"
        self.order = GlobalOrder(len(self.dataset), B, cfg.data.seed, cache_dir=cache, key=self.dataset.fingerprint)
        if resume is not None:
            self._check_resume(resume, allow_fingerprint_mismatch)
            if start_step not in (0, resume.batches_processed):
                raise DataError(f"start_step={start_step} disagrees with the data state "
                                f"(batches_processed={resume.batches_processed})")
            start_step = resume.batches_processed
        self.start_step = self._next = start_step
        self.stop_step = cfg.train.steps if stop_step is None else stop_step
        d = cfg.data
        filt = ((d.repetition_min_period, d.repetition_max_period, d.repetition_max_count)
                if d.repetition_filter else None)
        self.source = StepSource(self.dataset, self.order, process_index, process_count, share_fn=share_fn,
                                 repetition_filter=filt)
        self._iter: Any = None

    def _check_resume(self, s: DataState, allow: bool) -> None:
        d, B = self.cfg.data, self.cfg.train.global_batch_size
        if s.seed != d.seed:
            raise DataError(f"data.seed={d.seed} but the saved data state used seed {s.seed}; "
                            f"set data.seed={s.seed} to resume the same order")
        changes = state_mismatches(s, self.dataset)
        if not changes and s.content and self.cfg.data.content_fingerprint:
            now = self.dataset.content_hashes
            if len(now) == len(s.content):
                # A file read remotely on either side has no content hash to compare.
                edited = [n for (n, h), (_, h2) in zip(s.content, now) if h is not None and h2 is not None and h != h2]
                if edited:
                    files = {os.path.basename(f.path): f.path for f in self.dataset.files}
                    changes.append("contents changed (same name and size, sampled bytes differ): "
                                   + ", ".join(files.get(n, n) for n in edited[:5])
                                   + (f" and {len(edited) - 5} more" if len(edited) > 5 else ""))
        if changes and not allow:
            raise DataError("the dataset differs from the one in the saved data state: " + "; ".join(changes)
                            + ". Restore the original files, start a new --run-dir, or pass "
                            "--allow-fingerprint-mismatch to resume anyway (the data order may differ)")
        if s.global_batch_size != B:
            raise DataError(f"train.global_batch_size={B} but the saved data state used {s.global_batch_size} "
                            f"instances per batch; step {s.batches_processed} would skip or repeat data")

    def state(self) -> DataState:
        """The state after the last batch this loader yielded."""
        B, L = self.cfg.train.global_batch_size, self.cfg.data.sequence_length
        return DataState(seed=self.cfg.data.seed, epoch=self.order.locate(self._next)[0],
                         batches_processed=self._next, tokens_processed=self._next * B * L,
                         fingerprint=self.dataset.fingerprint, global_batch_size=B, dataset=self.dataset.describe(),
                         content=self.dataset.content_hashes if self.cfg.data.content_fingerprint else [])

    def batch(self, step: int) -> dict[str, np.ndarray]:
        """Batch of global step ``step``, read in this process (random access, no state change)."""
        return self.source(step)

    def _pipeline(self):
        import grain
        d = self.cfg.data
        ds = grain.MapDataset.range(self._next, self.stop_step).map(self.source)
        # Threads read ahead inside a process; prefetch=0 reads synchronously.
        it = ds.to_iter_dataset(grain.ReadOptions(num_threads=1 if d.prefetch else 0,
                                                  prefetch_buffer_size=d.prefetch))
        if d.workers > 0:
            from absl import flags
            if not flags.FLAGS.is_parsed():  # Grain's workers read absl flags; use their defaults
                flags.FLAGS.mark_as_parsed()
            # Batches travel pickled, not in shared memory: a few MB per step is cheap to copy,
            # and Grain's shared-memory blocks outlive an interpreter that exits mid-stream.
            it = grain.experimental.WithOptionsIterDataset(it, grain.experimental.DatasetOptions(min_shm_size=1 << 62))
            it = it.mp_prefetch(grain.MultiprocessingOptions(num_workers=d.workers,
                                                             per_worker_buffer_size=max(d.prefetch, 1)),
                                worker_init_fn=functools.partial(die_with_parent, parent=os.getpid()))
        return iter(it)

    def __iter__(self) -> Iterator[dict[str, np.ndarray]]:
        self.close()
        self._iter = self._pipeline()
        for batch in self._iter:
            if int(batch["step"]) != self._next:  # cheap guard against any reordering
                raise RuntimeError(f"loader produced step {int(batch['step'])}, expected {self._next}")
            self._next += 1
            yield batch
        self.close()

    def close(self) -> None:
        if self._iter is not None and hasattr(self._iter, "close"):
            self._iter.close()
        self._iter = None

    def __enter__(self) -> DataLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def global_batch_to_device(local: Any, mesh: jax.sharding.Mesh) -> Any:
    """Assemble this process's share (an array or a dict of arrays) into global ``jax.Array``s.

    The batch dimension is sharded as ``olmax.sharding.batch_sharding`` says (over the data
    axes); other dimensions are replicated. Rows of the global array are grouped by process
    (process r's share, i.e. columns ``r::R`` of global batch k, lands on r's devices): the same
    instances as batch k, in a per-process arrangement. Scalars (``step``) are left on the host.
    """
    import jax  # here only: Grain's worker processes import this module and need no JAX

    from olmax.sharding import batch_sharding

    def put(x: Any) -> Any:
        x = np.asarray(x)
        if x.ndim == 0:
            return x
        shape = (x.shape[0] * jax.process_count(), *x.shape[1:])
        return jax.make_array_from_process_local_data(batch_sharding(mesh, x.ndim), x, shape)

    return {k: put(v) for k, v in local.items()} if isinstance(local, dict) else put(local)
