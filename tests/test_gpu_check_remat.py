"""The GPU check's remat rows, rehearsed on the CPU at tiny shapes (as ``make rehearse-gpu`` runs
them): the lent H200's one run must measure each policy beside XLA's view of the same program,
or the estimate's error cannot be read from it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[1]


def test_train_remat_measures_each_policy_beside_xlas_estimate(tmp_path):
    out = tmp_path / "gpu_check.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "JAX_PLATFORMS": "cpu"}
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "chip_check.py"), "--rehearse", "--only",
                        "train,train_remat", "--remat", "minimal", "--out", str(out)],
                       cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["errors"] == {}
    full, minimal = report["train"], report["train_remat"]["policies"]["minimal"]
    assert (full["remat"], minimal["remat"]) == ("full", "minimal")
    for row in (full, minimal):
        assert row["finite"] and row["step_seconds_median"] > 0
        assert row["compiled_gib"]["need"] > 0
        assert row["xla"]["model_flops_per_device"] == pytest.approx(
            row["flops_per_token"] * row["batch"] * row["seq_len"])
    # Full remat runs every layer's forward twice: XLA's count holds more than the model's FLOPs,
    # and more than minimal's, which keeps the matmul outputs.
    assert full["xla"]["recompute_overhead"] > 1.2
    assert minimal["xla"]["flops_per_device"] < full["xla"]["flops_per_device"]
    against = minimal["against_full"]
    assert against["speedup_by_compiled_flops"] == pytest.approx(
        full["xla"]["flops_per_device"] / minimal["xla"]["flops_per_device"])
    assert against["measured_speedup"] == pytest.approx(full["step_seconds_median"] / minimal["step_seconds_median"])
    assert report["train_remat"]["full"]["step_seconds_median"] == full["step_seconds_median"]
