"""The error contract and strict JSON: nonsense flags and config values are one line naming the flag
or field, exit 2 and ``{"error": ...}`` with ``--json``; every ``--json`` output parses with a parser
that rejects NaN and Infinity."""

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


def test_argument_errors_honour_json(capsys):
    msg = json_error(["eval", "loss", "--checkpoint", "x", "--data", "y", "--batches", "abc"], capsys)
    assert "--batches" in msg and "abc" in msg


@pytest.mark.parametrize("flags,flag", [
    (["--devices", "-4"], "--devices"), (["--devices", "0"], "--devices"), (["--hbm-gib", "-1"], "--hbm-gib"),
    (["--hbm-gib", "nan"], "--hbm-gib"), (["--hbm-gib", "inf"], "--hbm-gib"), (["--hbm-gib", "0"], "--hbm-gib")])
def test_inspect_refuses_nonsense_devices_and_hbm(flags, flag, capsys):
    assert flag in json_error(["inspect", "tiny", *flags], capsys)


def test_inspect_json_is_strict(capsys):
    rc, out, _ = run(["inspect", "tiny", "--devices", "4", "--hbm-gib", "1e-300", "--json"], capsys)
    assert rc == 0
    assert strict_loads(out)["fits"] is False


@pytest.mark.parametrize("dtype", ["float32", "int8", "banana"])
def test_eval_token_dtype_must_be_a_token_dtype(dtype, capsys):
    for cmd in (["eval", "loss", "--checkpoint", "x", "--data", "y"],
                ["eval", "domains", "--checkpoint", "x", "--domain", "a=b:1"]):
        assert "--token-dtype" in json_error(cmd + ["--token-dtype", dtype], capsys)


def test_eval_loss_json_writes_null_for_a_diverged_checkpoint(monkeypatch, capsys):
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


def test_data_audit_huge_epoch_is_an_error(capsys):
    assert "--epoch" in json_error(["data", "audit", "tiny", "--epoch", "99999999999999999999"], capsys)


@pytest.mark.parametrize("flags,flag", [
    (["--interrupt-at", "0"], "--interrupt-at"), (["--steps", "0"], "--steps"), (["--steps", "1"], "--steps"),
    (["--devices-before", "0"], "--devices-before"), (["--tol", "nan"], "--tol"), (["--tol", "-1"], "--tol"),
    (["--devices-before", "2", "--devices-after", "3"], "--devices-after"),
    (["--steps", "4", "--interrupt-at", "4"], "--interrupt-at")])
def test_verify_resume_refuses_before_training(flags, flag, capsys, monkeypatch):
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
def test_launch_refuses_nonsense_counts(argv, flag, capsys):
    rc, out, err = run(argv, capsys)
    assert rc == 2 and flag in err and "Traceback" not in err


def test_launch_status_of_a_missing_run_dir_is_an_error(tmp_path, capsys):
    assert "--run-dir" in json_error(["launch", "status", "--run-dir", str(tmp_path / "nope")], capsys)
    (tmp_path / "run").mkdir()
    rc, out, _ = run(["launch", "status", "--run-dir", str(tmp_path / "run"), "--json"], capsys)
    assert rc == 0 and strict_loads(out)["checkpoint"] is None


# Flags whose plain int/float type is checked after parsing, with a message naming the flag.
CHECKED_LATER = {("generate", "--temperature"), ("generate", "--top-p"), ("chat", "--temperature"),
                 ("chat", "--top-p"), ("compare", "--threshold"), ("compare", "--heldout-fraction"),
                 ("eval", "lm-eval", "--limit")}


def _numeric_flags(parser: argparse.ArgumentParser, path: tuple[str, ...]):
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items():
                yield from _numeric_flags(sub, path + (name,))
        elif a.option_strings and a.type in (int, float):
            yield path + (a.option_strings[0],)


def _checked_flags(parser: argparse.ArgumentParser, path: tuple[str, ...]):
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items():
                yield from _checked_flags(sub, path + (name,))
        elif a.option_strings and a.type is not None and a.type not in (int, float, str) and not a.choices:
            yield path, a, any("--json" in b.option_strings for b in parser._actions)


def test_every_checked_flag_refuses_nonsense_while_parsing(capsys, monkeypatch):
    """Each flag with a checking type refuses -1, NaN, inf and a word, and 0 where it must be
    positive: exit 2, one line naming the flag, strict JSON where the command has --json. The
    values are refused while parsing, before any required argument is missing or any work runs."""
    from olmax import argtypes
    parser = cli.build_parser()
    # cli.main builds its parser once a process; the hundreds of calls here share one (7 s of argparse).
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    cases = 0
    for path, a, has_json in _checked_flags(parser, ()):
        flag = a.option_strings[0]
        values = ["-1", "nan", "inf", "banana", "1e999"]
        if a.type in (argtypes.positive_int, argtypes.positive_float):
            values.append("0")
        for v in values:
            rc, out, err = run([*path, flag, v], capsys)
            assert rc == 2 and flag in err and "Traceback" not in err, (path, flag, v, rc, err)
            assert len([ln for ln in err.splitlines() if "error:" in ln]) == 1, (path, flag, v, err)
            if has_json:
                assert flag in json_error([*path, flag, v], capsys), (path, flag, v)
            cases += 1
    assert cases >= 150, cases


def test_every_numeric_flag_is_checked():
    """A numeric flag takes a checking type from ``olmax.argtypes`` (refused while parsing: 0 where
    it must be positive, -1, NaN, inf), or is listed here with the check that follows parsing.
    Plain ``type=int`` let ``generate --seed -1`` end in an OverflowError traceback and
    ``compile --step generate --batch-size 0`` report that a batch of nothing fits."""
    unchecked = set(_numeric_flags(cli.build_parser(), ()))
    assert unchecked <= CHECKED_LATER, sorted(unchecked - CHECKED_LATER)


@pytest.mark.parametrize("argv,flag", [
    (["generate", "--checkpoint", "x", "--prompt", "hi", "--seed", "-1"], "--seed"),
    (["generate", "--checkpoint", "x", "--prompt", "hi", "--seed", str(2**32)], "--seed"),
    (["generate", "--checkpoint", "x", "--prompt", "hi", "--temperature", "inf"], "--temperature"),
    (["generate", "--checkpoint", "x", "--prompt", "hi", "--batch-size", "0"], "--batch-size"),
    (["parity", "--hf", "x", "--seed", "-1"], "--seed"),
    (["eval", "kl", "x", "y", "--seed", "-1"], "--seed"),
    (["verify", "trl", "--grpo", "--seed", "-1"], "--seed"),
    (["compile", "tiny", "--topology", "v5p-8", "--step", "generate", "--batch-size", "0"], "--batch-size"),
    (["compile", "tiny", "--topology", "v5p-8", "--step", "generate", "--max-length", "-1"], "--max-length"),
    (["demo", "--corpus-mb", "nan"], "--corpus-mb"),
    (["convert", "hf-to-olmax", "--hf", "x", "--out", "y", "--pad-vocab-to", "0"], "--pad-vocab-to")])
def test_post_training_and_tool_flags_refuse_nonsense(argv, flag, capsys):
    rc, out, err = run(argv, capsys)
    assert rc == 2 and flag in err and "Traceback" not in err, (rc, err)


def test_sampling_refuses_a_seed_the_decoder_cannot_hold():
    from olmax.engine import Sampling
    for bad in (Sampling(seed=-1), Sampling(seed=2**32), Sampling(temperature=math.inf),
                Sampling(temperature=math.nan)):
        with pytest.raises(ValueError):
            bad.check()
    Sampling(seed=2**32 - 1, temperature=0.5).check()


@pytest.mark.parametrize("stage,override", [("rl", "rl.group_size=0"), ("rl", "rl.nope=3"),
                                            ("sft", "optim.lr=nan")])
def test_demo_stages_check_their_overrides_before_any_stage_runs(stage, override, tmp_path, capsys):
    rc, out, err = run(["demo", "--run-dir", str(tmp_path / "demo"), stage, "--set", override], capsys)
    assert rc == 2 and override.split("=")[0] in err and "Traceback" not in err, err
    assert not (tmp_path / "demo").exists()  # nothing pre-trained, built or written
