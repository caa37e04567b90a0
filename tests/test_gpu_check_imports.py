"""The accelerator check (benchmarks/chip_check.py) runs as the GPU check on the lent H200's own image: olmax is not
installed there (gpu_check.sh puts src/ on PYTHONPATH) and the packages of olmax's lock file that
the image lacks cannot be installed (no registry). This guards that path in seconds: a fresh
interpreter with only src/ on the path and those packages made unimportable imports every olmax
module the check imports and runs its ``env`` section. `make rehearse-gpu` runs the whole check."""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "benchmarks" / "chip_check.py"
# The benchmarks whose code the check's sections import (``logprob_gap``).
SECTIONS_FROM = [ROOT / "benchmarks" / "bench_logprob_gap.py"]
# In requirements.lock, not on the image (the device tool's KINDS.md package list).
NOT_ON_IMAGE = ["grain", "tensorboardX", "zstandard", "lm_eval", "olmo_core", "libtpu", "datasets", "evaluate",
                "boto3", "botocore", "moto", "portpicker", "nltk", "trl", "array_record", "cached_path"]

CHILD = r"""
import importlib, importlib.abc, runpy, sys
blocked = set(sys.argv[1].split(","))

class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in blocked:
            raise ModuleNotFoundError(f"No module named {name!r} (not on the GPU image)", name=name)
        return None

sys.meta_path.insert(0, Block())
for m in sys.argv[2].split(","):
    importlib.import_module(m)
bad = sorted(m for m in sys.modules if m.split(".")[0] in blocked)
assert not bad, bad
sys.argv = [sys.argv[3], "--rehearse", "--only", "env", "--out", sys.argv[4]]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def _is_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a name inside a module, not a submodule
        return False


def check_imports() -> list[str]:
    """Every ``olmax...`` module chip_check.py (and the benchmarks it takes sections from)
    imports, at the top or inside a section."""
    mods = set()
    for node in (n for f in (CHECK, *SECTIONS_FROM) for n in ast.walk(ast.parse(f.read_text()))):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "olmax":
            mods.add(node.module)
            mods.update(f"{node.module}.{a.name}" for a in node.names if _is_module(f"{node.module}.{a.name}"))
        elif isinstance(node, ast.Import):
            mods.update(a.name for a in node.names if a.name.split(".")[0] == "olmax")
    return sorted(mods)


def test_gpu_check_imports_without_install_or_missing_packages(tmp_path):
    mods = check_imports()
    assert {"olmax.objectives.lm", "olmax.engine", "olmax.verify.parity", "olmax.rl.grpo"} <= set(mods)
    assert "from bench_logprob_gap import" in CHECK.read_text()
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "OLMAX_MALLOC")}
    env.update(PYTHONPATH=str(ROOT / "src"), JAX_PLATFORMS="cpu")
    out = tmp_path / "gpu_check.json"
    # -s: no user site; the editable install's .pth points at the same src/, so olmax resolves
    # from PYTHONPATH first either way.
    r = subprocess.run([sys.executable, "-s", "-c", CHILD, ",".join(NOT_ON_IMAGE), ",".join(mods), str(CHECK),
                        str(out)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["errors"] == {} and report["env"]["backend"] == "cpu"
    assert (ROOT / report["env"]["olmax_from"]).resolve() == (ROOT / "src" / "olmax").resolve()  # src/, not installed
