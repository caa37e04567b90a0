"""The multi-process settings are checked before jax.distributed is touched: a bad environment
variable or flag is an error that names it (the runs themselves: test_multiprocess.py)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from olmax.config import ConfigError
from olmax.train import distributed


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OLMAX_COORDINATOR", "OLMAX_NUM_PROCESSES", "OLMAX_PROCESS_ID", "SLURM_NTASKS",
                 "OLMAX_DISTRIBUTED"):
        monkeypatch.delenv(name, raising=False)


@pytest.mark.parametrize("name", ["OLMAX_NUM_PROCESSES", "OLMAX_PROCESS_ID", "SLURM_NTASKS"])
def test_a_non_integer_variable_is_named(monkeypatch: pytest.MonkeyPatch, name: str) -> None:
    monkeypatch.setenv(name, "two")
    with pytest.raises(ConfigError, match=f"{name}='two': expected an integer"):
        distributed.initialise()


def test_an_incomplete_or_inconsistent_setting_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ConfigError, match="need the coordinator address, the process count and this process's id"):
        distributed.initialise(coordinator="127.0.0.1:1234", num_processes=2)
    monkeypatch.setenv("OLMAX_COORDINATOR", "127.0.0.1:1234")
    monkeypatch.setenv("OLMAX_NUM_PROCESSES", "2")
    monkeypatch.setenv("OLMAX_PROCESS_ID", "2")
    with pytest.raises(ConfigError, match=r"process id 2 is outside 0\.\.1"):
        distributed.initialise()


def test_a_process_count_below_one_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OLMAX_NUM_PROCESSES", "0")
    with pytest.raises(ConfigError, match="OLMAX_NUM_PROCESSES=0: must be >= 1"):
        distributed.initialise()


@pytest.mark.parametrize("var,value", [("SLURM_NTASKS", "2"), ("OLMAX_DISTRIBUTED", "auto")])
def test_asking_for_a_cluster_outside_one_names_the_variable(var: str, value: str) -> None:
    # In a child process: JAX's cluster detection must not run in the test process.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "OLMAX_"))}
    env.update({var: value, "JAX_PLATFORMS": "cpu"})
    code = ("from olmax.config import ConfigError\nfrom olmax.train.distributed import initialise\n"
            "try:\n    initialise()\nexcept ConfigError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert f"{var}={value} asks for a multi-process run" in out.stdout, out.stdout + out.stderr[-2000:]
