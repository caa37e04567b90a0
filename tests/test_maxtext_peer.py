"""The TPU check's MaxText side (benchmarks/tpu/maxtext_peer.py) rehearsed on the CPU, so that it
cannot rot between lent machines: the carried wheel list and the index's names, the install plan,
the Python 3.11 rewrite, the launcher, the trainer's command line and environment, the parsing of
MaxText's step lines, and a row run through a stand-in trainer process. The chip's own run:
docs/benchmarks.md (TPU check)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "tpu"))
import maxtext_peer as mp  # noqa: E402

SHAPE = {"layers": 2, "d": 4096, "heads": 32, "kv_heads": 32, "head_dim": 128, "mlp": 11008, "vocab": 32768,
         "window": 4096, "seq": 4096, "batch": 2}


def test_rehearsal_checks_lists_plan_patch_command_and_parsing():
    r = mp.rehearse(SHAPE)
    assert r["row"]["tokens_per_second"] == pytest.approx(8192 / 0.339)
    assert r["row"]["mfu_vs_datasheet"] == pytest.approx(82.7 / 197)
    assert "remat_policy=full" in r["args"] and "per_device_batch_size=2" in r["args"]


def test_wheel_list_pins_every_line(tmp_path):
    bad = tmp_path / "w.txt"
    bad.write_text("# comment\nmaxtext==0.2.5\naqtp\n")
    with pytest.raises(ValueError, match="aqtp"):
        mp.pins(bad)


def test_check_wheels_names_missing_unlisted_and_duplicates(tmp_path):
    for f in ("maxtext-0.2.5-py3-none-any.whl", "aqtp-0.9.0-py3-none-any.whl", "aqtp-0.8.0-py3-none-any.whl"):
        (tmp_path / f).write_bytes(b"x")
    got = mp.check_wheels(tmp_path, ["maxtext==0.2.5", "aqtp==0.9.0", "typeguard==2.13.3"])
    assert got["missing"] == ["typeguard==2.13.3"] and got["unlisted"] == ["aqtp-0.8.0-py3-none-any.whl"]
    assert got["duplicates"] == [] and got["wheels"] == 3


def _fake_site(tmp_path: Path, script: str) -> Path:
    """A site whose launcher is a stand-in for MaxText's trainer (it prints what ``script`` does)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / mp.LAUNCHER_NAME).write_text(script)
    return site


def test_run_row_reads_the_trainers_step_lines(tmp_path):
    script = ("import sys, os\nassert os.environ['DECOUPLE_GCLOUD'] == 'TRUE'\n"
              "assert 'remat_policy=minimal' in sys.argv and 'skip_jax_distributed_system=true' in sys.argv\n"
              f"print({mp.CANNED_LOG!r})\n")
    row = mp.run_row(_fake_site(tmp_path, script), SHAPE, "minimal", tmp_path / "work", 197.0, timeout_s=60)
    assert "error" not in row, row
    assert row["remat"] == "minimal" and row["steps_timed"] == mp.STEPS - mp.WARMUP
    assert row["step_seconds_median"] == pytest.approx(0.339) and row["tflops_per_second"] == pytest.approx(82.7)
    assert not any(a.startswith("base_output_directory=") for a in row["args"])  # no machine path in the JSON


def test_run_row_records_a_failed_trainer_and_retries_a_busy_chip_once(tmp_path, monkeypatch):
    monkeypatch.setattr(mp, "BUSY_WAIT_S", 0)
    marker = tmp_path / "tried"
    script = (f"import pathlib, sys\np = pathlib.Path({str(marker)!r})\n"
              "if not p.exists():\n    p.write_text('1')\n"
              "    print(\"RuntimeError: Unable to initialize backend 'tpu': TPU in use\")\n    sys.exit(1)\n"
              "print('Traceback: ModuleNotFoundError: No module named x')\nsys.exit(3)\n")
    row = mp.run_row(_fake_site(tmp_path, script), SHAPE, "full", tmp_path / "work", 197.0, timeout_s=60)
    assert row["retried"].startswith("Unable to initialize backend")
    assert row["error"] == "exit 3, 0 steps printed" and "No module named x" in row["log_tail"]
