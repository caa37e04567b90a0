"""A probe of the error contract as a new user meets it (not collected by pytest).

    python tests/probe_contract.py [--kills N] [--kill-recipes tiny,tiny_rl,tiny_dpo] [--only-kills]

1. Every numeric config field x {0, -1, NaN, inf, -inf} through ``olmax print-config tiny --set``:
   each must exit 2 with one ``error:`` line naming the field, or exit 0 for a value the field
   accepts (listed, to be judged by reading).
2. Flags of the CLI with nonsense values (0, -1, nan, inf, words) and bad paths, each with and
   without ``--json``: exit 2, one line, no traceback, and strict ``{"error": ...}`` JSON. The
   pre-training commands' flags and, since 2026-12-03, those of generation, ``parity``,
   ``eval kl``, ``compile --step generate``, ``verify trl`` and ``demo rl``, and missing files of
   generation and of the SFT, DPO and RL recipes.
3. ``--kills N [--kill-recipes tiny,tiny_rl,tiny_dpo]``: N trainings of each recipe killed with
   SIGKILL at random points and resumed; each resumed run's metrics (time excepted) and final
   weights must equal an uninterrupted run's bit for bit.
Prints the counts as JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).parent))

from test_train_contract import _numeric_fields  # noqa: E402

from olmax import cli  # noqa: E402
from olmax.config import Config  # noqa: E402
from trainlib import small_overrides, write_corpus  # noqa: E402


def strict(text: str):
    def reject(tok):
        raise ValueError(tok)
    return json.loads(text, parse_constant=reject)


def call(argv: list[str]) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli.main(argv)
        except SystemExit as e:
            rc = e.code
        except BaseException as e:  # a traceback: a bug
            import traceback
            traceback.print_exc(file=err)
            rc = f"traceback {type(e).__name__}"
    return rc, out.getvalue(), err.getvalue()


def _takes_json(argv: list[str]) -> bool:
    p = cli.build_parser()
    for word in argv:
        subs = [a for a in p._actions if a.__class__.__name__ == "_SubParsersAction"]
        if not subs or word not in subs[0].choices:
            break
        p = subs[0].choices[word]
    return any("--json" in a.option_strings for a in p._actions)


def judge(argv: list[str], name: str, counts: dict, accepted: list) -> None:
    for js in ((False, True) if _takes_json(argv) else (False,)):
        rc, out, err = call(argv + (["--json"] if js else []))
        counts["cases"] += 1
        if "Traceback" in err or isinstance(rc, str):
            counts["tracebacks"] += 1
            accepted.append(f"TRACEBACK {argv}: {err.strip().splitlines()[-1]}")
        elif rc == 2:
            lines = [ln for ln in err.splitlines() if "error:" in ln]
            counts["errors"] += 1
            if len(lines) != 1:
                counts["not_one_line"] += 1
            if name not in err:
                counts["not_naming"] += 1
                accepted.append(f"NOT NAMING {name}: {argv}: {lines}")
            if js:
                try:
                    strict(out.strip().splitlines()[-1])["error"]
                except Exception:
                    counts["bad_json"] += 1
        elif rc == 0:
            counts["accepted"] += 1
            if js and out.strip():
                try:
                    strict(out)
                except Exception:
                    counts["bad_json"] += 1
            if not js:
                accepted.append(f"accepted {' '.join(argv[-2:])}")
        else:
            counts["other_exit"] += 1
            accepted.append(f"exit {rc}: {argv}")


def probe_config(counts: dict, accepted: list) -> None:
    for name in _numeric_fields(Config()):
        for v in ("0", "-1", ".nan", ".inf", "-.inf"):
            rc, out, err = call(["print-config", "tiny", "--set", f"{name}={v}"])
            counts["cases"] += 1
            if rc == 2 and name in err and "Traceback" not in err:
                counts["errors"] += 1
            elif rc == 0:
                counts["accepted"] += 1
                accepted.append(f"{name}={v}")
            else:
                counts["tracebacks" if "Traceback" in err else "other_exit"] += 1
                accepted.append(f"BAD {name}={v}: {rc} {err.strip()[-200:]}")


FLAG_CASES = [
    (["inspect", "tiny", "--devices"], "--devices"), (["inspect", "tiny", "--hbm-gib"], "--hbm-gib"),
    (["data", "audit", "tiny", "--epoch"], "--epoch"), (["data", "audit", "tiny", "--processes"], "--processes"),
    (["data", "audit", "tiny", "--workers"], "--workers"),
    (["verify", "resume", "tiny", "--steps"], "--steps"),
    (["verify", "resume", "tiny", "--interrupt-at"], "--interrupt-at"),
    (["verify", "resume", "tiny", "--devices-before"], "--devices-before"),
    (["verify", "resume", "tiny", "--tol"], "--tol"),
    (["eval", "loss", "--checkpoint", "nope", "--data", "nope", "--batches"], "--batches"),
    (["eval", "loss", "--checkpoint", "nope", "--data", "nope", "--token-dtype"], "--token-dtype"),
    (["launch", "local", "tiny", "--backoff"], "--backoff"),
    (["launch", "local", "tiny", "--max-restarts"], "--max-restarts"),
    (["launch", "tpu", "tiny", "--hosts"], "--hosts"), (["launch", "tpu", "tiny", "--num-slices"], "--num-slices"),
]


def post_training_flag_cases(tmp: Path) -> list[tuple[list[str], str]]:
    """The flags of generation and of the tools that take seeds, on a random 2-layer HF model made
    here (an accepted value decodes for real)."""
    from olmax.compat.hf import random_hf_model
    hf = tmp / "hf"
    random_hf_model(hf, seed=0, vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, sliding_window=16,
                    eos_token_id=0, pad_token_id=1, bos_token_id=None)
    ids = tmp / "ids.jsonl"
    ids.write_text("[3, 4, 5]\n")
    gen = ["generate", "--checkpoint", f"hf:{hf}", "--prompt-ids", str(ids), "--max-new-tokens", "2"]
    cases = [(gen + [f], f) for f in ("--max-new-tokens", "--temperature", "--top-p", "--top-k", "--seed",
                                      "--batch-size")]
    cases += [(["parity", "--hf", str(hf), f], f) for f in ("--seed", "--seq-len", "--batch-size")]
    cases += [(["eval", "kl", f"hf:{hf}", f"hf:{hf}", f], f) for f in ("--seed", "--seq-len", "--batch-size")]
    cases += [(["compile", "tiny", "--topology", "v5p-8", "--step", "generate", f], f)
              for f in ("--batch-size", "--max-length")]
    cases += [(["verify", "trl", "--grpo", f], f) for f in ("--steps", "--seed")]
    cases += [(["demo", "rl", f], f) for f in ("--prompts", "--samples", "--sft-steps", "--dpo-steps")]
    return cases


def probe_flags(counts: dict, accepted: list, tmp: Path) -> None:
    for argv, flag in [*FLAG_CASES, *post_training_flag_cases(tmp)]:
        if argv[:2] == ["demo", "rl"]:
            argv = ["demo", "--run-dir", str(tmp / "no-demo"), "rl", flag]  # nothing may be trained
        for v in ("0", "-1", "nan", "inf", "banana"):
            if v == "0" and (argv[:2] == ["verify", "trl"] or flag == "--dpo-steps"):
                continue  # valid (a seed; RL straight from SFT) and would run for minutes
            if flag == "--tol" and v == "0":
                continue  # 0 is bitwise, the default
            if flag in ("--workers",) and v == "0":
                continue  # 0 workers: read in the main process
            if flag in ("--max-restarts", "--backoff") and v == "0":
                continue
            judge(argv + [v], flag, counts, accepted)


def probe_paths(counts: dict, accepted: list, tmp: Path) -> None:
    bad = tmp / "missing"
    empty_mix = tmp / "empty.txt"
    empty_mix.write_text("")
    binary = tmp / "bin.yaml"
    binary.write_bytes(bytes(range(256)))
    cases = [
        (["train", "tiny", "--run-dir", str(tmp / "r1"), "--set", f"data.paths={bad}"], str(bad)),
        (["train", "tiny", "--run-dir", str(tmp / "r2"), "--set", f"data.paths={empty_mix}"], str(empty_mix)),
        (["train", str(binary)], str(binary)),
        (["eval", "loss", "--checkpoint", str(bad), "--data", str(bad)], str(bad)),
        (["eval", "kl", str(bad), str(bad)], str(bad)),
        (["launch", "status", "--run-dir", str(bad)], str(bad)),
        (["convert", "hf-to-olmax", "--hf", str(bad), "--out", str(tmp / "o")], str(bad)),
        (["data", "audit", str(bad) + ".yaml"], str(bad)),
        (["generate", "--checkpoint", str(bad), "--prompt", "hi"], str(bad)),
        (["generate", "--checkpoint", f"hf:{tmp / 'hf'}", "--prompt-ids", str(bad)], str(bad)),
        (["chat", "--checkpoint", str(bad)], str(bad)),
        (["train", "tiny_rl", "--run-dir", str(tmp / "r3"), "--set", f"rl.prompts_path={bad}"], str(bad)),
        (["train", "tiny_dpo", "--run-dir", str(tmp / "r4"), "--set", f"data.preference_path={bad}"], str(bad)),
        (["train", "tiny_sft", "--run-dir", str(tmp / "r5"), "--set", f"data.paths={bad}"], str(bad)),
        (["demo", "--run-dir", str(tmp / "no-demo"), "rl", "--from", str(bad)], str(bad)),
    ]
    for argv, name in cases:
        judge(argv, name, counts, accepted)


# Metrics that measure time, not what was trained: they differ between any two runs.
VOLATILE = ("throughput/device", "throughput/MFU", "rl/generation_share", "rl/generation_tokens_per_sec",
            "rl/time_")


STEPS = 12


def kill_settings(recipe: str, tmp: Path) -> list[str]:
    """The overrides of a small run of ``recipe``: ``STEPS`` updates, a checkpoint every 2 or 3."""
    if recipe == "tiny":
        return small_overrides(write_corpus(tmp / "corpus"), f"train.steps={STEPS}", "checkpoint.interval=3")
    if recipe == "tiny_rl":  # killed while sampling, scoring or updating
        from trainlib import rl_overrides, write_rl_data
        return rl_overrides(write_rl_data(tmp / "rl_data"), f"train.steps={STEPS}", "checkpoint.interval=2")
    if recipe == "tiny_dpo":  # killed while computing the reference log-probs or training
        from olmax.data.chat import write_pairs
        from olmax.verify.trl import PARITY_OVERRIDES, make_pairs
        pairs = write_pairs(tmp / "pairs", make_pairs(64, 512, 64, 0, eos=0, pad=1))
        small = [o for o in PARITY_OVERRIDES if not o.startswith(("optim.", "dpo."))]
        return [*small, f"data.preference_path={pairs}", f"train.steps={STEPS}", "checkpoint.interval=3",
                "dpo.reference_batch_size=4"]
    raise ValueError(recipe)


def probe_kills(n: int, tmp: Path, counts: dict, accepted: list, recipes: list[str]) -> None:
    """For each recipe: one uninterrupted run, then ``n`` runs killed with SIGKILL at a random
    point and resumed by the same command: metrics (time excepted) and final weights must equal
    the uninterrupted run's bit for bit."""
    import numpy as np

    from olmax.checkpoint.load import load_params
    from olmax.eval.runs import read_metrics
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    rng = random.Random(0)
    for recipe in recipes:
        overrides = kill_settings(recipe, tmp)
        sets = sum((["--set", o] for o in overrides), [])
        ref = tmp / f"ref_{recipe}"
        cmd = [sys.executable, "-m", "olmax.cli", "train", recipe, "--no-progress", *sets]
        subprocess.run([*cmd, "--run-dir", str(ref)], env=env, check=True, capture_output=True)
        want = read_metrics(ref)
        want_w = [np.asarray(x) for x in jax_leaves(load_params(str(ref))[0])]
        for k in range(n):
            run = tmp / f"kill_{recipe}_{k}"
            p = subprocess.Popen([*cmd, "--run-dir", str(run)], env=env, stdout=subprocess.DEVNULL,
                                 stderr=subprocess.DEVNULL)
            # After a random checkpoint has appeared (a small run spends most of its time starting
            # and compiling), then up to a second more: in a save, a step, sampling or scoring.
            target = rng.choice([0, *range(2, STEPS - 1)])
            t0 = time.perf_counter()
            while p.poll() is None and newest_checkpoint(run) < target and time.perf_counter() - t0 < 600:
                time.sleep(0.02)
            time.sleep(rng.uniform(0, 1))
            if p.poll() is not None:  # finished first: not a kill
                counts["finished_before_kill"] = counts.get("finished_before_kill", 0) + 1
                continue
            p.send_signal(signal.SIGKILL)
            p.wait()
            counts["kills"] += 1
            at = time.perf_counter() - t0  # named in the failure line below (it was an undefined name)
            accepted.append(f"killed {recipe} {at:.1f} s in, newest checkpoint folder: "
                            f"step {newest_checkpoint(run)} of {STEPS}")
            r = subprocess.run([*cmd, "--run-dir", str(run)], env=env, capture_output=True, text=True)
            got = read_metrics(run) if r.returncode == 0 else {}
            same = r.returncode == 0 and sorted(got) == sorted(want) and all(
                got[s][m] == want[s][m] for s in want for m in want[s] if not m.startswith(VOLATILE))
            same = same and all(np.array_equal(a, np.asarray(b))
                                for a, b in zip(want_w, jax_leaves(load_params(str(run))[0])))
            if not same:
                counts["failed_resumes"] += 1
                accepted.append(f"kill {recipe} {k} at {at:.1f} s: rc {r.returncode} {r.stderr[-300:]}")


def newest_checkpoint(run: Path) -> int:
    """The highest step among ``run/checkpoints``' folders, committed or being written (-1: none)."""
    ck = run / "checkpoints"
    steps = [int(c.name.split(".")[0]) for c in ck.iterdir() if c.name.split(".")[0].isdigit()] if ck.is_dir() else []
    return max(steps, default=-1)


def jax_leaves(tree):
    import jax
    return jax.tree.leaves(tree)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--kills", type=int, default=0)
    ap.add_argument("--kill-recipes", default="tiny",
                    help="comma-separated: tiny, tiny_rl, tiny_dpo (--kills runs of each)")
    ap.add_argument("--only-kills", action="store_true", help="skip the config, flag and path probes")
    args = ap.parse_args()
    counts = dict(cases=0, errors=0, accepted=0, tracebacks=0, other_exit=0, not_one_line=0, not_naming=0,
                  bad_json=0, kills=0, failed_resumes=0)
    notes: list[str] = []
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        if not args.only_kills:
            probe_config(counts, notes)
            probe_flags(counts, notes, tmp)
            probe_paths(counts, notes, tmp)
        if args.kills:
            probe_kills(args.kills, tmp, counts, notes, args.kill_recipes.split(","))
    print(json.dumps({"counts": counts, "notes": notes}, indent=1))


if __name__ == "__main__":
    main()
