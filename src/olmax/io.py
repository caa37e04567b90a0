"""Remote files: ``s3://``, ``gs://`` and ``http(s)://`` token files, mix files and run directories.

One small API over fsspec (``size``, ``read_range``, ``read_bytes``, ``put_file``, ...), used by the
data pipeline (byte-range reads: a process fetches only the instances it trains on) and by the
run mirror (:mod:`olmax.checkpoint.remote`).

Why these libraries: fsspec is what Grain, etils.epath (Orbax's path layer) and OLMo-core's
readers already sit on, and its HTTP filesystem (aiohttp) does range requests. For ``s3://`` and
``gs://`` the usual fsspec backends (s3fs, gcsfs) cannot be installed beside this project's pinned
botocore and fsspec (s3fs needs an aiobotocore that pins an older botocore; gcsfs pins fsspec to
its own release), so we use Apache Arrow's C++ S3 and GCS clients (``pyarrow.fs``, already
installed through ``datasets``) behind fsspec's own ``ArrowFSWrapper``, registered as fsspec's
``s3`` / ``gs`` implementations only when s3fs / gcsfs are absent (if installed, they are used).
Checkpoints do not go through Orbax's remote paths: see :mod:`olmax.checkpoint.remote`.

Endpoints and credentials come from the standard variables: ``AWS_ENDPOINT_URL`` (or
``AWS_ENDPOINT_URL_S3``) for S3-compatible stores, ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``
/ ``AWS_REGION``, and Google's application-default credentials for ``gs://``
(``OLMAX_GCS_ENDPOINT`` points ``gs://`` at an emulator).

Transient failures (HTTP 5xx and 429, connection errors, timeouts) are retried with exponential
backoff (``OLMAX_IO_RETRIES`` attempts, default 6, starting at ``OLMAX_IO_BACKOFF`` seconds,
default 0.5); a missing object or a refused access fails at once with a :class:`RemoteError`
naming the URL.
"""

from __future__ import annotations

import functools
import hashlib
import os
import posixpath
import threading
import time
from typing import Any, Callable, TypeVar

import numpy as np

REMOTE_PREFIXES = ("s3://", "gs://", "gcs://", "http://", "https://")
T = TypeVar("T")


class RemoteError(ValueError):
    """A remote object that cannot be read or written; the message names the URL."""


def is_remote(path: str | os.PathLike) -> bool:
    return str(path).startswith(REMOTE_PREFIXES)


def join(base: str, *parts: str) -> str:
    """``posixpath.join`` that keeps ``scheme://`` intact (works for local paths too)."""
    if not is_remote(base):
        return os.path.join(base, *parts)
    scheme, rest = base.split("://", 1)
    return f"{scheme}://" + posixpath.join(rest, *parts)


def parent(url: str) -> str:
    if not is_remote(url):
        return os.path.dirname(url)
    scheme, rest = url.split("://", 1)
    return f"{scheme}://" + posixpath.dirname(rest.rstrip("/"))


# --------------------------------------------------------------------------- file systems


def _s3_options() -> dict[str, Any]:
    opts: dict[str, Any] = {}
    ep = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if ep:
        scheme, _, host = ep.partition("://")
        opts.update(endpoint_override=host.rstrip("/") if host else ep, scheme=scheme if host else "https")
    region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
    if region:
        opts["region"] = region
    return opts


def _arrow_fs(protocol: str):
    import pyarrow.fs as pafs
    if protocol == "s3":
        return pafs.S3FileSystem(**_s3_options())
    opts: dict[str, Any] = {}
    ep = os.environ.get("OLMAX_GCS_ENDPOINT")
    if ep:
        scheme, _, host = ep.partition("://")
        opts.update(endpoint_override=host, scheme=scheme, anonymous=True)
    return pafs.GcsFileSystem(**opts)


def _wrapper_class(protocol: str):
    from fsspec.implementations.arrow import ArrowFSWrapper

    class _Arrow(ArrowFSWrapper):
        """fsspec over ``pyarrow.fs`` for one protocol (constructed without arguments, as etils does)."""
        protocol_name = protocol

        def __init__(self, **kwargs: Any):
            super().__init__(_arrow_fs(protocol), **kwargs)

        @classmethod
        def _strip_protocol(cls, path: Any) -> str:
            path = str(path)
            for p in (f"{protocol}://", "gcs://" if protocol == "gs" else None):
                if p and path.startswith(p):
                    path = path[len(p):]
            return path.rstrip("/")

    _Arrow.protocol = (protocol, "gcs") if protocol == "gs" else (protocol,)
    _Arrow.__name__ = f"Arrow{protocol.upper()}FileSystem"
    return _Arrow


_registered = False
_lock = threading.Lock()


def register_filesystems() -> None:
    """Make ``fsspec.filesystem("s3"/"gs")`` (and so etils.epath and Orbax) work without s3fs/gcsfs."""
    global _registered
    with _lock:
        if _registered:
            return
        import importlib.util

        import fsspec
        for protocol, module in (("s3", "s3fs"), ("gs", "gcsfs")):
            if importlib.util.find_spec(module) is None:
                cls = _wrapper_class(protocol)
                for name in cls.protocol:
                    fsspec.register_implementation(name, cls, clobber=True)
        _registered = True


@functools.lru_cache(maxsize=None)
def _fs_for(protocol: str, pid: int, env: tuple):  # pid: a forked loader worker builds its own clients
    import fsspec
    register_filesystems()
    return fsspec.filesystem(protocol, skip_instance_cache=True)


_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ACCESS_KEY_ID",
        "OLMAX_GCS_ENDPOINT")


def filesystem(url: str):
    """(fsspec filesystem, path as that filesystem names it)."""
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    if protocol == "gcs":
        protocol = "gs"
    fs = _fs_for(protocol, os.getpid(), tuple(os.environ.get(k) for k in _ENV))
    return fs, (url if protocol in ("http", "https") else fs._strip_protocol(url))


# --------------------------------------------------------------------------- errors and retries


def _status(e: BaseException) -> int | None:
    s = getattr(e, "status", None) or getattr(e, "code", None)
    if isinstance(s, int):
        return s
    msg = str(e)
    for code in (403, 401, 404, 429, 500, 502, 503, 504):
        if f"{code}" in msg and ("HTTP" in msg or "response code" in msg or "status" in msg.lower()):
            return code
    if "ACCESS_DENIED" in msg or "AccessDenied" in msg:
        return 403
    return None


def _chain(e: BaseException) -> list[BaseException]:
    out: list[BaseException] = []
    while e is not None and e not in out and len(out) < 8:
        out.append(e)
        e = e.__cause__ or e.__context__
    return out


def _permanent(url: str, e: BaseException, what: str) -> RemoteError | None:
    """The error to raise at once (not retried), or None for a transient failure."""
    # fsspec's HTTP client turns a refused HEAD into FileNotFoundError; the status is in the cause.
    status = next((s for s in map(_status, _chain(e)) if s is not None), None)
    if status in (401, 403):
        return RemoteError(f"{url}: access denied (HTTP {status}) while {what}; check the credentials "
                           "(AWS_* variables, gcloud application-default login) and the object's permissions")
    if status is not None and (status >= 500 or status == 429):
        return None  # the server's trouble, not the object's absence: retry
    if isinstance(e, FileNotFoundError) or status == 404 or "NoSuchKey" in str(e) or "NoSuchBucket" in str(e):
        return RemoteError(f"{url}: no such object ({what}); check the path, bucket and data.paths")
    if isinstance(e, (IsADirectoryError, NotADirectoryError, PermissionError)):
        return RemoteError(f"{url}: {e} ({what})")
    if status is not None and 400 <= status < 500 and status != 429:
        return RemoteError(f"{url}: HTTP {status} while {what}: {e}")
    return None


def _io_error(e: BaseException) -> bool:
    if isinstance(e, (OSError, TimeoutError)):
        return True
    try:
        import aiohttp
        return isinstance(e, aiohttp.ClientError)
    except ImportError:
        return False


def with_retries(url: str, what: str, fn: Callable[[], T]) -> T:
    """``fn()``, retried with exponential backoff on transient errors; permanent ones named by URL."""
    attempts, delay = int(os.environ.get("OLMAX_IO_RETRIES", "6")), float(os.environ.get("OLMAX_IO_BACKOFF", "0.5"))
    for attempt in range(1, attempts + 1):
        try:
            return fn()
        except RemoteError:
            raise
        except Exception as e:  # noqa: BLE001 - classified below, re-raised with the URL
            if not _io_error(e):
                raise  # a bug, not the network: no retry
            perm = _permanent(url, e, what)
            if perm is not None:
                raise perm from e
            if attempt == attempts:
                raise RemoteError(f"{url}: {what} failed after {attempts} attempts: {type(e).__name__}: {e}") from e
            time.sleep(delay * 2 ** (attempt - 1))
    raise AssertionError("unreachable")


# --------------------------------------------------------------------------- reads


def size(url: str) -> int:
    """Object size in bytes, from metadata (HEAD), never by downloading."""
    if not is_remote(url):
        return os.path.getsize(url)
    fs, path = filesystem(url)

    def get() -> int:
        info = fs.info(path)
        if info.get("type") == "directory":
            raise IsADirectoryError("is a folder, not a file")
        s = info.get("size")
        if s is None:
            raise RemoteError(f"{url}: the server does not report the size (no Content-Length)")
        return int(s)
    return with_retries(url, "reading its size", get)


def exists(url: str) -> bool:
    if not is_remote(url):
        return os.path.exists(url)
    fs, path = filesystem(url)
    try:
        return bool(with_retries(url, "checking it exists", lambda: fs.exists(path)))
    except RemoteError:
        return False


def read_range(url: str, start: int, end: int, nbytes: int | None = None) -> bytes:
    """Bytes ``[start, end)`` with one range request (``nbytes``: the object's size, if known)."""
    if end <= start:
        return b""
    fs, path = filesystem(url)
    arrow = hasattr(fs, "fs") and type(fs).__name__.startswith("Arrow")

    def get() -> bytes:
        if arrow:
            with fs.fs.open_input_file(path) as f:
                data = f.read_at(end - start, start)
        else:
            data = fs.cat_file(path, start=start, end=end)
        if len(data) != end - start:
            raise OSError(f"short read: got {len(data)} of {end - start} bytes (status 503-like)")
        return data
    return with_retries(url, f"reading bytes {start}..{end}", get)


def read_bytes(url: str) -> bytes:
    if not is_remote(url):
        with open(url, "rb") as f:
            return f.read()
    fs, path = filesystem(url)
    return with_retries(url, "reading it", lambda: fs.cat_file(path))


def read_text(url: str) -> str:
    return read_bytes(url).decode()


# --------------------------------------------------------------------------- writes (run mirror)


def put_file(local: str | os.PathLike, url: str) -> None:
    fs, path = filesystem(url)
    with_retries(url, "uploading", lambda: fs.put_file(os.fspath(local), path))


def get_file(url: str, local: str | os.PathLike) -> None:
    fs, path = filesystem(url)
    tmp = f"{os.fspath(local)}.part"
    os.makedirs(os.path.dirname(os.fspath(local)) or ".", exist_ok=True)
    with_retries(url, "downloading", lambda: fs.get_file(path, tmp))
    os.replace(tmp, local)


def write_bytes(url: str, data: bytes) -> None:
    fs, path = filesystem(url)
    with_retries(url, "writing", lambda: fs.pipe_file(path, data))


def list_files(url: str) -> dict[str, int]:
    """``{relative path: size}`` of every object under the prefix ``url`` (empty if none)."""
    fs, path = filesystem(url)

    def get() -> dict[str, int]:
        try:
            found = fs.find(path, detail=True)
        except FileNotFoundError:
            return {}
        base = path.rstrip("/") + "/"
        return {k[len(base):]: int(v.get("size") or 0) for k, v in found.items()
                if k.startswith(base) and v.get("type") != "directory"}
    return with_retries(url, "listing", get)


def list_dirs(url: str) -> list[str]:
    """Names of the immediate sub-folders of ``url``."""
    fs, path = filesystem(url)

    def get() -> list[str]:
        try:
            entries = fs.ls(path, detail=True)
        except FileNotFoundError:
            return []
        return [posixpath.basename(e["name"].rstrip("/")) for e in entries if e.get("type") == "directory"]
    return with_retries(url, "listing", get)


def remove(url: str) -> None:
    fs, path = filesystem(url)
    with_retries(url, "deleting", lambda: fs.rm(path, recursive=True) if fs.exists(path) else None)


# --------------------------------------------------------------------------- token arrays


class RemoteArray:
    """A read-only 1-D token array over a remote file: ``a[i:j]`` is one range request.

    With ``cache_dir``, reads go through fixed ``block_bytes`` blocks kept under
    ``cache_dir/<hash of URL and size>/`` (written atomically), so a second epoch or run reads
    nothing remote; blocks are fetched only when an instance in them is read.
    Picklable (Grain workers reopen their own clients).
    """

    def __init__(self, url: str, dtype: np.dtype | str, nbytes: int, cache_dir: str | None = None,
                 block_bytes: int = 1 << 24):
        self.url, self.dtype, self.nbytes = url, np.dtype(dtype).newbyteorder("<"), nbytes
        self.cache_dir, self.block_bytes = cache_dir, block_bytes
        self.shape = (nbytes // self.dtype.itemsize,)

    def __len__(self) -> int:
        return self.shape[0]

    def _bytes(self, a: int, b: int) -> bytes:
        if self.cache_dir is None:
            return read_range(self.url, a, b, self.nbytes)
        bs = self.block_bytes
        folder = os.path.join(self.cache_dir, hashlib.sha256(f"{self.url}\0{self.nbytes}".encode()).hexdigest()[:24])
        parts = []
        for blk in range(a // bs, (b - 1) // bs + 1):
            f = os.path.join(folder, f"{blk:08d}")
            lo, hi = blk * bs, min((blk + 1) * bs, self.nbytes)
            if os.path.exists(f) and os.path.getsize(f) == hi - lo:
                with open(f, "rb") as fh:
                    data = fh.read()
            else:
                data = read_range(self.url, lo, hi, self.nbytes)
                os.makedirs(folder, exist_ok=True)
                tmp = f"{f}.{os.getpid()}.tmp"
                with open(tmp, "wb") as fh:
                    fh.write(data)
                os.replace(tmp, f)
            parts.append(data[max(a, lo) - lo: min(b, hi) - lo])
        return b"".join(parts)

    def __getitem__(self, key: int | slice) -> Any:
        n = self.shape[0]
        if isinstance(key, slice):
            start, stop, step = key.indices(n)
            if step != 1:
                raise IndexError("RemoteArray supports contiguous slices only")
            stop = max(stop, start)
            item = self.dtype.itemsize
            return np.frombuffer(self._bytes(start * item, stop * item), dtype=self.dtype)
        i = int(key) + (n if int(key) < 0 else 0)
        if not 0 <= i < n:
            raise IndexError(f"index {key} outside a file of {n} tokens")
        return self[i:i + 1][0]
