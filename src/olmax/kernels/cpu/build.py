"""Builds olmax's CPU kernels: the C++ sources beside this file compiled into one shared library
with the C++ compiler on the path (``$CXX`` or ``c++``) against the FFI headers jaxlib ships, into
``$OLMAX_CACHE_DIR/kernels`` (default ``~/.cache/olmax/kernels``), once per sources, jaxlib,
compiler and flags. Warnings are on (``-Wall -Wextra``; jaxlib's headers are system headers, whose
own warnings are not ours): a clean build prints nothing (``tests/test_cpu_kernels.py``), and what
a compiler does print is logged. A failed build raises with the compiler's last lines."""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

HERE = Path(__file__).parent
# One translation unit per purpose, and the header of what they share.
SOURCES = tuple(HERE / name for name in ("attention.cc", "projections.cc", "decode.cc"))
HEADERS = (HERE / "common.h",)
WARNINGS = ("-Wall", "-Wextra")


def flags(isa: str) -> list[str]:
    """The compiler flags for ``isa`` (``avx2``, or ``avx512``: AVX-512F and VL, 32 registers)."""
    out = ["-O3", "-mavx2", "-mfma", "-std=c++17", "-shared", "-fPIC", *WARNINGS]
    return out + ["-mavx512f", "-mavx512vl"] if isa == "avx512" else out


def cache_dir() -> Path:
    root = os.environ.get("OLMAX_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "olmax")
    return Path(root) / "kernels"


def compiler() -> tuple[str, str]:
    """``(path, version text)`` of the C++ compiler, or a RuntimeError naming what is missing."""
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")
    if not cxx:
        raise RuntimeError("no C++ compiler on the path (set CXX or install g++)")
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"the C++ compiler {cxx} does not run: {e}") from e
    return cxx, version


def compile_to(out: Path, isa: str, cxx: str | None = None) -> str:
    """Compiles the sources for ``isa`` into ``out``; returns what the compiler printed (empty for
    a clean build). A RuntimeError with the compiler's last lines if it fails."""
    import jax

    cxx = cxx or compiler()[0]
    cmd = [cxx, *flags(isa), "-isystem", jax.ffi.include_dir(), *map(str, SOURCES), "-o", str(out)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except (OSError, subprocess.SubprocessError) as e:
        raise RuntimeError(f"building olmax's CPU kernels failed: {e}") from e
    printed = (done.stderr + done.stdout).strip()
    if done.returncode != 0:
        tail = printed.splitlines()[-5:]
        raise RuntimeError(f"building olmax's CPU kernels failed ({cxx}): " + " / ".join(tail))
    return printed


def library(isa: str) -> Path:
    """The compiled library for ``isa``, built now if these sources, jaxlib, compiler and flags
    have none yet."""
    import jaxlib

    cxx, version = compiler()
    sources = [p.read_text() for p in (*SOURCES, *HEADERS)]
    key = hashlib.sha256("\0".join([*sources, jaxlib.__version__, version, *flags(isa)]).encode()).hexdigest()[:16]
    out = cache_dir() / f"olmax_cpu_kernels-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # A few seconds, once per machine: say so on stderr (stdout may be a command's JSON).
    print(f"[olmax] building olmax's CPU kernels ({isa}; once, a few seconds): {out}", file=sys.stderr, flush=True)
    with tempfile.TemporaryDirectory(dir=out.parent) as tmp:
        part = Path(tmp) / out.name
        printed = compile_to(part, isa, cxx)
        if printed:  # a compiler other than the one the sources were checked with may warn
            log.warning("the compiler printed this while building olmax's CPU kernels:\n%s", printed)
        os.replace(part, out)  # another process may have won the race: the same bytes either way
    return out
