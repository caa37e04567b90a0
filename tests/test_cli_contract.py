"""The error contract and strict JSON (issue 23, items 7 and 10): nonsense flags and config values
are one line naming the flag or field, exit 2 and ``{"error": ...}`` with ``--json``; every
``--json`` output parses with a parser that rejects NaN and Infinity."""

from __future__ import annotations

import argparse
import json
import math
import re
from pathlib import Path

import numpy as np
import pytest

from olmax import cli, jsonout

SRC = Path(__file__).resolve().parents[1] / "src" / "olmax"


def strict_loads(text: str):
    def reject(token: str):
        raise ValueError(f"non-strict JSON token {token}")
    return json.loads(text, parse_constant=reject)


def run(argv: list[str], capsys) -> tuple[int, str, str]:
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # argparse
        rc = e.code
    out = capsys.readouterr()
    return rc, out.out, out.err


def json_error(argv: list[str], capsys) -> str:
    rc, out, err = run(argv + ["--json"], capsys)
    assert rc == 2, (argv, out, err)
    msg = strict_loads(out.strip().splitlines()[-1])["error"]
    assert "Traceback" not in err and "error: " in err
    return msg


def test_strict_json_writes_null_for_nonfinite_numbers():
    obj = {"a": float("nan"), "b": [float("inf"), -math.inf, 1.5], "c": np.float32("nan"), "d": np.int64(3),
           "e": np.array([1.0, np.inf]), "f": (True, None, "x"), "g": {"h": np.float64(2.0)}}
    s = jsonout.dumps(obj)
    assert strict_loads(s) == {"a": None, "b": [None, None, 1.5], "c": None, "d": 3, "e": [1.0, None],
                               "f": [True, None, "x"], "g": {"h": 2.0}}
    with pytest.raises(ValueError):
        strict_loads(json.dumps({"x": float("nan")}))  # the parser of these tests does reject NaN


def test_every_json_printer_goes_through_the_strict_helper():
    """No --json output is written with the stdlib's json.dumps, which emits NaN and Infinity."""
    offenders = []
    for f in SRC.rglob("*.py"):
        for i, line in enumerate(f.read_text().splitlines(), 1):
            if re.search(r"print\(\s*json\.dumps\(", line):
                offenders.append(f"{f.relative_to(SRC)}:{i}")
    assert not offenders, offenders


def _json_commands(parser: argparse.ArgumentParser, path: list[str]):
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items():
                yield from _json_commands(sub, path + [name])
        elif "--json" in getattr(a, "option_strings", ()):
            yield path


def test_every_json_command_reports_argument_errors_as_strict_json(capsys):
    commands = list(_json_commands(cli.build_parser(), []))
    assert len(commands) >= 15, commands
    for cmd in commands:
        msg = json_error(cmd + ["--no-such-flag-x"], capsys)
        assert msg.startswith("olmax"), (cmd, msg)


def test_argument_errors_honour_json(capsys):  # P5
    msg = json_error(["eval", "loss", "--checkpoint", "x", "--data", "y", "--batches", "abc"], capsys)
    assert "--batches" in msg and "abc" in msg


@pytest.mark.parametrize("flags,flag", [
    (["--devices", "-4"], "--devices"), (["--devices", "0"], "--devices"), (["--hbm-gib", "-1"], "--hbm-gib"),
    (["--hbm-gib", "nan"], "--hbm-gib"), (["--hbm-gib", "inf"], "--hbm-gib"), (["--hbm-gib", "0"], "--hbm-gib")])
def test_inspect_refuses_nonsense_devices_and_hbm(flags, flag, capsys):  # P7, P8
    assert flag in json_error(["inspect", "tiny", *flags], capsys)


def test_inspect_json_is_strict(capsys):  # P8
    rc, out, _ = run(["inspect", "tiny", "--devices", "4", "--hbm-gib", "1e-300", "--json"], capsys)
    assert rc == 0
    assert strict_loads(out)["fits"] is False


@pytest.mark.parametrize("dtype", ["float32", "int8", "banana"])
def test_eval_token_dtype_must_be_a_token_dtype(dtype, capsys):  # P4
    for cmd in (["eval", "loss", "--checkpoint", "x", "--data", "y"],
                ["eval", "domains", "--checkpoint", "x", "--domain", "a=b:1"]):
        assert "--token-dtype" in json_error(cmd + ["--token-dtype", dtype], capsys)


def test_eval_loss_json_writes_null_for_a_diverged_checkpoint(monkeypatch, capsys):  # P8
    from olmax.eval import commands, heldout

    class Diverged:
        files = {"": ["f"]}
        seq_len, batch_size = 16, 2

        def __init__(self, *a, **k):
            pass

        def evaluate_detailed(self, params):
            return {"batches": 1, "tokens": 32, "loss": float("inf"), "perplexity": float("inf"),
                    "loss_se": float("nan"), "per_batch_loss": [float("inf")]}

    monkeypatch.setattr(commands, "_load", lambda path, dtype: (None, None))
    monkeypatch.setattr(heldout, "HeldoutEvaluator", Diverged)
    rc, out, _ = run(["eval", "loss", "--checkpoint", "x", "--data", "y", "--json"], capsys)
    assert rc == 0
    r = strict_loads(out)
    assert r["loss"] is None and r["perplexity"] is None and r["per_batch_loss"] == [None]


def test_data_audit_huge_epoch_is_an_error(capsys):  # P6
    assert "--epoch" in json_error(["data", "audit", "tiny", "--epoch", "99999999999999999999"], capsys)


@pytest.mark.parametrize("flags,flag", [
    (["--interrupt-at", "0"], "--interrupt-at"), (["--steps", "0"], "--steps"), (["--steps", "1"], "--steps"),
    (["--devices-before", "0"], "--devices-before"), (["--tol", "nan"], "--tol"), (["--tol", "-1"], "--tol"),
    (["--devices-before", "2", "--devices-after", "3"], "--devices-after"),
    (["--steps", "4", "--interrupt-at", "4"], "--interrupt-at")])
def test_verify_resume_refuses_before_training(flags, flag, capsys, monkeypatch):  # P10
    from olmax.verify import resume
    monkeypatch.setattr(resume, "_train", lambda *a, **k: pytest.fail("trained before refusing"))
    msg = json_error(["verify", "resume", "tiny", "--set", "train.global_batch_size=8", *flags], capsys)
    assert flag in msg


@pytest.mark.parametrize("argv,flag", [
    (["launch", "tpu", "tiny", "--hosts", "0"], "--hosts"),
    (["launch", "tpu", "tiny", "--num-slices", "-1"], "--num-slices"),
    (["launch", "local", "tiny", "--backoff", "-5"], "--backoff"),
    (["launch", "local", "tiny", "--backoff", "nan"], "--backoff"),
    (["launch", "local", "tiny", "--max-restarts", "-1"], "--max-restarts"),
    (["launch", "slurm", "tiny", "--nodes", "0", "--gpus-per-node", "8"], "--nodes")])
def test_launch_refuses_nonsense_counts(argv, flag, capsys):  # P12
    rc, out, err = run(argv, capsys)
    assert rc == 2 and flag in err and "Traceback" not in err


def test_launch_status_of_a_missing_run_dir_is_an_error(tmp_path, capsys):  # P12
    assert "--run-dir" in json_error(["launch", "status", "--run-dir", str(tmp_path / "nope")], capsys)
    (tmp_path / "run").mkdir()
    rc, out, _ = run(["launch", "status", "--run-dir", str(tmp_path / "run"), "--json"], capsys)
    assert rc == 0 and strict_loads(out)["checkpoint"] is None
