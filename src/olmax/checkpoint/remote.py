"""Run directories and checkpoints on ``s3://`` and ``gs://``.

Orbax 0.12's array writer (TensorStore) only knows local paths and ``gs://``, and object stores
have no atomic directory rename, so a remote run directory is a *mirror*: training writes into a
local staging folder exactly as for a local run (Orbax's atomic tmp-dir rename included), and
olmax copies each finished checkpoint up, then writes ``checkpoints/<N>/_OLMAX_COMMITTED`` (the
list of the checkpoint's files and sizes) last. Only checkpoints with that marker exist for
olmax: an upload cut short (a crash, a preemption, a full quota) is never picked as the newest,
and the next save or resume on any machine ignores it. Old remote checkpoints are deleted marker
first, so a half-deleted one is invisible too. Small run files (``config.yaml``,
``run_info.json``, ``metrics.jsonl``, ``tensorboard/``, instance traces) are uploaded after every
checkpoint and at the end; on start they are downloaded, so a run continues on a new machine.

The staging folder is ``$OLMAX_STAGING_DIR/<hash of the URL>`` (default ``~/.cache/olmax/staging``).
Multi-process runs must point ``OLMAX_STAGING_DIR`` at a file system every host shares (Orbax's
multi-host save commits from process 0 over all hosts' files); process 0 uploads.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

from olmax import io

COMMITTED = "_OLMAX_COMMITTED"
CHECKPOINTS = "checkpoints"
_NOT_MIRRORED = ("checkpoints", "order_cache")


def staging_dir(url: str) -> Path:
    url = url.rstrip("/")
    name = url.split("://", 1)[-1].rstrip("/").rsplit("/", 1)[-1] or "run"
    root = Path(os.environ.get("OLMAX_STAGING_DIR") or Path.home() / ".cache" / "olmax" / "staging")
    return root / f"{name}-{hashlib.sha256(url.encode()).hexdigest()[:12]}"


def check_multiprocess(process_count: int, url: str) -> None:
    if process_count > 1 and not os.environ.get("OLMAX_STAGING_DIR"):
        raise io.RemoteError(f"{url}: a remote run directory with {process_count} processes needs "
                             "OLMAX_STAGING_DIR on a file system all hosts share (Orbax commits a multi-host "
                             "checkpoint from process 0 over every host's files)")


class RemoteCheckpoints:
    """Committed checkpoints under ``URL/checkpoints`` and their local copies in the staging folder."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.root = io.join(self.url, CHECKPOINTS)
        self.local = staging_dir(self.url) / CHECKPOINTS

    def committed_steps(self) -> list[int]:
        names = io.list_dirs(self.root)
        steps = [int(n) for n in names if n.isdigit()]
        return sorted(s for s in steps if io.exists(io.join(self.root, str(s), COMMITTED)))

    def drop_uncommitted_local(self, committed: list[int]) -> None:
        """Local step folders the remote does not hold committed are unfinished uploads: remove them,
        so Orbax never resumes from a checkpoint that exists only on this machine's disk."""
        if not self.local.is_dir():
            return
        for d in self.local.iterdir():
            if d.is_dir() and d.name.isdigit() and int(d.name) not in committed:
                shutil.rmtree(d, ignore_errors=True)

    def fetch(self, step: int) -> bool:
        """Download checkpoint ``step`` unless a complete local copy exists; True if it downloaded."""
        dest = self.local / str(step)
        marker = json.loads(io.read_text(io.join(self.root, str(step), COMMITTED)))
        files: dict[str, int] = marker["files"]
        if dest.is_dir() and all((dest / f).is_file() and (dest / f).stat().st_size == n for f, n in files.items()):
            return False
        tmp = self.local / f"{step}.olmax-download-tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        for rel, n in files.items():
            io.get_file(io.join(self.root, str(step), rel), tmp / rel)
            if (tmp / rel).stat().st_size != n:
                raise io.RemoteError(f"{io.join(self.root, str(step), rel)}: {(tmp / rel).stat().st_size} bytes, "
                                     f"the commit marker says {n}")
        shutil.rmtree(dest, ignore_errors=True)
        os.replace(tmp, dest)
        return True

    def upload(self, step: int) -> None:
        """Copy the local (committed by Orbax) checkpoint ``step`` up; the marker goes last."""
        src = self.local / str(step)
        if not src.is_dir():
            raise io.RemoteError(f"checkpoint {step} is not in the staging folder {src}")
        base = io.join(self.root, str(step))
        if io.exists(io.join(base, COMMITTED)):
            return  # already committed remotely (never overwritten)
        files = {}
        for p in sorted(src.rglob("*")):
            if p.is_file():
                rel = p.relative_to(src).as_posix()
                io.put_file(p, io.join(base, rel))
                files[rel] = p.stat().st_size
        io.write_bytes(io.join(base, COMMITTED), json.dumps({"step": step, "files": files}).encode())

    def prune(self, keep_last: int, keep_every: int | None) -> None:
        """Orbax's policy (last ``keep_last`` plus every ``keep_every``-th) applied to the remote copies."""
        steps = self.committed_steps()
        keep = set(steps[-keep_last:]) | {s for s in steps if keep_every and s % keep_every == 0}
        for s in steps:
            if s not in keep:
                io.remove(io.join(self.root, str(s), COMMITTED))  # invisible first, then deleted
                io.remove(io.join(self.root, str(s)))


class RunMirror:
    """The local staging folder of a remote run directory, and its small files' sync."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.local = staging_dir(self.url)
        self._pushed: dict[str, tuple[int, int]] = {}

    def pull(self) -> None:
        """Download the run's small files (the remote is the truth: local copies are replaced)."""
        self.local.mkdir(parents=True, exist_ok=True)
        for rel in io.list_files(self.url):
            if rel.split("/", 1)[0] in _NOT_MIRRORED:
                continue
            io.get_file(io.join(self.url, rel), self.local / rel)
            st = (self.local / rel).stat()
            self._pushed[rel] = (st.st_size, st.st_mtime_ns)

    def push(self) -> None:
        """Upload the small files that changed since the last push."""
        for p in sorted(self.local.rglob("*")):
            rel = p.relative_to(self.local).as_posix()
            if not p.is_file() or rel.split("/", 1)[0] in _NOT_MIRRORED or rel.endswith((".part", ".tmp")):
                continue
            st = p.stat()
            if self._pushed.get(rel) != (st.st_size, st.st_mtime_ns):
                io.put_file(p, io.join(self.url, rel))
                self._pushed[rel] = (st.st_size, st.st_mtime_ns)
