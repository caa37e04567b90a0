"""``olmax demo rl``'s data and warm start: the task set (deterministic, split by the prompt's
hash, exact answers), the RL prompt files, the standard error's formula, and, shortened, the warm
start from a tiny pre-training (20 steps on 0.4 MB) with held-out accuracy measured three ways."""

from __future__ import annotations

import json
import keyword
import math
from pathlib import Path

import numpy as np
import pytest

from olmax.demos.rl import (
    build_task_set,
    heldout_accuracy,
    mean_se,
    paired_gain,
    preference_record,
    prompt_record,
    read_prompts,
    rl_overrides,
    sample_rewards,
    warm_start,
    write_prompts,
)

# End-to-end runs in child processes: the integration tier (`make test-integration`).
pytestmark = pytest.mark.integration


def _prompts(recs: list[dict]) -> set[str]:
    return {r["messages"][1]["content"] for r in recs}


def test_task_set_is_deterministic_split_by_prompt_and_right() -> None:
    train, held = build_task_set(300)
    assert (train, held) == build_task_set(300)
    assert held and train and not _prompts(train) & _prompts(held)
    assert 0.1 < len(held) / 300 < 0.3
    # The split is a function of the prompt: a bigger set keeps every held-out prompt held out.
    train2, held2 = build_task_set(600)
    assert not _prompts(train2) & _prompts(held)
    for r in train + held:
        q = r["messages"][1]["content"]
        assert q.startswith("How many words: ") and r["answer"] == str(len(q.split(": ", 1)[1].split()))
        assert r["messages"][2] == {"role": "assistant", "content": r["answer"]} and r["task"] == "count"
    assert {r["answer"] for r in train} == {"2", "3", "4", "5", "6"}
    t, h = build_task_set(60, tasks=("first", "alpha", "which"))
    for r in t + h:
        words = r["messages"][1]["content"].split(": ", 1)[1].replace(" or ", " ").split()
        if r["task"] == "which":
            assert keyword.iskeyword(words[int(r["answer"]) - 1]) and sum(map(keyword.iskeyword, words)) == 1
        else:
            assert r["answer"] == (words[0] if r["task"] == "first" else min(words))
    with pytest.raises(ValueError, match="choose from"):
        build_task_set(10, tasks=("nope",))


def test_prompt_files(tmp_path: Path) -> None:
    _, held = build_task_set(100)
    write_prompts(tmp_path / "p.jsonl", held)
    lines = read_prompts(tmp_path / "p.jsonl")
    assert lines == [prompt_record(r) for r in held]
    for line, r in zip(lines, held):
        assert [m["role"] for m in line["messages"]] == ["system", "user"]
        assert line["ground_truth"] == r["answer"] and set(line) == {"messages", "ground_truth"}


def test_preference_pairs_reject_a_neighbouring_count() -> None:
    import random
    train, _ = build_task_set(300)
    rng = random.Random(0)
    pairs = [preference_record(r, rng) for r in train]
    for r, p in zip(train, pairs):
        assert p["prompt"] == prompt_record(r)["messages"] and p["chosen"] == r["answer"]
        assert abs(int(p["rejected"]) - int(r["answer"])) == 1 and 2 <= int(p["rejected"]) <= 6
    # both neighbours are used where both exist
    assert {int(p["rejected"]) - int(p["chosen"]) for p in pairs if p["chosen"] == "4"} == {-1, 1}


def test_standard_error_over_prompts() -> None:
    scores = np.array([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]], float)   # p = 0.5, 1, 0
    m, se = mean_se(scores)
    assert m == pytest.approx(0.5)
    # sqrt(sum (p_i - mean)^2 / (N (N - 1))) = sqrt((0 + 0.25 + 0.25) / 6)
    assert se == pytest.approx(math.sqrt(0.5 / 6))
    assert mean_se(scores[:1]) == (0.5, 0.0)
    after = scores.copy()
    after[0] = 1                                                             # p = 1, 1, 0: gains 0.5, 0, 0
    d, dse = paired_gain(scores, after)
    assert d == pytest.approx(0.5 / 3) and dse == pytest.approx(math.sqrt(((1 / 3) ** 2 + 2 * (1 / 6) ** 2) / 6))


def _encoded(start: dict, prompts: list[dict]) -> list[list[int]]:
    from olmax.chat.codec import TextCodec
    from olmax.recipes import get_recipe
    codec = TextCodec.load(start["tokenizer"], get_recipe("tiny_rl"))
    return [codec.encode_chat(p["messages"]) for p in prompts]


def test_warm_start_and_heldout_accuracy(tmp_path: Path) -> None:
    from olmax.checkpoint.load import load_params
    from olmax.cli import main
    from olmax.recipes import get_recipe
    demo = tmp_path / "demo"
    assert main(["demo", "--run-dir", str(demo), "--corpus-mb", "0.4", "--set", "train.steps=20",
                 "--set", "eval.interval=20", "--set", "checkpoint.interval=20"]) in (0, 1)
    r = warm_start(demo, n=200, steps=3)
    assert r["sft"] == demo / "rl" / "sft" and (r["sft"] / "checkpoints" / "3").is_dir()
    held = read_prompts(r["heldout_prompts"])
    train = read_prompts(r["train_prompts"])
    assert len(held) + len(train) == 200 and not {json.dumps(p) for p in held} & {json.dumps(p) for p in train}
    man = json.loads((r["chat"] / "train" / "manifest.json").read_text())
    assert man["format"] == "olmax-chat/1" and man["report"]["conversations"] == len(train)
    assert warm_start(demo, n=200, steps=3)["sft"] == r["sft"]               # reused: nothing to redo
    cfg = get_recipe("tiny_rl", rl_overrides(r))                            # the RL settings make a valid config
    assert cfg.train.objective == "grpo" and cfg.rl.reward == "exact_match"
    assert cfg.rl.max_prompt_length >= max(len(codec_ids) for codec_ids in _encoded(r, held + train))

    prompts = held[:6]
    s = sample_rewards(str(r["sft"]), prompts, k=3, seed=1)
    assert s.shape == (6, 3) and set(np.unique(s)) <= {0.0, 1.0}
    m, se = heldout_accuracy(r["sft"], prompts, k=3, seed=1)
    assert (m, se) == mean_se(s) and 0 <= m <= 1 and se >= 0
    # The same weights as (params, config) with the tokenizer give the same draw.
    params, cfg = load_params(str(r["sft"]))
    assert np.array_equal(sample_rewards((params, cfg), prompts, k=3, seed=1, tokenizer=r["tokenizer"]), s)
    g = sample_rewards(str(r["sft"]), prompts, k=5, temperature=0)
    assert g.shape == (6, 1)

    # `olmax demo rl` (SFT -> DPO -> RL) with an RL stage that cannot help (lr 0): RL keeps the DPO
    # stage's weights, so the same draws and no gain, exit 1, and the figures on stdout as JSON (the
    # warm start above is reused). Flat groups are kept (rl.filter_zero_std=false): with every reward
    # 0 they would all be dropped, and a run that trains on no token exits 2 instead.
    import contextlib
    import io
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main(["demo", "--run-dir", str(demo), "rl", "--prompts", "200", "--sft-steps", "3", "--dpo-steps", "2",
                   "--set", "optim.lr=0", "--set", "rl.filter_zero_std=false",
                   "--set", "train.steps=2", "--set", "rl.prompts_per_step=2", "--set", "train.global_batch_size=16",
                   "--eval-prompts", "6", "--samples", "3", "--json"])
    out = json.loads(buf.getvalue())
    assert rc == 1 and out["improved"] is False and out["rl_steps"] == 2
    assert out["accuracy_after"] == out["accuracy_after_dpo"] and out["dpo_steps"] == 2
    dpo = demo / "rl" / "dpo"
    assert (dpo / "checkpoints" / "2").is_dir()
    dcfg = get_recipe(str(dpo / "config.yaml"))
    assert dcfg.train.objective == "dpo" and dcfg.train.init_from == f"olmax:{r['sft']}"
    rcfg = get_recipe(str(demo / "rl" / "rl_run" / "config.yaml"))
    assert rcfg.train.init_from == f"olmax:{dpo}"                            # RL starts from the DPO run
    assert sum(1 for _ in open(demo / "rl" / "dpo_pairs.jsonl")) == len(train)
    # CPU devices (one or a mesh): the training forward repeats the kernels' decode arithmetic (README, RL)
    from olmax.model.dispatch import can_reproduce_decode_bits
    assert (out["max_logprob_gap"] == 0.0 if can_reproduce_decode_bits(rcfg.model)
            else 0 <= out["max_logprob_gap"] <= 1e-5)
    assert {"accuracy_before_se", "accuracy_after_se", "greedy_before", "greedy_after"} <= set(out)
