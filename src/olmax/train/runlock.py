"""One trainer per run directory.

``RUN/.olmax-train.lock`` is held with an exclusive ``flock`` for as long as ``olmax train`` runs
(process 0 of a multi-process run). A second trainer on the same directory refuses at once, naming
the holder (pid, host, start time), instead of both writing checkpoints and metrics over each other.
The kernel drops the lock when its process dies, even by ``kill -9``: the file a killed trainer
leaves behind is stale and the next trainer takes it over (nothing to clean up by hand). Local run
directories only: an ``s3://`` or ``gs://`` run has no lock that spans machines.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

from olmax.config import ConfigError

LOCK_NAME = ".olmax-train.lock"


class RunDirectoryBusy(ConfigError):
    """Another live process trains in this run directory."""


class RunLock:
    def __init__(self, run_dir: str | os.PathLike):
        self.path = Path(run_dir) / LOCK_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(self.path)
            os.close(fd)
            raise RunDirectoryBusy(f"run directory {self.path.parent} is in use by another olmax train ({holder}; "
                                   f"lock {self.path}): wait for it to finish or stop it, or use another "
                                   "--run-dir") from None
        # Ours now (a file left by a killed trainer is overwritten): say who holds it.
        info = {"pid": os.getpid(), "host": socket.gethostname(),
                "since": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(info) + "\n").encode(), 0)
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            fcntl.flock(self._fd, fcntl.LOCK_UN)
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _describe(path: Path) -> str:
    try:
        info = json.loads(path.read_text() or "{}")
        return f"pid {info['pid']} on {info['host']} since {info['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not written its pid yet"
