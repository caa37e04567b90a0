"""``olmax demo sft``, shortened: a tiny pre-training by ``olmax demo`` (few steps, a small corpus),
then SFT on a small chat set built here; the held-out assistant-token loss must go down and the
exit status say so, and a forced no-help run (learning rate 0) must exit 1."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from olmax.cli import main
from olmax.demos.sft import build_chat_set, verdict

# End-to-end runs in child processes: the integration tier (`make test-integration`).
pytestmark = pytest.mark.integration

PRETRAIN = ["--corpus-mb", "0.4", "--set", "train.steps=20", "--set", "eval.interval=20",
            "--set", "checkpoint.interval=20"]
SFT = ["--synthetic", "300", "--max-doc", "60", "--check", "8", "--set", "eval.batch_size=4"]
LOSSES = re.compile(r"held-out loss on assistant tokens: ([0-9.]+) before SFT, ([0-9.]+) after")


def test_chat_set_is_deterministic_and_split_by_prompt() -> None:
    a_train, a_held = build_chat_set(200, max_doc=40)
    b_train, b_held = build_chat_set(200, max_doc=40)
    assert a_train == b_train and a_held == b_held
    prompts = lambda recs: {r["messages"][1]["content"] for r in recs}  # noqa: E731
    assert a_held and not prompts(a_train) & prompts(a_held)
    # The split is a function of the prompt: a bigger set keeps every held-out prompt held out.
    c_train, c_held = build_chat_set(400, max_doc=40)
    assert not prompts(c_train) & prompts(a_held)
    for r in a_train + a_held:
        assert r["messages"][-1] == {"role": "assistant", "content": r["answer"]}
        if r["task"] == "reverse":
            words = r["messages"][1]["content"].split(": ", 1)[1].split()
            assert r["answer"].split() == words[::-1]


def test_verdict() -> None:
    assert verdict(2.0, 1.5) == 0
    assert verdict(2.0, 2.0) == 1 and verdict(2.0, 2.5) == 1


def test_demo_sft_lowers_heldout_loss(tmp_path: Path, capsys) -> None:
    demo = tmp_path / "demo"
    # No demo run there yet: `olmax demo` pre-trains first (shortened), then the SFT stage.
    rc = main(["demo", "--run-dir", str(demo), *PRETRAIN, "sft", *SFT])
    err = capsys.readouterr().err
    assert "running `olmax demo" in err and "tokenize --chat" in err and "exactly right" in err, err
    before, after = map(float, LOSSES.search(err).groups())
    assert after < before and rc == 0, err
    man = json.loads((demo / "sft" / "chat" / "train" / "manifest.json").read_text())
    assert man["format"] == "olmax-chat/1" and man["report"]["trained_tokens"] > 0
    assert (demo / "sft" / "run" / "checkpoints").is_dir()

    # Forced no-help: the same stage from the same weights with a learning rate of 0 changes
    # nothing, so the held-out loss does not go down and the exit status is 1.
    rc = main(["demo", "sft", "--from", str(demo / "run"), "--out", str(tmp_path / "sft0"), *SFT,
               "--set", "optim.lr=0", "--check", "0", "--show", "0"])
    err = capsys.readouterr().err
    before0, after0 = map(float, LOSSES.search(err).groups())
    assert before0 == before and after0 == before0 and rc == 1, err
    assert "did NOT lower" in err
