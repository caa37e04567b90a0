"""Remote files: ``s3://``, ``gs://`` and ``http(s)://`` token files, mix files and run directories.

One small API over fsspec (``size``, ``read_range``, ``read_bytes``, ``put_file``, ...), used by the
data pipeline (byte-range reads: a process fetches only the instances it trains on) and by the
run mirror (:mod:`olmax.checkpoint.remote`).

Why these libraries: fsspec is what Grain, etils.epath (Orbax's path layer) and OLMo-core's
readers already sit on, and its HTTP filesystem (aiohttp) does range requests. For ``s3://`` and
``gs://`` the usual fsspec backends (s3fs, gcsfs) cannot be installed beside this project's pinned
botocore and fsspec (s3fs needs an aiobotocore that pins an older botocore; gcsfs pins fsspec to
its own release). For ``s3://`` we use Apache Arrow's C++ S3 client (``pyarrow.fs``, already
installed through ``datasets``) behind fsspec's own ``ArrowFSWrapper``, registered as fsspec's
``s3`` implementation when s3fs is absent (if installed, it is used). For ``gs://`` Arrow's GCS
client hangs on ranged reads, so a small fsspec filesystem over Google's ``google-cloud-storage``
(JSON API) is registered as ``gs`` / ``gcs``.
Checkpoints do not go through Orbax's remote paths: see :mod:`olmax.checkpoint.remote`.

Endpoints and credentials come from the standard variables: ``AWS_ENDPOINT_URL`` (or
``AWS_ENDPOINT_URL_S3``) for S3-compatible stores, ``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``
/ ``AWS_REGION``, and Google's application-default credentials for ``gs://``
(``OLMAX_GCS_ENDPOINT``, e.g. ``http://127.0.0.1:4443``, points ``gs://`` at an emulator,
without credentials).

Transient failures (HTTP 5xx and 429, connection errors, timeouts) are retried with exponential
backoff (``OLMAX_IO_RETRIES`` attempts, default 6, starting at ``OLMAX_IO_BACKOFF`` seconds,
default 0.5; a value below 1 attempt or a negative backoff is an error naming the variable);
a missing object or a refused access fails at once with a :class:`RemoteError`
naming the URL.
"""

from __future__ import annotations

import functools
import hashlib
import json
import math
import os
import posixpath
import threading
import time
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np

from olmax.extras import require

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
    assert protocol == "s3", protocol  # gs:// has its own client (_gcs_class)
    return pafs.S3FileSystem(**_s3_options())


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
            if path.startswith(f"{protocol}://"):
                path = path[len(protocol) + 3:]
            return path.rstrip("/")

    _Arrow.protocol = (protocol,)
    _Arrow.__name__ = f"Arrow{protocol.upper()}FileSystem"
    return _Arrow


def _gcs_client():
    from google.cloud import storage
    ep = os.environ.get("OLMAX_GCS_ENDPOINT")
    if ep:
        if not ep.startswith(("http://", "https://")):
            raise RemoteError(f"OLMAX_GCS_ENDPOINT={ep!r}: give the URL with its scheme, e.g. http://127.0.0.1:4443")
        from google.auth.credentials import AnonymousCredentials
        return storage.Client(project=os.environ.get("GOOGLE_CLOUD_PROJECT") or "olmax",
                              credentials=AnonymousCredentials(), client_options={"api_endpoint": ep.rstrip("/")})
    import google.auth.exceptions
    try:
        return storage.Client()
    except google.auth.exceptions.DefaultCredentialsError as e:
        raise RemoteError(f"gs://: no Google credentials ({e}); run `gcloud auth application-default login` or "
                          "set GOOGLE_APPLICATION_CREDENTIALS (OLMAX_GCS_ENDPOINT for an emulator)") from None


class GcsFileSystem:
    """fsspec's ``gs://`` / ``gcs://`` over Google's own Python client (``google-cloud-storage``).

    pyarrow's GCS client hangs on a ranged read (``read_at``) before it sends the request (seen
    with pyarrow 26 against an emulator and against a minimal server), and gcsfs pins fsspec to
    its own release, so ``gs://`` uses the official client. The client's own retries are off
    (``retry=None``): every call is retried by :func:`with_retries`, as for ``s3://``.
    Credentials: Google's application-default credentials; ``OLMAX_GCS_ENDPOINT`` (e.g.
    ``http://127.0.0.1:4443``) points it at an emulator or test server, anonymously.

    Only the methods: fsspec is an optional extra, so :func:`_gcs_class` makes the filesystem fsspec
    registers (this class over fsspec's ``AbstractFileSystem``) when ``gs://`` is first used.
    """

    protocol = ("gs", "gcs")
    root_marker = ""
    TIMEOUT = (20, 120)  # (connect, read) seconds per request

    def __init__(self, **kwargs: Any):
        super().__init__(**kwargs)
        self._local = threading.local()  # one client (one HTTP session) per thread

    @property
    def client(self):
        c = getattr(self._local, "client", None)
        if c is None:
            c = self._local.client = _gcs_client()
        return c

    @classmethod
    def _strip_protocol(cls, path: Any) -> str:
        path = str(path)
        for p in ("gs://", "gcs://"):
            if path.startswith(p):
                path = path[len(p):]
        return path.rstrip("/")

    def _split(self, path: str) -> tuple[str, str]:
        bucket, _, key = self._strip_protocol(path).partition("/")
        if not bucket:
            raise RemoteError(f"gs://{path}: no bucket in the URL (gs://BUCKET/PATH)")
        return bucket, key

    def _blob(self, path: str):
        bucket, key = self._split(path)
        if not key:
            raise IsADirectoryError(f"gs://{bucket} is a bucket, not an object")
        return self.client.bucket(bucket).blob(key)

    @staticmethod
    def _file(bucket: str, blob) -> dict[str, Any]:
        return {"name": f"{bucket}/{blob.name}", "size": int(blob.size or 0), "type": "file",
                "generation": blob.generation}

    def _list(self, bucket: str, prefix: str, delimiter: str | None, max_results: int | None = None):
        it = self.client.list_blobs(bucket, prefix=prefix, delimiter=delimiter, max_results=max_results,
                                    retry=None, timeout=self.TIMEOUT)
        blobs = list(it)
        return blobs, sorted(it.prefixes)

    def info(self, path: str, **kwargs: Any) -> dict[str, Any]:
        from google.api_core import exceptions as gexc
        bucket, key = self._split(path)
        if key:
            try:
                blob = self.client.bucket(bucket).get_blob(key, retry=None, timeout=self.TIMEOUT)
            except gexc.NotFound:  # a missing bucket
                raise FileNotFoundError(f"gs://{bucket}/{key}: no such bucket") from None
            if blob is not None:
                return self._file(bucket, blob)
        blobs, prefixes = self._list(bucket, f"{key}/" if key else "", "/", max_results=1)
        if blobs or prefixes or not key:
            return {"name": f"{bucket}/{key}".rstrip("/"), "size": 0, "type": "directory"}
        raise FileNotFoundError(f"gs://{bucket}/{key}")

    def exists(self, path: str, **kwargs: Any) -> bool:
        try:
            self.info(path)  # other errors than a missing object are raised (and retried)
            return True
        except FileNotFoundError:
            return False

    def ls(self, path: str, detail: bool = True, **kwargs: Any):
        bucket, key = self._split(path)
        prefix = f"{key}/" if key else ""
        blobs, prefixes = self._list(bucket, prefix, "/")
        out = [self._file(bucket, b) for b in blobs if b.name != prefix]
        out += [{"name": f"{bucket}/{p.rstrip('/')}", "size": 0, "type": "directory"} for p in prefixes]
        if not out and key:
            out = [self.info(path)]  # a file, or FileNotFoundError
        return out if detail else [e["name"] for e in out]

    def find(self, path: str, maxdepth: int | None = None, withdirs: bool = False, detail: bool = False,
             **kwargs: Any):
        bucket, key = self._split(path)
        blobs, _ = self._list(bucket, f"{key}/" if key else "", None)
        out = {f"{bucket}/{b.name}": self._file(bucket, b) for b in blobs if not b.name.endswith("/")}
        return out if detail else sorted(out)

    def cat_file(self, path: str, start: int | None = None, end: int | None = None, **kwargs: Any) -> bytes:
        if start is not None and start < 0 or end is not None and end < 0:
            raise ValueError("negative offsets are not supported for gs://")
        if end is not None and end <= (start or 0):
            return b""
        ranged = start is not None or end is not None
        return self._blob(path).download_as_bytes(start=start, end=None if end is None else end - 1,
                                                  checksum=None if ranged else "auto", retry=None,
                                                  timeout=self.TIMEOUT)

    def get_file(self, rpath: str, lpath: str, **kwargs: Any) -> None:
        self._blob(rpath).download_to_filename(os.fspath(lpath), retry=None, timeout=self.TIMEOUT)

    def put_file(self, lpath: str, rpath: str, **kwargs: Any) -> None:
        self._blob(rpath).upload_from_filename(os.fspath(lpath), retry=None, timeout=self.TIMEOUT)

    def pipe_file(self, path: str, value: bytes, **kwargs: Any) -> None:
        self._blob(path).upload_from_string(value, retry=None, timeout=self.TIMEOUT)

    def rm(self, path: str, recursive: bool = False, **kwargs: Any) -> None:
        from google.api_core import exceptions as gexc
        bucket, key = self._split(path)
        names = [key] if key else []
        if recursive:
            names += [b.name for b in self._list(bucket, f"{key}/" if key else "", None)[0]]
        for name in names:
            try:
                self.client.bucket(bucket).blob(name).delete(retry=None, timeout=self.TIMEOUT)
            except gexc.NotFound:
                pass  # already gone (or the prefix was no object itself)


def _gcs_class():
    from fsspec.spec import AbstractFileSystem
    return type("GcsFileSystem", (GcsFileSystem, AbstractFileSystem), {})


_registered = False
_lock = threading.Lock()


def register_filesystems() -> None:
    """Make ``fsspec.filesystem("s3"/"gs")`` work without s3fs/gcsfs (``gs``: always olmax's own)."""
    global _registered
    with _lock:
        if _registered:
            return
        import importlib.util

        import fsspec
        if importlib.util.find_spec("s3fs") is None:
            fsspec.register_implementation("s3", _wrapper_class("s3"), clobber=True)
        gcs = _gcs_class()
        for name in gcs.protocol:
            fsspec.register_implementation(name, gcs, clobber=True)
        _registered = True


# What each protocol's filesystem imports (the 'remote' extra).
_NEEDS = {"s3": ("fsspec", "pyarrow"), "gs": ("fsspec", "google.cloud.storage"), "http": ("fsspec", "aiohttp"),
          "https": ("fsspec", "aiohttp")}


@functools.cache
def _fs_for(protocol: str, pid: int, env: tuple):  # pid: a forked loader worker builds its own clients
    require("remote", *_NEEDS.get(protocol, ("fsspec",)))
    import fsspec
    register_filesystems()
    return fsspec.filesystem(protocol, skip_instance_cache=True)


_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_REGION", "AWS_DEFAULT_REGION", "AWS_ACCESS_KEY_ID",
        "OLMAX_GCS_ENDPOINT", "GOOGLE_APPLICATION_CREDENTIALS", "GOOGLE_CLOUD_PROJECT", "STORAGE_EMULATOR_HOST")


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
        creds = ("Google application-default credentials (gcloud auth application-default login)"
                 if url.startswith(("gs://", "gcs://")) else "AWS_* variables" if url.startswith("s3://")
                 else "URL's access rules")
        return RemoteError(f"{url}: access denied (HTTP {status}) while {what}; check the credentials "
                           f"({creds}) and the object's permissions")
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
    """An error of the storage or the network (classified by :func:`_permanent`), not a bug."""
    if isinstance(e, (OSError, TimeoutError)):  # requests' errors are OSErrors too
        return True
    kinds: list[type] = []
    try:
        import aiohttp
        kinds.append(aiohttp.ClientError)
    except ImportError:
        pass
    try:  # google-cloud-storage (gs://): HTTP errors carry .code; a failed token refresh
        from google.api_core.exceptions import GoogleAPICallError
        from google.auth.exceptions import TransportError
        kinds += [GoogleAPICallError, TransportError]
    except ImportError:
        pass
    return isinstance(e, tuple(kinds))


def _env_number(name: str, default: str, kind: type, minimum: float) -> Any:
    raw = os.environ.get(name, default)
    try:
        value = kind(raw)
    except ValueError:
        value = None
    if value is None or not math.isfinite(value) or value < minimum:
        what = "a whole number of attempts, at least 1" if kind is int else f"a number of seconds, at least {minimum}"
        raise RemoteError(f"{name}={raw!r}: must be {what} (default {default})")
    return value


def with_retries(url: str, what: str, fn: Callable[[], T]) -> T:
    """``fn()``, retried with exponential backoff on transient errors; permanent ones named by URL."""
    attempts = _env_number("OLMAX_IO_RETRIES", "6", int, 1)
    delay = _env_number("OLMAX_IO_BACKOFF", "0.5", float, 0.0)
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
    raise AssertionError("unreachable: attempts >= 1")


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


def read_json_object(path: str | os.PathLike, what: str, error: type[Exception], expected: str = "") -> dict:
    """A JSON file whose top level must be an object: invalid JSON or another value is ``error``
    naming the file as not ``what`` (``expected`` adds what the object should hold)."""
    try:
        data = json.loads(read_text(os.fspath(path)))
    except ValueError as e:  # JSONDecodeError and UnicodeDecodeError
        raise error(f"{path}: not {what} (invalid JSON: {e})") from None
    if not isinstance(data, dict):
        raise error(f"{path}: not {what} (expected a JSON object{expected}, got {type(data).__name__})")
    return data


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


def check_local_output(path: str | os.PathLike, flag: str, error: type[Exception]) -> None:
    """Refuse, before any work, a local output file path that is a folder or lies in a missing one
    (``error`` naming ``flag`` and the path)."""
    path = os.fspath(path)
    parent = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise error(f"{flag} {path}: is a folder; give a file path")
    if not os.path.isdir(parent):
        raise error(f"{flag} {path}: the folder {parent} does not exist")


def write_local_atomically(path: str | os.PathLike, content: bytes | str | Callable[[Any], None]) -> None:
    """Write a local file whole or not at all: ``content`` (bytes, text, or a function writing to the
    open binary file) goes to a temporary sibling renamed over ``path``; on any failure the temporary
    file is removed and an earlier ``path`` is left as it was."""
    path = os.fspath(path)
    folder, name = os.path.split(path)
    tmp = os.path.join(folder, f".{name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            if callable(content):
                content(f)
            else:
                f.write(content.encode() if isinstance(content, str) else content)
        os.replace(tmp, path)
    except BaseException:
        if os.path.isfile(tmp):
            os.remove(tmp)
        raise


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
