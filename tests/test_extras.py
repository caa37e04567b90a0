"""The lean core install (``olmax.extras``): the CLI and the core commands (inspect, train) run with
every optional package blocked, and a command that needs a missing extra exits 2 through the error
contract, naming the extra and the pip command that installs it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from olmax import cli
from olmax.config import WandbConfig
from olmax.extras import EXTRAS, MissingExtra, installed, require
from trainlib import small_overrides, write_corpus

ROOT = Path(__file__).resolve().parents[1]
# What `pip install olmax` does not bring (the tpu extra's libtpu is left: olmax looks for it at import).
OPTIONAL = ("torch", "transformers", "lm_eval", "accelerate", "math_verify", "wandb", "pyarrow", "google.cloud",
            "matplotlib", "aiohttp", "fsspec", "datasets", "olmo_core", "trl")

# Run first in the subprocess: importing any optional package (or a submodule) raises ImportError.
BLOCK = f"""
import importlib.abc, sys
OPTIONAL = {OPTIONAL!r}
class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if any(name == m or name.startswith(m + ".") for m in OPTIONAL):
            raise ImportError(f"{{name}} is blocked (not in the core install)")
sys.meta_path.insert(0, Blocked())
try:
    import torch
    raise SystemExit("the blocker let torch through")
except ImportError:
    pass
"""


def _blocked(code: str, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", BLOCK + code], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})


@pytest.mark.integration  # a training run in a child process (17 s of the unit tier on 2026-12-06)
def test_core_commands_run_without_optional_packages(tmp_path: Path) -> None:
    paths = write_corpus(tmp_path / "data")
    overrides = small_overrides(paths, "train.steps=2", "checkpoint.interval=2")
    sets = [a for o in overrides for a in ("--set", o)]
    code = f"""
from olmax import cli
cli.build_parser()
rc = cli.main(["inspect", "olmo3_7b_stage1", "--json"])
assert rc == 0, rc
rc = cli.main(["train", "tiny", "--run-dir", "run", "--no-progress", *{sets!r}])
assert rc == 0, rc
"""
    r = _blocked(code, tmp_path)
    assert r.returncode == 0, r.stderr[-3000:]
    info = json.loads(r.stdout)
    assert info["recipe"] == "olmo3_7b_stage1" and info["params"]["total"] > 7e9
    assert (tmp_path / "run" / "checkpoints" / "2").is_dir()
    assert "trained steps 0..2" in r.stderr


@pytest.mark.parametrize("blocked, argv, extra", [
    ("torch", ["parity", "--hf", "x"], "hf"),
    ("lm_eval", ["eval", "lm-eval", "--checkpoint", "x"], "eval"),
    ("matplotlib", ["compare", "a", "b"], "plots"),
])
def test_a_missing_extra_exits_2_with_the_pip_command(blocked: str, argv: list[str], extra: str, capsys,
                                                      monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, blocked, None)  # as an install without the package
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert err == (f"error: olmax {argv[0]} needs the '{extra}' extra ({blocked} is not installed): "
                   f"pip install 'olmax[{extra}]'\n")
    if argv[0] == "parity":  # with --json, also {"error": ...} on stdout
        assert cli.main([*argv, "--json"]) == 2
        assert json.loads(capsys.readouterr().out)["error"] == err[len("error: "):-1]


def test_a_missing_extra_in_a_subprocess(tmp_path: Path) -> None:
    """Blocked by the import system, not by sys.modules: the same one line, exit 2."""
    r = _blocked("from olmax import cli; sys.exit(cli.main(['parity', '--hf', 'x']))", tmp_path)
    assert r.returncode == 2 and r.stderr.strip().splitlines()[-1] == (
        "error: olmax parity needs the 'hf' extra (torch is not installed): pip install 'olmax[hf]'")


def test_extras_are_checked_when_chosen_not_when_first_used(monkeypatch, tmp_path: Path) -> None:
    """The math reward and W&B logging fail at once (a failing reward scores 0 and W&B's own
    failures are survived, so a missing package must not reach them)."""
    from olmax.metrics.sinks import WandbSink
    from olmax.rl.rewards import get_reward
    monkeypatch.setitem(sys.modules, "math_verify", None)
    with pytest.raises(MissingExtra, match=r"'rl' extra \(math_verify is not installed\): pip install 'olmax\[rl\]'"):
        get_reward("math")
    assert get_reward("exact_match")("4", "4") == 1.0
    monkeypatch.setitem(sys.modules, "wandb", None)
    with pytest.raises(MissingExtra, match=r"pip install 'olmax\[wandb\]'"):
        WandbSink(WandbConfig(project="p"), tmp_path)


def test_require_and_the_declared_extras_agree() -> None:
    with pytest.raises(KeyError, match="no extra 'nope'"):
        require("nope")
    assert installed("json") and not installed("olmax_no_such_module") and not installed("no_such_parent.child")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert set(EXTRAS) <= set(extras)
    assert extras["all"] == [f"olmax[{','.join(e for e in EXTRAS if e != 'tpu')}]"]
    assert "olmax[all]" in extras["test"]
