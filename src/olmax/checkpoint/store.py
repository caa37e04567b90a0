"""Checkpoints of the training state, on top of Orbax.

Numbering contract (pinned by tests; the published reproduction got this wrong):

    Checkpoint ``N`` holds the state after ``N`` optimizer updates, and a run resumed from it
    trains global batch index ``N`` (0-based) next. Checkpoint 0 is the initial state.

The MaxText reproduction wrote directory N after iteration N (0-based) had run, so the model
resumed at update N+1 while the loader restarted at batch N: every later step used the previous
step's batch, invisibly on the loss curve. With this contract the loop saves ``step`` = number of
updates applied so far, and on resume sets both its update counter and its data position to N.

Layout: ``RUN_DIR/checkpoints/<N>/{state,meta}``. ``state`` is the pytree of arrays (params,
optimizer state, skip-step history, ...), ``meta`` a JSON item (data state, RNG, resolved config,
dataset fingerprint, versions). Both are items of one Orbax checkpoint, so they are committed
together: Orbax writes into ``<N>.orbax-checkpoint-tmp`` and renames it to ``<N>`` only when
everything is on disk, so a checkpoint is complete or invisible.

Nothing already written is destroyed: saving a step that already exists is skipped (``save``
returns False and logs a warning); it never overwrites.
"""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import threading
import zlib
from collections.abc import Mapping
from pathlib import Path
from types import FrameType
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from olmax import io
from olmax.checkpoint.remote import RemoteCheckpoints, check_multiprocess
from olmax.config import CheckpointConfig, Config, ConfigError, model_differences

log = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
# Keys of the meta item that this module reads (the loop writes them).
META_STEP = "step"
META_CONFIG = "config_yaml"             # resolved config, YAML text (Config.to_yaml())
META_FINGERPRINT = "fingerprint"        # dataset fingerprint

_STATE, _META = "state", "meta"
_MAX_LISTED = 12


class _DropReadOnlyWarnings(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not ("read_only=True" in msg or "is read only" in msg)


class CheckpointError(ConfigError):
    """A checkpoint that cannot be used for this run; the message names the field or parameter."""


class CorruptCheckpointError(CheckpointError):
    """A checkpoint whose files are unreadable, missing, truncated or fail their checksums (the
    trainer then falls back to the previous complete checkpoint)."""


class Checkpointer:
    """Saves and restores ``RUN_DIR/checkpoints/<N>`` with Orbax (see the module docstring)."""

    def __init__(self, run_dir: str | os.PathLike, ckpt_cfg: CheckpointConfig, *, read_only: bool = False):
        self.cfg, self.read_only = ckpt_cfg, read_only
        # s3:// and gs:// run directories: Orbax writes a local staging copy, committed checkpoints
        # are uploaded with a marker written last (olmax.checkpoint.remote).
        self.remote = None
        if io.is_remote(run_dir):
            check_multiprocess(jax.process_count(), str(run_dir))
            self.remote = RemoteCheckpoints(str(run_dir))
            self.remote.local.mkdir(parents=True, exist_ok=True)
            if not read_only and jax.process_index() == 0:  # a reader must not touch a live run's uploads
                self.remote.drop_uncommitted_local(self.remote.committed_steps())
            self.directory = self.remote.local
        else:
            self.directory = Path(run_dir).absolute() / CHECKPOINT_DIR
        self.where = self.remote.root if self.remote is not None else str(self.directory)  # for messages
        self._unsealed: list[int] = []  # committed (or in flight) here, checksums not yet written
        pp = ocp.checkpoint_managers
        # Orbax's policies express "last K plus every M-th" exactly: a step survives if any keeps it.
        policies = [pp.LatestN(ckpt_cfg.keep_last)]
        if ckpt_cfg.keep_every is not None:
            policies.append(pp.EveryNSteps(ckpt_cfg.keep_every))
        # Orbax warns on every read-only manager that it is read-only: that is the point here.
        quiet = _DropReadOnlyWarnings() if read_only else None
        absl_logger = logging.getLogger("absl")
        if quiet:
            absl_logger.addFilter(quiet)
        try:
            options = ocp.CheckpointManagerOptions(
                enable_async_checkpointing=ckpt_cfg.async_save,
                preservation_policy=pp.AnyPreservationPolicy(policies),
                # A leftover <N>.orbax-checkpoint-tmp is a save that died; it is never a checkpoint.
                # Readers (tools) must not delete it: it may be a live run's save in progress.
                cleanup_tmp_directories=not read_only,
                read_only=read_only,
                create=not read_only,
            )
            # A reader restores through the PyTree handler (the Standard one writes the same files),
            # which can leave part of the state on disk: export and eval read the parameters alone.
            state_handler = ocp.PyTreeCheckpointHandler() if read_only else ocp.StandardCheckpointHandler()
            self._manager = ocp.CheckpointManager(
                self.directory, options=options,
                item_handlers={_STATE: state_handler, _META: ocp.JsonCheckpointHandler()})
        finally:
            if quiet:
                absl_logger.removeFilter(quiet)

    # ------------------------------------------------------------------ queries

    def should_save(self, step: int) -> bool:
        """True on the regular interval (the loop adds SIGTERM/SIGINT and the final step itself)."""
        return step % self.cfg.interval == 0

    def all_steps(self) -> list[int]:
        """Steps of complete checkpoints, ascending. Includes this process's saves still in
        flight (they are committed or fail; ``restore`` waits for them). For a remote run
        directory: the checkpoints whose upload was committed."""
        if self.remote is not None:
            return self.remote.committed_steps()
        return sorted(self._manager.all_steps())

    def latest_step(self) -> int | None:
        steps = self.all_steps()
        return steps[-1] if steps else None

    # ------------------------------------------------------------------ save

    def save(self, step: int, state: Mapping[str, Any], meta: Mapping[str, Any], force: bool = False) -> bool:
        """Save the state after ``step`` updates (resume trains batch ``step`` next).

        Saves only when ``should_save(step)`` or ``force``. Returns False (and writes nothing)
        when skipped, including when checkpoint ``step`` already exists: an existing checkpoint
        is never overwritten. With ``async_save`` this returns once the arrays are copied to host
        memory, so the caller may donate or overwrite ``state`` right away.
        """
        if step < 0:
            raise ValueError(f"checkpoint step must be >= 0 (updates applied), got {step}")
        if not force and not self.should_save(step):
            return False
        if step in self.all_steps():
            log.warning("checkpoint %d already exists in %s; not overwriting it", step, self.where)
            return False
        if META_STEP in meta and meta[META_STEP] != step:
            raise ValueError(f"meta[{META_STEP!r}]={meta[META_STEP]!r} disagrees with the checkpoint step {step}")
        meta = {META_STEP: step, **meta}
        _check_json(meta, "meta")  # fail here, not in a background thread
        if self.cfg.checksums:
            self.wait()  # seal the previous save (Orbax would wait for it here anyway)
        try:
            self._manager.save(step, args=ocp.args.Composite(
                **{_STATE: ocp.args.StandardSave(dict(state)), _META: ocp.args.JsonSave(meta)}), force=True)
        except Exception as e:
            raise self._save_error(e, step) from e
        self._unsealed.append(step)
        if not self.cfg.async_save or self.remote is not None:
            self.wait()  # commit and seal: the upload copies the committed, checksummed checkpoint
        if self.remote is not None and jax.process_index() == 0:
            self.remote.upload(step)
            self.remote.prune(self.cfg.keep_last, self.cfg.keep_every)
        return True

    def _ensure_local(self, step: int) -> None:
        """Download a remote checkpoint into the staging folder (process 0; the folder is shared)."""
        if self.remote is None:
            return
        fetched = self.remote.fetch(step) if jax.process_index() == 0 else True
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices(f"olmax fetch checkpoint {step}")
        if fetched or step not in self._manager.all_steps():  # e.g. fetched by another reader
            self._manager.reload()

    def wait(self) -> None:
        """Block until asynchronous saves are committed (re-raises their errors), then write
        their checksums."""
        try:
            self._manager.wait_until_finished()
        except Exception as e:
            raise self._save_error(e, self._unsealed[-1] if self._unsealed else None) from e
        self._seal()

    def poll(self) -> None:
        """Seal (write the checksums of) saves that committed in the background, without waiting
        for one in flight: the training loop calls this every step, so a committed checkpoint is
        protected from its commit on, not only once the next save starts."""
        # Multi-process: each process would decide alone, and the wait may synchronise them all.
        if (self._unsealed and self.cfg.checksums and jax.process_count() == 1
                and not self._manager.is_saving_in_progress()):
            self.wait()

    def _save_error(self, e: Exception, step: int | None) -> CheckpointError:
        """One line for a failed save (a full disk, a quota, permissions): what, where, and that
        the older checkpoints are untouched (Orbax commits by renaming a finished tmp folder)."""
        self._unsealed = []
        msg = str(e)
        known = re.search(r"No space left on device|Disk quota exceeded|File too large|Permission denied|"
                          r"Read-only file system", msg)
        reason = known.group(0) if known else _short(e)
        what = f"checkpoint {step}" if step is not None else "a checkpoint"
        return CheckpointError(f"could not write {what} in {self.directory}: {reason}. The older checkpoints are "
                               "intact; free space (or fix the folder) and run the same command to resume")

    def close(self) -> None:
        self.wait()
        self._manager.close()

    # ------------------------------------------------------------------ integrity

    def _seal(self) -> None:
        """Write ``checksums.p<r>.json`` (CRC32 and size of each file this process owns) into each
        checkpoint this Checkpointer committed. Written after Orbax's commit and atomically (tmp
        file + rename): a checkpoint killed in between has no checksums and is restored unverified."""
        steps, self._unsealed = self._unsealed, []
        if not self.cfg.checksums:
            return
        for step in steps:
            d = self.directory / str(step)
            if not d.is_dir():
                continue  # already rotated away
            sums = {str(f.relative_to(d)): [f.stat().st_size, _crc32(f)] for f in _owned_files(d)}
            path = d / _checksum_name()
            tmp = path.with_name(path.name + ".tmp")
            with open(tmp, "w") as fh:
                json.dump({"format": "olmax-checksums-v1", "algorithm": "crc32", "files": sums}, fh)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)

    def set_aside(self, step: int) -> Path | None:
        """Rename damaged checkpoint ``step`` to ``<step>.damaged[-k]`` (process 0; nothing is
        deleted), so the resumed run can write that step again and rotation counts only good ones."""
        src = self.directory / str(step)
        dst = None
        if jax.process_index() == 0 and src.exists():
            dst = self.directory / f"{step}.damaged"
            k = 1
            while dst.exists():
                k += 1
                dst = self.directory / f"{step}.damaged-{k}"
            os.replace(src, dst)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils
            multihost_utils.sync_global_devices(f"olmax_set_aside_{step}")
        self._manager.reload()
        return dst

    def verify(self, step: int) -> bool:
        """Check this process's files of checkpoint ``step`` against its checksums. Returns False
        when the checkpoint has none (written with ``checksums`` off, or killed before they were
        written); raises ``CorruptCheckpointError`` naming the first bad file."""
        d = self.directory / str(step)
        path = d / _checksum_name()
        if not path.exists():
            return False
        try:
            files = json.loads(path.read_text())["files"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CorruptCheckpointError(f"checkpoint {d}: its checksum file {path.name} is unreadable ({e})") from None
        for rel, (size, crc) in files.items():
            f = d / rel
            if not f.is_file():
                raise CorruptCheckpointError(f"checkpoint {d}: file {rel} is missing")
            if f.stat().st_size != size:
                raise CorruptCheckpointError(f"checkpoint {d}: file {rel} has {f.stat().st_size} bytes, "
                                             f"{size} when written (truncated?)")
            if _crc32(f) != crc:
                raise CorruptCheckpointError(f"checkpoint {d}: file {rel} fails its CRC32 checksum (corrupted on disk)")
        return True

    def __enter__(self) -> Checkpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ restore

    def _complete_step(self, step: int | None) -> int:
        """``step`` (default: the latest) if it is a complete checkpoint, on local disk from here on."""
        steps = self.all_steps()
        step = steps[-1] if step is None and steps else step
        if step is None or step not in steps:
            raise CheckpointError(f"no complete checkpoint{'' if step is None else f' {step}'} in {self.where} "
                                  f"(available: {steps or 'none'})")
        self._ensure_local(step)
        return step

    def restore(self, step: int, abstract_state: Mapping[str, Any], *, verify: bool = True
                ) -> tuple[dict[str, Any], dict[str, Any]]:
        """Restore checkpoint ``step`` into the shapes, dtypes and shardings of ``abstract_state``.

        ``abstract_state`` is a pytree of ``jax.ShapeDtypeStruct`` whose ``.sharding`` may use a
        different mesh or device count than at save time (elastic resume); a leaf without a
        sharding is restored replicated on all devices. Any difference in tree structure, shape
        or dtype is a ``CheckpointError`` naming the parameters (never a silent cast or pad). A
        ``read_only`` Checkpointer may be given some top-level entries (``{"params": ...}``) alone.
        """
        self.wait()
        self._complete_step(step)
        if self.cfg.checksums and verify:  # verify=False: the caller has just verified it
            self.verify(step)
        where = self.directory / str(step)
        try:
            stored = self._manager.item_metadata(step)[_STATE]
        except Exception as e:  # Orbax/TensorStore raise many types for missing or damaged files
            raise CorruptCheckpointError(f"checkpoint {where} is unreadable: {_short(e)}") from e
        if stored is None:
            raise CorruptCheckpointError(f"checkpoint {where} is unreadable: its state/ item is missing")
        partial = self.read_only and set(abstract_state) != set(stored.tree)  # a reader's subset
        _check_against_metadata(step, {k: v for k, v in stored.tree.items() if k in abstract_state or not partial},
                                abstract_state)
        target = jax.tree.map(_with_sharding, dict(abstract_state))
        state_args = (ocp.args.PyTreeRestore(target, ocp.checkpoint_utils.construct_restore_args(target),
                                             partial_restore=partial)
                      if self.read_only else ocp.args.StandardRestore(target))
        try:
            out = self._manager.restore(step, args=ocp.args.Composite(
                **{_STATE: state_args, _META: ocp.args.JsonRestore()}))
        except Exception as e:
            raise CorruptCheckpointError(f"checkpoint {where} is unreadable: {_short(e)}") from e
        return dict(out[_STATE]), dict(out[_META] or {})

    @staticmethod
    def read_meta(run_dir: str | os.PathLike, step: int | None = None) -> dict[str, Any]:
        """The meta item of checkpoint ``step`` (default: the latest), without reading arrays."""
        ckpt = Checkpointer(run_dir, CheckpointConfig(), read_only=True)
        try:
            step = ckpt._complete_step(step)
            try:
                out = ckpt._manager.restore(step, args=ocp.args.Composite(**{_META: ocp.args.JsonRestore()}))
                meta = out[_META]
            except Exception as e:  # a damaged or missing meta/metadata file
                raise CorruptCheckpointError(
                    f"checkpoint {ckpt.directory / str(step)}: its meta item (meta/metadata) is unreadable: "
                    f"{_short(e)}") from e
            if not isinstance(meta, dict) or not meta:
                raise CorruptCheckpointError(
                    f"checkpoint {ckpt.directory / str(step)}: its meta item (meta/metadata) is missing or empty")
            return dict(meta)
        finally:
            ckpt.close()

    # ------------------------------------------------------------------ compatibility

    @staticmethod
    def check_compatible(meta: Mapping[str, Any], cfg: Config, *, fingerprint: str | None = None) -> None:
        """Raise ``CheckpointError`` unless the checkpoint's resolved model config is ``cfg.model``
        (``olmax.config.model_differences``) and, when ``fingerprint`` is given, the dataset
        fingerprint matches. Call it before building or compiling anything."""
        step = meta.get(META_STEP, "?")
        saved = config_from_meta(meta).model
        diffs = model_differences(saved, cfg.model)
        if diffs:
            lines = "; ".join(f"model.{k}: checkpoint {a!r}, config {b!r}" for k, a, b in diffs)
            raise CheckpointError(
                f"checkpoint {step} is of a different model: {lines}. Set these fields back "
                "(--set key=value) or train in a new --run-dir")
        if fingerprint is not None:
            old = meta.get(META_FINGERPRINT)
            if old != fingerprint:
                raise CheckpointError(
                    f"checkpoint {step} was trained on another dataset: fingerprint checkpoint {old!r}, "
                    f"current data {fingerprint!r}. Restore the original data.paths (and sequence length, "
                    "dtype, token ids), or start a new --run-dir")


# ---------------------------------------------------------------------- helpers

def config_from_meta(meta: Mapping[str, Any]) -> Config:
    """The resolved config a checkpoint was written with."""
    step = meta.get(META_STEP, "?")
    if not isinstance(meta.get(META_CONFIG), str):
        raise CheckpointError(f"checkpoint {step} has no resolved config (meta[{META_CONFIG!r}]); "
                              "cannot check that it belongs to this model")
    return Config.from_yaml(meta[META_CONFIG], where=f"checkpoint {step}'s config")


def _checksum_name() -> str:
    return f"checksums.p{jax.process_index()}.json"


def _owner(rel: Path) -> int:
    """The process that wrote a file of a checkpoint: ``ocdbt.process_K`` and
    ``array_metadatas/process_K`` are process K's, everything else the primary's."""
    for part in rel.parts:
        for prefix in ("ocdbt.process_", "process_"):
            if part.startswith(prefix) and part[len(prefix):].isdigit():
                return int(part[len(prefix):])
    return 0


def _owned_files(d: Path) -> list[Path]:
    me = jax.process_index()
    return sorted(f for f in d.rglob("*") if f.is_file() and not f.name.startswith("checksums.p")
                  and _owner(f.relative_to(d)) == me)


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            crc = zlib.crc32(chunk, crc)
    return crc


def _short(e: BaseException) -> str:
    """The first line of an exception's message (TensorStore's run to many lines)."""
    msg = str(e).strip().splitlines()
    first = msg[0].split(" See full TensorStore details")[0][:300] if msg else ""
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def _with_sharding(leaf: Any) -> Any:
    if isinstance(leaf, jax.ShapeDtypeStruct) and leaf.sharding is None:
        # Replicated over every device (global, so this is also right with several processes).
        mesh = Mesh(np.asarray(jax.devices()), ("all",))
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=NamedSharding(mesh, P()))
    return leaf


def _name(path: tuple[Any, ...]) -> str:
    return ".".join(ocp.tree.str_keypath(path))  # the names Orbax gives stored arrays


def _listed(names: list[str]) -> str:
    more = f" (+{len(names) - _MAX_LISTED} more)" if len(names) > _MAX_LISTED else ""
    return ", ".join(names[:_MAX_LISTED]) + more


def _check_against_metadata(step: int, stored_tree: Any, abstract: Any) -> None:
    """Compare names, shapes and dtypes before Orbax does (its errors do not name the parameter)."""
    stored = {getattr(m, "name", None): m for m in jax.tree.leaves(stored_tree)}
    stored.pop(None, None)
    wanted = {_name(p): leaf for p, leaf in jax.tree_util.tree_flatten_with_path(abstract)[0]}
    problems = []
    missing = sorted(set(wanted) - set(stored))
    extra = sorted(set(stored) - set(wanted))
    if missing:
        problems.append(f"not in the checkpoint: {_listed(missing)}")
    if extra:
        problems.append(f"in the checkpoint but not in this run's state: {_listed(extra)}")
    mismatched = []
    for name in sorted(set(wanted) & set(stored)):
        want, have = wanted[name], stored[name]
        if not hasattr(want, "shape"):
            continue  # Python scalars restore as whatever was saved
        ws, hs = tuple(want.shape), tuple(getattr(have, "shape", ()) or ())
        wd, hd = np.dtype(want.dtype), getattr(have, "dtype", None)
        if ws != hs:
            mismatched.append(f"{name} shape: checkpoint {hs}, requested {ws}")
        elif hd is not None and np.dtype(hd) != wd:
            mismatched.append(f"{name} dtype: checkpoint {np.dtype(hd).name}, requested {wd.name}")
    if mismatched:
        problems.append("; ".join(mismatched[:_MAX_LISTED]) + (
            f" (+{len(mismatched) - _MAX_LISTED} more)" if len(mismatched) > _MAX_LISTED else ""))
    if problems:
        raise CheckpointError(f"checkpoint {step} does not match this run's state: " + " | ".join(problems)
                              + ". Is it a checkpoint of another model or another olmax version?")


def _check_json(obj: Any, path: str) -> None:
    """Name the first value json cannot store (e.g. bytes, numpy ints) instead of json's bare error."""
    if isinstance(obj, Mapping):
        for k, v in obj.items():
            if not isinstance(k, str):
                raise TypeError(f"{path}: key {k!r} is not a string (JSON object keys must be)")
            _check_json(v, f"{path}[{k!r}]")
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _check_json(v, f"{path}[{i}]")
    elif not (obj is None or isinstance(obj, (str, bool, int, float))):
        raise TypeError(f"{path} is a {type(obj).__name__}, which is not JSON-serialisable "
                        "(convert numpy/jax scalars with int()/float(), arrays with .tolist())")
    if path == "meta":
        json.dumps(obj)


# ---------------------------------------------------------------------- signals

class StopSignal:
    """SIGTERM/SIGINT set a flag so the loop can save a checkpoint and exit cleanly.

    A SIGINT after a stop was requested raises ``KeyboardInterrupt`` (Ctrl-C twice = now).
    The previous handlers come back on ``close()`` or on leaving the ``with`` block. Handlers
    can only be installed from the main thread; elsewhere this is inert (``requested`` stays False).
    """

    def __init__(self, signals: tuple[int, ...] = (signal.SIGTERM, signal.SIGINT)):
        self.signum: int | None = None
        self._old: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for s in signals:
                self._old[s] = signal.signal(s, self._handle)
        else:
            log.warning("StopSignal created outside the main thread: SIGTERM/SIGINT will not be caught")

    @property
    def requested(self) -> bool:
        return self.signum is not None

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signum is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt
        if self.signum is None:
            self.signum = signum
        # os.write, not print/logging: a signal handler may interrupt a write to the same stream.
        os.write(2, f"\nolmax: received {signal.Signals(signum).name}; saving a checkpoint and stopping "
                    "after this step (Ctrl-C again to abort now)\n".encode())

    def close(self) -> None:
        for s, old in self._old.items():
            # None: the old handler was not set from Python; the default is the closest we can do.
            signal.signal(s, old if old is not None else signal.SIG_DFL)
        self._old = {}

    def __enter__(self) -> StopSignal:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
