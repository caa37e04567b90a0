"""The olmax weights directory: a streamable on-disk format for a parameter tree.

Layout::

    config.yaml                            the full olmax Config (``Config.to_yaml()``)
    model-00001-of-0000N.safetensors ...   tensors named by their tree path (``embed``,
                                           ``layers.3.attn.q``, ``final_norm``, ``lm_head``)
    model.safetensors.index.json           {"metadata": {"total_size": ...}, "weight_map": {name: file}}

Tensors keep their stored dtype: fp32, or bf16 through ``ml_dtypes.bfloat16``, which
safetensors (>= 0.4) reads and writes with its numpy backend, so neither direction needs torch.
Writes hold at most one shard in memory and reads go tensor by tensor (``safe_open``), so a 7B
bf16 model converts within a few GiB of RAM. Every write goes to a temporary directory beside
the output and is renamed into place at the end: a failure leaves nothing in the output.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import ml_dtypes  # registers numpy's bfloat16, which safetensors' numpy backend needs to read BF16
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from olmax import io
from olmax.config import Config, ConfigError, ModelConfig, load_yaml
from olmax.model.params import ParamSpec, param_specs

INDEX_NAME = "model.safetensors.index.json"
CONFIG_NAME = "config.yaml"
DEFAULT_SHARD_BYTES = 2 * 1024**3

DTYPES: dict[str, np.dtype] = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}


class WeightsError(ValueError):
    """A weights directory or tensor set that does not match what the config declares."""


# --------------------------------------------------------------------------- names


def named_specs(cfg: ModelConfig) -> dict[str, ParamSpec]:
    """Flat ``{name: ParamSpec}`` in tree order (``embed``, ``layers.0.attn.q``, ...)."""
    return dict(flatten_tree(param_specs(cfg)))


def flatten_tree(tree: Any) -> list[tuple[str, Any]]:
    """``[(dotted name, leaf)]`` with dict keys and list indices joined by dots, in tree order."""
    out: list[tuple[str, Any]] = []

    def walk(prefix: str, node: Any) -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(f"{prefix}.{k}" if prefix else str(k), v)
        elif isinstance(node, (list, tuple)):
            for i, v in enumerate(node):
                walk(f"{prefix}.{i}" if prefix else str(i), v)
        else:
            out.append((prefix, node))

    walk("", tree)
    return out


def unflatten(cfg: ModelConfig, named: dict[str, Any]) -> Any:
    """Build the tree ``param_specs(cfg)`` lays out (same dicts and lists) from ``{name: leaf}``."""

    def build(prefix: str, node: Any) -> Any:
        if isinstance(node, dict):
            return {k: build(f"{prefix}.{k}" if prefix else str(k), v) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return type(node)(build(f"{prefix}.{i}" if prefix else str(i), v) for i, v in enumerate(node))
        return named[prefix]

    return build("", param_specs(cfg))


def check_tensor(name: str, shape: tuple[int, ...], specs: dict[str, ParamSpec], where: str) -> None:
    if name not in specs:
        raise WeightsError(f"{where}: unexpected tensor {name!r} (not a parameter of this model config)")
    if tuple(shape) != specs[name].shape:
        raise WeightsError(f"{where}: tensor {name!r} has shape {tuple(shape)}, the config expects {specs[name].shape}")


def check_names(found: Iterable[str], specs: dict[str, ParamSpec], where: str) -> None:
    found = set(found)
    missing = [n for n in specs if n not in found]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise WeightsError(f"{where}: missing tensor {missing[0]!r}{more}")
    extra = sorted(found - set(specs))
    if extra:
        raise WeightsError(f"{where}: unexpected tensor {extra[0]!r} (not a parameter of this model config)")


def check_reader(reader: TensorReader, specs: dict[str, ParamSpec], where: str) -> None:
    """Every name and shape of a stored tensor set against ``specs``, from the headers alone."""
    check_names(reader.names(), specs, where)
    for name in reader.names():
        check_tensor(name, reader.shape(name), specs, where)


def np_dtype(name: str | None) -> np.dtype | None:
    if name is None:
        return None
    if name not in DTYPES:
        raise ConfigError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return DTYPES[name]


def dtype_name(dt: np.dtype) -> str:
    for k, v in DTYPES.items():
        if np.dtype(dt) == v:
            return k
    raise WeightsError(f"unsupported tensor dtype {dt} (olmax stores float32 or bfloat16)")


# --------------------------------------------------------------------------- atomic directories


@contextlib.contextmanager
def atomic_dir(out_dir: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary directory beside ``out_dir``; rename it to ``out_dir`` on success, delete
    it on failure. An existing non-empty ``out_dir`` is refused (never overwritten)."""
    out = Path(out_dir)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise WeightsError(f"output directory {str(out)!r} already exists and is not empty; choose a new path")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        yield tmp
        _umask_permissions(tmp)
        if out.exists():
            out.rmdir()  # empty (checked above)
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _umask_permissions(directory: Path) -> None:
    """mkdtemp (and safetensors) create owner-only entries; give them the usual umask modes."""
    umask = os.umask(0)
    os.umask(umask)
    directory.chmod(0o777 & ~umask)
    for p in directory.iterdir():
        if p.is_file():
            p.chmod(0o666 & ~umask)


# --------------------------------------------------------------------------- sharded safetensors


def write_shards(directory: Path, named_tensors: Iterable[tuple[str, np.ndarray]], *, shard_bytes: int,
                 metadata: dict[str, str] | None = None, single_file: str | None = None,
                 always_index: bool = True, progress: Any = None) -> dict[str, str]:
    """Write tensors into ``model-0000i-of-0000N.safetensors`` shards of at most ``shard_bytes``
    (a larger tensor gets a shard of its own) plus the index. Only one shard is held in memory.

    With ``single_file`` and ``always_index=False``, a result that fits one shard is written as
    that file with no index (HF's layout for small models). Returns ``{name: file}``."""
    shard: dict[str, np.ndarray] = {}
    size = 0
    parts: list[tuple[str, list[str]]] = []   # (temporary file name, tensor names)
    total = 0
    seen: set[str] = set()

    def flush() -> None:
        nonlocal shard, size
        if not shard:
            return
        tmp_name = f"part-{len(parts):05d}.safetensors"
        save_file(shard, str(directory / tmp_name), metadata=metadata)
        parts.append((tmp_name, list(shard)))
        shard, size = {}, 0

    for i, (name, arr) in enumerate(named_tensors):
        if name in seen:
            raise WeightsError(f"tensor {name!r} written twice")
        seen.add(name)
        arr = np.ascontiguousarray(arr)
        if shard and size + arr.nbytes > shard_bytes:
            flush()
        shard[name] = arr
        size += arr.nbytes
        total += arr.nbytes
        if progress is not None:
            progress(i + 1, name)
    flush()

    weight_map: dict[str, str] = {}
    if single_file is not None and len(parts) == 1 and not always_index:
        os.replace(directory / parts[0][0], directory / single_file)
        return {n: single_file for n in parts[0][1]}
    n = len(parts)
    for i, (tmp_name, names) in enumerate(parts):
        final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        os.replace(directory / tmp_name, directory / final)
        weight_map.update({name: final for name in names})
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
    return weight_map


def _open_safetensors(path: Path) -> Any:
    """``safe_open(path)``; a truncated or garbage file is a ``WeightsError`` naming it."""
    try:
        return safe_open(str(path), "np")
    except SafetensorError as e:
        raise WeightsError(f"{path}: not a readable safetensors file ({e})") from None


def _read_index(index: Path) -> dict[str, str]:
    """The ``weight_map`` of a safetensors index: ``{"weight_map": {tensor name: shard file}, ...}``."""
    data = io.read_json_object(index, "a safetensors index", WeightsError, ' with a "weight_map" object')
    if "weight_map" not in data:
        raise WeightsError(f"{index}: not a safetensors index (no \"weight_map\")")
    weight_map = data["weight_map"]
    if not isinstance(weight_map, dict):
        raise WeightsError(f"{index}: weight_map must be an object {{tensor name: shard file}}, got "
                           f"{type(weight_map).__name__}")
    for name, file in weight_map.items():
        if not isinstance(file, str) or not file:
            raise WeightsError(f"{index}: weight_map[{name!r}] must be a shard file name, got {file!r}")
    return weight_map


class TensorReader:
    """Tensor-by-tensor access to a single ``*.safetensors`` file or a sharded set with an index.
    A shard that is not a readable safetensors file (truncated, garbage), or that lacks a tensor the
    index puts in it, is a ``WeightsError`` naming the file."""

    def __init__(self, directory: str | os.PathLike, single_file: str = "model.safetensors"):
        self.dir = Path(directory)
        index = self.dir / INDEX_NAME
        if index.exists():
            self.weight_map: dict[str, str] = _read_index(index)
        elif (self.dir / single_file).exists():
            with _open_safetensors(self.dir / single_file) as f:
                self.weight_map = {k: single_file for k in f.keys()}
        else:
            raise WeightsError(f"{str(self.dir)!r} holds neither {INDEX_NAME} nor {single_file}")
        for file in sorted(set(self.weight_map.values())):
            if not (self.dir / file).exists():
                raise WeightsError(f"{index}: shard {file!r} is missing")
        self._open: dict[str, Any] = {}
        self._stack = contextlib.ExitStack()

    def _handle(self, file: str) -> Any:
        if file not in self._open:
            self._open[file] = self._stack.enter_context(_open_safetensors(self.dir / file))
        return self._open[file]

    def _slice(self, name: str) -> Any:
        file = self.weight_map[name]
        try:
            return self._handle(file).get_slice(name)
        except SafetensorError as e:  # e.g. the index puts a tensor in a shard that lacks it
            raise WeightsError(f"{self.dir / file}: cannot read tensor {name!r} ({e})") from None

    def names(self) -> list[str]:
        return list(self.weight_map)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """safetensors dtype code: "F32", "BF16", "F16", ..."""
        return self._slice(name).get_dtype()

    def get(self, name: str) -> np.ndarray:
        # A fresh handle per tensor: safe_open memory-maps the file, and the pages a read touches
        # stay resident until the map is closed (a 7B conversion otherwise peaks at the model's size).
        path = self.dir / self.weight_map[name]
        with _open_safetensors(path) as f:
            try:
                return f.get_tensor(name)
            except SafetensorError as e:
                raise WeightsError(f"{path}: cannot read tensor {name!r} ({e})") from None

    def close(self) -> None:
        self._stack.close()
        self._open.clear()

    def __enter__(self) -> TensorReader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# --------------------------------------------------------------------------- public API


def save_weights(out_dir: str | os.PathLike, named_tensors: Iterable[tuple[str, np.ndarray]], cfg: Config,
                 shard_bytes: int = DEFAULT_SHARD_BYTES, progress: Any = None) -> Path:
    """Write an olmax weights directory atomically. Every name and shape is checked against
    ``param_specs(cfg.model)``; a missing, unexpected or misshapen tensor raises ``WeightsError``
    naming it, and nothing is left at ``out_dir``."""
    specs = named_specs(cfg.model)
    where = f"saving {str(out_dir)!r}"

    def checked() -> Iterator[tuple[str, np.ndarray]]:
        for name, arr in named_tensors:
            arr = np.asarray(arr)
            check_tensor(name, arr.shape, specs, where)
            dtype_name(arr.dtype)  # fp32 / bf16 only
            yield name, arr

    with atomic_dir(out_dir) as tmp:
        (tmp / CONFIG_NAME).write_text(cfg.to_yaml())
        weight_map = write_shards(tmp, checked(), shard_bytes=shard_bytes, metadata={"format": "olmax"},
                                  progress=progress)
        check_names(weight_map, specs, where)
    return Path(out_dir)


def is_weights_dir(path: str | os.PathLike) -> bool:
    """An olmax weights directory (a run directory holds a config.yaml too, but no safetensors)."""
    p = Path(path)
    return (p / CONFIG_NAME).is_file() and any(p.glob("*.safetensors"))


def load_config(weights_dir: str | os.PathLike) -> Config:
    path = Path(weights_dir) / CONFIG_NAME
    if not path.exists():
        raise WeightsError(f"{str(weights_dir)!r} is not an olmax weights directory (no {CONFIG_NAME})")
    return load_yaml(str(path))


def iter_weights(weights_dir: str | os.PathLike, dtype: str | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """Yield ``(name, array)`` one tensor at a time, in the order the index lists them."""
    dt = np_dtype(dtype)
    with TensorReader(weights_dir) as reader:
        for name in reader.names():
            arr = reader.get(name)
            yield name, (arr if dt is None else arr.astype(dt))


def load_weights(weights_dir: str | os.PathLike, dtype: str | None = None) -> tuple[Any, Config]:
    """Read an olmax weights directory into ``(params, Config)``; params is a tree of numpy arrays
    laid out as ``param_specs`` (place it on devices with ``jax.device_put``). Names and shapes are
    checked against the config before any tensor is read."""
    cfg = load_config(weights_dir)
    specs = named_specs(cfg.model)
    where = f"loading {str(weights_dir)!r}"
    dt = np_dtype(dtype)
    with TensorReader(weights_dir) as reader:
        check_reader(reader, specs, where)
        named = {}
        for name in specs:
            arr = reader.get(name)
            named[name] = arr if dt is None else arr.astype(dt)
    return unflatten(cfg.model, named), cfg
